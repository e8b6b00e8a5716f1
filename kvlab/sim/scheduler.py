"""An iteration-level, vLLM-v1-like scheduler shared by the simulator and the real engine.

One scheduler, two executors: the simulator runs it against the cost model in simulated time
(:class:`SimClock`); the real engine runs it against the model in wall time (:class:`WallClock`).
An :class:`Executor` runs one step: ``execute(batch) -> seconds``, where ``batch`` is a list of
``(request, num_new_tokens, num_cached_context_tokens)``.

Each step (vLLM v1 ``Scheduler.schedule``; no prefill/decode distinction, every request just catches
its ``num_computed_tokens`` up with its ``num_tokens``):

1. Running requests, oldest first, each get ``min(num_tokens - num_computed_tokens, token budget)``
   tokens (chunked prefill; 1 token when decoding). If their slots do not fit, the newest running
   request is preempted (recompute: its blocks are freed, it goes back to the front of the waiting
   queue with ``num_computed_tokens = 0``), until the slots fit or the request preempted itself.
2. If nobody was preempted, waiting requests are admitted in FCFS order while the token budget,
   ``max_num_seqs`` and free blocks allow: prefix lookup (hits measured here: first admission and
   re-admissions after preemption in separate counters), then slots for the rest of the chunk.
   The first request that does not fit stops admission. A request in ``WAITING_FOR_KV_LOAD`` (a tier
   load in flight, or a prefetch it waits for: ``loads``, kvlab.tiers.serving) is passed over and keeps
   its place; once its load is done it runs in its turn with the blocks it holds.
3. The executor runs the batch; the clock advances by its duration (simulated) or has already moved.
4. Every request whose known tokens are all computed samples one token; the first one is its first
   token; a request with ``output_length`` tokens finishes and frees its blocks (tail first).

A request that could never fit the pool alone (``ceil((prompt + output - 1) / block_size)`` blocks
above capacity) is rejected at arrival. Requests arrive at their (already scaled) ``arrival`` times.

Fast forward (simulated time only, exact): when a step is decode-only for every running request, no one
was preempted and admission stopped for a reason that cannot change while only decodes run, the next
``k`` steps have the same batch composition. They are taken at once, ``k`` bounded by the first step that
would finish a request, need a new block, key a block, or start at or after the next arrival. Results
are identical to stepping one by one (the cost model computes the same floats; tests check it).

Per-step cost is O(running requests), independent of the number waiting.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np
import pandas as pd

from kvlab.cache.manager import KVCacheManager, KVRequest
from kvlab.errors import ConfigError

NAN = math.nan


class RequestStatus(IntEnum):
    """Where a request is. ``WAITING_FOR_KV_LOAD``: admitted to a tier load, not yet schedulable."""

    WAITING = 0
    WAITING_FOR_KV_LOAD = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED = 4
    REJECTED = 5


@dataclass(slots=True, eq=False)
class Request(KVRequest):
    """A request in the scheduler (times in seconds on the scheduler's clock; sizes in tokens).

    ``output_length`` >= 1 tokens are sampled, one per step once all known tokens are computed.
    ``computed_tokens`` counts every token the executor ran for it (recomputation included),
    ``prefill_tokens`` those of prefill chunks (until a token is sampled after an admission) and
    ``computed_prompt_tokens`` those at prompt positions. ``cached_blocks`` / ``orphan_blocks``: the
    cache's keyed / orphaned blocks right after the first admission.
    """

    row: int = 0
    arrival: float = 0.0
    output_length: int = 1
    status: RequestStatus = RequestStatus.WAITING
    num_output_tokens: int = 0
    admitted_s: float = NAN
    first_token_s: float = NAN
    finished_s: float = NAN
    preemptions: int = 0
    in_prefill: bool = True
    computed_tokens: int = 0
    prefill_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_blocks: int = 0
    orphan_blocks: int = 0


Entry = tuple[Request, int, int]  # (request, num_new_tokens, num_cached_context_tokens)


class Executor(Protocol):
    """Runs one step of a batch and returns its duration in seconds."""

    def execute(self, batch: Sequence[Entry]) -> float: ...


class Clock(Protocol):
    """The scheduler's time source; ``simulated`` clocks move only when told to."""

    simulated: bool

    def now(self) -> float: ...

    def advance(self, seconds: float) -> None: ...

    def wait_until(self, t: float) -> None: ...


class SimClock:
    """Simulated time: moves by the executor's step durations and jumps over idle gaps."""

    simulated = True

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def set(self, t: float) -> None:
        """Move to ``t`` (never backwards)."""
        if t < self.t:
            raise ConfigError(f"SimClock cannot go back from {self.t} to {t}")
        self.t = t

    def wait_until(self, t: float) -> None:
        if t > self.t:
            self.t = t


class WallClock:
    """Wall time since construction: a step's duration has already passed when it is reported."""

    simulated = False

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._t0 = time.perf_counter()
        self._sleep = sleep

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, seconds: float) -> None:
        """Nothing to do: the executor spent ``seconds`` of wall time."""

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            self._sleep(delay)


TIMESERIES_COLUMNS = (
    "step", "time_s", "duration_s", "num_steps", "running", "waiting", "batch_seqs", "batch_tokens",
    "prefill_tokens", "decode_tokens", "kv_running_blocks", "kv_cached_blocks", "kv_evictable_blocks",
    "evictions", "preemptions", "admissions", "finished", "tier_hits_hbm",
)


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix lookup at admission and recompute preemption.

    Limits: ``max_num_seqs`` running requests, ``max_num_batched_tokens`` tokens per step.
    ``fast_forward`` (simulated clocks with an executor that has ``decode_durations``) takes runs of
    identical decode steps at once, at most ``max_fast_forward_steps``. ``on_finish(req)`` is called
    for each finished request. The time series (one row per step or fast-forwarded run, ``num_steps``
    steps of identical composition) is :meth:`timeseries`. ``loads`` (tiers below the device:
    :class:`kvlab.tiers.serving.TierServing`) is told of arrivals (``arrived``: prefetch) and admissions
    (``hold``: a load to wait for) and says when a waiting request may run (``ready``, ``next_ready``).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        executor: Executor,
        clock: Clock | None = None,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        fast_forward: bool = True,
        max_fast_forward_steps: int = 1024,
        on_finish: Callable[[Request], None] | None = None,
        loads: object | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.manager = manager
        self.cache = manager.cache
        self.executor = executor
        self.clock: Clock = clock if clock is not None else SimClock()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fast_forward = bool(fast_forward and self.clock.simulated and hasattr(executor, "decode_durations"))
        self.max_fast_forward_steps = max(1, int(max_fast_forward_steps))
        self.on_finish = on_finish
        self.loads = loads  # tier loads (kvlab.tiers.serving.TierServing): arrived / hold / ready / resumed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0  # model steps executed (fast-forwarded ones included)
        self.num_iterations = 0  # scheduler iterations (a fast-forwarded run is one)
        self.busy_s = 0.0  # seconds the executor ran
        self.prefill_busy_s = 0.0  # step seconds attributed to prefill tokens (by their share of the batch)
        self.preemptions = 0
        self.rejected = 0
        self._rows: list[tuple] = []
        self._evictions = self.cache.stats.evictions

    # ------------------------------------------------------------------ arrivals
    def fits_alone(self, req: Request) -> bool:
        """Whether the request's whole sequence fits the pool (else it could never finish)."""
        total = req.prompt_tokens + max(req.output_length, 1) - 1
        return self.manager.blocks_needed(total) <= self.cache.capacity_blocks

    def add_request(self, req: Request) -> None:
        """Queue an arrived request (FCFS), or reject it if it has no prompt or can never fit."""
        if req.output_length < 1:
            raise ConfigError(f"request {req.request_id}: output_length must be >= 1")
        if req.prompt_tokens < 1 or not self.fits_alone(req):
            req.status = RequestStatus.REJECTED
            self.rejected += 1
            return
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        if self.loads is not None and self.loads.arrived(req, self.clock.now()):
            req.status = RequestStatus.WAITING_FOR_KV_LOAD  # a prefetch it waits for

    # ------------------------------------------------------------------ one step
    def schedule(self) -> tuple[list[Entry], dict]:
        """Build the next batch (steps 1 and 2 of the module docstring)."""
        manager = self.manager
        manager.now = self.clock.now()
        running, waiting = self.running, self.waiting
        budget = self.max_num_batched_tokens
        batch: list[Entry] = []
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                n = budget
            scheduled = True
            while not manager.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            batch.append((req, n, req.num_computed_tokens))
            budget -= n
            i += 1
        admitted = hit_blocks = 0
        stop = "empty"
        if preempted:
            stop = "preempted"
        else:
            skipped: list[Request] = []
            while waiting:
                if budget <= 0:
                    stop = "budget"
                    break
                if len(running) >= self.max_num_seqs:
                    stop = "seqs"
                    break
                req = waiting[0]
                if req.status == RequestStatus.WAITING_FOR_KV_LOAD:
                    if not self.loads.ready(req, manager.now):  # type: ignore[union-attr]
                        skipped.append(waiting.popleft())
                        continue
                    req.status = RequestStatus.WAITING
                if req.blocks:  # its load is done: it runs with the blocks it holds
                    if not self._resume(req, batch, budget):
                        stop = "blocks"
                        break
                    budget -= batch[-1][1]
                    continue
                hits, hit_tokens = manager.get_computed_blocks(req)
                n = req.num_tokens - hit_tokens
                if n > budget:
                    n = budget
                if not manager.allocate_slots(req, n, hits):
                    stop = "blocks"
                    break
                waiting.popleft()
                if req.admissions == 1:
                    req.admitted_s = manager.now
                    req.cached_blocks = self.cache.num_cached_blocks
                    req.orphan_blocks = self.cache.num_orphan_blocks
                admitted += 1
                hit_blocks += len(hits)
                if self.loads is not None and self.loads.hold(req, manager.now):  # type: ignore[attr-defined]
                    req.status = RequestStatus.WAITING_FOR_KV_LOAD
                    skipped.append(req)
                    continue
                req.status = RequestStatus.RUNNING
                req.in_prefill = True
                running.append(req)
                batch.append((req, n, hit_tokens))
                budget -= n
            if stop == "blocks" and not running and self.loads is not None:
                for req in skipped + list(waiting):  # idle: a request whose load is done may not wait behind
                    if req.blocks and req.status == RequestStatus.WAITING_FOR_KV_LOAD and self.loads.ready(
                            req, manager.now):  # type: ignore[attr-defined]
                        (skipped if req in skipped else waiting).remove(req)
                        waiting.appendleft(req)
                        if self._resume(req, batch, budget):
                            break
            if skipped:
                waiting.extendleft(reversed(skipped))
                stop = "skipped"
        return batch, {"preempted": preempted, "admitted": admitted, "hit_blocks": hit_blocks, "stop": stop}

    def _resume(self, req: Request, batch: list[Entry], budget: int) -> bool:
        """Schedule the waiting head ``req``, whose tier load is done (it holds its blocks), for its next chunk (at
        most what its blocks hold: they were allocated with its admission, so it never waits for more)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget, max(req.slot_tokens - req.num_computed_tokens, 1))
        if not self.manager.allocate_slots(req, n):
            req.status = RequestStatus.WAITING_FOR_KV_LOAD  # still done; retried in its turn
            return False
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.in_prefill = True
        self.running.append(req)
        batch.append((req, n, req.num_computed_tokens))
        self.loads.resumed(req, self.manager.now)  # type: ignore[union-attr]
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue."""
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _fast_forward_steps(self, batch: list[Entry], info: dict, next_arrival: float) -> int:
        """Upper bound on identical decode steps starting with ``batch`` (1 = no fast forward)."""
        if info["preempted"] or info["stop"] not in ("empty", "blocks", "seqs", "budget"):
            return 1
        if len(batch) != len(self.running):
            return 1
        bs = self.manager.block_size
        key_scheduled = self.manager.cache_at == "schedule"
        k = self.max_fast_forward_steps
        for req, n, c in batch:
            if n != 1 or c + 1 != req.num_tokens:
                return 1
            left = req.output_length - req.num_output_tokens
            room = len(req.blocks) * bs - c  # steps until a new block is needed
            if key_scheduled and room > 1 and len(req.blocks) <= len(req.keys) and req.num_keyed_blocks < len(
                req.blocks
            ):
                room -= 1  # the last block gets its key when it fills: that step must be a normal one
            k = min(k, left, room)
            if k <= 1:
                return 1
        if next_arrival <= self.clock.now():
            return 1
        return k

    def step(self, next_arrival: float = math.inf) -> bool:
        """Schedule, execute and update once (or a fast-forwarded run). False if nothing could run."""
        batch, info = self.schedule()
        if not batch:
            return False
        if self.loads is not None:  # a load completing changes the batch: no fast forward past it
            next_arrival = min(next_arrival, self.loads.next_ready(self.clock.now()))  # type: ignore[attr-defined]
        cache = self.cache
        kv = (cache.num_running_blocks, cache.num_cached_blocks, cache.num_evictable_blocks)  # during the step
        clock = self.clock
        t0 = clock.now()
        k = self._fast_forward_steps(batch, info, next_arrival) if self.fast_forward else 1
        if k > 1:
            durations = self.executor.decode_durations([c for _, _, c in batch], k)  # type: ignore[attr-defined]
            starts = np.cumsum(np.concatenate(([t0], durations)))  # sequential adds: same floats as stepping
            # step i (i >= 1) runs only if it starts before the next arrival
            k = 1 + bisect.bisect_left(starts[1:k].tolist(), next_arrival)
            t_first = float(starts[1])
            clock.set(float(starts[k]))  # type: ignore[attr-defined]
            first = float(durations[0])
            busy = float(durations[:k].sum())
        else:
            first = busy = float(self.executor.execute(batch))
            clock.advance(first)
            t_first = clock.now()
        self._update(batch, info, k, t_first, clock.now(), t0, first, busy, kv)
        return True

    def _update(self, batch: list[Entry], info: dict, k: int, t_first: float, t_end: float, t0: float,
                first: float, busy: float, kv: tuple[int, int, int]) -> None:
        """Advance computed tokens, sample, finish (step 4); record the time-series row.

        ``first``: the duration of the run's first step (the only one that can hold prefill tokens);
        ``busy``: of all its ``k`` steps; ``kv``: running, cached and evictable blocks during the run.
        """
        prefill = decode = batch_tokens = finished = 0
        manager = self.manager
        for req, n, c in batch:
            batch_tokens += n
            if req.in_prefill:
                prefill += n
                req.prefill_tokens += n
                p = req.prompt_tokens
                if c < p:
                    req.computed_prompt_tokens += (c + n if c + n < p else p) - c
                done = n + (k - 1)  # k > 1 only for a one-token step: a prefill token, then decodes
                decode += k - 1
            else:
                done = n * k
                decode += done
            req.num_computed_tokens += done
            req.computed_tokens += done
            if req.num_computed_tokens >= req.num_tokens:
                if req.first_token_s != req.first_token_s:  # NaN: no token yet
                    req.first_token_s = t_first
                req.in_prefill = False
                req.num_output_tokens += k
                req.num_tokens += k
                if req.num_output_tokens >= req.output_length:
                    req.finished_s = t_end
                    req.status = RequestStatus.FINISHED
                    manager.now = t_end
                    manager.free(req)
                    finished += 1
                    if self.on_finish is not None:
                        self.on_finish(req)
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if prefill:  # prefill tokens only occur in the first step of a run: its time, by their token share
            self.prefill_busy_s += first * (prefill / (batch_tokens if k == 1 else len(batch)))
        self.busy_s += busy
        self.num_steps += k
        self.num_iterations += 1
        evictions = self.cache.stats.evictions
        self._rows.append((
            self.num_steps - k, t0, t_end - t0, k, len(self.running), len(self.waiting), len(batch),
            batch_tokens, prefill, decode, *kv, evictions - self._evictions, info["preempted"], info["admitted"],
            finished, info["hit_blocks"],
        ))
        self._evictions = evictions

    # ------------------------------------------------------------------ whole runs
    def run(self, requests: Sequence[Request]) -> None:
        """Serve ``requests`` (sorted by ``arrival``) until every one has finished or been rejected."""
        clock = self.clock
        n = len(requests)
        i = 0
        arrivals = [r.arrival for r in requests]
        if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
            raise ConfigError("requests must be sorted by arrival")
        while True:
            now = clock.now()
            while i < n and arrivals[i] <= now:
                self.add_request(requests[i])
                i += 1
            next_arrival = arrivals[i] if i < n else math.inf
            if not self.running and not self.waiting:
                if i == n:
                    break
                clock.wait_until(next_arrival)
                continue
            preemptions = self.preemptions
            if not self.step(next_arrival):
                if self.preemptions != preemptions:  # a request preempted itself (tier loads hold blocks): again
                    continue
                wake = min(next_arrival, self.loads.next_ready(now)) if self.loads is not None else next_arrival
                if wake == math.inf:
                    raise RuntimeError("scheduler stalled: waiting requests can never be scheduled")
                clock.wait_until(wake)

    def timeseries(self) -> pd.DataFrame:
        """One row per step (``num_steps`` > 1: a fast-forwarded run of identical decode steps).

        ``batch_seqs`` / ``batch_tokens`` are per step; ``prefill_tokens`` / ``decode_tokens`` are totals over
        the row's steps (``batch_tokens × num_steps = prefill_tokens + decode_tokens``); ``kv_*`` (blocks) are
        during the run (after scheduling, before finished requests free theirs); ``evictions``,
        ``preemptions``, ``admissions``, ``finished`` and ``tier_hits_hbm`` (blocks hit in HBM at
        admission) count events of the row. ``step`` is the index of the row's first model step.
        """
        return pd.DataFrame.from_records(self._rows, columns=list(TIMESERIES_COLUMNS))
