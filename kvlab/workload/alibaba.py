"""Alibaba Qwen-Bailian KVCache traces (USENIX ATC'25 "KVCache Cache in the Wild").

One JSON object per line: ``chat_id`` (int), ``parent_chat_id`` (int, -1 for a first turn), ``timestamp``
(float, seconds from trace start), ``input_length``/``output_length`` (int tokens), ``type`` (str request
type), ``turn`` (int, 1 = first) and ``hash_ids`` (one id per 16-token block, ``ceil(input_length/16)``
of them). The ids are per-block content hashes, **not** prefix-chained: the same id recurs after
different prefixes. The loader chains them (see :func:`chain_block_ids`) so that, as everywhere in
kvlab, an id names a block *and its whole prefix*.

Sessions: ``session`` is the ``chat_id`` of the earliest request of the ``parent_chat_id`` chain that is
in the file. When the chain leads to a ``parent_chat_id`` that is not in the file (the file is a sample,
or the parent is before the trace window), the session is that missing parent's id, the earliest id the
chain names: siblings and descendants of one missing parent share a session. ``parent`` is the row index
of ``parent_chat_id`` in the file, -1 for first turns and for parents that are not in the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload._common import (
    block_size_arg,
    check_block_count,
    csr,
    get_int,
    get_int_list,
    get_length,
    get_number,
    get_str,
    int_array,
    iter_json_lines,
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.workload import Workload, _gather_ranges

ALIBABA_BLOCK_SIZE = 16


def chain_block_ids(offsets: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Prefix-chain per-block content ids given in CSR form (``offsets`` [n + 1], ``raw`` [total]).

    ``chained[j]`` is the dense id of the pair ``(chained[j - 1] or -1 at a request's first block,
    raw[j])``, ids numbered 0, 1, 2, ... in order of first appearance in the flat array. So two blocks get
    the same chained id iff their requests agree on every raw id up to and including that block.
    Equivalent to a dict over pairs, but vectorised level by level (block position), so memory stays
    O(total) int64 arrays; time is O(total log total) plus a small cost per distinct position.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    raw = np.asarray(raw, dtype=np.int64)
    total = len(raw)
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    counts = np.diff(offsets)
    pos = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], counts)
    # Pair keys (local previous id, raw id) must fit in int64: use raw ids directly when small enough.
    if raw.min() >= 0 and (int(raw.max()) + 1) * total < 2**62:
        codes, k = raw, int(raw.max()) + 1
    else:
        uniq, codes = np.unique(raw, return_inverse=True)
        codes, k = codes.reshape(-1).astype(np.int64), len(uniq)
        if k * total >= 2**62:
            raise ConfigError(f"chain_block_ids: {total} blocks x {k} distinct ids overflow int64 pair keys")
    order = np.argsort(pos, kind="stable")  # flat indices grouped by position, ascending within a group
    bounds = np.searchsorted(pos[order], np.arange(int(pos.max()) + 2))
    tmp = np.empty(total, dtype=np.int64)  # per-level ids: level L's ids are [base_L, base_L+1)
    first = np.empty(total, dtype=np.int64)  # flat index of each per-level id's first occurrence
    base = prev_base = 0
    for level in range(len(bounds) - 1):
        idx = order[bounds[level] : bounds[level + 1]]
        key = codes[idx] if level == 0 else (tmp[idx - 1] - prev_base) * k + codes[idx]
        _, first_in, inv = np.unique(key, return_index=True, return_inverse=True)
        tmp[idx] = base + inv.reshape(-1)
        first[base : base + len(first_in)] = idx[first_in]
        prev_base, base = base, base + len(first_in)
    # Renumber in order of first appearance in the flat array.
    rank = np.empty(base, dtype=np.int64)
    rank[np.argsort(first[:base], kind="stable")] = np.arange(base, dtype=np.int64)
    return rank[tmp]


def load_alibaba(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    block_size: int = ALIBABA_BLOCK_SIZE,
    sort: bool = False,
    chain: bool = True,
) -> Workload:
    """Load an Alibaba Bailian JSONL trace as a ``kind="blocks"`` Workload (ids chained on load).

    Validation as for Mooncake: every field present and typed (ints are JSON integers; ``timestamp`` a
    finite number; ``type`` a string), lengths in ``[0, MAX_REQUEST_TOKENS]``, no key twice,
    ``len(hash_ids) == ceil(input_length / block_size)``, ``chat_id`` unique, ``parent_chat_id`` -1 or
    another request's id, no parent cycles, timestamps non-decreasing. Errors raise
    ``TraceFormatError(path, line, field, msg)``; an unreadable path ``TraceFileError``.

    ``sort=True`` stably sorts rows by timestamp instead of rejecting a file whose timestamps go
    backwards (the public files and the 20-record sample are sorted, so the default is strict).
    ``chain=False`` keeps the raw, unchained ids: an *unsafe* variant for studying what position-
    independent keys would do (``meta["chained"]`` records the choice).

    Columns: ``request_id`` = chat_id, ``category`` = type, ``turn``, ``session`` and ``parent`` as in the
    module docstring; ``arrival`` = timestamp (s).
    """
    block_size = block_size_arg("load_alibaba", block_size)
    p = str(path)
    data = read_trace_bytes(path)
    chat: list[int] = []
    parent_id: list[int] = []
    ts: list[float] = []
    in_len: list[int] = []
    out_len: list[int] = []
    types: list[str] = []
    turns: list[int] = []
    counts: list[int] = []
    flat: list[int] = []
    lines: list[int] = []
    prev_t, prev_ln = None, 0
    for ln, obj in iter_json_lines(p, data):
        cid = get_int(p, ln, obj, "chat_id", min_value=0)
        pid = get_int(p, ln, obj, "parent_chat_id", min_value=-1)
        if pid == cid:
            raise TraceFormatError(p, ln, "parent_chat_id", f"request {cid} names itself as its parent")
        t = get_number(p, ln, obj, "timestamp")
        il = get_length(p, ln, obj, "input_length")
        ol = get_length(p, ln, obj, "output_length")
        typ = get_str(p, ln, obj, "type")
        turn = get_int(p, ln, obj, "turn", min_value=0)
        ids = get_int_list(p, ln, obj, "hash_ids")
        check_block_count(p, ln, "hash_ids", len(ids), il, block_size)
        if not sort and prev_t is not None and t < prev_t:
            raise TraceFormatError(
                p,
                ln,
                "timestamp",
                f"goes backwards: {t} s after {prev_t} s on line {prev_ln} (load with sort=True to reorder)",
            )
        prev_t, prev_ln = t, ln
        chat.append(cid)
        parent_id.append(pid)
        ts.append(t)
        in_len.append(il)
        out_len.append(ol)
        types.append(typ)
        turns.append(turn)
        counts.append(len(ids))
        flat.extend(ids)
        lines.append(ln)

    arrival = np.array(ts, dtype=np.float64)
    chat_a = np.array(chat, dtype=np.int64)
    parent_a = np.array(parent_id, dtype=np.int64)
    line_a = np.array(lines, dtype=np.int64)
    in_a = np.array(in_len, dtype=np.int64)
    out_a = np.array(out_len, dtype=np.int64)
    turn_a = np.array(turns, dtype=np.int64)
    offsets = csr(counts)
    raw = int_array(flat)
    category = pd.Categorical(types)
    n = len(arrival)

    if sort and n > 1 and np.any(np.diff(arrival) < 0):
        order = np.argsort(arrival, kind="stable")
        starts, cnt = offsets[order], np.diff(offsets)[order]
        raw = _gather_ranges(raw, starts, cnt)
        offsets = csr(cnt)
        arrival, chat_a, parent_a, line_a = arrival[order], chat_a[order], parent_a[order], line_a[order]
        in_a, out_a, turn_a, category = in_a[order], out_a[order], turn_a[order], category[order]

    parent_row, session = _link_sessions(p, chat_a, parent_a, line_a)
    values = chain_block_ids(offsets, raw) if chain else raw
    return Workload(
        arrival=arrival,
        input_length=in_a,
        output_length=out_a,
        prompt_offsets=offsets,
        prompt_values=values,
        kind="blocks",
        block_size=block_size,
        request_id=chat_a,
        session=session,
        turn=turn_a,
        parent=parent_row,
        category=category,
        name=name if name is not None else Path(path).stem,
        source=p,
        checksum=sha256_bytes(data),
        meta={
            "format": "alibaba",
            "chained": chain,
            "distinct_blocks": int(values.max()) + 1 if chain and len(values) else None,
            "sorted_on_load": bool(sort),
        },
    )


def _link_sessions(path: str, chat: np.ndarray, parent: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row index of each parent (-1 if root/absent) and the session id (see module docstring)."""
    n = len(chat)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    sorter = np.argsort(chat, kind="stable")
    sorted_ids = chat[sorter]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if len(dup):
        rows = sorter[[dup[0], dup[0] + 1]]
        first, second = int(lines[rows].min()), int(lines[rows].max())
        raise TraceFormatError(
            path, second, "chat_id", f"duplicate chat_id {int(sorted_ids[dup[0]])} (first on line {first})"
        )
    pos = np.minimum(np.searchsorted(sorted_ids, parent), n - 1)
    found = (parent >= 0) & (sorted_ids[pos] == parent)
    parent_row = np.where(found, sorter[pos], -1)
    # Pointer doubling: f(i) = parent row, or i itself at a chain's top; f^(2^k) converges to the top.
    top = np.where(parent_row >= 0, parent_row, np.arange(n))
    for _ in range(int(n).bit_length() + 1):
        nxt = top[top]
        if np.array_equal(nxt, top):
            break
        top = nxt
    cyc = np.flatnonzero(parent_row[top] >= 0)  # a chain top that still has a parent lies on a cycle
    if len(cyc):
        raise TraceFormatError(path, int(lines[cyc].min()), "parent_chat_id", "parent_chat_id links form a cycle")
    session = np.where(parent[top] >= 0, parent[top], chat[top])
    return parent_row.astype(np.int64), session.astype(np.int64)
