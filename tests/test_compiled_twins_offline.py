"""Compiled (numba) twins of belady and lfu-halflife: every replay column equals the Python class's,
request for request (orphan counts included), in both counting modes; lfu-halflife in both clocks with
irregular arrival times and several half-lives (its float counts bit for bit); belady also on object
sequences, where the compiled engine equals libCacheSim's Belady hit for hit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from _util import assert_twin_equal, assert_twin_on_random_tokens, random_token_workload, write_oracle_general

from kvlab.cache import AccessContext
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.policies import lfu_halflife, make_policy
from kvlab.policies.belady import NEVER
from kvlab.replay import ReplayConfig, replay
from kvlab.workload import synthetic_chat
from kvlab.workload.objects import object_sequence
from kvlab.workload.workload import from_lists

TWINS = ["belady", "lfu-halflife"]
CASES = [(1, 2, 0), (3, 2, 1), (8, 1, 2), (13, 4, 3), (40, 2, 4), (24, 3, 5)]



def irregular(w, seed: int, mean_gap: float = 1.0):
    """``w``'s prompts with exponential inter-arrival gaps, rounded to 1/4 s (bursts at equal times)."""
    rng = np.random.default_rng(seed)
    arrival = np.round(np.cumsum(rng.exponential(mean_gap, len(w))) * 4) / 4
    return from_lists([w.prompt(i) for i in range(len(w))], arrival=arrival)


@pytest.mark.parametrize("policy", TWINS)
@pytest.mark.parametrize(("capacity", "block_size", "seed"), CASES)
def test_compiled_twin_equals_python(policy, capacity, block_size, seed):
    assert_twin_on_random_tokens(policy, capacity, block_size, seed, min_hits=40)


@pytest.mark.parametrize("clock", ["time", "requests"])
@pytest.mark.parametrize("half_life", [0.5, 4.0, 60.0])
def test_lfu_halflife_twin_with_clocks_and_half_lives(clock, half_life):
    params = {"half_life": half_life, "clock": clock}
    hits = []
    for seed, (capacity, block_size) in enumerate([(13, 2), (24, 1), (40, 3)]):
        w = irregular(random_token_workload(10 + seed, n=400, vocab=4), seed)
        for mode in ("vllm", "ideal"):
            frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode,
                                                      policy="lfu-halflife", policy_params=params))
            assert frame["evictions"].sum() > 100
            hits.append(frame["hit_blocks"].to_numpy())
    if half_life < 60:  # the decay really orders blocks differently from plain LFU (so the floats matter)
        w = irregular(random_token_workload(10, n=400, vocab=4), 0)
        lfu = replay(w, capacity_blocks=13, block_size=2, policy="lfu").requests["hit_blocks"].to_numpy()
        assert not np.array_equal(hits[0], lfu)


@pytest.mark.parametrize("clock", ["time", "requests"])
def test_lfu_halflife_twin_on_synthetic_chat(clock):
    w = synthetic_chat(500, seed=3)
    assert len(np.unique(np.diff(w.arrival))) > 100  # real, irregular arrival times
    for half_life in (5.0, 600.0) if clock == "time" else (20.0,):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=150, block_size=64, policy="lfu-halflife",
                                                  policy_params={"half_life": half_life, "clock": clock}))
        assert frame["evictions"].sum() > 1000 and frame["hit_blocks"].sum() > 500


def test_lfu_halflife_compiled_floats_are_bit_identical():
    # the twin's counts and priorities are the Python class's floats, bit for bit, over many hits with
    # irregular gaps (a compile-time ``2.0 ** x`` would differ here: LLVM rewrites it as exp2)
    rng = np.random.default_rng(0)
    n, half_life = 20000, 37.3
    arrival = np.cumsum(rng.exponential(5.0, n) * (rng.random(n) < 0.7))
    py = lfu_halflife.LFUHalfLife(half_life=half_life)
    py.prepare(SimpleNamespace(arrival=arrival))
    twin = py.compiled
    state = twin.init(4, 1, py.compiled_params())
    B, F = state.f_b, state.f_bft.T[4:7]  # heap rows; the fields count, t_last and the priority at unpin
    blocks = [SimpleNamespace(block_id=b, key=b, position=0) for b in range(4)]
    py.attach(SimpleNamespace(capacity_blocks=4, blocks=blocks, block_size=1))
    for b in range(4):
        ctx = AccessContext(time=float(arrival[b]), seq=b)
        py.on_insert(blocks[b], ctx)
        twin.on_insert(state, b, 0, b, 0)
        py.on_unpin(blocks[b], ctx)
        twin.on_unpin(state, b, b)
    for seq in range(4, n):
        b = int(rng.integers(4))
        ctx = AccessContext(time=float(arrival[seq]), seq=seq)
        py.on_hit(blocks[b], ctx)
        twin.on_hit(state, b, 0, seq, 0)
        py.on_pin(blocks[b], ctx)
        twin.on_pin(state, b, seq)
        py.on_unpin(blocks[b], ctx)
        twin.on_unpin(state, b, seq)
        count, last = py.state.blkf[0][b], py.state.blkf[1][b]
        assert F[0, b] == count and F[1, b] == last
        assert F[2, b] == math.log2(count) + last / half_life
        assert py.victim().block_id == B[0, 0]  # heap top


def test_belady_twin_on_synthetic_chat():
    w = synthetic_chat(500, seed=4)
    for mode in ("vllm", "ideal"):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=120, block_size=32, mode=mode, policy="belady"))
        assert frame["evictions"].sum() > 1000 and frame["orphan_evictions"].sum() > 0


@pytest.mark.parametrize("capacity", [2, 10, 40])
def test_belady_twin_on_object_sequences_equals_python_and_libcachesim(tmp_path, capacity):
    rng = np.random.default_rng(capacity)
    weights = 1.0 / np.arange(1, 201) ** 0.9
    keys = rng.choice(200, size=4000, p=weights / weights.sum())
    w = object_sequence(keys)
    cfg = ReplayConfig(capacity_blocks=capacity, block_size=1, mode="ideal", policy="belady")
    frame = assert_twin_equal(w, cfg)
    ours = frame["hit_blocks"].to_numpy() > 0
    assert 0 < ours.sum() < len(keys) and frame["evictions"].sum() > 500
    lcs = pytest.importorskip("libcachesim")
    path = tmp_path / "zipf.oracleGeneral.bin"
    write_oracle_general(path, keys)
    ref = lcs.Belady(cache_size=capacity)
    theirs = np.array([ref.get(req) for req in lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)])
    np.testing.assert_array_equal(ours, theirs)


def test_compiled_params_need_prepare():
    with pytest.raises(ConfigError, match="prepare"):
        make_policy("belady").compiled_params()
    with pytest.raises(ConfigError, match="arrival"):
        make_policy("lfu-halflife").compiled_params()
    pol = make_policy("lfu-halflife", clock="requests")
    params = pol.compiled_params()
    assert params[0].tolist() == [600.0, 0.0, 2.0] and len(params[1]) == 0
    enc = EncodedWorkload(offsets=np.array([0, 1, 2]), key_ids=np.array([0, 0]), num_keys=1,
                          prompt_tokens=np.ones(2, int), num_blocks=np.ones(2, int), block_size=1, hash_label="x")
    pol = make_policy("belady")
    pol.prepare(enc)
    off, keys, nxt = pol.compiled_params()
    assert nxt.tolist() == [1, NEVER] and off.dtype == keys.dtype == np.int64
