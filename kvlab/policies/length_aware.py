"""LengthAwareCache from Mooncake: LFU that evicts blocks occurring later in requests first.

Source: R. Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving",
arXiv 2407.00079 v3, §4.2 and Table 1: "LengthAwareCache (similar to LFU but prioritizing eviction
of cache blocks occurring later in requests)". That one sentence is the whole published definition
(v4 words it "prioritizing cache blocks occurring later in requests"; we follow v3, which says which
blocks go first, and which agrees with prefix reuse: a later block is useless without its prefix).

Choices:

* Order: lowest frequency first; among equal frequencies the block at the larger position (block
  index in its sequence, ``KVBlock.position``) first; then the least recently unpinned. Frequency is
  primary because the policy is "similar to LFU".
* Frequency = 1 at insert, +1 per hit (hits on pinned blocks included); it does not survive eviction.

Cost: Python O(log n) per event (:class:`~kvlab.policies._heap.HeapPolicy` lazy heap). Compiled twin
(``LengthAware.compiled``, run by the replay's compiled engine), O(log n) per event: an indexed heap
keyed by (the same ``(frequency << 32) | (2**31 - 1 - position)`` int, unpin stamp), the position kept
from ``on_insert``. Tested hit for hit against this class.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._heap import HeapPolicy
from kvlab.policies._queues import heap_push_stamped, heap_remove
from kvlab.policies.base import register_policy

_POS_LIMIT = (1 << 31) - 1


@register_policy("length-aware")
class LengthAware(HeapPolicy):
    """Evict the lowest ``(frequency, -position)``; ties least recently unpinned."""

    source = "Mooncake LengthAwareCache (arXiv 2407.00079 v3 §4.2): LFU, later blocks first"

    def __init__(self) -> None:
        super().__init__()
        self._freq: list[int] = []

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._freq = [0] * cache.num_blocks  # type: ignore[attr-defined]

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = 1

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] += 1

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        # one int orders (frequency, -position): frequency in the high bits; positions below 2**31
        self._push(bid, (self._freq[bid] << 32) | (_POS_LIMIT - block.position))


# ---------------------------------------------------------------------- compiled twin
# state: (B, M): an indexed heap of the evictable blocks on the rows of B keyed by (KEY, STAMP) = (the
# Python priority int when unpinned, unpin stamp); FREQ and POS (position at insert) per block;
# M = [heap size, stamp clock].
H, P, KEY, STAMP, FREQ, POS = range(6)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((6, capacity), np.int64)
    B[P] = -1
    return (B, np.zeros(2, np.int64))


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B = state[0]
    B[FREQ, b] = 1
    B[POS, b] = pos


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    # an evictable block's heap key stays (as in Python): on_pin follows and takes it out
    state[0][FREQ, b] += 1


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, M = state
    heap_remove(B, M, H, P, KEY, STAMP, 0, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    heap_push_stamped(B, M, H, P, KEY, STAMP, 0, 1, b, (B[FREQ, b] << 32) | (_POS_LIMIT - B[POS, b]))


@nb.njit(cache=True)
def _victim(state):
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    heap_remove(B, M, H, P, KEY, STAMP, 0, b)


LengthAware.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
