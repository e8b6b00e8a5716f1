"""Every GPU check in one run, each section written to ``$OUT/gpu_check.json`` as soon as it finishes.

Run it through ``benchmarks/gpu_check.sh`` (it sets ``PYTHONPATH`` to the repository root and ``OUT``, default
``./gpu_check_out``), with the machine's own torch and transformers (no install, no package index)::

    bash benchmarks/gpu_check.sh                      # H100/H200: ~2-3 minutes, < 5 min by its budgets
    bash benchmarks/gpu_check.sh --tiny --device cpu  # every section with tiny shapes, seconds, no GPU

Sections, in run order (``--sections`` picks some; docs/engine.md, "GPU check"):

``environment``  device name, Python / torch / transformers / CUDA versions, device and host memory, peak FLOP/s.
``copy``         host<->device copy bandwidth (GB/s = 1e9 bytes/s) of one pool block of the shape at block size
                 16 and 512 tokens and of 64 MiB, from pinned and pageable host memory, H2D and D2H, for the
                 tier work. On the CPU the same copies run host->host (pinned memory needs an accelerator).
``model``        the ``llama-3-8b``-shaped random model (``--tiny``: ``tiny-llama``) built on the device in
                 bf16; parameters, build seconds, the FLOP model.
``verify``       the oracle at the dtype's tolerance (bf16: logits 1e-2 + 5e-2 x max|ref|) on 8 requests
                 (4 documents asked twice) through ``Engine.run(verify=True)``: passed, argmax and greedy
                 agreement, max |dlogit| and |dKV|.
``pool``         blocks and bytes of the KV pool at ``--memory-utilization`` (default 0.9) of device memory,
                 after the weights and the activation peak of a ``--profile-tokens`` forward (vLLM's rule);
                 the pool is allocated to prove it fits (on the CPU: computed, and a 64 MiB pool allocated).
``prefill``      prefill tokens/s, TFLOP/s and MFU of the pool compute at hit fraction 0 / .5 / .9 and batch
                 1 / 8 / 32: batch 1 runs ``PagedModel.forward_tokens``; batch > 1 runs
                 ``forward_batch(entries)`` from ``kvlab.engine.batched`` when that module exists, else the
                 section records ``"batched": "not available"`` and runs batch 1 only.
``ttft``         TTFT vs hit fraction through ``Engine.prefill`` (``kvlab.engine.bench.run_sweep``, as
                 ``benchmarks/gpu_engine.py``): P = 2,048 and 8,192, the transformers baselines, the oracle
                 on the last request of every h.

Each section runs under its own time budget (``SECTION_BUDGETS_S``, ``--section-timeout NAME=SECONDS``) and
all of them under ``--budget-s`` (default 285 s from process start): a section over its budget is stopped
(``SIGALRM``), recorded as ``"status": "timeout"`` and the next one runs. The JSON is rewritten atomically
(temporary file + rename) before and after every section, so an external ``timeout``/kill keeps every
finished section (a section being run shows ``"status": "running"``; SIGTERM records it as ``killed``).
Exit status 0 when every section that ran is ``ok``, 1 otherwise (and 143 after SIGTERM).
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the overall budget counts from here (imports included)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_engine import _plain, environment, peak_flops, verify_workload  # noqa: E402  (puts the repo on sys.path)

from kvlab.engine import Engine, PagedModel, build_random_model, sync_device  # noqa: E402
from kvlab.engine.bench import (  # noqa: E402
    HIT_FRACTIONS,
    FlopModel,
    format_table,
    hit_tokens_for,
    run_sweep,
    summarize_sweep,
    sweep_blocks,
)
from kvlab.engine.kv_pool import KVLayout  # noqa: E402
from kvlab.engine.model import cache_from_kv, forward_logits, resolve_device, resolve_dtype, shape_config  # noqa: E402
from kvlab.engine.verify import Tolerance  # noqa: E402

SECTIONS = ("environment", "copy", "model", "verify", "pool", "prefill", "ttft")
NEEDS_MODEL = {"verify", "pool", "prefill", "ttft"}
SECTION_BUDGETS_S = {"environment": 15.0, "copy": 45.0, "model": 90.0, "verify": 60.0, "pool": 45.0,
                     "prefill": 90.0, "ttft": 120.0}  # seconds each; the overall --budget-s caps their sum
PREFILL_HITS = (0.0, 0.5, 0.9)
BATCHES = (1, 8, 32)
MIB = 1 << 20
CPU_POOL_CAP_BYTES = 64 * MIB


class SectionTimeout(BaseException):
    """Raised by SIGALRM when a section runs past its budget (a BaseException: no ``except Exception`` in the
    code under test swallows it)."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (wall) unless the block ends first.
    The signal is handled between Python bytecodes, i.e. once the running torch op returns; it repeats every
    second after that, in case a ``__del__`` or callback that happened to be running swallowed it."""

    def fire(signum: int, frame: object) -> None:
        raise SectionTimeout(f"over its budget of {seconds:.3g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, old)


class _Run:
    """The report and the section being run, for the SIGTERM handler."""

    report: Report | None = None
    section: str = ""
    started: float = 0.0


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (an external ``timeout``): record the running section as ``killed`` and exit with 143 at once.
    Writing here is safe: the handler runs between bytecodes and never during a write (they hold SIGTERM).
    A section whose final entry is already written is left as it is."""
    rep, name = _Run.report, _Run.section
    if rep is not None and name:
        entry = rep.data["sections"].get(name)
        if entry is None or entry.get("status") == "running":
            rep.record(name, {**(entry or {}), "status": "killed", "error": f"signal {signum}",
                              "elapsed_s": time.perf_counter() - _Run.started})
    print(f"\n## {name or 'gpu_check'}: killed (signal {signum}); report kept", flush=True)
    sys.stderr.flush()
    os._exit(143)


def _finite(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None (strict JSON), recursively through dicts and lists."""
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _finite(obj.tolist())
    if isinstance(obj, np.integer | np.bool_):
        return obj.item()
    return obj


class Report:
    """The JSON report at ``path``: run metadata plus one entry per section, rewritten atomically."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data: dict = {"kind": "kvlab.gpu_check", "version": 1, **meta, "sections": {}, "complete": False}
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        """Write to a temporary file in the same directory, then rename it over the report (atomic on POSIX).
        SIGTERM and SIGALRM are held meanwhile (delivered after the rename), so no report is half-replaced."""
        self.data["elapsed_s"] = time.perf_counter() - START
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        held = {signal.SIGTERM, signal.SIGALRM}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            tmp.write_text(json.dumps(_finite(self.data), indent=1, default=_plain, allow_nan=False) + "\n")
            os.replace(tmp, self.path)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def record(self, name: str, entry: dict) -> None:
        self.data["sections"][name] = entry
        self.write()


@dataclasses.dataclass
class Context:
    """What the sections share: the parsed arguments, the device, and the model once built."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    shape: str
    threads: int | None
    peak: float | None = None
    peak_source: str = ""
    model: torch.nn.Module | None = None
    flops: FlopModel | None = None

    def layout(self, block_size: int) -> KVLayout:
        """The pool layout of the shape at ``block_size`` tokens per block (from the config: no model needed)."""
        cfg = shape_config(self.shape)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        return KVLayout(int(cfg.num_hidden_layers), kv_heads, head_dim, int(block_size), self.dtype)


# ---------------------------------------------------------------------------------------------- memory
def host_memory() -> dict:
    """Host memory in bytes: ``total`` (physical) and ``available`` (``MemAvailable`` where /proc has it)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return {"total_bytes": int(total), "available_bytes": available}


def device_memory(device: torch.device) -> dict:
    """Device memory in bytes: ``total`` and ``free`` (CUDA: ``mem_get_info``, every process), torch's
    ``allocated`` / ``reserved``; the host's on the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"total_bytes": int(total), "free_bytes": int(free),
                "allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "reserved_bytes": int(torch.cuda.memory_reserved(device))}
    host = host_memory()
    return {"total_bytes": host["total_bytes"], "free_bytes": host["available_bytes"]}


def release_memory(device: torch.device) -> None:
    """Return cached blocks to the driver so the next section starts from the weights only."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- sections
def section_environment(ctx: Context) -> dict:
    """Versions, device and host memory, the peak FLOP/s used for MFU."""
    env = environment(ctx.device)
    return {**env, "device_memory": device_memory(ctx.device), "host_memory": host_memory(),
            "peak_flops": ctx.peak, "peak_source": ctx.peak_source, "shape": ctx.shape,
            "dtype": str(ctx.dtype).removeprefix("torch."), "argv": sys.argv[1:]}


def copy_sizes(ctx: Context) -> list[tuple[str, int]]:
    """(label, bytes): one pool block of the shape at 16 and at 512 tokens, and 64 MiB."""
    return [("block_16", ctx.layout(16).bytes_per_block), ("block_512", ctx.layout(512).bytes_per_block),
            ("64MiB", 64 * MIB)]


def time_copies(dst: torch.Tensor, src: torch.Tensor, device: torch.device, *, iters: int, trials: int,
                non_blocking: bool) -> list[float]:
    """Seconds per ``dst.copy_(src)`` in each of ``trials`` timed loops of ``iters`` copies (after 2 warm-up
    copies); CUDA events time the device stream, ``perf_counter`` the CPU."""
    for _ in range(2):
        dst.copy_(src, non_blocking=non_blocking)
    sync_device(device)
    out = []
    for _ in range(trials):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(iters):
                dst.copy_(src, non_blocking=non_blocking)
            end.record()
            end.synchronize()
            out.append(begin.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src, non_blocking=non_blocking)
            out.append((time.perf_counter() - t0) / iters)
    return out


def section_copy(ctx: Context) -> dict:
    """Host<->device copy bandwidth (module docstring). Rows: ``size`` label, ``bytes``, ``host_memory``
    (pinned / pageable), ``direction`` (h2d / d2h), ``gbps`` (best trial, 1e9 bytes/s), ``gbps_median``,
    ``us_per_copy`` (best, microseconds), ``iters`` per trial."""
    dev = ctx.device
    target = (256 if ctx.args.tiny else 1024) * MIB  # bytes moved per trial
    kinds = ["pageable"]
    pinned: str | bool = False
    if dev.type == "cuda":
        kinds.insert(0, "pinned")
        pinned = True
    else:
        pinned = "not available: pinned host memory needs an accelerator; host->host copies of pageable memory"
    rows = []
    for label, size in copy_sizes(ctx):
        iters = int(min(max(math.ceil(target / size), 3), 2000))
        device_buf = torch.empty(size, dtype=torch.uint8, device=dev)
        for kind in kinds:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=kind == "pinned")
            host.fill_(1)
            device_buf.fill_(2)
            for direction, dst, src in (("h2d", device_buf, host), ("d2h", host, device_buf)):
                secs = time_copies(dst, src, dev, iters=iters, trials=3, non_blocking=kind == "pinned")
                best, med = min(secs), float(np.median(secs))
                rows.append({"size": label, "bytes": size, "host_memory": kind, "direction": direction,
                             "gbps": size / best / 1e9, "gbps_median": size / med / 1e9,
                             "us_per_copy": best * 1e6, "iters": iters})
            del host
        del device_buf
    for r in rows:
        print(f"  {r['size']:>9} {r['bytes'] / MIB:8.2f} MiB {r['host_memory']:>8} {r['direction']}: "
              f"{r['gbps']:7.2f} GB/s ({r['us_per_copy']:.1f} us)")
    return {"pinned": pinned, "host_to_host": dev.type != "cuda", "rows": rows,
            "note": "GB/s = 1e9 bytes/s; best of 3 trials; h2d = host to device, d2h = device to host"}


def section_model(ctx: Context) -> dict:
    """Build the random model on the device (kept in ``ctx`` for the later sections)."""
    t0 = time.perf_counter()
    model = build_random_model(ctx.shape, seed=ctx.args.seed, dtype=ctx.dtype, device=ctx.device)
    sync_device(ctx.device)
    build_s = time.perf_counter() - t0
    ctx.model, ctx.flops = model, FlopModel.from_model(model)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"  {ctx.shape}: {n_params / 1e9:.2f} B parameters, {weight_bytes / 2**30:.2f} GiB, built in {build_s:.1f} s")
    return {"shape": ctx.shape, "parameters": n_params, "weight_bytes": weight_bytes, "build_s": build_s,
            "flop_model": ctx.flops.to_dict(), "device_memory": device_memory(ctx.device)}


def section_verify(ctx: Context) -> dict:
    """The oracle on 8 requests (4 random documents asked two questions: the second hits the first)."""
    bs = ctx.args.block_size
    doc = 64 if ctx.args.tiny else 1024
    engine = Engine(ctx.model, capacity_blocks=-(-(doc + 16) // bs) * 8 + 8, block_size=bs, device=ctx.device,
                    num_threads=ctx.threads)
    res = engine.run(verify_workload(engine.vocab_size, doc, 4, ctx.args.seed), verify=True, verify_tokens=4)
    f, s = res.requests, res.summary
    out = {key: s[key] for key in ("verified_requests", "verify_failures", "verify_max_logit_abs",
                                   "verify_max_logit_rel", "verify_max_kv_abs", "verify_argmax_agreement",
                                   "verify_greedy_agreement", "token_hit_rate")}
    tol = Tolerance.for_dtypes(engine.model_dtype, engine.layout.dtype)
    out.update(passed=int(s["verify_failures"]) == 0 and int(s["verified_requests"]) > 0,
               tolerance=dataclasses.asdict(tol), document_tokens=doc, hit_blocks=f["hit_blocks"].tolist(),
               logit_max_abs=f["verify_logit_max_abs"].tolist(), logit_allowed=f["verify_logit_allowed"].tolist(),
               kv_max_abs=f["verify_kv_max_abs"].tolist())
    print(f"  {out['verified_requests'] - out['verify_failures']}/{out['verified_requests']} passed, max |dlogit| "
          f"{out['verify_max_logit_abs']:.3g} (allowed {min(out['logit_allowed']):.3g}+), max |dKV| "
          f"{out['verify_max_kv_abs']:.3g}, argmax agreement {out['verify_argmax_agreement']}")
    if not out["passed"]:
        out["status"] = "failed"
    return out


def section_pool(ctx: Context) -> dict:
    """The KV pool the device holds at ``--memory-utilization``: ``utilization x total - in use (weights, CUDA
    context, other processes) - activation peak of one --profile-tokens forward``, in blocks of 16 and 512
    tokens. On CUDA the pool is allocated (``PagedModel(capacity_bytes=...)``) to prove it fits."""
    dev, model, args = ctx.device, ctx.model, ctx.args
    tokens = args.profile_tokens or (512 if args.tiny else 8192)
    release_memory(dev)
    ids = torch.randint(0, int(model.config.vocab_size), (1, tokens), device=dev)
    pos = torch.arange(tokens, device=dev).view(1, -1)
    activation = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    with torch.no_grad():
        forward_logits(model, ids, pos, cache_from_kv(None, 0))
    sync_device(dev)
    if dev.type == "cuda":
        activation = int(torch.cuda.max_memory_allocated(dev) - base)
    release_memory(dev)
    mem = device_memory(dev)
    total, free = mem["total_bytes"], mem["free_bytes"]
    in_use = total - free if free is not None else 0
    pool_bytes = int(args.memory_utilization * total - in_use - (activation or 0))
    out: dict = {"memory_utilization": args.memory_utilization, "total_bytes": total, "in_use_bytes": in_use,
                 "profile_tokens": tokens, "activation_peak_bytes": activation, "pool_bytes": max(pool_bytes, 0),
                 "block_sizes": {}}
    if dev.type != "cuda":
        out["note"] = "CPU: host memory, activation peak not measured; a pool capped at 64 MiB is allocated"
    for bs in sorted({16, 512, args.block_size}):
        lay = ctx.layout(bs)
        blocks = max(pool_bytes, 0) // lay.bytes_per_block
        out["block_sizes"][str(bs)] = {"bytes_per_block": lay.bytes_per_block, "blocks": int(blocks),
                                       "bytes": int(blocks * lay.bytes_per_block), "tokens": int(blocks * bs)}
    bs = args.block_size
    want = out["block_sizes"][str(bs)]["bytes"]
    if dev.type != "cuda":
        want = min(want, CPU_POOL_CAP_BYTES)
    if want >= ctx.layout(bs).bytes_per_block:
        t0 = time.perf_counter()
        pm = PagedModel(model, capacity_bytes=want, block_size=bs, device=dev, num_threads=ctx.threads)
        sync_device(dev)
        out.update(allocated_blocks=pm.capacity_blocks, allocated_bytes=pm.capacity_bytes,
                   allocate_s=time.perf_counter() - t0, free_after_bytes=device_memory(dev)["free_bytes"])
        del pm
        release_memory(dev)
    else:
        out.update(allocated_blocks=0, allocated_bytes=0)
        out["status"] = "failed"
        out["error"] = "no block fits in the memory left at this utilisation"
    for b, v in out["block_sizes"].items():
        print(f"  block {b:>3}: {v['blocks']} blocks, {v['bytes'] / 2**30:.2f} GiB, {v['tokens']:,} tokens")
    return out


@dataclasses.dataclass
class Batched:
    """``kvlab.engine.batched``'s ``PagedModel.forward_batch`` and its entry type, or why they are missing."""

    entry: type | None = None
    status: str = "not available"

    @property
    def available(self) -> bool:
        return self.entry is not None


def resolve_batched() -> Batched:
    """``BatchEntry`` and ``PagedModel.forward_batch`` if ``kvlab.engine.batched`` exists at run time (an older
    tree has neither: batch > 1 is then not measured)."""
    try:
        from kvlab.engine.batched import BatchEntry
    except ModuleNotFoundError as e:
        if e.name == "kvlab.engine.batched":
            return Batched(status="not available")
        return Batched(status=f"not available: importing kvlab.engine.batched failed: {e!r}")
    except Exception as e:  # a half-written module must not stop the check
        return Batched(status=f"not available: importing kvlab.engine.batched failed: {e!r}")
    if not callable(getattr(PagedModel, "forward_batch", None)):
        return Batched(status="not available: PagedModel has no forward_batch")
    return Batched(BatchEntry, "kvlab.engine.batched: PagedModel.forward_batch")


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(result, wall seconds) of ``fn()``, device-synchronised before and after."""
    sync_device(device)
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - t0


def section_prefill(ctx: Context) -> dict:
    """Prefill throughput of the pool compute: one document of P tokens stored in blocks ``0 ..``; per hit
    fraction h, each of ``batch`` sequences reuses its first ``n = hit_tokens_for(h, P, bs)`` tokens and
    computes ``P - n`` fresh tokens into blocks of its own. Batch 1 runs ``PagedModel.forward_tokens`` (the
    engine's path: gather the hit blocks into a working cache, forward, write the pool); batch > 1 one
    ``forward_batch`` of all sequences (only when ``kvlab.engine.batched`` exists).

    Rows per (h, batch): ``time_s`` (best of ``repeats``, wall seconds, device-synchronised), ``median_s``,
    ``tokens_per_s`` = batch x (P - n) / time_s, ``effective_tokens_per_s`` = batch x P / time_s, ``gflop``
    = batch x F(n, P) / 1e9, ``tflops`` = batch x F(n, P) / time_s / 1e12, ``mfu`` = that / peak FLOP/s.
    Batch > 1 adds ``sequential_s`` (best time of the same sequences through ``forward_tokens`` one by
    one), ``batched_speedup`` = sequential_s / time_s, and the batched logits against the sequential ones:
    ``vs_sequential_max_logit_abs``, ``vs_sequential_allowed`` (the dtype's oracle tolerance: atol + rtol x
    max |sequential|), ``vs_sequential_argmax_agreement`` (share of sequences with the same top-1 token)."""
    args, dev, model = ctx.args, ctx.device, ctx.model
    p, bs = args.prefill_tokens or (256 if args.tiny else 2048), args.block_size
    repeats = args.repeats or (2 if args.tiny else 3)
    warmup = args.warmup if args.warmup is not None else 1
    batched = resolve_batched()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    requested = sorted(set(args.batches))
    batches = requested if batched.available else [1]
    per_seq = -(-p // bs)
    pm = PagedModel(model, capacity_blocks=per_seq * (1 + max(batches)), block_size=bs, device=dev,
                    num_threads=ctx.threads)
    tol = Tolerance.for_dtypes(pm.model_dtype, pm.layout.dtype)
    rng = np.random.default_rng(args.seed)
    doc = rng.integers(0, pm.vocab_size, p, dtype=np.int64)
    pm.forward_tokens(doc, list(range(per_seq)), 0)
    rows, failed = [], False

    def sequential(seqs: list, n: int, pm: PagedModel = pm) -> list[torch.Tensor]:
        return [pm.forward_tokens(toks, ids, n)[0] for toks, ids in seqs]

    def together(entries: list, pm: PagedModel = pm) -> list[torch.Tensor]:
        return pm.forward_batch(entries)

    for frac in args.prefill_hits:
        n = hit_tokens_for(frac, p, bs)
        work = ctx.flops.prefill_flops(n, p)
        for b in batches:
            hit_ids = list(range(n // bs))
            seqs = [(rng.integers(0, pm.vocab_size, p - n, dtype=np.int64),
                     hit_ids + list(range(per_seq * (i + 1) + n // bs, per_seq * (i + 2)))) for i in range(b)]
            row: dict = {"fraction": float(frac), "batch": b, "prompt_tokens": p, "hit_tokens": n,
                         "computed_tokens": b * (p - n), "method": "forward_tokens" if b == 1 else "forward_batch"}
            if b == 1:
                def fn(seqs: list = seqs, n: int = n) -> list[torch.Tensor]:
                    return sequential(seqs, n)
            else:
                entries = [batched.entry(block_ids=ids, start=n, tokens=toks) for toks, ids in seqs]

                def fn(entries: list = entries) -> list[torch.Tensor]:
                    return together(entries)
            try:
                runs = [_timed(fn, dev) for _ in range(warmup + repeats)][warmup:]
                times = [t for _, t in runs]
                best = min(times)
                row.update(time_s=best, median_s=float(np.median(times)), tokens_per_s=b * (p - n) / best,
                           effective_tokens_per_s=b * p / best, gflop=b * work / 1e9,
                           tflops=b * work / best / 1e12)
                if ctx.peak:
                    row["mfu"] = b * work / best / ctx.peak
                if b > 1:
                    seq = [_timed(lambda seqs=seqs, n=n: sequential(seqs, n), dev) for _ in range(max(1, repeats - 1))]
                    ref = torch.stack([x.float() for x in seq[-1][0]])
                    got = torch.stack([x.float() for x in runs[-1][0]])
                    diff = float((got - ref).abs().max())
                    allowed = tol.logit_atol + tol.logit_rtol * float(ref.abs().max())
                    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                    seq_s = min(t for _, t in seq)
                    row.update(sequential_s=seq_s, batched_speedup=seq_s / best, vs_sequential_max_logit_abs=diff,
                               vs_sequential_allowed=allowed, vs_sequential_argmax_agreement=agree)
                    failed |= diff > allowed
            except Exception as e:  # e.g. out of memory at batch 32: recorded, the next batch still runs
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                failed = True
                rows.append(row)
                release_memory(dev)
                continue
            rows.append(row)
            extra = (f", {row['batched_speedup']:.2f}x sequential, max |dlogit| "
                     f"{row['vs_sequential_max_logit_abs']:.3g}" if b > 1 else "")
            print(f"  h={frac:.2f} batch {b:>2}: {1e3 * best:8.1f} ms, {row['tokens_per_s']:10.0f} tok/s, "
                  f"{row['tflops']:7.2f} TFLOP/s, MFU {100 * row.get('mfu', float('nan')):.1f} %{extra}")
    out: dict = {"batched": batched.status, "batches": batches, "requested_batches": requested,
                 "prompt_tokens": p, "block_size": bs, "repeats": repeats, "warmup": warmup,
                 "tolerance": dataclasses.asdict(tol), "rows": rows}
    if not batched.available:
        out["note"] = "no batched forward at run time: batch > 1 not measured"
    if dev.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    if failed:
        out["status"] = "failed"
    del pm
    release_memory(dev)
    return out


def section_ttft(ctx: Context) -> dict:
    """TTFT vs hit fraction through ``Engine.prefill`` (``kvlab.engine.bench``), per prompt length."""
    args, dev = ctx.args, ctx.device
    lengths = args.prompt_tokens or ([256] if args.tiny else [2048, 8192])
    repeats = args.repeats or (2 if args.tiny else 3)
    warmup = args.warmup if args.warmup is not None else 1
    sweeps = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)  # not the pool section's full-memory pool
    for p in lengths:
        engine = Engine(ctx.model, capacity_blocks=sweep_blocks(p, args.block_size, args.hits),
                        block_size=args.block_size, device=dev, num_threads=ctx.threads)
        rows = run_sweep(engine, p, args.hits, repeats=repeats, warmup=warmup, seed=args.seed, verify=True,
                         baselines=not args.no_hf)
        table = summarize_sweep(rows, ctx.flops, peak_flops=ctx.peak)
        print(f"  P = {p}, best of {repeats}, pool {engine.capacity_bytes / 2**30:.2f} GiB")
        print("  " + format_table(table, cpu_time=dev.type == "cpu").replace("\n", "\n  "))
        sweeps.append({"prompt_tokens": p, "pool_bytes": engine.capacity_bytes, "table": table.to_dict("records")})
        del engine
        release_memory(dev)
    passed = all(bool(t.get("verify_passed", True)) for sw in sweeps for t in sw["table"])
    out = {"repeats": repeats, "warmup": warmup, "hits": list(args.hits), "sweeps": sweeps, "verify_passed": passed}
    if dev.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    if not passed:
        out["status"] = "failed"
    return out


RUNNERS: dict[str, Callable[[Context], dict]] = {
    "environment": section_environment, "copy": section_copy, "model": section_model, "verify": section_verify,
    "pool": section_pool, "prefill": section_prefill, "ttft": section_ttft,
}


# ---------------------------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny-llama and short prompts: every section in seconds")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default=None, help="model shape (default llama-3-8b; tiny-llama with --tiny)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=285.0, help="overall wall budget in seconds from start")
    ap.add_argument("--section-timeout", action="append", default=[], metavar="NAME=SECONDS",
                    help="override one section's budget (repeatable), e.g. prefill=60")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs only)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU, in TFLOP/s")
    ap.add_argument("--memory-utilization", type=float, default=0.9, help="share of device memory for the pool")
    ap.add_argument("--profile-tokens", type=int, default=None, help="pool: activation profile tokens (8192)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill: prompt tokens (2048; --tiny 256)")
    ap.add_argument("--prefill-hits", type=float, nargs="+", default=list(PREFILL_HITS))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="ttft: 2048 8192 (--tiny: 256)")
    ap.add_argument("--hits", type=float, nargs="+", default=list(HIT_FRACTIONS), help="ttft: hit fractions")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1)")
    ap.add_argument("--no-hf", action="store_true", help="ttft: skip the transformers baselines")
    ap.add_argument("--out", default=None, help="JSON path or folder (default $OUT/gpu_check.json)")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen]
    budgets = dict(SECTION_BUDGETS_S)
    for item in args.section_timeout:
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            ap.error(f"--section-timeout wants NAME=SECONDS with NAME in {', '.join(SECTIONS)}, got {item!r}")
        budgets[name] = float(value)
    args.budgets = budgets
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections in order; return the exit status (module docstring)."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    shape = args.shape or ("tiny-llama" if args.tiny else "llama-3-8b")
    threads = args.threads if device.type == "cpu" else None
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or "gpu_check_out")
    if out.suffix != ".json":
        out = out / "gpu_check.json"
    ctx = Context(args, device, dtype, shape, threads)
    ctx.peak, ctx.peak_source = peak_flops(device, args.peak_tflops)
    report = Report(out, {"shape": shape, "device": str(device), "budget_s": args.budget_s,
                          "section_budgets_s": {s: args.budgets[s] for s in args.sections},
                          "args": {k: v for k, v in vars(args).items() if k != "budgets"}})
    _Run.report = report
    signal.signal(signal.SIGTERM, _terminate)
    report.write()
    print(f"gpu_check: {shape} on {device}, sections {', '.join(args.sections)}, budget {args.budget_s:.0f} s "
          f"-> {out}")
    status = 0
    for name in args.sections:
        status |= run_section(name, ctx, report)
    _Run.section = ""
    report.data["complete"] = True
    report.write()
    print(f"\nwritten {out} ({time.perf_counter() - START:.1f} s)")
    return status


def run_section(name: str, ctx: Context, report: Report) -> int:
    """Run one section under its budget and record it (before, as running, and after); 0 when ``ok``, else 1.
    ``_Run.section`` names it meanwhile, for the SIGTERM handler."""
    args = ctx.args
    left = args.budget_s - (time.perf_counter() - START)
    budget = min(args.budgets[name], left)
    entry: dict = {"budget_s": budget}
    if name in NEEDS_MODEL and ctx.model is None:
        entry.update(status="skipped", reason="no model (the model section did not run or failed)")
    elif budget <= 0:
        entry.update(status="skipped", reason="overall budget spent")
    if entry.get("status") == "skipped":
        report.record(name, entry)
        print(f"\n## {name}: skipped ({entry['reason']})")
        return 1
    _Run.section, _Run.started = name, time.perf_counter()
    report.record(name, {**entry, "status": "running"})
    print(f"\n## {name} (budget {budget:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        with alarm(budget):
            result = RUNNERS[name](ctx)
        entry = {"status": "ok", **entry, **result}
    except SectionTimeout as e:
        entry.update(status="timeout", error=str(e))
    except Exception as e:
        entry.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                     traceback=traceback.format_exc()[-4000:])
    entry["elapsed_s"] = time.perf_counter() - t0
    if entry["status"] != "ok":
        release_memory(ctx.device)
    report.record(name, entry)
    print(f"## {name}: {entry['status']} in {entry['elapsed_s']:.1f} s"
          + (f" ({entry['error']})" if "error" in entry else ""), flush=True)
    return 0 if entry["status"] == "ok" else 1

if __name__ == "__main__":
    sys.exit(main())
