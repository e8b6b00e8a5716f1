"""Transforms by name: every group module is imported here, so :data:`TRANSFORMS` is complete once this
module is; :func:`get_transform` and :func:`make_layout` build layouts from names and specs (config files,
``kvlab layout-study``). Groups register with :func:`kvlab.layout.base.register`; they never import this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.errors import ConfigError
from kvlab.layout import history, order, volatile  # noqa: F401 - registers every transform
from kvlab.layout.base import TRANSFORMS, BoundTransform, Layout, Transform

__all__ = ["TRANSFORMS", "get_transform", "make_layout"]


def get_transform(name: str) -> Transform:
    """The registered transform ``name``; ConfigError listing the known names otherwise."""
    t = TRANSFORMS.get(name)
    if t is None:
        raise ConfigError(f"unknown layout transform {name!r} (known: {', '.join(sorted(TRANSFORMS))})")
    return t


def make_layout(spec: str | dict | Sequence, where: str = "transform") -> Layout:
    """A :class:`Layout` from a spec: a name (``"volatile_top"``; ``"a+b"`` composes), a mapping ``{"name": ...,
    "label": ..., <parameters>}`` or ``{"label": ..., "steps": [spec, ...]}``, or a list of specs (composed).
    ``where`` names the spec in errors (a config file and field)."""
    try:
        if isinstance(spec, str):
            if spec in ("as_generated", ""):
                return Layout(name=None)
            return Layout(tuple(get_transform(s.strip()).bind() for s in spec.split("+")))
        if isinstance(spec, dict):
            spec = dict(spec)
            label = spec.pop("label", None)
            if label is not None and not isinstance(label, str):
                raise ConfigError("label must be a string")
            if "steps" in spec:
                steps = spec.pop("steps")
                if spec or not isinstance(steps, list):
                    raise ConfigError("a layout with 'steps' takes only 'label' besides (steps: a list of transforms)")
                inner = make_layout(steps, where)
                return Layout(inner.steps, name=label)
            name = spec.pop("name", None)
            if not isinstance(name, str):
                raise ConfigError("needs 'name' (a transform name) or 'steps'")
            if name == "as_generated":
                if spec:
                    raise ConfigError("as_generated takes no parameters")
                return Layout(name=label)
            return Layout((get_transform(name).bind(**spec),), name=label)
        if isinstance(spec, list | tuple):
            steps: list[BoundTransform] = []
            for s in spec:
                steps += make_layout(s, where).steps
            return Layout(tuple(steps))
        raise ConfigError(f"a transform is a name, a mapping or a list, not {type(spec).__name__}")
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None
