"""kvlab native JSONL: an optional header line, then one request per line (fields: :mod:`.native_schema`).

:func:`load_jsonl` checks line by line, so the first bad line in file order is the one reported (file,
line, field); :func:`save_jsonl` writes atomically (temp file beside the target, then ``os.replace``)
and round-trips exactly with the loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload._common import (
    Tokenizer,
    atomic_open,
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
    read_trace_bytes,
    sha256_bytes,
)
from kvlab.workload.native_schema import (
    INT_ABSENT,
    OPTIONAL_COLUMNS,
    RECORD_KEYS,
    SEGMENTS_NEED_IDS,
    build_segments,
    check_parents_resolvable,
    default_header,
    get_block_size,
    is_label,
    make_header,
    optional_columns,
    parse_header,
    parse_segments,
    prompt_key,
    segments_records,
)
from kvlab.workload.workload import CATEGORICAL_COLUMNS, Workload


def load_jsonl(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    tokenizer: Tokenizer | None = None,
    block_size: int | None = None,
) -> Workload:
    """Load a kvlab JSONL trace (:mod:`.native_schema` has the fields); errors name file, line and field.

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
    segs: list[list] = []
    seen: set[str] = set()
    prev_a, prev_ln = None, 0
    for ln, obj in iter_json_lines(p, data):
        if "kvlab_trace" in obj:
            if header is not None or lines:
                raise TraceFormatError(p, ln, "kvlab_trace", "the header must be the first line")
            header = parse_header(p, ln, obj)
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
        key, rkind = prompt_key(p, ln, obj, list_found=True)
        if kind is None:
            kind = rkind
        elif rkind != kind:
            raise TraceFormatError(p, ln, key, f"a {rkind} record in a {kind} trace")
        if key == "hash_ids":
            ids = check_int_list(p, ln, key, obj[key])
            il = get_length(p, ln, obj, "input_length")
            rbs = get_block_size(p, ln, obj)
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
        if "segments" in obj and key == "text":
            raise TraceFormatError(p, ln, "segments", SEGMENTS_NEED_IDS)
        segs.append(parse_segments(p, ln, obj["segments"], il) if "segments" in obj else [])
        seen.update(obj)
        arrival.append(a)
        out_len.append(ol)
        in_len.append(il)
        counts.append(len(ids))
        flat.extend(ids)
        lines.append(ln)

    hd = header or default_header(p)
    kind = kind or "tokens"
    present = (seen | set(hd["columns"])) & set(OPTIONAL_COLUMNS)
    kw = optional_columns(p, present, cols, lines, hd, out_counts, out_flat)
    if "segments" in present:
        kw["segments"] = build_segments(p, segs, lines)
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
    """Append this record's optional values to ``cols`` (absent: :data:`INT_ABSENT`, None for labels).

    Of the int fields only ``parent`` may be null; a label is a string, an int or null.
    """
    for c, absent in INT_ABSENT.items():
        if c not in obj or (c == "parent" and obj[c] is None):
            cols[c].append(absent)
        else:
            cols[c].append(get_int(p, ln, obj, c))
    for c in CATEGORICAL_COLUMNS:
        v = obj.get(c)
        if v is not None and not is_label(v):
            raise TraceFormatError(p, ln, c, f"expected a string, int or null, got {describe(v)}")
        cols[c].append(v)
    ot = obj.get("output_tokens")
    if ot is None:
        out_counts.append(0)
    else:
        ot = check_int_list(p, ln, "output_tokens", ot)
        out_counts.append(len(ot))
        out_flat.extend(ot)


def save_jsonl(workload: Workload, path: str | os.PathLike) -> Path:
    """Write ``workload`` as kvlab JSONL (header line + one request per line), atomically; return the path."""
    w = workload
    check_parents_resolvable(w)
    head = make_header(w)
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
    if w.segments is not None:
        extra.append(("segments", segments_records(w)))
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
