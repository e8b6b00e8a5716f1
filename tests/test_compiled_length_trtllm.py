"""Compiled (numba) twins of length-aware (Mooncake LengthAwareCache) and trtllm-priority (TensorRT-LLM
retention priorities): every replay column equals the Python class's, request for request, at several
capacities and block sizes, in both counting modes, with default and non-default parameters (priority
ranges, default level, durations that expire during the replay, per-category ranges), on workloads with
categories (some missing) and irregular arrival times (ties, negative times)."""

from __future__ import annotations

import pytest
from _util import assert_twin_equal, random_category_workload, random_token_workload

from kvlab.policies import make_policy
from kvlab.policies.length_aware import LengthAware
from kvlab.policies.trtllm_priority import TRTLLMPriority
from kvlab.replay import ReplayConfig
from kvlab.workload.generate import synthetic_chat

TRT_PARAMS = [
    {},
    {"priorities": [(0, 2, 90)]},
    {"priorities": [(0, 2, 90), (2, 5, 10)], "default": 50, "duration_s": 2.0},
    {"priorities": [(0, 1, 100, 0.0), (1, 3, 80, 1.5), (3, None, 5)], "duration_s": 6.0},
    {"priorities": [(1, 4, 70, None), (0, None, 20, 3.0)], "default": 0},
    {"priorities": [(0, 3, 60)], "duration_s": 1.0,
     "by_category": {"rag": [(0, 6, 95, 4.0)], "search": [(2, None, 1)], "nosuch": [(0, 1, 99)]}},
    {"by_category": {"chat": [(0, 2, 90, 0.5), (4, 8, 3)], "rag": []}, "default": 40, "duration_s": 2.5},
]


@pytest.mark.parametrize("capacity,block_size,seed", [(5, 1, 0), (9, 2, 1), (16, 3, 2), (40, 1, 3)])
def test_length_aware_equals_python(capacity, block_size, seed):
    for w in (random_token_workload(seed, n=400), random_category_workload(seed)):
        for mode in ("vllm", "ideal"):
            cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy="length-aware")
            b = assert_twin_equal(w, cfg)
            assert b["evictions"].sum() > 50


@pytest.mark.parametrize("params", TRT_PARAMS, ids=range(len(TRT_PARAMS)))
@pytest.mark.parametrize("capacity,block_size,seed", [(6, 1, 0), (12, 2, 1), (30, 1, 2)])
def test_trtllm_equals_python(params, capacity, block_size, seed):
    for w in (random_token_workload(seed, n=400), random_category_workload(seed)):
        for mode in ("vllm", "ideal"):
            cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode,
                               policy="trtllm-priority", policy_params=params)
            b = assert_twin_equal(w, cfg)
            assert b["evictions"].sum() > 50


def test_trtllm_twin_expires_priorities():
    """The durations in the tests do expire (refresh moves blocks) and change the victims."""
    w = random_category_workload(5)
    base = {"priorities": [(0, 3, 90)]}
    out = {}
    for dur in (None, 1.0):
        cfg = ReplayConfig(capacity_blocks=12, block_size=1, policy="trtllm-priority",
                           policy_params={**base, "duration_s": dur})
        out[dur] = assert_twin_equal(w, cfg)
    assert not out[None]["hit_blocks"].equals(out[1.0]["hit_blocks"])


@pytest.mark.parametrize("policy,params", [
    ("length-aware", {}),
    ("trtllm-priority", {}),
    ("trtllm-priority", {"priorities": [(0, 8, 90)], "duration_s": 30.0,
                         "by_category": {"rag": [(0, 40, 95, 60.0), (40, None, 10)]}}),
    ("trtllm-priority", {"priorities": [(0, 4, 80, 5.0), (4, 30, 60)], "default": 20, "duration_s": 20.0}),
])
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
def test_twins_equal_python_on_synthetic_chat(policy, params, mode):
    w = synthetic_chat(300, seed=3, doc_tokens=(100, 400), system_tokens=(40, 120), n_docs=12)
    assert w.category is not None
    for capacity in (60, 150):
        cfg = ReplayConfig(capacity_blocks=capacity, block_size=16, mode=mode, policy=policy, policy_params=params)
        b = assert_twin_equal(w, cfg)
        assert b["evictions"].sum() > 200


def test_twins_are_registered():
    assert LengthAware.compiled is not None and TRTLLMPriority.compiled is not None
    assert make_policy("trtllm-priority", by_category={"a": [(0, 1, 50)]}).compiled is not None
