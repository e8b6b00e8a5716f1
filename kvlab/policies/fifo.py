"""FIFO: evict the evictable block that entered the cache first; hits never reorder.

Source: the classic first-in first-out replacement (e.g. Belady 1966; libCacheSim ``FIFO.c``).
Documented choices:

* order = order of entry: a new block enters when its request releases it (its first unpin), so the
  blocks of one request enter tail first (as in vLLM's LRU) and all of them are younger than every
  block of earlier requests. On object sequences this is plain insertion order;
* hits and pin/unpin never change the order: a pinned block is only skipped, and once unpinned it is
  again exactly as old as it was (so a block hit while old is still evicted early);
* state does not survive eviction: a key computed again is a new entry.

On object sequences this is libCacheSim's FIFO hit for hit. O(1) per event but for blocks pinned while
at the head of the queue (O(log n); a parking FIFO queue of ``kvlab.policies._queues``).
Written once, as compiled hooks: the replay kernel and, through kvlab.policies._adapter, the Python core
run them.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.compiled import CompiledPolicy, no_hit
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import fq_append, fq_first, fq_remove, fq_unpin
from kvlab.policies.base import register_policy

# state: (B, M): one parking FIFO queue (kvlab.policies._queues.fq_*) on the rows of B, sentinel column
# = capacity; M = [front heap size, clock].
NXT, PRV, LOC, PIN, H, P, K1, K2 = range(8)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((8, capacity + 1), np.int64)
    B[NXT] = np.arange(capacity + 1)
    B[PRV] = np.arange(capacity + 1)
    B[P] = -1
    return (B, np.zeros(2, np.int64))


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][PIN, b] = 1


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    state[0][PIN, b] = 1


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    if B[LOC, b] == 0:  # first unpin: enter the queue
        B[PIN, b] = 0
        B[K2, b] = M[1]
        M[1] += 1
        fq_append(B, NXT, PRV, LOC, B.shape[1] - 1, b)
    else:
        fq_unpin(B, M, LOC, PIN, H, P, K1, K2, 0, b)


@nb.njit(cache=True)
def _victim(state):
    B, M = state
    return fq_first(B, M, NXT, PRV, LOC, PIN, H, P, K1, K2, 0, B.shape[1] - 1)


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    fq_remove(B, M, NXT, PRV, LOC, H, P, K1, K2, 0, b)


@register_policy("fifo")
class FIFO(CompiledAdapter):
    """Oldest entry first. Invariant: the queue holds every block unpinned since its insertion."""

    source = "classic FIFO (libCacheSim FIFO); entry order, hits do not reorder"
    compiled = CompiledPolicy(_init, _on_insert, no_hit, _on_pin, _on_unpin, _victim, _on_evict)
