"""Real lower tiers for the engine (docs/engine.md, "Real tiers in the engine"): the stores that hold the bytes
of :class:`kvlab.tiers.TierStack`'s slots, one interface, media chosen by name (:mod:`~kvlab.engine.tiers.store`:
:class:`TierStore`, :data:`STORES`: DRAM, disk), the data mover (:mod:`~kvlab.engine.tiers.mover`) and the
engine's glue (:mod:`~kvlab.engine.tiers.attach`: build the stack, its stores and the mover; the results' tier
columns)."""

from kvlab.engine.tiers.attach import attach_tiers, default_stores, request_tier_hits, tier_config, tier_results
from kvlab.engine.tiers.mover import TierIO, TierIOCounters
from kvlab.engine.tiers.store import (
    STORES,
    DiskStore,
    DramStore,
    StoreSpec,
    StoreStats,
    TierDir,
    TierReadError,
    TierStore,
    make_store,
)

__all__ = ["STORES", "DiskStore", "DramStore", "StoreSpec", "StoreStats", "TierDir", "TierIO", "TierIOCounters",
           "TierReadError", "TierStore", "attach_tiers", "default_stores", "make_store", "request_tier_hits",
           "tier_config", "tier_results"]
