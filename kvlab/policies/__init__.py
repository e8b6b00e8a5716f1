"""Eviction policies: one file per policy, registered by name, usable by every driver."""

from kvlab.policies import lru  # noqa: F401  (built-in policies register themselves on import)
from kvlab.policies.base import EvictionPolicy, available_policies, make_policy, register_policy

__all__ = ["EvictionPolicy", "available_policies", "make_policy", "register_policy"]
