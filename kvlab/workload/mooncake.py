"""Mooncake (Kimi, FAST'25) request traces.

One JSON object per line: ``{"timestamp": int ms, "input_length": int, "output_length": int,
"hash_ids": [int, ...]}``. ``hash_ids`` are already prefix-chained 512-token block ids (an id names the
block and its whole prefix), so they are kept as they are. Timestamps are milliseconds from trace start
and never decrease in file order; the loader enforces that, and every other rule below, line by line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvlab.errors import TraceFormatError
from kvlab.workload._common import (
    check_block_count,
    csr,
    get_int,
    get_int_list,
    get_length,
    int_array,
    iter_json_lines,
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.workload import Workload

MOONCAKE_BLOCK_SIZE = 512


def load_mooncake(path: str | os.PathLike, *, name: str | None = None) -> Workload:
    """Load a Mooncake JSONL trace as a ``kind="blocks"`` Workload with ``block_size=512``.

    Per line: ``timestamp`` (int, ms, non-decreasing), ``input_length``/``output_length`` (ints in
    ``[0, MAX_REQUEST_TOKENS]``) and ``hash_ids`` (list of ints >= 0, exactly ``ceil(input_length / 512)``
    of them). Blank lines are skipped; unknown keys are ignored; a key given twice is an error. Any
    violation raises ``TraceFormatError(path, line, field, msg)``; an unreadable path ``TraceFileError``.
    ``arrival = timestamp / 1000`` seconds; ``checksum`` is the sha256 of the file; ``name`` defaults
    to the file stem. The 12,031-line conversation trace loads in about 0.2 s.
    """
    p = str(path)
    data = read_trace_bytes(path)
    ts: list[int] = []
    in_len: list[int] = []
    out_len: list[int] = []
    counts: list[int] = []
    flat: list[int] = []
    prev_t, prev_ln = None, 0
    bs = MOONCAKE_BLOCK_SIZE
    for ln, obj in iter_json_lines(p, data):
        t = get_int(p, ln, obj, "timestamp")
        il = get_length(p, ln, obj, "input_length")
        ol = get_length(p, ln, obj, "output_length")
        ids = get_int_list(p, ln, obj, "hash_ids")
        check_block_count(p, ln, "hash_ids", len(ids), il, bs)
        if prev_t is not None and t < prev_t:
            raise TraceFormatError(p, ln, "timestamp", f"goes backwards: {t} ms after {prev_t} ms on line {prev_ln}")
        prev_t, prev_ln = t, ln
        ts.append(t)
        in_len.append(il)
        out_len.append(ol)
        counts.append(len(ids))
        flat.extend(ids)
    return Workload(
        arrival=np.array(ts, dtype=np.int64) / 1000.0,
        input_length=np.array(in_len, dtype=np.int64),
        output_length=np.array(out_len, dtype=np.int64),
        prompt_offsets=csr(counts),
        prompt_values=int_array(flat),
        kind="blocks",
        block_size=bs,
        name=name if name is not None else Path(path).stem,
        source=p,
        checksum=sha256_bytes(data),
        meta={"format": "mooncake", "chained": True},
    )
