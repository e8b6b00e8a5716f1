"""PGDSF: RAGCache's prefix-aware Greedy-Dual-Size-Frequency, on the leaves of the prefix tree.

Source: C. Jin et al., "RAGCache: Efficient Knowledge Caching for Retrieval-Augmented Generation",
arXiv 2404.12457, §5 (knowledge tree, PGDSF replacement). The search tool held only the abstract and
third-party summaries of the paper ("Priority = Clock + Frequency x Cost / Size"; "considers the
document order, size, frequency and recency"); the details below follow the paper's structure as we
read it and are documented as kvlab's choices.

``priority = clock + frequency * cost / size``, lowest evicted first; ``clock`` becomes the victim's
priority (it never decreases). A knowledge-tree node is one cached block here:

* ``size`` = 1 block (all nodes have the same size, so it only fixes the units).
* ``frequency`` = number of requests that used the node's *key* (hits and recomputations), kept across
  evictions: RAGCache counts retrievals of a document, which happen whether or not it is cached.
  (RAGCache counts within a time window; kvlab counts over the whole run.)
* ``cost`` is prefix-aware: the per-token prefill cost of the request span that computed the block,
  which depends on how much of the prefix was cached then. A request with ``c`` cached tokens computes
  ``n`` new ones, token ``i`` attending over ``c + i`` tokens, so its mean per-token cost is
  ``1 + attention_ratio * (c + (n + 1) / 2)`` (units: linear FLOPs per token; ``attention_ratio`` as in
  ``gdsf``, the profiled-time table of RAGCache replaced by this FLOP model). A key's cost is the mean
  over every time it was computed, kept across evictions. ``c`` is the position of the request's first
  inserted block times the block size; ``n = prompt_tokens - c`` (at least one block).
* Only leaves are evicted (blocks whose key has no cached children), as RAGCache evicts leaf nodes of
  its knowledge tree to keep every cached node reachable; see ``kvlab.policies._heap``.
* Ties go to the least recently unpinned block. One clock per cache (per tier).

Units: priorities in cost units; ``block_size`` (from the cache) in tokens.
"""

from __future__ import annotations

from collections.abc import Hashable
from heapq import heappush

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._heap import LeafHeapPolicy
from kvlab.policies.base import register_policy
from kvlab.policies.gdsf import LLAMA2_7B_ATTENTION_RATIO


@register_policy("pgdsf")
class PGDSF(LeafHeapPolicy):
    """RAGCache PGDSF: lowest ``clock + key frequency * prefix-aware cost`` among leaf blocks."""

    source = "RAGCache (Jin et al., arXiv 2404.12457) PGDSF; leaf-only; FLOP cost model"

    def __init__(self, attention_ratio: float = LLAMA2_7B_ATTENTION_RATIO) -> None:
        super().__init__()
        if not attention_ratio >= 0:
            raise ConfigError(f"pgdsf: attention_ratio must be >= 0, got {attention_ratio}")
        self.attention_ratio = float(attention_ratio)
        self.clock = 0.0
        self._stats: dict[Hashable, list] = {}  # key -> [frequency, mean cost, computations]
        self._prio: list[float] = []
        self._block_size = 1
        self._span_seq: int | None = None  # (seq, request_id) of the request whose span cost is cached
        self._span_rid: int | None = None
        self._span_cost = 1.0

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._prio = [0.0] * cache.num_blocks  # type: ignore[attr-defined]
        self._block_size = cache.block_size  # type: ignore[attr-defined]

    def span_cost(self, cached_tokens: int, new_tokens: int) -> float:
        """Mean per-token prefill cost of ``new_tokens`` computed after ``cached_tokens``."""
        return 1.0 + self.attention_ratio * (cached_tokens + (new_tokens + 1) / 2)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq != self._span_seq or ctx.request_id != self._span_rid:  # a new request: its span cost
            self._span_seq, self._span_rid = ctx.seq, ctx.request_id
            c = block.position * self._block_size
            self._span_cost = self.span_cost(c, max(ctx.prompt_tokens - c, self._block_size))
        cost = self._span_cost
        key = block.key
        st = self._stats.get(key)
        if st is None:
            self._stats[key] = [1, cost, 1]
            self._prio[block.block_id] = self.clock + cost
        else:
            f, n = st[0] + 1, st[2] + 1
            mean = st[1] + (cost - st[1]) / n
            st[0], st[1], st[2] = f, mean, n
            self._prio[block.block_id] = self.clock + f * mean

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        st = self._stats[block.key]
        f = st[0] + 1
        st[0] = f
        self._prio[block.block_id] = self.clock + f * st[1]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id  # HeapPolicy._push, inlined
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        e = (self._prio[bid], s, bid)
        run = self._run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(self._heap, e)
        self._n += 1

    def on_evict(self, block: KVBlock) -> None:
        h = self._prio[block.block_id]
        if h > self.clock:
            self.clock = h
        super().on_evict(block)

    def on_remove(self, block: KVBlock) -> None:
        super().on_evict(block)
