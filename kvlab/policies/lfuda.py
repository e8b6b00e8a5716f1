"""LFU-DA: LFU with dynamic aging.

Source: Arlitt, Cherkasova, Dilley, Friedrich, Jin, "Evaluating Content Management Techniques for Web
Proxy Caches", HP Labs / ACM SIGMETRICS PER 2000 (LFU-DA, with unit size and cost). Each block has a
priority ``K = L + F``: ``F`` its frequency (1 at insertion, +1 per hit) and ``L`` the cache age, set to
the priority of every evicted block; a block's ``K`` is recomputed with the current ``L`` at each hit,
so blocks that stopped being used age out. ``victim()`` is the smallest ``K``.

Documented choices: ties go to the least recently unpinned block (vLLM's LRU order); a hit counts even
while the block is pinned; pinned blocks are out of the order and rejoin it at unpin with their
current ``K``; per-block frequency does not survive eviction (only ``L`` remembers). libCacheSim's
``LFUDA.c`` is not this formula (it adds the current minimum to the frequency at each hit and does not
increment it), so no cross-check with it is claimed.

Python: O(1) per event but when a priority gets its first block (O(log n)). Compiled twin (numba, used
by the replay driver's compiled engine; tested hit for hit against this class): O(log n) per event, an
indexed heap on ``(K at unpin, unpin stamp)``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._queues import BucketQueue, heap_push_stamped, heap_remove
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lfuda")
class LFUDA(EvictionPolicy):
    """Smallest ``(K, unpin stamp)`` first. Invariants: ``_freq`` / ``_prio`` cover every cached block;
    ``age`` never decreases."""

    source = "LFU-DA (Arlitt et al., 2000): priority = cache age + frequency"

    def __init__(self) -> None:
        self._queue = BucketQueue()
        self._freq: dict[int, int] = {}
        self._prio: dict[int, int] = {}
        self.age = 0

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = 1
        self._prio[block.block_id] = self.age + 1

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        self._freq[bid] += 1
        self._prio[bid] = self.age + self._freq[bid]

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.remove(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.push(block, self._prio[block.block_id])

    def victim(self) -> KVBlock:
        return self._queue.first()

    def _drop(self, block: KVBlock) -> int:
        bid = block.block_id
        if bid in self._queue:
            self._queue.remove(bid)
        del self._freq[bid]
        return self._prio.pop(bid)

    def on_evict(self, block: KVBlock) -> None:
        self.age = max(self.age, self._drop(block))

    def on_remove(self, block: KVBlock) -> None:
        self._drop(block)

    def __len__(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------------- compiled twin
# state: (B, M). B (per block): an indexed heap of the evictable blocks (H, P) keyed by (KEY, STAMP) = (K
# when unpinned, unpin stamp), as the Python BucketQueue's push order; FREQ and PRIO (K) of every cached
# block. M = [heap size, stamp clock, age L].
H, P, FREQ, PRIO, KEY, STAMP = range(6)
N, CLOCK, AGE = range(3)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((6, capacity), np.int64)
    B[P] = -1
    return (B, np.zeros(3, np.int64))


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B, M = state
    B[FREQ, b] = 1
    B[PRIO, b] = M[AGE] + 1


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    # an evictable block's heap key stays (as in Python): on_pin follows and takes it out
    B, M = state
    f = B[FREQ, b] + 1
    B[FREQ, b] = f
    B[PRIO, b] = M[AGE] + f


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, M = state
    heap_remove(B, M, H, P, KEY, STAMP, N, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    heap_push_stamped(B, M, H, P, KEY, STAMP, N, CLOCK, b, B[PRIO, b])


@nb.njit(cache=True)
def _victim(state):
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    if B[P, b] >= 0:
        heap_remove(B, M, H, P, KEY, STAMP, N, b)
    if B[PRIO, b] > M[AGE]:
        M[AGE] = B[PRIO, b]


LFUDA.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
