"""Real-engine prefill on a CUDA GPU: prefill tokens/s, MFU and TTFT vs prefix-hit fraction on a
Llama-3-8B-shaped random model in bf16, plus the cached-vs-uncached oracle at bf16 tolerance.

One short script, run from the source tree (no install; it puts the repository root on ``sys.path`` if
``kvlab`` is not importable), with the GPU machine's own stack (tested against Python 3.11-3.12, torch
2.11-2.13, transformers 5.17-5.24; needs numpy, pandas, pyarrow, numba, xxhash, tqdm, as kvlab does)::

    PYTHONPATH=. python benchmarks/gpu_engine.py                      # H100/H200: ~1-2 minutes
    PYTHONPATH=. python benchmarks/gpu_engine.py --tiny --device cpu  # smoke test, seconds, no GPU

What it does (``kvlab.engine.bench`` has the workload and the FLOP model):

1. builds ``llama-3-8b`` (32 layers, hidden 4096, 32 / 8 heads, vocabulary 128,256; 8.0 B parameters)
   with seeded random weights **created directly on the GPU** in bf16 (``--tiny``: ``tiny-llama``);
2. per prompt length (default 2,048 and 8,192 tokens; ``--tiny``: 256): an engine with block size 16 and
   an LRU pool of ``(2 len(h) + 2) x P / 16`` blocks, a random document prefilled once, then ``--repeats``
   rounds of requests hitting ``h`` in {0, .25, .5, .75, .9} of the prompt (whole blocks) after warm-up
   rounds; TTFT = the engine's ``prefill`` call, CUDA-synchronised before and after each timed phase.
   Printed per h: best-of-N TTFT and median, prefill tokens/s (computed tokens / TTFT), speedup over
   h = 0, the FLOP ideal F(0,P)/F(s,P) and 1/(1-h), bookkeeping share (hash, lookup, gather, scatter),
   achieved TFLOP/s and **MFU** = F(s, P) / TTFT / peak, and the transformers baselines (plain, and a
   deep-copied prefix DynamicCache);
3. the oracle (bf16 tolerance: logits 1e-2 + 5e-2 x max|ref|) on the last request of every h, and on a
   small shared-prefix workload through ``Engine.run(verify=True)``; prints the max logit / K/V diffs.

Peak FLOP/s for MFU: ``--peak-tflops``, else the shipped hardware profile matching
``torch.cuda.get_device_name()`` (H100 / H200: 989.4 dense bf16 TFLOP/s; ``kvlab/data/hardware``), else
``cpu-local`` on the CPU. Results go to ``$OUT/gpu_engine.json`` when ``OUT`` is set, else
``results/gpu_engine.json`` (``--out`` overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import kvlab  # noqa: F401
except ImportError:  # run from the source tree without PYTHONPATH
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kvlab.engine import Engine, build_random_model  # noqa: E402
from kvlab.engine.bench import (  # noqa: E402
    HIT_FRACTIONS,
    FlopModel,
    format_table,
    run_sweep,
    summarize_sweep,
    sweep_blocks,
)
from kvlab.engine.model import resolve_device, resolve_dtype  # noqa: E402
from kvlab.workload.workload import Workload, from_lists  # noqa: E402

PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"), ("L40S", "l40s"), ("4090", "rtx-4090"))


def peak_flops(device: torch.device, flag: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from): the flag, else the shipped profile for the device name."""
    if flag:
        return flag * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = next((p for key, p in PROFILES if key in name.upper()), None)
    else:
        profile = "cpu-local"
    if profile is None:
        return None, "unknown device: pass --peak-tflops"
    try:
        from kvlab.profiles import load_hardware

        return float(load_hardware(profile).peak_flops), f"kvlab hardware profile {profile}"
    except Exception:  # the simulator package unimportable here: read the shipped JSON directly
        data = json.loads((ROOT / "kvlab" / "data" / "hardware" / f"{profile}.json").read_text())
        return float(data["peak_flops"]), f"kvlab/data/hardware/{profile}.json"


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                   gpu_memory_bytes=int(props.total_memory), cuda=torch.version.cuda)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def _plain(obj: object) -> object:
    """JSON for numpy scalars and arrays (everything else in the results is plain Python)."""
    if isinstance(obj, np.generic | np.ndarray):
        return obj.tolist()
    return str(obj)


def verify_workload(vocab: int, doc_tokens: int, docs: int, seed: int) -> Workload:
    """``docs`` random documents, each asked two different questions (the second one hits the first's
    blocks), for ``Engine.run(verify=True)``."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(docs):
        doc = rng.integers(0, vocab, doc_tokens)
        prompts += [np.r_[doc, rng.integers(0, vocab, 7)], np.r_[doc, rng.integers(0, vocab, 13)]]
    return from_lists(prompts, arrival=np.arange(len(prompts), dtype=float))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny-llama, 256-token prompts: a smoke test in seconds")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default=None, help="model shape (default llama-3-8b; tiny-llama with --tiny)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="default 2048 8192 (--tiny: 256)")
    ap.add_argument("--hits", type=float, nargs="+", default=list(HIT_FRACTIONS))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; --tiny: 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2; --tiny: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs only)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU, in TFLOP/s")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_engine.json or results/)")
    args = ap.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    shape = args.shape or ("tiny-llama" if args.tiny else "llama-3-8b")
    lengths = args.prompt_tokens or ([256] if args.tiny else [2048, 8192])
    repeats = args.repeats or (2 if args.tiny else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    env = environment(device)
    peak, peak_source = peak_flops(device, args.peak_tflops)
    print("environment:", json.dumps(env))
    print(f"peak: {peak / 1e12 if peak else float('nan'):.1f} TFLOP/s ({peak_source})")

    t0 = time.perf_counter()
    model = build_random_model(shape, seed=args.seed, dtype=dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    flops = FlopModel.from_model(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {shape} ({n_params / 1e9:.2f} B parameters, {str(dtype).removeprefix('torch.')}) built on "
          f"{device} in {build_s:.1f} s; {flops}")

    threads = args.threads if device.type == "cpu" else None
    results: dict = {"environment": env, "args": vars(args), "shape": shape, "parameters": n_params,
                     "build_s": build_s, "peak_flops": peak, "peak_source": peak_source,
                     "flop_model": flops.to_dict(), "sweeps": []}
    for p in lengths:
        engine = Engine(model, capacity_blocks=sweep_blocks(p, args.block_size, args.hits), block_size=args.block_size,
                        device=device, num_threads=threads)
        t1 = time.perf_counter()
        rows = run_sweep(engine, p, args.hits, repeats=repeats, warmup=warmup, seed=args.seed, verify=True,
                         baselines=not args.no_hf)
        table = summarize_sweep(rows, flops, peak_flops=peak)
        print(f"\n## {shape}, {str(dtype).removeprefix('torch.')}, P = {p}, best of {repeats} "
              f"({time.perf_counter() - t1:.1f} s, pool {engine.capacity_bytes / 2**30:.2f} GiB)")
        print(format_table(table, cpu_time=device.type == "cpu"))
        results["sweeps"].append({"prompt_tokens": p, "pool_bytes": engine.capacity_bytes,
                                  "table": table.to_dict("records"), "requests": rows.to_dict("records")})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()

    doc = 64 if args.tiny else 1024
    engine = Engine(model, capacity_blocks=-(-(doc + 16) // args.block_size) * 8 + 8, block_size=args.block_size,
                    device=device, num_threads=threads)
    res = engine.run(verify_workload(engine.vocab_size, doc, 4, args.seed), verify=True, verify_tokens=4)
    f, s = res.requests, res.summary
    verify = {key: s[key] for key in ("verified_requests", "verify_failures", "verify_max_logit_abs",
                                      "verify_max_logit_rel", "verify_max_kv_abs", "verify_argmax_agreement",
                                      "verify_greedy_agreement", "token_hit_rate")}
    verify.update(hit_blocks=f["hit_blocks"].tolist(), logit_max_abs=f["verify_logit_max_abs"].tolist(),
                  logit_allowed=f["verify_logit_allowed"].tolist(), kv_max_abs=f["verify_kv_max_abs"].tolist(),
                  sweep_max_logit_abs=max(float(t["verify_logit_max_abs"]) for sw in results["sweeps"]
                                          for t in sw["table"]),
                  sweep_passed=all(bool(t["verify_passed"]) for sw in results["sweeps"] for t in sw["table"]))
    results["verify"] = verify
    print(f"\n## oracle ({len(f)} requests, {doc}-token documents, hits {f['hit_blocks'].tolist()}): "
          f"{verify['verified_requests'] - verify['verify_failures']}/{verify['verified_requests']} passed, "
          f"max |dlogit| {verify['verify_max_logit_abs']:.3g} (rel {verify['verify_max_logit_rel']:.3g}, allowed "
          f"{min(verify['logit_allowed']):.3g}+), max |dKV| {verify['verify_max_kv_abs']:.3g}; sweep requests: max "
          f"|dlogit| {verify['sweep_max_logit_abs']:.3g}, all passed: {verify['sweep_passed']}")
    if device.type == "cuda":
        results["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        print(f"peak GPU memory {results['peak_memory_bytes'] / 2**30:.1f} GiB")

    out = Path(args.out) if args.out else (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("results"))
    if out.suffix != ".json":
        out = out / "gpu_engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=_plain) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
