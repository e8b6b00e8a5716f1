"""Transforms of order: tool definitions (order and JSON key order) and retrieved documents.

Tools. A tool catalogue is either several ``tools`` parts (one per tool) or ``tools`` parts whose text holds
the tools as JSON: a JSON array (``[{...}, {...}]``, possibly inside other text) or one JSON object per line
(Qwen's ``<tools>`` block). Each tool is re-serialised with :func:`json.dumps` (``ensure_ascii=False``, the
original's indent for an array), so every variant of a study writes its JSON the same way.

* ``tools_canonical``: tools sorted by name (a fixed order for every request);
* ``tools_shuffled``: a fresh random order per request (as a client iterating a set or a dict of plugins);
* ``tools_keys_sorted`` / ``tools_keys_unstable``: every JSON object's keys sorted, or in a fresh random order
  per request (as a serialiser without ``sort_keys`` over a hash map).

Documents (``document`` parts, wherever they are): ``documents_retrieval`` keeps the retrieval order,
``documents_canonical`` sorts them by text (one global order, so two requests retrieving overlapping sets share a
longer prefix), ``documents_reranked`` a fresh random order per request (a re-ranker's noise).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlab.layout.base import (
    LayoutRequest,
    Messages,
    RequestContext,
    part_positions,
    register,
    replace_parts,
    request_rng,
)
from kvlab.workload.render import Part

Reorder = Callable[[list[Any]], list[Any]]


def tool_name(tool: Any) -> str:
    """A tool's name (``name`` or OpenAI's ``function.name``), else its JSON text (for sorting)."""
    if isinstance(tool, dict):
        if isinstance(tool.get("name"), str):
            return tool["name"]
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    return json.dumps(tool, sort_keys=True, ensure_ascii=False)


def _indent(text: str) -> int | None:
    m = re.search(r"\n( +)\S", text)
    return len(m.group(1)) if m else None


def _split_tools(text: str) -> tuple[list[Any], Callable[[list[Any]], str]] | None:
    """The JSON tools in ``text`` and a function writing the text back with other tools in their place; None if
    ``text`` holds no JSON tools. Recognised, in this order: the whole text one JSON object (one tool) or array
    (of tools); one JSON object per line; a JSON array of objects inside other text."""
    body = text.strip()
    lead, trail = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()):]
    try:
        whole = json.loads(body) if body[:1] in "[{" and body else None
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return [whole], lambda new: lead + json.dumps(new[0], ensure_ascii=False) + trail
    if isinstance(whole, list) and whole and all(isinstance(x, dict) for x in whole):
        indent = _indent(body)
        return whole, lambda new: lead + json.dumps(new, indent=indent, ensure_ascii=False) + trail
    lines = text.split("\n")
    found: list[tuple[int, Any]] = []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("{") and s.endswith("}"):
            with contextlib.suppress(ValueError):
                found.append((i, json.loads(s)))
    if found:
        def write(new: list[Any]) -> str:
            out = list(lines)
            for (i, _), item in zip(found, new, strict=True):
                pad = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
                out[i] = pad + json.dumps(item, ensure_ascii=False)
            return "\n".join(out)

        return [item for _, item in found], write
    for m in re.finditer(r"\[\s*\{", text):  # an array of objects inside other text
        start, end = m.start(), text.rfind("]")
        try:
            items = json.loads(text[start:end + 1])
        except ValueError:
            continue
        if isinstance(items, list) and items and all(isinstance(x, dict) for x in items):
            head, tail, indent = text[:start], text[end + 1:], _indent(text[start:end + 1])
            return items, lambda new, h=head, t=tail, i=indent: h + json.dumps(new, indent=i, ensure_ascii=False) + t
    return None


def reorder_tools(messages: Messages, reorder: Reorder, each: Callable[[Any], Any] | None = None) -> Messages:
    """Messages with the tools put in ``reorder(tools)`` order and each tool replaced by ``each(tool)``.

    Several ``tools`` parts are reordered among their places (their texts move; each text is rewritten by
    ``each`` if it is JSON); a single ``tools`` part holding JSON tools is reordered inside its text."""
    pos = part_positions(messages, "tools")
    if not pos:
        return messages
    parts = [messages[k].parts[j] for k, j in pos]
    if len(parts) > 1:
        texts = reorder([p.text for p in parts])
        if each is not None:
            texts = [_rewrite(t, lambda items: [each(x) for x in items]) for t in texts]
        return replace_parts(messages, pos, [Part("tools", t) for t in texts])
    text = _rewrite(parts[0].text, lambda items: [each(x) if each else x for x in reorder(items)])
    return replace_parts(messages, pos, [Part("tools", text)])


def _rewrite(text: str, fn: Callable[[list[Any]], list[Any]]) -> str:
    split = _split_tools(text)
    if split is None:
        return text
    items, write = split
    return write(fn(items))


def sort_keys(obj: Any) -> Any:
    """``obj`` with every JSON object's keys sorted (recursively)."""
    if isinstance(obj, dict):
        return {k: sort_keys(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [sort_keys(x) for x in obj]
    return obj


def shuffle_keys(obj: Any, rng: np.random.Generator) -> Any:
    """``obj`` with every JSON object's keys in a random order drawn from ``rng`` (recursively)."""
    if isinstance(obj, dict):
        keys = list(obj)
        return {keys[i]: shuffle_keys(obj[keys[i]], rng) for i in rng.permutation(len(keys)).tolist()}
    if isinstance(obj, list):
        return [shuffle_keys(x, rng) for x in obj]
    return obj


def _permute(rng: np.random.Generator) -> Reorder:
    return lambda items: [items[i] for i in rng.permutation(len(items)).tolist()]


def _by_name(items: list[Any]) -> list[Any]:
    return sorted(items, key=lambda t: tool_name(t) if not isinstance(t, str) else _text_tool_name(t))


def _text_tool_name(text: str) -> str:
    split = _split_tools(text)
    return tool_name(split[0][0]) if split else text


@register("tools_canonical", "tools", "tool definitions sorted by name")
def tools_canonical(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(reorder_tools(req.messages, _by_name))


@register("tools_shuffled", "tools", "tool definitions in a fresh random order per request")
def tools_shuffled(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(reorder_tools(req.messages, _permute(request_rng(ctx, "tools_shuffled"))))


@register("tools_keys_sorted", "tools", "tool JSON with sorted keys")
def tools_keys_sorted(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(reorder_tools(req.messages, list, sort_keys))


@register("tools_keys_unstable", "tools", "tool JSON with its keys in a fresh random order per request")
def tools_keys_unstable(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    rng = request_rng(ctx, "tools_keys_unstable")
    return req.with_messages(reorder_tools(req.messages, list, lambda t: shuffle_keys(t, rng)))


def reorder_documents(messages: Messages, reorder: Reorder) -> Messages:
    """Messages with the ``document`` parts' texts in ``reorder(texts)`` order, each in a document's place."""
    pos = part_positions(messages, "document")
    if len(pos) < 2:
        return messages
    texts = reorder([messages[k].parts[j].text for k, j in pos])
    return replace_parts(messages, pos, [Part("document", t) for t in texts])


@register("documents_retrieval", "documents", "retrieved documents in retrieval order (as generated)")
def documents_retrieval(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req


@register("documents_canonical", "documents", "retrieved documents in one global order (sorted by text)")
def documents_canonical(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(reorder_documents(req.messages, sorted))


@register("documents_reranked", "documents", "retrieved documents in a fresh random order per request (re-ranker)")
def documents_reranked(req: LayoutRequest, ctx: RequestContext) -> LayoutRequest:
    return req.with_messages(reorder_documents(req.messages, _permute(request_rng(ctx, "documents_reranked"))))
