"""One schema for every parameter a user gives kvlab: the CLI, the Python API and (later) config files.

Each configuration is a pydantic model whose field names are the names used everywhere (the CLI flag
is the field name with ``-`` for ``_``: ``capacity_blocks`` <-> ``--capacity-blocks``). Constructing
one validates every field (types, ranges, NaN/inf refused in every float) and raises
:class:`~kvlab.errors.ConfigError` with one line naming the field, its flag, the allowed range and the
value given, so bad input is refused before any work starts.

Units: capacities and block counts in blocks, sizes in tokens, rates in requests/s, times in seconds.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvlab.errors import ConfigError

#: the largest capacity kvlab accepts, in blocks (2**40 blocks of 16 tokens = 2**44 tokens). State is
#: allocated for at most the blocks a workload can use, so a large capacity costs no memory.
MAX_CAPACITY_BLOCKS = 1 << 40
#: the largest block size in tokens (vLLM's largest is 256; hash traces use up to 512)
MAX_BLOCK_SIZE = 1 << 16

PositiveInt = Annotated[int, Field(ge=1)]
CapacityBlocks = Annotated[int, Field(ge=1, le=MAX_CAPACITY_BLOCKS)]
BlockSize = Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)]
Seed = Annotated[int, Field(ge=0, lt=1 << 64)]
#: an experiment's name, also its results folder ``results/<name>`` (kvlab.experiment.config.Experiment.name;
#: kvlab.results.runs reads it from an experiment file)
ExperimentName = Annotated[str, Field(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
HashScheme = Literal["sha256", "xxh3_128", "xxh3_64", "builtin"]
CountingMode = Literal["vllm", "ideal"]
TraceFormat = Literal["mooncake", "alibaba", "jsonl", "parquet", "request-log", "messages"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)  # the trace formats kvlab reads (one list: loaders, CLI)


#: fields whose CLI flag is not simply the field name with dashes
FLAG_NAMES = {"policy_params": "--policy-param", "fast_forward": "--no-fast-forward", "tiers": "--tier"}

_BOUND_TYPES = {"greater_than_equal", "less_than_equal", "greater_than", "less_than"}
_PLAIN = {
    "int_from_float": "must be an integer",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping of names to values",
}


def flag(field: str) -> str:
    """The CLI flag of a schema field: ``capacity_blocks`` -> ``--capacity-blocks``."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def _range(metadata: list) -> str | None:
    """``[lo, hi]`` / ``(lo, hi)`` from annotated_types bounds in a field's metadata."""
    lo = hi = None
    lo_open = hi_open = False
    for m in metadata:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False),
                                     ("lt", False, True)):
            value = getattr(m, attr, None)
            if value is not None:
                if is_lo:
                    lo, lo_open = value, is_open
                else:
                    hi, hi_open = value, is_open
    if lo is None and hi is None:
        return None
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _describe(err: dict, metadata: list | None) -> str:
    kind = err.get("type", "")
    got = f", got {err['input']!r}" if "input" in err else ""
    if kind == "extra_forbidden":
        return "is not a known parameter"
    if kind == "missing":
        return "is required"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err.get("msg", "invalid")))
    if kind in _BOUND_TYPES and metadata and (span := _range(metadata)):
        return f"must be in {span}{got}"
    if kind in _PLAIN:
        return _PLAIN[kind] + got
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Input should be"):
        msg = "must be" + msg[len("Input should be"):]
    return msg + got


def config_error(exc: ValidationError, model: str, fields: dict | None = None) -> ConfigError:
    """One line for the first problem of a ValidationError: ``Model.field (--flag): must be ..., got X``."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    field = loc[0] if loc else ""
    info = (fields or {}).get(field)
    where = f"{model}.{'.'.join(loc)} ({flag(field)})" if field else model
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return ConfigError(f"{where}: {_describe(err, _metadata(info))}{more}")


def _metadata(info: Any) -> list:
    """Bound metadata of a field, looking inside ``Annotated[...] | None`` too."""
    if info is None:
        return []
    if info.metadata:
        return list(info.metadata)
    for arg in get_args(info.annotation):
        if get_origin(arg) is Annotated:
            return [m for item in arg.__metadata__ for m in getattr(item, "metadata", [item])]
    return []


def _number_kind(annotation: Any) -> str | None:
    """``"an integer"`` / ``"a number"`` when a field's annotation takes an int / a float and no bool (looking
    inside ``Annotated`` and unions), else None."""
    kinds: set[Any] = set()
    stack = [annotation]
    while stack:
        a = stack.pop()
        if get_origin(a) is Annotated:
            stack.append(get_args(a)[0])
        elif get_args(a) and get_origin(a) is not Literal and not isinstance(get_origin(a), type):
            stack.extend(get_args(a))  # a union (typing.Union or X | Y)
        else:
            kinds.add(a)
    if bool in kinds or Any in kinds or object in kinds or str in kinds:
        return None
    return "an integer" if int in kinds else "a number" if float in kinds else None


class _BoolAsNumber:
    """A boolean given for a number field: fails the field's own int/float validation, so the error keeps the
    field's location (its flag, ``--tier`` key or dotted path) and reads ``must be an integer, got True (a
    boolean)``."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{self.value} (a boolean)"


def refuse_bool_numbers(cls: type[BaseModel], data: Any) -> Any:
    """Model validator (before): a boolean is never a number. pydantic's lax mode takes ``True`` as 1 for an int
    or float field (``capacity_blocks: true`` = one block); here such a value is swapped for a marker the field's
    own validation refuses, naming the field. A model validator, not a ``"*"`` field validator, since pydantic
    refuses before-validators on a discriminated union's tag field (the workload families' ``family``). Used by
    :class:`Schema`, kvlab.experiment.sections.Section and kvlab.analysis.spec.AnalysisSpec."""
    if not isinstance(data, dict):
        return data
    bad = [name for name, value in data.items() if isinstance(value, bool) and name in cls.model_fields
           and _number_kind(cls.model_fields[name].annotation) is not None]
    return {**data, **{name: _BoolAsNumber(data[name]) for name in bad}} if bad else data


#: the validator to put in a model: ``_no_bool_numbers = NO_BOOL_NUMBERS``
NO_BOOL_NUMBERS = model_validator(mode="before")(classmethod(refuse_bool_numbers))  # type: ignore[arg-type]


class Schema(BaseModel):
    """Base of kvlab's configurations: validated at construction, ConfigError on the first bad field (a
    boolean is never accepted as a number: :func:`refuse_bool_numbers`)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", validate_default=True)
    _no_bool_numbers = NO_BOOL_NUMBERS
    #: the name used in error messages (defaults to the class name)
    label: ClassVar[str | None] = None
    #: fields added after run identities were first written -> their defaults: ``to_dict`` leaves them out while
    #: they hold those defaults, so a run that does not use them keeps its run id
    _LATER: ClassVar[dict[str, Any]] = {}

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, self.label or type(self).__name__, type(self).model_fields) from None

    def to_dict(self) -> dict:
        """Plain JSON-serialisable field values, in declaration order (``_LATER`` fields at their defaults left
        out)."""
        out = self.model_dump(mode="python")
        for name, default in self._LATER.items():
            if out.get(name) == default:
                del out[name]
        return out

    def replace(self, **changes: Any) -> Schema:
        """A validated copy with ``changes`` applied."""
        return type(self)(**{**self.to_dict(), **changes})


def validate_fields(model: str, **values: Any) -> None:
    """Check loose values against the schema's field types (``name=(type_annotation, value)``) at once.

    Used for options that are not part of a run's identity (threads, limits of a measurement grid).
    """
    fields = {name: (ann, ...) for name, (ann, _) in values.items()}
    from pydantic import create_model

    cls = create_model(f"_{model}", __config__=ConfigDict(allow_inf_nan=False), **fields)  # type: ignore[call-overload]
    try:
        cls(**{name: v for name, (_, v) in values.items()})
    except ValidationError as exc:
        raise config_error(exc, model, cls.model_fields) from None


class TraceSelection(Schema):
    """Which requests of which trace: a path or known name, its format, and the first ``limit`` requests."""

    label: ClassVar[str | None] = "trace"
    trace: Annotated[str, Field(min_length=1)]
    format: TraceFormat | None = None
    limit: PositiveInt | None = None


__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_CAPACITY_BLOCKS",
    "BlockSize",
    "CapacityBlocks",
    "CountingMode",
    "ExperimentName",
    "HashScheme",
    "PositiveInt",
    "Schema",
    "Seed",
    "TRACE_FORMATS",
    "TraceFormat",
    "TraceSelection",
    "NO_BOOL_NUMBERS",
    "config_error",
    "flag",
    "refuse_bool_numbers",
    "validate_fields",
]


def renamed_fields(data: Any) -> Any:
    """Model validator (before): old field names (kvlab.names.ALIASES, e.g. ``engine`` -> ``backend``)
    accepted under their new names."""
    from kvlab.names import canonical_keys

    return canonical_keys(data) if isinstance(data, dict) else data
