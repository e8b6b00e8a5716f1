"""Workload families (kvlab.workload.families): determinism per seed, each family's structure (system prompts
shared per tenant with Zipf popularity, RAG passages in retrieval order with Zipf popularity, chat history that
grows and reuses, agent reasoning stripped so the prefix breaks at the answer), presets, mixes, distributions,
and rendering into a segmented Workload with a BPE tokenizer."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.workload import load_alibaba, load_jsonl, load_mooncake, save_jsonl
from kvlab.workload.families import (
    FAMILIES,
    PRESETS,
    AgentConfig,
    ArrivalProcess,
    ChatConfig,
    GeneratedRequest,
    LengthDist,
    MixConfig,
    RAGConfig,
    SystemPromptConfig,
    family_config,
    family_workload,
    generate,
    is_reasoning,
)
from kvlab.workload.families.base import FITTED_OUTPUT_LENGTHS, corpus_pool, fit_lengths, length_tokenizer
from kvlab.workload.families.chat import vllm_multi_turn
from kvlab.workload.families.rag import document_text, musique_passages


@pytest.fixture(scope="module")
def text_dir(shared_file) -> str:
    return str(shared_file("text"))


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    return length_tokenizer("kvlab-bpe")


def _small(text_dir: str, seed: int = 0) -> list:
    """One small config per family, lengths measured in bytes (fast)."""
    kw = {"seed": seed, "tokenizer": "byte", "text_dir": text_dir}
    return [
        SystemPromptConfig(n_requests=40, n_tenants=4, system_tokens=[200, 400], **kw),
        RAGConfig(n_requests=40, k=3, **kw),
        ChatConfig(n_sessions=6, **kw),
        AgentConfig(n_sessions=3, **kw),
        MixConfig(components=[{"config": RAGConfig(n_requests=20, **kw), "weight": 1},
                              {"config": ChatConfig(n_sessions=5, **kw), "weight": 1}], n_requests=20),
    ]


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


# ------------------------------------------------------------------------------------------ every family
def test_determinism_per_seed(text_dir):
    for a, b, c in zip(_small(text_dir, 0), _small(text_dir, 0), _small(text_dir, 1), strict=True):
        ra, rb, rc = generate(a), generate(b), generate(c)
        assert ra == rb, a.family
        assert ra != rc, a.family
        assert all(isinstance(r, GeneratedRequest) for r in ra)
        arr = [r.arrival for r in ra]
        assert arr == sorted(arr)
        assert {r.answer_source for r in ra} <= {"reference", "corpus", "none"}


def test_registry_and_config_errors(text_dir):
    assert set(FAMILIES) == {"system_prompt", "rag", "chat", "agent", "mix"}
    cfg = family_config("rag", k=2, text_dir=text_dir)
    assert isinstance(cfg, RAGConfig) and cfg.k == 2
    with pytest.raises(ConfigError, match="unknown workload family"):
        family_config("nope")
    with pytest.raises(ConfigError, match="RAGConfig.k"):
        RAGConfig(k=0)
    with pytest.raises(ConfigError):
        ChatConfig(n_sessions=1, bogus=3)


# ------------------------------------------------------------------------------------------ system prompts
def test_system_prompts_per_tenant_zipf(text_dir):
    cfg = SystemPromptConfig(n_requests=400, n_tenants=5, prompts_per_tenant=2, system_tokens=[100, 300],
                             tenant_zipf=1.2, tokenizer="byte", text_dir=text_dir, seed=4)
    reqs = generate(cfg)
    counts = Counter(r.tenant for r in reqs)
    assert counts[0] > counts[1] > counts[4] > 0  # Zipf: tenant 0 busiest
    pool = corpus_pool("byte", text_dir)
    texts: dict = {}
    for r in reqs:
        sys_text = r.messages[0].parts[0].text
        assert r.messages[0].parts[0].kind == "system" and r.messages[1].parts[0].kind == "user"
        assert texts.setdefault(r.meta["system_prompt"], sys_text) == sys_text  # one text per (tenant, prompt)
    for (t, p), text in texts.items():
        want = cfg.system_tokens[(t * 2 + p) % 2]
        assert abs(pool.count(text) - want) <= 4  # byte spans: exact up to a split UTF-8 character
    assert len(set(texts.values())) == len(texts)


# ------------------------------------------------------------------------------------------ RAG
def test_rag_document_popularity_and_retrieval_order(text_dir):
    cfg = RAGConfig(n_requests=600, k=4, doc_zipf=1.1, tokenizer="byte", text_dir=text_dir, seed=2)
    reqs = generate(cfg)
    docs, _ = musique_passages(text_dir)
    freq = Counter(d for r in reqs for d in r.meta["documents"])
    for r in reqs:
        ids = r.meta["documents"]
        assert len(ids) == 4 and len(set(ids)) == 4
        parts = r.messages[1].parts
        assert [p.kind for p in parts] == ["document"] * 4 + ["user"]
        assert [p.text for p in parts[:4]] == [document_text(*docs[d]) for d in ids]
    top = [c for _, c in freq.most_common()]
    assert top[0] > 0.3 * len(reqs)  # Zipf(1.1) over ~1,400 passages: the hottest is in many requests
    assert len(freq) < 0.6 * len(docs)
    # retrieval order = draw order: earlier positions hold more popular passages on average
    mean_freq = [np.mean([freq[r.meta["documents"][j]] for r in reqs]) for j in range(4)]
    assert mean_freq[0] > mean_freq[1] > mean_freq[3]


def test_rag_query_popularity_keeps_musique_order(text_dir):
    reqs = generate(RAGConfig(n_requests=200, k=6, popularity="query", tokenizer="byte", text_dir=text_dir))
    _, per_record = musique_passages(text_dir)
    for r in reqs:
        assert r.meta["documents"] == per_record[r.meta["record"]][:6]
    assert Counter(r.meta["record"] for r in reqs).most_common(1)[0][1] > 20


# ------------------------------------------------------------------------------------------ chat
def test_chat_history_grows_and_reuses(text_dir, bpe):
    cfg = ChatConfig(n_sessions=8, turns=LengthDist(kind="uniform", min=3, max=4), system_tokens=64,
                     text_dir=text_dir, seed=5)
    reqs = generate(cfg)
    by_session: dict = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    sources = Counter(r.answer_source for r in reqs)
    assert sources["reference"] > 0 and sources["corpus"] > 0 and sources["none"] == 0
    w = family_workload(reqs, bpe)
    row = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(w.session, w.turn, strict=True))}
    for s, turns in by_session.items():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.arrival >= a.arrival + cfg.decode_s_per_token * a.output_tokens
            assert len(b.messages) == len(a.messages) + 2
            assert b.messages[-2].parts == a.response  # the answer goes into the history
            ia, ib = row[(s, a.turn)], row[(s, b.turn)]
            assert w.parent[ib] == ia
            pa, pb = w.prompt(ia), w.prompt(ib)
            assert np.array_equal(pb[: len(pa)], pa)  # the whole earlier prompt is reused
            kinds = [seg.kind for seg in w.segment_spans(ib)]
            assert kinds[0] == "system" and "history" in kinds and "output" in kinds and kinds[-1] == "user"
        for r in turns:
            if r.answer_source == "reference":
                assert r.turn <= 2 and r.meta["record"] is not None


def test_chat_from_a_local_conversation_file(text_dir, tmp_path):
    rows = [{"id": "c0", "conversations": [
        {"from": "human", "value": "What is a prefix cache?"}, {"from": "gpt", "value": "It keeps KV blocks."},
        {"from": "human", "value": "And eviction?"}, {"from": "gpt", "value": "LRU drops the oldest block."}]}]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(rows))
    cfg = ChatConfig(n_sessions=2, questions="records", records_path=str(path), turns=LengthDist(value=3, min=1),
                     tokenizer="byte", text_dir=text_dir)
    reqs = generate(cfg)
    first = [r for r in reqs if r.session == 0]
    assert [r.messages[-1].parts[-1].text for r in first[:2]] == ["What is a prefix cache?", "And eviction?"]
    assert [r.answer_source for r in first] == ["reference", "reference", "corpus"]
    assert first[1].response[0].text == "LRU drops the oldest block." and first[1].output_tokens == 27
    with pytest.raises(ConfigError, match="records_path"):
        generate(ChatConfig(questions="records", text_dir=text_dir))


def test_chat_arrival_processes(text_dir):
    kw = {"tokenizer": "byte", "text_dir": text_dir, "turns": LengthDist(kind="constant", value=1, min=1)}
    rng = np.random.Generator(np.random.PCG64(0))
    gaps = np.diff(ArrivalProcess(process="gamma", rate=2.0, cv=3.0).times(rng, 20000))
    assert gaps.mean() == pytest.approx(0.5, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)
    day = ArrivalProcess(process="diurnal", rate=1.0, period_s=1000.0, amplitude=0.9).times(rng, 4000)
    phase = (day % 1000.0) / 1000.0
    assert (phase < 0.5).mean() > 0.7  # the sine's high half
    starts = [r.arrival for r in generate(ChatConfig(n_sessions=50, arrival=ArrivalProcess(process="burst"), **kw))]
    assert starts == [0.0] * 50


def test_fitted_output_lengths():
    rng = np.random.Generator(np.random.PCG64(0))
    x = LengthDist(kind="fitted", fit="mooncake_conversation", min=1).sample(rng, 50000)
    assert np.median(x) == pytest.approx(350, abs=10) and x.mean() == pytest.approx(342.6, rel=0.05)
    assert x.min() >= 1 and x.max() <= 2000
    v = LengthDist(kind="lognormal", average=1000, median_ratio=0.85, max=5000).sample(rng, 50000)
    assert np.median(v) == pytest.approx(850, rel=0.05) and v.max() <= 5000


@pytest.mark.parametrize("fit, rel", [("mooncake_conversation", "mooncake/conversation_trace.jsonl"),
                                      ("mooncake_synthetic", "mooncake/synthetic_trace.jsonl"),
                                      ("alibaba_traceA_sample", "alibaba/sample_traceA_multiturn_20.jsonl")])
def test_cached_fits_match_the_traces(shared_file, fit, rel):
    path = shared_file(rel)
    w = load_mooncake(path) if fit.startswith("mooncake") else load_alibaba(path)
    got, cached = fit_lengths(w.output_length, "x"), FITTED_OUTPUT_LENGTHS[fit]
    assert got["levels"] == cached["levels"]
    assert np.allclose(got["quantiles"], cached["quantiles"], atol=0.051)
    assert got["mean"] == pytest.approx(cached["mean"], abs=0.01)
    assert np.allclose(got["lognormal"], cached["lognormal"], atol=1e-4)


# ------------------------------------------------------------------------------------------ presets
def test_presets_build(text_dir):
    for name, make in PRESETS.items():
        cfg = make(text_dir=text_dir, tokenizer="byte")
        assert cfg.family in FAMILIES, name
    hic = generate(PRESETS["sglang_multiturn_hicache"](n_sessions=3, text_dir=text_dir, tokenizer="byte"))
    assert len(hic) == 30 and all(r.output_tokens == 1 for r in hic)
    assert [r.turn for r in hic] == sorted(r.turn for r in hic)  # round barrier: every turn k before k + 1
    pool = corpus_pool("byte", text_dir)
    assert all(abs(pool.count(r.messages[-1].parts[-1].text) - 2048) <= 4 for r in hic)
    v = generate(vllm_multi_turn(text_dir=text_dir, tokenizer="byte"))
    turns = Counter(r.session for r in v)
    assert len(turns) == 24 and set(turns.values()) <= set(range(6, 10))
    assert len({r.messages[0].parts[0].text for r in v}) == 1  # the 500-token common prefix
    assert all(80 <= r.output_tokens <= 120 for r in v)


# ------------------------------------------------------------------------------------------ agents
@pytest.mark.parametrize("mode", ["strip", "keep", "qwen3"])
def test_agent_reasoning_breaks_prefix_at_the_answer(text_dir, bpe, mode):
    cfg = AgentConfig(n_sessions=3, reasoning=mode, tasks=LengthDist(kind="constant", value=2, min=1),
                      steps=LengthDist(kind="constant", value=2, min=1), n_tools=6, text_dir=text_dir, seed=1)
    reqs = generate(cfg)
    w = family_workload(reqs, bpe)
    assert all(r.response and is_reasoning(r.response[0]) and not is_reasoning(r.response[1]) for r in reqs)
    out = {i: w.output(i) for i in range(len(w))}
    row = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(w.session, w.turn, strict=True))}
    spans = w.segment_spans(0)
    assert [s.kind for s in spans].count("tools") == 6
    assert all(json.loads(s.text)["type"] == "function" for s in spans if s.kind == "tools")
    checked = 0
    for r in reqs:
        j = row.get((r.session, r.turn + 1))
        if j is None or r.meta["step"] == 2:  # the last step answers; the next request starts a new task
            continue
        i = row[(r.session, r.turn)]
        produced = np.concatenate([w.prompt(i), out[i]])  # what the model's KV covers after this call
        common = _common_prefix(produced, w.prompt(j))
        reasoning_tokens = len(bpe.encode(r.response[0].text, add_special_tokens=False))
        if mode == "keep" or mode == "qwen3":  # same task: qwen3 keeps this loop's reasoning
            assert common >= len(produced) - 1
        else:
            # the break is right after the prompt: reasoning and call both open with '<', nothing more matches
            assert len(w.prompt(i)) <= common <= len(w.prompt(i)) + 1 < len(produced) - reasoning_tokens
        checked += 1
    assert checked >= 6
    # qwen3: reasoning of an earlier task is gone from a later task's prompt
    last = max(reqs, key=lambda r: (r.meta["task"], r.turn))
    kept = [p for m in last.messages for p in m.parts if is_reasoning(p)]
    assert len(kept) == {"strip": 0, "keep": 5, "qwen3": 2}[mode]


# ------------------------------------------------------------------------------------------ mixes and workloads
def test_mix_interleaves_by_arrival(text_dir):
    kw = {"tokenizer": "byte", "text_dir": text_dir}
    cfg = MixConfig(components=[
        {"config": {"family": "system_prompt", "n_requests": 100, "n_tenants": 3, **kw}, "weight": 3},
        {"config": {"family": "chat", "n_sessions": 30, **kw}, "weight": 1},
    ], n_requests=40)
    reqs = generate(cfg)
    assert Counter(r.category for r in reqs) == {"system_prompt": 30, "chat": 10}
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    sp = {r.session for r in reqs if r.category == "system_prompt"}
    ch = {r.session for r in reqs if r.category == "chat"}
    assert not sp & ch and min(ch) > max(sp)
    assert {r.tenant for r in reqs if r.category == "chat"} == {3}
    assert generate(MixConfig(**cfg.to_dict())) == reqs


def test_family_workload_columns(text_dir, bpe, tmp_path):
    reqs = generate(RAGConfig(n_requests=12, k=3, text_dir=text_dir))
    w = family_workload(reqs, bpe, name="rag")
    assert len(w) == 12 and w.kind == "tokens" and w.output_offsets is None
    assert list(w.output_length) == [r.output_tokens for r in reqs]
    assert list(w.category) == ["rag"] * 12 and list(w.parent) == [-1] * 12
    assert w.meta["answer_source"] == {"reference": 0, "corpus": 0, "none": 12}
    assert w.meta["tokenizer"]["tokenizer"].startswith("kvlab-bpe")
    kinds = [s.kind for s in w.segment_spans(0)]
    assert kinds == ["system", "document", "document", "document", "user"]
    back = load_jsonl(save_jsonl(w, tmp_path / "rag.jsonl"))  # segments and labels survive the native format
    assert back.content_sha256 == w.content_sha256
