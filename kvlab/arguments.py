"""Checks of the plain arguments of kvlab's public Python functions (``replay``, ``simulate``, sweeps, curves,
engine serving, layout study).

Configs are validated by their schema (:mod:`kvlab.schema`); these checks cover what a function takes besides a
config, so a wrong type ends in one :class:`~kvlab.errors.ConfigError` naming the argument before any work,
never in an ``AttributeError`` deep inside. Invariants:

* an object argument is an instance of its class (:func:`require_instance`); ``None`` only where optional;
* an integer argument is an ``int`` (numpy integers too), never a ``bool``, a ``str`` or a float
  (:func:`require_ints`, :func:`require_int_list`); its range is the schema's annotation (one definition of
  every bound) or the caller's;
* a real argument is a finite ``int`` or ``float`` (:func:`require_real`), never a ``bool`` or ``str``;
* text is a ``str`` of valid Unicode (:func:`require_text`): a lone surrogate is refused naming the field and
  the character, never a raw ``UnicodeEncodeError`` from a tokenizer.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

import numpy as np
from pydantic import Field

from kvlab.errors import ConfigError

T = TypeVar("T")
#: a count that may be 0 (tokens, requests), for :func:`require_ints`; kvlab.schema has the positive ones
NonNegativeInt = Annotated[int, Field(ge=0)]


def kind_of(value: Any) -> str:
    """A short description of ``value``'s type for error messages: ``None``, ``a str ('x')``, ``a dict``..."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return f"a bool ({value})"
    if isinstance(value, str | os.PathLike):
        text = os.fspath(value)
        shown = text if len(text) <= 60 else text[:57] + "..."
        return f"a {'path' if isinstance(value, os.PathLike) else 'str'} ({shown!r})"
    return _a(type(value).__name__)


def _a(name: str) -> str:
    """``name`` with its indefinite article (``a dict``, ``an Engine``)."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def require_instance(value: Any, cls: type[T], argument: str, *, optional: bool = False, hint: str = "") -> T:
    """``value`` if it is a ``cls`` (or None when ``optional``); ConfigError naming ``argument`` otherwise.

    ``hint`` (e.g. ``"load it first with ..."``) ends the message."""
    if isinstance(value, cls) or (optional and value is None):
        return value
    more = f"; {hint}" if hint else ""
    raise ConfigError(f"{argument}: expected {_a(cls.__name__)}{' or None' if optional else ''}, "
                      f"got {kind_of(value)}{more}")


def require_ints(function: str, **values: tuple[Any, Any]) -> None:
    """Check integer arguments ``name=(annotation, value)``: ``value`` is None (where the annotation allows it)
    or an integer (never a bool, str or float), within the annotation's bounds (e.g.
    :data:`kvlab.schema.CapacityBlocks`). ConfigError ``"<function>.<name> ...: ..."`` otherwise."""
    for name, (_, value) in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ConfigError(f"{function}: {name} must be an integer, got {kind_of(value)}")
    from kvlab.schema import validate_fields

    validate_fields(function, **{name: (ann, None if v is None else int(v)) for name, (ann, v) in values.items()})


def require_real(function: str, name: str, value: Any) -> float:
    """``value`` as a float if it is a real number (never a bool or str) and finite; ConfigError naming
    ``<function>: <name>`` otherwise (ranges are the caller's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"{function}: {name} must be a finite number, got {kind_of(value)}"
                          f"{f' {value!r}' if isinstance(value, numbers.Real) else ''}")
    return float(value)


def require_int_list(function: str, name: str, values: Any) -> np.ndarray:
    """The int64 array of an iterable of integers (never a str, bools or floats); ConfigError naming
    ``<function>: <name>`` otherwise (ranges are the caller's)."""
    if isinstance(values, str | bytes | os.PathLike) or not isinstance(values, Iterable):
        raise ConfigError(f"{function}: {name} must be a list of integers, got {kind_of(values)}")
    items = list(values)
    for k, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConfigError(f"{function}: {name}[{k}] must be an integer, got {kind_of(v)}")
    return np.asarray(items, dtype=np.int64)


def unicode_problem(text: str) -> str | None:
    """What makes ``text`` invalid Unicode (a lone surrogate, which UTF-8 cannot encode), or None when it is
    valid. JSON ``"\\ud800"`` escapes and ``surrogateescape`` decoding are where such text comes from."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; "
                "text must be valid Unicode")
    return None


def require_text(value: Any, field: str) -> str:
    """``value`` if it is a ``str`` of valid Unicode (:func:`unicode_problem`); ConfigError naming ``field``
    otherwise (e.g. ``messages[0].content: holds a lone surrogate (U+D800) at character 5; ...``)."""
    if not isinstance(value, str):
        raise ConfigError(f"{field}: expected text (a str), got {kind_of(value)}")
    problem = unicode_problem(value)
    if problem is not None:
        raise ConfigError(f"{field}: {problem}")
    return value


__all__ = ["NonNegativeInt", "kind_of", "require_instance", "require_int_list", "require_ints", "require_real",
           "require_text", "unicode_problem"]
