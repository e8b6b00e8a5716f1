"""Policy parameters: every registered policy's declared types and bounds are checked at construction
(and by resolved_policy_params), with one-line ConfigErrors naming the policy, the parameter, the allowed
values and the value. Policies are discovered from the registry; bounds are read from the declarations."""

from __future__ import annotations

import json
import math
import re
import tracemalloc
import types
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import Field
from pydantic.fields import FieldInfo

from kvlab.errors import ConfigError
from kvlab.policies import EvictionPolicy, available_policies, make_policy, register_policy
from kvlab.policies import base as policy_base
from kvlab.policies.base import PolicyParam, parameters_markdown, policy_params, resolved_policy_params

POLICIES = available_policies()
BOUNDS = (at.Gt, at.Ge, at.Lt, at.Le)
DOC = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def declared() -> list[tuple[str, PolicyParam]]:
    return [(name, p) for name in POLICIES for p in policy_params(name).values() if p.declared]


def numeric_members(tp: object, bounds: tuple = ()) -> list[tuple[type, tuple]]:
    """The int and float members of a declared type at its top level (through ``Annotated`` and unions,
    not into lists or dicts), each with its bounds (annotated_types Gt/Ge/Lt/Le)."""
    origin = get_origin(tp)
    if origin is Annotated:
        found = list(bounds)
        for m in tp.__metadata__:
            found += [b for b in (m.metadata if isinstance(m, FieldInfo) else [m]) if isinstance(b, BOUNDS)]
        return numeric_members(get_args(tp)[0], tuple(found))
    if origin is Union or origin is types.UnionType:
        return [m for a in get_args(tp) for m in numeric_members(a, bounds)]
    if tp in (int, float):
        return [(tp, bounds)]
    return []


def members(tp: object) -> list[object]:
    """The types a declared type's top level accepts (through ``Annotated`` and unions)."""
    if get_origin(tp) is Annotated:
        return members(get_args(tp)[0])
    if get_origin(tp) is Union or get_origin(tp) is types.UnionType:
        return [m for a in get_args(tp) for m in members(a)]
    return [tp]


def numeric() -> list[tuple[str, str, type, tuple]]:
    return [(name, p.name, kind, bounds) for name, p in declared() for kind, bounds in numeric_members(p.annotation)]


def edge_cases() -> list[tuple[str, str, object, object]]:
    """(policy, parameter, refused value just outside a bound, accepted value just inside it)."""
    out = []
    for name, param, kind, bounds in numeric():
        for b in bounds:
            value = getattr(b, type(b).__name__.lower())  # Gt(gt=0).gt
            if kind is float:
                value = float(value)
                down, up = math.nextafter(value, -math.inf), math.nextafter(value, math.inf)
            else:
                down, up = value - 1, value + 1
            bad, good = {at.Ge: (down, value), at.Gt: (value, up), at.Le: (up, value), at.Lt: (value, down)}[type(b)]
            out.append((name, param, bad, good))
    return out


def refuses(policy: str, params: dict, match: str) -> str:
    """Both make_policy and resolved_policy_params refuse ``params`` with a one-line ConfigError."""
    with pytest.raises(ConfigError, match=match) as got:
        make_policy(policy, **params)
    message = str(got.value)
    assert "\n" not in message
    with pytest.raises(ConfigError, match=match):
        resolved_policy_params(policy, params)
    return message


# ---------------------------------------------------------------------- over the registry


@pytest.mark.parametrize("name", POLICIES)
def test_defaults_construct(name):
    policy = make_policy(name)
    assert isinstance(policy, EvictionPolicy) and policy.name == name
    assert isinstance(type(policy)(), EvictionPolicy)  # the class directly, too


@pytest.mark.parametrize("name", POLICIES)
def test_unknown_parameter_refused_naming_policy_and_parameter(name):
    refuses(name, {"no_such_param": 1}, rf"^policy '{re.escape(name)}': unknown parameter 'no_such_param' \(accepted: ")


@pytest.mark.parametrize(("name", "param"), [(n, p) for n, p, kind, _ in numeric() if kind is float])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_parameters_refuse_nan_and_inf(name, param, value):
    message = refuses(name, {param: value}, rf"^policy '{re.escape(name)}': parameter '{param}' must be ")
    assert message.endswith(f"got {value!r}")


@pytest.mark.parametrize(("name", "param", "bad", "good"), edge_cases())
def test_bound_refused_just_outside_accepted_just_inside(name, param, bad, good):
    message = refuses(name, {param: bad}, rf"^policy '{re.escape(name)}': parameter '{param}' must be ")
    assert message.endswith(f"got {bad!r}")
    make_policy(name, **{param: good})
    assert resolved_policy_params(name, {param: good})[param] == good


def test_every_number_has_a_lower_bound_and_the_open_ended_are_known():
    """The numbers without an upper bound: times and a half-life (any finite size is harmless) and clock's
    ``init_freq`` (bounded by ``2**bits - 1`` in __init__)."""
    assert all(any(isinstance(b, at.Gt | at.Ge) for b in bounds) for *_, bounds in numeric())
    open_ended = {(n, p) for n, p, _, bounds in numeric() if not any(isinstance(b, at.Lt | at.Le) for b in bounds)}
    assert open_ended == {("clock", "init_freq"), ("lfu-halflife", "half_life"), ("trtllm-priority", "duration_s"),
                          ("ttl", "ttl_s"), ("workload-aware", "life_s")}


@pytest.mark.parametrize(("name", "param", "kind"), [
    (n, p.name, k) for n, p in declared() for k, _ in numeric_members(p.annotation)
    if set(members(p.annotation)) <= {int, float, type(None)}])
@pytest.mark.parametrize("value", ["abc", [1], {"a": 1}, True, False])
def test_ill_typed_numbers_refused(name, param, kind, value):
    refuses(name, {param: value}, rf"^policy '{re.escape(name)}': parameter '{param}' must be ")
    if kind is int:
        refuses(name, {param: 2.5}, rf"^policy '{re.escape(name)}': parameter '{param}' must be an integer")


@pytest.mark.parametrize("name", POLICIES)
def test_resolved_params_are_plain_json_and_rebuild_the_policy(name):
    resolved = resolved_policy_params(name)
    assert set(resolved) == set(policy_params(name)) or name == "prefix-aware"
    assert json.loads(json.dumps(resolved, allow_nan=False)) == resolved
    make_policy(name, **resolved)


@pytest.mark.parametrize(("name", "params", "expected"), [
    ("slru", {"segments": (0.2, 0.8)}, {"segments": [0.2, 0.8]}),
    ("slru", {"segments": 3.0}, {"segments": 3}),
    ("ttl", {"ttl_s": 10, "by_category": {"a": 1, 7: 2.5}}, {"ttl_s": 10.0, "by_category": {"a": 1.0, "7": 2.5}}),
    ("trtllm-priority", {"priorities": [(0, 4, 90), (4, None, 10, 2.5)]},
     {"priorities": [[0, 4, 90], [4, None, 10, 2.5]], "default": 35, "duration_s": None, "by_category": None}),
    ("prefix-aware", {"inner": "slru", "inner_params": {"segments": [1, 3]}},
     {"inner": "slru", "inner_params": {"segments": [1.0, 3.0]}}),
    ("prefix-aware", {"inner": "lfu"}, {"inner": "lfu", "inner_params": {}}),
])
def test_resolved_params_are_canonical(name, params, expected):
    resolved = resolved_policy_params(name, params)
    assert {k: resolved[k] for k in expected} == expected
    assert json.loads(json.dumps(resolved, allow_nan=False)) == resolved


# ---------------------------------------------------------------------- nested values and cross checks


@pytest.mark.parametrize(("name", "params"), [
    ("slru", {"segments": []}),
    ("slru", {"segments": [1.0] * 65}),
    ("slru", {"segments": [0.2, math.nan]}),
    ("slru", {"segments": [0.2, math.inf]}),
    ("slru", {"segments": [0.0, 1.0]}),
    ("slru", {"segments": [1.0, math.nextafter(1e9, math.inf)]}),
    ("ttl", {"by_category": {"a": math.nan}}),
    ("ttl", {"by_category": {"a": -1.0}}),
    ("ttl", {"by_category": [1.0]}),
    ("trtllm-priority", {"priorities": [(0, 4, 90, math.inf)]}),
    ("trtllm-priority", {"priorities": [(0, 4, 101)]}),
    ("trtllm-priority", {"priorities": [(-1, 4, 90)]}),
    ("trtllm-priority", {"priorities": [(0, 2**31 + 1, 90)]}),
    ("trtllm-priority", {"priorities": [(4, 2, 90)]}),
    ("trtllm-priority", {"priorities": [(0, 4)]}),
    ("trtllm-priority", {"by_category": {"x": [(0, 1, 50, math.nan)]}}),
    ("prefix-aware", {"inner": "nope"}),
    ("prefix-aware", {"inner": 3}),
    ("prefix-aware", {"inner_params": [1]}),
    ("slru", {"segments": [1.0, True]}),
    ("trtllm-priority", {"priorities": [(0, True, 90)]}),
    ("ttl", {"by_category": {"a": True}}),
])
def test_nested_values_refused(name, params):
    param = next(iter(params))
    refuses(name, params, rf"^policy '{re.escape(name)}': parameter '{param}' must be ")


def test_a_boolean_parameter_keeps_true_and_false():
    """A boolean is never a number, but a parameter declared boolean still takes True/False."""
    from kvlab.policies.lru import LRU

    class Flagged(LRU):
        def __init__(self, flag: Annotated[bool, Field()] = False,
                     n: Annotated[int, Field(ge=0)] = 1) -> None:
            super().__init__()
            self.flag = flag

    register_policy("test-flagged", replace=True)(Flagged)
    try:
        assert make_policy("test-flagged", flag=True).flag is True
        assert resolved_policy_params("test-flagged", {"flag": False}) == {"flag": False, "n": 1}
        refuses("test-flagged", {"n": True}, r"^policy 'test-flagged': parameter 'n' must be ")
    finally:
        policy_base._REGISTRY.pop("test-flagged", None)


def test_nested_bounds_accepted_just_inside():
    assert len(make_policy("slru", segments=[1.0] * 64).fractions) == 64
    assert make_policy("slru", segments=[5e-324, 1e9]).n_seg == 2
    assert make_policy("ttl", by_category={"a": 0.0}).by_category == {"a": 0.0}
    pol = make_policy("trtllm-priority", priorities=[(0, 2**31, 100, 0.0)], by_category={"x": [(2**31 - 1, None, 0)]})
    assert pol.ranges == [(0, 2**31, 100, 0.0)]
    assert pol.by_category == {"x": [(2**31 - 1, None, 0, None)]}


def test_cross_parameter_checks_in_one_line():
    message = refuses_construct("clock", {"bits": 2, "init_freq": 4})
    assert message == "policy 'clock': parameter 'init_freq' must be an integer in [0, 2**bits - 1] = [0, 3], got 4"
    assert make_policy("clock", bits=2, init_freq=3).init_freq == 3


def refuses_construct(name: str, params: dict) -> str:
    with pytest.raises(ConfigError) as got:
        make_policy(name, **params)
    assert "\n" not in str(got.value)
    return str(got.value)


def test_prefix_aware_inner_params_checked_by_the_inner_policy():
    message = refuses_construct("prefix-aware", {"inner": "slru", "inner_params": {"segments": 10**9}})
    assert message.startswith("policy 'prefix-aware': inner policy 'slru': parameter 'segments' must be an integer "
                              "in [1, 64]")
    message = refuses_construct("prefix-aware", {"inner": "ttl", "inner_params": {"ttl": 1}})
    assert message.startswith("policy 'prefix-aware': inner policy 'ttl': unknown parameter 'ttl'")
    with pytest.raises(ConfigError, match="^policy 'prefix-aware': inner policy 'wtinylfu': parameter 'max_count'"):
        resolved_policy_params("prefix-aware", {"inner": "wtinylfu", "inner_params": {"max_count": 0}})
    for value in (math.nan, math.inf):  # the value as given, not as JSON would spell it
        with pytest.raises(ConfigError, match=f"^policy 'prefix-aware': inner policy 'ttl': .* got {value}$"):
            resolved_policy_params("prefix-aware", {"inner": "ttl", "inner_params": {"ttl_s": value}})
    pol = make_policy("prefix-aware", inner="slru", inner_params={"segments": [1, 3]})
    assert pol.inner.fractions == [0.25, 0.75]


def test_direct_construction_is_checked_positional_too():
    from kvlab.policies.clock import Clock
    from kvlab.policies.slru import SLRU

    with pytest.raises(ConfigError, match="^policy 'slru': parameter 'segments'"):
        SLRU(10**9)
    with pytest.raises(ConfigError, match="^policy 'clock': parameter 'bits'"):
        Clock(0)
    with pytest.raises(ConfigError, match="^policy 'clock': "):
        Clock(1, 0, 5)
    assert SLRU((1, 1)).fractions == [0.5, 0.5]


# ---------------------------------------------------------------------- the tester's case, speed


def test_slru_huge_segment_count_refused_without_allocating():
    tracemalloc.start()
    try:
        for _ in range(3):
            with pytest.raises(ConfigError, match=r"segments' must be an integer in \[1, 64\].*got 1000000000$"):
                make_policy("slru", segments=10**9)
            with pytest.raises(ConfigError, match="got 1000000000$"):
                resolved_policy_params("slru", {"segments": 10**9})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # refused before anything of that size is allocated (no time decides a pass)


# ---------------------------------------------------------------------- plugins


@pytest.fixture
def registered():
    """Register test plugins; unregistered afterwards."""
    names = []

    def reg(name: str, cls: type) -> type:
        names.append(name)
        return register_policy(name)(cls)

    yield reg
    for name in names:
        cls = policy_base._REGISTRY.pop(name)
        policy_base._PARAMS.pop(cls, None)


def test_plain_plugin_without_annotations_works_unchanged(registered):
    class Plain(EvictionPolicy):
        def __init__(self, x=1.0, y=None):
            self.x, self.y = x, y

        def __len__(self):
            return 0

    init = Plain.__init__
    registered("test-plain", Plain)
    assert Plain.__init__ is init  # not wrapped
    payload = object()
    pol = make_policy("test-plain", x=math.nan, y=payload)  # no bounds it does not declare
    assert math.isnan(pol.x) and pol.y is payload
    assert resolved_policy_params("test-plain") == {"x": 1.0, "y": None}
    assert resolved_policy_params("test-plain", {"x": 2}) == {"x": 2, "y": None}
    refuses("test-plain", {"z": 1}, r"^policy 'test-plain': unknown parameter 'z' \(accepted: x, y\)$")
    assert all(not p.declared and p.allowed == "any value" for p in policy_params("test-plain").values())


def test_plugin_with_plain_hints_is_not_bounded(registered):
    class Hinted(EvictionPolicy):
        def __init__(self, rate: float = 0.5, names: list[str] | None = None) -> None:
            self.rate, self.names = rate, names

    registered("test-hinted", Hinted)
    assert math.isinf(make_policy("test-hinted", rate=math.inf).rate)
    assert make_policy("test-hinted", names=("a",)).names == ("a",)  # passed as given, not coerced


def test_plugin_with_var_kwargs(registered):
    class Kw(EvictionPolicy):
        def __init__(self, **params):
            self.params = params

    registered("test-kw", Kw)
    assert make_policy("test-kw", anything=1).params == {"anything": 1}
    assert resolved_policy_params("test-kw", {"a": 1}) == {"a": 1}


def test_plugin_may_declare_bounds(registered):
    class Declared(EvictionPolicy):
        def __init__(self, k: Annotated[int, Field(ge=1, le=8)] = 2, free=None) -> None:
            self.k, self.free = k, free

    registered("test-declared", Declared)
    assert make_policy("test-declared", k=8, free=math.nan).k == 8
    message = refuses("test-declared", {"k": 9}, "^policy 'test-declared'")
    assert message == "policy 'test-declared': parameter 'k' must be an integer in [1, 8], got 9"
    assert policy_params("test-declared")["k"].allowed == "an integer in [1, 8]"


# ---------------------------------------------------------------------- docs


def test_docs_table_matches_the_declarations():
    text = DOC.read_text()
    begin, end = "<!-- parameters table: begin -->\n", "<!-- parameters table: end -->"
    assert begin in text and end in text
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table.strip() == parameters_markdown().strip(), (
        "docs/policies.md is stale: paste the output of "
        "python -c 'from kvlab.policies.base import parameters_markdown; print(parameters_markdown())'")
