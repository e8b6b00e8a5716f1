"""Real lower tiers for the engine (docs/engine.md, "Real tiers in the engine"): the stores that hold the bytes
of :class:`kvlab.tiers.TierStack`'s slots (:mod:`~kvlab.engine.tiers.store`: DRAM, disk, the data mover) and the
engine's glue (:mod:`~kvlab.engine.tiers.attach`: build the stack and the mover, the results' tier columns)."""

from kvlab.engine.tiers.attach import attach_tiers, request_tier_hits, tier_config, tier_results
from kvlab.engine.tiers.store import DiskStore, DramStore, TierDir, TierIO, TierIOCounters, TierReadError

__all__ = ["DiskStore", "DramStore", "TierDir", "TierIO", "TierIOCounters", "TierReadError", "attach_tiers",
           "request_tier_hits", "tier_config", "tier_results"]
