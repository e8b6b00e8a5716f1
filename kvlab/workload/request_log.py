"""Serving request logs with token ids (vLLM-style JSONL), and session-preserving downsampling.

One JSON object per request and line, in any order (a server usually writes a request when it finishes):

* ``arrival_time`` (number, seconds; any origin, e.g. Unix time: rebased so the earliest request is 0);
* ``prompt_token_ids`` (list of ints >= 0);
* ``output_token_ids`` (list of ints >= 0) and/or ``output_length`` (int >= 0; equal to the list's length
  when both are given); at least one of them;
* optional ``request_id`` (int >= 0 or string, unique), ``session_id`` (int or string: the conversation),
  ``user`` (string: kept as the ``tenant`` label), ``lora_name`` (string: the ``adapter`` label, part of
  every block key) and ``cache_salt`` (string: the ``salt`` label). ``null`` means absent.

Other keys are ignored (a log may carry timings, sampling parameters...); a key given twice is an error.
Every violation raises ``TraceFormatError`` naming the file, the line and the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload._common import (
    MAX_REQUEST_TOKENS,
    check_int_list,
    csr,
    describe,
    get_length,
    get_number,
    int_array,
    iter_json_lines,
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.workload import Workload

_MISSING = object()
#: optional string labels: log key -> Workload categorical column
_LABELS = {"user": "tenant", "lora_name": "adapter", "cache_salt": "salt"}


def load_request_log(path: str | os.PathLike, *, name: str | None = None, sort: bool = True) -> Workload:
    """Load a serving request log (module docstring) as a ``kind="tokens"`` Workload.

    Rows are ordered by ``arrival_time`` (stable: ties keep file order); ``sort=False`` instead requires the
    file to be in arrival order and reports the first line that goes backwards. ``arrival`` is in seconds
    from the earliest request. Columns: ``request_id`` (the log's integer ids; string ids become 0, 1, ...
    in first-seen file order, the strings kept in ``meta["request_id_labels"]``; absent: the file line
    order), ``session`` (``session_id`` as a dense code 0, 1, ... in order of first arrival, -1 without
    one), ``turn`` (1-based order within the session, -1 without one), ``parent`` (row of the session's
    previous request, -1 for the first), ``tenant`` / ``adapter`` / ``salt`` from ``user`` / ``lora_name``
    / ``cache_salt`` (only when some line has them), ``output_offsets`` / ``output_values`` when every line
    has ``output_token_ids``. ``checksum`` is the file's sha256; ``name`` defaults to the file stem.
    """
    p = str(path)
    data = read_trace_bytes(path)
    lines: list[int] = []
    arrival: list[float] = []
    prompts: list[list[int]] = []
    out_len: list[int] = []
    outputs: list[list[int] | None] = []
    rid_raw: list[int | str | None] = []
    sess_raw: list[int | str | None] = []
    labels: dict[str, list[str | None]] = {col: [] for col in _LABELS.values()}
    seen_rid: dict[int | str, int] = {}
    prev_t, prev_ln = None, 0
    for ln, obj in iter_json_lines(p, data):
        t = get_number(p, ln, obj, "arrival_time")
        if not sort and prev_t is not None and t < prev_t:
            raise TraceFormatError(p, ln, "arrival_time", f"goes backwards: {t} s after {prev_t} s on line {prev_ln}")
        prev_t, prev_ln = t, ln
        prompt = obj.get("prompt_token_ids", _MISSING)
        if prompt is _MISSING:
            raise TraceFormatError(p, ln, "prompt_token_ids", "missing required field")
        prompt = check_int_list(p, ln, "prompt_token_ids", prompt)
        if len(prompt) > MAX_REQUEST_TOKENS:
            raise TraceFormatError(p, ln, "prompt_token_ids", f"more than {MAX_REQUEST_TOKENS:,} tokens")
        out_ids = obj.get("output_token_ids")
        if out_ids is not None:
            out_ids = check_int_list(p, ln, "output_token_ids", out_ids)
        if obj.get("output_length") is not None:
            ol = get_length(p, ln, obj, "output_length")
            if out_ids is not None and ol != len(out_ids):
                raise TraceFormatError(
                    p, ln, "output_length", f"is {ol} but output_token_ids has {len(out_ids)} tokens"
                )
        elif out_ids is not None:
            ol = len(out_ids)
        else:
            raise TraceFormatError(p, ln, "output_length", "missing: give output_length or output_token_ids")
        rid = _int_or_str(p, ln, obj, "request_id")
        if rid is not None:
            first = seen_rid.setdefault(rid, ln)
            if first != ln:
                raise TraceFormatError(p, ln, "request_id", f"duplicate id {rid!r}, first on line {first}")
        for key, col in _LABELS.items():
            v = obj.get(key)
            if v is not None and type(v) is not str:
                raise TraceFormatError(p, ln, key, f"expected a string or null, got {describe(v)}")
            labels[col].append(v)
        lines.append(ln)
        arrival.append(t)
        prompts.append(prompt)
        out_len.append(ol)
        outputs.append(out_ids)
        rid_raw.append(rid)
        sess_raw.append(_int_or_str(p, ln, obj, "session_id"))
    n = len(lines)
    if n == 0:
        raise TraceFormatError(p, None, None, "no requests (empty file)")
    t_arr = np.array(arrival, dtype=np.float64)
    order = np.argsort(t_arr, kind="stable") if sort else np.arange(n)
    t0 = float(t_arr.min())
    rows = order.tolist()
    prompts = [prompts[i] for i in rows]
    counts = [len(x) for x in prompts]
    columns: dict[str, Any] = {}
    meta: dict[str, Any] = {"format": "request-log"}
    rid_col, rid_labels = _request_ids(p, lines, rid_raw)
    if rid_labels is not None:
        meta["request_id_labels"] = rid_labels
    columns["request_id"] = rid_col[order]
    if any(s is not None for s in sess_raw):
        columns.update(_sessions([sess_raw[i] for i in rows]))
    for col, vals in labels.items():
        if any(v is not None for v in vals):
            columns[col] = [vals[i] for i in rows]
    if all(o is not None for o in outputs):
        outs = [outputs[i] for i in rows]
        columns["output_offsets"] = csr([len(o) for o in outs])
        columns["output_values"] = int_array([x for o in outs for x in o])
    return Workload(
        arrival=t_arr[order] - t0,
        input_length=np.array(counts, dtype=np.int64),
        output_length=np.array(out_len, dtype=np.int64)[order],
        prompt_offsets=csr(counts),
        prompt_values=int_array([x for pr in prompts for x in pr]),
        kind="tokens",
        name=name if name is not None else Path(path).stem,
        source=p,
        checksum=sha256_bytes(data),
        meta=meta,
        **columns,
    )


def _int_or_str(path: str, ln: int, obj: dict, key: str) -> int | str | None:
    """``obj[key]`` as an int in ``[0, 2**63)`` or a string; None when absent or null."""
    v = obj.get(key)
    if v is None or type(v) is str:
        return v
    if type(v) is int and 0 <= v < 2**63:
        return v
    raise TraceFormatError(path, ln, key, f"expected an integer >= 0 or a string, got {describe(v)}")


def _request_ids(path: str, lines: list[int], raw: list[int | str | None]) -> tuple[np.ndarray, list[str] | None]:
    """The request_id column in file order, and the original strings when the ids are strings."""
    present = [r for r in raw if r is not None]
    if not present:
        return np.arange(len(raw), dtype=np.int64), None
    for ln, r in zip(lines, raw, strict=True):
        if r is None:
            raise TraceFormatError(path, ln, "request_id", "missing here but given on other lines")
    kind = type(raw[0])
    for ln, r in zip(lines, raw, strict=True):
        if type(r) is not kind:
            what = "an integer" if kind is int else "a string"
            raise TraceFormatError(path, ln, "request_id", f"{describe(r)}, but {what} on line {lines[0]}")
    if kind is int:
        return np.array(raw, dtype=np.int64), None
    return np.arange(len(raw), dtype=np.int64), [str(r) for r in raw]


def _sessions(raw: list[int | str | None]) -> dict[str, np.ndarray]:
    """``session`` (dense codes in order of first appearance, -1 = none), ``turn`` and ``parent`` columns."""
    n = len(raw)
    session = np.full(n, -1, dtype=np.int64)
    turn = np.full(n, -1, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    code: dict[tuple[type, int | str], int] = {}
    last: dict[int, int] = {}
    for i, s in enumerate(raw):
        if s is None:
            continue
        c = code.setdefault((type(s), s), len(code))  # 7 and "7" are different sessions
        session[i] = c
        prev = last.get(c)
        turn[i] = 1 if prev is None else turn[prev] + 1
        parent[i] = -1 if prev is None else prev
        last[c] = i
    return {"session": session, "turn": turn, "parent": parent}


def downsample_sessions(
    workload: Workload, *, fraction: float | None = None, count: int | None = None, seed: int = 0
) -> Workload:
    """Keep whole sessions: a uniform random sample of ``fraction`` (in (0, 1]) or ``count`` of them.

    Sampling unit: a session (every row with one ``session`` code); a row without a session (-1), or any
    row of a workload without a ``session`` column, is a unit of its own. ``fraction`` keeps
    ``round(fraction * units)`` units (at least 1); ``count`` keeps ``min(count, units)``. The units are
    drawn without replacement by ``numpy.random.default_rng(seed)`` (same seed, same rows), and the kept
    rows stay in their order with their arrival times unchanged; ``parent`` is re-indexed (a session is
    kept whole, so no parent is lost). ``meta["downsample"]`` records the sample.
    """
    if (fraction is None) == (count is None):
        raise ConfigError("downsample_sessions: give exactly one of fraction= or count=")
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1
    ):
        raise ConfigError(f"downsample_sessions: fraction must be a number in (0, 1], got {fraction!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1):
        raise ConfigError(f"downsample_sessions: count must be a positive number of sessions, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"downsample_sessions: seed must be an int >= 0, got {seed!r}")
    n = len(workload)
    sess = workload.session if workload.session is not None else np.full(n, -1, dtype=np.int64)
    # unit of each row: its session code, or (for rows without one) a code past every session's
    unit = np.where(sess >= 0, sess, int(sess.max(initial=-1)) + 1 + np.arange(n))
    units = np.unique(unit)
    k = min(int(count), len(units)) if count is not None else max(1, round(float(fraction) * len(units)))
    kept = np.random.default_rng(int(seed)).choice(units, size=k, replace=False)
    rows = np.flatnonzero(np.isin(unit, kept))
    out = workload.select(rows)
    out.meta["downsample"] = {
        "fraction": fraction, "count": count, "seed": int(seed), "units": int(len(units)), "kept_units": int(k),
        "rows": int(len(rows)),
    }
    return out
