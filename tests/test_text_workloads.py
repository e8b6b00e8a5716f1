"""Token workloads from real text: RAG prompts, MT-Bench sessions, ShareGPT first turns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import TraceFormatError
from kvlab.workload import ByteTokenizer, mt_bench_sessions, rag_prompts, sharegpt_first_turns
from kvlab.workload.text import ASSISTANT_PREFIX, CHAT_SYSTEM_PROMPT, RAG_SYSTEM_PROMPT, USER_PREFIX

TOK = ByteTokenizer()


class BosTokenizer:
    """Hugging Face-like: prepends BOS (id 1) unless add_special_tokens=False."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [b + 2 for b in text.encode()]


class PlainTokenizer:
    """Only ``encode(text)``: no keyword arguments at all."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_byte_tokenizer():
    t = ByteTokenizer(offset=3)
    ids = t.encode("héllo")
    assert ids == [b + 3 for b in "héllo".encode()] and t.vocab_size == 259
    assert t.decode(ids) == "héllo"
    assert t.encode("ab") + t.encode("c") == t.encode("abc")


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def mini_text(tmp_path):
    inputs = tmp_path / "cacheblend" / "inputs"
    inputs.mkdir(parents=True)
    for n in (2, 10, 1):
        obj = {str(k): f"passage {n}.{k} " for k in range(3)} | {"query": f"Q{n}?", "chunk_num": "3"}
        (inputs / f"{n}.json").write_text(json.dumps(obj))
    (inputs / "notes.json").write_text("{}")  # not <n>.json: ignored
    mt = tmp_path / "mt_bench"
    (mt / "reference_answer").mkdir(parents=True)
    qs = [
        {"question_id": 81, "category": "writing", "turns": ["Write A.", "Shorter."]},
        {"question_id": 101, "category": "reasoning", "turns": ["Why B?", "And C?"]},
    ]
    (mt / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    ans = {"question_id": 101, "model_id": "m", "choices": [{"index": 0, "turns": ["Because.", "Also."]}]}
    (mt / "reference_answer" / "gpt-4.jsonl").write_text(json.dumps(ans) + "\n")
    share = tmp_path / "share.json"
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "hello there"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "second"}]},
    ]
    share.write_text(json.dumps(items))
    return tmp_path


def test_rag_prompts_fixture(mini_text):
    w = rag_prompts(mini_text / "cacheblend", TOK, interval=0.5)
    assert w.request_id.tolist() == [1, 2, 10]
    assert w.arrival.tolist() == [0.0, 0.5, 1.0]
    text = TOK.decode(w.prompt(2))
    assert text == RAG_SYSTEM_PROMPT + "passage 10.0 passage 10.1 passage 10.2 Q10?"
    assert w.category.tolist() == ["rag"] * 3 and len(w.checksum) == 64
    same = rag_prompts(mini_text / "cacheblend" / "inputs", TOK)
    np.testing.assert_array_equal(same.prompt_values, w.prompt_values)
    bos = rag_prompts(mini_text / "cacheblend", BosTokenizer(), system_prompt=None)
    assert bos.prompt(0)[0] == 1 and np.count_nonzero(bos.prompt_values == 1) == 3  # one BOS per prompt


def test_rag_prompts_errors(tmp_path):
    with pytest.raises(TraceFormatError):
        rag_prompts(tmp_path, TOK)
    (tmp_path / "1.json").write_text(json.dumps({"0": "a", "query": "q", "chunk_num": "2"}))
    with pytest.raises(TraceFormatError) as ei:
        rag_prompts(tmp_path, TOK)
    assert ei.value.field == "1" and ei.value.path.endswith("1.json")
    (tmp_path / "1.json").write_text('{"0": "a", "qu')
    with pytest.raises(TraceFormatError, match="invalid JSON"):
        rag_prompts(tmp_path, TOK)


def test_mt_bench_fixture(mini_text):
    q = mini_text / "mt_bench" / "question.jsonl"
    a = mini_text / "mt_bench" / "reference_answer" / "gpt-4.jsonl"
    w = mt_bench_sessions(q, TOK, a, interval=1.0, turn_gap=1.5, output_length=99)
    assert w.arrival.tolist() == [0.0, 1.0, 1.5, 2.5]
    assert w.session.tolist() == [81, 101, 81, 101] and w.turn.tolist() == [1, 1, 2, 2]
    assert w.parent.tolist() == [-1, -1, 0, 1]
    assert w.category.tolist() == ["writing", "reasoning", "writing", "reasoning"]
    # Answered question 101: turn 2 = turn 1 prompt + answer + question 2; output ids = the answer.
    p1, p2 = TOK.decode(w.prompt(1)), TOK.decode(w.prompt(3))
    assert p1 == CHAT_SYSTEM_PROMPT + USER_PREFIX + "Why B?" + ASSISTANT_PREFIX
    assert p2 == p1 + " Because." + USER_PREFIX + "And C?" + ASSISTANT_PREFIX
    assert TOK.decode(w.output(1)) == " Because." and w.output_length[1] == len(" Because.")
    # Unanswered question 81: no answer in the history, default output length, no output ids.
    assert TOK.decode(w.prompt(2)) == TOK.decode(w.prompt(0)) + USER_PREFIX + "Shorter." + ASSISTANT_PREFIX
    assert w.output_length[0] == 99 and w.output(0).size == 0
    assert w.meta["answered_questions"] == 1
    plain = mt_bench_sessions(mini_text / "mt_bench", TOK, system_prompt=None)
    assert plain.output_offsets is None and TOK.decode(plain.prompt(0)).startswith("USER: Write A.")
    odd = mt_bench_sessions(q, PlainTokenizer(), a)  # tokenizer without add_special_tokens
    assert len(odd) == 4


def test_mt_bench_errors(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["only one"]}) + "\n")
    with pytest.raises(TraceFormatError) as ei:
        mt_bench_sessions(q, TOK)
    assert (ei.value.line, ei.value.field) == (1, "turns")
    q.write_text(json.dumps({"question_id": "1", "category": "x", "turns": ["a", "b"]}) + "\n")
    with pytest.raises(TraceFormatError) as ei:
        mt_bench_sessions(q, TOK)
    assert ei.value.field == "question_id"
    q.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}) + "\n")
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"question_id": 1, "choices": []}) + "\n")
    with pytest.raises(TraceFormatError) as ei:
        mt_bench_sessions(q, TOK, a)
    assert (ei.value.path, ei.value.line, ei.value.field) == (str(a), 1, "choices")


def test_sharegpt_fixture(mini_text, tmp_path):
    w = sharegpt_first_turns(mini_text / "share.json", TOK, system_prompt=None, interval=2.0, output_length=7)
    assert [TOK.decode(w.prompt(i)) for i in range(2)] == [
        "USER: hello there" + ASSISTANT_PREFIX,
        "USER: second" + ASSISTANT_PREFIX,
    ]
    assert w.arrival.tolist() == [0.0, 2.0] and w.output_length.tolist() == [7, 7]
    assert len(sharegpt_first_turns(mini_text / "share.json", TOK, limit=1)) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "x"}]}]))
    with pytest.raises(TraceFormatError, match="item 0"):
        sharegpt_first_turns(bad, TOK)
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(TraceFormatError):
        sharegpt_first_turns(bad, TOK)


# ------------------------------------------------------------------------------------------ real data
@pytest.mark.shared
def test_rag_prompts_real(shared_file):
    folder = shared_file("text/cacheblend/inputs")
    w = rag_prompts(folder.parent, TOK)
    assert len(w) == 10 and w.request_id.tolist() == list(range(1, 11))
    sys_ids = TOK.encode(RAG_SYSTEM_PROMPT)
    for i in range(10):
        obj = json.loads((folder / f"{i + 1}.json").read_text())
        text = RAG_SYSTEM_PROMPT + "".join(obj[str(k)] for k in range(int(obj["chunk_num"]))) + obj["query"]
        assert TOK.decode(w.prompt(i)) == text
        np.testing.assert_array_equal(w.prompt(i)[: len(sys_ids)], sys_ids)
    assert w.input_length.min() > 5_000  # six long passages each


@pytest.mark.shared
def test_mt_bench_real(shared_file):
    q = shared_file("text/mt_bench/question.jsonl")
    a = shared_file("text/mt_bench/reference_answer/gpt-4.jsonl")
    w = mt_bench_sessions(q, TOK, a)
    assert len(w) == 160 and w.meta["answered_questions"] == 30
    assert len(w.category.categories) == 8
    assert np.all(np.diff(w.arrival) >= 0)
    for i in np.flatnonzero(w.turn == 2):
        p = w.parent[i]
        history = np.concatenate([w.prompt(p), w.output(p)])
        np.testing.assert_array_equal(w.prompt(i)[: len(history)], history)
    answered = w.output_offsets[1:] > w.output_offsets[:-1]
    assert answered.sum() == 60
    np.testing.assert_array_equal(w.output_length[answered], np.diff(w.output_offsets)[answered])


@pytest.mark.shared
def test_sharegpt_real(shared_file):
    path = shared_file("text/sharegpt_first_turn/ShareGPT_V3_filtered_500.json")
    w = sharegpt_first_turns(path, TOK)
    assert len(w) == 500 and w.category.tolist()[0] == "sharegpt"
    first = json.loads(path.read_text())[0]["conversations"][0]["value"]
    assert first in TOK.decode(w.prompt(0))
    sys_len = len(TOK.encode(CHAT_SYSTEM_PROMPT))
    assert all(np.array_equal(w.prompt(i)[:sys_len], w.prompt(0)[:sys_len]) for i in range(500))
