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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from heapq import heappop, heappush

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies.base import EvictionPolicy, register_policy

MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 100, 35

Range = tuple[int, int | None, int, float | None]


def _ranges(spec: Sequence[Sequence], duration_s: float | None, what: str) -> list[Range]:
    out: list[Range] = []
    for r in spec:
        if len(r) not in (3, 4):
            raise ConfigError(f"trtllm-priority: {what} range {r!r} must be (start, end, priority[, duration_s])")
        start, end, prio = int(r[0]), None if r[1] is None else int(r[1]), int(r[2])
        dur = (None if r[3] is None else float(r[3])) if len(r) == 4 else duration_s
        if start < 0 or (end is not None and end <= start):
            raise ConfigError(f"trtllm-priority: {what} range {r!r} needs 0 <= start < end (blocks)")
        if not MIN_PRIORITY <= prio <= MAX_PRIORITY:
            raise ConfigError(f"trtllm-priority: priority {prio} outside {MIN_PRIORITY}..{MAX_PRIORITY}")
        if dur is not None and not dur >= 0:
            raise ConfigError(f"trtllm-priority: duration {dur} must be >= 0 seconds")
        out.append((start, end, prio, dur))
    return out


@register_policy("trtllm-priority")
class TRTLLMPriority(EvictionPolicy):
    """Lowest retention priority first, LRU within a priority; expired priorities fall to ``default``."""

    source = "TensorRT-LLM KvCacheRetentionConfig + LRUEvictionPolicy (evictionPolicy.cpp)"

    def __init__(
        self,
        priorities: Sequence[Sequence] = (),
        default: int = DEFAULT_PRIORITY,
        duration_s: float | None = None,
        by_category: dict[str, Sequence[Sequence]] | None = None,
    ) -> None:
        if not MIN_PRIORITY <= int(default) <= MAX_PRIORITY:
            raise ConfigError(f"trtllm-priority: default {default} outside {MIN_PRIORITY}..{MAX_PRIORITY}")
        if duration_s is not None and not duration_s >= 0:
            raise ConfigError(f"trtllm-priority: duration_s must be >= 0 seconds, got {duration_s}")
        self.default = int(default)
        self.ranges = _ranges(priorities, duration_s, "priorities")
        self.by_category = {str(k): _ranges(v, duration_s, f"category {k!r}") for k, v in (by_category or {}).items()}
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
