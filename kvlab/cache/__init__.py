"""The prefix-cache core: block pool, key index, ref counts and one eviction policy per tier."""

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.cache.prefix_cache import COUNTING_MODES, Admission, PrefixCache, pool_blocks

__all__ = ["COUNTING_MODES", "AccessContext", "Admission", "KVBlock", "PrefixCache", "pool_blocks"]
