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
"""

from __future__ import annotations

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies._heap import HeapPolicy
from kvlab.policies.base import register_policy

_POS_LIMIT = (1 << 31) - 1


@register_policy("length-aware")
class LengthAware(HeapPolicy):
    """Evict the lowest ``(frequency, -position)``; ties least recently unpinned."""

    source = "Mooncake LengthAwareCache (arXiv 2407.00079 v3 §4.2): LFU, later blocks first"

    def __init__(self) -> None:
        super().__init__()
        self._freq: list[int] = []

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._freq = [0] * cache.num_blocks  # type: ignore[attr-defined]

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = 1

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] += 1

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        # one int orders (frequency, -position): frequency in the high bits; positions below 2**31
        self._push(bid, (self._freq[bid] << 32) | (_POS_LIMIT - block.position))
