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

Cost: ``prepare`` is O(m log m) for m key occurrences; then every key occurrence of the trace is
advanced once (O(1) each), plus O(log n) per event and per evictable block whose key's next use moves
(n evictable blocks). Compiled twin (``Belady.compiled``, run by the replay's compiled engine): the same
order on an indexed heap keyed by (``NEVER - next use``, push stamp), with the same stamp sequence and the
same clock (a request is learnt at ``on_insert``/``on_hit``/``on_pin``/``on_unpin``, not ``on_miss``, and
keys are advanced in ``on_unpin`` and ``victim``); ``compiled_params()`` passes the prepared
``(offsets, key_ids, next use)`` arrays. Tested hit for hit against this class and libCacheSim.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._heap import HeapPolicy
from kvlab.policies._queues import heap_fix, heap_push_stamped, heap_remove, list_append, list_unlink
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
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # for the compiled twin

    def prepare(self, encoded: object) -> None:
        offsets = np.ascontiguousarray(encoded.offsets, dtype=np.int64)  # type: ignore[attr-defined]
        key_ids = np.ascontiguousarray(encoded.key_ids, dtype=np.int64)  # type: ignore[attr-defined]
        nxt = next_use(offsets, key_ids)
        self._arrays = (offsets, key_ids, nxt)
        self._off = offsets.tolist()
        self._keys = key_ids.tolist()
        self._nxt = nxt.tolist()
        num_keys = int(key_ids.max()) + 1 if len(key_ids) else 0
        self._key_next = [NEVER] * max(num_keys, int(getattr(encoded, "num_keys", 0)))
        self._done = -1
        self._cur = -1
        self._evictable = {}

    def compiled_params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prepared future: ``(offsets, key_ids, next use per key occurrence)``, int64."""
        if self._arrays is None:
            raise ConfigError("belady needs prepare(encoded) with the workload's future before use")
        return self._arrays

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
        self._push(bid, NEVER - self._key_next[k])

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


# ---------------------------------------------------------------------- compiled twin
# state: (B, K, M, off, keys, nxt). B rows over blocks: an indexed heap of the evictable blocks keyed by
# (NEVER - next use of the block's key, push stamp) [H, P, PRI, STAMP], the block's key [BKEY] and links
# of its key's list of evictable blocks in unpin order [ENXT, EPRV]; K rows over keys: that list's
# [KHEAD, KTAIL] (-1 = none) and the key's next use [KNEXT]; M = [heap size, next stamp, done, cur] as in
# the Python class. Python's stale heap entries are replaced by heap_fix with the new (priority, stamp).
H, P, PRI, STAMP, BKEY, ENXT, EPRV = range(7)
KHEAD, KTAIL, KNEXT = range(3)
_N, _NEXT, _DONE, _CUR = range(4)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    off, keys, nxt = params
    B = np.full((7, capacity), -1, np.int64)
    K = np.full((3, num_keys), -1, np.int64)
    K[KNEXT] = NEVER
    M = np.zeros(4, np.int64)
    M[_NEXT] = 1
    M[_DONE] = -1
    M[_CUR] = -1
    return (B, K, M, off, keys, nxt)


@nb.njit(cache=True)
def _advance(state, seq):
    """Belady._advance: every key of requests done+1 .. seq gets its next use after that request; its
    evictable blocks (in unpin order) get the new priority and fresh stamps."""
    B, K, M, off, keys, nxt = state
    for r in range(M[_DONE] + 1, seq + 1):
        for j in range(off[r], off[r + 1]):
            k = keys[j]
            nx = nxt[j]
            K[KNEXT, k] = nx
            b = K[KHEAD, k]
            while b >= 0:
                B[PRI, b] = NEVER - nx
                B[STAMP, b] = M[_NEXT]
                M[_NEXT] += 1
                heap_fix(B, M, H, P, PRI, STAMP, _N, b)
                b = B[ENXT, b]
    M[_DONE] = seq


@nb.njit(cache=True, inline="always")
def _see(M, seq):
    if seq > M[_CUR]:
        M[_CUR] = seq


@nb.njit(cache=True)
def _forget(B, K, M, b):
    """Take evictable block ``b`` out of the heap and its key's list."""
    heap_remove(B, M, H, P, PRI, STAMP, _N, b)
    list_unlink(B, ENXT, EPRV, K, KHEAD, KTAIL, B[BKEY, b], b)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][BKEY, b] = key
    _see(state[2], seq)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    _see(state[2], seq)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, K, M = state[0], state[1], state[2]
    _see(M, seq)
    _forget(B, K, M, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, K, M = state[0], state[1], state[2]
    _see(M, seq)
    if M[_CUR] > M[_DONE]:
        _advance(state, M[_CUR])
    k = B[BKEY, b]
    list_append(B, ENXT, EPRV, K, KHEAD, KTAIL, k, b)
    heap_push_stamped(B, M, H, P, PRI, STAMP, _N, _NEXT, b, NEVER - K[KNEXT, k])


@nb.njit(cache=True)
def _victim(state):
    M = state[2]
    if M[_CUR] > M[_DONE]:
        _advance(state, M[_CUR])
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    _forget(state[0], state[1], state[2], b)


Belady.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
