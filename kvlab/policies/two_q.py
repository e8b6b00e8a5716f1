"""2Q: a FIFO for first accesses (A1in), a ghost FIFO of keys evicted from it (A1out), an LRU (Am).

Source: Johnson & Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
Algorithm", VLDB'94 (the "full" version), in libCacheSim's form (``TwoQ.c``; parameters and defaults
``ain_ratio=0.25``, ``aout_ratio=0.5``; sizes ``Kin = int(C * ain_ratio)``, ``Kout = int(C * aout_ratio)``):

* a new block goes to Am if its key is in A1out (the key leaves A1out), else to the tail of A1in;
* a hit in A1in changes nothing (correlated references); a hit in Am makes the block most recent;
* ``victim()``: A1in's oldest block if A1in holds more than ``Kin`` blocks, its key then entering
  A1out (oldest keys dropped beyond ``Kout``); otherwise Am's least recent block.

Documented choices for the prefix cache: a new block is placed when first unpinned (its request
released), so the victims of a request never depend on its own new blocks, and A1out is trimmed at
each unpin after that placement (on object sequences this equals libCacheSim, where the key leaves
A1out before the eviction pushes one); A1in keeps its entry order through pin/unpin, Am is ordered by
unpin time (vLLM's LRU order); ``|A1in|`` counts placed blocks, pinned or not; if the chosen queue has
no evictable block the other one is used; only A1out remembers a key after eviction.
On object sequences this is libCacheSim's TwoQ hit for hit. O(1) per event but for A1in blocks
pinned while at its head (O(log n)): A1in a parking FIFO queue (``kvlab.policies._queues.fq_*``), Am a
linked list, A1out a FIFO list of dense key ids; these compiled hooks run in both engines
(kvlab.policies._adapter). On a ``reset`` a removed A1in block leaves no A1out entry.
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.compiled import CompiledPolicy, no_hit
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink, fq_append, fq_first, fq_remove, fq_unpin, grow_keys
from kvlab.policies.base import register_policy

# state: (B, K, M). B (per block; sentinel columns C = A1in, C + 1 = Am): A1in is a parking FIFO queue
# (kvlab.policies._queues.fq_*: NXT / PRV / LOC / PIN and the front heap H / P / K1 / K2), Am a linked
# list of its evictable blocks on the same NXT / PRV rows (least recent first), WHERE (0 not placed,
# 1 A1in, 2 Am), BKEY. K (per key; sentinel column = number of keys): A1out, a FIFO list (GNXT / GPRV,
# INA = member). M: counts, clock, sizes (slots below).
NXT, PRV, LOC, PIN, H, P, K1, K2, WHERE, BKEY = range(10)
GNXT, GPRV, INA = range(3)
FN, CLOCK, N_AIN, N_AOUT, AIN_SIZE, AOUT_SIZE = range(6)
AIN, AM = 1, 2


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((10, capacity + 2), np.int64)
    B[NXT] = np.arange(capacity + 2)
    B[PRV] = np.arange(capacity + 2)
    B[P] = -1
    K = np.zeros((3, num_keys + 1), np.int64)
    K[GNXT] = np.arange(num_keys + 1)
    K[GPRV] = np.arange(num_keys + 1)
    M = np.zeros(6, np.int64)
    M[AIN_SIZE] = np.int64(capacity * params[0])
    M[AOUT_SIZE] = np.int64(capacity * params[1])
    return (B, K, M)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B = state[0]
    B[BKEY, b] = key
    B[WHERE, b] = 0


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B = state[0]
    if B[WHERE, b] == AM:
        dl_unlink(B, NXT, PRV, b)
    else:
        B[PIN, b] = 1


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, K, M = state
    w = B[WHERE, b]
    if w == AM:
        dl_append(B, NXT, PRV, B.shape[1] - 1, b)
    elif w == AIN:
        fq_unpin(B, M, LOC, PIN, H, P, K1, K2, FN, b)
    else:
        k = B[BKEY, b]
        if K[INA, k]:  # first unpin of a block whose key was in A1out: Am
            dl_unlink(K, GNXT, GPRV, k)
            K[INA, k] = 0
            M[N_AOUT] -= 1
            B[WHERE, b] = AM
            dl_append(B, NXT, PRV, B.shape[1] - 1, b)
        else:  # first unpin: tail of A1in
            B[WHERE, b] = AIN
            B[PIN, b] = 0
            B[K2, b] = M[CLOCK]
            M[CLOCK] += 1
            M[N_AIN] += 1
            fq_append(B, NXT, PRV, LOC, B.shape[1] - 2, b)
    s = K.shape[1] - 1
    while M[N_AOUT] > M[AOUT_SIZE]:
        k = K[GNXT, s]
        dl_unlink(K, GNXT, GPRV, k)
        K[INA, k] = 0
        M[N_AOUT] -= 1


@nb.njit(cache=True)
def _victim(state):
    B, M = state[0], state[2]
    s_am = B.shape[1] - 1
    if M[N_AIN] > M[AIN_SIZE]:
        b = fq_first(B, M, NXT, PRV, LOC, PIN, H, P, K1, K2, FN, s_am - 1)
        if b >= 0:
            return b
    b = B[NXT, s_am]
    if b != s_am:
        return b
    return fq_first(B, M, NXT, PRV, LOC, PIN, H, P, K1, K2, FN, s_am - 1)


@nb.njit(cache=True)
def _drop(B, M, b):
    """Take block ``b`` out of Am or A1in; returns the queue it was in."""
    w = B[WHERE, b]
    B[WHERE, b] = 0
    if w == AM:
        dl_unlink(B, NXT, PRV, b)
    elif w == AIN:
        fq_remove(B, M, NXT, PRV, LOC, H, P, K1, K2, FN, b)
        M[N_AIN] -= 1
    return w


@nb.njit(cache=True)
def _on_evict(state, b):
    B, K, M = state
    if _drop(B, M, b) == AIN:  # evicted from A1in: its key enters the A1out ghost list
        k = B[BKEY, b]
        if M[AOUT_SIZE] > 0 and K[INA, k] == 0:
            dl_append(K, GNXT, GPRV, K.shape[1] - 1, k)
            K[INA, k] = 1
            M[N_AOUT] += 1


@nb.njit(cache=True)
def _on_remove(state, b):
    """A key dropped without eviction (``reset``): out of Am or A1in, no A1out entry."""
    _drop(state[0], state[2], b)


def _grow(state, num_keys):
    B, K, M = state
    return (B, grow_keys(K, num_keys, 1, (GNXT, GPRV)), M)


@register_policy("2q")
class TwoQ(CompiledAdapter):
    """A1in (a parking FIFO queue of block ids), Am (a linked list of its evictable blocks, least recent
    first), A1out (a FIFO list of dense key ids)."""

    source = "2Q (Johnson & Shasha, VLDB'94; libCacheSim TwoQ parameters)"
    compiled = CompiledPolicy(_init, _on_insert, no_hit, _on_pin, _on_unpin, _victim, _on_evict,
                              on_remove=_on_remove, grow=_grow)

    def __init__(
        self,
        ain_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.25,  # Am must hold a block
        aout_ratio: Annotated[float, Field(ge=0, le=10**6)] = 0.5,  # C * ratio keys must fit an int64
    ) -> None:
        self.ain_ratio = float(ain_ratio)
        self.aout_ratio = float(aout_ratio)

    def compiled_params(self) -> np.ndarray:
        return np.array([self.ain_ratio, self.aout_ratio], dtype=np.float64)
