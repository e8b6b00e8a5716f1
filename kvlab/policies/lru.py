"""LRU, exactly as vLLM v1's free-block queue orders cached blocks.

vLLM appends a block to the tail of its free queue when its ref count drops to 0 and allocates from
the head; requests free their blocks tail first, so a sequence's last block is evicted before its
first. Ordering evictable blocks by unpin time reproduces that queue (the unkeyed free blocks that
vLLM keeps at the head are the cache's free list). State does not survive eviction.
Source: vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue), block_pool.py.
"""

from __future__ import annotations

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lru")
class LRU(EvictionPolicy):
    """Least recently *unpinned* first. O(1) per event (insertion-ordered dict as the queue)."""

    source = "vLLM v1 prefix caching (FreeKVCacheBlockQueue order)"

    def __init__(self) -> None:
        self._queue: dict[int, KVBlock] = {}

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        del self._queue[block.block_id]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue[block.block_id] = block

    def victim(self) -> KVBlock:
        return next(iter(self._queue.values()))

    def on_evict(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)
