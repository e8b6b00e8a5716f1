"""Segmented requests: the Segments columns, hit attribution by segment, native JSONL/Parquet round trips."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload import ByteTokenizer, from_lists, load_jsonl, load_parquet, save_jsonl, save_parquet, synthetic_chat
from kvlab.workload.segments import SEGMENT_KINDS, Segment, Segments, first_miss_segment, hit_tokens_by_segment

TOK = ByteTokenizer()


def segmented(parts_per_request: list[list[tuple[str, str]]], **columns: object):
    """A token workload whose prompts are the byte-token concatenation of ``(kind, text)`` parts."""
    prompts, segs = [], []
    for parts in parts_per_request:
        ids: list[int] = []
        row = []
        for kind, text in parts:
            piece = TOK.encode(text)
            row.append(Segment(kind, len(ids), len(ids) + len(piece), text))
            ids += piece
        prompts.append(ids)
        segs.append(row)
    return from_lists(prompts, segments=Segments.from_lists(segs), **columns)


@pytest.fixture(scope="module")
def mt_bench_text(shared_file) -> list[dict]:
    """The first eight MT-Bench questions (real text), with their categories."""
    path = shared_file("text/mt_bench/question.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()[:8]]


@pytest.fixture(scope="module")
def real_workload(mt_bench_text):
    """Eight two-turn prompts from real MT-Bench text: system + volatile + history + user segments."""
    system = "You are a helpful assistant. Answer concisely.\n"
    reqs = []
    for k, q in enumerate(mt_bench_text):
        t1, t2 = q["turns"][:2]
        reqs.append([("system", system), ("volatile", f"Request id: {1000 + k}\n"), ("history", "USER: " + t1 + "\n"),
                     ("user", "USER: " + t2 + "\nASSISTANT:")])
    return segmented(reqs, arrival=np.arange(len(reqs), dtype=float), output_length=[64] * len(reqs),
                     category=[q["category"] for q in mt_bench_text])


# ------------------------------------------------------------------------------------------ attribution
def test_hit_tokens_by_segment_overlap_and_first_miss():
    spans = [Segment("system", 0, 10), Segment("volatile", 10, 13), Segment("user", 13, 40)]
    # block size 8: two full blocks hit = 16 tokens; the second block straddles system and volatile/user
    assert hit_tokens_by_segment(spans, 16) == {"system": 10, "volatile": 3, "user": 3}
    assert hit_tokens_by_segment(spans, 0) == {"system": 0, "volatile": 0, "user": 0}
    assert hit_tokens_by_segment(spans, 40) == {"system": 10, "volatile": 3, "user": 27}
    assert first_miss_segment(spans, 0) == "system"
    assert first_miss_segment(spans, 9) == "system"
    assert first_miss_segment(spans, 10) == "volatile"
    assert first_miss_segment(spans, 39) == "user"
    assert first_miss_segment(spans, 40) is None


def test_gaps_and_repeated_kinds():
    spans = [("document", 2, 5), ("document", 7, 9), ("user", 9, 12)]  # tokens 0-1 and 5-6: template
    assert hit_tokens_by_segment(spans, 8) == {"document": 4, "user": 0}
    assert first_miss_segment(spans, 0) == "document"  # a miss in a gap goes to the next segment
    assert first_miss_segment(spans, 5) == "document"
    assert first_miss_segment(spans, 6) == "document"


def test_vectorised_hits_match_per_request(real_workload):
    w = real_workload
    rng = np.random.default_rng(0)
    hits = rng.integers(0, w.input_length + 1)
    per_row = w.segments.hit_tokens(hits)
    for i in range(len(w)):
        spans = w.segment_spans(i)
        a, b = w.segments.offsets[i], w.segments.offsets[i + 1]
        assert per_row[a:b].tolist() == [max(0, min(hits[i], s.end) - s.start) for s in spans]
        assert sum(hit_tokens_by_segment(spans, int(hits[i])).values()) == per_row[a:b].sum()
    hits[0] = w.input_length[0]  # all hit: no first miss
    first = w.segments.first_miss(hits)
    assert [None if pd.isna(k) else k for k in first] == [
        first_miss_segment(w.segment_spans(i), int(hits[i])) for i in range(len(w))
    ]
    assert pd.isna(first[0])
    frame = w.segments.frame(hits)
    assert list(frame.columns) == ["row", "index", "kind", "start", "end", "tokens", "hit_tokens"]
    assert frame.groupby("row")["tokens"].sum().tolist() == w.input_length.tolist()  # the spans tile each prompt
    assert frame["hit_tokens"].tolist() == w.segments.hit_tokens(hits).tolist() and frame["index"].max() == 3


def test_clip_to_shorter_prompts(real_workload):
    w = real_workload
    cut = np.minimum(w.input_length, 60)
    segs = w.segments.clip(cut)
    clipped = from_lists([w.prompt(i)[:60] for i in range(len(w))], segments=segs)
    for i in range(len(w)):
        assert [(s.kind, s.start, s.end) for s in clipped.segment_spans(i)] == [
            (s.kind, min(s.start, 60), min(s.end, 60)) for s in w.segment_spans(i)
        ]


def test_first_miss_with_gaps_and_empty_requests():
    segs = Segments.from_lists([[("document", 2, 5), ("user", 7, 9)], [], [("system", 0, 4)]])
    first = segs.first_miss(np.array([0, 0, 4]))
    assert first[0] == "document" and pd.isna(first[1]) and pd.isna(first[2])
    assert segs.first_miss(np.array([6, 0, 3]))[0] == "user"
    assert segs.frame().shape == (3, 6)


# ------------------------------------------------------------------------------------------ the Workload
def test_segments_text_and_ids(real_workload):
    w = real_workload
    for i in range(len(w)):
        spans = w.segment_spans(i)
        assert [s.kind for s in spans] == ["system", "volatile", "history", "user"]
        assert spans[0].start == 0 and spans[-1].end == w.input_length[i]
        for s in spans:
            assert TOK.decode(w.prompt(i)[s.start : s.end]) == s.text


def test_segments_from_plain_lists():
    w = from_lists([[1, 2, 3], [4]], segments=[[("system", 0, 1), ("user", 1, 3)], [("user", 0, 1)]])
    assert isinstance(w.segments, Segments) and w.segment_spans(1) == [Segment("user", 0, 1)]


def test_select_keeps_segments(real_workload):
    w = real_workload
    sub = w.select(np.array([2, 5]))
    assert sub.segment_spans(0) == w.segment_spans(2) and sub.segment_spans(1) == w.segment_spans(5)
    assert w.head(3).segment_spans(2) == w.segment_spans(2)
    assert len(w.head(3).segments.kind) == 12


def test_content_hash_sees_segments(real_workload):
    w = real_workload
    bare = from_lists([w.prompt(i) for i in range(len(w))], arrival=w.arrival, output_length=w.output_length,
                      category=w.category)
    assert bare.content_sha256 != w.content_sha256
    moved = Segments.from_lists([[s._replace(kind="document") if s.kind == "history" else s for s in w.segment_spans(i)]
                                 for i in range(len(w))])
    other = from_lists([w.prompt(i) for i in range(len(w))], arrival=w.arrival, output_length=w.output_length,
                       category=w.category, segments=moved)
    assert other.content_sha256 != w.content_sha256


def test_without_segments_nothing_changes(tmp_path):
    """No segments: same content hash and byte-identical JSONL as before segments existed."""
    w = synthetic_chat(300, seed=3)
    assert w.segments is None and w.segment_spans(0) == []
    assert w.content_sha256 == "edcb794390f30fa8426b21f2f760f13efb7f242cdfdd7ffddde80ac467dc0dac"
    save_jsonl(w, tmp_path / "w.jsonl")
    digest = hashlib.sha256((tmp_path / "w.jsonl").read_bytes()).hexdigest()
    assert digest == "f3f460fc4e0746554d7c47eda250e37a2df860e0b795b97bd09ffd27f054b050"
    save_parquet(w, tmp_path / "w.parquet")
    assert "segments" not in pq.read_schema(tmp_path / "w.parquet").names
    assert load_parquet(tmp_path / "w.parquet").segments is None


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([("system", 0, 99)], "outside"),
        ([("system", 3, 2)], "outside"),
        ([("system", 0, 5), ("user", 4, 8)], "before the previous segment"),
        ([("user", -1, 2)], "outside"),
    ],
)
def test_bad_spans_are_config_errors(spans, message):
    with pytest.raises(ConfigError, match=message):
        from_lists([[1] * 10], segments=Segments.from_lists([spans]))


def test_bad_kind_and_mixed_text():
    with pytest.raises(ConfigError, match="'prompt' is not a segment kind"):
        Segments.from_lists([[("prompt", 0, 1)]])
    with pytest.raises(ConfigError, match="every segment or for none"):
        Segments.from_lists([[("system", 0, 1, "a"), ("user", 1, 2)]])
    assert SEGMENT_KINDS == ("system", "tools", "document", "history", "user", "volatile", "output")


# ------------------------------------------------------------------------------------------ native formats
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip(real_workload, tmp_path, fmt):
    w = real_workload.select(np.arange(len(real_workload)))
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    path = save(w, tmp_path / f"w.{fmt}")
    back = load(path)
    assert back.content_sha256 == w.content_sha256
    for i in range(len(w)):
        assert back.segment_spans(i) == w.segment_spans(i)
        for s in back.segment_spans(i):  # the ids of a segment are its span of the stored prompt
            assert TOK.decode(back.prompt(i)[s.start : s.end]) == s.text
    save(back, tmp_path / f"again.{fmt}")
    if fmt == "jsonl":
        assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip_without_text_and_empty(tmp_path, fmt):
    segs = Segments.from_lists([[("system", 0, 2), ("user", 2, 3)], [], [("document", 1, 1)]])
    w = from_lists([[1, 2, 3], [4], [5, 6]], segments=segs)
    save, load = (save_jsonl, load_jsonl) if fmt == "jsonl" else (save_parquet, load_parquet)
    back = load(save(w, tmp_path / f"w.{fmt}"))
    assert back.segments.text is None and back.content_sha256 == w.content_sha256
    assert back.segment_spans(1) == [] and back.segment_spans(2) == [Segment("document", 1, 1)]
    empty = from_lists([[1, 2]], segments=Segments.from_lists([[]]))
    back = load(save(empty, tmp_path / f"e.{fmt}"))
    assert back.segments is not None and back.content_sha256 == empty.content_sha256


def _jsonl(tmp_path, *records: dict):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ("system", "expected a list of segment objects"),
        ([{"kind": "sys", "start": 0, "end": 1}], "segment 0: kind string 'sys' is not one of"),
        ([{"kind": "user", "start": 0, "end": 9}], r"segment 0: span \[0, 9\) must lie in \[0, 3\]"),
        ([{"kind": "user", "start": 0, "end": 2}, {"kind": "user", "start": 1, "end": 3}], "segment 1: span"),
        ([{"kind": "user", "start": 0, "end": 1, "colour": 1}], "unknown key 'colour'"),
        ([{"kind": "user", "start": "0", "end": 1}], "segment 0: start expected an integer"),
        ([{"kind": "user", "start": 0, "end": 1, "text": 5}], "text must be a string"),
    ],
)
def test_jsonl_bad_segments_name_line_and_field(tmp_path, segments, message):
    good = {"arrival": 0, "output_length": 1, "tokens": [1, 2, 3]}
    path = _jsonl(tmp_path, good, good | {"segments": segments})
    with pytest.raises(TraceFormatError, match=message) as e:
        load_jsonl(path)
    assert e.value.line == 2 and e.value.field == "segments"
    assert str(e.value).startswith(f"{path}:2: field 'segments': ")


def test_segments_refused_on_text_prompts(tmp_path):
    seg = [{"kind": "user", "start": 0, "end": 1}]
    path = _jsonl(tmp_path, {"arrival": 0, "output_length": 1, "text": "abc", "segments": seg})
    with pytest.raises(TraceFormatError, match="segment spans are token positions") as e:
        load_jsonl(path, tokenizer=TOK)
    assert e.value.line == 1 and e.value.field == "segments"
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"arrival": [0.0], "output_length": [1], "text": ["abc"], "segments": [seg]}), path)
    with pytest.raises(TraceFormatError, match="segment spans are token positions"):
        load_parquet(path, tokenizer=TOK)


def test_jsonl_text_on_some_segments_only(tmp_path):
    rec = {"arrival": 0, "output_length": 1, "tokens": [1, 2, 3]}
    path = _jsonl(tmp_path, rec | {"segments": [{"kind": "user", "start": 0, "end": 3, "text": "abc"}]},
                  rec | {"segments": [{"kind": "user", "start": 0, "end": 3}]})
    with pytest.raises(TraceFormatError, match="segment 0 has no text, unlike the first") as e:
        load_jsonl(path)
    assert e.value.line == 2


def test_parquet_bad_segments_name_row(tmp_path):
    w = from_lists([[1, 2, 3], [4, 5]], segments=Segments.from_lists([[("user", 0, 3)], [("user", 0, 2)]]))
    path = save_parquet(w, tmp_path / "w.parquet")
    table = pq.read_table(path)
    bad = pa.array([[{"kind": "user", "start": 0, "end": 3, "text": None}],
                    [{"kind": "user", "start": 0, "end": 7, "text": None}]], type=table.schema.field("segments").type)
    table = table.set_column(table.schema.get_field_index("segments"), "segments", bad)
    pq.write_table(table, path)
    with pytest.raises(TraceFormatError, match=r"row 1: segment 0: span \[0, 7\)") as e:
        load_parquet(path)
    assert e.value.field == "segments"
    table = table.set_column(table.schema.get_field_index("segments"), "segments", pa.array([1, 2]))
    pq.write_table(table, path)
    with pytest.raises(TraceFormatError, match="expected a list<struct> column"):
        load_parquet(path)
