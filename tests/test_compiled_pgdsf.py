"""Compiled (numba) twin of pgdsf: every replay column equals the Python class's, request for request
(orphan counts included), in both counting modes, with non-default attention ratios, and on deep shared
prefixes where the leaf-only machinery (parking non-leaves, releasing them, the fallback to a non-leaf
when every evictable block has cached children) actually runs."""

from __future__ import annotations

import numpy as np
import pytest
from _util import (
    assert_twin_equal,
    assert_twin_on_random_tokens,
    conversation_workload,
    deep_prefix_workload,
    random_token_workload,
)

from kvlab.errors import ConfigError
from kvlab.policies import make_policy
from kvlab.policies.pgdsf import PGDSF
from kvlab.replay import ReplayConfig, encode, replay

CASES = [(1, 2, 0), (3, 2, 1), (8, 1, 2), (13, 4, 3), (40, 2, 4), (24, 3, 5)]


@pytest.fixture
def leaf_events(monkeypatch):
    """Counts, in the Python class, victims chosen while blocks were parked, parked keys released and
    fallback victims (a block whose key has cached children)."""
    counts = {"parked": 0, "released": 0, "fallback": 0}
    victim, release = PGDSF.victim, PGDSF._release_parked

    def counting_victim(self):
        block = victim(self)
        counts["parked"] += bool(self._parked)
        counts["fallback"] += self._children(block.key) > 0
        return block

    def counting_release(self):
        counts["released"] += len({k for k in self._dirty if k in self._parked and self._children(k) == 0})
        release(self)

    monkeypatch.setattr(PGDSF, "victim", counting_victim)
    monkeypatch.setattr(PGDSF, "_release_parked", counting_release)
    return counts


@pytest.mark.parametrize(("capacity", "block_size", "seed"), CASES)
def test_compiled_pgdsf_equals_python(capacity, block_size, seed):
    assert_twin_on_random_tokens("pgdsf", capacity, block_size, seed)


@pytest.mark.parametrize("attention_ratio", [0.0, 0.37, 1e6])
def test_compiled_pgdsf_equals_python_with_attention_ratio(attention_ratio):
    w = random_token_workload(7, n=400, vocab=4)
    for capacity, block_size in [(24, 2), (9, 3)]:
        for mode in ("vllm", "ideal"):
            cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode, policy="pgdsf",
                               policy_params={"attention_ratio": attention_ratio})
            frame = assert_twin_equal(w, cfg)
            assert frame["evictions"].sum() > 50


@pytest.mark.parametrize("attention_ratio", [0.0, 3.9e-5, 1e6])
@pytest.mark.parametrize(("capacity", "seed"), [(10, 0), (20, 1), (40, 2), (80, 3)])
def test_compiled_pgdsf_on_deep_prefixes(leaf_events, capacity, seed, attention_ratio):
    w = conversation_workload(seed)
    for mode in ("vllm", "ideal"):
        cfg = ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode, policy="pgdsf",
                           policy_params={"attention_ratio": attention_ratio})
        frame = assert_twin_equal(w, cfg)
        assert frame["evictions"].sum() > 300
        # leaf-only: no block is ever orphaned (gdsf, which evicts inner blocks, orphans many)
        assert frame["orphan_evictions"].sum() == 0
        assert frame["orphan_blocks"].max() == 0
        gdsf = replay(w, cfg, policy="gdsf", policy_params={}, engine="python").requests
        assert gdsf["orphan_evictions"].sum() > 100
    assert leaf_events["parked"] > 20
    assert leaf_events["released"] > 10


def test_compiled_pgdsf_when_only_non_leaves_are_evictable(leaf_events):
    for capacity, seed in [(16, 0), (20, 0), (30, 1)]:
        w = deep_prefix_workload(seed)
        for mode in ("vllm", "ideal"):
            assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode, policy="pgdsf"))
    assert leaf_events["fallback"] > 3


def test_compiled_pgdsf_on_a_longer_workload():
    # enough requests for the clock to climb and old frequent keys to age out
    w = random_token_workload(11, n=1500, vocab=5, max_len=60)
    for capacity in (16, 64):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=2, policy="pgdsf"))
        assert frame["evictions"].sum() > 500


def test_compiled_params_need_prepare():
    policy = make_policy("pgdsf", attention_ratio=0.5)
    with pytest.raises(ConfigError, match="prepare"):
        policy.compiled_params()
    w = random_token_workload(0, n=20)
    enc = encode(w, ReplayConfig(capacity_blocks=4, block_size=2))
    policy.prepare(enc)
    values, prompt, offsets, key_ids = policy.compiled_params()
    assert values.tolist() == [0.5, 2.0]
    assert np.array_equal(prompt, enc.prompt_tokens) and np.array_equal(key_ids, enc.key_ids)
    assert np.array_equal(offsets, enc.offsets)
