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

A priority policy (kvlab.policies._priority; ``L`` is its aging slot): O(log n) per event, the same
float operations in both engines (bit-identical priorities). The compiled twin reads the block size from
``compiled_params()``, which knows it after ``prepare(encoded)`` (the replay driver calls it first).
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
from pydantic import Field

from kvlab.errors import ConfigError
from kvlab.policies._priority import Priority, PriorityPolicy, field
from kvlab.policies.base import register_policy

LLAMA2_7B_ATTENTION_RATIO = 4 * 32 * 4096 / (2 * 6.74e9)
#: attention FLOPs per context token over linear FLOPs per token: about 1 / (6 d_model) for a
#: transformer (at most 1/6); up to 1e6 (cost = position alone, as the exactness tests use) keeps
#: ``frequency * cost`` and the clock far from float overflow
AttentionRatio = Annotated[float, Field(ge=0, le=10**6)]

FREQ, COST, PRIO = 0, 1, 2  # per-block fields: int, float, float
CLOCK = 0  # global float slot: L
AR, BS = 0, 1  # parameters: attention_ratio, block size


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    bs = int(s.par[BS])
    c = 1.0 + s.par[AR] * (pos * bs + (bs + 1) / 2)  # recompute cost of the block at ``pos``
    s.blk[FREQ][b] = 1
    s.blkf[COST][b] = c
    s.blkf[PRIO][b] = s.glob[CLOCK] + c


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    f = s.blk[FREQ][b] + 1
    s.blk[FREQ][b] = f
    s.blkf[PRIO][b] = s.glob[CLOCK] + f * s.blkf[COST][b]


@nb.njit(cache=True)
def _priority(s, b, r):
    return s.blkf[PRIO][b]


@register_policy("gdsf")
class GDSF(PriorityPolicy):
    """Evict the lowest ``L + frequency * cost(position)``; ``L`` = priority of the last victim."""

    source = "Cherkasova 1998 (GDSF); cost = recompute FLOPs of the block at its position"
    spec = Priority(_priority, _insert, _hit, block=(0, 0.0, 0.0), glob=(0.0,), float_priority=True, aging=CLOCK)
    clock = property(lambda self: self.state.glob[CLOCK])
    _prio = field(PRIO)

    def __init__(self, attention_ratio: AttentionRatio = LLAMA2_7B_ATTENTION_RATIO) -> None:
        super().__init__()
        self.attention_ratio = float(attention_ratio)

    def prepare(self, encoded: object) -> None:
        """Read the replay's block size (tokens): the compiled twin's cost model needs it."""
        self.block_size = int(encoded.block_size)  # type: ignore[attr-defined]

    def params(self) -> list[float]:
        """``[attention_ratio, block_size]``, the block size from ``prepare`` (or ``attach``)."""
        if self.block_size is None:
            raise ConfigError("gdsf: compiled_params() needs the block size: call prepare(encoded) first")
        return [self.attention_ratio, self.block_size]
