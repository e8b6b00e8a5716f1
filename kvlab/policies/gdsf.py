"""GDSF: Greedy-Dual-Size-Frequency with a recompute-cost model for KV blocks.

Source: L. Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency Caching
Policy", HP Labs HPL-98-69R1 (1998); libCacheSim's GDSF applies the same rule with a constant cost.

Each block has priority ``H = L + frequency * cost / size``; the evictable block with the lowest ``H``
is evicted and the clock ``L`` becomes its ``H`` (so ``L`` never decreases and old blocks age out).

Choices:

* ``size`` is 1 (every KV block has the same size).
* ``frequency`` counts accesses since the block got its key: 1 at insert, +1 per hit (hits on blocks
  that are pinned by another running request count too). Frequency and priority do not survive
  eviction (the block's state is dropped with its key), as in classic GDSF.
* ``H`` is recomputed with the current ``L`` at every access (insert or hit) and the block enters the
  order when it is unpinned.
* ``cost`` is the block's recompute cost relative to the linear (weight) FLOPs of one block. Token ``j``
  (1..B) of block ``p`` (0-based, block size ``B``) attends over ``p*B + j`` tokens, so the mean context is
  ``p*B + (B+1)/2`` and ``cost(p) = 1 + attention_ratio * (p*B + (B+1)/2)``: later blocks cost more.
  ``attention_ratio`` is the attention FLOPs per context token over the linear FLOPs per token,
  ``4*layers*d_model / (2*params)``; the default 3.9e-5 is Llama-2-7B's (32 layers, d_model 4096,
  6.74e9 parameters). ``attention_ratio=0`` gives a constant cost (GDSF degenerates to LFU with aging).
* Ties in ``H`` go to the least recently unpinned block (a released sequence's tail first).
* Not prefix-aware: a sequence's head is its cheapest block, so GDSF gives heads up first and leaves
  their descendants unreachable (``orphan_blocks``); ``pgdsf`` evicts leaves only.

Units: ``L`` and ``H`` in cost units (linear FLOPs of one block); ``block_size`` (from the cache) in tokens.

Cost: O(log n) per event (Python: amortised, a lazy heap whose monotone pushes cost O(1); compiled: an
indexed heap). Compiled twin (numba, for the replay driver's compiled engine; tested hit for hit against
this class): the heap is keyed by ``(H, unpin stamp)``, ``H`` computed with the same float operations in
the same order (bit-identical) and kept as an int64 key ordered like the float
(:func:`kvlab.policies._queues.float_key`). Its cost model reads the block size from
``compiled_params()``, which knows it after ``prepare(encoded)`` (the replay driver calls it first).
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._heap import HeapPolicy
from kvlab.policies._queues import float_key, heap_push_stamped, heap_remove
from kvlab.policies.base import register_policy

LLAMA2_7B_ATTENTION_RATIO = 4 * 32 * 4096 / (2 * 6.74e9)
#: attention FLOPs per context token over linear FLOPs per token: about 1 / (6 d_model) for a
#: transformer (at most 1/6); up to 1e6 (cost = position alone, as the exactness tests use) keeps
#: ``frequency * cost`` and the clock far from float overflow
AttentionRatio = Annotated[float, Field(ge=0, le=10**6)]


def block_cost(position: int, block_size: int, attention_ratio: float) -> float:
    """Recompute cost of the block at ``position``, in units of one block's linear FLOPs."""
    return 1.0 + attention_ratio * (position * block_size + (block_size + 1) / 2)


@register_policy("gdsf")
class GDSF(HeapPolicy):
    """Evict the lowest ``L + frequency * cost(position)``; ``L`` = priority of the last victim."""

    source = "Cherkasova 1998 (GDSF); cost = recompute FLOPs of the block at its position"

    def __init__(self, attention_ratio: AttentionRatio = LLAMA2_7B_ATTENTION_RATIO) -> None:
        super().__init__()
        self.attention_ratio = float(attention_ratio)
        self.clock = 0.0
        self._freq: list[int] = []
        self._cost: list[float] = []
        self._prio: list[float] = []
        self._block_size = 1
        self._block_size_known = False

    def prepare(self, encoded: object) -> None:
        """Read the replay's block size (tokens): the compiled twin's cost model needs it."""
        self._block_size = int(encoded.block_size)  # type: ignore[attr-defined]
        self._block_size_known = True

    def compiled_params(self) -> np.ndarray:
        """``[attention_ratio, block_size]``, the block size from ``prepare`` (or ``attach``)."""
        if not self._block_size_known:
            raise ConfigError("gdsf: compiled_params() needs the block size: call prepare(encoded) first")
        return np.array([self.attention_ratio, self._block_size], dtype=np.float64)

    def attach(self, cache: object) -> None:
        super().attach(cache)
        n = cache.num_blocks  # type: ignore[attr-defined]
        self._block_size = cache.block_size  # type: ignore[attr-defined]
        self._block_size_known = True
        self._freq = [0] * n
        self._cost = [0.0] * n
        self._prio = [0.0] * n

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        c = block_cost(block.position, self._block_size, self.attention_ratio)
        self._freq[bid] = 1
        self._cost[bid] = c
        self._prio[bid] = self.clock + c

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        f = self._freq[bid] + 1
        self._freq[bid] = f
        self._prio[bid] = self.clock + f * self._cost[bid]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        self._push(bid, self._prio[bid])

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        h = self._prio[bid]
        if h > self.clock:
            self.clock = h
        self._stamp[bid] = 0
        self._n -= 1

    def on_remove(self, block: KVBlock) -> None:
        HeapPolicy.on_evict(self, block)


# ---------------------------------------------------------------------- compiled twin
# state: (B, Bf, M, F). B (per block): an indexed heap of the evictable blocks (H, P) keyed by (KEY,
# STAMP) = (float_key of H when unpinned, unpin stamp), FREQ; PRIO and COST hold float64 bits, read and
# written through Bf = B.view(np.float64). M = [heap size, stamp clock, block size]; F = [clock L,
# attention_ratio].
H, P, KEY, STAMP, FREQ, PRIO, COST = range(7)
N, CLOCK, BS = range(3)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((7, capacity), np.int64)
    B[P] = -1
    M = np.zeros(3, np.int64)
    M[BS] = np.int64(params[1])
    F = np.zeros(2, np.float64)
    F[1] = params[0]
    return (B, B.view(np.float64), M, F)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B, Bf, M, F = state
    bs = M[BS]
    c = 1.0 + F[1] * (pos * bs + (bs + 1) / 2)  # block_cost(), same operations
    B[FREQ, b] = 1
    Bf[COST, b] = c
    Bf[PRIO, b] = F[0] + c


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    # an evictable block's heap key stays (as in Python): on_pin follows and takes it out
    B, Bf, F = state[0], state[1], state[3]
    f = B[FREQ, b] + 1
    B[FREQ, b] = f
    Bf[PRIO, b] = F[0] + f * Bf[COST, b]


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, M = state[0], state[2]
    heap_remove(B, M, H, P, KEY, STAMP, N, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state[0], state[2]
    heap_push_stamped(B, M, H, P, KEY, STAMP, N, CLOCK, b, float_key(B[PRIO, b]))


@nb.njit(cache=True)
def _victim(state):
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    B, Bf, M, F = state
    if B[P, b] >= 0:
        heap_remove(B, M, H, P, KEY, STAMP, N, b)
    h = Bf[PRIO, b]
    if h > F[0]:
        F[0] = h


GDSF.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
