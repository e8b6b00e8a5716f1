"""LFU: evict the least frequently used evictable block; among those, the least recently unpinned.

Source: classic least-frequently-used replacement, in libCacheSim's form (``LFU.c``: one FIFO per
frequency, appended on every access, evicting from the lowest non-empty frequency). Documented choices:

* frequency = 1 at insertion + 1 per hit (``on_hit``, counted even while the block is pinned);
* tie-break: least recently *unpinned* first (vLLM's LRU order, so a sequence's tail goes before its
  head). On object sequences every access unpins its block at once, which is libCacheSim's order
  (least recently accessed within a frequency);
* frequency does **not** survive eviction (as in libCacheSim's LFU): a recomputed key starts at 1;
* pin/unpin: a pinned block is out of the order; unpinning re-enters it as the most recent of its
  frequency.

On object sequences this is libCacheSim's LFU hit for hit. Python: O(1) per event but when a frequency
gets its first block (O(log n)); compiled: O(log n) (heap on (frequency, unpin stamp)).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._queues import BucketQueue, heap_fix, heap_push_stamped, heap_remove
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lfu")
class LFU(EvictionPolicy):
    """Smallest ``(frequency, unpin time)`` first. Invariant: ``_freq`` holds every cached block's count;
    ``_queue`` holds the evictable blocks keyed by their count when unpinned."""

    source = "classic LFU (libCacheSim LFU); ties: least recently unpinned; frequency reset on eviction"

    def __init__(self) -> None:
        self._queue = BucketQueue()
        self._freq: dict[int, int] = {}

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = 1

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] += 1

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.remove(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.push(block, self._freq[block.block_id])

    def victim(self) -> KVBlock:
        return self._queue.first()

    def on_evict(self, block: KVBlock) -> None:
        if block.block_id in self._queue:
            self._queue.remove(block.block_id)
        del self._freq[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------------- compiled twin
# state: (B, M): an indexed heap of the evictable blocks on the rows of B keyed by (frequency, unpin
# stamp); M = [heap size, clock].
H, P, FREQ, STAMP = range(4)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((4, capacity), np.int64)
    B[P] = -1
    return (B, np.zeros(2, np.int64))


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][FREQ, b] = 1


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    B, M = state
    B[FREQ, b] += 1
    if B[P, b] >= 0:
        heap_fix(B, M, H, P, FREQ, STAMP, 0, b)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, M = state
    heap_remove(B, M, H, P, FREQ, STAMP, 0, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    heap_push_stamped(B, M, H, P, FREQ, STAMP, 0, 1, b, B[FREQ, b])


@nb.njit(cache=True)
def _victim(state):
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    heap_remove(B, M, H, P, FREQ, STAMP, 0, b)


LFU.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
