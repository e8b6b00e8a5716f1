"""SIEVE: a FIFO queue with a visited bit and a hand that sweeps from the oldest block to the newest.

Source: Zhang et al., "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for Web
Caches", NSDI'24; libCacheSim ``Sieve.c``. A hit sets the block's visited bit; ``victim()`` starts at
the hand (or the oldest block), clears and passes visited blocks towards the newest, wrapping to the
oldest, evicts the first unvisited one and leaves the hand at the next newer block. New blocks enter
at the newest end and are never moved. Documented choices:

* a new block joins the queue when it is first unpinned (its request released), not at ``on_insert``:
  the victims a request causes never depend on its own new blocks, and a request's blocks enter tail
  first (release order). On object sequences insertion and first unpin are the same access;
* a pinned block stays in place; the hand passes it without clearing its bit (it is not a candidate);
* a hit on a block counts even while it is pinned or not yet queued (visited bit set);
* state does not survive eviction.

On object sequences this is libCacheSim's Sieve hit for hit. Amortised O(1) per event.
Written once, as compiled hooks: the replay kernel and, through kvlab.policies._adapter, the Python core
run them.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies.base import register_policy

# state: (B, M). B rows NEWER / OLDER (-1 = none), VISITED, FLAG (0 not queued, 1 queued, 2 queued and
# pinned); M = [head (newest), tail (oldest), hand].
NEWER, OLDER, VISITED, FLAG = range(4)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((4, capacity), np.int64)
    B[NEWER] = -1
    B[OLDER] = -1
    return (B, np.full(3, -1, np.int64))


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][VISITED, b] = 0


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    state[0][VISITED, b] = 1


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    state[0][FLAG, b] = 2


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    if B[FLAG, b] == 2:
        B[FLAG, b] = 1
        return
    B[FLAG, b] = 1
    head = M[0]
    B[OLDER, b] = head
    B[NEWER, b] = -1
    if head < 0:
        M[1] = b
    else:
        B[NEWER, head] = b
    M[0] = b


@nb.njit(cache=True)
def _victim(state):
    B, M = state
    b = M[2]
    while True:
        if b < 0:
            b = M[1]
        if B[FLAG, b] == 2:
            b = B[NEWER, b]
        elif B[VISITED, b]:
            B[VISITED, b] = 0
            b = B[NEWER, b]
        else:
            break
    M[2] = B[NEWER, b]
    return b


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    B[FLAG, b] = 0
    nb_, ob = B[NEWER, b], B[OLDER, b]
    if M[2] == b:
        M[2] = nb_
    if nb_ < 0:
        M[0] = ob
    else:
        B[OLDER, nb_] = ob
    if ob < 0:
        M[1] = nb_
    else:
        B[NEWER, ob] = nb_



@register_policy("sieve")
class Sieve(CompiledAdapter):
    """Queued blocks (unpinned at least once since insertion) in a doubly linked list with a hand."""

    source = "SIEVE (Zhang et al., NSDI'24; libCacheSim Sieve)"
    compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
