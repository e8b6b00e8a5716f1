"""LFU with exponentially decaying frequency (half-life).

Source: exponentially decayed access counts, the "decayed LFU" / LRFU family (Lee et al., "LRFU: A
Spectrum of Policies that Subsumes the LRU and LFU Policies", IEEE ToC 2001, with the weighting
function ``F(x) = 2**(-x / half_life)``). A block's count is 1 at insertion; at a hit at time ``t`` it
becomes ``count * 2**(-(t - t_last) / half_life) + 1``. ``victim()`` is the block with the smallest
count *now*. Since every count decays by the same factor, that order never changes between a block's
events: it is the order of ``log2(count) + t_last / half_life``, kept in a heap.

Parameters: ``half_life`` (default 600) in units of ``clock``: ``"time"`` (``ctx.time``, seconds of
trace time; the default) or ``"requests"`` (``ctx.seq``, requests admitted). Documented choices: ties go
to the least recently unpinned block; a hit counts even while the block is pinned; pinned blocks are
out of the order and rejoin it at unpin; the count does not survive eviction. O(log n) per event.

Compiled twin (``LFUHalfLife.compiled``, run by the replay's compiled engine), O(log n) per event: an
indexed heap keyed by (``float_key`` of the priority's float64 bits, unpin stamp); ``prepare`` keeps the
workload's per-request ``arrival`` (the Python replay's ``ctx.time``) for ``clock="time"``. Counts and
priorities are computed with the same operations in the same order, so they are bit for bit the Python
floats: the power's base 2.0 comes from ``compiled_params()`` at run time, because a compile-time
``2.0 ** x`` lets LLVM turn ``pow`` into ``exp2``, which rounds differently in rare cases. Tested hit for
hit against this class in both clocks.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._queues import KeyedQueue, float_key, heap_push_stamped, heap_remove
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lfu-halflife")
class LFUHalfLife(EvictionPolicy):
    """Smallest ``(log2(count) + t_last / half_life, unpin stamp)`` first.

    Invariant: ``_state[bid] = (count at t_last, t_last)`` for every cached block."""

    source = "decayed LFU (LRFU-style 2^(-age/half_life) weighting)"

    def __init__(
        self,
        half_life: Annotated[float, Field(gt=0)] = 600.0,  # in units of ``clock``
        clock: Annotated[Literal["time", "requests"], Field()] = "time",
    ) -> None:
        self.half_life = float(half_life)
        self.clock = clock
        self._queue = KeyedQueue()
        self._state: dict[int, tuple[float, float]] = {}
        self._arrival: np.ndarray | None = None  # per-request time, for the compiled twin

    def prepare(self, encoded: object) -> None:
        arrival = getattr(encoded, "arrival", None)
        self._arrival = None if arrival is None else np.ascontiguousarray(arrival, dtype=np.float64)

    def compiled_params(self) -> tuple[np.ndarray, np.ndarray]:
        """``([half_life, clock is "time", 2.0], arrival)``; arrival is empty for the requests clock."""
        is_time = self.clock == "time"
        if is_time and self._arrival is None:
            raise ConfigError("lfu-halflife with clock='time' needs prepare(encoded) with per-request arrival")
        arrival = self._arrival if is_time else np.zeros(0, dtype=np.float64)
        return (np.array([self.half_life, 1.0 if is_time else 0.0, 2.0]), arrival)

    def _now(self, ctx: AccessContext) -> float:
        return float(ctx.time if self.clock == "time" else ctx.seq)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._state[block.block_id] = (1.0, self._now(ctx))

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        count, last = self._state[block.block_id]
        now = self._now(ctx)
        self._state[block.block_id] = (count * 2.0 ** (-(now - last) / self.half_life) + 1.0, now)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.pin(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        count, last = self._state[block.block_id]
        self._queue.push(block, math.log2(count) + last / self.half_life)

    def victim(self) -> KVBlock:
        return self._queue.first()

    def on_evict(self, block: KVBlock) -> None:
        self._queue.remove(block.block_id)
        del self._state[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------------- compiled twin
# state: (B, F, FI, M, params, arrival). B rows over blocks: an indexed heap of the evictable blocks keyed
# by (order-preserving int64 of the priority, unpin stamp) [H, P, KEY, STAMP]; F (float64) rows: [COUNT,
# LAST] and the priority [PRI], read as IEEE bits through FI, an int64 view of F; M = [heap size, clock];
# params = [half_life, clock is "time", 2.0].
H, P, KEY, STAMP = range(4)
COUNT, LAST, PRI = range(3)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    par, arrival = params
    B = np.zeros((4, capacity), np.int64)
    B[P] = -1
    F = np.zeros((3, capacity), np.float64)
    return (B, F, F.view(np.int64), np.zeros(2, np.int64), par, arrival)


@nb.njit(cache=True, inline="always")
def _now(par, arrival, seq):
    if par[1] != 0.0:
        return arrival[seq]
    return float(seq)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    F, par, arrival = state[1], state[4], state[5]
    F[COUNT, b] = 1.0
    F[LAST, b] = _now(par, arrival, seq)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    F, par, arrival = state[1], state[4], state[5]
    now = _now(par, arrival, seq)
    # par[2] = 2.0, read at run time: see the module docstring
    F[COUNT, b] = F[COUNT, b] * par[2] ** (-(now - F[LAST, b]) / par[0]) + 1.0
    F[LAST, b] = now


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B, M = state[0], state[3]
    heap_remove(B, M, H, P, KEY, STAMP, 0, b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, F, FI, M, par = state[0], state[1], state[2], state[3], state[4]
    F[PRI, b] = math.log2(F[COUNT, b]) + F[LAST, b] / par[0]
    heap_push_stamped(B, M, H, P, KEY, STAMP, 0, 1, b, float_key(FI[PRI, b]))


@nb.njit(cache=True)
def _victim(state):
    return state[0][H, 0]


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state[0], state[3]
    heap_remove(B, M, H, P, KEY, STAMP, 0, b)


LFUHalfLife.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
