"""A researcher's own requests: a *messages file* (JSONL, one request a line, OpenAI chat shape) -> requests.

One line is one request::

    {"messages": [{"role": "system", "content": [{"type": "text", "text": "Current time: ...", "segment": "volatile"},
                                                 {"type": "text", "text": "You are ..."}]},
                  {"role": "user", "content": "How do I ...?"}],
     "arrival": 12.5, "session": "alice", "output_tokens": 180}

* ``messages`` (required, non-empty): each ``{"role", "content", "segment"?}``; ``role`` one of :data:`ROLES`;
  ``content`` a string or a list of text parts ``{"type": "text", "text": ..., "segment"?}``.
* ``segment`` (on a message or on a part; a part's wins): the segment kind the text is counted under, one of
  :data:`~kvlab.workload.segments.SEGMENT_KINDS` (system, tools, document, history, user, volatile, output).
  Default by role (:func:`default_segment`): ``system`` -> system, ``assistant`` -> output, ``tool`` -> history,
  the last ``user`` message -> user, earlier ones -> history.
* ``arrival`` (seconds, a finite number >= 0): give it on every line or on none; none: line order, one request
  a second (the k-th request at k - 1 s). Requests are served in arrival order (ties keep line order).
* ``session`` (an integer or a string): requests of one session are its turns, numbered in arrival order;
  default: every request is a session of its own.
* ``output_tokens`` (tokens, an integer in ``[0, 2**28]``): default :data:`DEFAULT_OUTPUT_TOKENS`.
* ``id`` (a string or an integer): a label kept in the request's ``meta``; any other key is refused (a typo such
  as ``arival`` would otherwise silently fall back to a default).

Every bad record is one :class:`~kvlab.workload.sources.TextSourceError` line (a ConfigError and a
TraceFormatError) naming the file, the line and the field (``messages[1].content[0].segment``), raised while the
file is read, before anything is rendered. Bounded: a file over :data:`MAX_MESSAGES_BYTES` bytes or
:data:`MAX_MESSAGES_REQUESTS` requests is refused.

:func:`load_messages` gives :class:`~kvlab.workload.families.base.GeneratedRequest` s (text; the layout study's
``messages`` family); :func:`load_messages_trace` renders them with a tokenizer into a segmented token Workload
(the ``messages`` trace format of :func:`kvlab.workload.load_trace`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvlab.arguments import unicode_problem
from kvlab.errors import ConfigError, TraceFormatError
from kvlab.units import GIB
from kvlab.workload._common import (
    MAX_REQUEST_TOKENS,
    check_regular_file,
    describe,
    field_label,
    iter_json_lines,
    read_trace_bytes,
    sha256_bytes,
    trace_file_error,
)
from kvlab.workload.families.base import GeneratedRequest
from kvlab.workload.render import Message, Part
from kvlab.workload.segments import SEGMENT_KINDS
from kvlab.workload.sources import TextSourceError
from kvlab.workload.tokenizer import TextTokenizer, load_tokenizer
from kvlab.workload.workload import Workload

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (the four the chat templates render)."""
RECORD_KEYS = ("messages", "arrival", "session", "output_tokens", "id")
MESSAGE_KEYS = ("role", "content", "segment")
PART_KEYS = ("type", "text", "segment")
DEFAULT_OUTPUT_TOKENS = 256
"""Output tokens of a request without ``output_tokens`` (the default of
:func:`kvlab.workload.render.rendered_workload`)."""
ARRIVAL_SPACING_S = 1.0
"""Seconds between two requests of a file without ``arrival``: the k-th line's request arrives at (k - 1) s."""
MAX_MESSAGES_REQUESTS = 100_000
"""The most requests a messages file may hold (the layout study's limit per family,
:data:`kvlab.layout.config.MAX_FAMILY_REQUESTS`): every layout renders and tokenises each request."""
MAX_ARRIVAL_S = 1e12
"""The latest arrival accepted (seconds; about 31,700 years): finite, and exact to the microsecond."""
MAX_MESSAGES_BYTES = GIB
"""The largest messages file read (1 GiB): it is read whole, and its text is held while it is rendered."""
CATEGORY = "messages"


def default_segment(role: str, index: int, last_user: int) -> str:
    """The segment kind of message ``index`` (role ``role``) without a ``segment`` tag; ``last_user`` is the index
    of the request's last user message (-1 if none)."""
    if role == "user":
        return "user" if index == last_user else "history"
    return {"system": "system", "assistant": "output", "tool": "history"}[role]


def _err(path: str, ln: int, field: str | None, message: str) -> TextSourceError:
    return TextSourceError(path, ln, field, message)


def _text(path: str, ln: int, field: str, value: Any) -> str:
    if type(value) is not str:
        raise _err(path, ln, field, f"expected a string, got {describe(value)}")
    problem = unicode_problem(value)
    if problem is not None:
        raise _err(path, ln, field, problem)
    return value


def _segment(path: str, ln: int, field: str, value: Any) -> str:
    if type(value) is not str or value not in SEGMENT_KINDS:
        raise _err(path, ln, field, f"{describe(value)} is not a segment kind (one of {', '.join(SEGMENT_KINDS)})")
    return value


def _unknown(path: str, ln: int, where: str, obj: dict, known: tuple[str, ...]) -> None:
    bad = next((k for k in obj if k not in known), None)
    if bad is not None:
        raise _err(path, ln, f"{where}{field_label(bad)}", f"unknown key (known: {', '.join(known)})")


def _message(path: str, ln: int, k: int, m: Any) -> tuple[str, str | None, list[tuple[str | None, str]]]:
    """``(role, message segment or None, [(part segment or None, text)])`` of ``messages[k]``."""
    where = f"messages[{k}]"
    if type(m) is not dict:
        raise _err(path, ln, where, f"expected an object {{role, content}}, got {describe(m)}")
    _unknown(path, ln, f"{where}.", m, MESSAGE_KEYS)
    role = m.get("role")
    if type(role) is not str or role not in ROLES:
        raise _err(path, ln, f"{where}.role", f"{describe(role)} is not a role (one of {', '.join(ROLES)})")
    seg = _segment(path, ln, f"{where}.segment", m["segment"]) if "segment" in m else None
    if "content" not in m:
        raise _err(path, ln, f"{where}.content", "missing required field")
    content = m["content"]
    if type(content) is str:
        return role, seg, [(None, _text(path, ln, f"{where}.content", content))]
    if type(content) is not list:
        raise _err(path, ln, f"{where}.content", f"expected a string or a list of text parts, got {describe(content)}")
    parts = []
    for j, p in enumerate(content):
        pw = f"{where}.content[{j}]"
        if type(p) is not dict:
            raise _err(path, ln, pw, f"expected a text part {{type: text, text}}, got {describe(p)}")
        _unknown(path, ln, f"{pw}.", p, PART_KEYS)
        if p.get("type") != "text":
            raise _err(path, ln, f"{pw}.type", f"only text parts are read (type: text), got {describe(p.get('type'))}")
        if "text" not in p:
            raise _err(path, ln, f"{pw}.text", "missing required field")
        text = _text(path, ln, f"{pw}.text", p["text"])
        parts.append((_segment(path, ln, f"{pw}.segment", p["segment"]) if "segment" in p else None, text))
    return role, seg, parts


def _record(path: str, ln: int, obj: dict) -> dict:
    """One line's fields, checked (module docstring); messages as :class:`Message` s of tagged parts."""
    _unknown(path, ln, "", obj, RECORD_KEYS)
    msgs = obj.get("messages")
    if "messages" not in obj:
        raise _err(path, ln, "messages", "missing required field")
    if type(msgs) is not list or not msgs:
        raise _err(path, ln, "messages", f"expected a non-empty list of messages, got {describe(msgs)}")
    parsed = [_message(path, ln, k, m) for k, m in enumerate(msgs)]
    last_user = max((k for k, (role, _, _) in enumerate(parsed) if role == "user"), default=-1)
    messages = tuple(
        Message(role, tuple(Part(ps or seg or default_segment(role, k, last_user), text) for ps, text in parts))
        for k, (role, seg, parts) in enumerate(parsed)
    )
    out: dict[str, Any] = {"messages": messages, "line": ln}
    if "arrival" in obj:
        a = obj["arrival"]
        if type(a) not in (int, float) or not 0 <= a <= MAX_ARRIVAL_S:
            raise _err(path, ln, "arrival", f"expected a number of seconds in [0, {MAX_ARRIVAL_S:g}], "
                                            f"got {describe(a)}")
        out["arrival"] = float(a)
    if "session" in obj:
        s = obj["session"]
        if type(s) not in (int, str):
            raise _err(path, ln, "session", f"expected an integer or a string, got {describe(s)}")
        out["session"] = s
    if "output_tokens" in obj:
        o = obj["output_tokens"]
        if type(o) is not int or not 0 <= o <= MAX_REQUEST_TOKENS:
            raise _err(path, ln, "output_tokens", f"expected an integer in [0, {MAX_REQUEST_TOKENS:,}] (tokens), "
                                                  f"got {describe(o)}")
        out["output_tokens"] = o
    if "id" in obj:
        if type(obj["id"]) not in (int, str):
            raise _err(path, ln, "id", f"expected an integer or a string, got {describe(obj['id'])}")
        out["id"] = obj["id"]
    return out


def _read(path: str | os.PathLike) -> tuple[str, bytes]:
    """The file's name (as errors show it) and bytes; refused when not a regular file or over the size limit."""
    p = os.fspath(path)
    check_regular_file(p)
    try:
        size = Path(p).stat().st_size
    except (OSError, ValueError) as e:
        raise trace_file_error(p, e) from None
    if size > MAX_MESSAGES_BYTES:
        raise TextSourceError(p, None, None, f"{size:,} bytes, more than the {MAX_MESSAGES_BYTES:,} a messages file "
                                             "may hold (docs/layout.md, 'Messages file'); split it")
    return p, read_trace_bytes(p)


def load_messages(
    path: str | os.PathLike,
    *,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    max_requests: int = MAX_MESSAGES_REQUESTS,
) -> list[GeneratedRequest]:
    """The requests of messages file ``path`` in arrival order (module docstring), each with ``session`` (0-based,
    in order of first appearance), ``turn`` (1-based within its session, in arrival order), ``tenant`` 0,
    ``category`` ``"messages"`` and ``meta`` ``{"line": <1-based line>, "id": <the record's id, if any>}``;
    ``output_tokens`` is the default for records without one. Every record is checked before any request is
    built; the first bad one is the one reported."""
    if type(output_tokens) is not int or not 0 <= output_tokens <= MAX_REQUEST_TOKENS:
        raise ConfigError(f"load_messages: output_tokens must be an integer in [0, {MAX_REQUEST_TOKENS:,}], "
                          f"got {output_tokens!r}")
    if type(max_requests) is not int or not 1 <= max_requests <= MAX_MESSAGES_REQUESTS:
        raise ConfigError(f"load_messages: max_requests must be an integer in [1, {MAX_MESSAGES_REQUESTS:,}], "
                          f"got {max_requests!r}")
    return _requests(*_read(path), output_tokens=output_tokens, max_requests=max_requests)


def _requests(p: str, data: bytes, *, output_tokens: int = DEFAULT_OUTPUT_TOKENS,
              max_requests: int = MAX_MESSAGES_REQUESTS) -> list[GeneratedRequest]:
    """:func:`load_messages` of file ``p`` whose bytes are ``data``."""
    records: list[dict] = []
    try:
        for ln, obj in iter_json_lines(p, data):
            if len(records) == max_requests:
                raise _err(p, ln, None, f"more than {max_requests:,} requests (the most a messages file may hold "
                                        "here; docs/layout.md, 'Messages file'); split the file")
            records.append(_record(p, ln, obj))
    except TextSourceError:
        raise
    except TraceFormatError as e:  # the shared JSON line reader's errors, as this module's one kind
        raise TextSourceError(e.path, e.line, e.field, e.message) from None
    if not records:
        raise TextSourceError(p, None, None, "no requests (every line is blank); one JSON object a line, "
                                             "each with 'messages'")
    timed = "arrival" in records[0]
    odd = next((r for r in records if ("arrival" in r) != timed), None)
    if odd is not None:
        how = "missing, but line {} gives one" if timed else "given, but line {} has none"
        raise _err(p, odd["line"], "arrival", how.format(records[0]["line"]) + ": give every request an arrival "
                   "or none (then one a second, in line order)")
    for k, r in enumerate(records):
        r.setdefault("arrival", k * ARRIVAL_SPACING_S)
    order = sorted(range(len(records)), key=lambda k: records[k]["arrival"])  # stable: ties keep line order
    sessions: dict[tuple, int] = {}
    turns: dict[int, int] = {}
    out = []
    for k in order:
        r = records[k]
        key = ("given", type(r["session"]).__name__, r["session"]) if "session" in r else ("line", k)
        session = sessions.setdefault(key, len(sessions))
        turns[session] = turns.get(session, 0) + 1
        meta = {"line": r["line"], **({"id": r["id"]} if "id" in r else {})}
        out.append(GeneratedRequest(
            messages=r["messages"], arrival=r["arrival"], output_tokens=r.get("output_tokens", output_tokens),
            session=session, turn=turns[session], tenant=0, category=CATEGORY, answer_source="none", meta=meta,
        ))
    return out


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a messages file's bytes (its identity in captions and manifests)."""
    return sha256_bytes(_read(path)[1])


def load_messages_trace(
    path: str | os.PathLike,
    *,
    tokenizer: str | TextTokenizer | None = None,
    name: str | None = None,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    date_string: str | None = None,
) -> Workload:
    """The ``messages`` trace format: the requests of ``path`` (:func:`load_messages`) rendered once with
    ``tokenizer`` (a :func:`~kvlab.workload.tokenizer.load_tokenizer` spec or a TextTokenizer; default
    ``kvlab-bpe``) into a segmented token Workload (:func:`kvlab.workload.families.family_workload`), named
    ``name`` (default: the file's stem); ``source`` is the path and ``checksum`` the file's sha256.
    The file is checked whole before the tokenizer is loaded."""
    from kvlab.workload.families import family_workload

    p, data = _read(path)
    reqs = _requests(p, data, output_tokens=output_tokens)
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        tok = load_tokenizer(tokenizer)
    elif isinstance(tokenizer, TextTokenizer):
        tok = tokenizer
    else:
        raise ConfigError(f"the messages loader: tokenizer must be a tokenizer spec (e.g. 'kvlab-bpe') or a "
                          f"TextTokenizer, got {type(tokenizer).__name__}")
    w = family_workload(reqs, tok, name=name if name is not None else Path(p).stem, date_string=date_string,
                        meta={"format": "messages"})
    w.source = p
    w.checksum = sha256_bytes(data)
    return w


__all__ = ["ARRIVAL_SPACING_S", "DEFAULT_OUTPUT_TOKENS", "MAX_MESSAGES_BYTES", "MAX_MESSAGES_REQUESTS", "ROLES",
           "default_segment", "file_sha256", "load_messages", "load_messages_trace"]
