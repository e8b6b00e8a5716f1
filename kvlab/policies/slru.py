"""SLRU: segmented LRU, a probationary segment and protected segments of increasing rank.

Source: Karedla, Love & Wherry, "Caching Strategies to Improve Disk System Performance", IEEE Computer
1994, generalised to ``n`` segments as in libCacheSim (``SLRU.c``, default 4 equal segments). A new
block enters segment 0 (probationary); a hit moves a block from segment ``i`` to the most recent end
of segment ``i + 1`` (a hit in the top segment makes it most recent there); when a protected segment
``j >= 1`` holds more than its size, its least recent block is demoted to the most recent end of
segment ``j - 1``, cascading down. ``victim()`` is the least recent block of the lowest segment that
has an evictable block.

Parameter ``segments``: a number of equal segments (default 4) or a sequence of relative sizes
(lowest first), e.g. ``(0.2, 0.8)`` for the classic probationary/protected split. Protected segment
``j`` holds ``int(C * size_j)`` blocks; segment 0 has no bound of its own (it holds the rest).
Documented choices: recency = unpin time (vLLM's order); a new block is placed when first unpinned;
a hit on a block not yet placed places it one segment up; segment counts include pinned blocks, and
demotion skips pinned ones (a segment may then briefly exceed its size); no state survives eviction.
libCacheSim fills higher segments first while the cache warms up (new objects go to the lowest
segment with space); this class always inserts into segment 0, so no hit-for-hit equality with it is
claimed. O(1) per event (amortised over demotions): a linked list per segment over block ids, segment
and counts in int64 arrays; these compiled hooks run in both engines (kvlab.policies._adapter).
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.compiled import CompiledPolicy, no_insert
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink
from kvlab.policies.base import register_policy

#: at most this many segments (each a linked list with its own sentinel column)
MAX_SEGMENTS = 64
#: ``segments``: a count of equal segments, or relative sizes (normalised by their sum), lowest first
Segments = Annotated[
    Annotated[int, Field(ge=1, le=MAX_SEGMENTS)]
    | Annotated[list[Annotated[float, Field(gt=0, le=10**9)]], Field(min_length=1, max_length=MAX_SEGMENTS)],
    Field(description=f"an integer in [1, {MAX_SEGMENTS}] or a list of 1-{MAX_SEGMENTS} relative sizes "
                      "(normalised by their sum), each a finite number in (0, 1e9]"),
]

# state: (B, M). B (per block; sentinel columns C + i = segment i's list): NXT / PRV, a linked list per
# segment of its evictable blocks (least recent first), SEG (-1 not placed), LINKED (in its list),
# PEND (hit before placement). M: counts ``n[i]`` in slots 0..S-1, sizes ``caps[i]`` in slots S..2S-1.
NXT, PRV, SEG, LINKED, PEND = range(5)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    S = len(params)
    B = np.zeros((5, capacity + S), np.int64)
    B[NXT] = np.arange(capacity + S)
    B[PRV] = np.arange(capacity + S)
    B[SEG] = -1
    M = np.zeros(2 * S, np.int64)
    for i in range(S):
        M[S + i] = np.int64(capacity * params[i])
    return (B, M)


@nb.njit(cache=True)
def _promote(B, M, b, i):
    """Placed block ``b`` from segment ``i`` one up, demoting overflow down; returns its segment."""
    S = M.shape[0] // 2
    base = B.shape[1] - S
    evictable = B[LINKED, b] != 0
    if evictable:
        dl_unlink(B, NXT, PRV, b)
        B[LINKED, b] = 0
    j = i + 1
    B[SEG, b] = j
    M[i] -= 1
    M[j] += 1
    while j >= 1 and M[j] > M[S + j] and B[NXT, base + j] != base + j:
        low = B[NXT, base + j]
        dl_unlink(B, NXT, PRV, low)
        B[SEG, low] = j - 1
        M[j] -= 1
        M[j - 1] += 1
        dl_append(B, NXT, PRV, base + j - 1, low)
        j -= 1
    if evictable:
        dl_append(B, NXT, PRV, base + i + 1, b)
        B[LINKED, b] = 1
    return i + 1


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    B, M = state
    S = M.shape[0] // 2
    i = B[SEG, b]
    if i < 0:
        B[PEND, b] = 1
    elif i < S - 1:
        _promote(B, M, b, i)
    elif B[LINKED, b]:
        s = B.shape[1] - S + i
        dl_unlink(B, NXT, PRV, b)
        dl_append(B, NXT, PRV, s, b)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B = state[0]
    dl_unlink(B, NXT, PRV, b)
    B[LINKED, b] = 0


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, M = state
    S = M.shape[0] // 2
    i = B[SEG, b]
    if i < 0:
        i = 0
        B[SEG, b] = 0
        M[0] += 1
        if B[PEND, b]:
            B[PEND, b] = 0
            if S > 1:
                i = _promote(B, M, b, 0)
    dl_append(B, NXT, PRV, B.shape[1] - S + i, b)
    B[LINKED, b] = 1


@nb.njit(cache=True)
def _victim(state):
    B, M = state
    S = M.shape[0] // 2
    base = B.shape[1] - S
    for i in range(S):
        b = B[NXT, base + i]
        if b != base + i:
            return b
    return -1


@nb.njit(cache=True)
def _on_evict(state, b):
    B, M = state
    B[PEND, b] = 0
    i = B[SEG, b]
    if i >= 0:
        if B[LINKED, b]:
            dl_unlink(B, NXT, PRV, b)
            B[LINKED, b] = 0
        B[SEG, b] = -1
        M[i] -= 1


@register_policy("slru")
class SLRU(CompiledAdapter):
    """A linked list per segment of its evictable blocks (least recent first); segment of each placed
    block and counts per segment in int64 arrays."""

    source = "segmented LRU (Karedla et al., 1994; n segments as in libCacheSim SLRU)"
    compiled = CompiledPolicy(_init, no_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)

    def __init__(self, segments: Segments = 4) -> None:
        sizes = [1.0] * segments if isinstance(segments, int) else [float(s) for s in segments]
        total = sum(sizes)
        self.fractions = [s / total for s in sizes]
        self.n_seg = len(sizes)

    def compiled_params(self) -> np.ndarray:
        return np.array(self.fractions, dtype=np.float64)
