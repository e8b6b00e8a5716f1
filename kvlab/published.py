"""Published numbers as data (with citations) beside kvlab's own computation of each (docs/published.md).

:data:`PUBLISHED` holds every cell kvlab is compared against: Mooncake FAST'25 Table 2, the Mooncake arXiv
report's Table 1, the Alibaba ATC'25 ideal hit ratios and the seed documents' worked numbers. Each
:class:`Cell` names its source, table or figure, the value as printed, the precision it was printed with and
the ``measure`` kvlab computes for it. :func:`comparison` computes kvlab's number for every cell whose data
is here; a cell whose trace file is absent gets status ``needs download`` and the exact ``kvlab download``
command (:func:`download_command`). Nothing here is a result: published values are inputs, kvlab's are
computed each time.

Units: tokens, blocks, bytes; rates are fractions in [0, 1].
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.profiles import load_model
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.stats import trace_stats
from kvlab.units import GIB
from kvlab.workload.load import load_trace
from kvlab.workload.registry import TRACES, download_command, find_local
from kvlab.workload.workload import Workload, from_lists

FAST25 = ("Qin et al., \"Mooncake: Trading More Storage for Less Computation\", USENIX FAST'25, Appendix A, "
          "Table 2 (PDF: kvcache-ai/Mooncake FAST25-release/Mooncake-FAST25.pdf; transcribed verbatim in "
          "../shared/traces/mooncake/SOURCE.md)")
ARXIV = ("Qin et al., \"Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving\", arXiv 2407.00079 "
         "v3, section 4.2, Table 1 (cache hit rates, single global pool, 512-token blocks; the table is an image: "
         "values as transcribed identically by several public notes on the paper; issue 17 quotes the "
         "1k..100k columns)")
ATC25 = ("Wang et al., \"KVCache Cache in the Wild\", USENIX ATC'25 (arXiv 2506.02634): ideal (infinite "
         "capacity) hit ratios of traces A and B, 16-token blocks (values as stated in issue 17 and a public "
         "summary of the paper: the page and figure were not read here)")
SEED002 = "seed document 002 (../shared/seeds/002_aab9a6de2d5bae99.txt, lines 11-12): the A..H example"
SEED003 = "seed document 003 (../shared/seeds/003_d59b10613fe4c157.txt)"

#: Table 1's capacities (blocks of 512 tokens); ``math.inf`` is the "Inf" column
TABLE1_CAPACITIES = (1_000, 10_000, 30_000, 50_000, 100_000, math.inf)
#: Table 1's rows: the paper's policy name -> kvlab's policy
TABLE1_POLICIES = {"LRUCache": "lru", "LFUCache": "lfu", "LengthAwareCache": "length-aware"}
TABLE1_MODE = "ideal"  # hash-id simulators count every full block a prefix matches (no last-token rule)

#: how kvlab computes each measure, and where its definition differs from the paper's
DEFINITIONS = {
    "requests": "lines of the trace file (one request each).",
    "mean_input_tokens": "mean input_length of the trace (tokens).",
    "mean_output_tokens": "mean output_length of the trace (tokens).",
    "cache_ratio": "kvlab: share of all prompt block ids (full and partial) that occurred earlier in the trace "
                   "(trace_stats repeated_block_ratio). The paper does not define its 'Cache Ratio'; "
                   "cache_ratio_definitions gives other candidates (repeated full blocks, infinite-cache hit rates).",
    "hit_rate": "kvlab: token hit rate of an exact replay (prefix lookup stops at the first miss; object-cache "
                "counting: every matched full block is a hit). The paper's simulator is not published; vLLM "
                "counting recomputes the last prompt token, which can cost a whole block when the prompt ends "
                "on a block boundary.",
    "ideal_hit_rate": "kvlab: infinite-cache token hit rate, object-cache counting (trace_stats "
                      "ideal_hit_rate_nocap); vLLM counting (ideal_hit_rate) recomputes the last prompt token.",
    "recompute_without": "Σ over T decode steps of the K/V projections computed per layer without a cache: a "
                         "replay of T requests whose prompts grow by one token, every prompt computed in full.",
    "recompute_with": "K/V projections computed per layer with an unbounded cache: the same replay's "
                      "prompt tokens minus its hit tokens (block size 1).",
    "kv_bytes_per_token": "2 × layers × kv_heads × head_dim × bytes per value, from kvlab's model profile "
                          "(kvlab/data/models, the Hugging Face config.json).",
    "kv_bytes": "kv_bytes_per_token × tokens × sequences (bytes).",
    "seed002_hit_blocks": "blocks of 2 tokens hit when A..H is cached and one position becomes X: two requests "
                          "replayed through kvlab's cache (object-cache counting).",
}


@dataclass(frozen=True)
class Cell:
    """One published number: ``value`` in ``unit``, printed to ``precision`` (half of it is rounding)."""

    key: str  # unique id, e.g. "fast25/conversation/requests"
    source: str  # short label: "Mooncake FAST'25", "seed 003", ...
    location: str  # "Table 2", "Table 1", "text", ...
    subject: str  # a registry trace name, a model profile, or an example
    quantity: str  # what is counted, in words
    measure: str  # a key of DEFINITIONS: how kvlab computes it
    value: float
    unit: str
    precision: float
    citation: str
    params: dict = field(default_factory=dict)


def _fast25() -> list[Cell]:
    rows = {"mooncake_conversation": (12_031, 12_035, 343, 0.40), "mooncake_toolagent": (23_608, 8_596, 182, 0.59),
            "mooncake_synthetic": (3_993, 15_325, 149, 0.66)}
    out = []
    for trace, (n, inp, outp, ratio) in rows.items():
        short = trace.removeprefix("mooncake_")
        for measure, quantity, value, unit, prec in (
                ("requests", "Num Requests", n, "requests", 1),
                ("mean_input_tokens", "Avg Input Len", inp, "tokens", 1),
                ("mean_output_tokens", "Avg Output Len", outp, "tokens", 1),
                ("cache_ratio", "Cache Ratio", ratio, "fraction", 0.01)):
            out.append(Cell(f"fast25/{short}/{measure}", "Mooncake FAST'25", "Table 2", trace, quantity, measure,
                            value, unit, prec, FAST25))
    return out


def _arxiv() -> list[Cell]:
    values = {"LRUCache": (0.30, 0.40, 0.48, 0.50, 0.51, 0.51), "LFUCache": (0.30, 0.35, 0.43, 0.49, 0.51, 0.51),
              "LengthAwareCache": (0.30, 0.35, 0.42, 0.48, 0.50, 0.51)}
    out = []
    for name, row in values.items():
        for cap, v in zip(TABLE1_CAPACITIES, row, strict=True):
            label = "inf" if math.isinf(cap) else f"{int(cap) // 1000}k"
            out.append(Cell(f"arxiv/{TABLE1_POLICIES[name]}/{label}", "Mooncake arXiv v3", "Table 1", "mooncake_arxiv",
                            f"{name} hit rate, {label} blocks", "hit_rate" if not math.isinf(cap) else "ideal_hit_rate",
                            v, "fraction", 0.01, ARXIV, {"policy": TABLE1_POLICIES[name], "capacity_blocks": cap}))
    return out


def _atc25() -> list[Cell]:
    return [Cell(f"atc25/{t}/ideal", "Alibaba ATC'25", "text", f"alibaba_{t}", "ideal hit ratio (infinite cache)",
                 "ideal_hit_rate", v, "fraction", 0.02, ATC25) for t, v in (("traceA", 0.62), ("traceB", 0.54))]


def _seeds() -> list[Cell]:
    out = []
    for p, t, without, with_cache, line in ((5, 16, 200, 20, 38), (5, 64, 2_336, 68, 40)):
        where = f"{SEED003}, line {line}"
        out.append(Cell(f"seed003/waste/P{p}T{t}/without", "seed 003", "text", "decode steps",
                        f"K/V projections per layer without cache, P={p}, T={t}", "recompute_without", without,
                        "projections", 1, where, {"P": p, "T": t}))
        out.append(Cell(f"seed003/waste/P{p}T{t}/with", "seed 003", "text", "decode steps",
                        f"K/V projections per layer with cache, P={p}, T={t}", "recompute_with", with_cache,
                        "projections", 1, where, {"P": p, "T": t}))
    for model, v, line in (("llama-2-7b", 524_288, 98), ("llama-3-8b", 131_072, 140)):
        out.append(Cell(f"seed003/kv/{model}", "seed 003", "text", model, "KV bytes per token (16-bit)",
                        "kv_bytes_per_token", v, "bytes", 1, f"{SEED003}, line {line}", {"model": model}))
    for tokens, seqs, v, prec, line in ((4_096, 1, 2 * GIB, 1, 98), (4_096, 8, 16 * GIB, 1, 140),
                                        (16_384, 8, 68.7e9, 0.1e9, 117)):
        out.append(Cell(f"seed003/kv/llama-2-7b/{tokens}x{seqs}", "seed 003", "text", "llama-2-7b",
                        f"KV bytes, {tokens:,} tokens × {seqs} sequences", "kv_bytes", v, "bytes", prec,
                        f"{SEED003}, line {line}", {"model": "llama-2-7b", "tokens": tokens, "sequences": seqs}))
    for changed, letter, v in ((7, "H", 3), (0, "A", 0)):
        out.append(Cell(f"seed002/X-replaces-{letter}", "seed 002", "text", "A..H, blocks of 2",
                        f"reusable full blocks when X replaces {letter}", "seed002_hit_blocks", v, "blocks", 1,
                        SEED002, {"changed": changed}))
    return out


#: every published cell, in the order of the notebook's table
PUBLISHED: tuple[Cell, ...] = tuple(_fast25() + _arxiv() + _atc25() + _seeds())
TRACE_MEASURES = ("requests", "mean_input_tokens", "mean_output_tokens", "cache_ratio", "hit_rate", "ideal_hit_rate")


# ---------------------------------------------------------------------- kvlab's counterparts
def recompute_waste(prompt_tokens: int, steps: int) -> tuple[int, int]:
    """Seed 003's formula: K/V projections per layer for ``steps`` decode steps after a ``prompt_tokens`` prompt,
    ``(without cache, with cache)`` = ``(T·P + T(T−1)/2, P + T − 1)``."""
    p, t = int(prompt_tokens), int(steps)
    return t * p + t * (t - 1) // 2, p + t - 1


def decode_steps_workload(prompt_tokens: int, steps: int) -> Workload:
    """``steps`` requests whose prompts are the first ``P``, ``P + 1``, ... tokens of one sequence (decode step
    ``s`` reads the prompt and the ``s`` tokens generated so far)."""
    return from_lists([list(range(1, prompt_tokens + s + 1)) for s in range(steps)], kind="tokens")


def replay_recompute(prompt_tokens: int, steps: int, mode: str = "vllm") -> tuple[int, int]:
    """``(without cache, with cache)`` projections per layer, measured: :func:`decode_steps_workload` replayed
    through an unbounded kvlab cache (block size 1); without a cache every prompt token is computed."""
    w = decode_steps_workload(prompt_tokens, steps)
    res = replay(w, capacity_blocks=int(w.input_length.sum()) + 1, block_size=1, mode=mode)
    total = int(w.input_length.sum())
    return total, total - int(res.requests["hit_tokens"].sum())


def kv_bytes(model: str, tokens: int = 1, sequences: int = 1) -> int:
    """KV bytes of ``sequences`` × ``tokens`` tokens of ``model`` (a kvlab profile: 2 × layers × kv_heads ×
    head_dim × bytes per value per token)."""
    return load_model(model).kv_bytes_per_token * int(tokens) * int(sequences)


def seed002_hit_blocks(changed: int, mode: str = "ideal", repeat: bool = False) -> int:
    """Seed 002: cache A..H (token ids 1..8) in blocks of 2, then a request with position ``changed`` set to X
    (or the same request again when ``repeat``); the blocks it hits, replayed through kvlab's cache."""
    first = list(range(1, 9))
    second = list(first)
    if not repeat:
        second[changed] = 99  # X
    res = replay(from_lists([first, second]), capacity_blocks=16, block_size=2, mode=mode)
    return int(res.requests["hit_blocks"].iloc[1])


def policy_table(workload: Workload, capacities: tuple = TABLE1_CAPACITIES,
                 policies: Mapping[str, str] | None = None, mode: str = TABLE1_MODE) -> pd.DataFrame:
    """Table 1's grid on ``workload``: one exact replay per (policy, capacity in blocks); ``math.inf`` is the
    infinite cache (trace_stats). Columns: policy (paper's name), kvlab_policy, capacity_blocks, mode,
    token_hit_rate, block_hit_rate."""
    policies = TABLE1_POLICIES if policies is None else policies
    stats = trace_stats(workload)
    inf_rate = stats["ideal_hit_rate_nocap" if mode == "ideal" else "ideal_hit_rate"]
    enc = encode(workload, ReplayConfig(capacity_blocks=1, mode=mode))
    rows = []
    for name, policy in policies.items():
        for cap in capacities:
            if math.isinf(cap):
                rows.append((name, policy, cap, mode, inf_rate, math.nan))
                continue
            s = replay(workload, capacity_blocks=int(cap), policy=policy, mode=mode, encoded=enc).summary
            rows.append((name, policy, cap, mode, s["token_hit_rate"], s["block_hit_rate"]))
    return pd.DataFrame(rows, columns=["policy", "kvlab_policy", "capacity_blocks", "mode", "token_hit_rate",
                                       "block_hit_rate"])


def cache_ratio_definitions(workload: Workload) -> dict[str, float]:
    """Candidate definitions of a trace's "cache ratio" (fractions; FAST'25 Table 2 does not define its own):
    repeated block ids (all, full and partial), repeated full blocks, and the infinite-cache token hit rate,
    aggregate and mean per request (object-cache counting)."""
    s = trace_stats(workload)
    return {"repeated block ids (full and partial)": s.get("repeated_block_ratio", math.nan),
            "repeated full blocks": 1.0 - s["unique_blocks"] / s["full_blocks"] if s["full_blocks"] else math.nan,
            "infinite-cache token hit rate": s["ideal_hit_rate_nocap"],
            "infinite-cache mean request hit rate": s["ideal_mean_request_hit_rate_nocap"]}


def trace_values(workload: Workload, cells: list[Cell]) -> dict[str, float]:
    """kvlab's number for each of ``cells`` (all about ``workload``), by cell key."""
    stats = trace_stats(workload)
    grid = None
    if any(c.measure == "hit_rate" for c in cells):
        caps = tuple(sorted({c.params["capacity_blocks"] for c in cells if c.measure == "hit_rate"}))
        pols = {c.params["policy"]: c.params["policy"] for c in cells if c.measure == "hit_rate"}
        grid = policy_table(workload, caps, pols)
    out = {}
    for c in cells:
        if c.measure == "cache_ratio":
            out[c.key] = stats.get("repeated_block_ratio", math.nan)
        elif c.measure == "ideal_hit_rate":
            out[c.key] = stats["ideal_hit_rate_nocap"]
        elif c.measure == "hit_rate":
            row = grid[(grid["kvlab_policy"] == c.params["policy"])
                       & (grid["capacity_blocks"] == c.params["capacity_blocks"])]
            out[c.key] = float(row["token_hit_rate"].iloc[0])
        else:
            out[c.key] = float(stats[c.measure])
    return out


def model_value(c: Cell) -> float:
    """kvlab's number for a cell that needs no trace (seed documents)."""
    p = c.params
    if c.measure == "recompute_without":
        return replay_recompute(p["P"], p["T"])[0]
    if c.measure == "recompute_with":
        return replay_recompute(p["P"], p["T"])[1]
    if c.measure == "kv_bytes_per_token":
        return kv_bytes(p["model"])
    if c.measure == "kv_bytes":
        return kv_bytes(p["model"], p["tokens"], p["sequences"])
    if c.measure == "seed002_hit_blocks":
        return seed002_hit_blocks(p["changed"])
    raise ConfigError(f"cell {c.key!r}: measure {c.measure!r} needs a trace")


def comparison(paths: Mapping[str, str | os.PathLike] | None = None,
               workloads: Mapping[str, Workload] | None = None) -> pd.DataFrame:
    """Every :data:`PUBLISHED` cell beside kvlab's number: one row per cell.

    A trace cell is computed from ``workloads[subject]``, else the file ``paths[subject]`` (any file in the
    trace's format, e.g. your own copy), else the verified local copy of the registry trace; with none, its
    status is ``needs download`` and ``command`` is the exact ``kvlab download`` command.
    Columns: key, source, location, subject, quantity, unit, published, kvlab, difference (kvlab −
    published), relative (difference / published), within_rounding (|difference| ≤ precision / 2), status,
    command, definition, citation.
    """
    paths, workloads = dict(paths or {}), dict(workloads or {})
    values: dict[str, float] = {}
    status: dict[str, str] = {}
    command: dict[str, str] = {}
    by_trace: dict[str, list[Cell]] = {}
    for c in PUBLISHED:
        if c.measure in TRACE_MEASURES:
            by_trace.setdefault(c.subject, []).append(c)
        else:
            values[c.key], status[c.key] = model_value(c), "computed"
    for trace, cells in by_trace.items():
        w = workloads.get(trace)
        if w is None:
            path = paths.get(trace) or find_local(trace)
            w = None if path is None else load_trace(path, format=TRACES[trace]["format"])
        for c in cells:
            command[c.key] = download_command(trace)
            status[c.key] = "needs download" if w is None else "computed"
        if w is not None:
            values.update(trace_values(w, cells))
    rows = []
    for c in PUBLISHED:
        v = values.get(c.key, math.nan)
        diff = v - c.value
        rows.append({"key": c.key, "source": c.source, "location": c.location, "subject": c.subject,
                     "quantity": c.quantity, "unit": c.unit, "published": float(c.value), "kvlab": v,
                     "difference": diff, "relative": diff / c.value if c.value else math.nan,
                     "within_rounding": bool(abs(diff) <= c.precision / 2 + 1e-12) if not math.isnan(v) else None,
                     "status": status[c.key], "command": command.get(c.key, ""),
                     "definition": DEFINITIONS[c.measure], "citation": c.citation})
    return pd.DataFrame(rows)


def capacity_tokens(low: float = 1e4, high: float = 1e9, points: int = 26, block_size: int = 512) -> np.ndarray:
    """Distinct capacities in blocks of ``block_size`` tokens for log-spaced token capacities ``low``..``high``."""
    tokens = np.logspace(math.log10(low), math.log10(high), points)
    return np.unique(np.maximum(1, np.round(tokens / block_size)).astype(np.int64))


__all__ = ["ARXIV", "ATC25", "DEFINITIONS", "FAST25", "PUBLISHED", "SEED002", "SEED003", "TABLE1_CAPACITIES",
           "TABLE1_MODE", "TABLE1_POLICIES", "Cell", "cache_ratio_definitions", "capacity_tokens", "comparison",
           "decode_steps_workload", "download_command", "kv_bytes", "model_value", "policy_table",
           "recompute_waste", "replay_recompute", "seed002_hit_blocks", "trace_values"]
