"""The experiment schema: one YAML file (or Python object) describes a whole study.

An :class:`Experiment` holds the trace (with its transforms: ``limit``, session resampling), the hasher,
the cache (block size, capacity, policy and its parameters, tiers), the driver (``replay``, ``simulate`` or
``engine``, with its ``simulate:`` or ``engine:`` section), the model and hardware, the seed, the ``analysis``
settings applied when results are read (kvlab.analysis.runs; recorded, never part of a run id), and a
``sweep``: ``grid`` axes (every combination) and ``zip`` axes (advanced together), each keyed by the dotted
path of any field (``cache.policy``, ``cache.capacity_blocks``, ``cache.policy_params.small_ratio``,
``trace.resample_seed``, ``seed``...). :func:`expand` turns it into one validated run (an Experiment without
a sweep) per point.

Units: capacities in blocks (``capacity_blocks``), tokens (``capacity_tokens``, rounded down to whole
blocks) or GiB of KV cache for ``model`` (``capacity_gib``, 2**30 bytes, rounded down to whole blocks);
block sizes in tokens. Every mistake raises :class:`~kvlab.errors.ConfigError` with one line naming the
file, the field path, what is allowed and the value given.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kvlab.analysis.spec import AnalysisSpec
from kvlab.errors import ConfigError
from kvlab.experiment.sections import (
    CAPACITY_FIELDS,
    CacheSpec,
    EngineSpec,
    HasherSpec,
    Section,
    TraceSpec,
    later_left_out,
)
from kvlab.schema import (
    ExperimentName,
    Schema,
    Seed,
    _describe,
    _metadata,
)

DRIVERS = ("replay", "simulate", "engine")
#: fields of the simulator (kvlab.sim.SimConfig) an experiment may set under ``simulate:``
SIM_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "rate", "time_scale",
              "tensor_parallel", "dtype", "kv_dtype", "cache_at", "fast_forward", "instances", "router",
              "load_or_recompute", "tier_overlap", "tier_prefetch", "prefetch_timeout_s", "kv_layout")
#: the most sweep points an experiment may have unless raised (``kvlab run --max-points``, ``max_points=``)
MAX_POINTS = 100_000
#: names an experiment may not take: each is a folder (or file) kvlab writes under RESULTS itself, or one its
#: figures folder ``RESULTS/figures/<name>/`` would share -> what it is (compared case-insensitively)
RESERVED_NAMES = {
    "figures": "RESULTS/figures/ is the figures root (kvlab run, kvlab figures)",
    "quick": "RESULTS/figures/quick/ is the figures root of quick runs",
    "runs": "runs/ holds the runs of a results folder",
    "demo": "RESULTS/demo/ is kvlab demo's folder",
    "calibration": "RESULTS/calibration/ holds kvlab calibrate's profiles",
    "layout_study": "RESULTS/layout_study/ is kvlab layout-study's folder",
    "tiers_serving": "RESULTS/tiers_serving/ is the tier serving study's folder",
    "tiers_serving_quick": "RESULTS/tiers_serving_quick/ is the tier serving study's quick folder",
    "manifest.json": "manifest.json is a results folder's manifest",
    "sweep.parquet": "sweep.parquet is a results folder's table",
    "sweep.csv": "sweep.csv is a results folder's table",
}


class Experiment(Schema):
    """A study: everything one run needs, plus the ``sweep`` axes (see the module docstring)."""

    label: ClassVar[str | None] = "experiment"
    name: ExperimentName
    description: str = ""
    trace: TraceSpec
    hasher: HasherSpec = Field(default_factory=HasherSpec)
    cache: CacheSpec
    driver: Literal["replay", "simulate", "engine"] = "replay"
    model: str | None = None  # a model profile (kvlab.profiles): capacity_gib, tier sizes, the simulator
    hardware: str | None = None  # a hardware profile (simulate; default h100)
    seed: Seed = 0
    simulate: dict = Field(default_factory=dict)  # SimConfig fields (rate, max_num_seqs...), driver simulate
    engine: EngineSpec | None = None  # driver engine (None: EngineSpec's defaults)
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)  # applied when results are read; not in run ids
    sweep: Sweep = Field(default_factory=lambda: Sweep())

    _LATER_IN_DUMPS: ClassVar[dict[str, Any]] = {"engine": None, "analysis": AnalysisSpec().model_dump()}  # Section

    @field_validator("name")
    @classmethod
    def _name_not_reserved(cls, value: str) -> str:
        why = RESERVED_NAMES.get(value.lower())
        if why is not None:
            raise ValueError(f"{value!r} is reserved ({why}); choose another name (reserved: "
                             f"{', '.join(RESERVED_NAMES)})")
        return value

    def __init__(self, **data: Any) -> None:
        try:
            BaseModel.__init__(self, **data)
        except ValidationError as exc:
            raise ConfigError(validation_message(exc)) from None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> object:
        return later_left_out(self, handler(self))

    @field_validator("model")
    @classmethod
    def _model_known(cls, value: str | None) -> str | None:
        if value is not None:
            from kvlab.profiles import load_model

            load_model(value)
        return value

    @field_validator("hardware")
    @classmethod
    def _hardware_known(cls, value: str | None) -> str | None:
        if value is not None:
            from kvlab.profiles import load_hardware

            load_hardware(value)
        return value

    @field_validator("simulate")
    @classmethod
    def _sim_fields(cls, value: dict) -> dict:
        unknown = sorted(set(value) - set(SIM_FIELDS))
        if unknown:
            raise ValueError(f"unknown simulator field {unknown[0]!r}; allowed: {', '.join(SIM_FIELDS)}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Experiment:
        if self.driver == "engine":
            self._engine_checks()
        if self.cache.capacity_gib is not None and self.model is None:
            raise ValueError("cache.capacity_gib: GiB of KV need a model (model: llama-3-8b, or a config.json)")
        if any(t.capacity_gib is not None for t in self.cache.tiers) and self.model is None:
            raise ValueError("cache.tiers: a tier sized in GiB needs a model (model: ...)")
        if self.simulate and self.driver != "simulate":
            raise ValueError(f"simulate: simulator fields need driver: simulate (driver is {self.driver!r})")
        if self.hardware is not None and self.driver != "simulate":
            raise ValueError("hardware: only the simulator uses it (driver: simulate)")
        if self.engine is not None and self.driver != "engine":
            raise ValueError(f"engine: engine fields need driver: engine (driver is {self.driver!r})")
        if self.driver == "engine" and self.engine is None:
            self.engine = EngineSpec()
        return self

    def _engine_checks(self) -> None:
        """What the engine driver cannot take, each naming the field to use instead."""
        if self.model is not None:
            raise ValueError("model: the engine driver's model is engine.model (a shape such as tiny-llama, a "
                             "config.json or a local checkpoint folder)")
        if self.cache.capacity_gib is not None:
            raise ValueError("cache.capacity_gib: the engine driver's pool is sized in blocks: give "
                             "cache.capacity_blocks or cache.capacity_tokens")
        if any(t.capacity_gib is not None for t in self.cache.tiers):
            raise ValueError("cache.tiers: the engine driver sizes its tiers in blocks (capacity_blocks)")
        if self.cache.mode != "vllm":
            raise ValueError("cache.mode: the engine computes at least one token per request: only 'vllm', got "
                             f"{self.cache.mode!r}")
        if self.cache.verify:
            raise ValueError("cache.verify: the replay's self-check; the engine's oracle is engine.verify")


class Sweep(Section):
    """Sweep axes, each ``dotted.field.path: [values]``: ``grid`` takes every combination, ``zip`` advances
    its axes together (equal lengths); the points are grid x zip."""

    grid: dict[str, list] = Field(default_factory=dict)
    zip: dict[str, list] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _axes(self) -> Sweep:
        for kind in ("grid", "zip"):
            for path, values in getattr(self, kind).items():
                check_path(path, f"sweep.{kind}")
                if not values:
                    raise ValueError(f"sweep.{kind}.{path}: give at least one value")
        both = set(self.grid) & set(self.zip)
        if both:
            raise ValueError(f"sweep: {sorted(both)[0]!r} is both a grid and a zip axis")
        lengths = {len(v) for v in self.zip.values()}
        if len(lengths) > 1:
            raise ValueError(f"sweep.zip: every axis needs the same number of values, got "
                             f"{', '.join(f'{k}: {len(v)}' for k, v in self.zip.items())}")
        return self


Experiment.model_rebuild()

#: sweepable top-level fields (``name``, ``description``, ``analysis`` and ``sweep`` itself are not axes)
AXIS_ROOTS = tuple(f for f in Experiment.model_fields if f not in ("name", "description", "analysis", "sweep"))
_SECTIONS = {"trace": TraceSpec, "hasher": HasherSpec, "cache": CacheSpec, "engine": EngineSpec,
             "analysis": AnalysisSpec}


def check_path(path: str, where: str) -> None:
    """A sweep axis names a field: ``seed``, ``cache.policy``, ``cache.policy_params.<name>``, ``simulate.<f>``."""
    parts = path.split(".")
    if parts[0] not in AXIS_ROOTS:
        raise ValueError(f"{where}: unknown field {path!r}; allowed: {', '.join(AXIS_ROOTS)} and their fields "
                         "(e.g. cache.policy, cache.capacity_blocks, cache.policy_params.<name>)")
    section = _SECTIONS.get(parts[0])
    if section is not None and len(parts) > 1 and parts[1] not in section.model_fields:
        raise ValueError(f"{where}: unknown field {path!r}; {parts[0]} has {', '.join(section.model_fields)}")
    if section is not None and len(parts) > 2 and parts[1] != "policy_params":
        raise ValueError(f"{where}: {path!r} goes inside {parts[0]}.{parts[1]}, which has no named fields")
    if section is None and len(parts) > 1 and parts[0] != "simulate":
        raise ValueError(f"{where}: {parts[0]} has no fields; sweep {parts[0]!r} itself")


def validation_message(exc: ValidationError) -> str:
    """One line for the first problem: ``field.path: what is allowed, got X`` (path dotted, from the root)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    info = None
    if len(loc) >= 2 and loc[0] in _SECTIONS:
        info = _SECTIONS[loc[0]].model_fields.get(loc[1])
    elif loc:
        info = Experiment.model_fields.get(loc[0])
    text = _describe(err, _metadata(info))
    if text.startswith("Value error, "):
        text = text[len("Value error, "):]
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if not loc or text.startswith((*(f"{r}." for r in AXIS_ROOTS), f"{loc[0]}.", f"{'.'.join(loc)}:")):
        return text + more
    return f"{'.'.join(loc)}: {text}{more}"


# ----------------------------------------------------------------------------- files
def load_experiment(path: str | os.PathLike) -> Experiment:
    """Read and validate an experiment YAML file; ConfigError starting with the file's path. The file must be a
    regular file (a FIFO or device is refused at once, kvlab.inputs) and no mapping may give a key twice."""
    from kvlab.inputs import parse_yaml, read_text

    path = Path(path)
    data = parse_yaml(read_text(path, "experiment file"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment file is a mapping (name:, trace:, cache:, ...), got "
                          f"{type(data).__name__}")
    for section, field in (("trace", "path"), ("engine", "model")):  # relative to the file's folder first
        part = data.get(section)
        if isinstance(part, dict) and isinstance(part.get(field), str):
            candidate = path.parent / part[field]
            if not Path(part[field]).is_absolute() and candidate.exists():
                data = {**data, section: {**part, field: str(candidate)}}
    try:
        experiment = Experiment(**data)
        check_tokenizers(experiment)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return experiment


def check_tokenizers(experiment: Experiment) -> None:
    """ConfigError naming ``trace.tokenizer`` (or its sweep axis) unless every tokenizer the experiment names is
    here (kvlab.workload.tokenizer.check_spec: a missing ``tekken`` names ``kvlab tokenizer fetch tekken``);
    checked without loading, before any run."""
    from kvlab.workload.tokenizer import check_spec

    specs = {("trace.tokenizer", experiment.trace.tokenizer)}
    for kind, axes in (("grid", experiment.sweep.grid), ("zip", experiment.sweep.zip)):
        values = axes.get("trace.tokenizer") or []
        specs.update((f"sweep.{kind}.trace.tokenizer", v) for v in values if isinstance(v, str))
    for field, spec in sorted(specs, key=lambda fs: (fs[0], str(fs[1]))):
        if spec is not None:
            try:
                check_spec(spec)
            except ConfigError as exc:
                raise ConfigError(f"{field}: {exc}") from None


# ----------------------------------------------------------------------------- sweeps
def _set(data: dict, path: str, value: object) -> None:
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"sweep axis {path!r}: {part} is not a mapping")
    if len(parts) == 2 and parts[0] == "cache" and parts[1] in CAPACITY_FIELDS:
        for other in CAPACITY_FIELDS:  # an axis in one unit replaces a capacity given in another
            node.pop(other, None)
    node[parts[-1]] = value


def count_points(sweep: Sweep) -> int:
    """How many points ``sweep`` has (the product of the grid axes' lengths times the zip length), counted
    without listing them."""
    return math.prod(len(v) for v in sweep.grid.values()) * (len(next(iter(sweep.zip.values()))) if sweep.zip else 1)


def check_size(sweep: Sweep, max_points: int = MAX_POINTS, source: str | None = None) -> int:
    """The number of points of ``sweep`` (:func:`count_points`); ConfigError naming ``sweep.grid`` (or
    ``sweep.zip``), each axis's length and the count when it exceeds ``max_points``, before anything is
    expanded."""
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise ConfigError(f"max_points (--max-points): must be a whole number >= 1, got {max_points!r}")
    n = count_points(sweep)
    if n <= max_points:
        return n
    axes = [f"{k} ({len(v):,})" for k, v in sweep.grid.items()]
    if sweep.zip:
        axes.append(f"sweep.zip ({len(next(iter(sweep.zip.values()))):,} positions)")
    what = "sweep.grid" if sweep.grid else "sweep.zip"
    raise ConfigError(f"{source + ': ' if source else ''}{what}: {' x '.join(axes)} make {n:,} points, more than "
                      f"the limit of {max_points:,}; sweep fewer values, or raise the limit with --max-points {n} "
                      "(max_points=) if you mean it")


def iter_points(sweep: Sweep) -> Iterator[dict]:
    """The sweep's points in order, one at a time, each ``{axis path: value}``: grid combinations (first axis
    slowest), each with every zip position."""
    grid_axes = list(sweep.grid.items())
    zipped = list(zip(*sweep.zip.values(), strict=True)) if sweep.zip else [()]
    for combo in itertools.product(*(values for _, values in grid_axes)):
        for z in zipped:
            yield {**dict(zip([k for k, _ in grid_axes], combo, strict=True)), **dict(zip(sweep.zip, z, strict=True))}


def points(sweep: Sweep, max_points: int = MAX_POINTS) -> list[dict]:
    """:func:`iter_points` as a list (ConfigError first when there are more than ``max_points``)."""
    check_size(sweep, max_points)
    return list(iter_points(sweep))


def expand(experiment: Experiment, source: str | None = None, *,
           max_points: int = MAX_POINTS) -> list[tuple[dict, Experiment]]:
    """``(point, run)`` per sweep point: ``run`` is the experiment with the point's values set and no sweep,
    validated (ConfigError naming the file, the point and the field). The points are counted first
    (:func:`check_size`: more than ``max_points`` is refused before any is made)."""
    check_size(experiment.sweep, max_points, source)
    base = experiment.model_dump(mode="python", exclude={"sweep"})
    out = []
    for i, point in enumerate(iter_points(experiment.sweep)):
        data = copy.deepcopy(base)
        for path, value in point.items():
            _set(data, path, value)
        try:
            out.append((point, Experiment(**data)))
        except ConfigError as exc:
            where = ", ".join(f"{k}={v!r}" for k, v in point.items())
            raise ConfigError(f"{source + ': ' if source else ''}sweep point {i + 1} ({where}): {exc}") from None
    return out


__all__ = ["DRIVERS", "MAX_POINTS", "RESERVED_NAMES", "SIM_FIELDS", "AnalysisSpec", "Experiment", "Sweep",
           "check_size", "check_tokenizers", "count_points", "expand", "iter_points", "load_experiment", "points"]
