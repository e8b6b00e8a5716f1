"""Text sources: the shared text (MuSiQue, CacheBlend, MT-Bench, ShareGPT), local JSON/JSONL/Parquet files,
Hugging Face datasets offline (on a local file), and one-line errors for bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload.sources import (
    Document,
    TextRecord,
    TextSourceError,
    Turn,
    cacheblend_records,
    hf_dataset_records,
    load_records,
    mt_bench_records,
    musique_records,
    shared_corpus,
    sharegpt_records,
)


@pytest.fixture(scope="module")
def text_dir(shared_file):
    return shared_file("text")


@pytest.fixture(scope="module")
def corpus(text_dir) -> dict[str, list[TextRecord]]:
    return shared_corpus(text_dir)


# ------------------------------------------------------------------------------------------ shared text
def test_shared_corpus_sizes(corpus):
    assert {k: len(v) for k, v in corpus.items()} == {"musique": 150, "cacheblend": 10, "mt_bench": 80, "sharegpt": 500}


def test_musique(corpus, text_dir):
    recs = corpus["musique"]
    assert all(len(r.documents) == 10 and r.category == "rag" for r in recs)
    first = recs[0]
    assert first.turns == (Turn("user", "Where was the author of Hannibal and Scipio educated at?"),
                           Turn("assistant", "Exeter College"))
    assert isinstance(first.documents[0], Document) and first.documents[0].text.startswith("thriller television")
    assert musique_records(text_dir, limit=3) == recs[:3]


def test_cacheblend(corpus, text_dir):
    recs = corpus["cacheblend"]
    assert [r.id for r in recs] == [f"cacheblend-{n}" for n in range(1, 11)]
    for n, r in enumerate(recs, 1):
        raw = json.loads((text_dir / "cacheblend" / "inputs" / f"{n}.json").read_text())
        assert len(r.documents) == int(raw["chunk_num"]) and r.documents[0].text == raw["0"]
        assert r.user_turns == [raw["query"]] and raw["query"].strip().startswith("Answer the question")


def test_mt_bench_turns_and_reference_answers(corpus, text_dir):
    recs = corpus["mt_bench"]
    answered = [r for r in recs if r.meta["answer_source"] == "reference"]
    assert len(answered) == 30
    assert all([t.role for t in r.turns] == ["user", "assistant", "user", "assistant"] for r in answered)
    assert all([t.role for t in r.turns] == ["user", "user"] for r in recs if r not in answered)
    r101 = next(r for r in recs if r.id == "101")
    assert r101.category == "reasoning" and r101.turns[1].content.startswith("If you have just overtaken the second")
    # without an answers file: questions only
    bare = mt_bench_records(text_dir / "mt_bench" / "question.jsonl")
    assert len(bare) == 80 and all(len(r.turns) == 2 for r in bare)
    assert {r.category for r in bare} >= {"writing", "reasoning", "math", "coding"}


def test_sharegpt_first_turns(corpus, text_dir):
    recs = corpus["sharegpt"]
    assert all(len(r.turns) == 1 and r.turns[0].role == "user" for r in recs)
    assert recs[0].id == "fzcoUcK_0" and recs[0].turns[0].content.startswith("How to stop automatic updates")
    default = sharegpt_records(limit=7)  # the registry's copy: the committed traces/text file, byte-identical
    assert [(r.id, r.turns) for r in default] == [(r.id, r.turns) for r in recs[:7]]
    assert default[0].source.endswith("traces/text/sharegpt_first_turn/ShareGPT_V3_filtered_500.json")


# ------------------------------------------------------------------------------------------ local files
def _conversations(corpus) -> list[dict]:
    """Real multi-turn conversations in three shapes, from MT-Bench questions with their reference answers."""
    answered = [r for r in corpus["mt_bench"] if len(r.turns) == 4][:6]
    rows = []
    for k, r in enumerate(answered):
        if k % 3 == 0:  # ShareGPT
            names = {"user": "human", "assistant": "gpt"}
            rows.append({"id": r.id, "conversations": [{"from": names[t.role], "value": t.content} for t in r.turns]})
        elif k % 3 == 1:  # OpenAI chat with a system message
            msgs = [{"role": "system", "content": "Be helpful."}] + [{"role": t.role, "content": t.content}
                                                                     for t in r.turns]
            rows.append({"id": r.id, "messages": msgs, "category": r.category})
        else:  # a prompt and a response
            rows.append({"id": r.id, "prompt": r.turns[0].content, "response": r.turns[1].content})
    return rows


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_local_files_in_every_shape(corpus, tmp_path, fmt):
    rows = _conversations(corpus)
    path = tmp_path / f"conv.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        for shape in ("conversations", "messages", "prompt"):  # one schema per Parquet file
            pq.write_table(pa.Table.from_pylist([r for r in rows if shape in r]), tmp_path / f"{shape}.parquet")
    recs = (load_records(path) if fmt != "parquet" else
            [r for s in ("conversations", "messages", "prompt") for r in load_records(tmp_path / f"{s}.parquet")])
    mt = {r.id: r for r in corpus["mt_bench"]}
    by_id = {r.id: r for r in recs}
    assert len(by_id) == 6
    for row in rows:
        rec = by_id[row["id"]]
        if "conversations" in row:
            assert rec.turns == mt[row["id"]].turns
        elif "messages" in row:
            assert rec.turns == (Turn("system", "Be helpful."), *mt[row["id"]].turns)
            assert rec.category == row["category"]
        else:
            assert rec.turns == mt[row["id"]].turns[:2]
    assert load_records(path if fmt != "parquet" else tmp_path / "messages.parquet", limit=1)[0] == recs[
        0 if fmt != "parquet" else 2]


def test_openai_content_parts_and_tool_calls(tmp_path):
    calls = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"alps\"}"}}]
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "Hannibal?"}]},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "Crossed the Alps."},
    ]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (rec,) = load_records(path)
    assert rec.turns == (Turn("user", "Where is Hannibal?"), Turn("assistant", json.dumps(calls)),
                         Turn("tool", "Crossed the Alps."))
    assert rec.id == "0"


# ------------------------------------------------------------------------------------------ datasets
def test_hf_datasets_on_a_local_file(corpus, tmp_path):
    pytest.importorskip("datasets")
    rows = [r for r in _conversations(corpus) if "messages" in r]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = hf_dataset_records(path, cache_dir=tmp_path / "hf-cache")
    assert [r.turns for r in recs] == [r.turns for r in load_records(path)]
    assert [r.id for r in recs] == [r["id"] for r in rows] and recs[0].source == str(path)
    assert hf_dataset_records(path, cache_dir=tmp_path / "hf-cache", limit=1) == recs[:1]


def test_hf_datasets_offline_unknown_name(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match="kvlab-test/no-such-dataset: cannot load offline") as e:
        hf_dataset_records("kvlab-test/no-such-dataset", cache_dir=tmp_path)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations", "message 0: unknown from string 'bot'"),
        ({"conversations": []}, "conversations", "expected a non-empty list of messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "expected a string (or text parts), got int 5"),
        ({"messages": ["hi"]}, "messages", "message 0: expected an object"),
        ({"turns": ["a", 1]}, "turns", "expected a non-empty list of strings"),
        ({"ctxs": [{"text": 3}], "question": "q"}, "ctxs", "passage 0: expected {title, text} strings"),
        ({"prompt": ["x"]}, "prompt", "expected a string, got list of 1"),
        ({"title": "no text"}, None, "no conversations/messages/turns/ctxs/prompt/instruction/question/text field"),
    ],
)
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, line, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ConfigError) as e:
        load_records(path)
    assert isinstance(e.value, TextSourceError) and isinstance(e.value, TraceFormatError)
    assert e.value.path == str(path) and e.value.line == 2 and e.value.field == field
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_files(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(TextSourceError, match=r"bad.jsonl:2: invalid JSON"):
        load_records(path)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": None, "text": 7}]))
    with pytest.raises(TextSourceError, match=r"bad.json: field 'text': row 1: expected a string, got int 7"):
        load_records(path)
    path.write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(TextSourceError, match="expected a JSON list of records"):
        load_records(path)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"turns": [["q1", "q2"], []]}), path)
    with pytest.raises(TextSourceError, match=r"rows.parquet: field 'turns': row 1: expected a non-empty list"):
        load_records(path)
    with pytest.raises(TextSourceError, match="unknown text format"):
        load_records(tmp_path / "data.txt")
    with pytest.raises(TextSourceError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    with pytest.raises(TextSourceError, match="no <n>.json CacheBlend input files"):
        cacheblend_records(tmp_path)
