"""LFU-DA: LFU with dynamic aging.

Source: Arlitt, Cherkasova, Dilley, Friedrich, Jin, "Evaluating Content Management Techniques for Web
Proxy Caches", HP Labs / ACM SIGMETRICS PER 2000 (LFU-DA, with unit size and cost). Each block has a
priority ``K = L + F``: ``F`` its frequency (1 at insertion, +1 per hit) and ``L`` the cache age, set to
the priority of every evicted block; a block's ``K`` is recomputed with the current ``L`` at each hit,
so blocks that stopped being used age out. ``victim()`` is the smallest ``K``.

Documented choices: ties go to the least recently unpinned block (vLLM's LRU order); a hit counts even
while the block is pinned; pinned blocks are out of the order and rejoin it at unpin with their
current ``K``; per-block frequency does not survive eviction (only ``L`` remembers). libCacheSim's
``LFUDA.c`` is not this formula (it adds the current minimum to the frequency at each hit and does not
increment it), so no cross-check with it is claimed.

A priority policy (kvlab.policies._priority; the age is its aging slot): Python O(1) per event but when a
priority gets its first block (buckets); compiled O(log n) (a heap).
"""

from __future__ import annotations

import numba as nb

from kvlab.policies._priority import BucketPriorityPolicy, Priority
from kvlab.policies.base import register_policy

FREQ, PRIO = 0, 1  # per-block fields
AGE = 0  # global int slot: L


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    s.blk[FREQ][b] = 1
    s.blk[PRIO][b] = s.globi[AGE] + 1


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    f = s.blk[FREQ][b] + 1
    s.blk[FREQ][b] = f
    s.blk[PRIO][b] = s.globi[AGE] + f


@nb.njit(cache=True)
def _priority(s, b, r):
    return s.blk[PRIO][b]


@register_policy("lfuda")
class LFUDA(BucketPriorityPolicy):
    """Smallest ``(K, unpin stamp)`` first; ``age`` (L) never decreases."""

    source = "LFU-DA (Arlitt et al., 2000): priority = cache age + frequency"
    spec = Priority(_priority, _insert, _hit, block=(0, 0), glob=(0,), aging=AGE)
    age = property(lambda self: self.state.globi[AGE])
