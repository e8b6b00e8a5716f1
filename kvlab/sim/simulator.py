"""The serving simulator: the shared cache core and scheduler, driven in simulated time by the cost model.

``simulate(workload, config)`` (a :class:`SimConfig`) or ``simulate(workload, model=..., hardware=...,
policy=...)`` (its fields; given with a config, they override its fields) replays a trace's arrivals
(scaled by ``time_scale`` or to a target ``rate``) through :class:`~kvlab.sim.scheduler.Scheduler` with a
:class:`CostModelExecutor`, so concurrency and memory pressure shape TTFT, throughput, hits and
evictions. The KV pool is sized from the model and hardware (``gpu_memory_utilization``) unless
``capacity_blocks`` is given.

Results use the replay's column and metric names where they mean the same thing (hits are measured at
a request's first admission; re-admissions after preemption are reported in ``readmission_*``), plus
latencies and a per-step time series. Times are in seconds of simulated time; sizes in tokens or blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import pandas as pd
from pydantic import Field, model_validator
from tqdm.auto import tqdm

from kvlab.arguments import require_instance
from kvlab.cache import pool_blocks
from kvlab.errors import ConfigError
from kvlab.metrics import latency_stats, summarize
from kvlab.names import canonical_keys
from kvlab.policies.base import resolved_policy_params
from kvlab.profiles import (
    HardwareProfile,
    ModelProfile,
    check_tensor_parallel,
    kv_pool_blocks,
    load_hardware,
    load_model,
)
from kvlab.results import build_manifest, write_results
from kvlab.results.frame import DRIVER_COLUMNS, requests_frame
from kvlab.schema import HashScheme, Seed
from kvlab.sim.cost import CostModel
from kvlab.sim.scheduler import Entry, Request, RequestStatus, Scheduler, SimClock
from kvlab.sim.trace_requests import (  # noqa: F401 - also the simulator's public names (route_requests, ...)
    ROUTERS,
    TraceRequests,
    _labels,
    ideal_hits,
    make_manager,
    route_requests,
    scaled_arrivals,
    sequence_keys,
    serving_demand_blocks,
    trace_requests,
)
from kvlab.tiers.config import CacheConfig
from kvlab.tiers.spec import TIMING_FIELDS
from kvlab.workload.workload import Workload, require_workload


class CostModelExecutor:
    """The simulator's executor: a step lasts what the roofline cost model says (seconds)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def execute(self, batch: list[Entry]) -> float:
        return self.cost.duration([(n, c) for _, n, c in batch])

    def decode_durations(self, contexts: list[int], steps: int) -> np.ndarray:
        """Durations of ``steps`` identical decode steps (fast forward); element 0 = ``execute`` of the batch."""
        return self.cost.decode_durations(contexts, steps)


class SimConfig(CacheConfig):
    """Everything that determines a simulation's numbers (profiles by name or path; see :func:`simulate`).

    The cache fields and their checks (policy name, its parameters, the tier rules) are the ones every driver
    shares (kvlab.tiers.config.CacheConfig). Validated at construction (kvlab.schema): a bad value raises
    ConfigError naming the field, its CLI flag and the allowed range. Units: capacity in blocks per instance
    (None: sized from the model and hardware), rate in requests/s.
    """

    model: Annotated[str, Field(min_length=1)] = "llama-3-8b"
    hardware: Annotated[str, Field(min_length=1)] = "h100"
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    max_num_seqs: Annotated[int, Field(ge=1, le=1 << 20)] = 256
    max_num_batched_tokens: Annotated[int, Field(ge=1, le=1 << 24)] = 8192
    rate: Annotated[float, Field(ge=1e-9, le=1e9)] | None = None
    time_scale: Annotated[float, Field(ge=1e-9, le=1e9)] = 1.0
    tensor_parallel: Annotated[int, Field(ge=1, le=1024)] = 1
    dtype: str | None = None
    kv_dtype: str | None = None
    cache_at: Literal["schedule", "compute"] = "schedule"
    hash: HashScheme = "xxh3_128"
    root_seed: Seed = 0
    fast_forward: bool = True
    instances: Annotated[int, Field(ge=1, le=4096)] = 1
    router: Literal["prefix", "round_robin"] = "prefix"
    seed: Seed = 0
    # options of the tiers below the device (docs/tiers.md, "Timing in the simulator"); a tier naming a link or
    # medium is timed
    load_or_recompute: bool = False  # load a lower-tier hit only if that beats recomputing it (timed tiers)
    tier_overlap: bool = False  # loads pipelined layer by layer with the step's compute (timed tiers)
    tier_prefetch: Literal["off", "best_effort", "wait_complete", "timeout"] = "off"  # from the slowest tier
    prefetch_timeout_s: Annotated[float, Field(gt=0, le=1e6)] = 1.0  # tier_prefetch="timeout": longest wait
    kv_layout: Literal["layer", "block"] = "layer"  # transfer operations per layer (vLLM) or per chunk
    tier_sync_stores: bool = False  # every store on the critical path of its step (an engine that stores inline)

    _FIELD_ORDER: ClassVar[tuple[str, ...]] = (
        "model", "hardware", "policy", "policy_params", "capacity_blocks", "gpu_memory_utilization", "max_num_seqs",
        "max_num_batched_tokens", "rate", "time_scale", "block_size", "tensor_parallel", "dtype", "kv_dtype",
        "cache_at", "hash", "root_seed", "fast_forward", "instances", "router", "seed", "tiers", "max_load_tokens",
        "load_or_recompute", "tier_overlap", "tier_prefetch", "prefetch_timeout_s", "kv_layout", "tier_sync_stores")

    #: fields added after run identities were first written: left out of ``to_dict`` at their defaults, so a
    #: run without tiers keeps its run id
    _LATER: ClassVar[dict[str, Any]] = {
        "tiers": [], "max_load_tokens": None, "load_or_recompute": False, "tier_overlap": False,
        "tier_prefetch": "off", "prefetch_timeout_s": 1.0, "kv_layout": "layer", "tier_sync_stores": False}

    @model_validator(mode="after")
    def _rate_or_time_scale(self) -> SimConfig:
        if self.rate is not None and self.time_scale != 1.0:
            raise ValueError("give either rate (--rate) or time_scale (--time-scale), not both")
        timed = any(getattr(t, f) is not None for t in self.tiers for f in TIMING_FIELDS)
        for name in ("load_or_recompute", "tier_overlap", "tier_prefetch", "kv_layout", "tier_sync_stores"):
            if getattr(self, name) != self._LATER[name] and not self.tiers:
                raise ValueError(f"{name} applies to the tiers below the device: give tiers too")
            if getattr(self, name) != self._LATER[name] and not timed:
                raise ValueError(f"{name} needs timed tiers (a tier naming a link=, kvlab.tiers.timing)")
        if self.prefetch_timeout_s != self._LATER["prefetch_timeout_s"] and self.tier_prefetch != "timeout":
            raise ValueError(f"prefetch_timeout_s ({self.prefetch_timeout_s:g} s) is the longest wait of "
                             f"tier_prefetch=timeout; it has no effect with tier_prefetch={self.tier_prefetch}: give "
                             "tier_prefetch timeout too, or leave prefetch_timeout_s out")
        if timed:
            missing = [t.name for t in self.tiers if t.link is None]
            if missing:
                raise ValueError(f"tier {missing[0]!r}: link (link=) is needed when tiers are timed")
            if self.tier_prefetch != "off" and self.tiers[-1].medium is None:
                raise ValueError(f"tier_prefetch reads the slowest tier into host memory: the last tier "
                                 f"{self.tiers[-1].name!r} needs a medium (medium=)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> SimConfig:
        """tensor_parallel divides the model's heads (kvlab.profiles.check_tensor_parallel), checked here
        for a model named by a shipped name or file; a ModelProfile given to simulate() is checked by CostModel."""
        if self.tensor_parallel > 1:
            try:
                profile = load_model(self.model)
            except ConfigError:  # not loadable by name: a profile object's name, or refused where it is loaded
                profile = None
            if profile is not None:
                check_tensor_parallel(profile, self.tensor_parallel)
        return self

    def validate(self) -> None:
        """Kept for callers: construction already validated every field."""


@dataclass
class SimResult:
    """Per-request rows (trace order), the per-step time series and totals of one simulation."""

    requests: pd.DataFrame
    timeseries: pd.DataFrame
    summary: dict
    config: SimConfig
    trace: dict
    model: ModelProfile
    hardware: HardwareProfile

    def save(self, out: str | Path) -> Path:
        """Write requests.parquet, timeseries.parquet, summary.json and manifest.json to ``out`` atomically."""
        config = {**self.config.to_dict(), "model_profile": self.model.to_dict(),
                  "hardware_profile": self.hardware.to_dict()}
        manifest = build_manifest(config, trace=self.trace, seed=self.config.seed, driver="simulator")
        return write_results(out, {"requests": self.requests, "timeseries": self.timeseries}, self.summary, manifest)




def _pct(values: np.ndarray, q: float) -> float:
    values = values[np.isfinite(values)]
    return float(np.percentile(values, q)) if len(values) else math.nan


def serving_results(workload: Workload, trace: TraceRequests, schedulers: list[Scheduler], *, cost: CostModel,
                    capacity_blocks: int, block_size: int, model: ModelProfile, config: SimConfig, seconds: float,
                    route: np.ndarray | None = None) -> tuple[pd.DataFrame, pd.DataFrame, dict, dict]:
    """After the run: the per-request frame (``instance`` column from ``route`` if given), the per-step time
    series of every instance (bytes columns from the model's KV bytes per block), the summary (``seconds``:
    the driver's own run time; ``capacity_blocks``: the capacity as given, per instance) and the trace's
    identity."""
    outputs = [r.output_length for r in trace.requests]
    ideal = ideal_hits(trace.keys, trace.offsets, trace.prompt.tolist(), outputs, block_size)
    frame = _requests_frame(workload, trace.requests, trace.arrival, trace.prompt, trace.prompt_full, ideal,
                            block_size)
    if route is not None:
        frame["instance"] = route
    series = []
    for inst, scheduler in enumerate(schedulers):
        ts = scheduler.timeseries()
        ts.insert(0, "instance", inst)
        series.append(ts)
    timeseries = pd.concat(series, ignore_index=True)
    block_bytes = block_size * model.kv_bytes_per_token
    timeseries["tier_bytes_hbm"] = timeseries["tier_hits_hbm"] * block_bytes
    timeseries["kv_running_bytes"] = timeseries["kv_running_blocks"] * block_bytes
    summary = _summary(frame, timeseries, schedulers, cost, capacity_blocks, block_size, trace.scale, config, seconds)
    info = {"source": workload.source, "sha256": workload.checksum, **workload.identity()}
    return frame, timeseries, summary, info


def simulate(
    workload: Workload,
    config: SimConfig | None = None,
    *,
    progress: bool = False,
    **overrides: object,
) -> SimResult:
    """Simulate serving ``workload`` (see the module docstring and docs/simulator.md); ``overrides`` set
    :class:`SimConfig` fields, as :func:`kvlab.replay.replay` does with a ReplayConfig.

    ``model`` / ``hardware`` may also be a :class:`ModelProfile` / :class:`HardwareProfile` (used as given,
    recorded by name) or a path. ``block_size`` defaults to ``workload.default_block_size`` (the trace's on
    hash traces, else 16). ``cache_at`` chooses when a computed block becomes findable (``"schedule"``: vLLM
    v1, in the step that computes it; ``"compute"``: after that step). ``fast_forward=False`` steps decode
    runs one by one (same results, slower). ``instances`` > 1 simulates that many identical, independent
    serving instances (data parallel, one pool and scheduler each); ``router`` assigns requests to them
    (:func:`route_requests`). Output lengths of 0 are served as 1 token (a request samples at least one).
    """
    workload = require_workload(workload)  # a path or None: one ConfigError naming the argument
    require_instance(config, SimConfig, "config", optional=True)
    overrides = canonical_keys(overrides)  # old field names (kvlab.names) override under their new ones
    profiles = {}  # model / hardware as given: a profile object is loaded as is, the config holds its name
    for name, kind in (("model", ModelProfile), ("hardware", HardwareProfile)):
        if name in overrides:
            given = profiles[name] = overrides[name]
            overrides[name] = given.name if isinstance(given, kind) else str(given)
    if overrides.get("policy_params", {}) is None:
        overrides["policy_params"] = {}
    if config is None:
        config = SimConfig(**overrides)  # type: ignore[arg-type]  # validates every field before any work
    elif overrides:
        config = SimConfig(**{**config.to_dict(), **overrides})
    model_p = load_model(profiles.get("model", config.model), dtype=config.dtype, kv_dtype=config.kv_dtype)
    hw = load_hardware(profiles.get("hardware", config.hardware))
    bs = config.block_size or workload.default_block_size
    params = config.policy_params  # as given: the policy fills in its defaults itself
    # every default that changes numbers filled in (the run's identity); the capacity stays as given
    block_bytes = bs * model_p.kv_bytes_per_token
    config = config.replace(block_size=bs, policy_params=resolved_policy_params(config.policy, params),
                            tiers=[t.resolve(block_bytes) for t in config.tiers])
    cost = CostModel(model_p, hw, tensor_parallel=config.tensor_parallel)
    capacity = config.capacity_blocks or kv_pool_blocks(
        model_p, hw, bs, gpu_memory_utilization=config.gpu_memory_utilization, tensor_parallel=config.tensor_parallel,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
    )
    pool = pool_blocks(capacity, serving_demand_blocks(workload, bs))
    tr = trace_requests(workload, model_id=model_p.name, block_size=bs, rate=config.rate, time_scale=config.time_scale,
                        hash=config.hash, root_seed=config.root_seed)
    n = len(workload)
    route = route_requests(tr.keys, tr.offsets, tr.prompt_full.tolist(), config.instances, config.router)
    bar = tqdm(total=n, disable=not progress, desc=f"simulate {config.policy}", unit="req", mininterval=0.5)
    schedulers: list[Scheduler] = []
    servings: list = []
    records = None
    if config.tiers:
        from kvlab.tiers.serving import TierRecords

        records = TierRecords(n)
    t0 = time.perf_counter()
    try:
        for inst in range(config.instances):
            rows = np.flatnonzero(route == inst).tolist()
            reqs = [tr.requests[r] for r in rows]
            for seq, req in enumerate(reqs):
                req.ctx.seq = seq  # the request's index in its instance's (FCFS) order
            manager = make_manager(reqs, tr, policy=config.policy, policy_params=params, capacity_blocks=pool,
                                   block_size=bs, cache_at=config.cache_at, tiers=config.tiers,
                                   max_load_tokens=config.max_load_tokens)
            clock, executor, loads = SimClock(), CostModelExecutor(cost), None
            if config.tiers:
                executor, loads = _tiered(manager, executor, clock, config, cost, records, model_p.num_layers)
                servings.append(loads)
            scheduler = Scheduler(
                manager, executor, clock, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, fast_forward=config.fast_forward,
                on_finish=(lambda _req: bar.update()) if progress else None, loads=loads,
            )
            scheduler.run(reqs)
            schedulers.append(scheduler)
    finally:
        bar.close()
    sim_s = time.perf_counter() - t0

    frame, timeseries, summary, trace = serving_results(
        workload, tr, schedulers, cost=cost, capacity_blocks=capacity, block_size=bs, model=model_p, config=config,
        seconds=sim_s, route=route if config.instances > 1 else None)
    if config.tiers:
        from kvlab.tiers.serving import tier_results

        tier_results(frame, timeseries, summary, tr.requests, servings, records, config.tiers, bs, block_bytes)
    return SimResult(frame, timeseries, summary, config, trace, model_p, hw)


def _tiered(manager, executor: CostModelExecutor, clock: SimClock, config: SimConfig, cost: CostModel,  # noqa: ANN001
            records, layers: int) -> tuple:  # noqa: ANN001
    """One instance's tier serving (kvlab.tiers.serving): the executor that times its steps and the loads."""
    from kvlab.tiers.serving import TieredExecutor, TierServing
    from kvlab.tiers.timing import TierTiming

    timed = any(getattr(t, f) is not None for t in config.tiers for f in TIMING_FIELDS)
    block_bytes = manager.block_size * cost.model.kv_bytes_per_token
    timing = TierTiming(config.tiers, block_bytes, layers, config.kv_layout) if timed else None
    serving = TierServing(manager.cache.tiers, timing, cost, records, overlap=config.tier_overlap,
                          load_or_recompute=config.load_or_recompute, prefetch=config.tier_prefetch,
                          prefetch_timeout_s=config.prefetch_timeout_s, sync_stores=config.tier_sync_stores)
    manager.serving = serving
    return TieredExecutor(executor, serving, clock), serving


def _requests_frame(workload: Workload, requests: list[Request], arrival: np.ndarray, prompt: np.ndarray,
                    prompt_full: np.ndarray, ideal: np.ndarray, bs: int) -> pd.DataFrame:
    """The common per-request columns (:func:`kvlab.results.frame.requests_frame`; ``arrival``: the scaled
    arrivals, s), the serving columns (latencies in s, preemptions, re-admission hits), then the labels."""
    def col(name: str, dtype: type = np.int64) -> np.ndarray:
        return np.fromiter((getattr(r, name) for r in requests), dtype=dtype, count=len(requests))

    counts = {name: col(name) for name in DRIVER_COLUMNS if name != "admitted"}
    first = col("first_token_s", np.float64)
    finished = col("finished_s", np.float64)
    out = col("output_length")
    serving = {
        "admitted_s": col("admitted_s", np.float64),
        "first_token_s": first,
        "finished_s": finished,
        "ttft_s": first - arrival,
        "tpot_s": np.where(out > 1, (finished - first) / np.maximum(out - 1, 1), np.nan),
        "latency_s": finished - arrival,
        "queue_s": col("admitted_s", np.float64) - arrival,
        "preemptions": col("preemptions"),
        "readmission_hit_blocks": col("readmission_hit_blocks"),
        "readmission_hit_tokens": col("readmission_hit_blocks") * bs,
        "computed_prompt_tokens": col("computed_prompt_tokens"),
        "prefill_tokens": col("prefill_tokens"),
        "computed_tokens": col("computed_tokens"),
        "rejected": col("status") == RequestStatus.REJECTED,
    }
    return requests_frame(workload, bs, {**counts, "admitted": col("admissions") > 0}, ideal, arrival=arrival,
                          prompt_tokens=prompt, full_blocks=prompt_full, extra=serving)


def _summary(frame: pd.DataFrame, ts: pd.DataFrame, schedulers: list[Scheduler], cost: CostModel,
             capacity_blocks: int, bs: int, scale: float, config: SimConfig, sim_s: float) -> dict:
    """Replay metric names (hit rates, evictions) plus latency, throughput, memory and tier metrics.

    With several instances, busy times add up (device-seconds), ``makespan_s`` is the latest finish,
    ``capacity_blocks`` and the ``kv_memory_*`` figures are per instance (peak: the largest instance's).
    """
    done = frame[frame["admitted"]]
    end = max(s.clock.now() for s in schedulers)
    makespan = float(end - frame["arrival"].min()) if len(frame) else 0.0
    summary = summarize(frame, duration_s=makespan, capacity_blocks=capacity_blocks)
    summary["rejected_requests"] = int(frame["rejected"].sum())
    summary.update(latency_stats(frame))  # TTFT / TPOT over the admitted requests (kvlab.metrics)
    summary["latency_p50_s"] = _pct(done["latency_s"].to_numpy(), 50)
    prefill_s = sum(s.prefill_busy_s for s in schedulers)
    busy_s = sum(s.busy_s for s in schedulers)
    block_bytes = bs * cost.model.kv_bytes_per_token
    peak = mean = final = 0
    for _, part in ts.groupby("instance", sort=True):
        run, w = part["kv_running_blocks"].to_numpy(), part["duration_s"].to_numpy()
        peak = max(peak, int(run.max()))
        mean += float((run * w).sum() / w.sum()) / len(schedulers) if w.sum() else 0.0
        final += int(part["kv_cached_blocks"].iloc[-1])
    hits = int(done["hit_blocks"].sum() + done["readmission_hit_blocks"].sum())
    recomputed = done["computed_tokens"] - (done["prompt_tokens"] - done["hit_tokens"]) - (
        np.maximum(done["output_tokens"], 1) - 1)
    arrival = frame["arrival"].to_numpy()
    span = float(arrival[-1] - arrival[0]) if len(arrival) > 1 else 0.0
    summary.update(
        prefill_throughput=float(done["prefill_tokens"].sum()) / prefill_s if prefill_s else 0.0,
        effective_prefill_throughput=float(done["prompt_tokens"].sum()) / prefill_s if prefill_s else 0.0,
        output_throughput=float(np.maximum(done["output_tokens"], 1).sum()) / makespan if makespan else 0.0,
        request_throughput=len(done) / makespan if makespan else 0.0,
        makespan_s=makespan,
        busy_s=busy_s,
        prefill_busy_s=prefill_s,
        utilization=busy_s / (makespan * len(schedulers)) if makespan else 0.0,
        preemptions=int(frame["preemptions"].sum()),
        readmission_hit_tokens=int(done["readmission_hit_tokens"].sum()),
        recomputed_tokens=int(recomputed.sum()),
        saved_prefill_flops=float(cost.saved_prefill_flops(done["prompt_tokens"], done["hit_tokens"]).sum()),
        kv_bytes_per_token=cost.model.kv_bytes_per_token,
        kv_bytes_per_block=block_bytes,
        kv_memory_peak_running_blocks=peak,
        kv_memory_mean_running_blocks=mean,
        kv_memory_peak_running_bytes=peak * block_bytes,
        kv_memory_final_cached_blocks=final,
        tier_hits_hbm=hits,
        tier_bytes_hbm=hits * block_bytes,
        capacity_blocks=capacity_blocks,
        block_size=bs,
        policy=config.policy,
        cache_at=config.cache_at,
        model=cost.model.name,
        hardware=cost.hardware.name,
        tensor_parallel=cost.tensor_parallel,
        instances=len(schedulers),
        router=config.router,
        calibration="calibrated" if cost.calibrated else "uncalibrated",
        cost_model=cost.label,
        time_scale=scale,
        rate=(len(frame) - 1) / span if span > 0 else None,
        steps=sum(s.num_steps for s in schedulers),
        iterations=sum(s.num_iterations for s in schedulers),
        sim_seconds=sim_s,
    )
    return summary
