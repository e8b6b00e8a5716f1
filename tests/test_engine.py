"""The real engine on CPU with tiny random-weight models (docs/engine.md).

Tolerance: cached prefill logits and K/V must equal the uncached forward within the fp32 oracle tolerance
(``1e-4 + 1e-5 x max |reference|``); measured differences are 0 to ~1e-5. Torch runs single-threaded
here: the models are tiny, and two OpenMP threads on a shared two-core machine are slower, not faster.
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from _util import random_token_workload

from kvlab.engine import (
    AdapterSet,
    Engine,
    KVLayout,
    KVPool,
    Request,
    Tolerance,
    build_random_model,
    load_model,
)
from kvlab.engine.faults import FAULTS, FaultyEngine
from kvlab.engine.model import forward_logits, kv_from_cache
from kvlab.engine.verify import reference_prefill
from kvlab.engine.workloads import clip_prompts, prefix_variants
from kvlab.errors import CapacityError, ConfigError
from kvlab.replay.replay import replay
from kvlab.results import read_results
from kvlab.workload import ByteTokenizer, rag_prompts
from kvlab.workload.workload import from_lists

ATOL = 1e-4  # fp32 logits / K/V, absolute (the oracle adds 1e-5 x max |reference|)
REPLAY_COLUMNS = ["hit_blocks", "hit_tokens", "new_blocks", "evictions", "orphan_evictions", "admitted",
                  "cached_blocks", "orphan_blocks", "ideal_hit_tokens", "full_blocks"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_model("tiny-llama", seed=0)


def engine(model, **kw) -> Engine:
    kw.setdefault("capacity_blocks", 32)
    kw.setdefault("block_size", 8)
    return Engine(model, num_threads=1, **kw)


def faulty_engine(model, faults: dict, **kw) -> FaultyEngine:
    """:func:`engine` with ``faults`` injected (the mutation tests of the oracle)."""
    kw.setdefault("capacity_blocks", 32)
    kw.setdefault("block_size", 8)
    return FaultyEngine(model, faults=faults, num_threads=1, **kw)


def uncached(model, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits, cache = reference_prefill(model, torch.as_tensor(tokens))
    return logits, kv_from_cache(cache)


# ---------------------------------------------------------------------- layout and capacity
def test_capacity_in_bytes_converts_to_blocks(model):
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32)
    assert lay.bytes_per_token == 2 * 4 * 2 * 32 * 4
    assert lay.bytes_per_block == 2 * 4 * 2 * 32 * 8 * 4 == 16384
    eng = engine(model, capacity_blocks=None, capacity_bytes=10 * 16384 + 16383)
    assert eng.layout == lay and eng.capacity_blocks == 10 and eng.capacity_bytes == 10 * 16384
    assert eng.pool.data.shape == (10, 4, 2, 2, 8, 32) and eng.pool.data.nbytes == eng.capacity_bytes
    half = engine(model, capacity_blocks=None, capacity_bytes=10 * 16384, dtype="float16")
    assert half.layout.bytes_per_block == 8192 and half.capacity_blocks == 20
    with pytest.raises(ConfigError, match="holds no block"):
        engine(model, capacity_blocks=None, capacity_bytes=16383)
    with pytest.raises(ConfigError, match="exactly one"):
        engine(model, capacity_blocks=4, capacity_bytes=16384)
    # the llama-3-8b shape's 128 KiB per bf16 token (seed 003), without building it
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert big.bytes_per_token == 128 * 1024 and big.blocks_for_bytes(2 * 1024**3) == 1024


def test_old_capacity_keyword_still_works(model):
    """``num_blocks`` is the old name of ``capacity_blocks`` (kvlab.names.KEYWORD_ALIASES): keyword and attribute."""
    eng = Engine(model, num_blocks=5, block_size=8, num_threads=1)
    assert eng.capacity_blocks == eng.num_blocks == eng.cache.capacity_blocks == 5
    assert eng.config()["capacity_blocks"] == 5
    assert faulty_engine(model, {}, capacity_blocks=None, num_blocks=6).capacity_blocks == 6
    with pytest.raises(TypeError, match="old name"):
        Engine(model, capacity_blocks=5, num_blocks=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocks'"):
        Engine(model, capacity_blocks=5, blocks=5)


def test_pool_gather_and_write_round_trip():
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=4, dtype=torch.float32)
    pool = KVPool(lay, 6)
    kv = torch.randn(2, 2, 3, 10, 4)
    blocks = [5, 1, 3]
    pool.write(blocks, 0, kv[:, :, :, :7])
    pool.write(blocks, 7, kv[:, :, :, 7:])  # unaligned append, as decode does
    assert torch.equal(pool.gather(blocks, 10), kv)
    assert torch.equal(pool.data[1, 1, 0, 2, 3], kv[1, 0, 2, 7])  # position 7 = block 1, slot 3
    assert torch.count_nonzero(pool.data[[0, 2, 4]]) == 0
    with pytest.raises(ConfigError):
        pool.write(blocks, 10, kv[:, :, :, :3])


# ---------------------------------------------------------------------- prefill and decode vs uncached
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gpt2"])
def test_prefill_with_and_without_hits_equals_uncached_forward(shape, model):
    m = model if shape == "tiny-llama" else build_random_model(shape, seed=1)
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 1024, 40)
    eng = engine(m)
    for tail, want_hits in ((5, 0), (9, 5), (3, 5)):
        prompt = np.r_[doc, rng.integers(0, 1024, tail)]
        res = eng.prefill(Request(prompt))
        assert res.hit_blocks == want_hits and res.computed_prompt_tokens == len(prompt) - 8 * want_hits
        ref_logits, ref_kv = uncached(m, prompt)
        assert (res.logits - ref_logits).abs().max() <= ATOL
        pool_kv = eng.pool.gather([b.block_id for b in res.state.blocks], len(prompt))
        assert (pool_kv - ref_kv).abs().max() <= ATOL
        report = eng.verify(res.state)
        assert report.passed and report.greedy_agree == report.greedy_k
        eng.release(res.state)


def test_decode_matches_hf_greedy_generate(model):
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 1024, 37)
    eng = engine(model)
    eng.release(eng.prefill(Request(doc[:30])).state)
    res = eng.prefill(Request(doc))
    assert res.hit_blocks == 3
    out = eng.decode(res.state, 11)
    tokens = [res.first_token, *out.tokens]
    assert out.steps == 11 and len(tokens) == 12 and res.state.num_computed == 37 + 11
    with torch.no_grad():
        gen = model.generate(torch.as_tensor(doc).view(1, -1), max_new_tokens=12, do_sample=False)
    assert gen[0, 37:].tolist() == tokens
    # the pool holds every computed position: prompt and fed output tokens
    state = res.state
    pool_kv = eng.pool.gather([b.block_id for b in state.blocks], state.num_computed)
    assert (pool_kv - kv_from_cache(state.cache)).abs().max() == 0
    eng.release(state)
    with pytest.raises(CapacityError):
        eng.release(state)


def test_decoded_blocks_are_keyed_and_reused_by_the_next_turn(model):
    """Turn 2 = turn 1's prompt + its (teacher-forced) answer + a question: it hits the answer's blocks."""
    rng = np.random.default_rng(2)
    p1 = rng.integers(0, 1024, 21)
    answer = rng.integers(0, 1024, 14)
    p2 = np.r_[p1, answer, rng.integers(0, 1024, 6)]
    wl = from_lists([p1, p2], output_length=[len(answer), 4],
                    output_offsets=np.array([0, len(answer), len(answer)]), output_values=answer)
    res = engine(model).run(wl, output_tokens="workload", force_outputs=True, verify=True)
    f = res.requests
    # turn 1 computed 21 + 13 positions = 4 full blocks; turn 2 hits all of them
    assert f["decode_steps"].tolist() == [13, 3] and f["decode_blocks"].tolist() == [2, 0]
    assert f["hit_blocks"].tolist() == [0, 4] and f["verify_passed"].all()
    assert res.summary["generated_tokens"] == 14 + 4


def test_batch_api_one_sequence_per_step(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1024, n) for n in (12, 19, 7)]
    eng = engine(model)
    states = [r.state for r in eng.prefill_batch([Request(p) for p in prompts])]
    steps = [eng.decode_step(states) for _ in range(3)]
    alone = engine(model)
    for i, p in enumerate(prompts):
        r = alone.prefill(Request(p))
        assert [r.first_token, *alone.decode(r.state, 3).tokens] == [states[i].emitted[0]] + [s[i] for s in steps]
        alone.release(r.state)
    for s in states:
        eng.release(s)
    assert eng.cache.num_running_blocks == 0


def test_executor_primitive_chunked_prefill_and_recompute(model):
    """forward_tokens with blocks managed outside (as a scheduler's KVCacheManager would): chunks of 10,
    a decode token, and a recompute from the pool after dropping the working cache all match uncached."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1024, 29)
    eng = engine(model)
    blocks, _ = eng.cache.allocate(4)
    ids = [b.block_id for b in blocks]
    working = None
    for start in (0, 10, 20):
        logits, working = eng.forward_tokens(prompt[start:start + 10], ids, start, working=working)
    ref_logits, ref_kv = uncached(model, prompt)
    assert (logits - ref_logits).abs().max() <= ATOL
    assert (eng.pool.gather(ids, 29) - ref_kv).abs().max() <= ATOL
    nxt = int(ref_logits.argmax())
    step, _ = eng.forward_tokens([nxt], ids, 29, working=working)
    again, _ = eng.forward_tokens([nxt], ids, 29)  # working cache dropped: gathered from the pool
    assert (step - uncached(model, np.r_[prompt, nxt])[0]).abs().max() <= ATOL
    assert (again - step).abs().max() <= ATOL
    with pytest.raises(ConfigError, match="working cache holds"):
        eng.forward_tokens([1], ids, 7, working=working)
    eng.cache.release(blocks)


def test_not_admitted_changes_nothing_and_bad_requests_fail(model):
    eng = engine(model, capacity_blocks=3)
    res = eng.prefill(Request(np.arange(25)))  # 4 blocks > 3
    assert not res.admitted and res.state is None and eng.cache.num_free_blocks == 3
    assert not eng.can_admit(Request(np.arange(25))) and eng.can_admit(Request(np.arange(24)))
    with pytest.raises(ConfigError, match="token ids"):
        eng.prefill(Request(np.array([1, 5000])))
    with pytest.raises(ConfigError, match="AdapterSet"):
        eng.prefill(Request(np.arange(5), adapter="lora-a"))
    with pytest.raises(ConfigError, match="unknown fault"):
        faulty_engine(model, {"flip": True})
    full = eng.prefill(Request(np.arange(24)))
    with pytest.raises(CapacityError):
        eng.decode(full.state, 1)  # a 4th block is needed and none is free
    eng.release(full.state)
    res = eng.run(from_lists([np.arange(25), np.arange(9)]), verify=True)
    f = res.requests
    assert f["admitted"].tolist() == [False, True] and np.isnan(f["ttft_s"][0]) and f["verify_passed"][1]
    assert res.summary["rejected_requests"] == 1 and res.summary["verify_failures"] == 0


# ---------------------------------------------------------------------- hits identical to the replay
def assert_same_as_replay(model, wl, capacity: int, block_size: int) -> pd.DataFrame:
    res = engine(model, capacity_blocks=capacity, block_size=block_size).run(wl, verify=True, verify_tokens=2)
    f = res.requests
    for kind in ("python", "auto"):
        rep = replay(wl, capacity_blocks=capacity, block_size=block_size, engine=kind).requests
        pd.testing.assert_frame_equal(f[REPLAY_COLUMNS], rep[REPLAY_COLUMNS], check_dtype=False)
    assert f["evictions"].sum() > 0 and f["hit_blocks"].sum() > 0
    assert res.summary["verify_failures"] == 0 and res.summary["false_hit_blocks"] == 0
    assert res.summary["verify_max_logit_abs"] <= ATOL and res.summary["verify_max_kv_abs"] <= ATOL
    return f


def test_hits_equal_replay_on_generated_workload(model):
    wl = random_token_workload(7, n=40, vocab=3, max_len=40)
    assert_same_as_replay(model, wl, capacity=9, block_size=4)


@pytest.mark.shared
def test_hits_equal_replay_on_rag_prompts(model, shared_file):
    rag = rag_prompts(shared_file("text/cacheblend"), ByteTokenizer())
    wl = prefix_variants(clip_prompts(rag, 400), lengths=(96, 176, 256))
    f = assert_same_as_replay(model, wl, capacity=40, block_size=16)
    assert (f["prompt_tokens"] <= 256).all() and len(f) == 3 * len(rag)


def test_workload_helpers():
    wl = from_lists([np.arange(10), np.arange(3)], output_length=[4, 5])
    clipped = clip_prompts(wl, 5)
    assert clipped.input_length.tolist() == [5, 3] and clipped.prompt(0).tolist() == [0, 1, 2, 3, 4]
    var = prefix_variants(wl, [2, 8], rounds=2)
    assert var.input_length.tolist() == [2, 2, 8, 3] * 2 and var.session.tolist() == [0, 1, 0, 1] * 2


# ---------------------------------------------------------------------- mutations: verify has teeth
def mutation_workload() -> tuple:
    """r1 hits r0's 4 blocks; r2 (exactly 4 blocks) evicts 2 of them; r3 has r0's prefix again."""
    rng = np.random.default_rng(0)
    d0, d1 = rng.integers(0, 1024, 32), rng.integers(0, 1024, 32)
    prompts = [np.r_[d0, rng.integers(0, 1024, 3)], np.r_[d0, rng.integers(0, 1024, 3)], d1,
               np.r_[d0, rng.integers(0, 1024, 3)]]
    return from_lists(prompts, arrival=np.arange(4.0))


# each fault and the requests whose verify must fail (the rest must pass)
MUTATIONS = {
    "none": ({}, []),
    "position_offset+1": ({"position_offset": 1}, [1, 3]),
    "position_offset-1": ({"position_offset": -1}, [1, 3]),
    "wrong_block": ({"wrong_block": True}, [1, 3]),
    "stale_block": ({"stale_block": True}, [2, 3]),
    "reuse_evicted": ({"reuse_evicted": True}, [3]),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verify_catches_each_mutation(model, name):
    faults, failing = MUTATIONS[name]
    res = faulty_engine(model, faults, capacity_blocks=6).run(mutation_workload(), verify=True, verify_tokens=2)
    f = res.requests
    assert f["hit_blocks"].tolist() == ([0, 4, 0, 4] if name == "reuse_evicted" else [0, 4, 0, 2])
    assert f["evictions"].sum() > 0
    assert np.flatnonzero(~f["verify_passed"].to_numpy(bool)).tolist() == failing
    bad = f.iloc[failing]
    assert (np.maximum(bad["verify_logit_max_abs"], bad["verify_kv_max_abs"]) > 1.0).all()


def test_every_fault_has_a_mutation_test():
    assert {k for faults, _ in MUTATIONS.values() for k in faults} == set(FAULTS)


# ---------------------------------------------------------------------- adapters, loading, results, imports
def test_adapters_change_kv_and_are_keyed(model):
    adapters = AdapterSet(model, ("lora-a", "lora-b"), seed=0)
    try:
        rng = np.random.default_rng(4)
        doc = rng.integers(0, 1024, 40)
        with torch.no_grad():
            logits = {}
            for name in (None, "lora-a", "lora-b"):
                with adapters.use(name):
                    logits[name] = reference_prefill(model, torch.as_tensor(doc))[0]
        assert (logits["lora-a"] - logits["lora-b"]).abs().max() > 1.0
        assert (logits[None] - logits["lora-a"]).abs().max() > 1.0
        wl = from_lists([doc, np.r_[doc, 1], np.r_[doc, 2]], adapter=["lora-a", "lora-b", "lora-a"])
        res = engine(model, adapters=adapters).run(wl, verify=True, verify_tokens=2)
        assert res.requests["hit_blocks"].tolist() == [0, 0, 5] and res.summary["verify_failures"] == 0
    finally:
        adapters.remove()
    assert not any(m._forward_hooks for m in model.modules())


def test_load_model_from_a_saved_checkpoint(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(str(tmp_path / "ckpt"), device="cpu")
    ids = torch.arange(9).view(1, -1)
    pos = torch.arange(9).view(1, -1)
    with torch.no_grad():
        a = forward_logits(model, ids, pos, kv_cache())
        b = forward_logits(loaded, ids, pos, kv_cache())
    assert torch.equal(a, b) and loaded.kvlab_model_id == str(tmp_path / "ckpt")


def kv_cache():
    from transformers import DynamicCache

    return DynamicCache()


def test_random_models_are_seeded_and_informative(model):
    again = build_random_model("tiny-llama", seed=0)
    other = build_random_model("tiny-llama", seed=1)
    p0 = dict(model.named_parameters())
    assert all(torch.equal(p, p0[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    logits, _ = uncached(model, np.arange(50, 90))
    top = logits.topk(2).values
    assert 2.0 < float(logits.std()) < 8.0  # logit_std=4: peaked, not HF's flat ~0.2
    assert float(top[0] - top[1]) > 10 * Tolerance.for_dtypes(torch.float32).logit_atol


def test_run_results_save_and_read_back(model, tmp_path):
    wl = random_token_workload(3, n=12, vocab=3, max_len=30)
    res = engine(model, capacity_blocks=8, block_size=4).run(wl, output_tokens=3, verify=True, verify_tokens=2)
    out = res.save(tmp_path / "run")
    back = read_results(out)
    assert back.manifest["driver"] == "engine" and back.manifest["config"]["model_id"] == "random:tiny-llama:seed0"
    f = back.requests
    for col in ("ttft_s", "prefill_s", "computed_prompt_tokens", "prefill_tokens_per_s", "kv_bytes_in_use",
                "kv_bytes_cached", "tpot_s", "verify_passed", "verify_logit_max_abs", "false_hit_blocks"):
        assert col in f.columns
    assert (f["computed_prompt_tokens"] + f["hit_tokens"] == f["prompt_tokens"]).all()
    assert (f["ttft_s"] > 0).all() and ((f["generated_tokens"] == 3) | f["decode_truncated"]).all()
    assert (f["generated_tokens"] == 1 + f["decode_steps"]).all() and f["decode_steps"].sum() > 0
    assert back.summary["prefill_throughput"] > 0 and back.summary["capacity_bytes"] == 8 * 4 * 2048
    assert (f["kv_bytes_in_use"] % res.summary["bytes_per_block"] == 0).all()


CUDA_ONLY = ("triton", "flash_attn", "xformers", "pynvml", "cupy", "apex", "bitsandbytes", "vllm")
ALLOWED_IMPORTS = {"__future__", "collections", "contextlib", "copy", "dataclasses", "inspect", "math", "pathlib",
                   "time", "typing", "numpy", "pandas", "torch", "tqdm", "transformers", "kvlab",
                   # the tier stores (kvlab/engine/tiers): files, checksums, buffers
                   "errno", "mmap", "os", "re", "statistics", "struct", "tempfile", "weakref", "xxhash"}


def test_cpu_path_imports_nothing_cuda_only(model):
    eng = engine(model)
    eng.release(eng.prefill(Request(np.arange(20))).state)
    assert eng.device.type == "cpu" and not torch.cuda.is_initialized()
    assert not [m for m in sys.modules if m.split(".")[0] in CUDA_ONLY]
    src = Path(__file__).resolve().parents[1] / "kvlab" / "engine"
    for path in src.rglob("*.py"):  # the engine and its subpackages (kvlab/engine/tiers)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert name.split(".")[0] in ALLOWED_IMPORTS, f"{path.name} imports {name}"


def test_gpu_shape_builds_on_the_target_device_without_cpu_weights():
    big = build_random_model("llama-3-8b", device="meta")  # no memory: shapes and dtype only
    params = list(big.parameters())
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    assert 8.0e9 < sum(p.numel() for p in params) < 8.1e9


def test_summary_latency_is_the_one_definition_nan_when_nothing_admitted(model):
    """The engine's ttft_* summary is kvlab.analysis.latency_stats of its requests (as the simulator's); a run
    that admits nothing reports NaN, not 0.0."""
    from kvlab.analysis import latency_stats

    res = engine(model, capacity_blocks=8, block_size=4).run(from_lists([np.arange(9), np.arange(13)]))
    stats = latency_stats(res.requests)
    for name in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
        assert res.summary[name] == stats[name] > 0
    assert not any(k.startswith("tpot_") for k in res.summary)  # the engine reports TTFT only
    empty = engine(model, capacity_blocks=3).run(from_lists([np.arange(25)]))  # 4 blocks > 3: none admitted
    assert empty.summary["rejected_requests"] == 1
    assert all(math.isnan(empty.summary[k]) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))


def test_engine_results_written_before_the_computed_tokens_rename_read_under_todays_name(model, tmp_path):
    """The engine's computed_tokens (prompt tokens run through the model) is computed_prompt_tokens now, as the
    simulator names that count; an engine run written under the old name reads under the new one (kvlab.names),
    a simulator's computed_tokens (every executed token) stays as it is."""
    from dataclasses import replace

    from kvlab.names import canonical_columns

    res = engine(model, capacity_blocks=8, block_size=4).run(from_lists([np.arange(9), np.arange(13)]))
    assert "computed_tokens" not in res.requests and "computed_tokens" not in res.summary
    old_frame = res.requests.rename(columns={"computed_prompt_tokens": "computed_tokens"})
    old_summary = {("computed_tokens" if k == "computed_prompt_tokens" else k): v for k, v in res.summary.items()}
    back = read_results(replace(res, requests=old_frame, summary=old_summary).save(tmp_path / "old"))
    assert back.summary["computed_prompt_tokens"] == res.summary["computed_prompt_tokens"] == 9 + (13 - 8)  # 2 hits
    assert back.requests["computed_prompt_tokens"].tolist() == res.requests["computed_prompt_tokens"].tolist()
    assert "computed_tokens" not in back.requests
    sim_like = pd.DataFrame({"computed_tokens": [3]})
    assert list(canonical_columns(sim_like, "simulator").columns) == ["computed_tokens"]
    assert engine(model).prefill(Request(np.arange(9))).computed_tokens == 9  # the old attribute name reads
