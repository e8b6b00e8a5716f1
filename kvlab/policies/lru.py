"""LRU, exactly as vLLM v1's free-block queue orders cached blocks.

vLLM appends a block to the tail of its free queue when its ref count drops to 0 and allocates from
the head; requests free their blocks tail first, so a sequence's last block is evicted before its
first. Ordering evictable blocks by unpin time reproduces that queue (the unkeyed free blocks that
vLLM keeps at the head are the cache's free list). State does not survive eviction.
Source: vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue), block_pool.py.
"""

from __future__ import annotations

from collections import OrderedDict

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lru")
class LRU(EvictionPolicy):
    """Least recently *unpinned* first. O(1) per event.

    The queue is an OrderedDict: a plain dict whose front entries are deleted makes ``next(iter())``
    scan the deleted slots (O(n) until the dict resizes)."""

    source = "vLLM v1 prefix caching (FreeKVCacheBlockQueue order)"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        del self._queue[block.block_id]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue[block.block_id] = block

    def victim(self) -> KVBlock:
        return next(iter(self._queue.values()))

    def on_evict(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------------- compiled twin
# state: (next, prev) of a doubly linked list over block ids with sentinel ``capacity``; head = oldest.


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    nxt = np.full(capacity + 1, capacity, np.int64)
    prv = np.full(capacity + 1, capacity, np.int64)
    return (nxt, prv)


@nb.njit(cache=True, inline="always")
def _unlink(state, b):
    nxt, prv = state
    nxt[prv[b]] = nxt[b]
    prv[nxt[b]] = prv[b]


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    pass


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    pass


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    _unlink(state, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    nxt, prv = state
    s = len(nxt) - 1
    t = prv[s]
    nxt[t] = b
    prv[b] = t
    nxt[b] = s
    prv[s] = b


@nb.njit(cache=True)
def _victim(state):
    nxt = state[0]
    return nxt[len(nxt) - 1]


@nb.njit(cache=True)
def _on_evict(state, b):
    _unlink(state, b)


LRU.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
