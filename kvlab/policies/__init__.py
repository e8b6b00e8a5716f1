"""Eviction policies: one file per policy, registered by name, usable by every driver.

Every module in this package is imported here, so a policy file registers itself just by existing.
"""

import importlib
import pkgutil

from kvlab.policies.base import EvictionPolicy, available_policies, make_policy, register_policy

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base" and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["EvictionPolicy", "available_policies", "make_policy", "register_policy"]
