"""The eviction-policy interface (DESIGN.md "Eviction policy interface") and the policy registry.

A policy orders the *evictable* blocks of one tier: keyed blocks whose ref count is 0. It never sees
a pinned block as a candidate. The cache calls, for each block:

* ``on_insert(block, ctx)``  a newly computed block got its key (the block is pinned at that moment);
* ``on_hit(block, ctx)``     a lookup matched it (before ``on_pin`` when it was evictable);
* ``on_miss(keys, ctx)``     optional: the keys of the full blocks an admitted request is about to
  compute, after its hits are pinned and before any block is allocated for it (so ``victim()`` may
  depend on them: ARC adapts to a ghost hit before choosing). Not called for unkeyed blocks;
* ``on_pin(block, ctx)``     ref count 0 -> 1: the block leaves the evictable set;
* ``on_unpin(block, ctx)``   ref count 1 -> 0: the block joins the evictable set;
* ``victim() -> block``      choose one evictable block (the cache then calls ``on_evict``);
* ``on_evict(block)``        the block left the evictable set and lost its key;
* ``on_remove(block)``       the block's key was dropped without eviction (reset, invalidation).

Invariant: the set of blocks a policy may return from ``victim()`` is exactly those unpinned since
their last pin (or insert) and not evicted or removed since. ``len(policy)`` is that set's size.
Whether per-key state (e.g. frequency) survives eviction is each policy's documented choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError


class EvictionPolicy:
    """Base class: override the hooks a policy needs; ``victim`` and ``__len__`` are required."""

    name: ClassVar[str] = "base"
    #: one-line provenance shown in docs and results
    source: ClassVar[str] = ""
    #: numba twin of the hooks (kvlab.cache.compiled), or None: the replay then uses the Python core
    compiled: ClassVar[CompiledPolicy | None] = None

    def compiled_params(self) -> np.ndarray | tuple:
        """This instance's numeric parameters, in the order the compiled hooks read them (float64), or a
        tuple of arrays (parameters plus data from ``prepare``). Called after ``prepare``."""
        return np.zeros(0, dtype=np.float64)

    def attach(self, cache: object) -> None:  # noqa: B027 - optional hook
        """Called once by the PrefixCache that owns this policy (prefix-aware policies read its index:
        ``cache.num_cached_children(key)``, ``cache.get(key)``)."""

    def prepare(self, encoded: object) -> None:  # noqa: B027 - optional hook
        """Offline policies (Belady) read the trace's future here: an EncodedWorkload whose dense key
        ids are the keys the cache will see. Called once before a replay."""

    def prepared(self) -> object:
        """The EncodedWorkload a compiled twin reads, kept by ``prepare`` as ``self._encoded``; ConfigError
        if ``prepare`` was not called."""
        encoded = getattr(self, "_encoded", None)
        if encoded is None:
            raise ConfigError(f"{self.name}: compiled_params() needs the workload: call prepare(encoded) first")
        return encoded

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:  # noqa: B027 - optional hook
        pass

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:  # noqa: B027 - optional hook
        pass

    def on_miss(self, keys: Sequence[Hashable], ctx: AccessContext) -> None:  # noqa: B027 - optional hook
        pass

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement on_pin")

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement on_unpin")

    def victim(self) -> KVBlock:
        raise NotImplementedError(f"{type(self).__name__} must implement victim")

    def on_evict(self, block: KVBlock) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement on_evict")

    def on_remove(self, block: KVBlock) -> None:
        self.on_evict(block)

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__")


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}


def register_policy(name: str, *, replace: bool = False) -> Callable[[type], type]:
    """Class decorator: make a policy available by ``name`` in every driver (and the CLI)."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and not replace and _REGISTRY[name] is not cls:
            raise ConfigError(f"policy {name!r} is already registered (pass replace=True to override)")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def make_policy(name: str | EvictionPolicy, **params: object) -> EvictionPolicy:
    """A fresh policy instance by registered name (or pass an instance through)."""
    if isinstance(name, EvictionPolicy):
        return name
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None
    return factory(**params)


def resolved_policy_params(name: str | EvictionPolicy, params: dict | None = None) -> dict:
    """``params`` with every constructor default filled in (the policy part of a run's identity).

    Raises ConfigError for an unknown policy or parameter name. A policy instance passed directly
    contributes only the given ``params`` (its constructor arguments are not recoverable).
    """
    params = dict(params or {})
    if isinstance(name, EvictionPolicy):
        return params
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None
    sig = inspect.signature(factory)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return params
    unknown = sorted(set(params) - set(sig.parameters))
    if unknown:
        accepted = ", ".join(sig.parameters) or "none"
        raise ConfigError(f"policy {name!r}: unknown parameter {unknown[0]!r} (accepted: {accepted})")
    bound = sig.bind_partial(**params)
    bound.apply_defaults()
    return dict(bound.arguments)


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)
