"""Property/fuzz suite over every trace loader: malformed input is refused with one clear KvlabError.

For each format (Mooncake, Alibaba, kvlab JSONL and Parquet, and the text loaders) valid records are
generated, then mutated: wrong types, missing and extra fields, negative/huge/NaN/inf numbers, time going
backwards, block-id counts that disagree with ``input_length``, unicode, a truncated last line, empty
files, binary garbage, a BOM, CRLF, very long lines, deeply nested JSON, duplicate keys, Parquet columns
of the wrong type and truncated Parquet files. The property: loading either returns a Workload that
satisfies its invariants, or raises a :class:`~kvlab.errors.KvlabError` whose message is one printable
line (a :class:`~kvlab.errors.TraceFormatError` names the file and, where they exist, a line within the
file and the field). Any other exception fails the test; every load runs under a wall-clock alarm, so a
hang fails too; records that claim absurd sizes must be refused with the field named, under a small
memory bound.

Sized for a 2-core CI (the whole file takes well under a minute); ``KVLAB_FUZZ_EXAMPLES=500`` runs a
deeper search. Runs are derandomized, so CI failures reproduce.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.errors import ConfigError, KvlabError, TraceFileError, TraceFormatError
from kvlab.workload import (
    ByteTokenizer,
    Workload,
    load_alibaba,
    load_jsonl,
    load_mooncake,
    load_parquet,
    load_trace,
    mt_bench_sessions,
    rag_prompts,
    save_jsonl,
    save_parquet,
    sharegpt_first_turns,
)
from kvlab.workload._common import MAX_REQUEST_TOKENS

EXAMPLES = int(os.environ.get("KVLAB_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # hangs are caught by the alarm below, not by timing noise on a busy CI machine
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
TIME_LIMIT_S = 20.0  # per load; a healthy load of these tiny files takes milliseconds
INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------------- harness
@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging forever) if the block runs longer than ``seconds``."""

    def alarm(signum: int, frame: object) -> None:
        raise AssertionError(f"load did not finish within {seconds} s (a hang?)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """One scratch folder for the module (hypothesis re-runs a test body many times per fixture)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-fuzz-") as d:
        yield Path(d)


def check_error(e: KvlabError, path: Path | None, data: bytes | None) -> None:
    """The error is one clear line; a TraceFormatError names the file and a line/field that exist."""
    msg = str(e)
    assert msg and msg.isprintable(), repr(msg)  # no newlines, control or escape characters
    if isinstance(e, TraceFormatError):
        if path is not None:
            assert e.path == str(path) or e.path.startswith(str(path)), (e.path, path)
            assert msg.startswith(e.path)
        if e.line is not None:
            assert data is not None and 1 <= e.line <= data.count(b"\n") + 1, (e.line, msg)
            assert f":{e.line}" in msg
        if e.field is not None:
            assert type(e.field) is str and e.field.isprintable() and len(e.field) <= 40
            assert f"'{e.field}'" in msg


def check_workload(w: Workload, path: Path, data: bytes) -> None:
    """Invariants of a loaded workload (beyond the structural ones ``validate`` checks)."""
    w.validate()
    n = len(w)
    assert w.kind in ("blocks", "tokens")
    if w.kind == "blocks":
        assert type(w.block_size) is int and 1 <= w.block_size <= MAX_REQUEST_TOKENS
    assert w.source == str(path) and w.checksum == hashlib.sha256(data).hexdigest()
    assert isinstance(w.name, str) and isinstance(w.meta, dict)
    assert np.all(np.isfinite(w.arrival)) and (n < 2 or np.all(np.diff(w.arrival) >= 0))
    assert np.all((w.input_length >= 0) & (w.input_length <= MAX_REQUEST_TOKENS))
    assert np.all((w.output_length >= 0) & (w.output_length <= MAX_REQUEST_TOKENS))
    assert np.all(w.prompt_values >= 0)
    assert len(w.request_id) == n
    if w.parent is not None:
        assert np.all((w.parent >= -1) & (w.parent < n))


def attempt(path: Path, fn: Callable[[], Workload]) -> Workload | None:
    """Run a load under the alarm; return the workload, or None after a well-formed KvlabError."""
    data = path.read_bytes() if path.is_file() else None
    with time_limit(TIME_LIMIT_S):
        try:
            w = fn()
        except KvlabError as e:
            check_error(e, path, data)
            return None
    assert data is not None
    check_workload(w, path, data)
    return w


# ---------------------------------------------------------------------------------------------- values
WEIRD_NUMBERS = [0, -1, 1, 2**31, 2**53 + 1, INT64_MAX, INT64_MAX + 1, -(2**63) - 1, 10**15, 10**30, 10**300]
weird_value = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(WEIRD_NUMBERS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["12", "", "\ud800", "\x00", "\u202e", "a\nb", "\x1b[31m", "日本語"]),
    st.lists(st.integers(-3, 3), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
weird_key = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "\u0000", "\ud800", "a\nb", "\x1b[2J", "x" * 500, "INPUT_LENGTH", "hash_ids "]),
)


def dumps(obj: Any) -> str:
    """JSON as a trace writer might produce it (NaN/Infinity allowed, non-ASCII kept)."""
    return json.dumps(obj, ensure_ascii=False)


def to_bytes(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------------------------- records
@st.composite
def mooncake_records(draw: st.DrawFn, min_n: int = 0) -> list[dict]:
    n = draw(st.integers(min_n, 6))
    t, out = draw(st.integers(0, 10**6)), []
    for _ in range(n):
        t += draw(st.integers(0, 5000))
        il = draw(st.integers(0, 2100))
        ids = draw(st.lists(st.integers(0, 2**40), min_size=-(-il // 512), max_size=-(-il // 512)))
        out.append({"timestamp": t, "input_length": il, "output_length": draw(st.integers(0, 900)), "hash_ids": ids})
    return out


@st.composite
def alibaba_records(draw: st.DrawFn, min_n: int = 0) -> list[dict]:
    n = draw(st.integers(min_n, 6))
    chat = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n, unique=True))
    t, out = draw(st.floats(0, 1e4)), []
    for i, cid in enumerate(chat):
        t += draw(st.floats(0, 100))
        parent = draw(st.sampled_from([-1, 10**7 + i, *chat[:i]]))  # root, missing parent or earlier one
        il = draw(st.integers(0, 100))
        ids = draw(st.lists(st.integers(0, 50), min_size=-(-il // 16), max_size=-(-il // 16)))
        out.append(
            {
                "chat_id": cid,
                "parent_chat_id": parent,
                "timestamp": round(t, 3),
                "input_length": il,
                "output_length": draw(st.integers(0, 500)),
                "type": draw(st.sampled_from(["text", "search", "image", "file", "ü", ""])),
                "turn": draw(st.integers(1, 5)),
                "hash_ids": ids,
            }
        )
    return out


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Small workloads with every optional column, for the native formats."""
    n = draw(st.integers(0, 5))
    blocks = draw(st.booleans())
    bs = draw(st.sampled_from([1, 4, 16])) if blocks else None
    if blocks:
        in_len = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
        counts = [-(-x // bs) for x in in_len]
    else:
        counts = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
        in_len = counts
    prompts = [draw(st.lists(st.integers(0, 10**6), min_size=c, max_size=c)) for c in counts]
    arrival = np.cumsum(draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))) if n else np.zeros(0)
    flat = [x for p in prompts for x in p]
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["session"] = np.array(draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), dtype=np.int64)
        kw["turn"] = np.array(draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), dtype=np.int64)
        kw["parent"] = np.array([draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int64)
    if draw(st.booleans()):
        kw["tenant"] = pd.Categorical(draw(st.lists(st.sampled_from(["a", "b", None, "ü"]), min_size=n, max_size=n)))
        kw["category"] = pd.Categorical(draw(st.lists(st.sampled_from([1, 2, None]), min_size=n, max_size=n)))
    if not blocks and draw(st.booleans()):
        outs = [draw(st.lists(st.integers(0, 99), max_size=3)) for _ in range(n)]
        kw["output_offsets"] = np.cumsum([0, *map(len, outs)])
        kw["output_values"] = np.array([x for o in outs for x in o], dtype=np.int64)
    return Workload(
        arrival=np.asarray(arrival, dtype=np.float64),
        input_length=np.array(in_len, dtype=np.int64),
        output_length=np.array(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), dtype=np.int64),
        prompt_offsets=np.cumsum([0, *counts]).astype(np.int64),
        prompt_values=np.array(flat, dtype=np.int64),
        kind="blocks" if blocks else "tokens",
        block_size=bs,
        request_id=np.array(draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n, unique=True)), np.int64),
        name=draw(st.sampled_from(["w", "../../etc/passwd", "a/b", "", " ", "日本", "\u202e", "con", "x" * 300])),
        meta={"seed": draw(st.integers(0, 9))},
        **kw,
    )


# ---------------------------------------------------------------------------------------------- mutations
KNOWN_FIELDS = [
    "timestamp", "input_length", "output_length", "hash_ids", "chat_id", "parent_chat_id", "type", "turn",
    "arrival", "tokens", "text", "request_id", "session", "parent", "tenant", "category", "adapter", "salt",
    "output_tokens", "block_size", "kvlab_trace", "kind", "name", "columns", "categories", "ordered", "meta",
]  # fmt: skip


@st.composite
def mutate_record(draw: st.DrawFn, rec: dict) -> dict:
    """One record-level mistake (or several)."""
    rec = dict(rec)
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["delete", "set", "extra", "huge", "negative", "ids", "float", "string"]))
        keys = sorted(rec)
        if op == "delete" and keys:
            rec.pop(draw(st.sampled_from(keys)))
        elif op == "set":
            rec[draw(st.sampled_from(KNOWN_FIELDS))] = draw(weird_value)
        elif op == "extra":
            rec[draw(weird_key)] = draw(weird_value)
        elif op == "huge":
            rec[draw(st.sampled_from(["input_length", "output_length", "block_size", "timestamp"]))] = draw(
                st.sampled_from([10**15, INT64_MAX, INT64_MAX + 1, 10**4000])
            )
        elif op == "negative" and keys:
            rec[draw(st.sampled_from(keys))] = draw(st.sampled_from([-1, -(10**15), -0.5]))
        elif op == "ids":
            key = next((k for k in ("hash_ids", "tokens") if k in rec), "hash_ids")
            ids = list(rec[key]) if isinstance(rec.get(key), list) else []  # an earlier mutation may have set it
            how = draw(st.sampled_from(["more", "fewer", "negative", "float", "huge", "nested"]))
            if how == "more":
                ids.append(draw(st.integers(0, 9)))
            elif how == "fewer" and ids:
                ids.pop()
            elif how == "negative":
                ids.append(-1)
            elif how == "float":
                ids.append(1.5)
            elif how == "huge":
                ids.append(2**64)
            else:
                ids.append([1, [2]])
            rec[key] = ids
        elif op == "float" and keys:
            k = draw(st.sampled_from(keys))
            if type(rec[k]) is int:
                rec[k] = float(rec[k])
        elif op == "string" and keys:
            k = draw(st.sampled_from(keys))
            rec[k] = str(rec[k])
    return rec


DEEP = "[" * 100_000 + "]" * 100_000
RAW_LINES = [
    "",
    "   ",
    "\t",
    "null",
    "[]",
    "42",
    '"x"',
    "{",
    "{}",
    '{"a": 1,}',
    "{'timestamp': 1}",
    "NaN",
    DEEP,
    '{"a": ' + "{" * 50_000 + "}" * 50_000 + "}",
    '{"x": ' + "1" * 5000 + "}",
    '{"timestamp": 1, "timestamp": 2, "input_length": 0, "output_length": 0, "hash_ids": []}',
    '{"arrival": 0, "output_length": 0, "tokens": [], "tokens": [1]}',
    '{"x": "' + "y" * 300_000 + '"}',
    '{"\\ud800": 1}',
    '{"x": "\\u0000"}',
]


@st.composite
def corrupt_text(draw: st.DrawFn, lines: list[str]) -> bytes:
    """A file-level mistake on the serialized lines."""
    op = draw(
        st.sampled_from(
            ["truncate", "bom", "crlf", "garbage", "insert_bytes", "raw_line", "empty", "blank", "no_newline"]
        )
    )
    data = to_bytes(lines)
    if op == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if op == "bom":
        return b"\xef\xbb\xbf" + data
    if op == "crlf":
        return data.replace(b"\n", b"\r\n")
    if op == "garbage":
        return draw(st.binary(min_size=1, max_size=300))
    if op == "insert_bytes":
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"\xff", b"\x00", b"\xc3", b"\n", b"\r", b"{", b"\xe2\x80\xae"]))
        return data[:at] + junk + data[at:]
    if op == "raw_line":
        at = draw(st.integers(0, len(lines)))
        return to_bytes([*lines[:at], draw(st.sampled_from(RAW_LINES)), *lines[at:]])
    if op == "empty":
        return b""
    if op == "blank":
        return b"\n \n\t\r\n"
    return data.rstrip(b"\n")


def json_lines_case(records: st.SearchStrategy[list[dict]]) -> st.SearchStrategy[bytes]:
    """Files from valid records with one record mutated, or a file-level corruption, or both."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        recs = draw(records)
        lines = [dumps(r) for r in recs]
        if recs and draw(st.booleans()):
            i = draw(st.integers(0, len(recs) - 1))
            lines[i] = dumps(draw(mutate_record(recs[i])))
        if not recs or draw(st.booleans()):
            return draw(corrupt_text(lines))
        if len(recs) > 1 and draw(st.booleans()):  # time goes backwards / records out of order
            lines = lines[::-1]
        return to_bytes(lines)

    return build()


def write(workdir: Path, name: str, data: bytes) -> Path:
    path = workdir / name
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------- Mooncake
@FUZZ
@given(recs=mooncake_records())
def test_mooncake_valid_records_load_exactly(workdir, recs):
    path = write(workdir, "valid_mc.jsonl", to_bytes([dumps(r) for r in recs]))
    w = attempt(path, lambda: load_trace(path, format="mooncake"))
    assert w is not None and len(w) == len(recs) and w.block_size == 512
    for i, r in enumerate(recs):
        assert w.arrival[i] == r["timestamp"] / 1000 and w.input_length[i] == r["input_length"]
        assert w.output_length[i] == r["output_length"] and w.prompt(i).tolist() == r["hash_ids"]


@FUZZ
@given(data=json_lines_case(mooncake_records()), detect=st.booleans())
def test_mooncake_malformed(workdir, data, detect):
    path = write(workdir, "mc.jsonl", data)
    attempt(path, lambda: load_trace(path, format=None if detect else "mooncake"))


# ---------------------------------------------------------------------------------------------- Alibaba
@FUZZ
@given(recs=alibaba_records())
def test_alibaba_valid_records_load_exactly(workdir, recs):
    path = write(workdir, "valid_ali.jsonl", to_bytes([dumps(r) for r in recs]))
    w = attempt(path, lambda: load_trace(path, format="alibaba"))
    assert w is not None and len(w) == len(recs)
    assert w.request_id.tolist() == [r["chat_id"] for r in recs]
    assert w.input_length.tolist() == [r["input_length"] for r in recs]
    assert list(w.category) == [r["type"] for r in recs]
    row = {r["chat_id"]: i for i, r in enumerate(recs)}
    assert w.parent.tolist() == [row.get(r["parent_chat_id"], -1) for r in recs]


@FUZZ
@given(data=json_lines_case(alibaba_records()), sort=st.booleans(), chain=st.booleans(), detect=st.booleans())
def test_alibaba_malformed(workdir, data, sort, chain, detect):
    path = write(workdir, "ali.jsonl", data)
    if detect:
        attempt(path, lambda: load_trace(path))
    else:
        attempt(path, lambda: load_trace(path, format="alibaba", sort=sort, chain=chain))


# ---------------------------------------------------------------------------------------------- kvlab JSONL
def assert_same(a: Workload, b: Workload, stem: str) -> None:
    """Equal columns; an empty name is not kept (the loader names the workload after the file then)."""
    assert (a.kind, a.block_size, a.name or stem, a.meta) == (b.kind, b.block_size, b.name, b.meta)
    for f in ("arrival", "input_length", "output_length", "prompt_offsets", "prompt_values", "request_id"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for f in ("session", "turn", "parent", "output_offsets", "output_values", "tenant", "category"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            if isinstance(x, pd.Categorical):
                assert list(x.categories) == list(y.categories) and np.array_equal(x.codes, y.codes), f
            else:
                assert np.array_equal(x, y), f


@FUZZ
@given(w=workloads())
def test_native_roundtrip_of_generated_workloads(workdir, w):
    for fmt, save in (("jsonl", save_jsonl), ("parquet", save_parquet)):
        path = workdir / f"rt.{fmt}"
        save(w, path)
        back = attempt(path, lambda fmt=fmt, path=path: load_trace(path, format=fmt))
        assert back is not None
        assert_same(w, back, "rt")  # names such as "../../etc/passwd" are kept as data, never used as paths


@st.composite
def jsonl_cases(draw: st.DrawFn) -> bytes:
    w = draw(workloads())
    path = Path(tempfile.mkdtemp(prefix="kvlab-fuzz-gen-")) / "w.jsonl"
    try:
        save_jsonl(w, path)
        lines = path.read_text(encoding="utf-8").splitlines()
    finally:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    recs = [json.loads(x) for x in lines]
    target = draw(st.integers(0, len(recs) - 1))  # 0 is the header
    op = draw(st.sampled_from(["record", "header", "text", "both"]))
    if op in ("record", "header", "both"):
        i = 0 if op == "header" else target
        if op == "header" and draw(st.booleans()):
            recs[0] = dict(recs[0])
            key = draw(st.sampled_from(["kind", "block_size", "columns", "categories", "ordered", "meta", "name"]))
            recs[0][key] = draw(
                st.one_of(
                    weird_value,
                    st.sampled_from(
                        [
                            [["x"]],
                            {"tenant": ["a", "a"]},
                            {"tenant": [[1]]},
                            {"nope": []},
                            ["tenant", ["x"]],
                            [{"a": 1}],
                            10**15,
                            "blocks",
                        ]
                    ),
                )
            )
        else:
            recs[i] = draw(mutate_record(recs[i]))
    lines = [dumps(r) for r in recs]
    if op in ("text", "both"):
        return draw(corrupt_text(lines))
    return to_bytes(lines)


@FUZZ
@given(data=jsonl_cases(), bs=st.sampled_from([None, None, 1, 16, 0, -3, 10**15, True, 2.5]), detect=st.booleans())
def test_jsonl_malformed(workdir, data, bs, detect):
    path = write(workdir, "n.jsonl", data)
    if detect:
        attempt(path, lambda: load_trace(path))
    else:
        attempt(path, lambda: load_trace(path, format="jsonl", block_size=bs, tokenizer=ByteTokenizer()))


# ---------------------------------------------------------------------------------------------- Parquet
def retype(col: pa.ChunkedArray, how: str) -> pa.Array:
    """``col`` converted to another (often wrong) Arrow type."""
    vals = col.to_pylist()
    n = len(vals)
    if how == "string":
        return pa.array([None if v is None else str(v) for v in vals], type=pa.string())
    if how == "float":
        return pa.array([math.nan if i == 0 else 1.5 for i in range(n)], type=pa.float64())
    if how == "bool":
        return pa.array([True] * n, type=pa.bool_())
    if how == "uint64":
        return pa.array([2**64 - 1] * n, type=pa.uint64())
    if how == "int8":
        return pa.array([-1] * n, type=pa.int8())
    if how == "nulls":
        return pa.nulls(n, type=col.type)
    if how == "list_str":
        return pa.array([["a"]] * n, type=pa.list_(pa.string()))
    if how == "list_uint64":
        return pa.array([[2**64 - 1]] * n, type=pa.list_(pa.uint64()))
    if how == "list_nulls":
        return pa.array([[None]] * n, type=pa.list_(pa.int64()))
    if how == "huge":
        return pa.array([10**15] * n, type=pa.int64())
    if how == "struct":
        return pa.array([{"a": 1}] * n)
    if how == "dictionary":
        return pa.array([str(i) for i in range(n)]).dictionary_encode()
    return pa.array([float("inf")] * n, type=pa.float64())


PARQUET_OPS = ["retype", "drop", "extra", "duplicate", "metadata", "truncate", "flip", "empty_table", "none"]
RETYPES = ["string", "float", "bool", "uint64", "int8", "nulls", "list_str", "list_uint64", "list_nulls", "huge",
           "struct", "dictionary", "inf"]  # fmt: skip
BAD_METADATA = [b"", b"{", b"[]", b'{"kvlab_trace": 2}', b'{"kvlab_trace": 1, "kind": "x"}', b"\xff\xfe",
                b'{"kvlab_trace": 1, "ordered": [[1]], "categories": {}}', b"[" * 50_000,
                b'{"kvlab_trace": 1, "kvlab_trace": 1}', b'{"kvlab_trace": 1, "block_size": 1000000000000000}',
                b'{"kvlab_trace": 1, "categories": {"tenant": ["a", "a"]}}']  # fmt: skip


@st.composite
def parquet_cases(draw: st.DrawFn) -> tuple[bytes, int | None]:
    w = draw(workloads())
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-fuzz-gen-")) / "w.parquet"
    try:
        save_parquet(w, tmp)
        data = tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)
        tmp.parent.rmdir()
    table = pq.read_table(pa.BufferReader(data))
    op = draw(st.sampled_from(PARQUET_OPS))
    bs = draw(st.sampled_from([None, None, 16, 0]))
    if op in ("truncate", "flip"):
        if op == "truncate":
            return data[: draw(st.integers(0, len(data) - 1))], bs
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] ^= draw(st.integers(1, 255))
        return bytes(buf), bs
    names = table.column_names
    if op == "retype":
        c = draw(st.sampled_from(names))
        table = table.set_column(names.index(c), c, retype(table.column(c), draw(st.sampled_from(RETYPES))))
    elif op == "drop":
        table = table.drop_columns([draw(st.sampled_from(names))])
    elif op == "extra":
        table = table.append_column(draw(st.sampled_from(["x", "__index_level_0__", "text", "tokens", "\u202e"])),
                                    pa.array(["t"] * table.num_rows))
    elif op == "duplicate":
        c = draw(st.sampled_from(names))
        table = table.append_column(c, table.column(c))
    elif op == "metadata":
        table = table.replace_schema_metadata({"kvlab": draw(st.sampled_from(BAD_METADATA))})
    elif op == "empty_table":
        table = table.slice(0, 0)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes(), bs


@FUZZ
@given(case=parquet_cases(), detect=st.booleans())
def test_parquet_malformed(workdir, case, detect):
    data, bs = case
    path = write(workdir, "p.parquet", data)
    if detect:
        attempt(path, lambda: load_trace(path))
    else:
        attempt(path, lambda: load_trace(path, format="parquet", block_size=bs, tokenizer=ByteTokenizer()))


# ---------------------------------------------------------------------------------------------- text loaders
@FUZZ
@given(
    obj=st.one_of(
        st.fixed_dictionaries(
            {"0": st.text(max_size=5), "query": st.text(max_size=5)},
            optional={"chunk_num": st.one_of(weird_value, st.sampled_from([1, "1", 10**12, "999999999999"]))},
        ),
        weird_value,
    ),
    raw=st.one_of(st.none(), st.sampled_from(RAW_LINES[:14]).map(str.encode), st.binary(max_size=40)),
)
def test_rag_prompts_malformed(workdir, obj, raw):
    folder = workdir / "rag" / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "1.json"
    f.write_bytes(raw if raw is not None else dumps(obj).encode("utf-8", "surrogatepass"))
    with time_limit(TIME_LIMIT_S):
        try:
            w = rag_prompts(folder, ByteTokenizer())
        except KvlabError as e:
            check_error(e, f, f.read_bytes())
        else:
            w.validate()
            assert len(w) == 1


@FUZZ
@given(
    q=json_lines_case(
        st.lists(
            st.fixed_dictionaries(
                {"question_id": st.integers(0, 99), "category": st.text(max_size=4),
                 "turns": st.lists(st.text(max_size=6), min_size=2, max_size=3)}  # fmt: skip
            ),
            max_size=3,
        )
    ),
    answers=st.one_of(st.none(), st.sampled_from([b"", b'{"question_id": 1, "choices": 5}\n', b"\xff\n", b"{\n"])),
)
def test_mt_bench_malformed(workdir, q, answers):
    qpath = write(workdir, "question.jsonl", q)
    apath = write(workdir, "answers.jsonl", answers) if answers is not None else None
    with time_limit(TIME_LIMIT_S):
        try:
            w = mt_bench_sessions(qpath, ByteTokenizer(), apath)
        except KvlabError as e:
            bad = apath if isinstance(e, TraceFormatError) and apath is not None and e.path == str(apath) else qpath
            check_error(e, bad, bad.read_bytes())
        else:
            w.validate()


@FUZZ
@given(
    items=st.one_of(
        weird_value,
        st.lists(
            st.one_of(
                weird_value,
                st.fixed_dictionaries(
                    {"conversations": st.one_of(weird_value, st.lists(st.fixed_dictionaries(
                        {"from": st.sampled_from(["human", "gpt", 5]), "value": weird_value})))}  # fmt: skip
                ),
            ),
            max_size=4,
        ),
    ),
    limit=st.sampled_from([None, 0, 1, -1]),
)
def test_sharegpt_malformed(workdir, items, limit):
    f = write(workdir, "sharegpt.json", dumps(items).encode("utf-8", "surrogatepass"))
    with time_limit(TIME_LIMIT_S):
        try:
            w = sharegpt_first_turns(f, ByteTokenizer(), limit=limit)
        except KvlabError as e:
            check_error(e, f, f.read_bytes())
        else:
            w.validate()


# ---------------------------------------------------------------------------------------------- bounded memory
MC = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
ALI = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, "output_length": 5,
       "type": "text", "turn": 1, "hash_ids": [7, 8]}  # fmt: skip
HEADER = {"kvlab_trace": 1, "kind": "blocks", "block_size": 16}
NATIVE = {"arrival": 0.0, "output_length": 1, "input_length": 20, "hash_ids": [1, 2]}
HUGE = 10**15


@pytest.mark.parametrize(
    "loader, lines, line, field",
    [
        (load_mooncake, [dict(MC, input_length=HUGE)], 1, "input_length"),
        (load_mooncake, [MC, dict(MC, output_length=HUGE)], 2, "output_length"),
        (load_alibaba, [dict(ALI, input_length=HUGE)], 1, "input_length"),
        (load_alibaba, [dict(ALI, output_length=HUGE)], 1, "output_length"),
        (load_jsonl, [HEADER, dict(NATIVE, input_length=HUGE)], 2, "input_length"),
        (load_jsonl, [HEADER, dict(NATIVE, output_length=HUGE)], 2, "output_length"),
        (load_jsonl, [dict(HEADER, block_size=HUGE), dict(NATIVE, input_length=HUGE, hash_ids=[1])], 1, "block_size"),
        (load_jsonl, [dict(NATIVE, block_size=HUGE, hash_ids=[1])], 1, "block_size"),
    ],
)
def test_huge_claims_are_refused_not_allocated(tmp_path, loader, lines, line, field):
    path = write(tmp_path, "huge.jsonl", to_bytes([dumps(x) for x in lines]))
    tracemalloc.start()
    try:
        with time_limit(TIME_LIMIT_S), pytest.raises(TraceFormatError) as ei:
            loader(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    e = ei.value
    assert (e.path, e.line, e.field) == (str(path), line, field)
    assert str(MAX_REQUEST_TOKENS) in str(e).replace(",", "")
    assert peak < 5 * 2**20, peak


def test_huge_parquet_lengths_are_refused(tmp_path):
    path = tmp_path / "huge.parquet"
    table = pa.table({"arrival": [0.0], "output_length": [1], "input_length": [HUGE], "hash_ids": pa.array([[1]])})
    head = {"kvlab_trace": 1, "kind": "blocks", "block_size": HUGE}
    pq.write_table(table.replace_schema_metadata({"kvlab": json.dumps(head)}), path)
    with pytest.raises(TraceFormatError) as ei:
        load_parquet(path)
    assert ei.value.field == "block_size"
    pq.write_table(table, path)
    with pytest.raises(ConfigError, match="block_size"):
        load_parquet(path, block_size=HUGE)
    with pytest.raises(TraceFormatError) as ei:
        load_parquet(path, block_size=16)
    assert ei.value.field == "input_length" and "row 0" in str(ei.value)
    pq.write_table(table.set_column(1, "output_length", pa.array([HUGE])), path)
    with pytest.raises(TraceFormatError) as ei:
        load_parquet(path, block_size=16)
    assert ei.value.field == "output_length"


def test_rag_chunk_num_claim_is_refused(tmp_path):
    (tmp_path / "1.json").write_text(json.dumps({"0": "a", "query": "q", "chunk_num": 10**12}))
    with time_limit(TIME_LIMIT_S), pytest.raises(TraceFormatError) as ei:
        rag_prompts(tmp_path, ByteTokenizer())
    assert ei.value.field == "chunk_num"


# ---------------------------------------------------------------------------------------------- paths
LOADERS = [load_mooncake, load_alibaba, load_jsonl, load_parquet]


@pytest.mark.parametrize("loader", LOADERS, ids=lambda f: f.__name__)
def test_bad_paths_for_every_loader(tmp_path, loader):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [(tmp_path, "is a directory"), (tmp_path / "missing.jsonl", "no such file"), (fifo, "regular file")]
    for path, what in cases:
        with time_limit(TIME_LIMIT_S), pytest.raises(TraceFileError, match=what) as ei:
            loader(path)
        assert ei.value.path == str(path) and ei.value.line is None
        check_error(ei.value, path, None)
    with pytest.raises(TraceFileError, match="not a usable path"):
        loader("bad\0path")


def test_format_detection_refuses_bad_paths(tmp_path):
    from kvlab.workload import detect_format

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path, what in ((fifo, "regular file"), (tmp_path, "is a directory"), (tmp_path / "nope", "no such file")):
        with time_limit(TIME_LIMIT_S), pytest.raises(TraceFileError, match=what):
            detect_format(path)


# ---------------------------------------------------------------------------------------------- fixed cases
# Every entry of the list, for every JSON-lines format, without relying on the random search.
BASE = {"mooncake": [MC, dict(MC, timestamp=5)], "alibaba": [ALI, dict(ALI, chat_id=2, timestamp=0.75)],
        "jsonl": [HEADER, NATIVE, dict(NATIVE, arrival=1.0)]}  # fmt: skip


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("raw", RAW_LINES, ids=lambda r: repr(r[:12]) + f"..{len(r)}")
@pytest.mark.parametrize("fmt", sorted(BASE))
def test_raw_line_in_every_format(tmp_path, fmt, raw, where):
    lines = [dumps(r) for r in BASE[fmt]]
    lines = [raw, *lines] if where == "first" else [*lines, raw]
    path = write(tmp_path, "raw.jsonl", to_bytes(lines))
    w = attempt(path, lambda: load_trace(path, format=fmt))
    if w is None and raw.strip():
        with pytest.raises(TraceFormatError) as ei:
            load_trace(path, format=fmt)
        assert ei.value.line == (1 if where == "first" else len(lines))  # the line is named
    elif w is not None:
        assert not raw.strip() and len(w) == len(BASE[fmt]) - (fmt == "jsonl")  # blank lines are skipped


@pytest.mark.parametrize("fmt", sorted(BASE))
def test_text_level_corruptions(tmp_path, fmt):
    clean = to_bytes([dumps(r) for r in BASE[fmt]])
    ref = load_trace(write(tmp_path, "clean.jsonl", clean), format=fmt)
    # Equivalent spellings of the same file load to the same requests.
    for variant in (b"\xef\xbb\xbf" + clean, clean.replace(b"\n", b"\r\n"), clean.rstrip(b"\n"), clean + b"\n \n"):
        path = write(tmp_path, "variant.jsonl", variant)
        w = attempt(path, lambda path=path: load_trace(path, format=fmt))
        assert w is not None
        np.testing.assert_array_equal(w.arrival, ref.arrival)
        np.testing.assert_array_equal(w.prompt_values, ref.prompt_values)
        assert w.checksum == hashlib.sha256(variant).hexdigest() != ref.checksum
    # A truncated last line is an error on that line; binary garbage on line 1; a file with no request loads empty.
    n = clean.count(b"\n")
    for data, line in ((clean[:-7], n), (b"\x00\xff\xfe" * 50, 1), (bytes(range(256)), 1), (b"\xef\xbb\xbf\x00", 1)):
        path = write(tmp_path, "bad.jsonl", data)
        with pytest.raises(TraceFormatError) as ei:
            load_trace(path, format=fmt)
        assert (ei.value.path, ei.value.line) == (str(path), line)
        check_error(ei.value, path, data)
    for data in (b"", b"\n\n", b" \r\n\t\n", b"\xef\xbb\xbf"):
        path = write(tmp_path, "empty.jsonl", data)
        w = attempt(path, lambda path=path: load_trace(path, format=fmt))
        assert w is not None and len(w) == 0
        with pytest.raises(TraceFormatError, match="empty file"):
            load_trace(path)  # detection has nothing to go on


@pytest.mark.parametrize("fmt", ["mooncake", "alibaba"])
def test_duplicate_keys_name_the_key(tmp_path, fmt):
    rec = dumps(BASE[fmt][0])
    path = write(tmp_path, "dup.jsonl", to_bytes([rec, rec[:-1] + ', "input_length": 3}']))
    with pytest.raises(TraceFormatError, match="duplicate key") as ei:
        load_trace(path, format=fmt)
    assert (ei.value.line, ei.value.field) == (2, "input_length")


@pytest.mark.parametrize(
    "name", ["", "../../etc/passwd", "/abs", "a/b\\c", "..", "NUL", "con.txt", "\x00x", "\u202eevil", "a\nb",
             "x" * 5000, "日本語", "\ud800", " lead", "trail. "]
)  # fmt: skip
def test_weird_names_are_kept_as_data(tmp_path, name):
    head = json.dumps(dict(HEADER, name=name))  # ASCII escapes: a lone surrogate stays valid JSON
    path = write(tmp_path, "named.jsonl", to_bytes([head, dumps(NATIVE)]))
    w = attempt(path, lambda: load_trace(path, format="jsonl"))
    assert w is not None and w.name == (name or "named")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["named.jsonl"]  # nothing created from the name
    w2 = attempt(path, lambda: load_trace(path, format="jsonl", name=name + "!"))
    assert w2 is not None and w2.name == name + "!"
