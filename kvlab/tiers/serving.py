"""Tiers in the serving simulator: load-or-recompute, waiting for loads, prefetch, overlap, step stalls.

One :class:`TierServing` per serving instance holds its :class:`~kvlab.tiers.TierStack` (the tier semantics,
shared with the replay) and, when the tiers are timed, its :class:`~kvlab.tiers.timing.TierTiming` (links and
media with busy-until times). It plugs into the scheduler at four points:

* **decide** (:class:`TieredKVManager`, at each admission's lookup): how many of the blocks found below the
  device are loaded (a prefix). ``max_load_tokens`` caps them (the stack's rule); with prefetch, blocks of
  the slowest tier count only once prefetched into host memory; with ``load_or_recompute`` the prefix whose
  estimated finish (load, then compute the rest, under the cost model and the links' current queues) is
  earliest, ties to the longer load. The rest is recomputed. Every decision is recorded per request.
* **hold** (after a successful admission): the load is issued at the admission's time. Without overlap the
  request waits in ``WAITING_FOR_KV_LOAD`` until its data is on the device (vLLM's ``WAITING_FOR_REMOTE_KVS``);
  with ``overlap`` it waits only for the staging hops (disk to host), then runs, its link hops pipelined layer
  by layer with its step's compute. A request that hits device blocks whose load is still in flight waits too.
* **arrived**: prefetch from the slowest tier (one with a medium, the last level) into host memory while the
  request queues (SGLang HiCache): ``best_effort`` (admitted in its turn with what was prefetched),
  ``wait_complete`` (not admitted before the prefetch is done), ``timeout`` (waits at most
  ``prefetch_timeout_s``). Prefetch changes timing only: blocks it has not staged by admission are recomputed;
  the tiers' contents are the stack's.
* **step_time** (:class:`TieredExecutor`, once per step): write-back copies of the device's evictions (a
  ``write_back`` tier 1) sit on the critical path of the step whose allocations evicted them; overlapped loads
  stretch the step (:func:`~kvlab.tiers.timing.overlapped_end`); every other store is asynchronous and
  reserved on its link and medium at the step's end, or, with ``sync_stores`` (an engine that stores inline,
  as kvlab's real engine does), on the step's critical path: the step ends when its stores do. A step with no
  stall keeps the cost model's duration.

Units: seconds, tokens (``*_tokens``), blocks of the run's block size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvlab.cache.admission import lookup
from kvlab.cache.manager import KVCacheManager
from kvlab.errors import ConfigError
from kvlab.tiers.stack import TierHits, TierStack
from kvlab.tiers.timing import TierTiming, overlapped_end
from kvlab.units import GIB

PREFETCH = ("off", "best_effort", "wait_complete", "timeout")
#: ``load_decision`` labels: nothing found below the device; all found loaded; a prefix loaded; none loaded
DECISIONS = ("none", "load", "partial", "recompute")
#: ``load_limit`` labels: what kept found blocks from loading
LIMITS = ("", "max_load_tokens", "prefetch", "cost")


class TierRecords:
    """Per-request tier columns (trace rows), shared by the instances; written at first admissions."""

    def __init__(self, n: int) -> None:
        self.found = np.zeros(n, np.int64)  # blocks found below the device
        self.decision = np.zeros(n, np.int8)  # index into DECISIONS
        self.limit = np.zeros(n, np.int8)  # index into LIMITS
        self.load_est = np.zeros(n)  # s: estimated load of the blocks allowed to load (queues included)
        self.recompute_est = np.zeros(n)  # s: compute those blocks would cost instead
        self.load_bytes = np.zeros(n)
        self.prefetched = np.zeros(n, np.int64)  # blocks of the slowest tier staged by prefetch at admission
        self.load_wait = np.zeros(n)  # s before the first token spent waiting for loads (and overlap stalls)

    def columns(self, block_size: int) -> dict[str, np.ndarray]:
        return {
            "lower_found_tokens": self.found * block_size,
            "load_decision": np.asarray(DECISIONS, dtype=object)[self.decision],
            "load_limit": np.asarray(LIMITS, dtype=object)[self.limit],
            "load_est_s": self.load_est,
            "recompute_est_s": self.recompute_est,
            "load_bytes": self.load_bytes,
            "prefetched_tokens": self.prefetched * block_size,
            "ttft_load_s": self.load_wait,
        }


class TierServing:
    """The tiers of one serving instance (see the module docstring). ``cost``: the instance's cost model
    (estimates); ``timing`` None: untimed tiers (loads instant, as in the replay)."""

    def __init__(self, stack: TierStack, timing: TierTiming | None, cost, records: TierRecords, *,  # noqa: ANN001
                 overlap: bool = False, load_or_recompute: bool = False, prefetch: str = "off",
                 prefetch_timeout_s: float = 1.0, sync_stores: bool = False) -> None:
        if prefetch not in PREFETCH:
            raise ConfigError(f"tier_prefetch must be one of {PREFETCH}, got {prefetch!r}")
        self.stack = stack
        self.timing = timing
        self.cost = cost
        self.rec = records
        self.bs = stack.device.block_size
        self.levels = len(stack.tiers)
        self.overlap = overlap and timing is not None
        self.decide_cost = load_or_recompute and timing is not None
        self.prefetch = prefetch if timing is not None and timing.media[-1] is not None else "off"
        self.prefetch_timeout_s = prefetch_timeout_s
        self.layers = timing.layers if timing is not None else 1
        self.write_back1 = stack.tiers[0].spec.write == "write_back"
        self.sync_stores = sync_stores  # every store ends before the step does (else: only tier 1's write-backs)
        self.chunks = [t.chunk for t in stack.tiers]
        self.ready_at: dict[int, float] = {}  # rows in WAITING_FOR_KV_LOAD -> when they may run
        self.wait_start: dict[int, float] = {}
        self.pending: dict[int, list[int]] = {}  # the admission in progress: blocks to load per level
        self.link_pending: dict[int, list[int]] = {}  # overlap: link hops to run in the step that schedules it
        self.prefetched: dict[int, tuple[float, float, int]] = {}  # row -> (start, end, blocks)
        self.inflight: dict[int, float] = {}  # device keys whose load is in flight -> data ready
        self.step_loads: list = []  # overlap: (request, blocks per level) of the step being built
        self.rows: list[tuple] = []  # per step: tier occupancy, stall, bytes per resource
        self.stall_s = 0.0
        self._stored = [t.counters.stored_chunks for t in stack.tiers]
        self._bytes = [r.bytes for r in timing.resources.values()] if timing is not None else []

    # ------------------------------------------------------------------ the scheduler's hooks
    def arrived(self, req, now: float) -> bool:  # noqa: ANN001 - a kvlab.sim.scheduler.Request
        """Prefetch on arrival; True when the request must wait for it (``wait_complete``, ``timeout``)."""
        if self.prefetch == "off":
            return False
        found = lookup(self.stack.device, req.keys, req.num_tokens)
        lower = found.lower
        blocks = sum(e - s for level, s, e, _ in lower.segments if level == self.levels) if lower else 0
        if not blocks:
            return False
        medium = self.timing.media[-1]
        start, end = medium.reserve(now, blocks * self.timing.block_bytes,
                                    self.timing.ops(self.levels, blocks))
        self.prefetched[req.row] = (start, end, blocks)
        if self.prefetch == "best_effort":
            return False
        self.ready_at[req.row] = end if self.prefetch == "wait_complete" else min(end, now + self.prefetch_timeout_s)
        return True

    def ready(self, req, now: float) -> bool:  # noqa: ANN001
        """Whether a request in WAITING_FOR_KV_LOAD may run now."""
        t = self.ready_at.get(req.row)
        if t is not None and t > now:
            return False
        self.ready_at.pop(req.row, None)
        return True

    def next_ready(self, now: float) -> float:
        """The earliest time after ``now`` a load or prefetch that a request waits for completes (inf: none)."""
        return min((t for t in self.ready_at.values() if t > now), default=math.inf)

    def hold(self, req, now: float) -> bool:  # noqa: ANN001
        """Issue the admitted request's load; True when it must wait for it (WAITING_FOR_KV_LOAD)."""
        per_level = self.pending.pop(req.row, None)
        timing = self.timing
        if timing is None:
            return False
        first = req.admissions == 1
        loaded = sum(per_level) if per_level else 0
        t = now
        if loaded:
            staged = self._staged_list(req, now)
            if self.overlap:
                t = timing.staging(now, per_level, staged)
                self.link_pending[req.row] = per_level
            else:
                t = timing.load(now, per_level, staged).end
            if first:
                self.rec.load_bytes[req.row] = loaded * timing.block_bytes
        device = req.num_computed_tokens // self.bs - loaded
        inflight = self.inflight
        if inflight:
            keys = req.keys
            for i in range(device):
                ready = inflight.get(keys[i])
                if ready is not None and ready > t:
                    t = ready
            if len(inflight) > 4096:
                self.inflight = inflight = {k: v for k, v in inflight.items() if v > now}
        if loaded:
            for k in req.keys[device:device + loaded]:
                inflight[k] = t
        if t > now:
            self.ready_at[req.row] = t
            self.wait_start[req.row] = now
            return True
        self.resumed(req, now)
        return False

    def resumed(self, req, now: float) -> None:  # noqa: ANN001
        """The request runs from this step on (its load done, or staged in overlap mode)."""
        start = self.wait_start.pop(req.row, None)
        if start is not None and req.first_token_s != req.first_token_s:  # NaN: before the first token
            self.rec.load_wait[req.row] += now - start
        per_level = self.link_pending.pop(req.row, None)
        if per_level is not None:
            self.step_loads.append((req, per_level))

    # ------------------------------------------------------------------ decide (admission lookup)
    def decide(self, req, found: TierHits, device_hits: int, now: float) -> int:  # noqa: ANN001
        """How many found blocks to load (sets ``found.loaded``); returns the request's hit tokens."""
        segments = found.segments
        total = sum(e - s for _, s, e, _ in segments)
        allowed = found.loaded
        limit = 1 if allowed < total else 0
        staged_last = 0
        if self.prefetch != "off":
            before = sum(e - s for level, s, e, _ in segments if level < self.levels)
            staged_last = self._staged_blocks(req, now)
            cap = before + staged_last
            if cap < allowed:
                allowed, limit = cap, 2
        k = allowed
        est_load = est_recompute = 0.0
        if self.timing is not None and allowed:
            finish = {}
            cands = [allowed]
            if self.decide_cost:
                cands = sorted({0, allowed} | {self._cum(segments, lv) for lv in range(1, self.levels)} - {None},
                               reverse=True)
                cands = [c for c in cands if c <= allowed]
            for c in cands:
                finish[c] = self._estimate(req, segments, device_hits, c, now)
            k = min(cands, key=lambda c: (finish[c][0], -c))
            est_load = finish[allowed][1]
            compute = self.cost.duration
            n, d = req.num_tokens, device_hits * self.bs
            est_recompute = compute([(n - d, d)]) - compute([(n - d - allowed * self.bs, d + allowed * self.bs)])
            if k < allowed:
                limit = 3
        found.loaded = k
        self.pending[req.row] = per_level = self._per_level(segments, k)
        if req.admissions == 0:
            rec, row = self.rec, req.row
            rec.found[row] = total
            rec.decision[row] = 0 if not total else 1 if k == total else 2 if k else 3
            rec.limit[row] = limit if k < total else 0
            rec.load_est[row] = est_load
            rec.recompute_est[row] = est_recompute
            rec.prefetched[row] = min(staged_last, per_level[-1])
        return (device_hits + k) * self.bs

    def _estimate(self, req, segments, device_hits: int, k: int, now: float) -> tuple[float, float]:  # noqa: ANN001
        """``(finish, load seconds)`` of loading the first ``k`` found blocks and computing the rest."""
        cached = (device_hits + k) * self.bs
        c = self.cost.duration([(max(req.num_tokens - cached, 1), cached)])
        if not k:
            return now + c, 0.0
        timing = self.timing
        per_level = self._per_level(segments, k)
        staged = self._staged_list(req, now)
        state = timing.snapshot()
        try:
            if self.overlap:
                ready = timing.staging(now, per_level, staged)
                s, e = timing.link_hops(ready, per_level)
                return overlapped_end(ready, c, s, e, self.layers), e - now
            end = timing.load(now, per_level, staged).end
            return end + c, end - now
        finally:
            timing.restore(state)

    def _per_level(self, segments, k: int) -> list[int]:  # noqa: ANN001
        out = [0] * self.levels
        for level, s, e, _ in segments:
            take = min(e - s, k)
            out[level - 1] += take
            k -= take
        return out

    @staticmethod
    def _cum(segments, level: int) -> int | None:  # noqa: ANN001
        """Found blocks of the levels up to ``level`` (a candidate prefix), None if ``level`` found nothing."""
        if not any(lv == level for lv, *_ in segments):
            return None
        return sum(e - s for lv, s, e, _ in segments if lv <= level)

    def _staged_blocks(self, req, now: float) -> int:  # noqa: ANN001
        """Blocks of the slowest tier the request's prefetch has staged in host memory by ``now``."""
        p = self.prefetched.get(req.row)
        if p is None:
            return 0
        start, end, blocks = p
        if now >= end:
            return blocks
        return int(blocks * (now - start) / (end - start)) if now > start else 0

    def _staged_list(self, req, now: float) -> list[int] | None:  # noqa: ANN001
        if self.prefetch == "off":
            return None
        return [0] * (self.levels - 1) + [self._staged_blocks(req, now)]

    # ------------------------------------------------------------------ steps
    def step_time(self, t0: float, compute: float) -> float:
        """The step's duration (s) from its compute (the cost model's): write-back stalls, overlapped loads;
        reserves the asynchronous stores; records the step's row."""
        tiers = self.stack.tiers
        stored = [t.counters.stored_chunks for t in tiers]
        blocks = [(a - b) * c for a, b, c in zip(stored, self._stored, self.chunks, strict=True)]
        self._stored = stored
        timing = self.timing
        end = t0 + compute
        if timing is not None:
            timing.prune(t0)
            t_start = t0
            if self.write_back1 and blocks[0]:  # device evictions copied out before their blocks are reused
                t_start = max(t0, timing.store(t0, 1, blocks[0], True))
                blocks[0] = 0
            if self.step_loads:
                per_level = [sum(x) for x in zip(*(p for _, p in self.step_loads), strict=True)]
                s, e = timing.link_hops(t_start, per_level)
                end = overlapped_end(t_start, compute, s, e, self.layers)
                for req, _ in self.step_loads:
                    if req.first_token_s != req.first_token_s:
                        self.rec.load_wait[req.row] += end - (t_start + compute)
                self.step_loads.clear()
            else:
                end = t_start + compute
            for i, b in enumerate(blocks):
                if b:
                    done = timing.store(end, i + 1, b, tiers[i].spec.write != "write_back")
                    if self.sync_stores:
                        end = max(end, done)
        stall = end - t0 - compute if end > t0 + compute else 0.0
        self.stall_s += stall
        nbytes = [r.bytes for r in timing.resources.values()] if timing is not None else []
        moved = [a - b for a, b in zip(nbytes, self._bytes, strict=True)]
        self._bytes = nbytes
        self.rows.append((*(t.cache.num_cached_blocks * t.chunk for t in tiers), stall, *moved))
        return compute if stall == 0.0 else end - t0

    def columns(self) -> list[str]:
        """The names of :attr:`rows`' fields (timeseries columns)."""
        names = [f"tier_blocks_{t.spec.name}" for t in self.stack.tiers] + ["tier_stall_s"]
        if self.timing is not None:
            names += [f"{r.preset.kind}_bytes_{name}" for name, r in self.timing.resources.items()]
        return names


class TieredKVManager(KVCacheManager):
    """A :class:`KVCacheManager` whose admissions decide how many lower-tier hits to load (TierServing.decide)."""

    serving: TierServing | None = None

    def get_computed_blocks(self, req):  # noqa: ANN001, ANN201 - the parent's signature
        hits, tokens = super().get_computed_blocks(req)
        if req.lower and self.serving is not None:
            tokens = self.serving.decide(req, req.lower, len(hits), self.now if self.now is not None else 0.0)
        return hits, tokens


class TieredExecutor:
    """Wraps the simulator's executor: each step's duration passes through :meth:`TierServing.step_time`."""

    def __init__(self, inner, serving: TierServing, clock) -> None:  # noqa: ANN001
        self.inner, self.serving, self.clock = inner, serving, clock

    def execute(self, batch: Sequence) -> float:
        return self.serving.step_time(self.clock.now(), self.inner.execute(batch))

    def decode_durations(self, contexts: Sequence[int], steps: int) -> np.ndarray:
        d = self.inner.decode_durations(contexts, steps)
        first = self.serving.step_time(self.clock.now(), float(d[0]))
        if first != d[0]:
            d = d.copy()
            d[0] = first
        return d


def tier_results(frame, timeseries, summary: dict, requests: Sequence, servings: Sequence[TierServing],  # noqa: ANN001
                 records: TierRecords, tiers: Sequence, block_size: int, block_bytes: int) -> None:
    """Add a tiered serving run's results in place: the replay's tier columns and summary (kvlab.tiers.results:
    ``hit_tokens_device``, ``hit_tokens_<tier>``, ``device_token_hit_rate``, ``tiers``; counters summed over
    instances), the decision and TTFT-split columns, the per-step tier series and the timing totals."""
    from dataclasses import fields

    from kvlab.tiers.results import tier_columns, tier_summary
    from kvlab.tiers.stack import TierCounters

    levels = len(tiers)
    hits = np.zeros((len(requests), levels), np.int64)
    for i, r in enumerate(requests):
        if r.tier_hits:
            hits[i] = r.tier_hits
    tier_columns(frame, {"tier_hit_blocks": hits}, tiers, block_size)
    for name, values in records.columns(block_size).items():
        frame[name] = values
    frame["ttft_compute_s"] = frame["ttft_s"] - frame["queue_s"] - frame["ttft_load_s"]
    counters = []
    for level in range(levels):
        total = TierCounters()
        for s in servings:
            c = s.stack.tiers[level].counters
            for f in fields(TierCounters):
                setattr(total, f.name, getattr(total, f.name) + getattr(c, f.name))
        counters.append(total)
    out = tier_summary(frame, counters, tiers, block_size, None)
    for entry, t in zip(out["tiers"], tiers, strict=True):  # bytes from the served model's profile
        written = entry["blocks_stored"] * block_bytes
        read = entry["loaded_tokens"] // block_size * block_bytes
        entry.update(capacity_gib=t.capacity_blocks * block_bytes / GIB, bytes_written=written,
                     bytes_read=read, write_amplification=written / read if read else None)
    summary.update(out)
    done = frame[frame["admitted"]]
    summary.update(
        ttft_load_mean_s=float(done["ttft_load_s"].mean()) if len(done) else 0.0,
        tier_stall_s=float(sum(s.stall_s for s in servings)),
        loaded_bytes=float(frame["load_bytes"].sum()),
    )
    names = servings[0].columns()
    rows = [row for s in servings for row in s.rows]
    if len(rows) != len(timeseries):
        raise RuntimeError(f"tier series: {len(rows)} rows for {len(timeseries)} steps")
    values = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(names))
    for j, name in enumerate(names):
        col = values[:, j]
        timeseries[name] = col if name.endswith(("_s", "_bytes")) or "_bytes_" in name else col.astype(np.int64)
