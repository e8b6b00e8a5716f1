"""Eviction policies: one file per policy, registered by name, usable by every driver.

Every module in this package is imported here, so a policy file registers itself just by existing.

This package sits above the cache core (kvlab.cache): the registry lookup by name happens here, never in the
cache. :func:`make_cache` is the convenience for a cache by policy name; :func:`check_policy_name` and
:func:`check_policy_params` are the field validators config models above this floor use for a policy field.
"""

import importlib
import pkgutil
from typing import Any

from kvlab.cache.prefix_cache import PrefixCache
from kvlab.errors import ConfigError
from kvlab.policies.base import (
    EvictionPolicy,
    available_policies,
    make_policy,
    register_policy,
    resolved_policy_params,
)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base" and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")


def make_cache(
    capacity_blocks: int | None = None,
    policy: str | EvictionPolicy = "lru",
    *,
    block_size: int = 16,
    policy_params: dict | None = None,
    **old_names: int,
) -> PrefixCache:
    """A :class:`~kvlab.cache.PrefixCache` of ``capacity_blocks`` blocks (``block_size`` tokens each) with a fresh
    registered policy ``policy`` built with ``policy_params`` (a policy object is used as it is). The cache
    itself takes only a policy object; this is the lookup by name, above the cache floor. Old keywords
    (``num_blocks``) as :class:`~kvlab.cache.PrefixCache` takes them. ConfigError for an unknown policy or
    parameter, as :func:`make_policy` raises it."""
    return PrefixCache(capacity_blocks, make_policy(policy, **(policy_params or {})), block_size=block_size,
                       **old_names)


def check_policy_name(value: str) -> str:
    """Field validator: ``value`` is a registered eviction policy (ConfigError listing them otherwise)."""
    if value not in available_policies():
        raise ConfigError(f"unknown policy {value!r}; available: {', '.join(available_policies())}")
    return value


def check_policy_params(value: dict, info: Any) -> dict:
    """Field validator: the policy (an earlier field named ``policy``) checks its own parameters:
    unknown names, types and bounds (ConfigError naming the policy, parameter and range)."""
    policy = info.data.get("policy")
    if policy is not None:
        resolved_policy_params(policy, value)
        make_policy(policy, **value)
    return value


__all__ = ["EvictionPolicy", "available_policies", "check_policy_name", "check_policy_params", "make_cache",
           "make_policy", "register_policy"]
