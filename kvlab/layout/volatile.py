"""Transforms of what changes per request or over time: volatile content, system-prompt edits, the chat
template's date, adapters.

* ``volatile_top`` / ``volatile_after_system`` / ``volatile_end`` / ``volatile_none``: where the request's
  volatile content (a timestamp, a user id or a request id) sits: the top of the system prompt, right after
  it, at the end of the prompt, or nowhere. Volatile parts already in the messages are moved; a request
  without one gets one (:func:`volatile_text`).
* ``system_edited``: the system prompt is edited every ``period_minutes`` minutes (a revision line at its
  top or end), so requests in one period share it and a new period starts cold.
* ``date_injected`` / ``date_fixed``: the date a Llama-3.1-style template writes into the system turn: the
  request's wall-clock day, or a fixed date (:mod:`kvlab.layout.apply` passes it to the template, or writes
  the template's header itself for templates that inject no date).
* ``adapter_switch``: the request is served by one of ``adapters`` LoRA adapters, drawn per request or per
  session (the Workload's ``adapter`` column; the adapter is part of every block key).

Times: ``arrival`` in seconds; periods in minutes; wall-clock texts in UTC.
"""

from __future__ import annotations

import dataclasses
import zlib

from kvlab.errors import ConfigError
from kvlab.layout.base import (
    LayoutRequest,
    Messages,
    RequestContext,
    add_to_system,
    insert_part,
    register,
    request_rng,
    system_index,
)
from kvlab.workload.render import Message, Part
from kvlab.workload.tokenizer import DEFAULT_DATE_STRING

VOLATILE_KINDS = ("timestamp", "user_id", "request_id")
PLACES = ("top", "after_system", "end")


def volatile_text(ctx: RequestContext, what: str = "timestamp") -> str:
    """A request's volatile line: ``Current time: <UTC, to the second>``, ``User id: <session>`` or
    ``Request id: <16 hex digits drawn for this request>``."""
    if what == "timestamp":
        return f"Current time: {ctx.wall_time():%Y-%m-%d %H:%M:%S} UTC\n"
    if what == "user_id":
        return f"User id: user-{max(ctx.session, ctx.tenant, 0):05d}\n"
    if what == "request_id":
        return f"Request id: req-{int(request_rng(ctx, 'request_id').integers(1 << 62)):016x}\n"
    raise ConfigError(f"volatile 'what' is {what!r}, not one of {', '.join(VOLATILE_KINDS)}")


def strip_volatile(messages: Messages) -> tuple[Messages, list[Part]]:
    """Messages without their ``volatile`` parts, and those parts in prompt order."""
    found = [p for m in messages for p in m.parts if p.kind == "volatile"]
    kept = tuple(Message(m.role, tuple(p for p in m.parts if p.kind != "volatile")) for m in messages)
    return kept, found


def place_volatile(messages: Messages, parts: list[Part], where: str) -> Messages:
    """``parts`` (volatile) placed at ``where``, in their order: ``top`` (first parts of the system message, else of
    the first message), ``after_system`` (last parts of the system message, else first parts of the first
    message) or ``end`` (last parts of the last message)."""
    if where not in PLACES:
        raise ConfigError(f"volatile 'where' is {where!r}, not one of {', '.join(PLACES)}")
    k = system_index(messages)
    if where == "end":
        k, at = len(messages) - 1, len(messages[-1].parts)
    elif k is None:
        k, at = 0, 0
    else:
        at = 0 if where == "top" else len(messages[k].parts)
    out = messages
    for i, p in enumerate(parts):
        out = insert_part(out, k, at + i, p)
    return out


def _volatile(req: LayoutRequest, ctx: RequestContext, *, where: str | None, what: str) -> LayoutRequest:
    if what not in VOLATILE_KINDS:
        raise ConfigError(f"volatile 'what' is {what!r}, not one of {', '.join(VOLATILE_KINDS)}")
    msgs, found = strip_volatile(req.messages)
    if where is None:
        return req.with_messages(msgs)
    return req.with_messages(place_volatile(msgs, found or [Part("volatile", volatile_text(ctx, what))], where))


@register("volatile_top", "volatile", "volatile content (timestamp, user or request id) at the top of the system "
          "prompt", what="timestamp")
def volatile_top(req: LayoutRequest, ctx: RequestContext, *, what: str) -> LayoutRequest:
    return _volatile(req, ctx, where="top", what=what)


@register("volatile_after_system", "volatile", "volatile content right after the system prompt", what="timestamp")
def volatile_after_system(req: LayoutRequest, ctx: RequestContext, *, what: str) -> LayoutRequest:
    return _volatile(req, ctx, where="after_system", what=what)


@register("volatile_end", "volatile", "volatile content at the end of the prompt (after the query)", what="timestamp")
def volatile_end(req: LayoutRequest, ctx: RequestContext, *, what: str) -> LayoutRequest:
    return _volatile(req, ctx, where="end", what=what)


@register("volatile_none", "volatile", "no volatile content")
def volatile_none(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return _volatile(req, ctx, where=None, what="timestamp")


def revision(ctx: RequestContext, period_minutes: float) -> int:
    """The system prompt's revision at the request's arrival: whole periods since the wall clock's epoch
    (so revisions change at wall-clock multiples of the period, not at the workload's start)."""
    if period_minutes <= 0:
        raise ConfigError(f"system_edited: period_minutes must be > 0, got {period_minutes}")
    return int((ctx.clock_start + ctx.arrival) // (60.0 * period_minutes))


@register("system_edited", "system", "the system prompt is edited every N minutes (a revision line at its top or end)",
          period_minutes=10.0, where="top")
def system_edited(req: LayoutRequest, ctx: RequestContext, *, period_minutes: float, where: str) -> LayoutRequest:
    if where not in ("top", "end"):
        raise ConfigError(f"system_edited: where is {where!r}, not top or end")
    k = revision(ctx, period_minutes)
    since = ctx.wall_time((k * 60.0 * period_minutes) - (ctx.clock_start + ctx.arrival))
    line = Part("system", f"Policy revision {k % 100000}, in force since {since:%Y-%m-%d %H:%M} UTC.\n")
    return req.with_messages(add_to_system(req.messages, line, where))


@register("date_injected", "date", "the chat template writes the request's wall-clock day (Llama-3.1 'Today Date')")
def date_injected(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return dataclasses.replace(req, date_string=f"{ctx.wall_time():%d %b %Y}")


@register("date_fixed", "date", "the chat template writes a fixed date (kvlab's default date)")
def date_fixed(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return dataclasses.replace(req, date_string=DEFAULT_DATE_STRING)


@register("adapter_switch", "adapter", "served by one of N LoRA adapters, drawn per request or per session",
          adapters=4, per="request")
def adapter_switch(req: LayoutRequest, ctx: RequestContext, *, adapters: int, per: str) -> LayoutRequest:
    if not isinstance(adapters, int) or adapters < 1:
        raise ConfigError(f"adapter_switch: adapters must be an integer >= 1, got {adapters!r}")
    if per == "request":
        a = int(request_rng(ctx, "adapter").integers(adapters))
    elif per == "session":
        a = zlib.crc32(f"{ctx.seed}:{ctx.session if ctx.session >= 0 else ctx.index}".encode()) % adapters
    else:
        raise ConfigError(f"adapter_switch: per is {per!r}, not request or session")
    return dataclasses.replace(req, adapter=f"lora-{a}")
