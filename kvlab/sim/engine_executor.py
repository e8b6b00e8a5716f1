"""The real engine as the scheduler's executor: the same scheduler and KV manager, measured time.

:class:`EngineExecutor` implements :class:`~kvlab.sim.scheduler.Executor` with the engine's pool-compute
primitive (:meth:`PagedModel.forward_tokens <kvlab.engine.compute.PagedModel.forward_tokens>`): for each
batch entry ``(request, n, c)`` it runs the model forward for the request's tokens ``[c, c + n)`` over the
``c`` tokens already in the request's blocks, one sequence per forward call. The scheduler's
:class:`~kvlab.cache.manager.KVCacheManager` owns allocation, keys and eviction; its cache core's block ids
are the engine's KV-pool block ids, so the engine only computes (and writes each computed position into
the pool block the manager gave it).

:func:`run_engine_serving` serves a token trace with arrivals through that executor and returns the
simulator's result type, with the simulator's columns, so the two compare row by row.

``timer`` (``"wall"`` or ``"thread"``) picks the time base (:mod:`kvlab.sim.clocks`). The engine's profiles
for the cost model live here too: :func:`engine_model_profile` (its model), :func:`default_hardware` (the
shipped profile of its device) and :func:`device_name`. The fidelity study on top of this module and
:mod:`kvlab.sim.calibrate` is :mod:`kvlab.sim.fidelity`.

Units: seconds, tokens, blocks.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.arguments import NonNegativeInt, require_instance, require_ints
from kvlab.cache import pool_blocks
from kvlab.engine.batched import BatchEntry
from kvlab.engine.compute import PagedModel, sync_device
from kvlab.engine.driver import Engine
from kvlab.engine.tiers import TierIO, attach_tiers, tier_config, tier_results
from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile, ModelProfile, load_hardware
from kvlab.results import build_manifest, write_results
from kvlab.schema import BlockSize, CapacityBlocks, PositiveInt, Seed
from kvlab.sim.clocks import StoppedClock, gc_paused, make_clock, timer_function
from kvlab.sim.cost import CostModel
from kvlab.sim.scheduler import Entry, Request, Scheduler
from kvlab.sim.simulator import (
    SimConfig,
    SimResult,
    _labels,
    make_manager,
    serving_demand_blocks,
    serving_results,
    trace_requests,
)
from kvlab.sim.steps import Step, step_frame
from kvlab.tiers import Tier
from kvlab.workload.workload import Workload, require_workload


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
    verified: bool = False  # the oracle has judged its prompt (verify=True: once, at its first completed prefill)
    row: int = -1  # the request's row in the trace


class EngineExecutor:
    """Runs the scheduler's batches on a real :class:`~kvlab.engine.Engine` and returns measured seconds.

    Register each request with :meth:`add` before the scheduler can schedule it, and :meth:`discard` it
    when it finishes (``Scheduler(on_finish=executor.discard)``). Entries run in batch order, one
    sequence per forward call, so a block keyed at scheduling (``cache_at="schedule"``) is computed by
    the earlier entry that owns it before a later entry of the same step reads it. ``timer``: ``"wall"``
    or ``"thread"`` (module docstring). The engine's own cache core is not used: the manager's is, and
    its block ids must lie below ``engine.capacity_blocks`` (the pool).
    """

    def __init__(self, engine: PagedModel, *, timer: str = "wall", batched: bool = False, verify: bool = False,
                 verify_tokens: int = 2) -> None:
        self.engine = engine
        #: one packed forward per step (kvlab.engine.batched; one per run of entries with the same adapter)
        #: instead of one forward per entry; the pool is the only K/V memory then (no working caches)
        self.batched = batched
        #: judge each request's first completed prefill against the uncached forward (kvlab.engine.verify), inside
        #: its step (after the step is timed: verification is not in the measured seconds)
        self.verify = verify
        self.verify_tokens = verify_tokens
        self.verify_reports: list[dict] = []  # one per verified request: its row and the VerifyReport fields
        self._pending: list[tuple[EngineSequence, list[int], torch.Tensor, int]] = []
        self.timer = timer
        self._time = timer_function(timer)
        self.device = engine.device
        self._seqs: dict[Request, EngineSequence] = {}
        self.generated: dict[int, list[int]] = {}  # request row -> tokens sampled (kept after discard)
        self.forward_calls = 0
        self.steps: list[Step] = []  # every executed step: ((n, c) entries, measured seconds)
        self.tier_io: TierIO | None = None  # lower tiers' data mover: its deferred stores run after each forward

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
                             adapter, row=req.row)
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
        self._check_later(seq, block_ids, logits, c + n)
        self._sample(seq, logits, c + n)

    def _check_later(self, seq: EngineSequence, block_ids: Sequence[int], logits: torch.Tensor, computed: int) -> None:
        """Queue ``seq`` for the oracle when this computation completed its prompt for the first time."""
        if self.verify and not seq.verified and computed == seq.prompt_tokens:
            seq.verified = True
            self._pending.append((seq, list(block_ids), logits.detach().clone(), computed))

    def _run_checks(self) -> None:
        """Judge the queued prompts (after the step's timing): the cached logits and the K/V read back from the
        pool (the state decoding continues from, batched or not) against the uncached forward."""
        from kvlab.engine.verify import Tolerance, verify_prefill

        eng = self.engine
        for seq, block_ids, logits, p in self._pending:
            kv = eng.pool.gather(block_ids, p)
            report = verify_prefill(eng.model, torch.as_tensor(seq.tokens[:p], device=eng.device), logits, kv, kv,
                                    k=self.verify_tokens, tolerance=Tolerance.for_dtypes(eng.model_dtype,
                                                                                          eng.layout.dtype),
                                    adapters=eng.adapters, adapter=seq.adapter)
            self.verify_reports.append({"row": seq.row, **report.as_row()})
        self._pending.clear()

    @staticmethod
    def _sample(seq: EngineSequence, logits: torch.Tensor, computed: int) -> None:
        """Once every known token is computed (``computed`` tokens), the scheduler samples one: the known output
        token if the trace has it, else the greedy one."""
        if computed == len(seq.tokens):
            k = len(seq.tokens) - seq.prompt_tokens
            out = seq.outputs
            tok = int(out[k]) if out is not None and k < len(out) else int(logits.argmax())
            seq.tokens.append(tok)
            seq.sampled.append(tok)

    def run_batched(self, batch: Sequence[Entry]) -> None:
        """The whole step as packed forwards (:func:`kvlab.engine.batched.forward_batch`): one per run of
        consecutive entries with the same adapter (usually one), in batch order; then each entry samples."""
        self.run_packed([(self.sequence(req), [b.block_id for b in req.blocks], n, c) for req, n, c in batch])

    def run_packed(self, items: Sequence[tuple[EngineSequence, Sequence[int], int, int]]) -> None:
        """Compute ``(seq, block_ids, n, c)`` items (positions ``[c, c + n)`` of each) as packed forwards, one per
        run of consecutive items with the same adapter; then each samples. The batched code path of
        :meth:`execute` (calibration times exactly this)."""
        groups: list[tuple[str | None, list]] = []
        for seq, block_ids, n, c in items:
            if c + n > len(seq.tokens):
                raise ConfigError(f"scheduled tokens [{c}, {c + n}) exceed the {len(seq.tokens)} known tokens")
            seq.working, seq.working_len = None, 0  # (none in batched mode: the pool holds every position)
            if not groups or groups[-1][0] != seq.adapter:
                groups.append((seq.adapter, []))
            groups[-1][1].append((seq, list(block_ids), n, c))
        for adapter, items in groups:
            entries = [BatchEntry(blocks, c, seq.tokens[c:c + n]) for seq, blocks, n, c in items]
            logits = self.engine.forward_batch(entries, adapter=adapter)
            self.forward_calls += 1
            for (seq, blocks, n, c), lg in zip(items, logits, strict=True):
                self._check_later(seq, blocks, lg, c + n)
                self._sample(seq, lg, c + n)

    def execute(self, batch: Sequence[Entry]) -> float:
        """Run every entry (one forward each, in order; ``batched``: packed forwards); seconds measured by the timer
        (device synchronised).
        The step is recorded in :attr:`steps` (its ``(n, c)`` entries and these seconds)."""
        sync_device(self.device)
        t0 = self._time()
        if self.batched:
            self.run_batched(batch)
        else:
            for req, n, c in batch:
                seq = self.sequence(req)
                if seq.admission != req.admissions:  # (re-)admitted: a working cache from before is stale
                    seq.working, seq.working_len, seq.admission = None, 0, req.admissions
                self.run_entry(seq, [b.block_id for b in req.blocks], n, c)
        if self.tier_io is not None:
            self.tier_io.flush()  # write-through stores of the blocks this step computed (keyed at schedule)
        sync_device(self.device)
        seconds = self._time() - t0
        if self._pending:
            self._run_checks()
        self.steps.append((tuple((n, c) for _, n, c in batch), seconds))
        return seconds


# ---------------------------------------------------------------------- the engine's profiles
def engine_model_profile(engine_or_model: PagedModel | torch.nn.Module, name: str | None = None) -> ModelProfile:
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


def device_name(device: str | torch.device) -> str:
    """A readable name of the device: the CUDA device name, or the CPU model and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


# ---------------------------------------------------------------------- whole runs
@dataclass
class EngineServingResult(SimResult):
    """:class:`SimResult` of a trace served by the real engine (same columns); ``engine``: its config;
    ``generated``: the tokens each request (by row) sampled (known outputs where the trace has them);
    ``steps``: every step the engine ran, one row each (:func:`kvlab.sim.steps.step_frame`, measured
    seconds; their sum is ``summary["busy_s"]``); ``verify`` (``verify=True``): one row per judged request, its
    ``row`` in the trace and the oracle's ``verify_*`` fields (:meth:`kvlab.engine.verify.VerifyReport.as_row`)."""

    engine: dict = field(default_factory=dict)
    generated: dict = field(default_factory=dict)
    steps: pd.DataFrame = field(default_factory=lambda: step_frame([]))
    verify: pd.DataFrame = field(default_factory=pd.DataFrame)

    def save(self, out: str | Path) -> Path:
        """Write requests.parquet, timeseries.parquet, summary.json and manifest.json (driver ``engine-serving``)."""
        config = {**self.config.to_dict(), "model_profile": self.model.to_dict(),
                  "hardware_profile": self.hardware.to_dict(), "engine": self.engine}
        manifest = build_manifest(config, trace=self.trace, seed=self.config.seed, driver="engine-serving")
        return write_results(out, {"requests": self.requests, "timeseries": self.timeseries}, self.summary, manifest)


def warm_up(engine: PagedModel, steps: int = 2, tokens: int = 32) -> None:
    """A few untimed forward passes (allocator, kernels, caches), written to pool blocks nobody holds yet."""
    rng = np.random.default_rng(0)
    bs = engine.block_size
    blocks = list(range(min(engine.capacity_blocks, -(-(tokens + 1) // bs))))
    tokens = min(tokens, len(blocks) * bs - 1)
    for _ in range(steps):
        ids = rng.integers(0, engine.vocab_size, tokens + 1)
        _, working = engine.forward_tokens(ids[:tokens], blocks, 0)
        engine.forward_tokens(ids[tokens:], blocks, tokens, working=working)
    sync_device(engine.device)


def serving_engine(model: torch.nn.Module, workload: Workload, capacity_blocks: int, block_size: int, *,
                   dtype: str | torch.dtype | None = None, num_threads: int | None = None) -> Engine:
    """An :class:`Engine` to serve ``workload`` with :func:`run_engine_serving` at ``capacity_blocks``: its pool of
    real KV tensors holds no more blocks than the workload can ever use (``pool_blocks``; the capacity is
    recorded as given). ``dtype``: the KV pool's (default the model's); ``num_threads``: torch CPU threads (CPU
    only)."""
    workload = require_workload(workload)
    require_ints("serving_engine", capacity_blocks=(CapacityBlocks, capacity_blocks),
                 block_size=(BlockSize, block_size))
    pool = pool_blocks(capacity_blocks, serving_demand_blocks(workload, block_size))
    return Engine(model, capacity_blocks=pool, block_size=block_size, dtype=dtype,
                  num_threads=num_threads if model.device.type == "cpu" else None)


def run_engine_serving(
    workload: Workload,
    engine: Engine,
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
    batched: bool = False,
    verify: bool = False,
    verify_tokens: int = 2,
    tiers: Sequence[Tier] | None = None,
    tier_dir: str | Path | None = None,
    max_load_tokens: int | None = None,
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
    the result are seconds of that clock since the start of serving. ``batched``: each step is one packed
    forward (continuous batching, :class:`EngineExecutor`) instead of one forward per entry. ``verify``: each
    request's first completed prefill is judged against the uncached forward inside its step (untimed;
    kvlab.engine.verify, ``verify_tokens`` greedy tokens), per request also inside a packed batch; the summary
    gets the engine's verify totals. ``tiers``: lower tiers below the pool with real stores
    (:func:`kvlab.engine.tiers.attach.attach_tiers`: DRAM, with ``tier_dir`` the last one on disk), loaded
    synchronously at admission (``max_load_tokens`` per request); the result gets the replay's tier columns and
    ``tiers`` list. Their files are deleted at the end of the run. A wrong argument type (a path as the
    workload, a bool or str as a count) is one ConfigError naming the argument, before any work.
    """
    workload = require_workload(workload)
    require_instance(engine, Engine, "engine")
    require_ints("run_engine_serving", capacity_blocks=(CapacityBlocks | None, capacity_blocks),
                 max_num_seqs=(PositiveInt, max_num_seqs), max_num_batched_tokens=(PositiveInt, max_num_batched_tokens),
                 root_seed=(Seed, root_seed), seed=(Seed, seed), warmup=(NonNegativeInt, warmup),
                 verify_tokens=(PositiveInt, verify_tokens), max_load_tokens=(NonNegativeInt | None, max_load_tokens))
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
    capacity = int(capacity_blocks or engine.capacity_blocks)
    pool = pool_blocks(capacity, serving_demand_blocks(workload, bs))
    if not 1 <= pool <= engine.capacity_blocks:
        raise ConfigError(f"capacity_blocks must be in 1..{engine.capacity_blocks} (the engine's pool), got {capacity}")
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
    executor = EngineExecutor(engine, timer=timer, batched=batched, verify=verify, verify_tokens=verify_tokens)
    for r, req in enumerate(requests):
        executor.add(req, workload.prompt(r), workload.output(r), adapter[r])
    manager = make_manager(requests, tr, policy=policy, policy_params=policy_params, capacity_blocks=pool,
                           block_size=bs, cache_at=cache_at)
    tier_io = attach_tiers(manager.cache, engine.pool, tiers or [], tier_dir=tier_dir, max_load_tokens=max_load_tokens,
                           defer=cache_at == "schedule")
    executor.tier_io = tier_io
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
        if tier_io is not None:
            tier_io.flush()
    end = clock.now()
    wall = time.perf_counter() - t0
    scheduler.clock = StoppedClock(end)

    frame, timeseries, summary, trace = serving_results(
        workload, tr, [scheduler], cost=cost, capacity_blocks=capacity, block_size=bs, model=model_p, config=config,
        seconds=wall)
    summary.update(
        executor="engine", timer=timer, device=str(engine.device), engine_model_id=engine.model_id,
        calibration="measured", cost_model=f"measured:{model_p.name}@{engine.device}", hardware=str(engine.device),
        forward_calls=executor.forward_calls, wall_seconds=wall, batched=batched,
    )
    if verify:
        v = executor.verify_reports
        summary.update(
            verified_requests=len(v),
            verify_failures=sum(1 for r in v if not r["verify_passed"]),
            verify_pass_rate=sum(1 for r in v if r["verify_passed"]) / len(v) if v else 1.0,
            verify_max_logit_abs=max((r["verify_logit_max_abs"] for r in v), default=0.0),
            verify_max_kv_abs=max((r["verify_kv_max_abs"] for r in v), default=0.0),
        )
    if tier_io is not None:
        if "tiers" not in summary:
            summary.update(tier_results(frame, [r.tier_hits for r in requests], tier_io, bs))
        tier_io.close()
    engine_config = {**engine.config(), "timer": timer, "pool_blocks_used": pool, **tier_config(tier_io)}
    return EngineServingResult(frame, timeseries, summary, config, trace, model_p, hw, engine=engine_config,
                               generated=dict(executor.generated), steps=step_frame(executor.steps),
                               verify=pd.DataFrame(executor.verify_reports))
