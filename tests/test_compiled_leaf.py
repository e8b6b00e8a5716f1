"""Compiled (numba) twins of the leaf-only policies sglang-leaf, prefix-aware-lru and prefix-aware-lfu:
every replay column equals the Python class's, request for request (orphan counts included), in both
counting modes, and on deep shared prefixes where the leaf-only machinery (parking non-leaves, releasing
them, the fallback to a non-leaf when every evictable block has cached children) actually runs."""

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
from kvlab.policies.prefix_aware import PrefixAware
from kvlab.policies.sglang_leaf import SGLangLeaf
from kvlab.replay import ReplayConfig, encode
from kvlab.workload.workload import from_lists

POLICIES = ["sglang-leaf", "prefix-aware-lru", "prefix-aware-lfu"]
CASES = [(1, 2, 0), (3, 2, 1), (8, 1, 2), (13, 4, 3), (40, 2, 4), (24, 3, 5)]


@pytest.fixture
def leaf_events(monkeypatch):
    """Counts, in the Python classes, victims chosen while blocks were parked, parked keys released and
    fallback victims (a block whose key has cached children)."""
    counts = {"parked": 0, "released": 0, "fallback": 0}
    for cls in (SGLangLeaf, PrefixAware):
        victim, release = cls.victim, cls._release_parked

        def counting_victim(self, victim=victim):
            block = victim(self)
            counts["parked"] += bool(self._parked)
            counts["fallback"] += self._children(block.key) > 0
            return block

        def counting_release(self, release=release):
            counts["released"] += len({k for k in self._dirty if k in self._parked and self._children(k) == 0})
            release(self)

        monkeypatch.setattr(cls, "victim", counting_victim)
        monkeypatch.setattr(cls, "_release_parked", counting_release)
    return counts


def test_twins_cover_the_wrapper_around_lru_and_lfu_only():
    for name in POLICIES:
        assert make_policy(name).compiled is not None
    # the generic wrapper uses the twin of its inner policy where there is one, else runs in Python
    assert make_policy("prefix-aware").compiled is make_policy("prefix-aware-lru").compiled
    assert make_policy("prefix-aware", inner="lfu").compiled is make_policy("prefix-aware-lfu").compiled
    assert make_policy("prefix-aware", inner="fifo").compiled is None


def test_generic_wrapper_twin_equals_python():
    w = random_token_workload(5)
    for inner in ("lru", "lfu"):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=13, block_size=2, policy="prefix-aware",
                                                  policy_params={"inner": inner}))
        assert frame["evictions"].sum() > 50


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("capacity", "block_size", "seed"), CASES)
def test_compiled_leaf_equals_python(policy, capacity, block_size, seed):
    assert_twin_on_random_tokens(policy, capacity, block_size, seed)


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_leaf_on_deep_prefixes(leaf_events, policy):
    for capacity, seed in [(10, 0), (20, 1), (40, 2), (80, 3)]:
        w = conversation_workload(seed)
        for mode in ("vllm", "ideal"):
            frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode,
                                                      policy=policy))
            assert frame["evictions"].sum() > 300
            # leaf-only: no block is ever orphaned
            assert frame["orphan_evictions"].sum() == 0
            assert frame["orphan_blocks"].max() == 0
    # no parked/released counts asserted here: a parent is accessed (and unpinned) with each of its
    # children, so without duplicates an inner block rarely reaches the front of these orders


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_leaf_when_only_non_leaves_are_evictable(leaf_events, policy):
    for capacity, seed in [(16, 0), (20, 0), (30, 1)]:
        w = deep_prefix_workload(seed)
        for mode in ("vllm", "ideal"):
            assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode, policy=policy))
    assert leaf_events["parked"] > 20
    assert leaf_events["fallback"] > 3


def repeated_prefix_workload(seed: int, n: int = 300, trunks: int = 4, depth: int = 40, block_size: int = 4):
    """Prompts that are block-aligned prefixes of a few trunks, most without a tail: vllm mode recomputes
    such a prompt's last full block, a duplicate that later hits skip (they take the key's oldest block).
    The duplicate reaches the front while its key has cached children (parked) and is released when the
    last of them is evicted."""
    rng = np.random.default_rng(seed)
    trunk = [rng.integers(0, 50, size=depth).tolist() for _ in range(trunks)]
    prompts = []
    for _ in range(n):
        stem = trunk[int(rng.integers(trunks))][: int(rng.integers(1, depth // block_size)) * block_size]
        tail = rng.integers(0, 50, size=int(rng.integers(1, 4))).tolist() if rng.random() >= 0.7 else []
        prompts.append(stem + tail)
    return from_lists(prompts, arrival=np.arange(n, dtype=float))


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_leaf_parks_and_releases_duplicates(leaf_events, policy):
    for capacity, seed in [(12, 0), (20, 1), (30, 2)]:
        w = repeated_prefix_workload(seed)
        for mode in ("vllm", "ideal"):
            frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode,
                                                      policy=policy))
            assert frame["evictions"].sum() > 100
            assert frame["orphan_evictions"].sum() == 0
    assert leaf_events["parked"] > 20
    assert leaf_events["released"] > 20


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_leaf_on_a_longer_workload(policy):
    w = random_token_workload(11, n=1500, vocab=5, max_len=60)
    for capacity in (16, 64):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=2, policy=policy))
        assert frame["evictions"].sum() > 500


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_params_need_prepare(policy):
    p = make_policy(policy)
    with pytest.raises(ConfigError, match="prepare"):
        p.compiled_params()
    w = random_token_workload(0, n=20)
    enc = encode(w, ReplayConfig(capacity_blocks=4, block_size=2))
    p.prepare(enc)
    offsets, key_ids = p.compiled_params()
    assert np.array_equal(offsets, enc.offsets) and np.array_equal(key_ids, enc.key_ids)
