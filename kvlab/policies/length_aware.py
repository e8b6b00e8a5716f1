"""LengthAwareCache from Mooncake: LFU that evicts blocks occurring later in requests first.

Source: R. Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving",
arXiv 2407.00079 v3, §4.2 and Table 1: "LengthAwareCache (similar to LFU but prioritizing eviction
of cache blocks occurring later in requests)". That one sentence is the whole published definition
(v4 words it "prioritizing cache blocks occurring later in requests"; we follow v3, which says which
blocks go first, and which agrees with prefix reuse: a later block is useless without its prefix).

Choices:

* Order: lowest frequency first; among equal frequencies the block at the larger position (block
  index in its sequence, ``KVBlock.position``) first; then the least recently unpinned. Frequency is
  primary because the policy is "similar to LFU".
* Frequency = 1 at insert, +1 per hit (hits on pinned blocks included); it does not survive eviction.

A priority policy (kvlab.policies._priority), the priority one int ``(frequency << 32) | (2**31 - 1 -
position)``: O(log n) per event.
"""

from __future__ import annotations

import numba as nb

from kvlab.policies._priority import Priority, PriorityPolicy, field
from kvlab.policies.base import register_policy

FREQ, POS = 0, 1  # per-block fields
_POS_LIMIT = (1 << 31) - 1


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    s.blk[FREQ][b] = 1
    s.blk[POS][b] = pos


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    s.blk[FREQ][b] += 1


@nb.njit(cache=True)
def _priority(s, b, r):
    # one int orders (frequency, -position): frequency in the high bits; positions below 2**31
    return (s.blk[FREQ][b] << 32) | (_POS_LIMIT - s.blk[POS][b])


@register_policy("length-aware")
class LengthAware(PriorityPolicy):
    """Evict the lowest ``(frequency, -position)``; ties least recently unpinned."""

    source = "Mooncake LengthAwareCache (arXiv 2407.00079 v3 §4.2): LFU, later blocks first"
    spec = Priority(_priority, _insert, _hit, block=(0, 0))
    _freq = field(FREQ)
