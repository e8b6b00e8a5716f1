"""A lower storage tier, as a user names it: :class:`Tier` (Python) and ``--tier NAME:key=value:...`` (CLI).

Tier 0 is the device cache (its size is ``capacity_blocks``, its policy ``policy``); a run's ``tiers`` list
names the tiers below it, in order (e.g. DRAM, then SSD). docs/tiers.md states the semantics.

Units: ``capacity_blocks`` and ``chunk_blocks`` in blocks of the run's block size; ``capacity_gib`` in GiB
(2**30 bytes) of KV cache, converted with the model's KV bytes per block (:meth:`Tier.resolve`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from kvlab.errors import ConfigError
from kvlab.policies import check_policy_name, check_policy_params
from kvlab.schema import (
    MAX_CAPACITY_BLOCKS,
    CapacityBlocks,
    Schema,
    _describe,
    _metadata,
)
from kvlab.units import GIB

WriteMode = Literal["write_through", "write_through_selective", "write_back"]
Inclusion = Literal["none", "inclusive", "exclusive"]
TierName = Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]
#: names a lower tier may not take (the device tier's; columns are ``hit_tokens_<name>``)
RESERVED = {"device", "total", "ideal"}
#: Tier field -> its key in the ``--tier`` spelling (error messages name both)
SPEC_KEYS = {"name": "NAME", "capacity_blocks": "blocks", "capacity_gib": "gib", "policy": "policy",
             "policy_params": "policy parameters", "write": "write", "selective_hits": "selective",
             "inclusion": "inclusion", "chunk_blocks": "chunk", "touch": "touch", "medium": "medium", "link": "link"}
#: timing fields (kvlab.tiers.timing): left out of a tier's serialized form when unset, so a run without them
#: keeps its run id
TIMING_FIELDS = ("medium", "link")


class TierFieldError(ConfigError):
    """A bad :class:`Tier` field: ``field``, its ``--tier`` key ``key`` and what is wrong (``detail``)."""

    def __init__(self, name: object, field: str, detail: str) -> None:
        self.field, self.key, self.detail = field, SPEC_KEYS.get(field, field), detail
        super().__init__(f"tier {name!r}: {field} ({self.key}=) {detail}")


class Tier(Schema):
    """One tier below the device: its size, eviction policy, write policy and inclusion.

    * ``write``: when a block is stored here. ``write_through``: every block computed on the device is stored
      at once, in every write_through tier (vLLM's OffloadingConnector; LMCache writes to every backend);
      ``write_through_selective``: once the block has had ``selective_hits`` hits (device or lower tiers)
      while the device holds it (HiCache; its threshold counts the insert too, so HiCache's default 2 is
      ``selective_hits=1``); ``write_back``: when the last copy of its key leaves the tier above (LMCache's
      lazy offload). A store that finds no free or evictable room is skipped and counted.
    * ``inclusion``: ``none`` (tiers independent, as vLLM), ``inclusive`` (a key resident in any tier above
      is pinned here: never evicted below what is above, as HiCache), ``exclusive`` (a loaded block moves up
      and a key computed above leaves this tier: never in two tiers; needs ``write_back``).
    * ``chunk_blocks``: this tier stores and finds whole chunks of that many blocks (LMCache: 256 tokens).
    * ``touch``: every block of a request that this tier holds is touched (a hit, then unpinned: the most
      recent for recency policies), device hits included, as vLLM's offloading manager does.
    * ``max_load_tokens``: at most this many tokens of a request are loaded from the lower tiers (vLLM's
      per-request limit); hits past it are found but recomputed.
    * ``medium`` / ``link`` (serving simulator only; names of :mod:`kvlab.tiers.timing` presets): where the
      tier's data rests (its read/write bandwidth and per-operation latency, e.g. ``nvme_gen4``) and the link
      between it and the device (``pcie5_x16``); loads and stores then take time. Unset: untimed.
    """

    name: TierName
    capacity_blocks: CapacityBlocks | None = None
    capacity_gib: Annotated[float, Field(gt=0, le=1 << 30)] | None = None
    policy: str = "lru"
    policy_params: dict = Field(default_factory=dict)
    write: WriteMode = "write_through"
    selective_hits: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    inclusion: Inclusion = "none"
    chunk_blocks: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    touch: bool = True
    medium: str | None = None
    link: str | None = None

    _policy_known = field_validator("policy")(check_policy_name)
    _params_checked_by_policy = field_validator("policy_params")(check_policy_params)

    def __init__(self, **data: object) -> None:
        """Validated at construction: ConfigError naming the field and its ``--tier`` key (TierFieldError)."""
        try:
            BaseModel.__init__(self, **data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
            if not loc:  # a model check: its message names the tier
                raise ConfigError(_describe(err, None)) from None
            info = type(self).model_fields.get(loc[0])
            detail = _describe(err, _metadata(info))
            if loc[0] == "name" and err.get("type") == "string_pattern_mismatch":
                detail = f"must start with a letter and hold only letters, digits and _, got {err['input']!r}"
            raise TierFieldError(data.get("name"), loc[0], detail) from None

    @field_validator("medium", "link")
    @classmethod
    def _preset_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            from kvlab.tiers.timing import check_preset

            check_preset(value, info.field_name)
        return value

    @model_serializer(mode="wrap")
    def _drop_unset_timing(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer protocol
        out = handler(self)
        for name in TIMING_FIELDS:
            if out.get(name) is None:
                out.pop(name, None)
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Tier:
        check_tiers([self])  # a tier's own rules (the rules between tiers need the whole list)
        return self

    def resolve(self, kv_bytes_per_block: int | None) -> Tier:
        """This tier with ``capacity_blocks`` set: a ``capacity_gib`` tier is converted with the model's KV
        bytes per block (whole blocks, rounded down; the result names blocks only, as a run's identity does);
        ConfigError without a model."""
        if self.capacity_blocks is not None:
            return self
        if not kv_bytes_per_block:
            raise ConfigError(f"tier {self.name!r}: gib={self.capacity_gib} needs a model (--model) for the KV "
                              "bytes per block")
        blocks = math.floor(self.capacity_gib * GIB / kv_bytes_per_block)
        if not 1 <= blocks <= MAX_CAPACITY_BLOCKS:
            raise ConfigError(f"tier {self.name!r}: gib={self.capacity_gib} is {blocks} blocks of "
                              f"{kv_bytes_per_block} bytes; must be in [1, {MAX_CAPACITY_BLOCKS}]")
        return self.replace(capacity_blocks=blocks, capacity_gib=None)

    @property
    def chunk_slots(self) -> int:
        """Chunks this tier holds: ``capacity_blocks // chunk_blocks`` (at least 1 once sized in blocks:
        :func:`check_tiers` refuses a tier smaller than one chunk)."""
        if self.capacity_blocks is None:
            raise ConfigError(f"tier {self.name!r}: gib={self.capacity_gib} is not resolved to blocks yet "
                              "(Tier.resolve)")
        return self.capacity_blocks // self.chunk_blocks

    def label(self) -> str:
        """The ``--tier`` spelling of this tier (parse_tier(t.label()) == t)."""
        size = f"blocks={self.capacity_blocks}" if self.capacity_gib is None else f"gib={self.capacity_gib:g}"
        parts = [self.name, size, f"policy={self.policy}"]
        parts.append(f"selective={self.selective_hits}" if self.write == "write_through_selective"
                     else f"write={self.write}")
        parts += [f"inclusion={self.inclusion}", f"chunk={self.chunk_blocks}"]
        if not self.touch:
            parts.append("touch=off")
        parts += [f"{k}={getattr(self, k)}" for k in TIMING_FIELDS if getattr(self, k) is not None]
        parts += [f"{k}={v}" for k, v in sorted(self.policy_params.items())]
        return ":".join(parts)


_KEYS = ("blocks", "gib", "policy", "write", "selective", "inclusion", "chunk", "touch", "medium", "link")
#: ``write=`` short spellings parse_tier accepts (docs/tiers.md)
_WRITE_ALIASES = {"through": "write_through", "back": "write_back", "selective": "write_through_selective"}
#: the ``--tier`` spelling shown by ``--help`` and docs/parameters.md (every part of it is what parse_tier reads)
SPEC_HELP = ("NAME:blocks=N[:policy=P][:write=write_through|write_through_selective|write_back][:selective=K]"
             "[:inclusion=none|inclusive|exclusive][:chunk=C][:touch=on|off]")


def parse_tier(text: str, flag: str = "--tier") -> Tier:
    """A :class:`Tier` from ``NAME:blocks=N[:policy=P][:write=write_through|write_through_selective|write_back]
    [:selective=K][:inclusion=none|inclusive|exclusive][:chunk=C][:touch=on|off][:medium=M][:link=L]``
    (``gib=X`` instead of ``blocks=N`` with a model; ``selective=K`` alone means
    ``write=write_through_selective`` with ``K`` hits; ``medium`` / ``link``: timing presets,
    kvlab.tiers.timing); other ``key=value`` pairs are the tier policy's parameters. Strict: a key given twice,
    ``selective=K`` with another write policy, or a value holding ``=`` is refused. ConfigError naming
    ``flag``."""
    name, _, rest = text.partition(":")
    fields: dict[str, object] = {"name": name}
    params: dict[str, object] = {}
    seen: set[str] = set()
    for item in rest.split(":") if rest else []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {text!r}: expected key=value, got {item!r} (keys: {', '.join(_KEYS)})")
        if key in seen:
            raise ConfigError(f"{flag} {text!r}: {key}= given twice (kvlab never keeps one silently)")
        seen.add(key)
        if "=" in value:
            raise ConfigError(f"{flag} {text!r}: {item!r} holds two '='; give one key=value per ':'-separated part "
                              "(e.g. write=write_through_selective:selective=3)")
        if key == "blocks":
            fields["capacity_blocks"] = _number(value, int, text, key, flag)
        elif key == "gib":
            fields["capacity_gib"] = _number(value, float, text, key, flag)
        elif key == "policy":
            fields["policy"] = value
        elif key == "write":
            fields["write"] = _WRITE_ALIASES.get(value, value)
        elif key == "selective":
            fields["selective_hits"] = _number(value, int, text, key, flag)
        elif key == "inclusion":
            fields["inclusion"] = value
        elif key == "chunk":
            fields["chunk_blocks"] = _number(value, int, text, key, flag)
        elif key == "touch":
            if value not in ("on", "off", "true", "false"):
                raise ConfigError(f"{flag} {text!r}: touch must be on or off, got {value!r}")
            fields["touch"] = value in ("on", "true")
        elif key in TIMING_FIELDS:
            fields[key] = value
        else:
            params[key] = _number(value, float, text, key, flag, strict=False)
    if "selective_hits" in fields:
        write = fields.setdefault("write", "write_through_selective")
        if write != "write_through_selective":
            raise ConfigError(f"{flag} {text!r}: selective={fields['selective_hits']} applies to "
                              f"write=write_through_selective, not write={write}; give one of them")
    if params:
        fields["policy_params"] = params
    try:
        return Tier(**fields)
    except TierFieldError as err:
        sep = " " if err.detail.startswith("must") else ": "  # a check's own sentence after a colon
        raise ConfigError(f"{flag} {text!r}: {err.key}{sep}{err.detail}") from None
    except ConfigError as err:
        raise ConfigError(f"{flag} {text!r}: {str(err).removeprefix(f'tier {name!r}: ')}") from None


def _number(value: str, kind: type, text: str, key: str, flag: str, strict: bool = True) -> object:
    try:
        number = float(value)
        if kind is int:
            if number != int(number):
                raise ValueError
            return int(number)
        return number
    except (ValueError, OverflowError):
        if not strict:
            return value
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag} {text!r}: {key} must be {what}, got {value!r}") from None


def check_tiers(tiers: Sequence[Tier], *, max_load_tokens: int | None = None,
                field: Callable[[str], str] = str) -> Sequence[Tier]:
    """``tiers`` (the lower tiers, level 1 first) unchanged if they obey every tier rule; ConfigError naming the
    tier, its ``--tier`` key and the rule otherwise. The one check of tiers: :class:`Tier` (each tier's own
    rules, at construction), parse_tier, the CLI, kvlab.tiers.config.CacheConfig (ReplayConfig, SimConfig, the
    experiment's cache: section, the engine driver's run config), the engine
    (kvlab.engine.tiers.attach) and both replay backends (TierStack, kvlab.tiers.compiled) call it, so a
    spec is valid or refused whatever the backend or entry point (docs/tiers.md, "Rules").

    A tier: its name not reserved; exactly one of ``capacity_blocks`` / ``capacity_gib``; at least one whole
    chunk (``capacity_blocks >= chunk_blocks``); ``chunk_blocks > 1`` only with ``write_through`` (a chunk is
    stored when its last block is computed); ``selective_hits`` other than 1 only with
    ``write_through_selective``; ``exclusive`` only with ``write_back``; an online policy.
    Between tiers: names unique (they name result columns); ``write_back`` only below a tier of 1-block
    chunks (it stores single blocks as they leave the tier above). Options: ``max_load_tokens`` (tokens)
    only with tiers, and >= 0. ``field`` spells a field in messages (the CLI passes kvlab.schema.flag)."""
    seen: set[str] = set()
    above: Tier | None = None
    for t in tiers:
        name = t.name
        if name in RESERVED:
            raise ConfigError(f"tier name {name!r} is reserved ({', '.join(sorted(RESERVED))})")
        if (t.capacity_blocks is None) == (t.capacity_gib is None):
            raise ConfigError(f"tier {name!r}: give exactly one of blocks=N and gib=X")
        if t.capacity_blocks is not None and t.capacity_blocks < t.chunk_blocks:
            raise ConfigError(f"tier {name!r}: blocks={t.capacity_blocks} holds no whole chunk of chunk="
                              f"{t.chunk_blocks} blocks (a tier stores whole chunks); give blocks >= "
                              f"{t.chunk_blocks} or a smaller chunk")
        if t.chunk_blocks > 1 and t.write != "write_through":
            raise ConfigError(f"tier {name!r}: chunk={t.chunk_blocks} needs write=write_through (a chunk is stored "
                              f"when its last block is computed), got write={t.write}")
        if t.selective_hits != 1 and t.write != "write_through_selective":
            raise ConfigError(f"tier {name!r}: selective_hits (selective=) {t.selective_hits} applies to "
                              f"write=write_through_selective, not write={t.write}")
        if t.inclusion == "exclusive" and t.write != "write_back":
            raise ConfigError(f"tier {name!r}: inclusion=exclusive needs write=write_back")
        from kvlab.policies import make_policy

        if getattr(make_policy(t.policy, **t.policy_params), "offline", False):
            raise ConfigError(f"tier {name!r}: policy {t.policy} is offline (it reads the trace's future), "
                              "available on the device only")
        if name in seen:
            raise ConfigError(f"{field('tiers')}: tier name {name!r} given twice")
        seen.add(name)
        if t.write == "write_back" and above is not None and above.chunk_blocks > 1:
            raise ConfigError(f"{field('tiers')}: tier {name!r}: write=write_back below tier {above.name!r} of "
                              f"{above.chunk_blocks}-block chunks (chunk={above.chunk_blocks}): write_back stores "
                              f"single blocks as they leave the tier above; give {above.name!r} chunk=1 or {name!r} "
                              "write=write_through")
        above = t
    if max_load_tokens is not None:
        if not tiers:
            raise ConfigError(f"{field('max_load_tokens')} limits the tokens loaded from the lower tiers: give "
                              f"{field('tiers')} too")
        if isinstance(max_load_tokens, bool) or not isinstance(max_load_tokens, int):
            raise ConfigError(f"{field('max_load_tokens')} must be an integer, got {max_load_tokens!r}")
        if max_load_tokens < 0:
            raise ConfigError(f"{field('max_load_tokens')} must be in [0, inf) tokens, got {max_load_tokens!r}")
    return tiers
