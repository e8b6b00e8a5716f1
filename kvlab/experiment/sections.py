"""The sections of an experiment (kvlab.experiment.config.Experiment): ``trace:``, ``hasher:``, ``cache:`` and
``engine:``, each validated with the whole field path from the experiment's root in its errors.

``cache:`` (:class:`CacheSpec`) is the cache section every driver embeds (kvlab.tiers.config.ReplayCacheConfig)
with the capacity in blocks, tokens or GiB; :func:`capacity_blocks` converts it to whole blocks.
Units: block sizes in tokens; ``capacity_gib`` in 2**30 bytes of KV of the experiment's model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from kvlab.errors import ConfigError
from kvlab.schema import NO_BOOL_NUMBERS, HashScheme, PositiveInt, Schema, Seed, TraceFormat
from kvlab.tiers.config import ReplayCacheConfig
from kvlab.units import GIB

CAPACITY_FIELDS = ("capacity_blocks", "capacity_tokens", "capacity_gib")


def later_left_out(model: BaseModel, data: object) -> object:
    """``data`` (a dump of ``model``) without the fields of ``model._LATER_IN_DUMPS`` that hold their defaults
    there: fields added after experiments were first recorded, so the recorded runs (manifests, table columns)
    of an experiment that does not use them stay what they were."""
    if isinstance(data, dict):
        for name, default in getattr(model, "_LATER_IN_DUMPS", {}).items():
            if name in data and data[name] == default:
                del data[name]
    return data


class Section(BaseModel):
    """A part of an experiment: validated like :class:`~kvlab.schema.Schema` (no extra fields, no NaN) but
    without its own ``__init__``, so that errors carry the whole field path from the experiment's root."""

    model_config = Schema.model_config
    #: pydantic's own, also where a base is a Schema (CacheSpec): a section validated inside an experiment keeps
    #: the whole field path in its errors, where Schema.__init__ would turn them into a ConfigError of its own
    __init__ = BaseModel.__init__
    _no_bool_numbers = NO_BOOL_NUMBERS  # a boolean is never a number (kvlab.schema.refuse_bool_numbers)
    #: fields added later -> their defaults, left out of dumps at those defaults (:func:`later_left_out`)
    _LATER_IN_DUMPS: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> object:
        return later_left_out(self, handler(self))


class TraceSpec(Section):
    """Which requests: a trace path or known name, its format (default: detected), the first ``limit``, then
    (``resample_seed`` given) one session resample of those: as many sessions as they hold, drawn whole with
    replacement by ``numpy.random.default_rng(resample_seed)`` (kvlab.analysis.resample_sessions, duplicates
    isolated). ``resample_by``: the sessions: ``session`` (the trace's session column), ``prefix``
    (kvlab.analysis.prefix_groups: requests sharing their first two prompt values), ``auto`` (the session
    column if the trace has one, else prefix groups). ``tokenizer``: the tokenizer of a text trace (a
    kvlab.workload.tokenizer.load_tokenizer spec: kvlab-bpe, byte, tekken, a trained name, a file or folder;
    None: kvlab-bpe when the trace holds text); :func:`load_experiment` checks that it is here."""

    path: Annotated[str, Field(min_length=1)]
    format: TraceFormat | None = None
    limit: PositiveInt | None = None
    resample_seed: Seed | None = None
    resample_by: Literal["auto", "session", "prefix"] = "auto"
    tokenizer: Annotated[str, Field(min_length=1)] | None = None

    _LATER_IN_DUMPS: ClassVar[dict[str, Any]] = {"resample_seed": None, "resample_by": "auto", "tokenizer": None}

    @model_validator(mode="after")
    def _resample_by_needs_a_seed(self) -> TraceSpec:
        if self.resample_by != "auto" and self.resample_seed is None:
            raise ValueError(f"trace.resample_by: {self.resample_by!r} applies to a session resample: give "
                             "trace.resample_seed too")
        return self


class HasherSpec(Section):
    """How prompts become block keys (docs/hashing.md)."""

    scheme: HashScheme = "xxh3_128"
    root_seed: Seed = 0
    model_id: str = "kvlab"


class CacheSpec(Section, ReplayCacheConfig):
    """The device cache: block size (tokens), one capacity, the eviction policy, lower tiers.

    The fields and checks every driver shares (kvlab.tiers.config.ReplayCacheConfig: the policy, its parameters,
    the tier rules, messages naming ``cache.<field>``), plus the capacity in other units: exactly one of
    ``capacity_blocks``, ``capacity_tokens`` (rounded down to whole blocks) and ``capacity_gib`` (GiB of KV of the
    experiment's ``model``, 2**30 bytes, rounded down to whole blocks): :func:`capacity_blocks`."""

    capacity_tokens: Annotated[int, Field(ge=1, le=1 << 50)] | None = None
    capacity_gib: Annotated[float, Field(gt=0, le=1 << 30)] | None = None

    _FIELD_PREFIX: ClassVar[str] = "cache."
    _FIELD_ORDER: ClassVar[tuple[str, ...]] = (
        "block_size", "capacity_blocks", "capacity_tokens", "capacity_gib", "policy", "policy_params", "mode",
        "backend", "verify", "tiers", "max_load_tokens")

    @model_validator(mode="after")
    def _one_capacity(self) -> CacheSpec:
        given = [f for f in CAPACITY_FIELDS if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(CAPACITY_FIELDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        return self


class EngineSpec(Section):
    """The real engine (``driver: engine``): a transformers model on kvlab's paged KV pool behind the simulator's
    scheduler, in measured time (kvlab.sim.run_engine_serving, as ``kvlab simulate --executor engine``).

    ``model``: a random-weight shape (kvlab.engine.SHAPES: ``tiny-llama``, ``cpu-bench``...), a ``config.json``
    file (random weights of that config) or a local Hugging Face checkpoint folder (loaded offline).
    ``model_seed``: the random weights' seed. ``dtype``: the model's (default: the shape's or checkpoint's);
    ``kv_dtype``: the KV pool's (default: the model's). ``threads``: torch CPU threads. ``batched``: one packed
    forward per step. ``verify``: each request's first prefill judged against the uncached forward
    (``verify_tokens`` greedy tokens). ``timer``: wall or the serving thread's CPU time; ``warmup``: untimed
    forward passes first. The rest are the scheduler's, as in ``simulate:``. Times are measured seconds.
    """

    model: Annotated[str, Field(min_length=1)] = "tiny-llama"
    model_seed: Seed = 0
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    kv_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    device: Annotated[str, Field(pattern=r"^(cpu|auto|cuda(:[0-9]+)?|mps)$")] = "cpu"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    threads: Annotated[int, Field(ge=1, le=1024)] = 1
    batched: bool = False
    verify: bool = False
    verify_tokens: Annotated[int, Field(ge=1, le=1024)] = 2
    timer: Literal["wall", "thread"] = "wall"
    warmup: Annotated[int, Field(ge=0, le=1000)] = 2
    max_num_seqs: Annotated[int, Field(ge=1, le=1 << 20)] = 256
    max_num_batched_tokens: Annotated[int, Field(ge=1, le=1 << 24)] = 8192
    rate: Annotated[float, Field(ge=1e-9, le=1e9)] | None = None
    time_scale: Annotated[float, Field(ge=1e-9, le=1e9)] = 1.0
    cache_at: Literal["schedule", "compute"] = "schedule"

    @field_validator("model")
    @classmethod
    def _model_known(cls, value: str) -> str:
        engine_model_config(value)
        return value

    @model_validator(mode="after")
    def _rate_or_time_scale(self) -> EngineSpec:
        if self.rate is not None and self.time_scale != 1.0:
            raise ValueError("give either rate or time_scale, not both")
        return self


def engine_model_config(model: str) -> dict:
    """The transformers config (a dict with ``model_type``) of ``engine.model``: a named random-weight shape, a
    ``config.json`` file, or a checkpoint folder holding one. ConfigError naming ``engine.model`` otherwise."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"engine.model: cannot read the model config {path} ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
            raise ConfigError(f"engine.model: {path} is not a transformers config (no 'model_type')")
        return data
    try:
        from kvlab.engine.model import SHAPES
    except ImportError:
        raise ConfigError("engine.model: the engine driver needs torch and transformers "
                          "(pip install 'kvlab[engine]')") from None
    if model not in SHAPES:
        raise ConfigError(f"engine.model: {model!r} is not a named shape ({', '.join(SHAPES)}), a config.json or a "
                          "checkpoint folder holding one")
    return dict(SHAPES[model])


def capacity_blocks(cache: CacheSpec, block_size: int, model: str | None) -> int:
    """The device capacity in whole blocks of ``block_size`` tokens (at least 1)."""
    if cache.capacity_blocks is not None:
        return cache.capacity_blocks
    if cache.capacity_tokens is not None:
        blocks = cache.capacity_tokens // block_size
        what = f"capacity_tokens {cache.capacity_tokens}"
    else:
        from kvlab.profiles import load_model

        per_block = block_size * load_model(model).kv_bytes_per_token
        blocks = math.floor(cache.capacity_gib * GIB / per_block)
        what = f"capacity_gib {cache.capacity_gib} ({per_block:,} bytes per block of {model})"
    if blocks < 1:
        raise ConfigError(f"cache.{what} is less than one block of {block_size} tokens")
    return blocks


__all__ = ["CAPACITY_FIELDS", "CacheSpec", "EngineSpec", "HasherSpec", "Section", "TraceSpec", "capacity_blocks",
           "engine_model_config", "later_left_out"]
