"""kvlab's own trace format, the rules both readers and both writers share: fields, header, columns.

A trace is an optional header plus one record per request: a line of JSONL (:mod:`.native_jsonl`) or a
row of Parquet (:mod:`.native_parquet`). As JSONL, the header is the first line
``{"kvlab_trace": 1, "kind": "blocks", "block_size": 16, ...}`` and a record reads::

    {"arrival": 0.25, "output_length": 128, "tokens": [1, 2, 3], "request_id": 7, "tenant": "a", ...}

Per request: ``arrival`` (seconds, number, non-decreasing), ``output_length`` (int >= 0) and exactly one
prompt: ``tokens`` (token ids), ``text`` (tokenised by the loader's ``tokenizer``) or ``hash_ids`` with
``input_length`` (chained block ids of ``block_size`` tokens; the block size comes from the header, a
per-record ``block_size`` that must agree, or the loader's ``block_size`` argument). Optional:
``input_length`` (tokens records: must equal the token count), ``request_id``, ``session``, ``turn``
(ints), ``parent`` (the *request_id* of the previous turn, null for none), ``tenant``, ``category``,
``adapter``, ``salt`` (string or int, null for none), ``output_tokens`` (ids of a known answer),
``segments`` (the prompt's tagged segments, in order: ``[{"kind": "system", "start": 0, "end": 12,
"text": "..."}, ...]``, token spans ``[start, end)`` into the prompt; ``text`` on every segment of the file
or on none; :mod:`kvlab.workload.segments`).
Unknown keys are errors (the format is ours; typos should not pass silently).

Header keys: ``kvlab_trace`` (format version, 1), ``kind`` ("tokens" | "blocks"), ``block_size``,
``name``, ``columns`` (optional columns present, so empty files round-trip), ``categories`` (per
categorical column the category list in order, so codes and unused categories round-trip),
``ordered`` (categorical columns that are ordered) and ``meta`` (the Workload's meta dict).

Written once here, used by both readers (and the header by both writers, so what they write loads back):
field names, the header (parsed and emitted), the prompt choice, block-size bounds, the values absent int
fields stand for, category labels, request ids and parents. Typed JSON values and token-count bounds are
in :mod:`kvlab.workload._common`; each reader applies the rules to its own form (a JSON value per line,
an Arrow column). Every failure is a one-line :class:`~kvlab.errors.TraceFormatError` naming file, line
(JSONL; ``None`` and ``row i:`` for Parquet) and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Container
from typing import Any

import numpy as np
import pandas as pd

from kvlab.arguments import unicode_problem
from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload._common import MAX_REQUEST_TOKENS, csr, describe, field_label, get_int
from kvlab.workload.segments import SEGMENT_KINDS, Segment, Segments
from kvlab.workload.workload import CATEGORICAL_COLUMNS, Workload

FORMAT_VERSION = 1
PROMPT_KEYS = ("tokens", "text", "hash_ids")
OPTIONAL_COLUMNS = ("request_id", "session", "turn", "parent", *CATEGORICAL_COLUMNS, "output_tokens", "segments")
COLUMN_KEYS = frozenset(("arrival", "output_length", "input_length", *PROMPT_KEYS, *OPTIONAL_COLUMNS))
RECORD_KEYS = COLUMN_KEYS | {"block_size"}  # a JSONL record may repeat its block size; a Parquet file may not
HEADER_KEYS = frozenset(("kvlab_trace", "kind", "block_size", "name", "columns", "categories", "ordered", "meta"))
INT_ABSENT: dict[str, int | None] = {"request_id": None, "session": -1, "turn": -1, "parent": None}
"""The optional int fields, in reading order, and the value an absent one stands for."""


# ---------------------------------------------------------------------------------------------- fields
def is_label(x: Any) -> bool:
    """A category label that can be saved and loaded: a string or an int (not a bool)."""
    return type(x) is str or type(x) is int


def get_block_size(path: str, ln: int | None, obj: dict) -> int | None:
    """``obj["block_size"]`` as an int in ``[1, MAX_REQUEST_TOKENS]``; None when absent (null is an error)."""
    return get_int(path, ln, obj, "block_size", min_value=1, max_value=MAX_REQUEST_TOKENS, default=None)


def prompt_key(path: str, ln: int | None, names: Container[str], *, list_found: bool) -> tuple[str, str]:
    """``(key, kind)``: the one prompt field among ``names`` and its trace kind ("blocks" for hash_ids).

    More or fewer than one is an error naming the second prompt field (or ``tokens``); ``list_found``
    appends the prompt fields found to the message.
    """
    present = [k for k in PROMPT_KEYS if k in names]
    if len(present) != 1:
        field = present[1] if present else "tokens"
        found = f", got {present}" if list_found else ""
        raise TraceFormatError(path, ln, field, f"need exactly one of tokens/text/hash_ids{found}")
    key = present[0]
    return key, "blocks" if key == "hash_ids" else "tokens"


# ---------------------------------------------------------------------------------------------- header
def parse_header(path: str, ln: int | None, obj: dict) -> dict:
    """Validate a header object; return it with defaults filled (kind None if unspecified)."""
    unknown = sorted(set(obj) - HEADER_KEYS)
    if unknown:
        raise TraceFormatError(path, ln, field_label(unknown[0]), "unknown header field")
    version = get_int(path, ln, obj, "kvlab_trace", min_value=1)
    if version != FORMAT_VERSION:
        raise TraceFormatError(path, ln, "kvlab_trace", f"format version {version} not supported (this is 1)")
    kind = obj.get("kind")
    if kind is not None and kind not in ("tokens", "blocks"):
        raise TraceFormatError(path, ln, "kind", f"must be 'tokens' or 'blocks', got {describe(kind)}")
    bs = get_block_size(path, ln, obj) if obj.get("block_size") is not None else None  # null: unspecified
    if kind == "blocks" and bs is None:
        raise TraceFormatError(path, ln, "block_size", "a 'blocks' trace needs a block_size")
    if kind == "tokens" and bs is not None:
        raise TraceFormatError(path, ln, "block_size", "a 'tokens' trace has no block_size")
    name = obj.get("name")
    if name is not None and type(name) is not str:
        raise TraceFormatError(path, ln, "name", f"expected a string, got {describe(name)}")
    columns = obj.get("columns", [])
    if type(columns) is not list or any(type(c) is not str or c not in OPTIONAL_COLUMNS for c in columns):
        raise TraceFormatError(path, ln, "columns", f"expected a list of names from {list(OPTIONAL_COLUMNS)}")
    cats = obj.get("categories", {})
    if type(cats) is not dict or any(
        c not in CATEGORICAL_COLUMNS or type(v) is not list or not all(is_label(x) for x in v)
        for c, v in cats.items()
    ):
        raise TraceFormatError(
            path, ln, "categories", "expected {column: [string or int, ...]} for tenant/category/adapter/salt"
        )
    for c, v in cats.items():
        if len(set(v)) != len(v):
            raise TraceFormatError(path, ln, "categories", f"the categories of {c!r} repeat a value")
    ordered = obj.get("ordered", [])
    if type(ordered) is not list or any(type(c) is not str or c not in cats for c in ordered):
        raise TraceFormatError(path, ln, "ordered", "expected a list of columns named in 'categories'")
    meta = obj.get("meta", {})
    if type(meta) is not dict:
        raise TraceFormatError(path, ln, "meta", f"expected an object, got {describe(meta)}")
    return {
        "kind": kind,
        "block_size": bs,
        "name": name,
        "columns": columns,
        "categories": cats,
        "ordered": ordered,
        "meta": meta,
    }


def default_header(path: str) -> dict:
    """The header of a file that has none (JSONL without a header line, Parquet without ``kvlab`` metadata)."""
    return parse_header(path, None, {"kvlab_trace": FORMAT_VERSION})


def make_header(w: Workload) -> dict:
    """The header object describing ``w`` (both writers; :func:`parse_header` accepts it)."""
    columns = [c for c in OPTIONAL_COLUMNS if c not in ("output_tokens", "segments") and getattr(w, c) is not None]
    if w.output_offsets is not None:
        columns.append("output_tokens")
    if w.segments is not None:
        columns.append("segments")
    cats: dict[str, list] = {}
    ordered = []
    for c in CATEGORICAL_COLUMNS:
        col = getattr(w, c)
        if col is None:
            continue
        values = col.categories.tolist()
        if not all(is_label(x) for x in values):
            raise ConfigError(f"Workload.{c}: only string or int categories can be saved, got {values[:5]}")
        cats[c] = values
        if col.ordered:
            ordered.append(c)
    head: dict[str, Any] = {"kvlab_trace": FORMAT_VERSION, "kind": w.kind}
    if w.kind == "blocks":
        head["block_size"] = int(w.block_size)
    head.update(name=w.name, columns=columns, categories=cats)
    if ordered:
        head["ordered"] = ordered
    head["meta"] = _jsonable(w.meta)
    return head


def _jsonable(meta: dict) -> dict:
    """``meta`` with numpy scalars/arrays and paths converted; anything else non-JSON is a ConfigError."""

    def default(o: Any) -> Any:
        if isinstance(o, np.generic | np.ndarray):
            return o.tolist()
        if isinstance(o, os.PathLike):
            return os.fspath(o)
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")

    try:
        return json.loads(json.dumps(meta, default=default))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Workload.meta cannot be saved: {e}") from None


def check_parents_resolvable(w: Workload) -> None:
    """Both writers store ``parent`` as a request id, so parents need unique request ids."""
    if w.parent is not None and np.any(w.parent >= 0) and len(np.unique(w.request_id)) != len(w):
        raise ConfigError("cannot save 'parent' as request ids: Workload.request_id has duplicates")


# ---------------------------------------------------------------------------------------------- columns
def optional_columns(
    p: str,
    present: set[str],
    cols: dict[str, list],
    lines: list[int] | None,
    hd: dict,
    out_counts: list[int] | np.ndarray,
    out_flat: list[int] | np.ndarray,
) -> dict[str, Any]:
    """Workload keyword arguments for the optional columns ``present`` in a file (both readers).

    ``cols`` holds per optional column one value per request, already type-checked by the reader (absent
    ints as in :data:`INT_ABSENT`, absent labels None); ``out_counts`` / ``out_flat`` are the output
    tokens as counts and flat ids. Checked here: request ids all or none, parents name a unique request id
    (a parent not in the file becomes -1), labels among the header's categories. ``lines`` maps a request
    to its JSONL line; None (Parquet) reports ``row i:`` instead.
    """

    def where(i: int) -> tuple[int | None, str]:
        return (lines[i], "") if lines is not None else (None, f"row {i}: ")

    kw: dict[str, Any] = {}
    n = len(cols["session"])
    rid = None
    if "request_id" in present:
        raw = cols["request_id"]
        missing = [i for i, v in enumerate(raw) if v is None]
        if missing:
            ln, pre = where(missing[0])
            raise TraceFormatError(p, ln, "request_id", f"{pre}missing, but other requests have one")
        rid = np.array(raw, dtype=np.int64)
        kw["request_id"] = rid
    for c in ("session", "turn"):
        if c in present:
            kw[c] = np.array(cols[c], dtype=np.int64)
    if "parent" in present:
        ids = rid if rid is not None else np.arange(n, dtype=np.int64)
        row_of: dict[int, int] = {}
        dup: set[int] = set()
        for i, r in enumerate(ids.tolist()):
            if r in row_of:
                dup.add(r)
            row_of.setdefault(r, i)
        parent = np.full(n, -1, dtype=np.int64)
        for i, ref in enumerate(cols["parent"]):
            if ref is None:
                continue
            if ref in dup:
                ln, pre = where(i)
                raise TraceFormatError(p, ln, "parent", f"{pre}request_id {ref} is not unique")
            parent[i] = row_of.get(ref, -1)
        kw["parent"] = parent
    for c in CATEGORICAL_COLUMNS:
        if c not in present:
            continue
        values = cols[c]
        cats = hd["categories"].get(c)
        if cats is None:
            kw[c] = pd.Categorical(values)
            continue
        known = set(cats)
        lost = next((i for i, v in enumerate(values) if v is not None and v not in known), None)
        if lost is not None:
            ln, pre = where(lost)
            raise TraceFormatError(p, ln, c, f"{pre}{describe(values[lost])} is not among the header's categories")
        cat = pd.Categorical(values, categories=cats, ordered=c in hd["ordered"])
        kw[c] = cat
    if "output_tokens" in present:
        kw["output_offsets"] = csr(out_counts)
        kw["output_values"] = np.asarray(out_flat, dtype=np.int64) if len(out_flat) else np.zeros(0, np.int64)
    return kw


# ---------------------------------------------------------------------------------------------- segments
SEGMENT_KEYS = frozenset(("kind", "start", "end", "text"))
SEGMENTS_NEED_IDS = "segment spans are token positions: they need token ids (tokens or hash_ids), not text"


def parse_segments(path: str, ln: int | None, value: Any, input_length: int, pre: str = "") -> list[Segment]:
    """One record's ``segments`` value (a list of ``{kind, start, end[, text]}``) as checked Segments.

    Spans are token positions in the prompt, ordered, non-overlapping, within ``[0, input_length]``;
    ``pre`` prefixes messages (``"row i: "`` for Parquet).
    """
    if type(value) is not list:
        raise TraceFormatError(path, ln, "segments", f"{pre}expected a list of segment objects, got {describe(value)}")
    out: list[Segment] = []
    prev_end = 0
    for k, seg in enumerate(value):
        where = f"{pre}segment {k}"
        if type(seg) is not dict:
            raise TraceFormatError(path, ln, "segments", f"{where}: expected an object, got {describe(seg)}")
        unknown = sorted(set(seg) - SEGMENT_KEYS)
        if unknown:
            raise TraceFormatError(path, ln, "segments", f"{where}: unknown key {field_label(unknown[0])!r}")
        kind = seg.get("kind")
        if kind not in SEGMENT_KINDS:
            raise TraceFormatError(
                path, ln, "segments", f"{where}: kind {describe(kind)} is not one of {', '.join(SEGMENT_KINDS)}"
            )
        try:
            start = get_int(path, ln, seg, "start", min_value=0)
            end = get_int(path, ln, seg, "end", min_value=0)
        except TraceFormatError as e:
            raise TraceFormatError(path, ln, "segments", f"{where}: {e.field} {e.message}") from None
        if not prev_end <= start <= end <= input_length:
            raise TraceFormatError(
                path, ln, "segments",
                f"{where}: span [{start}, {end}) must lie in [{prev_end}, {input_length}] (tokens, in order)",
            )
        text = seg.get("text")
        if "text" in seg and type(text) is not str:
            raise TraceFormatError(path, ln, "segments", f"{where}: text must be a string, got {describe(text)}")
        if text is not None and unicode_problem(text) is not None:
            raise TraceFormatError(path, ln, "segments", f"{where}: text {unicode_problem(text)}")
        out.append(Segment(kind, start, end, text))
        prev_end = end
    return out


def build_segments(path: str, per_request: list[list[Segment]], lines: list[int] | None) -> Segments:
    """The Segments of a file's requests; texts must be on every segment or on none (error names the line)."""
    has = [[s.text is not None for s in r] for r in per_request]
    flat = [h for r in has for h in r]
    if any(flat) and not all(flat):
        want = not flat[0]  # the first segment decides; report the first that differs
        i = next(i for i, r in enumerate(has) if want in r)
        ln, pre = (lines[i], "") if lines is not None else (None, f"row {i}: ")
        what = "has a text" if want else "has no text"
        raise TraceFormatError(path, ln, "segments", f"{pre}segment {has[i].index(want)} {what}, unlike the first")
    return Segments.from_lists(per_request)


def segments_records(w: Workload) -> list[list[dict]]:
    """Per request the ``segments`` value both writers store (``text`` only where the workload has texts)."""
    seg = w.segments
    assert seg is not None
    out = []
    for i in range(len(w)):
        out.append([
            {"kind": s.kind, "start": s.start, "end": s.end} | ({} if s.text is None else {"text": s.text})
            for s in seg.of(i)
        ])
    return out
