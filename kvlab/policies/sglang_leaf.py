"""SGLang RadixAttention eviction: least recently used among the leaves of the prefix tree.

Source: L. Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(NeurIPS'24), §3 RadixAttention: "an LRU eviction policy that recursively evicts leaf nodes";
sglang/srt/mem_cache/radix_cache.py (``evict`` pops leaves from a heap on ``last_access_time``;
``match_prefix`` and ``insert`` refresh it; nodes with a lock (ref) count are skipped).

Choices:

* Candidates are evictable blocks without cached children (``cache.num_cached_children(key) == 0``);
  evicting a leaf can make its parent a candidate (see ``kvlab.policies._heap``). A radix node spans a
  run of tokens; here a node is one block.
* Recency is the last *access* (a hit or the insert), not the unpin as in vLLM's LRU: SGLang refreshes
  ``last_access_time`` on match and insert. Accesses are numbered per request by a logical clock (a
  new request = a new ``(ctx.seq, ctx.request_id)``; SGLang uses wall time), so runs are deterministic.
  Within one request the deeper block counts as older. One request's blocks lie on one path, of which
  only the deepest cached block can be a leaf, so among leaves this is exactly SGLang's order; it only
  spares the policy from skipping over the path's interior blocks.
* If no evictable block is a leaf (only when every evictable block has a pinned child, e.g. duplicates),
  the least recently accessed evictable block is evicted.
* State does not survive eviction.
"""

from __future__ import annotations

from heapq import heappush

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies._heap import LeafHeapPolicy
from kvlab.policies.base import register_policy

_POS_LIMIT = (1 << 31) - 1


@register_policy("sglang-leaf")
class SGLangLeaf(LeafHeapPolicy):
    """Least recently accessed leaf first."""

    source = "SGLang RadixAttention (radix_cache.py): LRU over leaf nodes by last access"

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0
        self._seq: int | None = None
        self._rid: int | None = None
        self._last: list[int] = []

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._last = [0] * cache.num_blocks  # type: ignore[attr-defined]

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq != self._seq or ctx.request_id != self._rid:
            self._seq, self._rid = ctx.seq, ctx.request_id
            self._clock += 1
        # (request clock, -position) in one int; positions below 2**31
        self._last[block.block_id] = (self._clock << 31) | (_POS_LIMIT - block.position)

    on_hit = on_insert

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id  # HeapPolicy._push, inlined
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        e = (self._last[bid], s, bid)
        run = self._run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(self._heap, e)
        self._n += 1
