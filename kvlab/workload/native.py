"""kvlab's own trace formats: JSONL and Parquet, lossless for every :class:`Workload` column.

JSONL: an optional first line is a header ``{"kvlab_trace": 1, "kind": "blocks", "block_size": 16, ...}``;
every other line is one request::

    {"arrival": 0.25, "output_length": 128, "tokens": [1, 2, 3], "request_id": 7, "tenant": "a", ...}

Per request: ``arrival`` (seconds, number, non-decreasing), ``output_length`` (int >= 0) and exactly one
prompt: ``tokens`` (token ids), ``text`` (tokenised by the loader's ``tokenizer``) or ``hash_ids`` with
``input_length`` (chained block ids of ``block_size`` tokens; the block size comes from the header, a
per-record ``block_size`` that must agree, or the loader's ``block_size`` argument). Optional:
``input_length`` (tokens records: must equal the token count), ``request_id``, ``session``, ``turn``
(ints), ``parent`` (the *request_id* of the previous turn, null for none), ``tenant``, ``category``,
``adapter``, ``salt`` (string or int, null for none), ``output_tokens`` (ids of a known answer).
Unknown keys are errors (the format is ours; typos should not pass silently).

Header keys: ``kvlab_trace`` (format version, 1), ``kind`` ("tokens" | "blocks"), ``block_size``,
``name``, ``columns`` (optional columns present, so empty files round-trip), ``categories`` (per
categorical column the category list in order, so codes and unused categories round-trip),
``ordered`` (categorical columns that are ordered) and ``meta`` (the Workload's meta dict).

Parquet: the same fields as columns (``tokens``/``hash_ids``/``output_tokens`` as ``list<int64>``,
categoricals as dictionary columns, ``parent`` as nullable int64 request id) and the header as JSON under
the schema metadata key ``kvlab``. :func:`save_jsonl` and :func:`save_parquet` write atomically (temp
file beside the target, then ``os.replace``) and round-trip exactly with the loaders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
    atomic_open,
    atomic_path,
    block_size_arg,
    check_block_count,
    check_int_list,
    csr,
    describe,
    encode_text,
    field_label,
    get_int,
    get_length,
    get_number,
    get_str,
    int_array,
    iter_json_lines,
    one_line,
    parse_json_text,
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.workload import CATEGORICAL_COLUMNS, Workload

FORMAT_VERSION = 1
PROMPT_KEYS = ("tokens", "text", "hash_ids")
OPTIONAL_COLUMNS = ("request_id", "session", "turn", "parent", *CATEGORICAL_COLUMNS, "output_tokens")
RECORD_KEYS = frozenset(("arrival", "output_length", "input_length", "block_size", *PROMPT_KEYS, *OPTIONAL_COLUMNS))
HEADER_KEYS = frozenset(("kvlab_trace", "kind", "block_size", "name", "columns", "categories", "ordered", "meta"))


# ---------------------------------------------------------------------------------------------- header
def _parse_header(path: str, ln: int | None, obj: dict) -> dict:
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
    bs = obj.get("block_size")
    if bs is not None:
        bs = get_int(path, ln, obj, "block_size", min_value=1, max_value=MAX_REQUEST_TOKENS)
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
        c not in CATEGORICAL_COLUMNS or type(v) is not list or not all(_is_cat_value(x) for x in v)
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


def _is_cat_value(x: Any) -> bool:
    return type(x) is str or type(x) is int


def _header(w: Workload) -> dict:
    """The header object describing ``w`` (shared by both writers)."""
    columns = [c for c in OPTIONAL_COLUMNS if c != "output_tokens" and getattr(w, c) is not None]
    if w.output_offsets is not None:
        columns.append("output_tokens")
    cats: dict[str, list] = {}
    ordered = []
    for c in CATEGORICAL_COLUMNS:
        col = getattr(w, c)
        if col is None:
            continue
        values = col.categories.tolist()
        if not all(_is_cat_value(x) for x in values):
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


def _check_parents_resolvable(w: Workload) -> None:
    if w.parent is not None and np.any(w.parent >= 0) and len(np.unique(w.request_id)) != len(w):
        raise ConfigError("cannot save 'parent' as request ids: Workload.request_id has duplicates")


# ---------------------------------------------------------------------------------------------- JSONL
def load_jsonl(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    tokenizer: Tokenizer | None = None,
    block_size: int | None = None,
) -> Workload:
    """Load a kvlab JSONL trace (module docstring has the schema); errors name file, line and field.

    ``tokenizer`` is needed only for ``text`` records; ``block_size`` only for a headerless ``hash_ids``
    file whose records carry no ``block_size``. ``name`` defaults to the header's name, else the stem.
    """
    p = str(path)
    if block_size is not None:
        block_size = block_size_arg("load_jsonl", block_size)
    data = read_trace_bytes(path)
    header: dict | None = None
    kind: str | None = None
    bs = block_size
    bs_from = "the block_size argument" if block_size is not None else None
    arrival: list[float] = []
    out_len: list[int] = []
    in_len: list[int] = []
    counts: list[int] = []
    flat: list[int] = []
    lines: list[int] = []
    cols: dict[str, list] = {c: [] for c in OPTIONAL_COLUMNS}
    out_counts: list[int] = []
    out_flat: list[int] = []
    seen: set[str] = set()
    prev_a, prev_ln = None, 0
    for ln, obj in iter_json_lines(p, data):
        if "kvlab_trace" in obj:
            if header is not None or lines:
                raise TraceFormatError(p, ln, "kvlab_trace", "the header must be the first line")
            header = _parse_header(p, ln, obj)
            kind = header["kind"]
            if header["block_size"] is not None:
                if bs is not None and bs != header["block_size"]:
                    raise TraceFormatError(
                        p, ln, "block_size", f"header says {header['block_size']}, {bs_from} says {bs}"
                    )
                bs, bs_from = header["block_size"], f"the header (line {ln})"
            continue
        unknown = sorted(set(obj) - RECORD_KEYS)
        if unknown:
            raise TraceFormatError(p, ln, field_label(unknown[0]), "unknown field")
        a = get_number(p, ln, obj, "arrival")
        if prev_a is not None and a < prev_a:
            raise TraceFormatError(p, ln, "arrival", f"goes backwards: {a} s after {prev_a} s on line {prev_ln}")
        prev_a, prev_ln = a, ln
        ol = get_length(p, ln, obj, "output_length")
        present = [k for k in PROMPT_KEYS if k in obj]
        if len(present) != 1:
            field = present[1] if present else "tokens"
            raise TraceFormatError(p, ln, field, f"need exactly one of tokens/text/hash_ids, got {present}")
        key = present[0]
        rkind = "blocks" if key == "hash_ids" else "tokens"
        if kind is None:
            kind = rkind
        elif rkind != kind:
            raise TraceFormatError(p, ln, key, f"a {rkind} record in a {kind} trace")
        if key == "hash_ids":
            ids = check_int_list(p, ln, key, obj[key])
            il = get_length(p, ln, obj, "input_length")
            rbs = get_int(p, ln, obj, "block_size", min_value=1, max_value=MAX_REQUEST_TOKENS, default=None)
            if rbs is not None:
                if bs is not None and rbs != bs:
                    raise TraceFormatError(p, ln, "block_size", f"{rbs} disagrees with {bs} from {bs_from}")
                bs, bs_from = rbs, f"line {ln}"
            if bs is None:
                raise TraceFormatError(
                    p, ln, "block_size", "hash_ids need a block_size (header line, record key or argument)"
                )
            check_block_count(p, ln, key, len(ids), il, bs)
        else:
            if "block_size" in obj:
                raise TraceFormatError(p, ln, "block_size", "only hash_ids records have a block_size")
            if key == "tokens":
                ids = check_int_list(p, ln, key, obj[key])
            else:
                text = get_str(p, ln, obj, "text")
                if tokenizer is None:
                    raise ConfigError(
                        f"{p}:{ln}: record has 'text' but no tokenizer was given; pass tokenizer=... "
                        "(any object with encode(str) -> list[int], e.g. a Hugging Face tokenizer)"
                    )
                ids = check_int_list(p, ln, "text", encode_text(tokenizer, text))
            il = len(ids)
            if "input_length" in obj and get_int(p, ln, obj, "input_length") != il:
                raise TraceFormatError(
                    p, ln, "input_length", f"is {obj['input_length']} but the prompt has {il} tokens"
                )
        _read_optional(p, ln, obj, cols, out_counts, out_flat)
        seen.update(obj)
        arrival.append(a)
        out_len.append(ol)
        in_len.append(il)
        counts.append(len(ids))
        flat.extend(ids)
        lines.append(ln)

    hd = header or _parse_header(p, None, {"kvlab_trace": FORMAT_VERSION})
    kind = kind or "tokens"
    present = (seen | set(hd["columns"])) & set(OPTIONAL_COLUMNS)
    kw = _optional_columns(p, present, cols, lines, hd, out_counts, out_flat)
    return Workload(
        arrival=np.array(arrival, dtype=np.float64),
        input_length=np.array(in_len, dtype=np.int64),
        output_length=np.array(out_len, dtype=np.int64),
        prompt_offsets=csr(counts),
        prompt_values=int_array(flat),
        kind=kind,
        block_size=bs if kind == "blocks" else None,
        name=name if name is not None else hd["name"] or Path(path).stem,
        source=p,
        checksum=sha256_bytes(data),
        meta=hd["meta"],
        **kw,
    )


def _read_optional(
    p: str, ln: int, obj: dict, cols: dict[str, list], out_counts: list[int], out_flat: list[int]
) -> None:
    """Append this record's optional values (None where absent) to ``cols``."""
    cols["request_id"].append(get_int(p, ln, obj, "request_id", default=None))
    cols["session"].append(get_int(p, ln, obj, "session", default=-1))
    cols["turn"].append(get_int(p, ln, obj, "turn", default=-1))
    par = obj.get("parent")
    cols["parent"].append(None if par is None else get_int(p, ln, obj, "parent"))
    for c in CATEGORICAL_COLUMNS:
        v = obj.get(c)
        if v is not None and not _is_cat_value(v):
            raise TraceFormatError(p, ln, c, f"expected a string, int or null, got {describe(v)}")
        cols[c].append(v)
    ot = obj.get("output_tokens")
    if ot is None:
        out_counts.append(0)
    else:
        ot = check_int_list(p, ln, "output_tokens", ot)
        out_counts.append(len(ot))
        out_flat.extend(ot)


def _optional_columns(
    p: str,
    present: set[str],
    cols: dict[str, list],
    lines: list[int] | None,
    hd: dict,
    out_counts: list[int] | np.ndarray,
    out_flat: list[int] | np.ndarray,
) -> dict[str, Any]:
    """Workload keyword arguments for the optional columns (``lines`` None: Parquet, report rows)."""

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


def save_jsonl(workload: Workload, path: str | os.PathLike) -> Path:
    """Write ``workload`` as kvlab JSONL (header line + one request per line), atomically; return the path."""
    w = workload
    _check_parents_resolvable(w)
    head = _header(w)
    n = len(w)
    arrival = w.arrival.tolist()
    out_len = w.output_length.tolist()
    in_len = w.input_length.tolist()
    offs = w.prompt_offsets.tolist()
    vals = w.prompt_values.tolist()
    rid = w.request_id.tolist()
    blocks = w.kind == "blocks"
    extra: list[tuple[str, list]] = []
    for c in ("session", "turn"):
        if getattr(w, c) is not None:
            extra.append((c, getattr(w, c).tolist()))
    if w.parent is not None:
        extra.append(("parent", [rid[j] if j >= 0 else None for j in w.parent.tolist()]))
    for c in CATEGORICAL_COLUMNS:
        col = getattr(w, c)
        if col is not None:
            names = col.categories.tolist()
            extra.append((c, [names[k] if k >= 0 else None for k in col.codes.tolist()]))
    if w.output_offsets is not None:
        o_offs, o_vals = w.output_offsets.tolist(), w.output_values.tolist()
        extra.append(("output_tokens", [o_vals[o_offs[i] : o_offs[i + 1]] for i in range(n)]))
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head) + "\n")
        for i in range(n):
            rec: dict[str, Any] = {"arrival": arrival[i], "output_length": out_len[i]}
            if blocks:
                rec["input_length"] = in_len[i]
                rec["hash_ids"] = vals[offs[i] : offs[i + 1]]
            else:
                rec["tokens"] = vals[offs[i] : offs[i + 1]]
            rec["request_id"] = rid[i]
            for c, v in extra:
                rec[c] = v[i]
            f.write(dumps(rec) + "\n")
    return Path(path)


# ---------------------------------------------------------------------------------------------- Parquet
def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """A ``list<int64>`` array (``large_list`` past 2**31 values) from CSR arrays."""
    vals = pa.array(values, type=pa.int64())
    if len(values) < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), vals)
    return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), vals)


def _dict_array(cat: pd.Categorical) -> pa.Array:
    codes = np.asarray(cat.codes, dtype=np.int32)
    names = cat.categories.tolist()
    typ = pa.string() if all(type(x) is str for x in names) else pa.int64()
    return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), pa.array(names, type=typ))


def save_parquet(workload: Workload, path: str | os.PathLike) -> Path:
    """Write ``workload`` as kvlab Parquet (header in schema metadata ``kvlab``) atomically; return path."""
    w = workload
    _check_parents_resolvable(w)
    head = _header(w)
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
    """Load a kvlab Parquet trace (same fields as JSONL); errors name file, field and row.

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
        hd = _parse_header(p, None, raw_head)
    else:
        hd = _parse_header(p, None, {"kvlab_trace": FORMAT_VERSION})
    names = [c for c in table.column_names if not c.startswith("__")]
    allowed = {"arrival", "output_length", "input_length", *PROMPT_KEYS, *OPTIONAL_COLUMNS}
    unknown = [c for c in names if c not in allowed]
    if unknown:
        raise TraceFormatError(p, None, field_label(unknown[0]), "unknown column")
    present = [k for k in PROMPT_KEYS if k in names]
    if len(present) != 1:
        raise TraceFormatError(p, None, present[1] if present else "tokens", "need exactly one of tokens/text/hash_ids")
    key = present[0]
    kind = "blocks" if key == "hash_ids" else "tokens"
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
    out_len = _numeric_column(p, table, "output_length", min_value=0, max_value=MAX_REQUEST_TOKENS)
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
        in_len = _numeric_column(p, table, "input_length", min_value=0, max_value=MAX_REQUEST_TOKENS)
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

    cols: dict[str, list] = {c: [None] * n for c in OPTIONAL_COLUMNS}
    cols["session"] = [-1] * n
    cols["turn"] = [-1] * n
    pres = set(hd["columns"]) | {c for c in names if c in OPTIONAL_COLUMNS}
    for c in ("request_id", "session", "turn", "parent"):
        if c in names:
            cols[c] = _int_column_list(
                p, table, c, nullable=c != "request_id", fill=-1 if c in ("session", "turn") else None
            )
    for c in CATEGORICAL_COLUMNS:
        if c in names:
            cols[c] = _category_values(p, table, c)
    out_counts, out_flat = np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if "output_tokens" in names:
        o_off, out_flat = _list_column(p, table, "output_tokens", nullable=True)
        out_counts = np.diff(o_off)
    kw = _optional_columns(p, pres, cols, None, hd, out_counts, out_flat)
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
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceFormatError(p, None, c, f"row {i}: null")
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
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceFormatError(p, None, c, f"row {i}: null")
    values = col.to_pylist()
    big = next((i for i, v in enumerate(values) if v is not None and v > INT64_MAX), None)
    if big is not None:
        raise TraceFormatError(p, None, c, f"row {big}: {values[big]} does not fit in int64")
    return [fill if v is None else v for v in values]


def _category_values(p: str, table: pa.Table, c: str) -> list:
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
        i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceFormatError(p, None, c, f"row {i}: null")
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
