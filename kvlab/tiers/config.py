"""The cache section every driver embeds: the device cache and the tiers below it, defined and checked once.

:class:`CacheConfig` holds the fields every driver shares — ``block_size`` (tokens per block), ``capacity_blocks``
(device blocks), ``policy`` and ``policy_params``, ``tiers`` (the lower tiers, level 1 first) and
``max_load_tokens`` (tokens per request loaded from the lower tiers) — and their checks: the policy name
(kvlab.policies.check_policy_name), its parameters (checked by the policy) and the tier rules
(:func:`kvlab.tiers.spec.check_tiers`, the one tier/spec validation of every entry point).
:class:`ReplayCacheConfig` adds what the replay counts with: ``mode``, ``backend``, ``verify``.

They are the bases of ``ReplayConfig`` (kvlab.replay), ``SimConfig`` (kvlab.sim) and the experiment's ``cache:``
section (kvlab.experiment.sections.CacheSpec); the engine's run config (kvlab.experiment.drivers.EngineRunConfig)
holds one. Field names are those users write (CLI flags, ``cache:`` keys, keyword arguments). A config whose
recorded layout does not start with these fields lists its own order in ``_FIELD_ORDER``, so its dumps (run
identities, manifests, experiment tables), its error precedence and its schema keep the order they were first
recorded in (docs/semantics.md, "One cache config").

The tiers live on the tiers floor (kvlab.tiers.spec), so this section does too: every driver sits above it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, field_validator, model_validator

from kvlab.policies import check_policy_name, check_policy_params
from kvlab.schema import (
    BlockSize,
    CapacityBlocks,
    CountingMode,
    Schema,
)
from kvlab.tiers.spec import Tier, check_tiers

#: how the replay runs the cache: the numba kernel, the Python core, or the kernel when the policy has one
CacheBackend = Literal["auto", "compiled", "python"]
CACHE_BACKENDS: tuple[str, ...] = get_args(CacheBackend)


class CacheConfig(Schema):
    """The device cache (block size in tokens, capacity in blocks, eviction policy) and the tiers below it.

    Invariants after construction: ``policy`` is registered, ``policy_params`` are accepted by it, and
    ``tiers`` / ``max_load_tokens`` obey every tier rule (:func:`~kvlab.tiers.spec.check_tiers`); a bad value
    raises ConfigError naming the field (``_FIELD_PREFIX`` + name in tier messages: ``cache.tiers`` in an
    experiment file). ``block_size`` / ``capacity_blocks`` None: the embedding config's default or another unit.
    """

    block_size: BlockSize | None = None  # tokens per block; None: the trace's (hash traces), else 16
    capacity_blocks: CapacityBlocks | None = None  # device blocks
    policy: str = "lru"
    policy_params: dict = Field(default_factory=dict)
    tiers: list[Tier] = Field(default_factory=list)  # below the device (docs/tiers.md); none: a single tier
    max_load_tokens: Annotated[int, Field(ge=0)] | None = None  # per request, from the lower tiers (None: all)

    _policy_known = field_validator("policy")(check_policy_name)
    _params_checked_by_policy = field_validator("policy_params")(check_policy_params)

    #: what tier messages put before a field's name (an experiment's section: ``cache.``)
    _FIELD_PREFIX: ClassVar[str] = ""
    #: every field of a subclass in its recorded order (empty: pydantic's, inherited fields first)
    _FIELD_ORDER: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _tier_rules(self) -> CacheConfig:
        """kvlab.tiers.spec.check_tiers: the tier rules of every entry point."""
        prefix = self._FIELD_PREFIX
        check_tiers(self.tiers, max_load_tokens=self.max_load_tokens, field=lambda name: f"{prefix}{name}")
        return self

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Put a subclass's fields in its ``_FIELD_ORDER`` (pydantic puts inherited fields first): its dumps,
        validation order and schema keep the layout recorded before this section existed."""
        super().__pydantic_init_subclass__(**kwargs)
        order = cls.__dict__.get("_FIELD_ORDER")
        if not order:
            return
        fields = cls.__pydantic_fields__
        if sorted(order) != sorted(fields):
            raise TypeError(f"{cls.__name__}._FIELD_ORDER must name each field once: "
                            f"{sorted(set(fields) ^ set(order))}")
        cls.__pydantic_fields__ = {name: fields[name] for name in order}
        cls.model_rebuild(force=True)
        if list(cls.model_fields) != list(order):  # a pydantic that rebuilds fields from annotations
            raise TypeError(f"{cls.__name__}: pydantic did not keep the field order of _FIELD_ORDER")


class ReplayCacheConfig(CacheConfig):
    """:class:`CacheConfig` plus how the replay counts: ``mode`` (``vllm``: the last prompt token is recomputed;
    ``ideal``), ``backend`` (:data:`CACHE_BACKENDS`) and ``verify`` (tokens verified on every hit: key collisions
    counted and refused)."""

    mode: CountingMode = "vllm"
    backend: CacheBackend = "auto"
    verify: bool = False


__all__ = ["CACHE_BACKENDS", "CacheBackend", "CacheConfig", "ReplayCacheConfig"]
