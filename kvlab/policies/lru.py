"""LRU, exactly as vLLM v1's free-block queue orders cached blocks.

vLLM appends a block to the tail of its free queue when its ref count drops to 0 and allocates from
the head; requests free their blocks tail first, so a sequence's last block is evicted before its
first. Ordering evictable blocks by unpin time reproduces that queue (the unkeyed free blocks that
vLLM keeps at the head are the cache's free list). State does not survive eviction.
Source: vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue), block_pool.py.
Written once, as compiled hooks: the replay kernel and, through kvlab.policies._adapter, the Python core
run them.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.compiled import CompiledPolicy, no_hit, no_insert
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink
from kvlab.policies.base import register_policy

# state: one array, rows NXT / PRV: a doubly linked list over block ids with sentinel column ``capacity``
# (NXT of the sentinel = the oldest). One array, not two: the Python core passes the state at every call.
NXT, PRV = 0, 1


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    return np.full((2, capacity + 1), capacity, np.int64)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    dl_unlink(state, NXT, PRV, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    dl_append(state, NXT, PRV, state.shape[1] - 1, b)


@nb.njit(cache=True)
def _victim(state):
    return state[NXT, state.shape[1] - 1]


@nb.njit(cache=True)
def _on_evict(state, b):
    dl_unlink(state, NXT, PRV, b)


@register_policy("lru")
class LRU(CompiledAdapter):
    """Least recently *unpinned* first: a linked list over block ids, unpinned blocks appended. O(1) per event."""

    source = "vLLM v1 prefix caching (FreeKVCacheBlockQueue order)"
    compiled = CompiledPolicy(_init, no_insert, no_hit, _on_pin, _on_unpin, _victim, _on_evict)
