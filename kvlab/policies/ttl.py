"""TTL: a cached block expires ``ttl_s`` seconds after its last use; expired blocks are evicted first.

Source: time-to-live expiry as in hosted prompt caches (e.g. Anthropic prompt caching: a 5-minute
lifetime refreshed each time the cached prefix is used), combined with LRU for unexpired blocks.

Choices:

* A block's last use ends when it is unpinned: it expires at ``ctx.time`` of its ``on_unpin`` plus the
  TTL of that request's category (``by_category``; otherwise ``ttl_s``). Units: seconds of ``ctx.time``
  (trace time in the replay).
* Expiry only orders blocks; it frees nothing by itself (the core evicts on demand only). ``victim()``
  returns the expired block with the oldest expiry (ties: least recently unpinned); if none has
  expired, the least recently unpinned block (LRU, vLLM's order).
* "Now" is the latest ``ctx.time`` the policy has seen: ``victim()`` gets no context, so a request
  without hits evicts at the time of the previous event.
* With one TTL for every category and a clock that never goes back, expiry order equals unpin order,
  so the policy then evicts exactly like ``lru``; it differs when categories get different TTLs.
* Within one TTL, blocks are ordered by unpin time; that is expiry order as long as ``ctx.time``
  does not go back (true of every driver's clock).
* No state survives eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated

from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, register_policy

#: a TTL in seconds of trace time (0: expired as soon as unpinned, evicted before anything unexpired)
Seconds = Annotated[float, Field(ge=0)]
Category = Annotated[str, Field(coerce_numbers_to_str=True)]


@register_policy("ttl")
class TTL(EvictionPolicy):
    """Expired (oldest expiry first), else least recently unpinned.

    One queue in unpin order per distinct TTL: with a clock that never goes back, a queue's head has
    its oldest expiry, so ``victim()`` compares only the heads (O(distinct TTLs)). A global queue in
    unpin order serves the LRU fallback. With a single TTL (no ``by_category``) the one queue *is* the
    global queue, so only that is kept. OrderedDicts: deleting at the front of a plain dict makes
    ``next(iter())`` slow.
    """

    source = "TTL expiry (hosted prompt caches), LRU among unexpired blocks"

    def __init__(
        self,
        ttl_s: Seconds = 300.0,
        by_category: Annotated[
            dict[Category, Seconds] | None,
            Field(description="None or a mapping from category (a string) to a finite number >= 0 (seconds)"),
        ] = None,
    ) -> None:
        self.ttl_s = float(ttl_s)
        self.by_category = {str(k): float(v) for k, v in (by_category or {}).items()}
        self._lru: OrderedDict[int, KVBlock] = OrderedDict()
        self._groups: dict[float, OrderedDict[int, tuple[float, int]]] = {}  # ttl -> {bid: (expiry, stamp)}
        self._group_of: dict[int, OrderedDict[int, tuple[float, int]]] = {}
        self._next = 1
        self.now = float("-inf")

    def ttl_of(self, ctx: AccessContext) -> float:
        """TTL (seconds) of a block last used by a request with context ``ctx``."""
        return self.by_category.get(ctx.category, self.ttl_s) if self.by_category else self.ttl_s

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.time > self.now:
            self.now = ctx.time

    on_hit = on_insert

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        del self._lru[bid]
        if self.by_category:
            del self._group_of.pop(bid)[bid]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        t = ctx.time
        if t > self.now:
            self.now = t
        bid = block.block_id
        if not self.by_category:  # one TTL: its queue is the LRU queue
            self._lru[bid] = block
            return
        ttl = self.ttl_of(ctx)
        group = self._groups.get(ttl)
        if group is None:
            group = self._groups[ttl] = OrderedDict()
        s = self._next
        self._next = s + 1
        group[bid] = (t + ttl, s)
        self._group_of[bid] = group
        self._lru[bid] = block

    def victim(self) -> KVBlock:
        if not self.by_category:
            return next(iter(self._lru.values()))
        now = self.now
        best = None
        for group in self._groups.values():
            if group:
                bid, head = next(iter(group.items()))
                if head[0] <= now and (best is None or head < best[1]):
                    best = (bid, head)
        if best is not None:
            return self._lru[best[0]]
        return next(iter(self._lru.values()))

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        del self._lru[bid]
        if self.by_category:
            del self._group_of.pop(bid)[bid]

    def __len__(self) -> int:
        return len(self._lru)
