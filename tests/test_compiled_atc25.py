"""Compiled (numba) twin of the workload-aware policy (ATC'25): every replay column equals the Python
class's, request for request, on workloads with several categories, turns and irregular arrival times
(ties, negative times), in both counting modes, at several capacities and block sizes, with non-default
parameters; and the float pieces it relies on (libm's log/expm1 as numba calls them, the time keys)."""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import pandas as pd
import pytest
from _util import assert_twin_equal, random_category_workload

from kvlab.cache import AccessContext, PrefixCache
from kvlab.errors import ConfigError
from kvlab.policies import make_policy
from kvlab.policies.workload_aware import Category, WorkloadAware, request_categories
from kvlab.replay import ReplayConfig, encode
from kvlab.workload.alibaba import load_alibaba
from kvlab.workload.generate import synthetic_chat
from kvlab.workload.mooncake import load_mooncake

# ---------------------------------------------------------------------- float pieces


@nb.njit(cache=True)
def _nb_log_expm1(x):
    a = np.empty_like(x)
    b = np.empty_like(x)
    for i in range(len(x)):
        a[i] = math.log(x[i])
        b[i] = math.expm1(-x[i])
    return a, b


def test_numba_log_and_expm1_are_bit_identical_to_python():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.random(20000), rng.random(20000) * 1e-6, np.exp(rng.uniform(-700, 700, 20000)),
                        np.array([1e-300, 5e-324, 1.0, 2.0, 0.5, 1e-3, 600.0, 1 / 600.0])])
    a, b = _nb_log_expm1(x)
    assert np.array_equal(a.view(np.int64), np.array([math.log(v) for v in x]).view(np.int64))
    assert np.array_equal(b.view(np.int64), np.array([math.expm1(-v) for v in x]).view(np.int64))


def test_time_keys_order_like_the_floats():
    vals = np.array([3.5, -0.0, 0.0, -1e-300, 1e-300, -7.25, 7.25, -np.inf, np.inf, 2.0, -2.0, 0.0, 1e9])
    enc = type("Enc", (), {"prompt_tokens": np.zeros(len(vals), np.int64), "arrival": vals})()
    _, rq = request_categories(enc, 10)
    keys = rq[0]
    for i in range(len(vals)):
        for j in range(len(vals)):
            assert (keys[i] < keys[j]) == (vals[i] < vals[j])
            assert (keys[i] == keys[j]) == (vals[i] == vals[j])


def test_categories_are_label_and_clamped_turn():
    w = random_category_workload(1, n=200, long_gap=40.0, turns=True)
    enc = encode(w, ReplayConfig(capacity_blocks=10, block_size=2))
    _, rq = request_categories(enc, 4)
    labels = [None if pd.isna(c) else str(c) for c in w.category]
    names = [(c, min(int(t), 4)) for c, t in zip(labels, w.turn, strict=True)]
    # same dense id <=> same Python category name
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert (rq[1][i] == rq[1][j]) == (names[i] == names[j])


def test_compiled_params_need_prepare():
    with pytest.raises(ConfigError):
        WorkloadAware().compiled_params()


# ---------------------------------------------------------------------- hit for hit


@pytest.mark.parametrize(("capacity", "block_size"), [(60, 16), (250, 16), (120, 32), (400, 8)])
def test_twin_equals_python_on_synthetic_chat(capacity, block_size):
    w = synthetic_chat(300, seed=capacity)
    assert len(set(w.category)) == 2 and w.turn.max() > 3
    for mode in ("vllm", "ideal"):
        cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy="workload-aware")
        frame = assert_twin_equal(w, cfg)
        assert frame["evictions"].sum() > 500
        assert frame["hit_blocks"].sum() > 100


PARAMS = [
    {"life_s": 30.0, "window": 7, "min_samples": 3, "max_turn": 2},
    {"life_s": 1e4, "window": 50, "min_samples": 40, "max_turn": 20},
    {"life_s": 0.5, "window": 1, "min_samples": 1, "max_turn": 1},
    {"life_s": 120.0, "window": 200, "min_samples": 10_000, "max_turn": 5},  # pooled or default fit only
]


@pytest.mark.parametrize("params", PARAMS)
def test_twin_equals_python_with_parameters(params):
    w = synthetic_chat(250, seed=7, think_time=5.0)
    for capacity, block_size in [(90, 16), (300, 8)]:
        for mode in ("vllm", "ideal"):
            cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy="workload-aware",
                               policy_params=params)
            assert assert_twin_equal(w, cfg)["evictions"].sum() > 500


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("capacity", "block_size", "params"), [
    (6, 2, {}),
    (13, 2, {"window": 5, "min_samples": 2, "max_turn": 3}),
    (24, 1, {"life_s": 2.0, "window": 3, "min_samples": 1}),
    (40, 3, {"life_s": 1e5, "max_turn": 12}),
])
def test_twin_equals_python_on_random_categories_turns_and_ties(seed, capacity, block_size, params):
    w = random_category_workload(seed, long_gap=40.0, turns=True)
    for mode in ("vllm", "ideal"):
        cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy="workload-aware",
                           policy_params=params)
        frame = assert_twin_equal(w, cfg)
        assert frame["evictions"].sum() > 300 and frame["hit_blocks"].sum() > 40


def test_the_python_class_scores_several_categories_and_both_fits():
    # the twin test's first case (synthetic_chat seed 60, 60 blocks of 16) exercises the scored path:
    # several non-empty queues, categories with their own fit and with the pooled one
    w = synthetic_chat(300, seed=60)
    enc = encode(w, ReplayConfig(capacity_blocks=60, block_size=16))
    pol = make_policy("workload-aware")
    cache = PrefixCache(60, pol, block_size=16)
    calls = {"scored": 0, "own": 0, "pooled": 0}
    original = pol.log_reuse_prob

    def log_reuse_prob(cat: Category, age: float) -> float:
        calls["scored"] += 1
        calls["own" if len(cat.samples) >= pol.min_samples else "pooled"] += 1
        return original(cat, age)

    pol.log_reuse_prob = log_reuse_prob  # type: ignore[method-assign]
    cats = [str(c) for c in w.category]
    for r in range(len(w)):
        ctx = AccessContext(time=float(w.arrival[r]), seq=r, category=cats[r], turn=int(w.turn[r]))
        adm = cache.admit(enc.keys(r).tolist(), int(enc.prompt_tokens[r]), ctx)
        if adm is not None:
            cache.release(adm.blocks, ctx)
    assert len(pol.categories) >= 4
    assert calls["own"] > 1000 and calls["pooled"] > 20


def test_twin_equals_python_on_the_alibaba_sample(shared_file):
    w = load_alibaba(shared_file("alibaba/sample_traceA_multiturn_20.jsonl"))
    for capacity in (130, 200):
        for mode in ("vllm", "ideal"):
            for params in ({}, {"min_samples": 1, "window": 20, "life_s": 60.0}):
                cfg = ReplayConfig(capacity_blocks=capacity, mode=mode, policy="workload-aware", policy_params=params)
                assert assert_twin_equal(w, cfg)["evictions"].sum() > 50


def test_twin_equals_python_on_mooncake_conversation_head(shared_file):
    # one category; arrival times on a 3 s grid (about 10 requests per time): the order is age, then
    # position, then unpin order
    w = load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(1500)
    for capacity in (500, 2000):
        cfg = ReplayConfig(capacity_blocks=capacity, policy="workload-aware")
        assert assert_twin_equal(w, cfg)["evictions"].sum() > 1000
