"""Prefill time vs prefix-hit fraction: the engine, plain transformers and transformers' prompt-cache reuse.

Shared by ``benchmarks/bench_engine.py`` (CPU), ``benchmarks/gpu_engine.py`` (CUDA) and notebook 02.

**Workload.** One random *document* of ``P`` tokens is prefilled once (its blocks become cached). For a hit
fraction ``h`` a request is ``document[:n] + fresh random tokens`` (``P`` tokens in all) with
``n = floor(h * P / block_size) * block_size`` (at most ``(P - 1) // block_size`` blocks: the engine always
computes the last prompt token), so the request hits exactly ``n`` tokens and computes ``P - n``. Every
repetition draws a new suffix, so only the document's blocks are ever hit. Repetitions run in rounds over
all ``h``; at each ``h > 0`` the engine first prefills an uncached reference (a fresh ``P``-token prompt,
no hits), then the cached request, then the transformers baseline, so the cached time and the uncached one
it is divided by are measured back to back, and the uncached time is sampled at every ``h`` (the best of
``len(h) x N`` instead of ``N``). The first ``warmup`` rounds are not recorded. On a shared machine report
the best of N (min) beside the median and the median of the back-to-back ratios (:func:`summarize_sweep`).

**Ceiling.** Only ``P - s`` of the ``P`` tokens are computed, and each costs at least what it costs
uncached (its attention reads as many keys), so no speedup can exceed ``1 / (1 - s/P)``. A measured one
above it (``above_ceiling``, :func:`ceiling_warnings`) is an artefact: the uncached runs were slowed by
preemption or other jobs (wall time on a shared CPU; the CPU-time speedup shows it), or a per-token cost
that falls with the chunk length (caches).

**FLOP model** (:class:`FlopModel`; norms, RoPE, softmax and activations are left out) for computing
positions ``[s, P)`` of a ``P``-token prompt after ``s`` cached tokens::

    F(s, P) = 2 * N_lin * (P - s)                      linear layers: 2 FLOPs per weight and token
            + 4 * L * H * d * sum_{i=s}^{P-1} (i + 1)  attention: q.k and p.v over the i + 1 visible keys
            + 2 * hidden * vocab                       LM head, last position only (logits_to_keep=1)

``N_lin`` = parameters of the decoder's linear layers (every 2-D weight except the embeddings and the LM
head), ``L`` layers, ``H`` query heads of ``d`` dims. The ideal speedup at ``s`` hit tokens is
``F(0, P) / F(s, P)``: below ``1 / (1 - s/P)`` because the suffix still attends over the cached context.

**Baselines** (same model, same prompts, the same forward call as the engine): ``transformers`` runs the
whole prompt with an empty ``DynamicCache`` (no reuse); ``transformers+copy`` computes the document
prefix's ``DynamicCache`` once per ``h`` and, per request, ``copy.deepcopy``-s it and runs the suffix
(transformers' documented prompt-reuse recipe). Times are wall seconds, device-synchronised; ``cpu_s``
is the process CPU time of the same call (on the CPU with one thread: the time not lost to preemption).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from kvlab.engine.compute import sync_device
from kvlab.engine.driver import Engine
from kvlab.engine.model import cache_from_kv, forward_logits
from kvlab.engine.request import Request
from kvlab.errors import ConfigError

HIT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9)
PHASES = ("hash_s", "lookup_s", "gather_s", "forward_s", "scatter_s")


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP count needs of a decoder-only model (module docstring: the formula)."""

    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    linear_params: int

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> FlopModel:
        """Read the shape from ``model.config`` and count the decoder's linear weights (2-D parameters
        other than the input/position embeddings and the LM head)."""
        cfg = model.config
        skip = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        head = model.get_output_embeddings()
        if head is not None:
            skip.add(id(head.weight))
        linear = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        return cls(int(cfg.num_hidden_layers), heads, head_dim, hidden, int(cfg.vocab_size), int(linear))

    def prefill_flops(self, start: int, stop: int) -> float:
        """FLOPs to compute positions ``[start, stop)`` after ``start`` cached positions (``F(start, stop)``)."""
        if not 0 <= start < stop:
            raise ConfigError(f"need 0 <= start < stop, got start={start}, stop={stop}")
        tokens = stop - start
        visible = (stop * (stop + 1) - start * (start + 1)) / 2  # sum of (i + 1) over i in [start, stop)
        return (2.0 * self.linear_params * tokens + 4.0 * self.num_layers * self.num_heads * self.head_dim * visible
                + 2.0 * self.hidden_size * self.vocab_size)

    def ideal_speedup(self, hit_tokens: int, prompt_tokens: int) -> float:
        """``F(0, P) / F(hit_tokens, P)``."""
        return self.prefill_flops(0, prompt_tokens) / self.prefill_flops(hit_tokens, prompt_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


def hit_tokens_for(fraction: float, prompt_tokens: int, block_size: int) -> int:
    """Tokens a request with hit fraction ``fraction`` reuses: whole blocks, at most ``(P - 1) // bs`` of them."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"hit fractions must lie in [0, 1), got {fraction}")
    blocks = min(int(fraction * prompt_tokens) // block_size, (prompt_tokens - 1) // block_size)
    return blocks * block_size


def sweep_blocks(prompt_tokens: int, block_size: int, fractions: Sequence[float] = HIT_FRACTIONS) -> int:
    """A pool size for :func:`run_sweep`: ``2 len(fractions) + 2`` prompts. A round allocates fewer new blocks
    than that minus the document (a cached request and its uncached reference per ``h``), and every hit block
    is touched once per round, so LRU never evicts a block a later request is meant to hit (``run_sweep``
    checks the hit count of every request)."""
    return -(-prompt_tokens // block_size) * (2 * len(fractions) + 2)


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float, float]:
    """(result, wall seconds, process CPU seconds) of ``fn()``, device-synchronised before and after."""
    sync_device(device)
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - t0, time.process_time() - c0


def run_sweep(
    engine: Engine,
    prompt_tokens: int = 2048,
    fractions: Sequence[float] = HIT_FRACTIONS,
    *,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    verify: bool = False,
    baselines: bool = True,
) -> pd.DataFrame:
    """Prefill ``repeats`` requests per hit fraction on ``engine`` and, with ``baselines``, on the same model
    through transformers (module docstring: the workload). In every round, each ``h > 0`` runs an uncached
    engine reference, the cached engine request and then the baseline (plain transformers at h = 0, the
    deep-copied prefix cache at h > 0), so all methods see the same background load.

    One row per measured request: ``method`` (``engine``, ``transformers``, ``transformers+copy``),
    ``fraction, repeat, prompt_tokens, hit_tokens, computed_tokens``, ``pair`` (the ``h`` whose cached
    request an uncached engine row was measured next to: ``fraction`` itself except on the references, whose
    ``fraction`` is 0), ``prefill_s`` (TTFT, wall) and ``cpu_s`` (process CPU time of the call); engine rows
    add the :class:`~kvlab.engine.request.PrefillResult` phases (``hash_s`` is part of ``lookup_s``) and
    ``bookkeeping_s`` = lookup + gather + scatter. ``verify=True`` runs the oracle (2 greedy tokens) on the
    engine's last request per ``h``, outside the timings: ``verify_*`` columns, NaN elsewhere.
    """
    p, bs, dev, model = int(prompt_tokens), engine.block_size, engine.device, engine.model
    vocab = engine.vocab_size
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, vocab, p, dtype=np.int64)
    hits = [hit_tokens_for(f, p, bs) for f in fractions]
    seeded = engine.prefill(Request(doc))
    if not seeded.admitted:
        raise ConfigError(f"a {p}-token prompt does not fit the engine's {engine.capacity_blocks} blocks")
    engine.release(seeded.state)
    prefixes: dict[int, object] = {}
    if baselines:
        with torch.no_grad():
            for n in sorted(set(hits) - {0}):
                prefixes[n] = cache_from_kv(None, 0)
                forward_logits(model, torch.as_tensor(doc[:n], device=dev).view(1, -1),
                               torch.arange(n, device=dev).view(1, -1), prefixes[n])

    def baseline(n: int) -> tuple[float, float]:
        x = torch.as_tensor(rng.integers(0, vocab, p - n), device=dev).view(1, -1)
        pos = torch.arange(n, p, device=dev).view(1, -1)

        def call() -> None:
            with torch.no_grad():
                work = copy.deepcopy(prefixes[n]) if n else cache_from_kv(None, 0)
                forward_logits(model, x, pos, work)

        _, wall, cpu = _timed(call, dev)
        return wall, cpu

    def prefill(frac: float, n: int, pair: float, rep: int, check: bool) -> dict:
        """One engine prefill hitting ``n`` document tokens: its row (``check``: with the oracle)."""
        req = Request(np.concatenate([doc[:n], rng.integers(0, vocab, p - n)]))
        res, _, cpu = _timed(lambda: engine.prefill(req), dev)
        if not res.admitted:
            raise ConfigError(f"request not admitted: {engine.capacity_blocks} blocks are too few for the sweep")
        if res.hit_tokens != n:
            engine.release(res.state)
            raise RuntimeError(f"expected {n} hit tokens at h={frac}, got {res.hit_tokens} (pool too small?)")
        row = {"method": "engine", "fraction": float(frac), "repeat": rep, "prompt_tokens": p, "hit_tokens": n,
               "computed_tokens": p - n, "pair": float(pair), "prefill_s": res.prefill_s, "cpu_s": cpu,
               **{k: getattr(res, k) for k in PHASES}, "bookkeeping_s": res.lookup_s + res.gather_s + res.scatter_s}
        if check:
            report = engine.verify(res.state, k=2)
            row.update(verify_passed=report.passed, verify_logit_max_abs=report.logit_max_abs,
                       verify_logit_rel=report.logit_rel, verify_kv_max_abs=report.kv_max_abs)
        engine.release(res.state)
        return row

    rows = []
    for rep in range(-int(warmup), int(repeats)):
        for frac, n in zip(fractions, hits, strict=True):
            check = verify and rep == repeats - 1
            measured = ([prefill(0.0, 0, frac, rep, False)] if n else []) + [prefill(frac, n, frac, rep, check)]
            if rep >= 0:
                rows.extend(measured)
            if baselines:
                wall, cpu = baseline(n)
                if rep >= 0:
                    rows.append({"method": "transformers+copy" if n else "transformers", "fraction": float(frac),
                                 "repeat": rep, "prompt_tokens": p, "hit_tokens": n, "computed_tokens": p - n,
                                 "pair": float(frac), "prefill_s": wall, "cpu_s": cpu})
    return pd.DataFrame(rows)


def summarize_sweep(rows: pd.DataFrame, flops: FlopModel, *, peak_flops: float | None = None) -> pd.DataFrame:
    """One row per hit fraction from :func:`run_sweep`'s rows.

    Engine: ``ttft_s`` (best of N: min over repeats; at h = 0 over every uncached prefill, the references
    included) and ``ttft_median_s``; ``tokens_per_s`` (computed tokens / best TTFT) and
    ``effective_tokens_per_s`` (prompt tokens / best TTFT); ``speedup`` = best uncached TTFT / best TTFT at
    h; ``speedup_paired`` = median over rounds of uncached / cached TTFT measured back to back (robust to
    load changes); ``speedup_cpu`` the same as ``speedup`` in process CPU time; ``flop_ideal`` =
    F(0,P) / F(s,P); ``inverse_miss`` = 1 / (1 - s/P), the ceiling; ``above_ceiling``: ``speedup`` or
    ``speedup_paired`` above it (an artefact, module docstring; :func:`ceiling_warnings`); ``of_ideal`` =
    speedup / flop_ideal; ``bookkeeping_pct`` = median over repeats of (lookup + gather + scatter) /
    prefill, in %; the phases' medians (``*_median_s``); ``gflop`` = F(s,P); ``tflops`` = F(s,P) / best
    TTFT; ``mfu`` = tflops / peak when ``peak_flops`` is given; ``verify_*`` maxima when verified. Baselines
    (when run): ``hf_ttft_s`` (plain transformers, best), ``hf_copy_ttft_s`` (deep-copied prefix cache,
    best; plain at h=0), ``hf_copy_speedup`` (hf_ttft_s / hf_copy_ttft_s) and ``vs_hf_copy``
    (hf_copy_ttft_s / ttft_s).
    """
    eng = rows[rows["method"] == "engine"]
    base = eng[eng["hit_tokens"] == 0]
    base_best = float(base["prefill_s"].min()) if len(base) else float("nan")
    base_cpu = float(base["cpu_s"].min()) if len(base) else float("nan")
    hf = rows[rows["method"] != "engine"]
    plain = float(hf.loc[hf["method"] == "transformers", "prefill_s"].min()) if len(hf) else float("nan")
    out = []
    for frac, f in eng.groupby("fraction", sort=True):
        p = int(f["prompt_tokens"].iloc[0])
        n = int(f["hit_tokens"].iloc[0])
        best = float(f["prefill_s"].min())
        work = flops.prefill_flops(n, p)
        own = f[f["pair"] == frac]  # at h = 0: the h = 0 requests, not the other h's references
        ref = base[base["pair"] == frac].set_index("repeat")["prefill_s"]
        paired = (ref / own.set_index("repeat")["prefill_s"]).dropna()
        row = {
            "fraction": float(frac), "prompt_tokens": p, "hit_tokens": n, "computed_tokens": p - n,
            "ttft_s": best, "ttft_median_s": float(f["prefill_s"].median()),
            "tokens_per_s": (p - n) / best, "effective_tokens_per_s": p / best,
            "speedup": base_best / best, "speedup_paired": float(paired.median()) if len(paired) else float("nan"),
            "speedup_cpu": base_cpu / float(f["cpu_s"].min()),
            "flop_ideal": flops.ideal_speedup(n, p), "inverse_miss": p / (p - n),
            "bookkeeping_pct": 100.0 * float((f["bookkeeping_s"] / f["prefill_s"]).median()),
            **{k.removesuffix("_s") + "_median_s": float(f[k].median()) for k in PHASES},
            "gflop": work / 1e9, "tflops": work / best / 1e12,
        }
        row["above_ceiling"] = bool(max(row["speedup"], row["speedup_paired"]) > row["inverse_miss"])
        row["of_ideal"] = row["speedup"] / row["flop_ideal"]
        if peak_flops:
            row["mfu"] = work / best / peak_flops
        if "verify_logit_max_abs" in f and f["verify_logit_max_abs"].notna().any():
            row["verify_logit_max_abs"] = float(f["verify_logit_max_abs"].max())
            row["verify_kv_max_abs"] = float(f["verify_kv_max_abs"].max())
            row["verify_passed"] = bool(f["verify_passed"].dropna().astype(bool).all())
        if len(hf):
            copies = hf.loc[(hf["method"] == "transformers+copy") & (hf["fraction"] == frac), "prefill_s"]
            row["hf_ttft_s"] = plain
            row["hf_copy_ttft_s"] = plain if n == 0 else float(copies.min())
            row["hf_copy_speedup"] = plain / row["hf_copy_ttft_s"]
            row["vs_hf_copy"] = row["hf_copy_ttft_s"] / best
        out.append(row)
    return pd.DataFrame(out)


def ceiling_warnings(table: pd.DataFrame) -> list[str]:
    """One line per :func:`summarize_sweep` row whose speedup exceeds the ``1 / (1 - h)`` ceiling (none: [])."""
    lines = []
    for r in table[table["above_ceiling"]].itertuples():
        cpu = f", CPU time {r.speedup_cpu:.3f}" if pd.notna(r.speedup_cpu) else ""
        lines.append(f"WARNING: h = {r.fraction:.2f}: speedup {r.speedup:.3f} (paired {r.speedup_paired:.3f}{cpu}) "
                     f"above the 1/(1-h) = {r.inverse_miss:.2f} ceiling no prefill can beat: a measurement artefact "
                     "(the uncached runs were slowed by other jobs, or caches favour short chunks); rerun with more "
                     "--repeats on a quieter machine, compare the paired and CPU-time speedups")
    return lines


def format_table(table: pd.DataFrame, *, cpu_time: bool = False) -> str:
    """The summary as a text table (times in ms). ``cpu_time`` adds the CPU-time speedup; TFLOP/s and MFU,
    the transformers baselines and the oracle's max logit difference are shown when present."""

    def ms(v: float) -> str:
        return f"{1e3 * v:.1f}"

    def num(digits: int) -> object:
        return lambda v: f"{v:.{digits}f}"

    spec: dict[str, tuple[str, object]] = {
        "fraction": ("h", num(2)), "hit_tokens": ("hit", num(0)), "ttft_s": ("TTFT ms", ms),
        "ttft_median_s": ("median", ms), "tokens_per_s": ("tok/s", num(0)),
        "effective_tokens_per_s": ("eff tok/s", num(0)), "speedup": ("speedup", num(2)),
        "speedup_paired": ("paired", num(2)), "speedup_cpu": ("CPU-time", num(2)),
        "flop_ideal": ("FLOP ideal", num(2)), "inverse_miss": ("1/(1-h)", num(2)), "of_ideal": ("of ideal", num(2)),
        "bookkeeping_pct": ("bookkeep %", num(2)), "tflops": ("TFLOP/s", num(2)),
        "mfu": ("MFU %", lambda v: f"{100 * v:.1f}"), "hf_ttft_s": ("HF ms", ms), "hf_copy_ttft_s": ("HF+copy ms", ms),
        "above_ceiling": ("> 1/(1-h)", lambda v: "ABOVE" if v else "no"),
        "vs_hf_copy": ("vs copy", num(2)), "verify_logit_max_abs": ("max|dlogit|", lambda v: f"{v:.2e}"),
    }
    skip = set() if cpu_time else {"speedup_cpu"}
    if "mfu" not in table:
        skip.add("tflops")
    shown = {head: table[col].map(fmt) for col, (head, fmt) in spec.items() if col in table and col not in skip}
    return pd.DataFrame(shown).to_string(index=False)
