"""Tiered KV storage: the tiers below the device cache (DRAM, SSD, a remote pool), docs/tiers.md.

:class:`Tier` names a tier (size, policy, write policy, inclusion, chunking); :func:`parse_tier` reads the
CLI's ``--tier`` spelling; :class:`TierStack` runs the tiers beside a device
:class:`~kvlab.cache.PrefixCache` in the Python core.
"""

from kvlab.tiers.spec import Tier, check_tiers, parse_tier
from kvlab.tiers.stack import LowerTier, TierCounters, TierHits, TierStack

__all__ = ["LowerTier", "Tier", "TierCounters", "TierHits", "TierStack", "check_tiers", "parse_tier"]
