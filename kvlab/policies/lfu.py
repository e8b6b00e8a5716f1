"""LFU: evict the least frequently used evictable block; among those, the least recently unpinned.

Source: classic least-frequently-used replacement, in libCacheSim's form (``LFU.c``: one FIFO per
frequency, appended on every access, evicting from the lowest non-empty frequency). Documented choices:

* frequency = 1 at insertion + 1 per hit (``on_hit``, counted even while the block is pinned);
* tie-break: least recently *unpinned* first (vLLM's LRU order, so a sequence's tail goes before its
  head). On object sequences every access unpins its block at once, which is libCacheSim's order
  (least recently accessed within a frequency);
* frequency does **not** survive eviction (as in libCacheSim's LFU): a recomputed key starts at 1;
* pin/unpin: a pinned block is out of the order; unpinning re-enters it as the most recent of its
  frequency.

On object sequences this is libCacheSim's LFU hit for hit. A priority policy (kvlab.policies._priority):
Python O(1) per event but when a frequency gets its first block (buckets); compiled O(log n) (a heap).
"""

from __future__ import annotations

import numba as nb

from kvlab.policies._priority import BucketPriorityPolicy, Priority
from kvlab.policies.base import register_policy

FREQ = 0  # per-block field


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    s.blk[FREQ][b] = 1


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    s.blk[FREQ][b] += 1


@nb.njit(cache=True)
def _priority(s, b, r):
    return s.blk[FREQ][b]


@register_policy("lfu")
class LFU(BucketPriorityPolicy):
    """Smallest ``(frequency, unpin stamp)`` first."""

    source = "classic LFU (libCacheSim LFU); ties: least recently unpinned; frequency reset on eviction"
    spec = Priority(_priority, _insert, _hit, block=(0,))
