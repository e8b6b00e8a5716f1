"""Text-backed expansion of hash traces (kvlab.workload.expand_text): every block id is a fixed span of real
text cut as token ids, so the expanded workload's block-level reuse is exactly the trace's (Mooncake, Alibaba),
checked by kvlab's own replay too; same id -> same text, distinct ids -> distinct blocks; deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.replay import replay
from kvlab.workload import load_alibaba, load_mooncake
from kvlab.workload.expand_text import BlockText, block_reuse, expand_with_text, expansion_stats, trace_requests
from kvlab.workload.families import family_workload
from kvlab.workload.families.base import corpus_pool
from kvlab.workload.render import Message, render_prompt
from kvlab.workload.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def mooncake(shared_file):
    shared_file("text")
    return load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(300)


@pytest.fixture(scope="module")
def expanded(mooncake):
    return expand_with_text(mooncake, tokenizer="byte")


def test_mooncake_reuse_is_exactly_the_traces(mooncake, expanded):
    w, e = mooncake, expanded
    assert e.kind == "tokens" and np.array_equal(e.input_length, w.input_length)
    assert np.array_equal(e.arrival, w.arrival) and np.array_equal(e.output_length, w.output_length)
    assert np.array_equal(block_reuse(w), block_reuse(e, 512))
    stats = expansion_stats(w, e)
    shared = stats.index.drop("distinct_token_ids")
    assert (stats.loc[shared, "original"] == stats.loc[shared, "expanded"]).all()
    assert stats.loc["reused_blocks", "original"] > 0
    # kvlab's replay agrees: an unbounded cache hits the same blocks in both
    a = replay(w, capacity_blocks=10**6, mode="ideal")
    b = replay(e, capacity_blocks=10**6, block_size=512, mode="ideal")
    assert np.array_equal(a.requests["hit_blocks"].to_numpy(), b.requests["hit_blocks"].to_numpy())
    assert a.summary["token_hit_rate"] == b.summary["token_hit_rate"] > 0


def test_same_id_same_text_distinct_ids_distinct_blocks(mooncake, expanded):
    w, e = mooncake, expanded
    bs = 512
    blocks: dict[int, np.ndarray] = {}
    for i in range(len(w)):
        ids, toks = w.prompt(i), e.prompt(i)
        for j, h in enumerate(ids.tolist()):
            got = toks[j * bs : (j + 1) * bs]
            ref = blocks.setdefault(h, got)
            n = min(len(ref), len(got))
            assert np.array_equal(ref[:n], got[:n])  # a partial last block is a prefix of its id's block
            if len(got) > len(ref):
                blocks[h] = got
    full = {h: b.tobytes() for h, b in blocks.items() if len(b) == bs}
    assert len(set(full.values())) == len(full)
    table = BlockText(w.prompt_values, bs, corpus_pool("byte", None))
    h = int(w.prompt(0)[0])
    assert table.text(h) == bytes(table.tokens(np.array([h]))[0].tolist()).decode("utf-8", "replace")
    assert e.meta["expanded_text"]["distinct_ids"] == len(np.unique(w.prompt_values))


def test_deterministic_per_seed(mooncake, expanded):
    w = mooncake.head(40)
    again = expand_with_text(w, tokenizer="byte")
    assert np.array_equal(again.prompt_values, expand_with_text(w, tokenizer="byte").prompt_values)
    # with the pieces per block fixed, a head's expansion is the head of the whole one
    fixed = expand_with_text(mooncake, tokenizer="byte", pieces=3)
    assert np.array_equal(expand_with_text(w, tokenizer="byte", pieces=3).prompt_values, fixed.head(40).prompt_values)
    other = expand_with_text(w, tokenizer="byte", seed=1)
    assert not np.array_equal(other.prompt_values, again.prompt_values)
    assert np.array_equal(block_reuse(other, 512), block_reuse(w))


def test_segments_carry_the_text(mooncake):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    e = expand_with_text(mooncake.head(5), segments=True)  # kvlab-bpe: ids cut from the pool, not re-tokenised
    spans = e.segment_spans(0)
    assert len(spans) == len(mooncake.prompt(0)) and spans[0].end - spans[0].start == 512
    assert spans[-1].end == e.input_length[0]
    assert all(s.text and s.kind == "history" for s in spans)
    assert e.meta["tokenizer"]["tokenizer"].startswith("kvlab-bpe")


def test_alibaba_content_ids(shared_file):
    shared_file("text")
    path = shared_file("alibaba/sample_traceA_multiturn_20.jsonl")
    chained = load_alibaba(path)
    raw = load_alibaba(path, chain=False)
    e = expand_with_text(raw, tokenizer="byte")
    stats = expansion_stats(chained, e)
    shared = stats.index.drop("distinct_token_ids")
    assert (stats.loc[shared, "original"] == stats.loc[shared, "expanded"]).all()
    assert np.array_equal(block_reuse(chained), block_reuse(e, 16))
    # content id 1086 recurs after four different prefixes: the same text wherever it occurs
    pos = [(i, j) for i in range(len(raw)) for j, h in enumerate(raw.prompt(i).tolist()) if h == 1086]
    assert len(pos) >= 2
    block = BlockText(raw.prompt_values, 16, corpus_pool("byte", None)).tokens(np.array([1086]))[0]
    for i, j in pos:  # (a tail block: cut short where the prompt ends)
        got = e.prompt(i)[j * 16 : (j + 1) * 16]
        assert len(got) >= 1 and np.array_equal(got, block[: len(got)])


def test_refuses_token_workloads(expanded):
    with pytest.raises(ConfigError, match="kind='blocks'"):
        expand_with_text(expanded)


def test_trace_requests_keep_the_prefix_structure(mooncake):
    w = mooncake.head(60)
    reqs = trace_requests(w, tokenizer="byte")
    assert len(reqs) == 60 and all(len(r.messages[0].parts) == len(w.prompt(i)) for i, r in enumerate(reqs))
    assert reqs[0].messages[0].parts[0].kind == "user" and reqs[1].messages[0].parts[0].kind == "history"
    tok = load_tokenizer("byte")
    fw = family_workload(reqs, tok)
    assert list(fw.output_length) == list(w.output_length)
    # requests sharing k leading blocks share their rendered prompts at least through those blocks' text
    for i in range(1, 60):
        k = int(np.argmin(np.append(w.prompt(i)[: len(w.prompt(0))] == w.prompt(0)[: len(w.prompt(i))], False)))
        assert k >= 1  # every conversation request starts with block 0
        shared = render_prompt(tok, [Message("user", reqs[i].messages[0].parts[:k])], add_generation_prompt=False).ids
        a, b = fw.prompt(0), fw.prompt(i)
        n = min(len(a), len(b))
        common = int(np.argmin(np.append(a[:n] == b[:n], False)))
        assert common >= len(shared) - 1
