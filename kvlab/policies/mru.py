"""MRU: evict the most recently unpinned evictable block.

Source: most-recently-used replacement (Chou & DeWitt, "An Evaluation of Buffer Management Strategies
for Relational Database Systems", VLDB'85), the classic answer to looping scans larger than the cache.
Documented choices: recency = unpin time (vLLM's order, so a just-released request's *head* block is
the most recent and goes first); pinned blocks are out of the order and rejoin it as the most recent
when unpinned; no state survives eviction. O(1) per event (insertion-ordered dict, evicted from its end).
"""

from __future__ import annotations

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("mru")
class MRU(EvictionPolicy):
    """Most recently unpinned first. Invariant: ``_queue`` holds exactly the evictable blocks, oldest first."""

    source = "MRU (Chou & DeWitt, VLDB'85): most recently unpinned first"

    def __init__(self) -> None:
        self._queue: dict[int, KVBlock] = {}

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        del self._queue[block.block_id]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue[block.block_id] = block

    def victim(self) -> KVBlock:
        return next(reversed(self._queue.values()))

    def on_evict(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)
