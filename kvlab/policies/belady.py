"""Belady's MIN (OPT), offline: evict the block whose key is next used farthest in the future.

Source: L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
Journal 5(2), 1966; libCacheSim's ``Belady`` (libCacheSim/cache/eviction/Belady.c: a priority queue on
each object's next access time, the farthest evicted) is the reference it is tested against.

``prepare(encoded)`` reads the future from the EncodedWorkload the cache will replay: for every
occurrence of a key in request ``r`` it stores the index of the next *later* request holding that key
(never = infinity). ``ctx.seq`` is the current request's index (the replay's admission order). When
the policy learns that request ``r`` has started, every key of ``r`` moves its next use past ``r``,
whether or not the cache looked it up (stop-at-first-miss), so no block keeps a next use that has
already gone by.

What it means (DESIGN.md): on object sequences (one-block requests, ``mode="ideal"``) this is OPT, a
bound for every online policy with the same capacity; on prefix traces the chain dependency and
stop-at-first-miss make it a strong heuristic, not a bound (a block whose key comes back soon is
useless if its parent is evicted first).

Choices:

* Ties (only possible among keys never used again, or duplicate blocks of one key) go to the least
  recently unpinned block. libCacheSim breaks them by its heap order; ties never change a hit, so the
  per-access hit vectors are identical (tested).
* ``victim()`` has no context: it uses the future as of the last event. A request with no hits
  allocates before the policy has seen its index, so that request's own cached-but-unreachable keys
  (orphans behind its first miss) still count as used now and are kept for that one allocation.
* Keys must be the dense key ids of the prepared EncodedWorkload (the Python replay's keys).
* State is per key and survives eviction (it is the trace's future, not the cache's history).
"""

from __future__ import annotations

from heapq import heappush

import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._heap import HeapPolicy
from kvlab.policies.base import register_policy

NEVER = 1 << 62


def next_use(offsets: np.ndarray, key_ids: np.ndarray) -> np.ndarray:
    """int64 per key occurrence: index of the next later request holding the same key, or NEVER."""
    offsets = np.asarray(offsets, dtype=np.int64)
    key_ids = np.asarray(key_ids, dtype=np.int64)
    m = len(key_ids)
    req = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    order = np.lexsort((np.arange(m), key_ids))  # grouped by key, in trace order
    nxt = np.full(m, -1, dtype=np.int64)  # next occurrence of the same key
    if m > 1:
        same = key_ids[order[1:]] == key_ids[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    # a key repeated inside one request: jump to the first occurrence in a later request
    while True:
        has = nxt >= 0
        stay = np.zeros(m, dtype=bool)
        stay[has] = req[nxt[has]] == req[has]
        if not stay.any():
            break
        nxt[stay] = nxt[nxt[stay]]
    out = np.full(m, NEVER, dtype=np.int64)
    has = nxt >= 0
    out[has] = req[nxt[has]]
    return out


@register_policy("belady")
class Belady(HeapPolicy):
    """Evict the block whose key's next request is farthest (offline; needs ``prepare``)."""

    source = "Belady 1966 (MIN/OPT), as libCacheSim's Belady; offline, reads the trace's future"

    def __init__(self) -> None:
        super().__init__()
        self._off: list[int] | None = None
        self._keys: list[int] = []
        self._nxt: list[int] = []
        self._key_next: list[int] = []
        self._done = -1  # last request whose keys were advanced
        self._cur = -1  # latest request index seen in a context
        self._evictable: dict[int, int | list[int]] = {}  # key -> its evictable block id(s)

    def prepare(self, encoded: object) -> None:
        offsets = np.asarray(encoded.offsets, dtype=np.int64)  # type: ignore[attr-defined]
        key_ids = np.asarray(encoded.key_ids, dtype=np.int64)  # type: ignore[attr-defined]
        self._off = offsets.tolist()
        self._keys = key_ids.tolist()
        self._nxt = next_use(offsets, key_ids).tolist()
        num_keys = int(key_ids.max()) + 1 if len(key_ids) else 0
        self._key_next = [NEVER] * max(num_keys, int(getattr(encoded, "num_keys", 0)))
        self._done = -1
        self._cur = -1
        self._evictable = {}

    def _advance(self, seq: int) -> None:
        """Move the next use of every key of requests ``done+1 .. seq`` past its request."""
        off = self._off
        if off is None:
            raise ConfigError("belady needs prepare(encoded) with the workload's future before use")
        if seq >= len(off) - 1:
            raise ConfigError(f"belady: request {seq} is beyond the prepared workload ({len(off) - 1} requests)")
        keys, nxt, key_next, evictable = self._keys, self._nxt, self._key_next, self._evictable
        for r in range(self._done + 1, seq + 1):
            for j in range(off[r], off[r + 1]):
                k = keys[j]
                key_next[k] = nxt[j]
                held = evictable.get(k)
                if held is not None:
                    for bid in [held] if type(held) is int else held:
                        self._repush(bid, NEVER - nxt[j])
        self._done = seq

    def _repush(self, bid: int, priority: int) -> None:
        """A new entry for an evictable block whose key's next use moved (the old one goes stale)."""
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        self._put((priority, s, bid))
        self._stale += 1

    # Hooks only note the latest request index; keys are advanced when an order is needed (on_unpin,
    # victim), after the request's hits are pinned, so hit blocks never get an entry they lose at once.

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if self._off is None:
            raise ConfigError("belady needs prepare(encoded) with the workload's future before use")
        if ctx.seq > self._cur:
            self._cur = ctx.seq

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq > self._cur:
            self._cur = ctx.seq

    def victim(self) -> KVBlock:
        if self._cur > self._done:
            self._advance(self._cur)
        return super().victim()

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq > self._cur:
            self._cur = ctx.seq
        if self._cur > self._done:
            self._advance(self._cur)
        k = block.key
        bid = block.block_id
        held = self._evictable.get(k)
        if held is None:
            self._evictable[k] = bid
        elif type(held) is int:
            self._evictable[k] = [held, bid]
        else:
            held.append(bid)
        s = self._next  # HeapPolicy._push, inlined
        self._next = s + 1
        self._stamp[bid] = s
        e = (NEVER - self._key_next[k], s, bid)
        run = self._run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(self._heap, e)
        self._n += 1

    def _forget(self, block: KVBlock) -> None:
        k = block.key
        bid = block.block_id
        held = self._evictable[k]
        if type(held) is int:
            del self._evictable[k]
        else:
            held.remove(bid)
            if len(held) == 1:
                self._evictable[k] = held[0]
        self._stamp[bid] = 0
        self._n -= 1

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq > self._cur:
            self._cur = ctx.seq
        self._forget(block)
        self._stale += 1
        if self._stale > self._n + 1024:
            self._compact()

    def on_evict(self, block: KVBlock) -> None:
        self._forget(block)
