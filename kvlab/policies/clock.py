"""CLOCK with an n-bit counter (second chance for ``bits=1``).

Source: Corbató's CLOCK (1968) in libCacheSim's form (``Clock.c``, FIFO-reinsertion): a hit raises the
block's counter by one up to ``2**bits - 1``; ``victim()`` looks at the oldest block, and while its
counter is positive decrements it and moves it to the newest end (the hand passes it), evicting the
first block found at zero. Parameters: ``bits`` (libCacheSim ``n-bit-counter``, default 1) and
``init_freq`` (counter of a new block, libCacheSim ``init-freq``, default 0). Documented choices:

* a new block joins the queue when first unpinned (its request released), so the victims a request
  causes never depend on its own new blocks; a request's blocks enter tail first (release order);
* a pinned block met by the hand is passed (moved to the newest end) *without* touching its counter;
* hits count even while the block is pinned; state does not survive eviction.

On object sequences this is libCacheSim's Clock hit for hit (same ``bits`` / ``init_freq``).
Amortised O(1) per event (a linked list over block ids is the circular queue).
Written once, as compiled hooks: the replay kernel and, through kvlab.policies._adapter, the Python core
run them.
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink
from kvlab.policies.base import param_error, register_policy

# state: (B, M). B rows NXT / PRV: the queue, a doubly linked list with sentinel column C (NXT[C] = the
# block under the hand); FREQ; FLAG (0 not queued, 1 queued, 2 queued and pinned). M = [max, init].
NXT, PRV, FREQ, FLAG = range(4)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((4, capacity + 1), np.int64)
    B[NXT] = np.arange(capacity + 1)
    B[PRV] = np.arange(capacity + 1)
    M = np.zeros(2, np.int64)
    M[0] = np.int64(params[0])
    M[1] = np.int64(params[1])
    return (B, M)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][FREQ, b] = state[1][1]


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    B = state[0]
    if B[FREQ, b] < state[1][0]:
        B[FREQ, b] += 1


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B = state[0]
    if B[FLAG, b] != 0:
        B[FLAG, b] = 2


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B = state[0]
    if B[FLAG, b] == 0:  # first unpin: joins the queue at the newest end
        dl_append(B, NXT, PRV, B.shape[1] - 1, b)
    B[FLAG, b] = 1


@nb.njit(cache=True)
def _victim(state):
    B = state[0]
    s = B.shape[1] - 1
    while True:
        b = B[NXT, s]
        if B[FLAG, b] != 2:
            if B[FREQ, b] == 0:
                return b
            B[FREQ, b] -= 1
        dl_unlink(B, NXT, PRV, b)  # the hand passes it: to the newest end
        dl_append(B, NXT, PRV, s, b)


@nb.njit(cache=True)
def _on_evict(state, b):
    B = state[0]
    if B[FLAG, b] != 0:
        dl_unlink(B, NXT, PRV, b)
    B[FLAG, b] = 0


@register_policy("clock")
class Clock(CompiledAdapter):
    """The queue: a linked list over block ids, the hand at its head; counters in ``[0, 2**bits - 1]``."""

    source = "CLOCK with n-bit counters (libCacheSim Clock, FIFO-reinsertion form)"
    compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)

    def __init__(
        self,
        bits: Annotated[int, Field(ge=1, le=32)] = 1,  # 32-bit counters exceed any hit count
        init_freq: Annotated[int, Field(ge=0, description="an integer in [0, 2**bits - 1]")] = 0,
    ) -> None:
        self.bits = int(bits)
        self.max_freq = (1 << self.bits) - 1
        if not init_freq <= self.max_freq:
            allowed = f"an integer in [0, 2**bits - 1] = [0, {self.max_freq}]"
            raise param_error(self.name, "init_freq", allowed, init_freq)
        self.init_freq = int(init_freq)

    def compiled_params(self) -> np.ndarray:
        return np.array([self.max_freq, self.init_freq], dtype=np.float64)
