"""S3-FIFO: a small FIFO that filters one-hit wonders, a main FIFO with 2-bit reinsertion, a ghost FIFO.

Source: Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23, in libCacheSim's form
(``S3FIFO.c``, whose parameters and defaults are used: ``small_ratio=0.10``, ``ghost_ratio=0.90``,
``move_to_main_threshold=2``). Sizes in blocks, truncated like libCacheSim:
``small = int(C * small_ratio)``, ``main = C - small``, ``ghost = int(C * ghost_ratio)`` keys.

* a new block goes to *main* if its key is in the ghost (the key leaves the ghost), else to *small*;
  before the first eviction ever, a new block also goes to main once small holds ``small`` blocks;
* a hit adds 1 to the block's counter (it starts at 0);
* ``victim()``: if main holds more than ``main`` blocks or small has no candidate, scan main: a block
  with counter ``f >= 1`` is reinserted at main's tail with ``min(f, 3) - 1``, the first at 0 is the
  victim. Otherwise scan small: a block with ``f >= move_to_main_threshold`` moves to main's tail with
  counter 0; the first below is the victim and its key enters the ghost (oldest ghost keys dropped).

Documented choices for the prefix cache:

* a new block is placed (ghost check, small or main) when first unpinned (its request released), so
  the victims a request causes never depend on its own new blocks; ghost keys pushed by evictions are
  trimmed to the ghost size at each unpin, after that placement (so a key evicted in this request
  still counts, and on object sequences the ghost equals libCacheSim's: there the key is removed
  from the ghost before the eviction pushes one);
* queue sizes count placed blocks, pinned or not; pinning never changes a block's place in its FIFO
  (a pinned block is skipped, not moved);
* counters (and ghost membership) are per block / per key; a block's counter does not survive its
  eviction, only the ghost remembers the key;
* libCacheSim refuses to cache any object when ``small <= 1`` (object size >= small size); a prefix
  cache always caches, so the two differ below 20 blocks of capacity (with the default ratio).

On object sequences with ``small >= 2`` this is libCacheSim's S3FIFO hit for hit. O(1) per event but
for blocks pinned while at the head of a queue (O(log n)). The compiled hooks below run in both engines
(kvlab.policies._adapter); on a ``reset`` a removed block leaves its queue without a ghost entry.
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink, fq_append, fq_first, fq_remove, fq_unpin, grow_keys
from kvlab.policies.base import register_policy

SMALL, MAIN = 1, 2  # queue ids

# state: (B, K, M). B (per block, sentinels: column C = small, C + 1 = main): two parking FIFO queues
# (kvlab.policies._queues.fq_*) with front heaps HS / HM, plus WHERE (0 none, 1 small, 2 main), FREQ and
# BKEY. K (per key, sentinel column = number of keys): the ghost FIFO (GNXT / GPRV, ING = member).
# M: counts, clock, flags, sizes and the front heaps' sizes (slots below).
NXT, PRV, LOC, PIN, HS, HM, P, K1, K2, WHERE, FREQ, BKEY = range(12)
GNXT, GPRV, ING = range(3)
N_SMALL, N_MAIN, CLOCK, HAS_EV, GHOST_N, SMALL_SIZE, MAIN_SIZE, GHOST_SIZE, THRESHOLD, FN_SMALL, FN_MAIN = range(11)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((12, capacity + 2), np.int64)
    B[NXT] = np.arange(capacity + 2)
    B[PRV] = np.arange(capacity + 2)
    B[P] = -1
    K = np.zeros((3, num_keys + 1), np.int64)
    K[GNXT] = np.arange(num_keys + 1)
    K[GPRV] = np.arange(num_keys + 1)
    M = np.zeros(11, np.int64)
    M[SMALL_SIZE] = np.int64(capacity * params[0])
    M[MAIN_SIZE] = capacity - M[SMALL_SIZE]
    M[GHOST_SIZE] = np.int64(capacity * params[1])
    M[THRESHOLD] = np.int64(params[2])
    return (B, K, M)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B = state[0]
    B[FREQ, b] = 0
    B[BKEY, b] = key
    B[PIN, b] = 1


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    state[0][FREQ, b] += 1


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    state[0][PIN, b] = 1


@nb.njit(cache=True)
def _ghost_drop(K, M, k):
    dl_unlink(K, GNXT, GPRV, k)
    K[ING, k] = 0
    M[GHOST_N] -= 1


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, K, M = state
    q = B[WHERE, b]
    if q == 0:  # first unpin: place the new block
        k = B[BKEY, b]
        if K[ING, k]:
            _ghost_drop(K, M, k)
            q = MAIN
        elif M[HAS_EV] == 0 and M[N_SMALL] >= M[SMALL_SIZE]:
            q = MAIN
        else:
            q = SMALL
        B[WHERE, b] = q
        M[q - 1] += 1
        B[K2, b] = M[CLOCK]
        M[CLOCK] += 1
        B[PIN, b] = 0
        fq_append(B, NXT, PRV, LOC, B.shape[1] - 3 + q, b)
    elif q == SMALL:
        fq_unpin(B, M, LOC, PIN, HS, P, K1, K2, FN_SMALL, b)
    else:
        fq_unpin(B, M, LOC, PIN, HM, P, K1, K2, FN_MAIN, b)
    sentinel = K.shape[1] - 1
    while M[GHOST_N] > M[GHOST_SIZE]:
        _ghost_drop(K, M, K[GNXT, sentinel])


@nb.njit(cache=True)
def _remove(B, M, b):
    if B[WHERE, b] == SMALL:
        fq_remove(B, M, NXT, PRV, LOC, HS, P, K1, K2, FN_SMALL, b)
    else:
        fq_remove(B, M, NXT, PRV, LOC, HM, P, K1, K2, FN_MAIN, b)
    M[B[WHERE, b] - 1] -= 1


@nb.njit(cache=True)
def _to_main_tail(B, M, b):
    _remove(B, M, b)
    B[WHERE, b] = MAIN
    M[N_MAIN] += 1
    B[K2, b] = M[CLOCK]
    M[CLOCK] += 1
    fq_append(B, NXT, PRV, LOC, B.shape[1] - 1, b)


@nb.njit(cache=True)
def _victim(state):
    B, M = state[0], state[2]
    s_small = B.shape[1] - 2
    s_main = s_small + 1
    while True:
        b = fq_first(B, M, NXT, PRV, LOC, PIN, HS, P, K1, K2, FN_SMALL, s_small)
        if (M[N_MAIN] > M[MAIN_SIZE] or b < 0) and fq_first(B, M, NXT, PRV, LOC, PIN, HM, P, K1, K2, FN_MAIN,
                                                             s_main) >= 0:
            while True:
                b = fq_first(B, M, NXT, PRV, LOC, PIN, HM, P, K1, K2, FN_MAIN, s_main)
                f = B[FREQ, b]
                if f == 0:
                    return b
                B[FREQ, b] = min(f, 3) - 1
                _to_main_tail(B, M, b)
        while b >= 0:
            if B[FREQ, b] < M[THRESHOLD]:
                return b
            B[FREQ, b] = 0
            _to_main_tail(B, M, b)
            b = fq_first(B, M, NXT, PRV, LOC, PIN, HS, P, K1, K2, FN_SMALL, s_small)


@nb.njit(cache=True)
def _on_evict(state, b):
    B, K, M = state
    M[HAS_EV] = 1
    q = B[WHERE, b]
    _remove(B, M, b)
    B[WHERE, b] = 0
    k = B[BKEY, b]
    if q == SMALL and M[GHOST_SIZE] > 0 and K[ING, k] == 0:
        dl_append(K, GNXT, GPRV, K.shape[1] - 1, k)
        K[ING, k] = 1
        M[GHOST_N] += 1


@nb.njit(cache=True)
def _on_remove(state, b):
    """A key dropped without eviction: out of its queue, no ghost entry."""
    B, M = state[0], state[2]
    if B[WHERE, b] != 0:
        _remove(B, M, b)
        B[WHERE, b] = 0


def _grow(state, num_keys):
    B, K, M = state
    return (B, grow_keys(K, num_keys, 1, (GNXT, GPRV)), M)


@register_policy("s3fifo")
class S3FIFO(CompiledAdapter):
    """Small and main FIFO queues of block ids (each a parking FIFO queue: a pinned block keeps its place),
    counters per block, the ghost FIFO over dense key ids."""

    source = "S3-FIFO (Yang et al., SOSP'23; libCacheSim S3FIFO parameters)"
    compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict,
                              on_remove=_on_remove, grow=_grow)

    def __init__(
        self,
        small_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.10,  # main = C - small must hold a block
        ghost_ratio: Annotated[float, Field(ge=0, le=10**6)] = 0.90,  # C * ratio keys must fit an int64
        move_to_main_threshold: Annotated[int, Field(ge=1, le=10**6)] = 2,
    ) -> None:
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.threshold = int(move_to_main_threshold)

    def compiled_params(self) -> np.ndarray:
        return np.array([self.small_ratio, self.ghost_ratio, self.threshold], dtype=np.float64)
