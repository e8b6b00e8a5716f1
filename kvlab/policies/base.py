"""The eviction-policy interface (docs/semantics.md, "Eviction policy interface") and the policy registry.

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

import functools
import inspect
import types
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import annotated_types as at
import numpy as np
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticSerializationError

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError


class EvictionPolicy:
    """Base class: override the hooks a policy needs; ``victim`` and ``__len__`` are required."""

    name: ClassVar[str] = "base"
    #: one-line provenance shown in docs and results
    source: ClassVar[str] = ""
    #: True for a policy that reads the trace's future (``prepare`` with the workload): usable on the device
    #: of a replay or simulation, not on a lower tier (a tier's accesses are not the trace's requests)
    offline: ClassVar[bool] = False
    #: numba twin of the hooks (kvlab.cache.compiled), or None: the replay then uses the Python core
    compiled: ClassVar[CompiledPolicy | None] = None

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        """Hook of :func:`resolved_policy_params`: ``params`` (checked, defaults filled in; converted to
        plain JSON values afterwards) as a run's identity records them; a wrapper resolves its inner
        policy's parameters here."""
        return params

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

# ---------------------------------------------------------------------- declared parameters
# A policy declares a constructor parameter by annotating it ``Annotated[type, Field(bounds...)]`` (pydantic);
# ``register_policy`` then checks every such argument before the constructor runs. Floats anywhere in a
# declared type (nested in lists and dicts too) must be finite. Undeclared parameters (a plain hint or
# none) are passed through unchecked, so a plain plugin keeps working unchanged.

#: how declared parameters are validated: every float must be finite; instances (``inner``) allowed
PARAM_CONFIG = ConfigDict(allow_inf_nan=False, arbitrary_types_allowed=True)
_BOUNDS = (at.Gt, at.Ge, at.Lt, at.Le)
#: the default of a parameter without one
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class PolicyParam:
    """One constructor parameter of a registered policy, as the framework reads it."""

    name: str
    default: object  # REQUIRED when the constructor gives none
    annotation: object = None  # the declared type (``Annotated[...]``); None when undeclared
    allowed: str = "any value"  # the allowed values in words (messages, docs/policies.md)
    adapter: TypeAdapter | None = field(default=None, repr=False, compare=False)

    @property
    def declared(self) -> bool:
        return self.adapter is not None

    def check(self, policy: str, value: object) -> object:
        """``value`` as the constructor gets it (pydantic's lax coercion: ints to floats, tuples to lists);
        ConfigError naming the policy, the parameter, the allowed values and ``value`` otherwise."""
        if self.adapter is None:
            return value
        if bool_for_number(self.annotation, value):
            raise param_error(policy, self.name, self.allowed, value)
        try:
            return self.adapter.validate_python(value)
        except ValidationError:
            raise param_error(policy, self.name, self.allowed, value) from None

    def plain(self, value: object) -> object:
        """A checked ``value`` as plain JSON values (tuples as lists); undeclared values as given."""
        if self.adapter is None:
            return value
        try:
            return self.adapter.dump_python(value, mode="json")
        except PydanticSerializationError:  # e.g. a policy instance given as prefix-aware's ``inner``
            return value


def _members(tp: object) -> list[object]:
    """The alternatives of ``tp`` (inside ``Annotated`` and unions)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def bool_for_number(tp: object, value: object) -> bool:
    """Whether ``value`` holds a boolean (at the top or inside lists and mappings) where the declared type
    ``tp`` takes a number and no boolean (a boolean is never a number: pydantic's lax mode would take ``True``
    as 1; the rule of :func:`kvlab.schema.refuse_bool_numbers`). A parameter that is boolean keeps True/False."""
    from kvlab.schema import _number_kind

    if isinstance(value, bool):
        return _number_kind(tp) is not None
    if isinstance(value, list | tuple | dict):
        seq = isinstance(value, list | tuple)
        inner = [get_args(m)[0 if seq else -1] for m in _members(tp) if get_args(m)
                 and get_origin(m) in ((list, tuple, Sequence) if seq else (dict,))]
        items = value if seq else value.values()  # type: ignore[union-attr]
        return bool(inner) and any(all(bool_for_number(t, v) for t in inner) for v in items)
    return False


def param_error(policy: str, param: str, allowed: str, value: object) -> ConfigError:
    """The one-line error for a refused parameter value."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return ConfigError(f"policy {policy!r}: parameter {param!r} must be {allowed}, got {text}")


def _num(x: object) -> str:
    return repr(x) if isinstance(x, float) else str(x)


def _bounded(noun: str, bounds: list) -> str:
    lo = next((b for b in bounds if isinstance(b, at.Gt | at.Ge)), None)
    hi = next((b for b in bounds if isinstance(b, at.Lt | at.Le)), None)
    if lo is not None and hi is not None:
        left = "(" if isinstance(lo, at.Gt) else "["
        right = ")" if isinstance(hi, at.Lt) else "]"
        lo_v = lo.gt if isinstance(lo, at.Gt) else lo.ge
        hi_v = hi.lt if isinstance(hi, at.Lt) else hi.le
        return f"{noun} in {left}{_num(lo_v)}, {_num(hi_v)}{right}"
    if lo is not None:
        return f"{noun} > {_num(lo.gt)}" if isinstance(lo, at.Gt) else f"{noun} >= {_num(lo.ge)}"
    if hi is not None:
        return f"{noun} < {_num(hi.lt)}" if isinstance(hi, at.Lt) else f"{noun} <= {_num(hi.le)}"
    return noun


def _metadata(meta: Sequence) -> tuple[str | None, list]:
    """(description, bounds) of an ``Annotated`` type's metadata."""
    description, bounds = None, []
    for m in meta:
        if isinstance(m, FieldInfo):
            description = description or m.description
            bounds += [b for b in m.metadata if isinstance(b, _BOUNDS)]
        elif isinstance(m, _BOUNDS):
            bounds.append(m)
    return description, bounds


def describe(tp: object) -> str:
    """The values a declared type allows, in words: ``Field(description=...)`` if given, else derived
    from the type and its bounds (``an integer in [1, 64]``, ``a finite number > 0``)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        description, bounds = _metadata(tp.__metadata__)  # type: ignore[attr-defined]
        return description or _bounded(describe(args[0]), bounds)
    if origin is Union or origin is types.UnionType:
        text = " or ".join(describe(a) for a in args if a is not type(None))
        return text + " or None" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple, Sequence) and args:
        return f"a list of items each {describe(args[0])}"
    if origin is dict and len(args) == 2:
        return f"a mapping from {describe(args[0])} to {describe(args[1])}"
    names = {int: "an integer", float: "a finite number", str: "a string", bool: "True or False"}
    return names.get(tp, f"a {getattr(tp, '__name__', tp)}")  # type: ignore[call-overload]


def _is_declared(hint: object) -> bool:
    """Whether ``hint`` holds, anywhere, an ``Annotated`` with pydantic ``Field`` or bounds metadata."""
    meta = hint.__metadata__ if get_origin(hint) is Annotated else ()  # type: ignore[attr-defined]
    if any(isinstance(m, (FieldInfo, *_BOUNDS)) for m in meta):
        return True
    return any(_is_declared(a) for a in get_args(hint))


def _read_params(factory: Callable) -> tuple[dict[str, PolicyParam], bool]:
    """(the named parameters of ``factory``, whether it also takes ``**kwargs``)."""
    sig = inspect.signature(factory)
    init = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        hints = get_type_hints(inspect.unwrap(init), include_extras=True)
    except Exception:  # a plugin's hint that does not resolve at run time: undeclared, as before
        hints = {}
    params: dict[str, PolicyParam] = {}
    var_kw = False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind is not inspect.Parameter.VAR_POSITIONAL:
            hint = hints.get(p.name)
            if _is_declared(hint):
                adapter = TypeAdapter(hint, config=PARAM_CONFIG)
                params[p.name] = PolicyParam(p.name, p.default, hint, describe(hint), adapter)
            else:
                params[p.name] = PolicyParam(p.name, p.default)
    return params, var_kw


_PARAMS: dict[Callable, tuple[dict[str, PolicyParam], bool]] = {}


def _params_of(factory: Callable) -> tuple[dict[str, PolicyParam], bool]:
    got = _PARAMS.get(factory)
    if got is None:
        got = _PARAMS[factory] = _read_params(factory)
    return got


def policy_params(name: str) -> dict[str, PolicyParam]:
    """The constructor parameters of the registered policy ``name``, in signature order."""
    return dict(_params_of(_factory(name))[0])


def _refuse_unknown(policy: str, params: dict[str, PolicyParam], var_kw: bool, given: Iterable[str]) -> None:
    if var_kw:
        return
    unknown = sorted(set(given) - set(params))
    if unknown:
        accepted = ", ".join(params) or "none"
        raise ConfigError(f"policy {policy!r}: unknown parameter {unknown[0]!r} (accepted: {accepted})")


def _checked_init(cls: type) -> None:
    """Make ``cls.__init__`` check its declared parameters first (once per class; inherited as is)."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "__kvlab_checked__", False):
        return
    params, var_kw = _params_of(cls)
    declared = [p for p in params.values() if p.declared]
    if not declared:
        return
    sig = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: EvictionPolicy, *args: object, **kwargs: object) -> None:
        name = type(self).name
        _refuse_unknown(name, params, var_kw, kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"policy {name!r}: {exc}") from None
        arguments = bound.arguments
        for p in declared:
            if p.name in arguments:
                arguments[p.name] = p.check(name, arguments[p.name])
        init(*bound.args, **bound.kwargs)

    __init__.__kvlab_checked__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def register_policy(name: str, *, replace: bool = False) -> Callable[[type], type]:
    """Class decorator: make a policy available by ``name`` in every driver (and the CLI).

    Constructor parameters annotated ``Annotated[type, Field(...)]`` are checked at construction (types,
    bounds, finite floats), with a one-line ConfigError; other parameters are passed through unchecked.
    """

    def deco(cls: type) -> type:
        if name in _REGISTRY and not replace and _REGISTRY[name] is not cls:
            raise ConfigError(f"policy {name!r} is already registered (pass replace=True to override)")
        cls.name = name
        if isinstance(cls, type):
            _checked_init(cls)
        _REGISTRY[name] = cls
        return cls

    return deco


def _factory(name: str) -> Callable[..., EvictionPolicy]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None


def make_policy(name: str | EvictionPolicy, **params: object) -> EvictionPolicy:
    """A fresh policy instance by registered name (or pass an instance through).

    Raises ConfigError (one line) for an unknown policy, an unknown parameter or a refused value."""
    if isinstance(name, EvictionPolicy):
        return name
    factory = _factory(name)
    _refuse_unknown(name, *_params_of(factory), params)
    return factory(**params)


def resolved_policy_params(name: str | EvictionPolicy, params: dict | None = None) -> dict:
    """``params`` checked, with every constructor default filled in, as plain JSON values (the policy
    part of a run's identity).

    Raises ConfigError as :func:`make_policy` does (without constructing the policy, so checks that
    relate two parameters are left to construction). A policy instance passed directly contributes
    only the given ``params`` (its constructor arguments are not recoverable).
    """
    params = dict(params or {})
    if isinstance(name, EvictionPolicy):
        return params
    factory = _factory(name)
    declared, var_kw = _params_of(factory)
    _refuse_unknown(name, declared, var_kw, params)
    checked = {}
    for p in declared.values():
        if p.name in params:
            checked[p.name] = p.check(name, params.pop(p.name))
        elif p.default is not REQUIRED:
            checked[p.name] = p.check(name, p.default)
    checked.update(params)  # taken by ``**kwargs``: as given
    hook = getattr(factory, "resolve_params", None)
    if hook is not None:
        checked = hook(checked)
    return {k: declared[k].plain(v) if k in declared else v for k, v in checked.items()}


def parameters_markdown() -> str:
    """The table of every built-in policy's declared parameters (docs/policies.md, "Parameters"); plugins
    registered at run time (outside ``kvlab.policies``) are left out."""
    rows = ["| policy | parameter | default | allowed |", "|---|---|---|---|"]
    bare = []
    for name in available_policies():
        if not getattr(_REGISTRY[name], "__module__", "").startswith("kvlab.policies."):
            continue
        params = policy_params(name)
        if not params:
            bare.append(f"`{name}`")
        for p in params.values():
            default = "required" if p.default is REQUIRED else f"`{p.default!r}`"
            rows.append(f"| `{name}` | `{p.name}` | {default} | {p.allowed} |")
    return "\n".join(rows) + "\n\nNo parameters: " + ", ".join(bare) + ".\n"


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)
