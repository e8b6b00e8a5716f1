"""kvlab native Parquet: the same fields as columns, the header as JSON under schema metadata ``kvlab``.

Columns: ``tokens``/``hash_ids``/``output_tokens`` as ``list<int64>``, categoricals as dictionary
columns, ``parent`` as a nullable int64 request id (fields and header: :mod:`.native_schema`). Checks are
per column, so errors name file, field and ``row i``. :func:`save_parquet` writes atomically (temp file
beside the target, then ``os.replace``) and round-trips exactly with :func:`load_parquet`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload._common import (
    INT64_MAX,
    MAX_REQUEST_TOKENS,
    Tokenizer,
    atomic_path,
    block_size_arg,
    check_int_list,
    csr,
    describe,
    encode_text,
    field_label,
    int_array,
    one_line,
    parse_json_text,
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.native_schema import (
    COLUMN_KEYS,
    INT_ABSENT,
    OPTIONAL_COLUMNS,
    SEGMENTS_NEED_IDS,
    build_segments,
    check_parents_resolvable,
    default_header,
    make_header,
    optional_columns,
    parse_header,
    parse_segments,
    prompt_key,
    segments_records,
)
from kvlab.workload.segments import Segments
from kvlab.workload.workload import CATEGORICAL_COLUMNS, Workload

SEGMENTS_TYPE = pa.list_(
    pa.struct([("kind", pa.string()), ("start", pa.int64()), ("end", pa.int64()), ("text", pa.string())])
)
"""The ``segments`` column: per request a list of ``{kind, start, end, text}`` (text null when unknown)."""


def _segments_column(p: str, table: pa.Table, in_len: np.ndarray) -> Segments:
    """The ``segments`` column checked row by row (the JSONL rules: :func:`.native_schema.parse_segments`)."""
    col = table.column("segments")
    if not pa.types.is_list(col.type) or not pa.types.is_struct(col.type.value_type):
        got = one_line(str(col.type), 80)
        raise TraceFormatError(p, None, "segments", f"expected a list<struct> column, got {got}")
    per_request = []
    for i, v in enumerate(col.to_pylist()):
        if v is not None:
            v = [{k: x for k, x in s.items() if not (k == "text" and x is None)} if type(s) is dict else s for s in v]
        per_request.append(parse_segments(p, None, [] if v is None else v, int(in_len[i]), f"row {i}: "))
    return build_segments(p, per_request, None)


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """A ``list<int64>`` array (``large_list`` past 2**31 values) from CSR arrays."""
    vals = pa.array(values, type=pa.int64())
    if len(values) < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), vals)
    return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), vals)


def _dict_array(cat: pd.Categorical) -> pa.Array:
    """A dictionary array (string values if every label is a string, else int64) with nulls for code -1."""
    codes = np.asarray(cat.codes, dtype=np.int32)
    names = cat.categories.tolist()
    typ = pa.string() if all(type(x) is str for x in names) else pa.int64()
    return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), pa.array(names, type=typ))


def save_parquet(workload: Workload, path: str | os.PathLike) -> Path:
    """Write ``workload`` as kvlab Parquet (header in schema metadata ``kvlab``) atomically; return path."""
    w = workload
    check_parents_resolvable(w)
    head = make_header(w)
    data: dict[str, pa.Array] = {
        "request_id": pa.array(w.request_id, type=pa.int64()),
        "arrival": pa.array(w.arrival, type=pa.float64()),
        "input_length": pa.array(w.input_length, type=pa.int64()),
        "output_length": pa.array(w.output_length, type=pa.int64()),
        ("hash_ids" if w.kind == "blocks" else "tokens"): _list_array(w.prompt_offsets, w.prompt_values),
    }
    for c in ("session", "turn"):
        if getattr(w, c) is not None:
            data[c] = pa.array(getattr(w, c), type=pa.int64())
    if w.parent is not None:
        data["parent"] = pa.array(w.request_id[np.maximum(w.parent, 0)], type=pa.int64(), mask=w.parent < 0)
    for c in CATEGORICAL_COLUMNS:
        if getattr(w, c) is not None:
            data[c] = _dict_array(getattr(w, c))
    if w.output_offsets is not None:
        data["output_tokens"] = _list_array(w.output_offsets, w.output_values)
    if w.segments is not None:
        data["segments"] = pa.array(segments_records(w), type=SEGMENTS_TYPE)
    table = pa.table(data).replace_schema_metadata({"kvlab": json.dumps(head)})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def load_parquet(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    tokenizer: Tokenizer | None = None,
    block_size: int | None = None,
) -> Workload:
    """Load a kvlab Parquet trace (:mod:`.native_schema` has the fields); errors name file, field and row.

    Files without the ``kvlab`` metadata (written by other tools) load too: the kind follows from the
    prompt column, and a ``hash_ids`` file then needs ``block_size``. Columns whose name starts with
    ``__`` (pandas index columns) are ignored; other unknown columns are errors.
    """
    p = str(path)
    if block_size is not None:
        block_size = block_size_arg("load_parquet", block_size)
    data = read_trace_bytes(path)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        why = one_line(str(e)) or type(e).__name__
        raise TraceFormatError(p, None, None, f"not a readable Parquet file: {why}") from None
    dup = sorted({c for c in table.column_names if table.column_names.count(c) > 1})
    if dup:
        raise TraceFormatError(p, None, field_label(dup[0]), "column appears more than once")
    md = table.schema.metadata or {}
    if b"kvlab" in md:
        try:
            raw_head = parse_json_text(p, None, md[b"kvlab"])
        except TraceFormatError as e:
            raise TraceFormatError(p, None, "kvlab", f"schema metadata 'kvlab' is not JSON: {e.message}") from None
        if type(raw_head) is not dict:
            raise TraceFormatError(p, None, "kvlab", "schema metadata 'kvlab' is not a JSON object")
        hd = parse_header(p, None, raw_head)
    else:
        hd = default_header(p)
    names = [c for c in table.column_names if not c.startswith("__")]
    unknown = [c for c in names if c not in COLUMN_KEYS]
    if unknown:
        raise TraceFormatError(p, None, field_label(unknown[0]), "unknown column")
    key, kind = prompt_key(p, None, names, list_found=False)
    if hd["kind"] is not None and hd["kind"] != kind:
        raise TraceFormatError(p, None, key, f"column {key!r} in a {hd['kind']} trace")
    bs = hd["block_size"]
    if block_size is not None and bs is not None and block_size != bs:
        raise TraceFormatError(p, None, "block_size", f"metadata says {bs}, the argument says {block_size}")
    bs = bs if bs is not None else block_size
    if kind == "blocks" and bs is None:
        raise TraceFormatError(p, None, "block_size", "hash_ids need a block_size (metadata or argument)")

    arrival = _numeric_column(p, table, "arrival", floating=True)
    if len(arrival) > 1 and np.any(np.diff(arrival) < 0):
        i = int(np.flatnonzero(np.diff(arrival) < 0)[0]) + 1
        raise TraceFormatError(p, None, "arrival", f"row {i}: goes backwards ({arrival[i]} s after {arrival[i - 1]} s)")
    out_len = _length_column(p, table, "output_length")
    n = len(arrival)
    if key == "text":
        if tokenizer is None:
            raise ConfigError(f"{p}: column 'text' needs a tokenizer; pass tokenizer=... (encode(str) -> list[int])")
        texts = table.column("text").to_pylist()
        prompts = []
        for i, t in enumerate(texts):
            if type(t) is not str:
                raise TraceFormatError(p, None, "text", f"row {i}: expected a string, got {describe(t)}")
            prompts.append(check_int_list(p, None, "text", encode_text(tokenizer, t)))
        counts = np.array([len(x) for x in prompts], dtype=np.int64)
        offsets, values = csr(counts), int_array([v for x in prompts for v in x])
    else:
        offsets, values = _list_column(p, table, key, nullable=False)
        counts = np.diff(offsets)
    if "input_length" in names:
        in_len = _length_column(p, table, "input_length")
    elif kind == "blocks":
        raise TraceFormatError(p, None, "input_length", "missing required column (hash_ids traces)")
    else:
        in_len = counts
    expected = -(-in_len // bs) if kind == "blocks" else in_len
    bad = np.flatnonzero(counts != expected)
    if len(bad):
        i = int(bad[0])
        what = f"ceil(input_length {in_len[i]} / block_size {bs})" if kind == "blocks" else "input_length"
        raise TraceFormatError(p, None, key, f"row {i}: has {counts[i]} ids, expected {what} = {expected[i]}")

    cols: dict[str, list] = {c: [INT_ABSENT.get(c)] * n for c in OPTIONAL_COLUMNS}
    pres = set(hd["columns"]) | {c for c in names if c in OPTIONAL_COLUMNS}
    for c, absent in INT_ABSENT.items():
        if c in names:
            cols[c] = _int_column_list(p, table, c, nullable=c != "request_id", fill=absent)
    for c in CATEGORICAL_COLUMNS:
        if c in names:
            cols[c] = _category_values(p, table, c)
    out_counts, out_flat = np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if "output_tokens" in names:
        o_off, out_flat = _list_column(p, table, "output_tokens", nullable=True)
        out_counts = np.diff(o_off)
    kw = optional_columns(p, pres, cols, None, hd, out_counts, out_flat)
    if "segments" in names and key == "text":
        raise TraceFormatError(p, None, "segments", SEGMENTS_NEED_IDS)
    if "segments" in pres:
        present = "segments" in names
        kw["segments"] = _segments_column(p, table, in_len) if present else build_segments(p, [[]] * n, None)
    return Workload(
        arrival=arrival,
        input_length=in_len,
        output_length=out_len,
        prompt_offsets=offsets,
        prompt_values=values,
        kind=kind,
        block_size=bs if kind == "blocks" else None,
        name=name if name is not None else hd["name"] or Path(path).stem,
        source=p,
        checksum=sha256_bytes(data),
        meta=hd["meta"],
        **kw,
    )


def _numeric_column(
    p: str,
    table: pa.Table,
    c: str,
    *,
    floating: bool = False,
    min_value: int | None = None,
    max_value: int | None = None,
) -> np.ndarray:
    """A required numeric column as float64 (``floating``) or int64 (within int64), without nulls."""
    if c not in table.column_names:
        raise TraceFormatError(p, None, c, "missing required column")
    col = table.column(c)
    typ = col.type
    ok = pa.types.is_integer(typ) or (floating and pa.types.is_floating(typ))
    if not ok:
        what = "a numeric" if floating else "an integer"
        raise TraceFormatError(p, None, c, f"expected {what} column, got {one_line(str(typ), 80)}")
    if col.null_count:
        raise TraceFormatError(p, None, c, f"row {_first_null(col)}: null")
    raw = col.to_numpy()
    if not floating:
        _check_int64(p, c, raw)
    arr = raw.astype(np.float64 if floating else np.int64)
    if floating and not np.all(np.isfinite(arr)):
        i = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise TraceFormatError(p, None, c, f"row {i}: must be finite, got {arr[i]}")
    if min_value is not None and np.any(arr < min_value):
        i = int(np.flatnonzero(arr < min_value)[0])
        raise TraceFormatError(p, None, c, f"row {i}: must be >= {min_value}, got {arr[i]}")
    if max_value is not None and np.any(arr > max_value):
        i = int(np.flatnonzero(arr > max_value)[0])
        raise TraceFormatError(p, None, c, f"row {i}: must be <= {max_value:,}, got {arr[i]}")
    return arr


def _length_column(p: str, table: pa.Table, c: str) -> np.ndarray:
    """A required token-count column: int64 in ``[0, MAX_REQUEST_TOKENS]`` (the JSONL ``get_length`` rule)."""
    return _numeric_column(p, table, c, min_value=0, max_value=MAX_REQUEST_TOKENS)


def _first_null(col: pa.Array | pa.ChunkedArray) -> int:
    """Row index of the first null of ``col`` (which has one)."""
    return int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])


def _check_int64(p: str, c: str, values: np.ndarray) -> None:
    """Refuse uint64 values that int64 cannot hold (they would wrap to negatives)."""
    if values.dtype == np.uint64 and len(values) and values.max() > INT64_MAX:
        i = int(np.flatnonzero(values > INT64_MAX)[0])
        raise TraceFormatError(p, None, c, f"row {i}: {values[i]} does not fit in int64")


def _int_column_list(p: str, table: pa.Table, c: str, *, nullable: bool, fill: int | None) -> list:
    """An optional int column as a Python list (nulls → ``fill``; not allowed unless ``nullable``)."""
    col = table.column(c)
    if not pa.types.is_integer(col.type):
        raise TraceFormatError(p, None, c, f"expected an integer column, got {one_line(str(col.type), 80)}")
    if col.null_count and not nullable:
        raise TraceFormatError(p, None, c, f"row {_first_null(col)}: null")
    values = col.to_pylist()
    big = next((i for i, v in enumerate(values) if v is not None and v > INT64_MAX), None)
    if big is not None:
        raise TraceFormatError(p, None, c, f"row {big}: {values[big]} does not fit in int64")
    return [fill if v is None else v for v in values]


def _category_values(p: str, table: pa.Table, c: str) -> list:
    """A label column (string or integer, plain or dictionary) as a Python list, None for null."""
    col = table.column(c)
    typ = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_integer(typ)):
        got = one_line(str(col.type), 80)
        raise TraceFormatError(p, None, c, f"expected a string or integer (dictionary) column, got {got}")
    return col.to_pylist()


def _list_column(p: str, table: pa.Table, c: str, *, nullable: bool) -> tuple[np.ndarray, np.ndarray]:
    """A ``list<int>`` column as CSR (offsets, int64 values); values must be >= 0."""
    col = table.column(c)
    typ = col.type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not pa.types.is_integer(typ.value_type):
        raise TraceFormatError(p, None, c, f"expected a list<int64> column, got {one_line(str(typ), 80)}")
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if arr.null_count and not nullable:
        raise TraceFormatError(p, None, c, f"row {_first_null(arr)}: null")
    counts = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    flat = arr.flatten()
    if flat.null_count:
        raise TraceFormatError(p, None, c, "null inside a list")
    if len(flat) and pa.types.is_uint64(typ.value_type) and pc.max(flat).as_py() > 2**63 - 1:
        raise TraceFormatError(p, None, c, "values do not fit in int64")
    values = flat.to_numpy().astype(np.int64) if len(flat) else np.zeros(0, dtype=np.int64)
    offsets = csr(counts)
    if len(values) and values.min() < 0:
        j = int(np.flatnonzero(values < 0)[0])
        i = int(np.searchsorted(offsets, j, side="right") - 1)
        raise TraceFormatError(p, None, c, f"row {i}: values must be >= 0, found {values[j]}")
    return offsets, values
