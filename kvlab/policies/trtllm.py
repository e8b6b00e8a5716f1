"""TensorRT-LLM KV cache reuse priorities: retention priority 0-100 per block range, optional expiry.

Source: TensorRT-LLM docs "KV cache system" and "How to change block priorities"
(``KvCacheRetentionConfig`` with ``TokenRangeRetentionConfig(token_start, token_end, priority,
duration_ms)``, default priority 35), and cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp
(``LRUEvictionPolicy``): one free queue per priority level, the lowest non-empty level evicted first,
LRU (front of the queue) within a level; a block released with a non-default priority and a duration
gets ``expiration = release time + duration``; ``refresh()`` moves expired blocks to the *back* of the
default level. A claim (allocation or reuse) sets the block's priority when the request gives one for
it and always replaces its duration.

kvlab's version:

* Ranges are in *blocks* of the request (``KVBlock.position``): ``priorities=[(0, 4, 90)]`` gives the
  first four blocks (a system prompt) priority 90; a tuple may carry its own duration,
  ``(start, end, priority, duration_s)``, else ``duration_s`` applies; ``end=None`` means to the end.
  ``by_category={"api": [...]}`` replaces the ranges for requests of that category. The first range
  that contains a block wins.
* On insert, a block covered by no range gets ``default`` and no expiry; on a hit, an uncovered block
  keeps its priority and loses its duration (TRT-LLM's claim without a priority). A covered block gets
  the range's priority and duration on every access.
* The expiry clock is ``ctx.time`` (seconds): ``release time`` = time of the ``on_unpin`` that makes the
  block evictable; "now" for ``victim()`` is the latest ``ctx.time`` seen (``victim()`` has no context).
* TRT-LLM's free queues hold only leaf blocks of its radix tree; this policy orders every evictable
  block. For TRT-LLM's leaf restriction too, use ``make_policy("prefix-aware", inner="trtllm-priority",
  inner_params={...})``.
* Decode-block priorities (``decode_retention_priority``) are not modelled: output blocks are keyed by
  position like any other block. No state survives eviction.

Cost: Python O(log n) per expiring release, O(1) amortised per other event (one insertion-ordered queue
per level; ``victim()`` scans the levels in use). Compiled twin (``TRTLLMPriority.compiled``, run by the
replay's compiled engine), every parameter supported (ranges, ``default``, ``duration_s``, per-range
durations, ``by_category``): the same per-level queues as doubly linked lists (O(1) per event, O(levels)
per victim) and an indexed heap of the pending expiries keyed by (``float_key`` of ``time + duration``,
unpin stamp), O(log n) per expiring release; ``prepare`` keeps the workload's per-request ``arrival``
(``ctx.time``) and category (``ctx.category``), mapped to the range set each request uses. "now" is
updated by the same hooks (insert, hit, unpin) with the same float comparison. Tested hit for hit
against this class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from heapq import heappop, heappush
from typing import Annotated

import numba as nb
import numpy as np
from pydantic import AfterValidator, Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._queues import dl_append, dl_unlink, float_key, heap_push_stamped, heap_remove
from kvlab.policies.base import EvictionPolicy, register_policy

MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 100, 35

Range = tuple[int, int | None, int, float | None]

# the declared parameters; block positions are below 2**31 everywhere in kvlab
_POS = Annotated[int, Field(ge=0, le=2**31)]
_LEVEL = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
_DURATION = Annotated[float, Field(ge=0)] | None


def _start_before_end(r: tuple) -> tuple:
    if r[1] is not None and r[1] <= r[0]:
        raise ValueError("end <= start")
    return r


_RANGE = Annotated[
    tuple[_POS, _POS | None, _LEVEL] | tuple[_POS, _POS | None, _LEVEL, _DURATION], AfterValidator(_start_before_end)
]
RANGES = (f"a list of (start, end, priority[, duration_s]) block ranges with 0 <= start < end <= 2**31 (end None: "
          f"to the end), priority an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], duration_s a finite number >= 0 "
          "or None")
Ranges = Annotated[list[_RANGE], Field(description=RANGES)]
ByCategory = Annotated[
    dict[Annotated[str, Field(coerce_numbers_to_str=True)], list[_RANGE]] | None,
    Field(description="None or a mapping from category (a string) to " + RANGES),
]


def _ranges(spec: Sequence[Sequence], duration_s: float | None) -> list[Range]:
    """Ranges (checked by the declaration) with their durations filled in."""
    out: list[Range] = []
    for r in spec:
        start, end, prio = int(r[0]), None if r[1] is None else int(r[1]), int(r[2])
        dur = (None if r[3] is None else float(r[3])) if len(r) == 4 else duration_s
        out.append((start, end, prio, dur))
    return out


@register_policy("trtllm-priority")
class TRTLLMPriority(EvictionPolicy):
    """Lowest retention priority first, LRU within a priority; expired priorities fall to ``default``."""

    source = "TensorRT-LLM KvCacheRetentionConfig + LRUEvictionPolicy (evictionPolicy.cpp)"

    def __init__(
        self,
        priorities: Ranges = (),
        default: _LEVEL = DEFAULT_PRIORITY,
        duration_s: _DURATION = None,
        by_category: ByCategory = None,
    ) -> None:
        self.default = int(default)
        self.ranges = _ranges(priorities, duration_s)
        self.by_category = {str(k): _ranges(v, duration_s) for k, v in (by_category or {}).items()}
        self._ranged = bool(self.ranges or self.by_category)
        levels = {self.default} | {r[2] for rs in [self.ranges, *self.by_category.values()] for r in rs}
        self._levels = sorted(levels)
        # OrderedDicts: deleting at the front of a plain dict makes next(iter()) slow
        self._queues: dict[int, OrderedDict[int, KVBlock]] = {p: OrderedDict() for p in self._levels}
        self._prio: dict[int, int] = {}  # block_id -> current priority
        self._dur: dict[int, float | None] = {}  # block_id -> current duration (s)
        self._queued: dict[int, int] = {}  # block_id -> level of the queue holding it
        self._heap: list[tuple[float, int, int]] = []  # (expiry, stamp, block_id)
        self._stamp: dict[int, int] = {}
        self._next = 1
        self._n = 0
        self.now = float("-inf")
        self._enc: tuple | None = None  # (arrival, category_codes, categories), for the compiled twin

    def prepare(self, encoded: object) -> None:
        arrival = getattr(encoded, "arrival", None)
        codes = getattr(encoded, "category_codes", None)
        self._enc = (
            None if arrival is None else np.ascontiguousarray(arrival, dtype=np.float64),
            None if codes is None else np.asarray(codes, dtype=np.int64),
            tuple(getattr(encoded, "categories", ())),
        )

    def compiled_params(self) -> tuple:
        """``([default level, ranged, levels], set offsets, ranges [start, end or -1, level, has duration],
        durations, range set per request, arrival)``, levels as indices into the sorted levels. Set 0 is
        ``priorities``, set 1 + i the i-th ``by_category`` entry; a request uses its category's set if
        ``by_category`` names it, else set 0."""
        if self._enc is None or self._enc[0] is None:
            raise ConfigError("trtllm-priority: compiled_params() needs prepare(encoded) with per-request arrival")
        arrival, codes, labels = self._enc
        sets = [self.ranges, *self.by_category.values()]
        offsets = np.zeros(len(sets) + 1, np.int64)
        flat = [r for rs in sets for r in rs]
        for i, rs in enumerate(sets):
            offsets[i + 1] = offsets[i] + len(rs)
        level = {p: i for i, p in enumerate(self._levels)}  # the twin holds priorities as level indices
        rint = np.zeros((4, len(flat)), np.int64)
        rdur = np.zeros(len(flat), np.float64)
        for j, (start, end, prio, dur) in enumerate(flat):
            rint[:, j] = (start, -1 if end is None else end, level[prio], 0 if dur is None else 1)
            rdur[j] = 0.0 if dur is None else float(dur)
        n = len(arrival)
        req_set = np.zeros(n, np.int64)
        if codes is not None and self.by_category:
            index = {name: 1 + i for i, name in enumerate(self.by_category)}
            code_set = np.array([index.get(str(label), 0) for label in labels] + [0], np.int64)
            req_set = code_set[codes]  # code -1 (no category) -> the appended 0
        par = np.array([float(level[self.default]), 1.0 if self._ranged else 0.0, float(len(self._levels))])
        return (par, offsets, rint, rdur, req_set, arrival)

    def priority_of(self, position: int, ctx: AccessContext) -> tuple[int, float | None] | None:
        """``(priority, duration_s)`` a request with ``ctx`` gives the block at ``position``, or None."""
        ranges = self.by_category.get(ctx.category, self.ranges) if self.by_category else self.ranges
        for start, end, prio, dur in ranges:
            if start <= position and (end is None or position < end):
                return prio, dur
        return None

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.time > self.now:
            self.now = ctx.time
        bid = block.block_id
        got = self.priority_of(block.position, ctx) if self._ranged else None
        if got is None:
            self._prio[bid] = self.default
            self._dur[bid] = None
        else:
            self._prio[bid], self._dur[bid] = got

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.time > self.now:
            self.now = ctx.time
        bid = block.block_id
        got = self.priority_of(block.position, ctx) if self._ranged else None
        if got is None:
            self._dur[bid] = None
        else:
            self._prio[bid], self._dur[bid] = got

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.time > self.now:
            self.now = ctx.time
        bid = block.block_id
        level = self._prio[bid]
        self._queues[level][bid] = block
        self._queued[bid] = level
        self._n += 1
        dur = self._dur[bid]
        if dur is not None and level != self.default:
            s = self._next
            self._next = s + 1
            self._stamp[bid] = s
            heap = self._heap
            heappush(heap, (ctx.time + dur, s, bid))
            if len(heap) > 2 * len(self._stamp) + 1024:
                stamp = self._stamp
                self._heap = sorted(e for e in heap if stamp.get(e[2]) == e[1])

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        del self._queues[self._queued.pop(bid)][bid]
        if self._stamp:
            self._stamp.pop(bid, None)
        self._n -= 1

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        del self._queues[self._queued.pop(bid)][bid]
        if self._stamp:
            self._stamp.pop(bid, None)
        self._n -= 1

    def refresh(self) -> None:
        """Move blocks whose priority expired (expiry <= now) to the back of the default level."""
        heap, stamp, default = self._heap, self._stamp, self.default
        while heap and heap[0][0] <= self.now:
            _, s, bid = heappop(heap)
            if stamp.get(bid) != s:
                continue
            del stamp[bid]
            block = self._queues[self._queued[bid]].pop(bid)
            self._queues[default][bid] = block
            self._queued[bid] = default
            self._prio[bid] = default

    def victim(self) -> KVBlock:
        if self._heap:
            self.refresh()
        queues = self._queues
        for level in self._levels:
            q = queues[level]
            if q:
                return next(iter(q.values()))
        raise IndexError("victim() called with no evictable block")

    def __len__(self) -> int:
        return self._n


# ---------------------------------------------------------------------- compiled twin
# state: (B, F, FI, M, T, params). Priorities are held as level indices (into the sorted levels). B rows
# over blocks and one sentinel column per level (column capacity + level): the per-level queues, doubly
# linked lists [NXT, PRV] in entry order (front = next victim of that level); an indexed heap of the
# pending expiries [EH, EP] keyed by (EKEY, ESTAMP) = (float_key of the expiry, unpin stamp); PRIO
# (current level) and HASDUR (current duration is not None). F (float64) rows: DUR (current duration)
# and EXP (expiry), read as IEEE bits through FI, an int64 view of F. M = [expiry heap size, stamp clock,
# levels, default level, capacity, ranged]; T = [now].
NXT, PRV, EH, EP, EKEY, ESTAMP, PRIO, HASDUR = range(8)
DUR, EXP = range(2)
NE, CLOCK, NLEV, DEF, CAP, RANGED = range(6)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    par = params[0]
    nlev = np.int64(par[2])
    B = np.zeros((8, capacity + nlev), np.int64)
    B[EP] = -1
    for li in range(nlev):
        B[NXT, capacity + li] = capacity + li
        B[PRV, capacity + li] = capacity + li
    F = np.zeros((2, capacity), np.float64)
    M = np.zeros(6, np.int64)
    M[NLEV] = nlev
    M[DEF] = np.int64(par[0])
    M[CAP] = capacity
    M[RANGED] = np.int64(par[1])
    return (B, F, F.view(np.int64), M, np.full(1, -np.inf), params)


@nb.njit(cache=True)
def _assign(state, b, seq, pos, insert):
    """``on_insert`` (``insert``) / ``on_hit``: now, then the priority and duration of the covering range."""
    B, F, M, T, params = state[0], state[1], state[3], state[4], state[5]
    t = params[5][seq]
    if t > T[0]:
        T[0] = t
    if M[RANGED] != 0:
        offsets, rint, rdur, req_set = params[1], params[2], params[3], params[4]
        s = req_set[seq]
        for j in range(offsets[s], offsets[s + 1]):
            if rint[0, j] <= pos and (rint[1, j] < 0 or pos < rint[1, j]):
                B[PRIO, b] = rint[2, j]
                B[HASDUR, b] = rint[3, j]
                F[DUR, b] = rdur[j]
                return
    if insert:
        B[PRIO, b] = M[DEF]
    B[HASDUR, b] = 0


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    _assign(state, b, seq, pos, True)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    _assign(state, b, seq, pos, False)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M, T = state[0], state[3], state[4]
    t = state[5][5][seq]
    if t > T[0]:
        T[0] = t
    level = B[PRIO, b]
    dl_append(B, NXT, PRV, M[CAP] + level, b)
    if B[HASDUR, b] != 0 and level != M[DEF]:
        F, FI = state[1], state[2]
        F[EXP, b] = t + F[DUR, b]
        heap_push_stamped(B, M, EH, EP, EKEY, ESTAMP, NE, CLOCK, b, float_key(FI[EXP, b]))


@nb.njit(cache=True)
def _drop(state, b):
    B = state[0]
    dl_unlink(B, NXT, PRV, b)
    if B[EP, b] >= 0:
        heap_remove(B, state[3], EH, EP, EKEY, ESTAMP, NE, b)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    _drop(state, b)


@nb.njit(cache=True)
def _on_evict(state, b):
    _drop(state, b)


@nb.njit(cache=True)
def _victim(state):
    B, M = state[0], state[3]
    cap = M[CAP]
    if M[NE] > 0:
        # refresh: expired blocks (expiry <= now), in expiry order, to the back of the default level
        F, now, default = state[1], state[4][0], M[DEF]
        while M[NE] > 0:
            b = B[EH, 0]
            if not F[EXP, b] <= now:
                break
            heap_remove(B, M, EH, EP, EKEY, ESTAMP, NE, b)
            dl_unlink(B, NXT, PRV, b)
            dl_append(B, NXT, PRV, cap + default, b)
            B[PRIO, b] = default
    for li in range(M[NLEV]):
        b = B[NXT, cap + li]
        if b != cap + li:
            return b
    return -1


TRTLLMPriority.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
