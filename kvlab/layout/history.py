"""Transforms of a conversation's history: truncation and reasoning.

A prompt's *turns*: the messages after the system message are grouped into turns, each starting at a user
message (messages before the first user message join the first turn); the last turn is the current one (the
query and, in an agent loop, its tool calls and results so far); the others are the history.

* ``history_full``: the whole history (as generated);
* ``history_drop_oldest``: a sliding window: only the last ``keep_turns`` history turns stay, the oldest are
  dropped, and with ``keep_system=False`` (the default, a naive truncation of the oldest messages) the system
  message goes too once anything is dropped. The window moves every turn, so the prompt changes right after
  what it keeps at the top;
* ``history_summarise``: the system message stays; older turns are compacted, ``chunk`` turns at a time, into a
  summary written at the end of the system message (``history`` part), the last ``keep_turns`` or more stay
  verbatim. Between two compactions the prompt only grows.

Reasoning (``output`` parts marked as Qwen3's ``<think>`` blocks, :func:`kvlab.workload.families.base.is_reasoning`):

* ``reasoning_kept``: every reasoning part stays in the history (as generated);
* ``reasoning_stripped``: every reasoning part is removed from the prompt (consistently: the history only grows);
* ``reasoning_stripped_before_last_user``: Qwen3's chat template rule: reasoning of assistant messages before the
  last user message is removed, the current agent loop's kept, so the prompt of a new user turn loses the
  reasoning the previous prompts had: the prefix breaks at the first earlier answer.
"""

from __future__ import annotations

import re

from kvlab.errors import ConfigError
from kvlab.layout.base import LayoutRequest, Messages, RequestContext, add_to_system, register
from kvlab.workload.families.base import is_reasoning
from kvlab.workload.render import Message, Part


def split_turns(messages: Messages) -> tuple[Messages, list[Messages]]:
    """``(system messages, turns)``: the messages before the first non-system message, and the rest grouped into
    turns each starting at a user message (the last is the current turn)."""
    k = 0
    while k < len(messages) and messages[k].role == "system":
        k += 1
    head, turns = messages[:k], []
    for m in messages[k:]:
        if m.role == "user" and turns and any(x.role == "user" for x in turns[-1]):
            turns.append([m])
        elif turns:
            turns[-1].append(m)
        else:
            turns.append([m])
    return head, [tuple(t) for t in turns]


def _check(keep_turns: int, chunk: int = 1) -> None:
    if not isinstance(keep_turns, int) or keep_turns < 0:
        raise ConfigError(f"history: keep_turns must be an integer >= 0, got {keep_turns!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"history: chunk must be an integer >= 1, got {chunk!r}")


def drop_oldest(messages: Messages, keep_turns: int, keep_system: bool = False) -> Messages:
    """The last ``keep_turns`` history turns and the current turn; the system message too while nothing is dropped
    or with ``keep_system``."""
    _check(keep_turns)
    head, turns = split_turns(messages)
    history, current = turns[:-1], turns[-1:]
    if len(history) <= keep_turns:
        return messages
    kept = history[len(history) - keep_turns:] if keep_turns else []
    return (*(head if keep_system else ()), *(m for t in (*kept, *current) for m in t))


def first_words(text: str, n: int = 16) -> str:
    """The first ``n`` words of ``text`` on one line (with '...' when cut)."""
    words = re.sub(r"\s+", " ", text).strip().split(" ")
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


def summary_text(turns: list[Messages]) -> str:
    """An extractive summary of ``turns``: one line per turn with the start of its user message."""
    lines = [f"Summary of the first {len(turns)} turns of this conversation:"]
    for i, t in enumerate(turns, 1):
        user = next((m.content for m in t if m.role == "user"), t[0].content if t else "")
        lines.append(f"- Turn {i}: the user asked \"{first_words(user)}\"")
    return "\n".join(lines) + "\n"


def summarise(messages: Messages, keep_turns: int, chunk: int) -> Messages:
    """System message kept; the oldest history turns compacted ``chunk`` at a time into a summary at the end of the
    system message, so that ``keep_turns`` to ``keep_turns + chunk - 1`` history turns stay verbatim (the summary
    changes every ``chunk`` turns; in between, the prompt only grows)."""
    _check(keep_turns, chunk)
    head, turns = split_turns(messages)
    history, current = turns[:-1], turns[-1:]
    n = (len(history) - keep_turns) // chunk * chunk  # turns compacted: a multiple of chunk
    if n <= 0:
        return messages
    summary = Part("history", summary_text(history[:n]))
    rest = tuple(m for t in (*history[n:], *current) for m in t)
    return add_to_system((*head, *rest), summary, "end") if head else add_to_system(rest, summary, "end")


@register("history_full", "history", "the whole conversation history (as generated)")
def history_full(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req


@register("history_drop_oldest", "history", "sliding window: the last N history turns (the system message dropped "
          "too unless keep_system)", keep_turns=3, keep_system=False)
def history_drop_oldest(req: LayoutRequest, ctx: RequestContext, *, keep_turns: int,
                        keep_system: bool) -> LayoutRequest:
    return req.with_messages(drop_oldest(req.messages, keep_turns, keep_system))


@register("history_summarise", "history", "system kept, older turns compacted N at a time into a summary",
          keep_turns=3, chunk=3)
def history_summarise(req: LayoutRequest, ctx: RequestContext, *, keep_turns: int, chunk: int) -> LayoutRequest:
    return req.with_messages(summarise(req.messages, keep_turns, chunk))


def strip_reasoning(messages: Messages, before: int | None = None) -> Messages:
    """Messages without reasoning parts (in messages before index ``before`` only, if given); a message left with
    no parts keeps an empty ``output`` part (the template still writes its header)."""
    out = []
    for k, m in enumerate(messages):
        if before is None or k < before:
            parts = tuple(p for p in m.parts if not is_reasoning(p))
            m = Message(m.role, parts or (Part("output", ""),))
        out.append(m)
    return tuple(out)


@register("reasoning_kept", "reasoning", "reasoning stays in the history (as generated)")
def reasoning_kept(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req


@register("reasoning_stripped", "reasoning", "every reasoning part removed from the prompt")
def reasoning_stripped(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(strip_reasoning(req.messages))


@register("reasoning_stripped_before_last_user", "reasoning",
          "Qwen3's rule: reasoning removed before the last user message, kept in the current agent loop")
def reasoning_stripped_before_last_user(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    last_user = max((k for k, m in enumerate(req.messages) if m.role == "user"), default=None)
    if last_user is None:
        return req
    return req.with_messages(strip_reasoning(req.messages, before=last_user))

