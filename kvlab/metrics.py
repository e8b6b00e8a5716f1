"""Aggregate metrics from per-request rows, with docs/semantics.md's names.

Input: a requests frame with at least :data:`SUMMARY_INPUTS` (``prompt_tokens``, ``hit_tokens``, ``full_blocks``,
``hit_blocks``, ``evictions``; tokens and blocks) and optionally ``admitted``, ``ideal_hit_tokens``,
``cached_blocks``. Rates are fractions in [0, 1]; ``eviction_rate_per_s`` is per second of trace time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.names import Summary


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


#: the ``requests.parquet`` columns every summary is computed from (:func:`summarize`); every driver writes them
SUMMARY_INPUTS: tuple[str, ...] = ("prompt_tokens", "hit_tokens", "full_blocks", "hit_blocks", "evictions")


def summarize(requests: pd.DataFrame, *, duration_s: float | None = None, capacity_blocks: int | None = None) -> dict:
    """Totals of one run (or one group of requests); ``capacity_blocks``: the cache's size (``mean_occupancy``)."""
    prompt = requests["prompt_tokens"].to_numpy()
    hit = requests["hit_tokens"].to_numpy()
    out: dict[str, float | int | None] = Summary({
        "requests": len(requests),
        "prompt_tokens": int(prompt.sum()),
        "reused_tokens": int(hit.sum()),
        "token_hit_rate": _ratio(hit.sum(), prompt.sum()),
        "block_hit_rate": _ratio(requests["hit_blocks"].sum(), requests["full_blocks"].sum()),
        "request_hit_rate": float((requests["hit_blocks"].to_numpy() > 0).mean()) if len(requests) else 0.0,
        "mean_request_hit_rate": float(np.mean(hit[prompt > 0] / prompt[prompt > 0])) if (prompt > 0).any() else 0.0,
        "evictions": int(requests["evictions"].sum()),
    })
    out["eviction_rate_per_request"] = _ratio(out["evictions"], len(requests))
    if duration_s is not None:
        out["eviction_rate_per_s"] = _ratio(out["evictions"], duration_s)
    if "ideal_hit_tokens" in requests:
        ideal = requests["ideal_hit_tokens"].to_numpy()
        out["ideal_hit_rate"] = _ratio(ideal.sum(), prompt.sum())
        out["ideal_mean_request_hit_rate"] = (
            float(np.mean(ideal[prompt > 0] / prompt[prompt > 0])) if (prompt > 0).any() else 0.0
        )
    if "admitted" in requests:
        out["rejected_requests"] = int((~requests["admitted"].to_numpy()).sum())
    if "collisions" in requests:
        out["collisions"] = int(requests["collisions"].sum())
    if "orphan_evictions" in requests:
        out["orphan_evictions"] = int(requests["orphan_evictions"].sum())
        out["mean_orphan_blocks"] = float(requests["orphan_blocks"].mean()) if len(requests) else 0.0
    if "cached_blocks" in requests and capacity_blocks:
        out["mean_occupancy"] = float(requests["cached_blocks"].mean()) / capacity_blocks
        out["final_cached_blocks"] = int(requests["cached_blocks"].iloc[-1]) if len(requests) else 0
    return out


def breakdown(requests: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    """Per-group metrics (e.g. ``by="tenant"`` or ``["category", "turn"]``), one row per group."""
    rows = []
    for name, group in requests.groupby(by, observed=True, sort=True):
        row = summarize(group)
        keys = name if isinstance(name, tuple) else (name,)
        row.update(dict(zip([by] if isinstance(by, str) else by, keys, strict=True)))
        rows.append(row)
    return pd.DataFrame(rows)


#: the TTFT / TPOT summary names (:data:`METRICS`): name -> (column, statistic); computed by :func:`latency_stats`
LATENCY_STATS: dict[str, tuple[str, str]] = {
    "ttft_p50_s": ("ttft_s", "p50"), "ttft_p90_s": ("ttft_s", "p90"), "ttft_p99_s": ("ttft_s", "p99"),
    "ttft_mean_s": ("ttft_s", "mean"),
    "tpot_p50_s": ("tpot_s", "p50"), "tpot_p90_s": ("tpot_s", "p90"), "tpot_p99_s": ("tpot_s", "p99"),
}


def admitted_values(requests: pd.DataFrame, column: str) -> np.ndarray:
    """The finite values of ``column`` over the admitted requests (all rows without an ``admitted`` column)."""
    admitted = requests["admitted"].to_numpy(dtype=bool) if "admitted" in requests else np.ones(len(requests), bool)
    values = requests[column].to_numpy(dtype=np.float64)[admitted]
    return values[np.isfinite(values)]


def latency_stats(requests: pd.DataFrame, columns: tuple[str, ...] = ("ttft_s", "tpot_s")) -> dict[str, float]:
    """:data:`LATENCY_STATS` of ``columns`` over the admitted requests, in seconds: the mean and linear
    percentiles (``numpy.percentile``) of the finite values; NaN when there are none (an empty run, nothing
    admitted) or when the frame has no such column. The one definition every driver's summary uses (the
    simulator's, the engine's ``ttft_*`` and :func:`kvlab.analysis.breakdown`'s per group)."""
    out: dict[str, float] = {}
    for name, (col, stat) in LATENCY_STATS.items():
        if col not in columns:
            continue
        values = admitted_values(requests, col) if col in requests else np.empty(0)
        if not len(values):
            out[name] = math.nan
        elif stat == "mean":
            out[name] = float(values.mean())
        else:
            out[name] = float(np.percentile(values, float(stat[1:])))
    return out


# ----------------------------------------------------------------------------- the vocabulary
#: The drivers, as ``manifest.json`` names them (``engine-serving``: :func:`kvlab.sim.run_engine_serving`, the
#: real engine behind the simulator's scheduler, with the simulator's columns).
DRIVERS: tuple[str, ...] = ("replay", "simulator", "engine", "engine-serving")

#: Every unit a table entry may have. ``fraction``: a share in [0, 1]; ``ratio`` / ``factor``: dimensionless,
#: unbounded; ``count``: events or things that are not tokens, blocks or requests; ``index`` / ``id``: integer
#: positions and identifiers; ``bool``: a flag; ``label``: a string (a config echo); ``logit`` and
#: ``K/V value``: differences in logits and in K/V tensor elements; ``GiB``: 2**30 bytes; ``list``: one entry
#: per item, its fields in a table of their own; ``as <metric>``: the unit of the metric the name is built from.
UNITS: tuple[str, ...] = (
    "tokens", "blocks", "requests", "s", "tokens/s", "requests/s", "blocks/s", "blocks/request", "bytes", "GiB",
    "FLOPs", "fraction", "ratio", "factor", "count", "index", "id", "bool", "label", "logit", "K/V value", "list",
    "as <metric>",
)

ALL = DRIVERS
SERVING = ("simulator", "engine-serving")
TIERED = ("replay", "simulator", "engine", "engine-serving")  # drivers that take tiers below the device
ENGINES = ("engine", "engine-serving")
TIMED = ("simulator", "engine", "engine-serving")


@dataclass(frozen=True)
class Metric:
    """One name of the vocabulary: its ``unit`` (one of :data:`UNITS`), a one-line ``definition`` and the
    ``drivers`` (of :data:`DRIVERS`) whose results can contain it (some only with an option the definition names)."""

    name: str
    unit: str
    definition: str
    drivers: tuple[str, ...]


def _table(*metrics: Metric) -> dict[str, Metric]:
    table = {m.name: m for m in metrics}
    if len(table) != len(metrics):
        raise ValueError("a name is defined twice in one table")
    return table


def _m(name: str, unit: str, definition: str, drivers: tuple[str, ...] = ALL) -> Metric:
    return Metric(name, unit, definition, tuple(drivers))


#: ``summary.json`` keys: name -> :class:`Metric`. Sums, means and percentiles are over the run's requests
#: (``requests.parquet`` rows) unless a definition says otherwise.
METRICS: dict[str, Metric] = _table(
    # kvlab.metrics.summarize: every driver
    _m("requests", "requests", "requests in the run (rows of requests.parquet)"),
    _m("prompt_tokens", "tokens", "Σ prompt tokens"),
    _m("reused_tokens", "tokens", "Σ hit_tokens: prompt tokens served from the cache"),
    _m("token_hit_rate", "fraction", "Σ hit tokens / Σ prompt tokens (vLLM prefix_cache_hits / prefix_cache_queries)"),
    _m("block_hit_rate", "fraction", "Σ hit blocks / Σ full prompt blocks"),
    _m("request_hit_rate", "fraction", "share of requests with ≥ 1 hit block"),
    _m("mean_request_hit_rate", "fraction", "mean over requests with a prompt of hit tokens / prompt tokens"),
    _m("evictions", "blocks", "Σ evictions column (keyed blocks evicted; see requests.parquet for when each counts)"),
    _m("eviction_rate_per_request", "blocks/request", "evictions / requests"),
    _m("eviction_rate_per_s", "blocks/s",
       "evictions / duration: first to last arrival in trace time (replay, engine) or makespan_s (serving)"),
    _m("ideal_hit_rate", "fraction", "Σ ideal_hit_tokens / Σ prompt tokens: token hit rate with unbounded capacity"),
    _m("ideal_mean_request_hit_rate", "fraction",
       "mean over requests with a prompt of ideal_hit_tokens / prompt tokens"),
    _m("rejected_requests", "requests",
       "requests never admitted: replay and engine, admitted = False; serving, rejected at arrival (never fits)"),
    _m("collisions", "blocks", "Σ key hits refused because the block held other content (replay verify=True)",
       ("replay",)),
    _m("orphan_evictions", "blocks", "Σ blocks evicted while orphaned (an ancestor block not cached)"),
    _m("mean_orphan_blocks", "blocks", "mean of the orphan_blocks column"),
    _m("mean_occupancy", "fraction", "mean of the cached_blocks column / capacity_blocks"),
    _m("final_cached_blocks", "blocks", "the cached_blocks column's last row (trace order)"),
    # configuration echoes
    _m("capacity_blocks", "blocks", "cache capacity in usable blocks (simulator: per instance, sized from the "
       "profiles unless given; engine-serving: the engine's pool unless given)"),
    _m("capacity_bytes", "bytes", "the engine's KV pool: capacity_blocks × kv_bytes_per_block", ("engine",)),
    _m("block_size", "tokens", "tokens per block"),
    _m("policy", "label", "eviction policy name"),
    _m("mode", "label", "counting mode: vllm (the last prompt token is recomputed) or ideal (replay only)",
       ("replay", "engine")),
    _m("hash", "label", "block-key hasher label: scheme plus deviations, /unsafe for unsafe keys",
       ("replay", "engine")),
    _m("backend", "label", "the replay core that ran: compiled (numba kernel) or python", ("replay",)),
    _m("cache_at", "label", "when a computed block becomes findable: schedule (in the step that computes it) or "
       "compute (after it)", SERVING),
    _m("model", "label", "cost-model profile name of the served model", SERVING),
    _m("hardware", "label", "hardware profile name (engine-serving: the engine's torch device)", SERVING),
    _m("tensor_parallel", "count", "tensor-parallel degree: devices per instance", SERVING),
    _m("instances", "count", "serving instances (data parallel, one pool and scheduler each)", SERVING),
    _m("router", "label", "how requests are assigned to instances: prefix or round_robin", SERVING),
    _m("calibration", "label", "cost model's hardware factors: calibrated or uncalibrated (engine-serving: measured)",
       SERVING),
    _m("cost_model", "label", "model@hardware[xTP], /uncalibrated when not fitted (engine-serving: "
       "measured:model@device)", SERVING),
    _m("time_scale", "factor", "factor applied to the trace's arrival times (given, or derived from rate)", SERVING),
    _m("rate", "requests/s", "mean arrival rate after scaling: (requests − 1) / (last − first arrival); null with "
       "one arrival time", SERVING),
    _m("model_id", "label", "the engine model's id (the hasher's model id; random models: random:shape:seedN)",
       ("engine",)),
    _m("engine_model_id", "label", "the engine model's id (the hasher's model id of the engine)", ("engine-serving",)),
    _m("device", "label", "torch device the engine ran on", ENGINES),
    _m("dtype", "label", "dtype of the engine's KV pool", ("engine",)),
    _m("executor", "label", "what ran the scheduler's steps: engine", ("engine-serving",)),
    _m("timer", "label", "time base of the engine's clock: wall or thread (this thread's CPU time)",
       ("engine-serving",)),
    # replay
    _m("block_lookups", "blocks", "full prompt blocks of the trace, i.e. keys looked up at most (Σ full_blocks)",
       ("replay",)),
    _m("replay_seconds", "s", "wall time of the replay loop (compilation excluded)", ("replay",)),
    _m("compile_seconds", "s", "wall time of the compiled kernel's warm-up and compilation (python backend: 0)",
       ("replay",)),
    # latency and throughput (simulator, engine)
    _m("ttft_p50_s", "s", "median of ttft_s over admitted requests", TIMED),
    _m("ttft_p90_s", "s", "90th percentile of ttft_s over admitted requests", TIMED),
    _m("ttft_p99_s", "s", "99th percentile of ttft_s over admitted requests", TIMED),
    _m("ttft_mean_s", "s", "mean of ttft_s over admitted requests", TIMED),
    _m("tpot_p50_s", "s", "median of tpot_s over admitted requests with ≥ 2 output tokens", SERVING),
    _m("tpot_p90_s", "s", "90th percentile of tpot_s over admitted requests with ≥ 2 output tokens", SERVING),
    _m("tpot_p99_s", "s", "99th percentile of tpot_s over admitted requests with ≥ 2 output tokens", SERVING),
    _m("latency_p50_s", "s", "median of latency_s over admitted requests", SERVING),
    _m("prefill_throughput", "tokens/s", "tokens computed in prefill (hits excluded; serving: recomputation included) "
       "/ prefill_busy_s", TIMED),
    _m("effective_prefill_throughput", "tokens/s", "Σ prompt tokens of admitted requests (hits included) / "
       "prefill_busy_s", TIMED),
    _m("decode_throughput", "tokens/s", "Σ decode_steps / decode_busy_s", ("engine",)),
    _m("output_throughput", "tokens/s", "Σ output tokens of admitted requests (0 served as 1) / makespan_s", SERVING),
    _m("request_throughput", "requests/s", "admitted requests / makespan_s", SERVING),
    _m("makespan_s", "s", "latest finish − first arrival, on the driver's clock", SERVING),
    _m("busy_s", "s", "time the executor ran steps, summed over instances (device-seconds)", SERVING),
    _m("prefill_busy_s", "s", "time spent on prefill: serving, each step's time × its prefill tokens' share; "
       "engine, Σ prefill_s", TIMED),
    _m("decode_busy_s", "s", "Σ decode_s of admitted requests", ("engine",)),
    _m("utilization", "fraction", "busy_s / (makespan_s × instances)", SERVING),
    _m("preemptions", "count", "recompute preemptions (Σ preemptions column)", SERVING),
    _m("readmission_hit_tokens", "tokens", "Σ readmission_hit_tokens of admitted requests", SERVING),
    _m("recomputed_tokens", "tokens", "Σ over admitted requests of computed_tokens − (prompt − hit tokens) − "
       "(output − 1): work redone after preemption", SERVING),
    _m("computed_prompt_tokens", "tokens", "Σ computed_prompt_tokens of admitted requests (prompt tokens run "
       "through the model; engine results before the rename: computed_tokens)", ("engine",)),
    _m("generated_tokens", "tokens", "Σ generated_tokens (first token included)", ("engine",)),
    _m("decode_truncated", "requests", "requests whose decode stopped early for want of a free block", ("engine",)),
    _m("false_hit_blocks", "blocks", "Σ hit blocks whose true identity differs: wrong reuse", ("engine",)),
    _m("saved_prefill_flops", "FLOPs", "prefill FLOPs the hits of admitted requests avoided (model profile; "
       "attention over the cached context still costs)", SERVING),
    # memory and tiers
    _m("kv_bytes_per_token", "bytes", "2 × layers × kv_heads × head_dim × bytes per value (serving: the model "
       "profile, which may override it; engine: the pool layout)", TIMED),
    _m("kv_bytes_per_block", "bytes", "kv_bytes_per_token × block_size", TIMED),
    _m("kv_memory_peak_running_blocks", "blocks", "largest kv_running_blocks of any step (the largest instance's)",
       SERVING),
    _m("kv_memory_mean_running_blocks", "blocks", "kv_running_blocks averaged over step time, mean over instances",
       SERVING),
    _m("kv_memory_peak_running_bytes", "bytes", "kv_memory_peak_running_blocks × kv_bytes_per_block", SERVING),
    _m("kv_memory_final_cached_blocks", "blocks", "kv_cached_blocks of each instance's last step, summed over "
       "instances", SERVING),
    _m("max_kv_bytes_in_use", "bytes", "largest kv_bytes_in_use of any request", ("engine",)),
    _m("peak_device_memory_bytes", "bytes", "torch.cuda.max_memory_allocated on the engine's device (CUDA only)",
       ("engine",)),
    _m("tier_hits_hbm", "blocks", "blocks hit in HBM by admitted requests, first admissions and re-admissions",
       SERVING),
    _m("tier_bytes_hbm", "bytes", "tier_hits_hbm × kv_bytes_per_block: KV bytes the HBM hits served in place",
       SERVING),
    _m("device_token_hit_rate", "fraction", "Σ hit_tokens_device / Σ prompt tokens: the share served from the "
       "device itself; plus every tier's hit_share it is token_hit_rate (with tiers)", TIERED),
    _m("tiers", "list", "one entry per lower tier, the one below the device first: its configuration and counters "
       "(the summary.json tiers[] table; with tiers)", TIERED),
    _m("ttft_load_mean_s", "s", "mean of ttft_load_s over admitted requests (with tiers)", ("simulator",)),
    _m("tier_stall_s", "s", "Σ tier_stall_s of the time series: step time spent waiting for write-back copies and "
       "overlapped loads, summed over instances (with tiers)", ("simulator",)),
    _m("loaded_bytes", "bytes", "Σ load_bytes: KV bytes loaded from the lower tiers at first admissions (with "
       "tiers; 0 untimed)", ("simulator",)),
    # run statistics
    _m("steps", "count", "model steps executed, fast-forwarded ones included, summed over instances", SERVING),
    _m("iterations", "count", "scheduler iterations (a fast-forwarded run counts once), summed over instances",
       SERVING),
    _m("forward_calls", "count", "model forward calls the engine executor made (batched: one per step and "
       "adapter)", ("engine-serving",)),
    _m("batched", "bool", "each scheduler step ran as one packed forward over the paged pool (continuous "
       "batching) instead of one forward per entry", ("engine-serving",)),
    _m("sim_seconds", "s", "wall time of the driver's serving loop (engine-serving: equals wall_seconds)", SERVING),
    _m("wall_seconds", "s", "wall time of serving the whole trace", ENGINES),
    # the oracle (engine verify=True)
    _m("verified_requests", "requests", "requests the oracle checked: every admitted one (verify=True; "
       "engine-serving: each request's first completed prefill)", ("engine", "engine-serving")),
    _m("verify_failures", "requests", "verified requests whose verify_passed is False (verify=True)",
       ("engine", "engine-serving")),
    _m("verify_pass_rate", "fraction", "share of verified requests that passed, 1 when none (verify=True)",
       ("engine", "engine-serving")),
    _m("verify_max_logit_abs", "logit", "largest verify_logit_max_abs (verify=True)", ("engine", "engine-serving")),
    _m("verify_max_logit_rel", "ratio", "largest verify_logit_rel (verify=True)", ("engine",)),
    _m("verify_max_kv_abs", "K/V value", "largest verify_kv_max_abs (verify=True)", ("engine", "engine-serving")),
    _m("verify_argmax_agreement", "fraction", "share of verified requests with a clear margin whose argmax agrees, "
       "1 when none is clear (verify=True)", ("engine",)),
    _m("verify_greedy_agreement", "fraction", "mean of verify_greedy_agree / verify_greedy_k (verify=True)",
       ("engine",)),
)

#: ``requests.parquet`` columns (one row per request, trace order): name -> :class:`Metric`.
COLUMNS: dict[str, Metric] = _table(
    _m("request_id", "id", "the request's id in the trace (default: its row)"),
    _m("arrival", "s", "arrival time: trace seconds (replay, engine) or after time_scale / rate (serving)"),
    _m("prompt_tokens", "tokens", "prompt length"),
    _m("output_tokens", "tokens", "output length the trace gives (0: unknown; serving serves at least 1)"),
    _m("full_blocks", "blocks", "full prompt blocks: prompt_tokens // block_size"),
    _m("hit_blocks", "blocks", "prompt blocks found in the cache at (first) admission"),
    _m("hit_tokens", "tokens", "min(hit_blocks × block_size, prompt_tokens)"),
    _m("new_blocks", "blocks", "blocks allocated, partial one included: replay, at admission; engine, in prefill; "
       "serving, over the request's life"),
    _m("evictions", "blocks", "keyed blocks evicted to allocate new_blocks (same span as new_blocks)"),
    _m("orphan_evictions", "blocks", "those of evictions that were orphaned (an ancestor block not cached)"),
    _m("admitted", "bool", "admitted: replay and engine, its prompt fit; serving, admitted at least once"),
    _m("cached_blocks", "blocks", "blocks holding a key: replay and engine, after the request's release; serving, "
       "right after its first admission"),
    _m("orphan_blocks", "blocks", "cached blocks unreachable because an ancestor is not cached, when cached_blocks "
       "is taken"),
    _m("ideal_hit_tokens", "tokens", "hit tokens with unbounded capacity, same counting mode (serving: output "
       "blocks of earlier token-trace requests count too)"),
    _m("session", "id", "session id from the trace (when it has one)", ALL),
    _m("turn", "index", "1-based turn in its session, -1 unknown (when the trace has it)", ALL),
    _m("tenant", "label", "tenant from the trace (when it has one)", ALL),
    _m("category", "label", "request type from the trace (when it has one)", ALL),
    _m("adapter", "label", "adapter (LoRA) id from the trace (when it has one)", ("engine",)),
    _m("collisions", "blocks", "key hits refused because the block held other content (verify=True)", ("replay",)),
    _m("instance", "index", "serving instance the router assigned (instances > 1)", ("simulator",)),
    _m("hit_tokens_device", "tokens", "hit tokens found on the device (with tiers; plus every hit_tokens_<tier> it is "
       "hit_tokens; serving: at the first admission)", TIERED),
    _m("hit_tokens_<tier>", "tokens", "hit tokens loaded from the lower tier named <tier> (one column per tier, "
       "e.g. hit_tokens_dram; with tiers)", TIERED),
    _m("lower_found_tokens", "tokens", "tokens found below the device at the first admission, loaded or not (with "
       "tiers)", ("simulator",)),
    _m("load_decision", "label", "none (nothing found below the device), load (all found loaded), partial (a prefix "
       "loaded, the rest recomputed) or recompute (none loaded) (with tiers)", ("simulator",)),
    _m("load_limit", "label", "what kept found tokens from loading: max_load_tokens, prefetch (not staged by the "
       "slowest tier's prefetch), cost (load_or_recompute: recomputing finishes sooner); empty when all loaded "
       "(with tiers)", ("simulator",)),
    _m("load_est_s", "s", "estimated seconds, at admission, until the loadable found tokens are on the device "
       "(link and medium queues included; timed tiers, else 0)", ("simulator",)),
    _m("recompute_est_s", "s", "cost-model seconds of computing those tokens instead (timed tiers, else 0)",
       ("simulator",)),
    _m("load_bytes", "bytes", "KV bytes loaded from the lower tiers at the first admission (timed tiers, else 0)",
       ("simulator",)),
    _m("prefetched_tokens", "tokens", "tokens of the slowest tier that its prefetch had staged in host memory and "
       "that were loaded (tier_prefetch, else 0)", ("simulator",)),
    _m("ttft_load_s", "s", "time before the first token spent waiting for tier loads (WAITING_FOR_KV_LOAD, after "
       "admission) plus the stalls overlapped loads added to its steps (with tiers; 0 untimed)", ("simulator",)),
    _m("ttft_compute_s", "s", "ttft_s − queue_s − ttft_load_s: time from admission to first token spent in steps "
       "(with tiers)", ("simulator",)),
    # serving
    _m("admitted_s", "s", "time of the first admission", SERVING),
    _m("first_token_s", "s", "time the first token was sampled", SERVING),
    _m("finished_s", "s", "time the last token was sampled", SERVING),
    _m("ttft_s", "s", "time to first token: serving, first_token_s − arrival (queueing + prefill); engine, wall "
       "seconds of the prefill call (nothing queues); NaN if not admitted", TIMED),
    _m("tpot_s", "s", "time per output token after the first: serving, (finished_s − first_token_s) / (output − 1); "
       "engine, decode_s / decode_steps; NaN without decode", TIMED),
    _m("latency_s", "s", "finished_s − arrival", SERVING),
    _m("queue_s", "s", "admitted_s − arrival", SERVING),
    _m("preemptions", "count", "times the request was preempted (recompute)", SERVING),
    _m("readmission_hit_blocks", "blocks", "blocks hit at re-admissions after preemption, summed", SERVING),
    _m("readmission_hit_tokens", "tokens", "readmission_hit_blocks × block_size", SERVING),
    _m("computed_prompt_tokens", "tokens", "tokens computed at prompt positions, recomputation included (engine: "
       "prompt_tokens − hit_tokens; its results before the rename: computed_tokens)", TIMED),
    _m("prefill_tokens", "tokens", "tokens computed in prefill chunks (until a token is sampled after an admission)",
       SERVING),
    _m("computed_tokens", "tokens", "every token run through the model for the request, decode and recomputation "
       "included", SERVING),
    _m("rejected", "bool", "rejected at arrival: an empty prompt, or its whole sequence never fits the pool",
       SERVING),
    # engine
    _m("false_hit_blocks", "blocks", "hit blocks whose true identity (chained sha256, all extras) differs: wrong "
       "reuse", ("engine",)),
    _m("prefill_s", "s", "wall seconds of the prefill call (0 if not admitted)", ("engine",)),
    _m("lookup_s", "s", "prefill phase: hashing, lookup and allocation (evictions included)", ("engine",)),
    _m("gather_s", "s", "prefill phase: hit blocks, pool → working cache", ("engine",)),
    _m("forward_s", "s", "prefill phase: the model on the uncached suffix", ("engine",)),
    _m("scatter_s", "s", "prefill phase: new K/V, working cache → pool, and keying", ("engine",)),
    _m("prefill_tokens_per_s", "tokens/s", "computed_prompt_tokens / prefill_s (0 if not admitted)", ("engine",)),
    _m("kv_blocks_in_use", "blocks", "pool blocks held by running requests right after this prefill", ("engine",)),
    _m("kv_bytes_in_use", "bytes", "kv_blocks_in_use × kv_bytes_per_block", ("engine",)),
    _m("kv_bytes_cached", "bytes", "cached_blocks × kv_bytes_per_block", ("engine",)),
    _m("generated_tokens", "tokens", "tokens emitted, the first one included", ("engine",)),
    _m("decode_steps", "count", "decode steps run (one token each)", ("engine",)),
    _m("decode_s", "s", "wall seconds of the decode steps", ("engine",)),
    _m("decode_blocks", "blocks", "blocks allocated during decode", ("engine",)),
    _m("decode_evictions", "blocks", "keyed blocks evicted during decode", ("engine",)),
    _m("decode_truncated", "bool", "decode stopped early for want of a free block", ("engine",)),
    # the oracle, verify=True (kvlab.engine.verify.VerifyReport)
    _m("verify_logit_max_abs", "logit", "max |cached − reference| logit at the last prompt position (verify=True)",
       ("engine",)),
    _m("verify_logit_rel", "ratio", "verify_logit_max_abs / max |reference logit| (verify=True)", ("engine",)),
    _m("verify_logit_allowed", "logit", "allowed logit error: atol + rtol × max |reference logit| (verify=True)",
       ("engine",)),
    _m("verify_kv_max_abs", "K/V value", "max |pool K/V − reference K/V| over every prompt slot (verify=True)",
       ("engine",)),
    _m("verify_kv_rel", "ratio", "verify_kv_max_abs / max |reference K/V| (verify=True)", ("engine",)),
    _m("verify_kv_allowed", "K/V value", "allowed K/V error: atol + rtol × max |reference K/V| (verify=True)",
       ("engine",)),
    _m("verify_ref_margin", "logit", "reference top-1 − top-2 logit (verify=True)", ("engine",)),
    _m("verify_argmax_clear", "bool", "the reference margin exceeds margin_factor × the allowed logit error "
       "(verify=True)", ("engine",)),
    _m("verify_argmax_match", "bool", "cached and reference top-1 tokens agree (verify=True)", ("engine",)),
    _m("verify_greedy_k", "tokens", "greedy tokens compared (verify_tokens; verify=True)", ("engine",)),
    _m("verify_greedy_agree", "tokens", "leading greedy tokens that agree (verify=True)", ("engine",)),
    _m("verify_greedy_ok", "bool", "all greedy tokens agree, or the first mismatch had an unclear margin "
       "(verify=True)", ("engine",)),
    _m("verify_passed", "bool", "logits, K/V, argmax and greedy all within tolerance (verify=True)", ("engine",)),
)

#: ``timeseries.parquet`` columns (serving drivers; one row per step or fast-forwarded run): name -> :class:`Metric`.
TIMESERIES: dict[str, Metric] = _table(
    _m("instance", "index", "serving instance (0-based)", SERVING),
    _m("step", "index", "index of the row's first model step", SERVING),
    _m("time_s", "s", "clock time at the row's start", SERVING),
    _m("duration_s", "s", "duration of the row's steps", SERVING),
    _m("num_steps", "count", "model steps in the row (> 1: a fast-forwarded run of identical decode steps)",
       SERVING),
    _m("running", "requests", "running requests after the row", SERVING),
    _m("waiting", "requests", "waiting requests after the row's scheduling", SERVING),
    _m("batch_seqs", "requests", "sequences per step", SERVING),
    _m("batch_tokens", "tokens", "tokens per step", SERVING),
    _m("prefill_tokens", "tokens", "prefill tokens over the row's steps", SERVING),
    _m("decode_tokens", "tokens", "decode tokens over the row's steps (batch_tokens × num_steps = prefill + decode)",
       SERVING),
    _m("kv_running_blocks", "blocks", "blocks held by running requests during the row", SERVING),
    _m("kv_cached_blocks", "blocks", "blocks holding a key during the row", SERVING),
    _m("kv_evictable_blocks", "blocks", "cached blocks no running request holds, during the row", SERVING),
    _m("evictions", "blocks", "keyed blocks evicted in the row", SERVING),
    _m("preemptions", "count", "preemptions in the row", SERVING),
    _m("admissions", "requests", "requests admitted in the row", SERVING),
    _m("finished", "requests", "requests finished in the row", SERVING),
    _m("tier_hits_hbm", "blocks", "blocks hit in HBM at the row's admissions", SERVING),
    _m("tier_bytes_hbm", "bytes", "tier_hits_hbm × kv_bytes_per_block", SERVING),
    _m("kv_running_bytes", "bytes", "kv_running_blocks × kv_bytes_per_block", SERVING),
    _m("tier_blocks_<tier>", "blocks", "blocks the lower tier named <tier> holds when the row's first step starts "
       "(with tiers)", ("simulator",)),
    _m("tier_stall_s", "s", "time the row's first step waited beyond its compute: write-back copies of its "
       "evictions, overlapped loads (timed tiers, else 0)", ("simulator",)),
    _m("link_bytes_<link>", "bytes", "bytes reserved on the link preset named <link> (loads and stores) during the "
       "row (timed tiers)", ("simulator",)),
    _m("medium_bytes_<medium>", "bytes", "bytes read from or written to the medium preset named <medium> during "
       "the row (timed tiers)", ("simulator",)),
)

#: the fields of each entry of ``summary.json``'s ``tiers`` list (kvlab.tiers.results.tier_summary), one entry per
#: lower tier: its configuration, then its counters over the run. Blocks are of the run's block size (a chunked
#: tier counts whole chunks × chunk_blocks); bytes need a model (``model=`` / ``--model``), else they are null.
TIER_FIELDS: dict[str, Metric] = _table(
    _m("name", "label", "the tier's name (its requests column is hit_tokens_<name>)", TIERED),
    _m("capacity_blocks", "blocks", "the tier's size (gib=X converted with the model's KV bytes per block, "
       "rounded down)", TIERED),
    _m("capacity_gib", "GiB", "the tier's size in GiB of KV (capacity_blocks x KV bytes per block / 2^30) "
       "with a model, null without", TIERED),
    _m("policy", "label", "the tier's eviction policy (it sees the tier's stores, loads and touches)", TIERED),
    _m("write", "label", "when a block is stored here: write_through (computed on the device), "
       "write_through_selective (after selective_hits hits) or write_back (its last copy left the tier above)",
       TIERED),
    _m("selective_hits", "count", "hits a block needs while on the device before a write_through_selective tier "
       "stores it; null for the other write policies", TIERED),
    _m("inclusion", "label", "none (tiers independent), inclusive (keys resident above are pinned here) or "
       "exclusive (a key is in one tier at most)", TIERED),
    _m("chunk_blocks", "blocks", "blocks per chunk: the unit this tier stores, finds and evicts", TIERED),
    _m("touch", "bool", "every block of a request this tier holds is touched at its admission (a hit for the "
       "tier's policy), device hits included", TIERED),
    _m("hit_share", "fraction", "Σ hit_tokens_<tier> / Σ prompt tokens: the share of all prompt tokens loaded "
       "from this tier", TIERED),
    _m("local_hit_rate", "fraction", "blocks found here / blocks looked up here (past the hits of the tiers "
       "above, up to each request's hit limit)", TIERED),
    _m("found_hit_tokens", "tokens", "hit tokens found here, loaded or not (past max_load_tokens they are "
       "recomputed)", TIERED),
    _m("loaded_tokens", "tokens", "tokens loaded from this tier into device blocks (Σ hit_tokens_<tier>)",
       TIERED),
    _m("blocks_stored", "blocks", "blocks written into this tier", TIERED),
    _m("stores_skipped", "blocks", "stores refused for want of a free or evictable slot (every slot pinned)",
       TIERED),
    _m("stores_never_read", "blocks", "stored blocks evicted before any load read them (those still held at "
       "the end are not counted)", TIERED),
    _m("evictions", "blocks", "blocks this tier's policy evicted to make room for stores", TIERED),
    _m("moved_up_blocks", "blocks", "blocks dropped because the device now holds their key (inclusion "
       "exclusive)", TIERED),
    _m("bytes_written", "bytes", "blocks_stored × kv_bytes_per_block (null without a model; the engine: its pool's "
       "bytes per block)", TIERED),
    _m("bytes_read", "bytes", "loaded blocks × kv_bytes_per_block (null without a model; the engine: its pool's "
       "bytes per block)", TIERED),
    _m("write_amplification", "ratio", "bytes_written / bytes_read: bytes written per byte loaded back (null "
       "without a model or when nothing was loaded)", TIERED),
    # the engine's real stores (kvlab.engine.tiers)
    _m("store", "label", "where the engine keeps the tier's bytes: dram (host tensors) or disk (one file per slot "
       "under tier_dir)", ENGINES),
    _m("read_errors", "count", "slots found unreadable (corrupt, truncated, missing or stale file): a miss there, "
       "dropped from the tier, the blocks recomputed, never served", ENGINES),
    _m("write_errors", "count", "stores that failed (OSError: a full disk or quota, an I/O error): the key is not "
       "stored", ENGINES),
    _m("read_s", "s", "seconds of the tier's reads and checks at lookup and of its copies into the pool", ENGINES),
    _m("write_s", "s", "seconds of the tier's stores: copies out of the pool, checksums, writes, fsync, rename",
       ENGINES),
)

#: columns :mod:`kvlab.analysis.runs` adds to an experiment table (``kvlab.results.load``): per interval metric
#: ``<metric>`` (a name of :data:`METRICS` computed from ``requests.parquet``: token_hit_rate, ttft_mean_s, ...),
#: then per run. Not written by a driver, so not in :data:`TABLES`.
INTERVAL_COLUMNS: dict[str, Metric] = _table(
    _m("<metric>_warmed", "as <metric>", "the metric over the requests left after warm-up (warm-up 0: the summary's "
       "value)"),
    _m("<metric>_ci_low", "as <metric>", "lower end of the batch-means interval over contiguous warmed windows"),
    _m("<metric>_ci_high", "as <metric>", "upper end of the batch-means interval over contiguous warmed windows"),
    _m("<metric>_lag1", "ratio", "lag-1 autocorrelation of the window values (near 0: windows nearly independent)"),
    _m("<metric>_rep_mean", "as <metric>", "mean of <metric>_warmed over the replicate runs of one point"),
    _m("<metric>_rep_low", "as <metric>", "lower end of the t interval over the replicate runs' <metric>_warmed"),
    _m("<metric>_rep_high", "as <metric>", "upper end of the t interval over the replicate runs' <metric>_warmed"),
    _m("replicates", "count", "runs of one point (rows equal but for the replicate columns: seed, "
       "trace.resample_seed)"),
    _m("warmed_requests", "requests", "requests left after warm-up (counted in every <metric>_warmed)"),
    _m("warmup_requests", "requests", "warm-up: the first requests left out (AnalysisSpec)"),
    _m("warmup_seconds", "s", "warm-up: requests arriving less than this after the first left out (AnalysisSpec)"),
    _m("ci_windows", "count", "batch-means windows (AnalysisSpec.windows)"),
    _m("ci_level", "fraction", "confidence level of every interval (AnalysisSpec.confidence)"),
)

TABLES: dict[str, dict[str, Metric]] = {"summary.json": METRICS, "summary.json tiers[]": TIER_FIELDS,
                                        "requests.parquet": COLUMNS, "timeseries.parquet": TIMESERIES}

#: a placeholder in a table entry's name (``hit_tokens_<tier>``): it stands for a tier name
PLACEHOLDER = re.compile(r"<[a-z]+>")
_NAME = "[A-Za-z][A-Za-z0-9_]*"


def table_name(name: str, table: dict[str, Metric]) -> str | None:
    """The entry of ``table`` that a written ``name`` belongs to: ``name`` itself, or the pattern entry it
    matches (``hit_tokens_dram`` -> ``hit_tokens_<tier>``); None if neither."""
    if name in table:
        return name
    for entry in table:
        parts = PLACEHOLDER.split(entry)
        if len(parts) > 1 and re.fullmatch(_NAME.join(map(re.escape, parts)), name):
            return entry
    return None


def metrics_markdown() -> str:
    """The tables of :data:`TABLES` and :data:`INTERVAL_COLUMNS` in markdown (docs/metrics.md, between its
    markers), one section per file."""
    out = []
    for file, table in {**TABLES, "experiment table (kvlab.analysis.runs)": INTERVAL_COLUMNS}.items():
        out += [f"### `{file}`", "", "| name | unit | definition | drivers |", "|---|---|---|---|"]
        for m in table.values():
            definition = m.definition.replace("|", "\\|")
            out.append(f"| `{m.name}` | {m.unit} | {definition} | {', '.join(m.drivers)} |")
        out.append("")
    return "\n".join(out)
