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

A priority policy (kvlab.policies._priority): O(log n) per event; ``prepare`` keeps the workload's
per-request ``arrival`` (the Python replay's ``ctx.time``) for the compiled twin with ``clock="time"``.
Counts and priorities are the same float operations in both engines, so bit for bit equal: the power's
base 2.0 comes from ``params()`` at run time, because a compile-time ``2.0 ** x`` lets LLVM turn
``pow`` into ``exp2``, which rounds differently in rare cases.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.errors import ConfigError
from kvlab.policies._priority import Priority, PriorityPolicy
from kvlab.policies.base import register_policy

COUNT, LAST = 0, 1  # per-block float fields: count at t_last, t_last
HALF, TIME, TWO = 0, 1, 2  # parameters: half_life, clock is "time", 2.0


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    s.blkf[COUNT][b] = 1.0
    s.blkf[LAST][b] = float(r.time) if s.par[TIME] != 0.0 else float(r.seq)


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    now = float(r.time) if s.par[TIME] != 0.0 else float(r.seq)
    count, last = s.blkf[COUNT], s.blkf[LAST]
    count[b] = count[b] * s.par[TWO] ** (-(now - last[b]) / s.par[HALF]) + 1.0
    last[b] = now


@nb.njit(cache=True)
def _priority(s, b, r):
    return math.log2(s.blkf[COUNT][b]) + s.blkf[LAST][b] / s.par[HALF]


@register_policy("lfu-halflife")
class LFUHalfLife(PriorityPolicy):
    """Smallest ``(log2(count) + t_last / half_life, unpin stamp)`` first."""

    source = "decayed LFU (LRFU-style 2^(-age/half_life) weighting)"
    spec = Priority(_priority, _insert, _hit, block=(0.0, 0.0), float_priority=True, layout=("par", "arrival"))

    def __init__(
        self,
        half_life: Annotated[float, Field(gt=0)] = 600.0,  # in units of ``clock``
        clock: Annotated[Literal["time", "requests"], Field()] = "time",
    ) -> None:
        super().__init__()
        self.half_life = float(half_life)
        self.clock = clock
        self._arrival: np.ndarray | None = None  # per-request time, for the compiled twin

    def prepare(self, encoded: object) -> None:
        arrival = getattr(encoded, "arrival", None)
        self._arrival = None if arrival is None else np.ascontiguousarray(arrival, dtype=np.float64)

    def params(self) -> list[float]:
        return [self.half_life, 1.0 if self.clock == "time" else 0.0, 2.0]

    def compiled_params(self) -> tuple[np.ndarray, np.ndarray]:
        """``([half_life, clock is "time", 2.0], arrival)``; arrival is empty for the requests clock."""
        is_time = self.clock == "time"
        if is_time and self._arrival is None:
            raise ConfigError("lfu-halflife with clock='time' needs prepare(encoded) with per-request arrival")
        arrival = self._arrival if is_time else np.zeros(0, dtype=np.float64)
        return (np.array(self.params()), arrival)
