"""Tokenizers for text workloads: kvlab's BPE (the committed file; retraining on the shared text reproduces it,
byte for byte, in a fresh process), Hugging Face tokenizers from a local folder (offline) with a
date-injecting chat template, the byte tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from kvlab.errors import ConfigError  # noqa: E402
from kvlab.workload import load_jsonl, save_jsonl  # noqa: E402
from kvlab.workload import tokenizer as tk  # noqa: E402
from kvlab.workload import tokenizer_files as tfiles  # noqa: E402
from kvlab.workload.render import Message, Part, render_prompt, rendered_workload  # noqa: E402
from kvlab.workload.segments import first_miss_segment, hit_tokens_by_segment  # noqa: E402
from kvlab.workload.sources import musique_records  # noqa: E402
from kvlab.workload.tokenizer import (  # noqa: E402
    BPE_VOCAB_SIZE,
    CHATML_TEMPLATE,
    DEFAULT_DATE_STRING,
    ByteTextTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from kvlab.workload.tokenizer_store import DATA_DIR, KVLAB_BPE_SHA256, train_named  # noqa: E402

LLAMA31_LIKE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""The shape of Llama-3.1/3.2's template: today's date in the system turn unless ``date_string`` is given,
contents trimmed."""


@pytest.fixture(scope="session")
def text_dir(shared_file):
    return shared_file("text")


@pytest.fixture(scope="session")
def bpe() -> HFTokenizer:
    """kvlab's default tokenizer: the committed file."""
    return load_tokenizer()


@pytest.fixture(scope="session")
def llama_like(bpe, tmp_path_factory) -> HFTokenizer:
    """A Hugging Face tokenizer folder (the BPE plus Llama-3 special tokens and a Llama-3.1-style template),
    loaded back through AutoTokenizer offline like any downloaded model's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=bpe.hf.backend_tokenizer, bos_token="<|begin_of_text|>",
                                 eos_token="<|eot_id|>")
    hf.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    hf.chat_template = LLAMA31_LIKE_TEMPLATE
    folder = tmp_path_factory.mktemp("llama-like")
    hf.save_pretrained(folder)
    return load_tokenizer(folder)


# ------------------------------------------------------------------------------------------ kvlab BPE
def test_bpe_is_the_default_and_the_committed_file(bpe, tmp_path, monkeypatch):
    assert bpe.name == f"kvlab-bpe-{BPE_VOCAB_SIZE}" and bpe.vocab_size == BPE_VOCAB_SIZE
    assert bpe.sha256 == KVLAB_BPE_SHA256  # the identity hashes the vocabulary JSON: the committed file's sha256

    def no_training(*a, **k):
        raise AssertionError("trained instead of loading the committed file")

    monkeypatch.setattr(tfiles, "train_bpe", no_training)
    again = load_tokenizer("kvlab-bpe", cache_dir=tmp_path)
    assert again.sha256 == bpe.sha256 and again.template_sha256 == bpe.template_sha256
    assert list(tmp_path.iterdir()) == []  # nothing written to the tokenizer folder
    assert bpe.chat_template == CHATML_TEMPLATE and not bpe.injects_date


def test_bpe_training_reproduces_the_committed_file_in_a_fresh_process(bpe, text_dir, tmp_path):
    """``kvlab tokenizer train`` in a fresh process (its own hash seeds and thread pool) on the shared text
    writes kvlab-bpe's vocabulary byte for byte, with the committed provenance's file list."""
    env = {**os.environ, "KVLAB_TOKENIZER_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvlab.cli", "tokenizer", "train", "--name", "again", "--text-dir", str(text_dir)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300, env=env)
    assert (tmp_path / "again.json").read_bytes() == (DATA_DIR / "kvlab-bpe.json").read_bytes()
    mine = json.loads((tmp_path / "again.provenance.json").read_text())
    committed = json.loads((DATA_DIR / "kvlab-bpe.provenance.json").read_text())
    assert {k: v for k, v in mine.items() if k not in ("name", "file")} == \
        {k: v for k, v in committed.items() if k not in ("name", "file")}
    assert load_tokenizer("again", cache_dir=tmp_path).sha256 == bpe.sha256


def test_training_key_covers_text_and_settings():
    key = tfiles.training_key(["a b", "c"], 100, 2)
    assert key == tfiles.training_key(["a b", "c"], 100, 2)
    assert len({key, tfiles.training_key(["a b", "c "], 100, 2), tfiles.training_key(["a", "b", "c"], 100, 2),
                tfiles.training_key(["a b", "c"], 200, 2), tfiles.training_key(["a b", "c"], 100, 3)}) == 5


def test_bpe_encodes_real_text(bpe, text_dir):
    text = (text_dir / "mt_bench" / "question.jsonl").read_text().splitlines()[0]
    ids, offsets = bpe.encode_offsets(text)
    assert bpe.decode(ids) == text and ids == bpe.encode(text)
    assert len(ids) < len(text.encode()) / 3  # a real vocabulary: several bytes per token
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(a <= b for a, b in offsets) and all(offsets[k][1] <= offsets[k + 1][0] for k in range(len(ids) - 1))


def test_chatml_rendering(bpe):
    text = bpe.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = bpe.encode(text, add_special_tokens=False)
    assert ids.count(bpe.hf.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens are single tokens


# ------------------------------------------------------------------------------------------ Hugging Face
def test_hf_folder_offline_with_date_injecting_template(llama_like, bpe):
    assert llama_like.injects_date and llama_like.template_sha256 != bpe.template_sha256
    assert llama_like.sha256 != bpe.sha256  # added special tokens change the definition
    msgs = [{"role": "system", "content": "You answer questions."}, {"role": "user", "content": "Why?"}]
    fixed = llama_like.apply_chat_template(msgs)
    assert f"Today Date: {DEFAULT_DATE_STRING}\n" in fixed and fixed.startswith("<|begin_of_text|>")
    assert fixed == llama_like.apply_chat_template(msgs)  # not today's date: the same every day
    other = llama_like.apply_chat_template(msgs, date_string="02 Dec 2026")
    assert "Today Date: 02 Dec 2026\n" in other and other != fixed
    ids = llama_like.encode(fixed, add_special_tokens=False)
    assert ids[0] == llama_like.hf.convert_tokens_to_ids("<|begin_of_text|>")


def test_unknown_hf_name_is_one_config_error_line():
    with pytest.raises(ConfigError, match="a local folder, nor in the Hugging Face cache") as e:
        load_tokenizer("kvlab-test/no-such-tokenizer")
    assert "\n" not in str(e.value)


def test_training_without_the_text_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="the text folder is missing"):
        train_named("mine", text_dir=tmp_path / "nowhere", folder=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ bytes
def test_byte_tokenizer_offsets_are_characters():
    t = load_tokenizer("byte")
    assert isinstance(t, ByteTextTokenizer)
    ids, offsets = t.encode_offsets("aé€")
    assert ids == list("aé€".encode()) and offsets == [(0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (2, 3)]
    assert t.chat_template is None and not t.injects_date and not t.special_tokens_in_template
    assert t.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]) == (
        "S\nUSER: Q\nASSISTANT:"
    )
    ident = t.identity()
    assert set(ident) == {"tokenizer", "tokenizer_sha256", "template_sha256", "vocab_size"}
    assert ident["tokenizer_sha256"] != ByteTextTokenizer(offset=3).sha256


# ------------------------------------------------------------------------------------------ rendering
def _rag_messages(record) -> list[Message]:
    docs = tuple(Part("document", f"{d.title}\n{d.text.strip()}\n\n") for d in record.documents[:4])
    return [
        Message("system", (Part("system", "Answer the question from the passages.\n"),
                           Part("volatile", "Request 7f3a at 2026-12-02 03:30:00\n"))),
        Message("user", (*docs, Part("user", record.user_turns[0]))),
    ]


@pytest.fixture(scope="session")
def musique(text_dir):
    return musique_records(text_dir / "cacheblend" / "musique_s.json", limit=5)


@pytest.mark.parametrize("cover", [True, False])
def test_render_real_rag_prompt_with_bpe(bpe, musique, cover):
    for record in musique:
        msgs = _rag_messages(record)
        r = render_prompt(bpe, msgs, cover=cover)
        assert r.ids == bpe.encode(r.text, add_special_tokens=False)  # the whole prompt, tokenised once
        assert [s.kind for s in r.segments] == ["system", "volatile"] + ["document"] * 4 + ["user"]
        assert all(a.end <= b.start for a, b in zip(r.segments, r.segments[1:], strict=False))
        if cover:  # spans tile the prompt: template tokens go to the part after them
            assert r.segments[0].start == 0 and r.segments[-1].end == len(r.ids)
            assert all(a.end == b.start for a, b in zip(r.segments, r.segments[1:], strict=False))
        for s in r.segments:
            decoded = bpe.decode(r.ids[s.start : s.end])
            assert (s.text in decoded) if cover else (decoded == s.text)
        assert r.dropped == []


def test_render_attributes_a_straddling_token_to_the_part_it_starts_in(bpe):
    msgs = [Message("user", (Part("user", "Hello wor"), Part("volatile", "ld peace")))]
    r = render_prompt(bpe, msgs, cover=False)
    a, b = r.segments
    assert bpe.decode(r.ids[a.start : a.end]) == "Hello world" and bpe.decode(r.ids[b.start : b.end]) == " peace"
    pieces = bpe.encode("Hello wor", add_special_tokens=False) + bpe.encode("ld peace", add_special_tokens=False)
    assert pieces != r.ids[a.start : b.end]  # BPE is not compositional: ids of pieces are not the prompt's


def test_date_injection_moves_the_first_miss_into_the_system_segment(llama_like):
    msgs = [Message("system", (Part("system", "You answer questions about the documents.  \n"),)),
            Message("user", (Part("document", "Hannibal crossed the Alps in 218 BC.\n"), Part("user", "When?")))]
    day1 = render_prompt(llama_like, msgs)
    day2 = render_prompt(llama_like, msgs, date_string="02 Dec 2026")
    assert day1.text != day2.text and [s.kind for s in day1.segments] == ["system", "document", "user"]
    assert day1.segments[0].start == 0 and day1.segments[-1].end == len(day1.ids)
    common = next(k for k, (x, y) in enumerate(zip(day1.ids, day2.ids, strict=False)) if x != y)
    assert first_miss_segment(day1.segments, common) == "system"
    assert hit_tokens_by_segment(day1.segments, common) == {"system": common, "document": 0, "user": 0}
    # the template trims the system text; its span is still found
    a, b = day1.char_spans[0]
    assert day1.text[a:b] == "You answer questions about the documents."
    same = render_prompt(llama_like, msgs)
    assert same.ids == day1.ids  # a fixed date: the same prompt every day


class _StripReasoning(ByteTextTokenizer):
    """A template that drops reasoning from earlier assistant turns (as Qwen3's does)."""

    def apply_chat_template(self, messages, **kw):
        msgs = [{**m, "content": re.sub(r"<think>.*?</think>", "", m["content"], flags=re.S)} for m in messages]
        return super().apply_chat_template(msgs, **kw)


def test_parts_the_template_drops_get_empty_spans():
    msgs = [Message.of("user", "user", "Sum 2+2."),
            Message("assistant", (Part("output", "<think>2 and 2 make 4</think>"), Part("output", "4"))),
            Message.of("user", "user", "Times 3?")]
    r = render_prompt(_StripReasoning(), msgs)
    assert r.dropped == [1]
    think = r.segments[1]
    assert think.start == think.end and think.text == "<think>2 and 2 make 4</think>"
    assert r.segments[0].start == 0 and r.segments[-1].end == len(r.ids)
    assert "think" not in r.text


def test_unknown_kind_and_no_messages():
    t = ByteTextTokenizer()
    with pytest.raises(ConfigError, match="message 0 \\(user\\): 'query' is not a segment kind"):
        render_prompt(t, [Message.of("user", "query", "x")])
    with pytest.raises(ConfigError, match="no messages"):
        render_prompt(t, [])


def test_rendered_workload_round_trips_with_its_tokenizer_identity(bpe, musique, tmp_path):
    prompts = [render_prompt(bpe, _rag_messages(r)) for r in musique]
    w = rendered_workload(prompts, bpe, output_length=16, name="rag5")
    assert w.meta["tokenizer"] == bpe.identity() and w.identity()["tokenizer"] == bpe.identity()
    for i, p in enumerate(prompts):
        assert w.prompt(i).tolist() == p.ids and w.segment_spans(i) == p.segments
    back = load_jsonl(save_jsonl(w, tmp_path / "rag5.jsonl"))
    assert back.content_sha256 == w.content_sha256 and back.meta["tokenizer"]["tokenizer_sha256"] == bpe.sha256
    assert [back.segment_spans(i) for i in range(len(w))] == [p.segments for p in prompts]


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_TOKENIZER_CACHE", raising=False)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "kv"))
    assert tk.tokenizer_cache_dir() == tmp_path / "kv" / "tokenizers"
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(tmp_path / "tok"))
    assert tk.tokenizer_cache_dir() == tmp_path / "tok"
    assert tk.tokenizer_cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("KVLAB_TOKENIZER_CACHE")
    monkeypatch.delenv("KVLAB_CACHE")
    assert tk.tokenizer_cache_dir().parts[-3:] == (".cache", "kvlab", "tokenizers")
