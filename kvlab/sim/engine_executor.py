"""The real engine as the scheduler's executor: the same scheduler and KV manager, measured time.

:class:`EngineExecutor` implements :class:`~kvlab.sim.scheduler.Executor` with a
:class:`~kvlab.engine.Engine`: for each batch entry ``(request, n, c)`` it runs the model forward for the
request's tokens ``[c, c + n)`` over the ``c`` tokens already in the request's blocks, one sequence per
forward call (:meth:`Engine.forward_tokens`). The scheduler's :class:`~kvlab.cache.manager.KVCacheManager`
owns allocation, keys and eviction; its cache core's block ids are the engine's KV-pool block ids, so the
engine only computes (and writes each computed position into the pool block the manager gave it).

:func:`run_engine_serving` serves a token trace with arrivals through that executor and returns the
simulator's result type, with the simulator's columns, so the two compare row by row.

Clocks (``timer``):

* ``"wall"`` (default): :class:`~kvlab.sim.scheduler.WallClock`; idle gaps are slept through and a step
  lasts the wall seconds it took (device work synchronised). The measurement on a dedicated machine.
* ``"thread"``: :class:`ThreadClock`, the serving thread's CPU seconds, with idle gaps skipped instead of
  slept. On a shared CPU (other jobs competing for the cores) wall times stretch by whatever else runs;
  CPU time measures the engine's own work (with one torch thread all of it runs in the calling thread).
  CPU only: on an accelerator the thread time misses the device's work.

Units: seconds, tokens, blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.cache import pool_blocks
from kvlab.errors import ConfigError
from kvlab.results import build_manifest, write_results
from kvlab.sim.cost import CostModel
from kvlab.sim.profiles import HardwareProfile, ModelProfile, load_hardware
from kvlab.sim.scheduler import Entry, Request, Scheduler, WallClock
from kvlab.sim.simulator import (
    SimConfig,
    SimResult,
    _labels,
    make_manager,
    serving_demand_blocks,
    serving_results,
    trace_requests,
)
from kvlab.workload.workload import Workload

TIMERS = ("wall", "thread")


def sync_device(device: torch.device) -> None:
    """Wait for queued device work (CUDA/MPS) so host timers cover it; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class ThreadClock:
    """Engine time on a shared CPU: the calling thread's CPU seconds since construction, idle gaps skipped.

    ``wait_until(t)`` jumps to ``t`` instead of sleeping (nothing runs while idle). Not ``simulated``:
    the scheduler treats it like a wall clock (a step's time has passed when the executor returns).
    """

    simulated = False

    def __init__(self) -> None:
        self._t0 = time.thread_time()
        self._skipped = 0.0

    def now(self) -> float:
        return time.thread_time() - self._t0 + self._skipped

    def advance(self, seconds: float) -> None:
        """Nothing to do: the executor spent ``seconds`` of this thread's CPU time."""

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            self._skipped += delay


@contextlib.contextmanager
def gc_paused():
    """Collect garbage, then keep the cyclic collector off (its pauses would land in measured steps)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def make_clock(timer: str) -> WallClock | ThreadClock:
    """The scheduler clock of a ``timer`` (``"wall"`` or ``"thread"``)."""
    if timer == "wall":
        return WallClock()
    if timer == "thread":
        return ThreadClock()
    raise ConfigError(f"timer must be one of {TIMERS}, got {timer!r}")


def timer_function(timer: str):
    """``time.perf_counter`` (``"wall"``) or ``time.thread_time`` (``"thread"``): seconds."""
    if timer == "wall":
        return time.perf_counter
    if timer == "thread":
        return time.thread_time
    raise ConfigError(f"timer must be one of {TIMERS}, got {timer!r}")


@dataclass(eq=False)
class EngineSequence:
    """The token side of one request on the engine (the manager holds its blocks).

    ``tokens``: the known sequence, prompt then sampled tokens (a sampled token is the known output
    ``outputs[k]`` where the trace has one, teacher forcing, else the argmax). ``working``: the request's
    working cache (transformers ``DynamicCache``) holding positions ``[0, working_len)``, reused by its
    next step when that step starts there; dropped on re-admission after a preemption.
    """

    tokens: list[int]
    prompt_tokens: int
    outputs: np.ndarray | None = None
    adapter: str | None = None
    working: object | None = None
    working_len: int = 0
    admission: int = -1
    sampled: list[int] = field(default_factory=list)


class EngineExecutor:
    """Runs the scheduler's batches on a real :class:`~kvlab.engine.Engine` and returns measured seconds.

    Register each request with :meth:`add` before the scheduler can schedule it, and :meth:`discard` it
    when it finishes (``Scheduler(on_finish=executor.discard)``). Entries run in batch order, one
    sequence per forward call, so a block keyed at scheduling (``cache_at="schedule"``) is computed by
    the earlier entry that owns it before a later entry of the same step reads it. ``timer``: ``"wall"``
    or ``"thread"`` (module docstring). The engine's own cache core is not used: the manager's is, and
    its block ids must lie below ``engine.num_blocks`` (the pool).
    """

    def __init__(self, engine, *, timer: str = "wall") -> None:
        self.engine = engine
        self.timer = timer
        self._time = timer_function(timer)
        self.device = engine.device
        self._seqs: dict[Request, EngineSequence] = {}
        self.generated: dict[int, list[int]] = {}  # request row -> tokens sampled (kept after discard)
        self.forward_calls = 0

    # ------------------------------------------------------------------ sequences
    def add(self, req: Request, prompt: np.ndarray | Sequence[int], outputs: np.ndarray | None = None,
            adapter: str | None = None) -> EngineSequence:
        """Register ``req``'s prompt token ids (and known output ids, fed instead of sampled ones)."""
        prompt = np.asarray(prompt, dtype=np.int64)
        if len(prompt) != req.prompt_tokens:
            raise ConfigError(f"request {req.request_id}: {len(prompt)} prompt ids for {req.prompt_tokens} tokens")
        vocab = self.engine.vocab_size
        for ids in (prompt, outputs):
            if ids is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ConfigError(f"request {req.request_id}: token ids must lie in [0, {vocab}) for this model")
        seq = EngineSequence(prompt.tolist(), len(prompt), None if outputs is None else np.asarray(outputs),
                             adapter)
        self._seqs[req] = seq
        return seq

    def discard(self, req: Request) -> None:
        """Forget a finished request (drops its working cache; its sampled tokens stay in ``generated``)."""
        seq = self._seqs.pop(req, None)
        if seq is not None:
            self.generated[req.row] = seq.sampled

    def sequence(self, req: Request) -> EngineSequence:
        seq = self._seqs.get(req)
        if seq is None:
            raise ConfigError(f"request {req.request_id} was not registered with EngineExecutor.add")
        return seq

    # ------------------------------------------------------------------ one entry
    def run_entry(self, seq: EngineSequence, block_ids: Sequence[int], n: int, c: int) -> None:
        """Compute positions ``[c, c + n)`` of ``seq`` stored in ``block_ids``; sample when all known tokens are
        computed. The per-entry code path of :meth:`execute` (calibration times exactly this)."""
        if c + n > len(seq.tokens):
            raise ConfigError(f"scheduled tokens [{c}, {c + n}) exceed the {len(seq.tokens)} known tokens")
        working = seq.working if seq.working is not None and seq.working_len == c else None
        logits, working = self.engine.forward_tokens(seq.tokens[c:c + n], block_ids, c, working=working,
                                                     adapter=seq.adapter)
        self.forward_calls += 1
        seq.working, seq.working_len = working, c + n
        if c + n == len(seq.tokens):  # every known token computed: the scheduler samples one now
            k = len(seq.tokens) - seq.prompt_tokens
            out = seq.outputs
            tok = int(out[k]) if out is not None and k < len(out) else int(logits.argmax())
            seq.tokens.append(tok)
            seq.sampled.append(tok)

    def execute(self, batch: Sequence[Entry]) -> float:
        """Run every entry (one forward each, in order); seconds measured by the timer (device synchronised)."""
        sync_device(self.device)
        t0 = self._time()
        for req, n, c in batch:
            seq = self.sequence(req)
            if seq.admission != req.admissions:  # (re-)admitted: a working cache from before is stale
                seq.working, seq.working_len, seq.admission = None, 0, req.admissions
            self.run_entry(seq, [b.block_id for b in req.blocks], n, c)
        sync_device(self.device)
        return self._time() - t0


# ---------------------------------------------------------------------- model profile of an engine
def engine_model_profile(engine_or_model, name: str | None = None) -> ModelProfile:
    """The cost model's :class:`ModelProfile` of the engine's transformers model (its config and dtypes).

    ``name`` defaults to the shape of a random model (``random:cpu-bench:seed0`` -> ``cpu-bench``) or the
    checkpoint name. The KV dtype is the engine's pool dtype.
    """
    is_engine = hasattr(engine_or_model, "forward_tokens")
    model = engine_or_model.model if is_engine else engine_or_model
    config = model.config.to_dict()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"] = dtype
    if name is None:
        mid = str(getattr(model, "kvlab_model_id", "") or config.get("_name_or_path") or config.get("model_type"))
        name = mid.split(":")[1] if mid.startswith("random:") else mid
    profile = ModelProfile.from_hf_config(config, name=name)
    layout = engine_or_model.layout if is_engine else None
    kv = str(layout.dtype).removeprefix("torch.") if layout is not None else None
    return profile.with_dtypes(kv_dtype=kv if kv and kv != dtype else None)


def default_hardware(device: torch.device) -> str:
    """The shipped hardware profile closest to ``device`` (by the CUDA device name; ``cpu-local`` on CPU)."""
    if device.type != "cuda":
        return "cpu-local"
    name = torch.cuda.get_device_name(device).lower()
    for key, profile in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"), ("l40s", "l40s"),
                         ("4090", "rtx-4090")):
        if key in name:
            return profile
    raise ConfigError(f"no shipped hardware profile for {name!r}: pass hardware= (a profile JSON)")


# ---------------------------------------------------------------------- whole runs
@dataclass
class EngineServingResult(SimResult):
    """:class:`SimResult` of a trace served by the real engine (same columns); ``engine``: its config;
    ``generated``: the tokens each request (by row) sampled (known outputs where the trace has them)."""

    engine: dict = field(default_factory=dict)
    generated: dict = field(default_factory=dict)

    def save(self, out: str | Path) -> Path:
        """Write requests.parquet, timeseries.parquet, summary.json and manifest.json (driver ``engine-serving``)."""
        config = {**self.config.to_dict(), "model_profile": self.model.to_dict(),
                  "hardware_profile": self.hardware.to_dict(), "engine": self.engine}
        manifest = build_manifest(config, trace=self.trace, seed=self.config.seed, driver="engine-serving")
        return write_results(out, {"requests": self.requests, "timeseries": self.timeseries}, self.summary, manifest)


class _StoppedClock:
    """A clock frozen at the end of a run (the summary reads ``now()`` as the makespan's end)."""

    simulated = True

    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def warm_up(engine, steps: int = 2, tokens: int = 32) -> None:
    """A few untimed forward passes (allocator, kernels, caches), written to pool blocks nobody holds yet."""
    rng = np.random.default_rng(0)
    bs = engine.block_size
    blocks = list(range(min(engine.num_blocks, -(-(tokens + 1) // bs))))
    tokens = min(tokens, len(blocks) * bs - 1)
    for _ in range(steps):
        ids = rng.integers(0, engine.vocab_size, tokens + 1)
        _, working = engine.forward_tokens(ids[:tokens], blocks, 0)
        engine.forward_tokens(ids[tokens:], blocks, tokens, working=working)
    sync_device(engine.device)


def run_engine_serving(
    workload: Workload,
    engine,
    *,
    policy: str = "lru",
    policy_params: dict | None = None,
    capacity_blocks: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    rate: float | None = None,
    time_scale: float = 1.0,
    cache_at: str = "schedule",
    hash: str = "xxh3_128",
    root_seed: int = 0,
    timer: str = "wall",
    model: ModelProfile | None = None,
    hardware: str | Path | HardwareProfile | None = None,
    warmup: int = 2,
    seed: int = 0,
    progress: bool = False,
) -> EngineServingResult:
    """Serve a token ``workload`` with arrivals through the scheduler and the real engine (measured time).

    Arguments mean what they mean in :func:`~kvlab.sim.simulate` (same scheduler, manager, hashing and
    arrival scaling, so per-request hits equal the simulator's wherever scheduling decisions do not depend
    on timing, e.g. ``max_num_seqs=1``). The pool is the engine's: ``capacity_blocks`` (default: all its
    blocks) of ``engine.block_size`` tokens; a fresh cache core with ``policy`` runs over it, so the run
    starts cold (the engine's own cache core is ignored; do not use the engine elsewhere meanwhile).
    ``model``: the cost-model profile of the engine's model (default: :func:`engine_model_profile`), whose
    name seeds the block keys as in the simulator; ``hardware`` only labels the result (default: the
    shipped profile of the device). ``timer``: ``"wall"`` or ``"thread"`` (module docstring). Times in
    the result are seconds of that clock since the start of serving.
    """
    if workload.kind != "tokens":
        raise ConfigError("the engine serves token workloads (expand a block-id trace first)")
    model_p = model if model is not None else engine_model_profile(engine)
    if hardware is None:
        try:
            hardware = default_hardware(engine.device)
        except ConfigError:  # an unlisted GPU: the profile only labels the result here
            hardware = "h100"
    hw = load_hardware(hardware)
    bs = engine.block_size
    capacity = int(capacity_blocks or engine.num_blocks)
    pool = pool_blocks(capacity, serving_demand_blocks(workload, bs))
    if not 1 <= pool <= engine.num_blocks:
        raise ConfigError(f"capacity_blocks must be in 1..{engine.num_blocks} (the engine's pool), got {capacity}")
    if timer == "thread" and engine.device.type != "cpu":
        raise ConfigError("timer='thread' measures CPU time: use timer='wall' on an accelerator")
    config = SimConfig(
        model=model_p.name, hardware=f"engine:{engine.device}", policy=policy, policy_params=dict(policy_params or {}),
        capacity_blocks=capacity, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, rate=rate,
        time_scale=time_scale, block_size=bs, cache_at=cache_at, hash=hash, root_seed=root_seed, fast_forward=False,
        seed=seed,
    )
    config.validate()
    make_clock(timer)  # validates the name before any work
    cost = CostModel(model_p, hw)
    tr = trace_requests(workload, model_id=model_p.name, block_size=bs, rate=rate, time_scale=time_scale, hash=hash,
                        root_seed=root_seed)
    n = len(workload)
    requests = tr.requests
    adapter = _labels(workload.adapter, n)
    executor = EngineExecutor(engine, timer=timer)
    for r, req in enumerate(requests):
        executor.add(req, workload.prompt(r), workload.output(r), adapter[r])
    manager = make_manager(requests, tr, policy=policy, policy_params=policy_params, capacity=pool, block_size=bs,
                           cache_at=cache_at)
    bar = tqdm(total=n, disable=not progress, desc=f"engine {policy}", unit="req", mininterval=0.5)

    def on_finish(req: Request) -> None:
        executor.discard(req)
        bar.update()

    if warmup:
        warm_up(engine, warmup)
    clock = make_clock(timer)
    scheduler = Scheduler(manager, executor, clock, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, fast_forward=False, on_finish=on_finish)
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), gc_paused():
            scheduler.run(requests)
    finally:
        bar.close()
    end = clock.now()
    wall = time.perf_counter() - t0
    scheduler.clock = _StoppedClock(end)

    frame, timeseries, summary, trace = serving_results(
        workload, tr, [scheduler], cost=cost, capacity=capacity, block_size=bs, model=model_p, config=config,
        seconds=wall)
    summary.update(
        executor="engine", timer=timer, device=str(engine.device), engine_model_id=engine.model_id,
        calibration="measured", cost_model=f"measured:{model_p.name}@{engine.device}", hardware=str(engine.device),
        forward_calls=executor.forward_calls, wall_seconds=wall,
    )
    engine_config = {**engine.config(), "timer": timer, "pool_blocks_used": pool}
    return EngineServingResult(frame, timeseries, summary, config, trace, model_p, hw, engine=engine_config,
                               generated=dict(executor.generated))


def zero_arrivals(workload: Workload) -> Workload:
    """The workload with every arrival at t = 0 (a saturation run: the queue holds the whole trace)."""
    return dataclasses.replace(workload, arrival=np.zeros(len(workload)), meta=dict(workload.meta))


def saturation_throughput(result: SimResult) -> float:
    """Requests per second a run with every arrival at 0 sustained: admitted requests / makespan."""
    frame = result.requests
    done = frame[frame["admitted"]]
    span = float(done["finished_s"].max()) if len(done) else math.nan
    return len(done) / span if span > 0 else math.nan


def ttft_errors(engine_requests: pd.DataFrame, sim_requests: pd.DataFrame) -> pd.DataFrame:
    """Per-request TTFT of both runs and the relative error ``|sim - engine| / engine`` (row by row)."""
    if len(engine_requests) != len(sim_requests) or not (
        engine_requests["request_id"].to_numpy() == sim_requests["request_id"].to_numpy()
    ).all():
        raise ConfigError("the two runs must hold the same requests in the same order")
    eng = engine_requests["ttft_s"].to_numpy(np.float64)
    sim = sim_requests["ttft_s"].to_numpy(np.float64)
    return pd.DataFrame({
        "request_id": engine_requests["request_id"].to_numpy(),
        "ttft_engine_s": eng,
        "ttft_sim_s": sim,
        "ttft_rel_error": np.abs(sim - eng) / eng,
        "hit_blocks_engine": engine_requests["hit_blocks"].to_numpy(),
        "hit_blocks_sim": sim_requests["hit_blocks"].to_numpy(),
    })


# ---------------------------------------------------------------------- fidelity: engine vs simulator
@dataclass
class FidelityResult:
    """Engine vs simulator on one trace: one ``table`` row per load, per-request ``requests`` rows
    (``load``, TTFTs, relative error, hits of both), the measured saturation throughput (requests/s), the
    profile the simulator used and, when the study calibrated it, the :class:`Calibration`."""

    table: pd.DataFrame
    requests: pd.DataFrame
    saturation_rps: float
    hardware: HardwareProfile
    config: dict
    calibration: object | None = None  # kvlab.sim.calibrate.Calibration


def fidelity(
    workload: Workload,
    engine,
    hardware: HardwareProfile | str | Path | None = None,
    *,
    loads: Sequence[float] = (0.5, 0.8),
    repeats: int = 1,
    saturation_repeats: int | None = None,
    timer: str = "wall",
    model: ModelProfile | None = None,
    policy: str = "lru",
    capacity_blocks: int | None = None,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 512,
    cache_at: str = "schedule",
    saturation_rps: float | None = None,
    grid: Sequence | None = None,
    base_hardware: HardwareProfile | str | None = None,
    progress: bool = False,
) -> FidelityResult:
    """Replay ``workload`` through the real engine and through the simulator at each load, a fraction of the
    engine's saturation throughput; compare TTFT request by request.

    ``hardware``: a calibrated profile of this device; None calibrates within the study
    (:mod:`kvlab.sim.calibrate`, nominal peaks from ``base_hardware``) over ``grid``, by default
    :func:`~kvlab.sim.calibrate.grid_for_limits` of the configuration (chunks up to the token budget,
    contexts up to the longest sequence: the deployment's ``max_model_len``, not the trace's mix):
    one round of the grid (each batch timed once, shuffled) is measured before the first engine run and
    after every engine run, and the fit uses each batch's median over all rounds — so the calibration sees
    the machine in the same states as the engine runs (other jobs on a shared CPU come and go). The trace
    itself is never used for the fit.

    Saturation (requests/s, unless given) is measured first: the engine serves the trace with every
    arrival at t = 0 (``saturation_repeats`` times, default ``repeats``, the median kept: it sets the load of
    every later run). At load
    ``x`` the arrivals are scaled to the rate ``x × saturation`` for both runs (same scheduler settings,
    pool, policy). The engine run is repeated ``repeats`` times (the loads alternate) and each request's
    engine TTFT is its median over the repeats. Per-request error: ``|TTFT_sim − TTFT_engine| /
    TTFT_engine``; for reference, ``engine_rerun_*_error`` compare the engine's repeats with one another
    (every ordered pair of runs, same formula): the noise floor of one run on this machine, and
    ``engine_split_half_*_error`` compare the median of the odd-numbered repeats with that of the even-numbered
    ones: the noise of a median of ``repeats / 2`` runs, an upper bound for that of the reported median.
    Each request's TTFT in every engine run is kept (``ttft_engine_runs_s``).
    ``max_num_seqs=1`` (default): every step holds one sequence, the setting in which the engine's
    one-sequence-per-forward execution is what the cost model describes; scheduling then does not depend
    on timing, so hits agree exactly (``hits_equal``).
    """
    from kvlab.sim.calibrate import calibrate, combine_rounds, grid_for_limits, measure_steps
    from kvlab.sim.simulator import simulate

    saturation_repeats = repeats if saturation_repeats is None else saturation_repeats
    if repeats < 1 or saturation_repeats < 1 or not loads or min(loads) <= 0:
        raise ConfigError("fidelity needs repeats >= 1, saturation_repeats >= 1 and loads > 0")
    model_p = model if model is not None else engine_model_profile(engine)
    rounds: list[pd.DataFrame] = []
    if grid is None:  # the configuration's limits: chunks up to the token budget, contexts up to max_model_len
        longest = int((workload.input_length + np.maximum(workload.output_length, 1)).max())
        grid = grid_for_limits(min(max_num_batched_tokens, int(workload.input_length.max())), longest)
    points = list(grid)

    def measure_round() -> None:
        if hardware is None:
            rounds.append(measure_steps(engine, points, repeats=1, timer=timer, seed=len(rounds),
                                        warmup=0 if rounds else 2))

    common = dict(policy=policy, capacity_blocks=capacity_blocks or engine.num_blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, cache_at=cache_at)
    serve = dict(common, timer=timer, model=model_p, progress=progress)
    measure_round()
    saturation_runs: list[float] = []
    if saturation_rps is None:
        for _ in range(saturation_repeats):
            saturation_runs.append(saturation_throughput(run_engine_serving(zero_arrivals(workload), engine,
                                                                            **serve)))
            measure_round()
        saturation_rps = float(np.median(saturation_runs))
    engine_runs: dict[float, list[EngineServingResult]] = {float(load): [] for load in loads}
    for _ in range(repeats):  # loads alternate, so that each sees the machine in the same states
        for load in engine_runs:
            engine_runs[load].append(run_engine_serving(workload, engine, rate=load * saturation_rps, **serve))
            measure_round()
    cal = None
    if hardware is None:
        cal = calibrate(engine, base_hardware=base_hardware, timer=timer, model=model_p,
                        samples=combine_rounds(rounds))
        hw = cal.hardware
    else:
        hw = load_hardware(hardware)
    rows, per_request = [], []
    for load, runs in engine_runs.items():
        rate = float(load) * saturation_rps
        sim = simulate(workload, rate=rate, model=model_p, hardware=hw, block_size=engine.block_size, **common)
        eng_req = runs[0].requests.copy()
        ttfts = np.stack([r.requests["ttft_s"].to_numpy(np.float64) for r in runs])
        eng_req["ttft_s"] = np.median(ttfts, axis=0)
        err = ttft_errors(eng_req, sim.requests)
        err.insert(0, "load", float(load))
        err["arrival_s"] = sim.requests["arrival"].to_numpy()
        err["prompt_tokens"] = sim.requests["prompt_tokens"].to_numpy()
        err["ttft_engine_spread"] = (ttfts.max(axis=0) - ttfts.min(axis=0)) / err["ttft_engine_s"]
        err["ttft_engine_runs_s"] = list(ttfts.T)
        per_request.append(err)
        e = err["ttft_rel_error"].to_numpy()
        busy = [r.summary["busy_s"] for r in runs]
        rerun = [np.abs(ttfts[i] - ttfts[j]) / ttfts[j] for i in range(repeats) for j in range(repeats) if i != j]
        rerun_e = np.concatenate(rerun) if rerun else np.array([np.nan])
        if repeats >= 2:
            odd, even = np.median(ttfts[1::2], axis=0), np.median(ttfts[0::2], axis=0)
            split_e = np.concatenate([np.abs(odd - even) / even, np.abs(even - odd) / odd])
        else:
            split_e = np.array([np.nan])
        rows.append({
            "load": float(load), "rate_rps": rate, "requests": len(err),
            "median_ttft_error": float(np.median(e)), "p90_ttft_error": float(np.percentile(e, 90)),
            "mean_signed_error": float(np.mean((err["ttft_sim_s"] - err["ttft_engine_s"]) / err["ttft_engine_s"])),
            "ttft_p50_engine_s": float(np.median(err["ttft_engine_s"])),
            "ttft_p50_sim_s": float(np.median(err["ttft_sim_s"])),
            "ttft_p90_engine_s": float(np.percentile(err["ttft_engine_s"], 90)),
            "ttft_p90_sim_s": float(np.percentile(err["ttft_sim_s"], 90)),
            "engine_rerun_median_error": float(np.median(rerun_e)),
            "engine_rerun_p90_error": float(np.percentile(rerun_e, 90)),
            "engine_split_half_median_error": float(np.median(split_e)),
            "engine_split_half_p90_error": float(np.percentile(split_e, 90)),
            "busy_engine_s": float(np.median(busy)), "busy_engine_min_s": float(np.min(busy)),
            "busy_engine_max_s": float(np.max(busy)), "busy_sim_s": float(sim.summary["busy_s"]),
            "makespan_engine_s": float(np.median([r.summary["makespan_s"] for r in runs])),
            "makespan_sim_s": float(sim.summary["makespan_s"]),
            "hits_equal": bool((err["hit_blocks_engine"] == err["hit_blocks_sim"]).all()),
            "token_hit_rate": float(sim.summary["token_hit_rate"]),
            "engine_repeats": repeats,
        })
    config = {"loads": [float(x) for x in loads], "repeats": repeats, "saturation_repeats": saturation_repeats,
              "saturation_runs_rps": saturation_runs,
              "timer": timer, "hardware": hw.name,
              "model": model_p.name, "block_size": engine.block_size, "calibration_rounds": len(rounds), **common}
    return FidelityResult(pd.DataFrame(rows), pd.concat(per_request, ignore_index=True), float(saturation_rps), hw,
                          config, cal)
