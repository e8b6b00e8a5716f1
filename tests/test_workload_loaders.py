"""Trace loaders (Mooncake, Alibaba, kvlab JSONL/Parquet), format detection and the generators."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload import (
    ByteTokenizer,
    Workload,
    chain_block_ids,
    detect_format,
    from_lists,
    load_alibaba,
    load_jsonl,
    load_mooncake,
    load_parquet,
    load_trace,
    save_jsonl,
    save_parquet,
    synthetic_chat,
    zipf_blocks,
)
from kvlab.workload.registry import TRACES

MOONCAKE_OK = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
ALIBABA_OK = {
    "chat_id": 1,
    "parent_chat_id": -1,
    "timestamp": 0.5,
    "input_length": 20,
    "output_length": 5,
    "type": "text",
    "turn": 1,
    "hash_ids": [7, 8],
}


def write_lines(path: Path, lines: list) -> Path:
    """Write JSON objects (dicts) or raw strings, one per line."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def expect_error(fn, path: Path, line: int | None, field: str | None) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as ei:
        fn(path)
    e = ei.value
    assert e.path == str(path)
    assert e.line == line
    assert e.field == field
    text = str(e)
    assert str(path) in text
    if line is not None:
        assert f":{line}" in text
    if field is not None:
        assert f"'{field}'" in text
    return e


def assert_same(a: Workload, b: Workload) -> None:
    """Every column, CSR array, categorical (categories, codes, ordered) and descriptor equal."""
    assert (a.kind, a.block_size, a.name, a.meta) == (b.kind, b.block_size, b.name, b.meta)
    for f in ("arrival", "input_length", "output_length", "prompt_offsets", "prompt_values", "request_id"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for f in ("session", "turn", "parent", "output_offsets", "output_values"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=f)
    for f in ("tenant", "category", "adapter", "salt"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.categories.tolist() == y.categories.tolist(), f
            np.testing.assert_array_equal(x.codes, y.codes, err_msg=f)
            assert x.ordered == y.ordered, f


# ------------------------------------------------------------------------------------------ Mooncake
@pytest.mark.shared
@pytest.mark.parametrize(
    "fname, n, mean_in, mean_out",
    [
        ("conversation_trace.jsonl", 12_031, 12_035.06, 342.62),
        ("synthetic_trace.jsonl", 3_993, 15_325.48, 149.12),
    ],
)
def test_mooncake_reproduces_fast25_table2(shared_file, fname, n, mean_in, mean_out):
    path = shared_file(f"mooncake/{fname}")
    w = load_mooncake(path)
    assert len(w) == n
    assert round(float(w.input_length.mean()), 2) == mean_in
    assert round(float(w.output_length.mean()), 2) == mean_out
    assert (w.kind, w.block_size, w.name, w.source) == ("blocks", 512, Path(fname).stem, str(path))
    assert w.checksum == next(e["sha256"] for e in TRACES.values() if e["filename"] == fname)
    assert np.all(np.diff(w.arrival) >= 0) and w.arrival[-1] <= 3600.0
    first = json.loads(path.read_text().split("\n", 1)[0])
    np.testing.assert_array_equal(w.prompt(0), first["hash_ids"])
    assert w.arrival[0] == first["timestamp"] / 1000


@pytest.mark.shared
def test_mooncake_conversation_shares_system_block(shared_file):
    w = load_mooncake(shared_file("mooncake/conversation_trace.jsonl"), name="conv")
    assert w.name == "conv"
    firsts = w.prompt_values[w.prompt_offsets[:-1][np.diff(w.prompt_offsets) > 0]]
    assert np.all(firsts == 0)


def test_mooncake_fixture_and_blank_lines(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            MOONCAKE_OK,
            "",
            {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0], "extra": 1},
            {"timestamp": 1500, "input_length": 0, "output_length": 3, "hash_ids": []},
        ],
    )
    w = load_mooncake(path)
    assert len(w) == 3
    np.testing.assert_array_equal(w.arrival, [0.0, 1.5, 1.5])
    np.testing.assert_array_equal(w.prompt_offsets, [0, 2, 3, 3])
    np.testing.assert_array_equal(w.input_length, [1000, 512, 0])
    assert w.meta["format"] == "mooncake"
    assert len(load_mooncake(write_lines(tmp_path / "empty.jsonl", []))) == 0


def _mc(**kw):
    rec = dict(MOONCAKE_OK, timestamp=5)
    rec.update(kw)
    return rec


MOONCAKE_BAD = [
    ('{"timestamp": 5, "input_length": 1000, "output_len', None),
    ("[1, 2]", None),
    ({k: v for k, v in MOONCAKE_OK.items() if k != "hash_ids"}, "hash_ids"),
    ({k: v for k, v in MOONCAKE_OK.items() if k != "timestamp"}, "timestamp"),
    (_mc(timestamp="5"), "timestamp"),
    (_mc(timestamp=5.0), "timestamp"),
    (_mc(timestamp=True), "timestamp"),
    (_mc(input_length="1000"), "input_length"),
    (_mc(input_length=1000.0), "input_length"),
    (_mc(output_length=False), "output_length"),
    (_mc(output_length=None), "output_length"),
    (_mc(hash_ids="0,1"), "hash_ids"),
    (_mc(hash_ids=[0, "1"]), "hash_ids"),
    (_mc(hash_ids=[0, 1.0]), "hash_ids"),
    (_mc(hash_ids=[0, True]), "hash_ids"),
    (_mc(hash_ids=[0, -1]), "hash_ids"),
    (_mc(hash_ids=[0, 2**63]), "hash_ids"),
    (_mc(input_length=-1, hash_ids=[]), "input_length"),
    (_mc(output_length=-5), "output_length"),
    (_mc(input_length=1025), "hash_ids"),  # needs 3 ids
    (_mc(input_length=512), "hash_ids"),  # needs 1 id
    (_mc(timestamp=-1), "timestamp"),  # goes backwards after 0
]


@pytest.mark.parametrize("bad, field", MOONCAKE_BAD)
def test_mooncake_bad_line(tmp_path, bad, field):
    path = write_lines(tmp_path / "bad.jsonl", [MOONCAKE_OK, bad, MOONCAKE_OK])
    expect_error(load_mooncake, path, 2, field)


def test_mooncake_backwards_message(tmp_path):
    path = write_lines(tmp_path / "b.jsonl", [_mc(timestamp=10), MOONCAKE_OK])
    e = expect_error(load_mooncake, path, 2, "timestamp")
    assert "backwards" in e.message and "line 1" in e.message


def test_mooncake_mismatch_message(tmp_path):
    path = write_lines(tmp_path / "b.jsonl", [_mc(input_length=1025)])
    e = expect_error(load_mooncake, path, 1, "hash_ids")
    assert "expected ceil(input_length 1025 / block_size 512) = 3" in e.message


def test_mooncake_non_utf8(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(json.dumps(MOONCAKE_OK).encode() + b"\n\xff\xfe\n")
    expect_error(load_mooncake, path, 2, None)


# ------------------------------------------------------------------------------------------ Alibaba
def _ali(**kw):
    rec = dict(ALIBABA_OK)
    rec.update(kw)
    return rec


def chain_reference(prompts: list[list[int]]) -> list[list[int]]:
    """The dict definition of chaining: dense id per (previous chained id or -1, raw id), first appearance."""
    table: dict[tuple[int, int], int] = {}
    out = []
    for ids in prompts:
        prev, row = -1, []
        for x in ids:
            prev = table.setdefault((prev, x), len(table))
            row.append(prev)
        out.append(row)
    return out


@pytest.mark.shared
def test_alibaba_real_sample(shared_file):
    path = shared_file("alibaba/sample_traceA_multiturn_20.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    w = load_alibaba(path)
    assert len(w) == 20 and (w.kind, w.block_size) == ("blocks", 16)
    np.testing.assert_array_equal(w.request_id, [r["chat_id"] for r in recs])
    np.testing.assert_array_equal(w.arrival, [r["timestamp"] for r in recs])
    np.testing.assert_array_equal(w.turn, [r["turn"] for r in recs])
    assert w.category.tolist() == [r["type"] for r in recs]
    ref = chain_reference([r["hash_ids"] for r in recs])
    np.testing.assert_array_equal(w.prompt_values, [x for row in ref for x in row])
    row = {r["chat_id"]: i for i, r in enumerate(recs)}
    for i, r in enumerate(recs):
        expect_parent = row.get(r["parent_chat_id"], -1)
        assert w.parent[i] == expect_parent
        if expect_parent >= 0:
            # A child repeats its parent's ids except the parent's partial last block.
            p = w.prompt(expect_parent)
            np.testing.assert_array_equal(w.prompt(i)[: len(p) - 1], p[:-1])
            assert w.prompt(i)[len(p) - 1] != p[-1]
    # 993 -> 816 -> 722 -> 555: one session named after its root
    assert w.session[row[993]] == w.session[row[816]] == w.session[row[722]] == 555
    assert w.session[row[121]] == 121 and w.session[row[716]] == 121
    # Tail id 1086 closes requests 239, 357, 555 and 1233 after different prefixes: four chained ids.
    tails = [w.prompt(row[c])[-1] for c in (239, 357, 555, 1233)]
    assert len(set(tails)) == 4
    assert w.meta["chained"] is True


def test_alibaba_fixture_chaining(tmp_path):
    parent = _ali(chat_id=10, input_length=40, hash_ids=[1, 2, 3])  # last block partial (8 tokens)
    child = _ali(chat_id=11, parent_chat_id=10, turn=2, timestamp=1.0, input_length=96, hash_ids=[1, 2, 4, 5, 6, 7])
    other = _ali(chat_id=12, timestamp=2.0, input_length=48, hash_ids=[9, 2, 1080])  # 2 after another prefix
    again = _ali(chat_id=13, timestamp=3.0, input_length=48, hash_ids=[1, 2, 1080])
    repeat = _ali(chat_id=14, timestamp=4.0, input_length=64, hash_ids=[5, 7, 5, 7])
    short = _ali(chat_id=15, timestamp=5.0, input_length=32, hash_ids=[5, 7])
    w = load_alibaba(write_lines(tmp_path / "a.jsonl", [parent, child, other, again, repeat, short]))
    p = [w.prompt(i).tolist() for i in range(len(w))]
    assert p[1][:2] == p[0][:2] and p[1][2] != p[0][2]
    assert p[2][1] != p[0][1]  # raw 2 after 9 is not raw 2 after 1
    assert p[3][:2] == p[0][:2]
    assert p[2][2] != p[3][2]  # shared tail 1080 after different prefixes
    assert len(set(p[4])) == 4  # an id repeated inside one request is a new block each time
    assert p[5] == p[4][:2]
    assert p == chain_reference([r["hash_ids"] for r in (parent, child, other, again, repeat, short)])
    assert p[0] == [0, 1, 2]  # dense, in order of first appearance
    np.testing.assert_array_equal(w.parent, [-1, 0, -1, -1, -1, -1])
    np.testing.assert_array_equal(w.session, [10, 10, 12, 13, 14, 15])
    raw = load_alibaba(tmp_path / "a.jsonl", chain=False)
    np.testing.assert_array_equal(
        raw.prompt_values, [x for r in (parent, child, other, again, repeat, short) for x in r["hash_ids"]]
    )
    assert raw.meta["chained"] is False


def test_chain_block_ids_matches_dict_reference():
    rng = np.random.default_rng(1)
    prompts = []
    for _ in range(300):
        n = int(rng.integers(0, 25))
        base = [int(x) for x in rng.integers(0, 4, size=min(n, 3))]  # few prefixes → much sharing
        prompts.append(base + [int(x) for x in rng.integers(0, 6, size=n - len(base))])
    offsets = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in prompts], out=offsets[1:])
    flat = np.array([x for p in prompts for x in p], dtype=np.int64)
    got = chain_block_ids(offsets, flat)
    np.testing.assert_array_equal(got, [x for row in chain_reference(prompts) for x in row])
    assert chain_block_ids(np.zeros(1, np.int64), np.zeros(0, np.int64)).size == 0


def test_alibaba_sessions_with_missing_parents(tmp_path):
    recs = [
        _ali(chat_id=5, parent_chat_id=999, turn=3, timestamp=0.0),  # parent before the window
        _ali(chat_id=6, parent_chat_id=999, turn=3, timestamp=1.0),  # its sibling
        _ali(chat_id=7, parent_chat_id=5, turn=4, timestamp=2.0),
        _ali(chat_id=8, parent_chat_id=-1, turn=1, timestamp=3.0),
        _ali(chat_id=9, parent_chat_id=20, turn=2, timestamp=4.0),  # parent later in the file
        _ali(chat_id=20, parent_chat_id=8, turn=1, timestamp=5.0),
    ]
    w = load_alibaba(write_lines(tmp_path / "s.jsonl", recs))
    np.testing.assert_array_equal(w.parent, [-1, -1, 0, -1, 5, 3])
    np.testing.assert_array_equal(w.session, [999, 999, 999, 8, 8, 8])


def test_alibaba_sort_option(tmp_path):
    recs = [
        _ali(chat_id=1, timestamp=2.0, hash_ids=[1, 2]),
        _ali(chat_id=2, parent_chat_id=1, timestamp=3.0, turn=2, hash_ids=[1, 3]),
        _ali(chat_id=3, timestamp=1.0, hash_ids=[4, 5]),
        _ali(chat_id=4, timestamp=2.0, hash_ids=[1, 6]),
    ]
    path = write_lines(tmp_path / "u.jsonl", recs)
    expect_error(load_alibaba, path, 3, "timestamp")
    w = load_alibaba(path, sort=True)
    np.testing.assert_array_equal(w.request_id, [3, 1, 4, 2])  # stable among equal timestamps
    np.testing.assert_array_equal(w.arrival, [1.0, 2.0, 2.0, 3.0])
    np.testing.assert_array_equal(w.parent, [-1, -1, -1, 1])
    assert w.prompt(1)[0] == w.prompt(2)[0] == w.prompt(3)[0]  # raw 1 at the start → same chained id
    assert w.meta["sorted_on_load"] is True


ALIBABA_BAD = [
    ('{"chat_id": 2, "parent_chat_id": -1, "timest', None, 2),
    ({k: v for k, v in ALIBABA_OK.items() if k != "type"} | {"chat_id": 2}, "type", 2),
    ({k: v for k, v in ALIBABA_OK.items() if k != "parent_chat_id"} | {"chat_id": 2}, "parent_chat_id", 2),
    (_ali(chat_id="2"), "chat_id", 2),
    (_ali(chat_id=2, timestamp="1.0"), "timestamp", 2),
    (_ali(chat_id=2, timestamp=True), "timestamp", 2),
    (_ali(chat_id=2, timestamp=float("inf")), "timestamp", 2),
    (_ali(chat_id=2, timestamp=float("nan")), "timestamp", 2),
    ('{"chat_id": 2, "timestamp": ' + "9" * 5000 + "}", None, 2),
    (_ali(chat_id=2, turn=1.0), "turn", 2),
    (_ali(chat_id=2, type=3), "type", 2),
    (_ali(chat_id=2, input_length=-3, hash_ids=[]), "input_length", 2),
    (_ali(chat_id=2, output_length=-1), "output_length", 2),
    (_ali(chat_id=2, input_length=33), "hash_ids", 2),  # ceil(33/16) = 3
    (_ali(chat_id=2, hash_ids=[1, None]), "hash_ids", 2),
    (_ali(chat_id=2, timestamp=0.25), "timestamp", 2),  # backwards
    (_ali(chat_id=2, parent_chat_id=-2), "parent_chat_id", 2),
    (_ali(chat_id=2, parent_chat_id=2), "parent_chat_id", 2),
    (_ali(chat_id=1), "chat_id", 2),  # duplicate
]


@pytest.mark.parametrize("bad, field, line", ALIBABA_BAD)
def test_alibaba_bad_line(tmp_path, bad, field, line):
    path = write_lines(tmp_path / "bad.jsonl", [ALIBABA_OK, bad, _ali(chat_id=3, timestamp=9.0)])
    expect_error(load_alibaba, path, line, field)


def test_alibaba_parent_cycle(tmp_path):
    recs = [_ali(chat_id=1, parent_chat_id=2), _ali(chat_id=2, parent_chat_id=1, timestamp=1.0)]
    expect_error(load_alibaba, write_lines(tmp_path / "c.jsonl", recs), 1, "parent_chat_id")


# ------------------------------------------------------------------------------------------ native formats
def rich_tokens_workload() -> Workload:
    return from_lists(
        [[5, 6, 7], [5, 6, 7, 8, 9], [], [1]],
        arrival=[0.0, 0.1, 0.1, 2.5],
        output_length=[3, 0, 7, 1],
        request_id=[10, 11, 12, 13],
        session=[1, 1, -1, 2],
        turn=[1, 2, -1, 1],
        parent=[-1, 0, -1, -1],
        tenant=pd.Categorical(["a", "a", None, "b"], categories=["b", "a", "unused"]),
        category=pd.Categorical(["chat", "chat", "rag", "rag"], ordered=True),
        adapter=pd.Categorical([None, None, None, None], categories=["lora1"]),
        salt=pd.Categorical([1, 1, 2, 1]),
        output_offsets=np.array([0, 2, 2, 3, 4]),
        output_values=np.array([100, 101, 102, 103]),
    )


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_roundtrip_tokens(tmp_path, fmt):
    w = rich_tokens_workload()
    w.name, w.meta = "rich", {"note": "x", "n": np.int64(3), "list": [1, 2]}
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    path = save(w, tmp_path / f"t.{fmt}")
    back = load(path)
    w.meta["n"] = 3  # numpy scalars are saved as plain JSON numbers
    assert_same(w, back)
    assert back.source == str(path) and len(back.checksum) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"t.{fmt}"]  # no temp files left
    assert load_trace(path).name == "rich"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_roundtrip_blocks_and_plain(tmp_path, fmt):
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    blocks = zipf_blocks(200, seed=3)
    blocks.category = pd.Categorical(np.where(np.arange(200) % 3 == 0, "x", "y"))
    blocks.session = np.arange(200) // 4
    assert_same(blocks, load(save(blocks, tmp_path / f"b.{fmt}")))
    plain = from_lists([[1, 2], [3]], arrival=[0.0, 1.0])
    back = load(save(plain, tmp_path / f"p.{fmt}"))
    assert_same(plain, back)
    assert back.session is None and back.tenant is None and back.output_offsets is None
    empty = from_lists([], kind="blocks", block_size=8)
    assert_same(empty, load(save(empty, tmp_path / f"e.{fmt}")))


@pytest.mark.shared
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_roundtrip_real_traces(tmp_path, shared_file, fmt):
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    ali = load_alibaba(shared_file("alibaba/sample_traceA_multiturn_20.jsonl"))
    assert_same(ali, load(save(ali, tmp_path / f"a.{fmt}")))
    moon = load_mooncake(shared_file("mooncake/synthetic_trace.jsonl")).head(500)
    assert_same(moon, load(save(moon, tmp_path / f"m.{fmt}")))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_roundtrip_synthetic_chat(tmp_path, fmt):
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    w = synthetic_chat(150, seed=2)
    assert_same(w, load(save(w, tmp_path / f"c.{fmt}")))


def test_save_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "keep.jsonl"
    target.write_text("old\n")
    import kvlab.workload.native_jsonl as native_jsonl

    monkeypatch.setattr(native_jsonl, "make_header", lambda w: {"bad": object()})
    with pytest.raises(TypeError):
        save_jsonl(from_lists([[1]]), target)
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.jsonl"]


def test_save_rejects_unsaveable(tmp_path):
    w = from_lists([[1]], tenant=pd.Categorical([(1, 2)]))
    with pytest.raises(ConfigError, match="tenant"):
        save_jsonl(w, tmp_path / "x.jsonl")
    w = from_lists([[1]], meta={"f": object()})
    with pytest.raises(ConfigError, match="meta"):
        save_parquet(w, tmp_path / "x.parquet")
    w = from_lists([[1], [2]], request_id=[4, 4], parent=[-1, 0])
    with pytest.raises(ConfigError, match="request_id"):
        save_jsonl(w, tmp_path / "x.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_jsonl_text_records_need_tokenizer(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"arrival": 0, "output_length": 1, "text": "hi"},
            {"arrival": 1, "output_length": 1, "text": "héllo"},
        ],
    )
    with pytest.raises(ConfigError, match=r"t\.jsonl:1.*tokenizer"):
        load_jsonl(path)
    w = load_jsonl(path, tokenizer=ByteTokenizer())
    assert w.prompt(0).tolist() == list(b"hi")
    assert w.input_length.tolist() == [2, 6]


def test_jsonl_block_size_sources(tmp_path):
    rec = {"arrival": 0.0, "output_length": 1, "input_length": 20, "hash_ids": [3, 4]}
    header = {"kvlab_trace": 1, "kind": "blocks", "block_size": 16}
    assert load_jsonl(write_lines(tmp_path / "h.jsonl", [header, rec])).block_size == 16
    assert load_jsonl(write_lines(tmp_path / "r.jsonl", [rec | {"block_size": 10}])).block_size == 10
    assert load_jsonl(write_lines(tmp_path / "a.jsonl", [rec]), block_size=12).block_size == 12
    expect_error(load_jsonl, tmp_path / "a.jsonl", 1, "block_size")  # no block size anywhere
    expect_error(load_jsonl, write_lines(tmp_path / "c.jsonl", [header, rec | {"block_size": 8}]), 2, "block_size")
    with pytest.raises(TraceFormatError) as ei:
        load_jsonl(tmp_path / "h.jsonl", block_size=8)
    assert (ei.value.line, ei.value.field) == (1, "block_size")


TOK = {"arrival": 1.0, "output_length": 2, "tokens": [1, 2, 3]}
JSONL_BAD = [
    ('{"arrival": 1.0, "output_length": 2, "tok', None),
    ({"arrival": 1.0, "output_length": 2}, "tokens"),  # no prompt
    (TOK | {"text": "x"}, "text"),  # two prompts
    (TOK | {"colour": "red"}, "colour"),  # unknown field
    ({"output_length": 2, "tokens": [1]}, "arrival"),
    (TOK | {"arrival": "1"}, "arrival"),
    (TOK | {"arrival": True}, "arrival"),
    (TOK | {"arrival": 0.5}, "arrival"),  # backwards
    (TOK | {"output_length": 2.0}, "output_length"),
    (TOK | {"output_length": -1}, "output_length"),
    (TOK | {"tokens": [1, -2]}, "tokens"),
    (TOK | {"tokens": [1, "2"]}, "tokens"),
    (TOK | {"input_length": 4}, "input_length"),
    (TOK | {"block_size": 16}, "block_size"),
    (TOK | {"session": "s1"}, "session"),
    (TOK | {"turn": False}, "turn"),
    (TOK | {"parent": 1.5}, "parent"),
    (TOK | {"tenant": ["a"]}, "tenant"),
    (TOK | {"output_tokens": [1, 2.5]}, "output_tokens"),
    ({"arrival": 1.0, "output_length": 2, "input_length": 3, "hash_ids": [1], "block_size": 4}, "hash_ids"),
    ({"kvlab_trace": 1}, "kvlab_trace"),  # header not first
]


@pytest.mark.parametrize("bad, field", JSONL_BAD)
def test_jsonl_bad_line(tmp_path, bad, field):
    path = write_lines(tmp_path / "bad.jsonl", [TOK, bad, TOK | {"arrival": 5.0}])
    expect_error(load_jsonl, path, 2, field)


def test_jsonl_more_errors(tmp_path):
    hdr = {"kvlab_trace": 1, "kind": "tokens", "categories": {"tenant": ["a"]}}
    expect_error(load_jsonl, write_lines(tmp_path / "c.jsonl", [hdr, TOK | {"tenant": "b"}]), 2, "tenant")
    expect_error(load_jsonl, write_lines(tmp_path / "v.jsonl", [{"kvlab_trace": 2}]), 1, "kvlab_trace")
    expect_error(load_jsonl, write_lines(tmp_path / "k.jsonl", [{"kvlab_trace": 1, "kind": "bits"}]), 1, "kind")
    expect_error(load_jsonl, write_lines(tmp_path / "b.jsonl", [{"kvlab_trace": 1, "kind": "blocks"}]), 1, "block_size")
    mixed = [TOK, {"arrival": 2.0, "output_length": 1, "input_length": 3, "hash_ids": [1]}]
    expect_error(load_jsonl, write_lines(tmp_path / "m.jsonl", mixed), 2, "hash_ids")
    rid = [TOK | {"request_id": 1}, TOK | {"arrival": 2.0}]
    expect_error(load_jsonl, write_lines(tmp_path / "r.jsonl", rid), 2, "request_id")
    dup = [TOK | {"request_id": 1}, TOK | {"request_id": 1}, TOK | {"request_id": 2, "parent": 1}]
    expect_error(load_jsonl, write_lines(tmp_path / "d.jsonl", dup), 3, "parent")


def test_jsonl_parent_by_request_id(tmp_path):
    recs = [
        TOK | {"request_id": 50},
        TOK | {"request_id": 7, "parent": 50},
        TOK | {"request_id": 8, "parent": 404},
    ]
    w = load_jsonl(write_lines(tmp_path / "p.jsonl", recs))
    np.testing.assert_array_equal(w.parent, [-1, 0, -1])  # a parent outside the file is -1


def _parquet(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def test_parquet_foreign_and_errors(tmp_path):
    ok = {"arrival": [0.0, 1.0], "output_length": [1, 2], "tokens": [[1, 2], [3]]}
    w = load_parquet(_parquet(tmp_path / "f.parquet", pa.table(ok)))
    assert w.prompt_values.tolist() == [1, 2, 3] and w.kind == "tokens" and w.name == "f"
    blocks = {"arrival": [0.0], "output_length": [1], "input_length": [20], "hash_ids": [[4, 5]]}
    path = _parquet(tmp_path / "h.parquet", pa.table(blocks))
    with pytest.raises(TraceFormatError) as ei:
        load_parquet(path)
    assert ei.value.field == "block_size"
    assert load_parquet(path, block_size=16).block_size == 16

    def bad(name: str, **cols) -> TraceFormatError:
        with pytest.raises(TraceFormatError) as ei:
            load_parquet(_parquet(tmp_path / f"{name}.parquet", pa.table(ok | cols)))
        assert ei.value.path.endswith(f"{name}.parquet") and ei.value.line is None
        return ei.value

    assert bad("back", arrival=[1.0, 0.5]).field == "arrival"
    assert "row 1" in bad("back2", arrival=[1.0, 0.5]).message
    assert bad("str", arrival=["a", "b"]).field == "arrival"
    assert bad("neg", output_length=[1, -2]).field == "output_length"
    assert bad("flt", output_length=[1.0, 2.0]).field == "output_length"
    assert bad("nul", tokens=[[1], None]).field == "tokens"
    assert bad("negtok", tokens=[[1], [-3]]).field == "tokens"
    assert bad("len", input_length=[2, 2]).field == "tokens"
    assert bad("unk", colour=["r", "g"]).field == "colour"
    assert bad("two", text=["a", "b"]).field == "text"
    with pytest.raises(TraceFormatError) as ei:
        load_parquet(_parquet(tmp_path / "miss.parquet", pa.table({"arrival": [0.0], "tokens": [[1]]})))
    assert ei.value.field == "output_length"
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(TraceFormatError):
        load_parquet(tmp_path / "junk.parquet")


def test_parquet_text_column(tmp_path):
    path = _parquet(tmp_path / "t.parquet", pa.table({"arrival": [0.0], "output_length": [1], "text": ["ab"]}))
    with pytest.raises(ConfigError, match="tokenizer"):
        load_parquet(path)
    assert load_parquet(path, tokenizer=ByteTokenizer(offset=3)).prompt(0).tolist() == [97 + 3, 98 + 3]


# ------------------------------------------------------------------------------------------ detection
def test_detect_format_and_load_trace(tmp_path):
    moon = write_lines(tmp_path / "x.jsonl", [MOONCAKE_OK])
    ali = write_lines(tmp_path / "y.jsonl", ["", ALIBABA_OK])
    nat = write_lines(tmp_path / "z.jsonl", [TOK])
    assert detect_format(moon) == "mooncake"
    assert detect_format(ali) == "alibaba"
    assert detect_format(nat) == "jsonl"
    w = from_lists([[1, 2]])
    assert detect_format(save_jsonl(w, tmp_path / "n.jsonl")) == "jsonl"
    assert detect_format(save_parquet(w, tmp_path / "n.data")) == "parquet"  # by magic bytes
    assert load_trace(moon).block_size == 512
    assert load_trace(ali).block_size == 16
    assert load_trace(ali, format="alibaba", block_size=10, name="n").name == "n"
    assert len(load_trace(tmp_path / "n.data")) == 1
    for bad in ([{"foo": 1}], ["[1]"], ["not json"], []):
        with pytest.raises(TraceFormatError):
            detect_format(write_lines(tmp_path / "bad.jsonl", bad))
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError):
        load_trace(moon, format="csv")


# ------------------------------------------------------------------------------------------ generators
def test_synthetic_chat_deterministic_and_structured():
    a, b = synthetic_chat(300, seed=7), synthetic_chat(300, seed=7)
    assert_same(a, b)
    np.testing.assert_array_equal(a.arrival, b.arrival)
    c = synthetic_chat(300, seed=8)
    assert not np.array_equal(a.prompt_values[:1000], c.prompt_values[:1000])
    w = synthetic_chat(seed=0)
    assert len(w) == 2000 and w.kind == "tokens"
    assert 1_000_000 < w.input_length.sum() < 6_000_000
    assert set(w.category.categories) == {"chat", "rag"} and len(w.tenant.categories) == 4
    assert np.all(np.diff(w.arrival) >= 0)
    assert w.prompt_values.min() >= 1000 and w.prompt_values.max() < 32000
    np.testing.assert_array_equal(w.output_length, np.diff(w.output_offsets))
    kids = np.flatnonzero(w.parent >= 0)
    assert len(kids) > 500
    for i in kids:
        p = w.parent[i]
        assert p < i and w.turn[i] == w.turn[p] + 1 and w.session[i] == w.session[p]
        assert w.tenant[i] == w.tenant[p] and w.category[i] == w.category[p]
        history = np.concatenate([w.prompt(p), w.output(p)])
        np.testing.assert_array_equal(w.prompt(i)[: len(history)], history)
    assert np.all(w.turn[w.parent < 0] == 1)
    # Same tenant → same system prompt prefix; different tenants differ at the first token.
    firsts = {}
    for i in np.flatnonzero(w.turn == 1)[:200]:
        firsts.setdefault(w.tenant[i], w.prompt(i)[:150].tolist())
        assert w.prompt(i)[:150].tolist() == firsts[w.tenant[i]]
    assert len({tuple(v) for v in firsts.values()}) == len(firsts)
    assert len(synthetic_chat(0)) == 0


def test_zipf_blocks_valid_and_deterministic():
    a, b = zipf_blocks(500, seed=1), zipf_blocks(500, seed=1)
    assert_same(a, b)
    assert a.kind == "blocks" and a.block_size == 16
    firsts = a.prompt_values[a.prompt_offsets[:-1]]
    assert len(np.unique(firsts)) < 100  # Zipf: popular prefixes repeat


def test_trace_stats_edge_cases():
    from kvlab.stats import trace_stats

    empty = trace_stats(from_lists([], kind="blocks", block_size=16))
    assert empty["requests"] == 0 and empty["repeated_block_ratio"] == 0.0 and empty["ideal_hit_rate"] == 0.0
    w = from_lists([[1, 2, 3, 4], [1, 2, 3, 4]], kind="blocks", block_size=4)
    assert trace_stats(w)["repeated_block_ratio"] == 0.5
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="block_size"):
            trace_stats(w, block_size=bad)
    with pytest.raises(ConfigError, match="hash scheme"):
        trace_stats(w, hash_scheme="md5")
