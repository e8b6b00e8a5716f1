"""Continuous batching on the real engine (issue 13): the engine executor runs each scheduler step as one packed
forward over the paged pool (``batched=True``) and serves exactly what the one-forward-per-entry executor
serves: the same scheduling and cache decisions, the same greedy tokens (fp32, tiny random-weight model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab.engine import Engine, build_random_model
from kvlab.sim.engine_executor import run_engine_serving
from kvlab.sim.fidelity import zero_arrivals
from kvlab.workload import from_lists, synthetic_chat

VOCAB = 1024  # tiny-llama
SAME = ["request_id", "prompt_tokens", "full_blocks", "hit_blocks", "hit_tokens", "new_blocks", "evictions",
        "orphan_evictions", "admitted", "cached_blocks", "orphan_blocks", "preemptions", "readmission_hit_blocks",
        "computed_prompt_tokens", "prefill_tokens", "computed_tokens", "rejected"]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine(build_random_model("tiny-llama", seed=0), capacity_blocks=96, block_size=8, num_threads=1)


@pytest.mark.parametrize(("max_num_seqs", "capacity", "budget"), [(4, 96, 64), (8, 40, 48)])
def test_batched_steps_serve_what_one_forward_per_entry_serves(engine, max_num_seqs, capacity, budget):
    """All arrivals at t=0 (decisions independent of timing), shared prefixes, chunked prefill, evictions: the
    batched executor's per-request rows, step shapes and sampled tokens equal the sequential executor's."""
    wl = synthetic_chat(30, seed=4, n_tenants=2, system_tokens=(16, 48), n_docs=4, doc_tokens=(40, 120),
                        user_median=12, answer_median=10, vocab_size=VOCAB, vocab_offset=8)
    wl = zero_arrivals(dataclasses.replace(wl, output_length=np.minimum(wl.output_length, 5)))
    kw = dict(capacity_blocks=capacity, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, timer="thread")
    seq = run_engine_serving(wl, engine, **kw)
    bat = run_engine_serving(wl, engine, batched=True, **kw)
    pd.testing.assert_frame_equal(bat.requests[SAME], seq.requests[SAME])
    cols = ["batch_seqs", "batch_tokens", "prefill_tokens", "decode_tokens"]
    pd.testing.assert_frame_equal(bat.timeseries[cols], seq.timeseries[cols])
    assert bat.summary["batched"] and not seq.summary["batched"]
    assert bat.summary["token_hit_rate"] > 0.2 and (bat.timeseries["batch_seqs"] > 1).any()
    assert bat.summary["forward_calls"] < seq.summary["forward_calls"]  # one forward per step, not per entry
    assert bat.generated == seq.generated


def test_batched_steps_sample_the_models_greedy_tokens(engine):
    """Without known outputs: prefix hits, chunked prefill and preemption (recompute) inside packed steps give
    the tokens of an uncached greedy generation."""
    rng = np.random.default_rng(5)
    doc = rng.integers(0, VOCAB, 40).tolist()
    prompts = [doc + rng.integers(0, VOCAB, k).tolist() for k in (3, 9, 14, 5)]
    wl = from_lists(prompts, output_length=[16, 16, 16, 16])
    res = run_engine_serving(wl, engine, capacity_blocks=12, max_num_seqs=4, max_num_batched_tokens=24, batched=True)
    assert res.summary["preemptions"] > 0 and res.requests["hit_blocks"].tolist() == [0, 5, 5, 5]
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            gen = engine.model.generate(torch.as_tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert res.generated[r] == gen[0, len(prompt):].tolist(), r


def test_batched_calibration_and_fidelity_run(engine):
    """Calibration times packed batches (one forward per batch) and fits the batched step equation; the fidelity
    study at max_num_seqs > 1 serves with the batched executor. Loose bound (shared 2-core machine):
    benchmarks/fidelity.py --batched holds the real target."""
    from kvlab.sim.calibrate import QUICK_GRID, calibrate, measure_steps
    from kvlab.sim.fidelity import fidelity

    samples = measure_steps(engine, QUICK_GRID[:6], repeats=1, timer="thread", execution="batched")
    assert (samples["seconds"] > 0).all()
    cal = calibrate(engine, grid=QUICK_GRID, repeats=1, timer="thread", execution="batched")
    assert cal.fit.execution == "batched" and "batched execution" in cal.hardware.description
    wl = synthetic_chat(30, seed=11, n_tenants=2, system_tokens=(16, 48), n_docs=4, doc_tokens=(40, 120),
                        user_median=12, answer_median=10, vocab_size=VOCAB, vocab_offset=8)
    wl = dataclasses.replace(wl, output_length=np.minimum(wl.output_length, 4))
    res = fidelity(wl, engine, None, grid=QUICK_GRID, loads=(0.5,), repeats=1, saturation_repeats=1, timer="thread",
                   capacity_blocks=64, max_num_seqs=4, max_num_batched_tokens=128, batched=True)
    assert res.calibration.fit.execution == "batched" and res.saturation_rps > 0
    assert (res.table["median_ttft_error"] < 2.0).all(), res.table.to_dict("records")


def test_verify_judges_each_request_inside_packed_batches(engine):
    """verify=True: every request's first completed prefill, computed inside a packed step beside others, is
    judged against the uncached forward (logits, pool K/V, greedy tokens): all pass in fp32."""
    wl = synthetic_chat(16, seed=2, n_tenants=2, system_tokens=(16, 48), n_docs=3, doc_tokens=(40, 100),
                        user_median=12, answer_median=10, vocab_size=VOCAB, vocab_offset=8)
    wl = zero_arrivals(dataclasses.replace(wl, output_length=np.minimum(wl.output_length, 3)))
    res = run_engine_serving(wl, engine, capacity_blocks=96, max_num_seqs=8, max_num_batched_tokens=96,
                             timer="thread", batched=True, verify=True)
    s = res.summary
    assert s["verified_requests"] == len(wl) and s["verify_failures"] == 0 and s["verify_pass_rate"] == 1.0
    assert s["token_hit_rate"] > 0.2 and 0 <= s["verify_max_logit_abs"] < 1e-3


# each fault that the batched path goes through, and whether verify must flag exactly the requests with hits
BATCHED_MUTATIONS = {
    "none": {},
    "position_offset+1": {"position_offset": 1},
    "position_offset-1": {"position_offset": -1},
    "wrong_block": {"wrong_block": True},
    "stale_block": {"stale_block": True},
}


@pytest.mark.parametrize("name", list(BATCHED_MUTATIONS))
def test_verify_catches_each_mutation_inside_packed_batches(name):
    """The oracle's mutation tests on the batched path: each fault of the compute seams, injected into packed
    forwards under the scheduler (max_num_seqs 4, shared prefixes, evictions), is caught by verify per request.
    Read faults (wrong block, shifted positions) break exactly the requests that read a cached prefix; lost
    writes (stale block) break requests whose pool K/V kept another forward's data."""
    from kvlab.engine.faults import FaultyEngine

    faults = BATCHED_MUTATIONS[name]
    eng = FaultyEngine(build_random_model("tiny-llama", seed=0), faults=faults, capacity_blocks=40, block_size=8,
                       num_threads=1)
    wl = synthetic_chat(16, seed=2, n_tenants=2, system_tokens=(16, 48), n_docs=3, doc_tokens=(40, 100),
                        user_median=12, answer_median=10, vocab_size=VOCAB, vocab_offset=8)
    wl = zero_arrivals(dataclasses.replace(wl, output_length=np.minimum(wl.output_length, 3)))
    res = run_engine_serving(wl, eng, capacity_blocks=40, max_num_seqs=4, max_num_batched_tokens=512, timer="thread",
                             batched=True, verify=True)
    s, f = res.summary, res.requests
    assert s["verified_requests"] == len(wl) and f["hit_blocks"].gt(0).sum() >= 4 and f["evictions"].sum() > 0
    failed = set(res.verify.loc[~res.verify["verify_passed"].astype(bool), "row"])
    if name == "none":
        assert not failed and s["verify_max_logit_abs"] < 1e-3
    elif name == "stale_block":
        assert eng.lost_writes > 0 and failed, "lost writes must be caught"
        assert (res.verify.loc[res.verify["row"].isin(failed), ["verify_logit_max_abs", "verify_kv_max_abs"]]
                .max(axis=1) > 1.0).all()
    else:
        assert failed == set(np.flatnonzero(f["hit_blocks"].to_numpy() > 0).tolist())
