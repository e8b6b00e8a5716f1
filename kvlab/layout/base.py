"""What a layout transform sees and returns, the registry of transforms by name, and message helpers.

A transform is a pure function of one request: ``(LayoutRequest, RequestContext) -> LayoutRequest``. A
:class:`LayoutRequest` is the request's messages (tagged :class:`~kvlab.workload.render.Part` s) plus the two
things a layout can change besides text: the adapter it is served with and the date a date-injecting chat
template writes. A :class:`RequestContext` carries everything a transform may read besides the messages: the
request's row, arrival (seconds), session, tenant and the study's seed and wall clock. Transforms never touch
token ids: each transformed prompt is rendered and tokenised once afterwards (:mod:`kvlab.layout.apply`).

Randomness is explicit: :func:`request_rng` gives one generator per (seed, transform, request), so a
transform draws the same values for a request whatever other requests or transforms run.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from kvlab.errors import ConfigError
from kvlab.workload.render import Message, Part

Messages = tuple[Message, ...]


@dataclass(frozen=True)
class RequestContext:
    """What a transform may read besides the messages. ``arrival`` in seconds from the workload's start;
    ``clock_start`` the wall-clock time of arrival 0 (POSIX seconds, UTC); ``seed`` the study's seed."""

    index: int
    arrival: float = 0.0
    session: int = -1
    turn: int = -1
    tenant: int = -1
    seed: int = 0
    clock_start: float = 0.0

    def wall_time(self, offset_s: float = 0.0) -> datetime:
        """The wall-clock time (UTC) of this request's arrival plus ``offset_s`` seconds."""
        return datetime.fromtimestamp(self.clock_start + self.arrival + offset_s, tz=UTC)


@dataclass(frozen=True)
class LayoutRequest:
    """One request as laid out: its messages, the adapter that serves it (None: the base model) and the date a
    date-injecting template writes (None: the tokenizer's fixed date, or no date line; :mod:`kvlab.layout.apply`)."""

    messages: Messages
    adapter: str | None = None
    date_string: str | None = None

    def with_messages(self, messages: Iterable[Message]) -> LayoutRequest:
        return dataclasses.replace(self, messages=tuple(messages))


TransformFn = Callable[[LayoutRequest, RequestContext], LayoutRequest]


@dataclass(frozen=True)
class Transform:
    """A registered transform: ``name``, ``group`` (what it varies), the function, its default parameters and a
    one-line description. :meth:`bind` fixes parameters; calling it applies it to one request."""

    name: str
    group: str
    fn: Callable[..., LayoutRequest]
    defaults: dict = field(default_factory=dict)
    doc: str = ""

    def bind(self, **params: Any) -> BoundTransform:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            known = ", ".join(self.defaults) or "none"
            raise ConfigError(f"transform {self.name!r}: unknown parameter {unknown[0]!r} (its parameters: {known})")
        return BoundTransform(self, {**self.defaults, **params})


@dataclass(frozen=True)
class BoundTransform:
    """A transform with its parameters; ``label`` names it in results (``name`` plus non-default parameters)."""

    transform: Transform
    params: dict

    @property
    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in self.params.items() if self.transform.defaults.get(k) != v]
        return self.transform.name + (f"({', '.join(extra)})" if extra else "")

    def __call__(self, req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
        return self.transform.fn(req, ctx, **self.params)


@dataclass(frozen=True)
class Layout:
    """A sequence of bound transforms applied in order (an empty one is the family's layout as generated)."""

    steps: tuple[BoundTransform, ...] = ()
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name or ("+".join(s.label for s in self.steps) if self.steps else "as_generated")

    def __call__(self, req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
        for step in self.steps:
            req = step(req, ctx)
        return req

    def identity(self) -> list[dict]:
        """The layout's part of a run's identity: every step's name and parameters."""
        return [{"transform": s.transform.name, **s.params} for s in self.steps]


TRANSFORMS: dict[str, Transform] = {}


def register(name: str, group: str, doc: str, **defaults: Any) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(req, ctx, **params) -> LayoutRequest`` under ``name`` with default parameters."""

    def deco(fn: Callable) -> Callable:
        if name in TRANSFORMS:
            raise ValueError(f"transform {name!r} registered twice")
        TRANSFORMS[name] = Transform(name, group, fn, dict(defaults), doc)
        return fn

    return deco


# ------------------------------------------------------------------------------------------ helpers
def request_rng(ctx: RequestContext, salt: str) -> np.random.Generator:
    """The generator of one (seed, ``salt``, request): independent of every other request and transform."""
    return np.random.default_rng([ctx.seed, zlib.crc32(salt.encode()), ctx.index])


def map_parts(messages: Messages, fn: Callable[[int, Message, Part], Part | None]) -> Messages:
    """Messages with every part replaced by ``fn(message_index, message, part)`` (None drops the part)."""
    out = []
    for k, m in enumerate(messages):
        parts = tuple(p for p in (fn(k, m, p) for p in m.parts) if p is not None)
        out.append(Message(m.role, parts))
    return tuple(out)


def part_positions(messages: Messages, kind: str) -> list[tuple[int, int]]:
    """``(message, part)`` indices of every part of ``kind``, in prompt order."""
    return [(k, j) for k, m in enumerate(messages) for j, p in enumerate(m.parts) if p.kind == kind]


def replace_parts(messages: Messages, positions: Sequence[tuple[int, int]], parts: Sequence[Part]) -> Messages:
    """Messages with the part at each of ``positions`` replaced by the matching one of ``parts``."""
    new = {pos: p for pos, p in zip(positions, parts, strict=True)}
    return tuple(Message(m.role, tuple(new.get((k, j), p) for j, p in enumerate(m.parts)))
                 for k, m in enumerate(messages))


def system_index(messages: Messages) -> int | None:
    """Index of the first system message, or None."""
    return next((k for k, m in enumerate(messages) if m.role == "system"), None)


def insert_part(messages: Messages, k: int, j: int, part: Part) -> Messages:
    """Messages with ``part`` inserted as part ``j`` of message ``k`` (``j = -1``: appended)."""
    m = messages[k]
    parts = list(m.parts)
    parts.insert(len(parts) if j == -1 else j, part)
    return (*messages[:k], Message(m.role, tuple(parts)), *messages[k + 1:])


def add_to_system(messages: Messages, part: Part, at: str = "top") -> Messages:
    """``part`` at the ``top`` or ``end`` of the system message (a new system message first if there is none)."""
    k = system_index(messages)
    if k is None:
        return (Message("system", (part,)), *messages)
    return insert_part(messages, k, 0 if at == "top" else -1, part)
