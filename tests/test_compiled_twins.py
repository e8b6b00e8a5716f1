"""Compiled (numba) twins of lfuda, gdsf and 2q: every replay column equals the Python class's, request
for request (orphan counts included), in both counting modes and with non-default parameters."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from _util import assert_twin_on_random_tokens, random_token_workload

from kvlab.errors import ConfigError
from kvlab.policies import make_policy
from kvlab.policies._queues import float_key
from kvlab.replay import ReplayConfig, encode, replay

TWINS = ["lfuda", "gdsf", "2q"]
COLUMNS = ["hit_blocks", "new_blocks", "evictions", "admitted", "cached_blocks", "orphan_blocks", "orphan_evictions"]
CASES = [(1, 2, 0), (3, 2, 1), (8, 1, 2), (13, 4, 3), (40, 2, 4), (24, 3, 5)]


def compiled_frame(w, cfg: ReplayConfig, enc) -> pd.DataFrame:
    fast = replay(w, cfg, encoded=enc, engine="compiled")
    assert fast.summary["engine"] == "compiled"
    return fast.requests[COLUMNS]


def python_frame(w, cfg: ReplayConfig, enc) -> pd.DataFrame:
    slow = replay(w, cfg, encoded=enc, engine="python")
    assert slow.summary["engine"] == "python"
    return slow.requests[COLUMNS].reset_index(drop=True)


def assert_twin_equal(w, cfg: ReplayConfig) -> pd.DataFrame:
    enc = encode(w, cfg)
    fast = compiled_frame(w, cfg, enc).reset_index(drop=True)
    slow = python_frame(w, cfg, enc)
    pd.testing.assert_frame_equal(fast, slow, check_dtype=False)
    return slow


@pytest.mark.parametrize("policy", TWINS)
@pytest.mark.parametrize(("capacity", "block_size", "seed"), CASES)
def test_compiled_twin_equals_python(policy, capacity, block_size, seed):
    assert_twin_on_random_tokens(policy, capacity, block_size, seed)


PARAMS = [
    ("gdsf", {"attention_ratio": 0.0}),
    ("gdsf", {"attention_ratio": 0.37}),  # cost dominated by position: many distinct float priorities
    ("gdsf", {"attention_ratio": 1e6}),
    ("2q", {"ain_ratio": 0.5, "aout_ratio": 2.0}),
    ("2q", {"ain_ratio": 0.0, "aout_ratio": 0.0}),
    ("2q", {"ain_ratio": 0.1, "aout_ratio": 0.25}),
]


@pytest.mark.parametrize(("policy", "params"), PARAMS)
def test_compiled_twin_equals_python_with_parameters(policy, params):
    w = random_token_workload(7, n=400, vocab=4)
    for capacity, block_size in [(24, 2), (9, 3)]:
        for mode in ("vllm", "ideal"):
            cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy=policy,
                               policy_params=params)
            frame = assert_twin_equal(w, cfg)
            assert frame["evictions"].sum() > 50


def test_lfuda_twin_on_a_longer_workload_with_more_keys():
    # enough requests for the cache age to climb and old frequent blocks to age out
    w = random_token_workload(11, n=1500, vocab=5, max_len=60)
    for capacity in (16, 64):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=2, policy="lfuda"))
        assert frame["evictions"].sum() > 500


def test_gdsf_compiled_params_carry_the_block_size():
    pol = make_policy("gdsf", attention_ratio=0.5)
    with pytest.raises(ConfigError, match="block size"):
        pol.compiled_params()
    pol.prepare(encode(random_token_workload(0, n=20), ReplayConfig(capacity_blocks=8, block_size=4)))
    np.testing.assert_array_equal(pol.compiled_params(), [0.5, 4.0])


def test_float_key_orders_like_the_float():
    import numba as nb

    @nb.njit
    def keys(x):
        v = x.view(np.int64)
        out = np.empty(len(x), np.int64)
        for i in range(len(x)):
            out[i] = float_key(v[i])
        return out

    rng = np.random.default_rng(0)
    x = rng.standard_normal(5000) * 10.0 ** rng.integers(-300, 300, 5000)
    x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, 5e-324, -5e-324, 1.0, 1.0, 2.0 ** 60]])
    k = keys(x)
    i, j = rng.integers(0, len(x), (2, 50_000))
    np.testing.assert_array_equal(x[i] < x[j], k[i] < k[j])
    np.testing.assert_array_equal(x[i] == x[j], k[i] == k[j])
