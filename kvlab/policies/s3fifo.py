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
for blocks pinned while at the head of a queue (O(log n)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._queues import FifoQueue, dl_append, dl_unlink, fq_append, fq_first, fq_remove, fq_unpin
from kvlab.policies.base import EvictionPolicy, register_policy

SMALL, MAIN = 1, 2  # queue ids of the compiled twin


@register_policy("s3fifo")
class S3FIFO(EvictionPolicy):
    """Invariants: ``_where`` maps each placed block to its queue (``_small`` or ``_main``, whose
    ``members`` count them, pinned or not); ``_freq`` covers every cached block; ``_ghost`` holds at most
    ``ghost_size`` keys after an unpin."""

    source = "S3-FIFO (Yang et al., SOSP'23; libCacheSim S3FIFO parameters)"

    def __init__(
        self,
        small_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.10,  # main = C - small must hold a block
        ghost_ratio: Annotated[float, Field(ge=0, le=10**6)] = 0.90,  # C * ratio keys must fit an int64
        move_to_main_threshold: Annotated[int, Field(ge=1, le=10**6)] = 2,
    ) -> None:
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.threshold = int(move_to_main_threshold)
        self._small = FifoQueue()
        self._main = FifoQueue()
        self._where: dict[int, FifoQueue] = {}
        self._freq: dict[int, int] = {}
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._has_evicted = False

    def attach(self, cache: object) -> None:
        """Size the queues for the cache's capacity ``C`` (in blocks)."""
        self.capacity = cache.num_blocks  # type: ignore[attr-defined]
        self.small_size = int(self.capacity * self.small_ratio)
        self.main_size = self.capacity - self.small_size
        self.ghost_size = int(self.capacity * self.ghost_ratio)

    def compiled_params(self) -> np.ndarray:
        return np.array([self.small_ratio, self.ghost_ratio, self.threshold], dtype=np.float64)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = 0

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] += 1

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._where[block.block_id].pin(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        q = self._where.get(bid)
        ghost = self._ghost
        if q is None:  # first unpin: place the new block
            if block.key in ghost:
                del ghost[block.key]
                q = self._main
            elif not self._has_evicted and self._small.members >= self.small_size:
                q = self._main
            else:
                q = self._small
            self._where[bid] = q
            q.append(block)
        else:
            q.unpin(bid)
        while len(ghost) > self.ghost_size:
            ghost.popitem(last=False)

    def _to_main_tail(self, block: KVBlock) -> None:
        """Move an evictable block to the tail of main."""
        bid = block.block_id
        self._where[bid].remove(bid)
        self._where[bid] = self._main
        self._main.append(block)

    def victim(self) -> KVBlock:
        small, main, freq = self._small, self._main, self._freq
        while True:
            if (main.members > self.main_size or not small) and main:
                while True:
                    block = main.first()
                    f = freq[block.block_id]
                    if f == 0:
                        return block
                    freq[block.block_id] = min(f, 3) - 1
                    self._to_main_tail(block)
            block = small.first()
            while block is not None:
                if freq[block.block_id] < self.threshold:
                    return block
                freq[block.block_id] = 0
                self._to_main_tail(block)
                block = small.first()

    def _drop(self, block: KVBlock) -> FifoQueue | None:
        bid = block.block_id
        del self._freq[bid]
        q = self._where.pop(bid, None)
        if q is not None:
            q.remove(bid)
        return q

    def on_evict(self, block: KVBlock) -> None:
        self._has_evicted = True
        if self._drop(block) is self._small and self.ghost_size > 0 and block.key not in self._ghost:
            self._ghost[block.key] = None

    def on_remove(self, block: KVBlock) -> None:
        self._drop(block)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


# ---------------------------------------------------------------------- compiled twin
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


S3FIFO.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
