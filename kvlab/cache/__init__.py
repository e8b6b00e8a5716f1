"""The prefix-cache core: block pool, key index, ref counts and one eviction policy per tier.

It sits below kvlab.policies and kvlab.tiers and imports neither: a :class:`PrefixCache` is given its policy
object (``kvlab.policies.make_policy(name)``; :func:`kvlab.policies.make_cache` builds both from a name) and
sees the tiers below it through :class:`LowerTiers`.
"""

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.cache.lower import LowerTiers
from kvlab.cache.prefix_cache import COUNTING_MODES, Admission, PrefixCache, pool_blocks

__all__ = ["COUNTING_MODES", "AccessContext", "Admission", "KVBlock", "LowerTiers", "PrefixCache", "pool_blocks"]
