"""Rank-file vocabularies (tiktoken files, Mistral's Tekken JSON) converted to byte-level BPE tokenizers: the
conversion encodes exactly like rank-based BPE, on a vocabulary trained tiktoken-style on real text."""

from __future__ import annotations

import base64
import json
from collections import Counter

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
regex = pytest.importorskip("regex")

from kvlab.errors import ConfigError  # noqa: E402
from kvlab.workload import rank_tokenizer as rt  # noqa: E402
from kvlab.workload.rank_tokenizer import CL100K_PATTERN, bpe_parts, read_tekken, read_tiktoken  # noqa: E402
from kvlab.workload.render import Message, render_prompt  # noqa: E402
from kvlab.workload.sources import mt_bench_records, sharegpt_records  # noqa: E402
from kvlab.workload.tokenizer import load_tokenizer  # noqa: E402


def train_ranks(texts: list[str], merges: int) -> dict[bytes, int]:
    """Rank-based BPE training (as tiktoken's educational trainer): repeatedly merge the most frequent pair."""
    words = Counter(w.encode() for t in texts for w in regex.findall(CL100K_PATTERN, t))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:], strict=False):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w, s in seqs.items():
            k, out = 0, []
            while k < len(s):
                if k + 1 < len(s) and s[k] == a and s[k + 1] == b:
                    out.append(a + b)
                    k += 2
                else:
                    out.append(s[k])
                    k += 1
            seqs[w] = out
    return ranks


def reference_encode(ranks: dict[bytes, int], text: str, pattern: str = CL100K_PATTERN) -> list[int]:
    """Rank-based BPE encoding (tiktoken's algorithm) in plain Python."""
    ids = []
    for piece in regex.findall(pattern, text):
        b = piece.encode()
        ids += [ranks[b]] if b in ranks else [ranks[p] for p in bpe_parts(ranks, b)]
    return ids


@pytest.fixture(scope="module")
def ranks(shared_file) -> dict[bytes, int]:
    shared_file("text/mt_bench/question.jsonl")
    texts = [t.content for r in mt_bench_records() for t in r.turns]
    return train_ranks(texts, 400)


@pytest.fixture(scope="module")
def held_out(shared_file) -> list[str]:
    shared_file("text/sharegpt_first_turn/ShareGPT_V3_filtered_500.json")
    return [r.turns[0].content for r in sharegpt_records(limit=40)] + ["Ünïcødé 漢字 🙂\r\n\ttabs  end "]


def _write_tiktoken(path, ranks):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def test_tiktoken_file_encodes_like_rank_bpe(ranks, held_out, tmp_path):
    path = _write_tiktoken(tmp_path / "toy.tiktoken", ranks)
    assert read_tiktoken(path) == ranks
    tok = load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert tok.name == "ranks:toy.tiktoken" and tok.vocab_size == len(ranks) and tok.chat_template is None
    for text in held_out:
        ids, offsets = tok.encode_offsets(text)
        assert ids == reference_encode(ranks, text)
        assert tok.decode(ids) == text and offsets[-1][1] == len(text)
    r = render_prompt(tok, [Message.of("system", "system", held_out[0]), Message.of("user", "user", held_out[1])])
    assert r.ids == reference_encode(ranks, r.text)


def test_conversion_is_cached(ranks, tmp_path, monkeypatch):
    path = _write_tiktoken(tmp_path / "toy.tiktoken", ranks)
    first = load_tokenizer(f"ranks:{path}", cache_dir=tmp_path / "cache")
    monkeypatch.setattr(rt, "tokenizer_from_ranks", lambda *a, **k: pytest.fail("converted again"))
    again = load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert again.sha256 == first.sha256 and len(list((tmp_path / "cache").iterdir())) == 1


def test_tekken_json_reserves_special_ids(ranks, held_out, tmp_path):
    vocab = [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
             for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    obj = {"config": {"pattern": CL100K_PATTERN, "default_vocab_size": len(ranks) + 3,
                      "default_num_special_tokens": 3, "version": "v7"},
           "vocab": vocab, "special_tokens": [{"rank": 0, "token_str": "<unk>"}, {"rank": 1, "token_str": "[INST]"}]}
    path = tmp_path / "tekken_toy.json"
    path.write_text(json.dumps(obj))
    shifted, pattern, specials = read_tekken(path)
    assert specials == {"<unk>": 0, "[INST]": 1, "<SPECIAL_2>": 2} and pattern == CL100K_PATTERN
    tok = load_tokenizer(path, cache_dir=tmp_path / "cache")
    text = held_out[2]
    assert tok.encode(text) == [i + 3 for i in reference_encode(ranks, text)]
    assert tok.encode("[INST]" + text) == [1] + [i + 3 for i in reference_encode(ranks, text)]


def test_bad_rank_files(tmp_path):
    path = tmp_path / "bad.tiktoken"
    path.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ConfigError, match="bad.tiktoken:2: not a tiktoken rank line"):
        read_tiktoken(path)
    path = tmp_path / "tekken_bad.json"
    path.write_text(json.dumps({"vocab": []}))
    with pytest.raises(ConfigError, match="not a Tekken tokenizer file"):
        load_tokenizer(path, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot be built from two lower-ranked tokens"):
        rt.tokenizer_from_ranks({b"a": 0, b"b": 1, b"abc": 2}, CL100K_PATTERN)


def test_bpe_parts():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert bpe_parts(ranks, b"abc") == [b"abc"]
    assert bpe_parts(ranks, b"abc", max_rank=5) == [b"ab", b"c"]
    assert bpe_parts(ranks, b"cab") == [b"c", b"ab"]
