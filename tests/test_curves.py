"""The one-pass LRU curve (kvlab.replay.curves) against the exact LRU replay, block for block (docs/curves.md)."""

from __future__ import annotations

import numpy as np
import pytest
from _util import random_token_workload

from kvlab.errors import ConfigError
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.replay.curves import CURVE_COLUMNS, key_sample, lru_curve
from kvlab.replay.minisim import MINI_COLUMNS, mini_curve, sampled_encoding
from kvlab.workload.generate import synthetic_chat
from kvlab.workload.mooncake import load_mooncake

SUMMARY_RATES = ("token_hit_rate", "block_hit_rate", "request_hit_rate", "mean_request_hit_rate")


def _exact(w, enc, cfg, capacity):
    return replay(w, cfg, encoded=enc, capacity_blocks=int(capacity))


def _assert_row_equal(row, run):
    assert row.hit_blocks == int(run.requests["hit_blocks"].sum()), row.capacity_blocks
    assert row.reused_tokens == run.summary["reused_tokens"]
    for name in SUMMARY_RATES:
        assert getattr(row, name) == pytest.approx(run.summary[name], abs=1e-12), (row.capacity_blocks, name)


@pytest.mark.parametrize("mode", ["vllm", "ideal"])
@pytest.mark.parametrize(("trace", "rows"), [("conversation", 3000), ("synthetic", 1500)])
def test_equals_exact_lru_on_mooncake(shared_file, trace, rows, mode):
    """At capacities of at least the largest request the curve equals the exact LRU replay block for block."""
    w = load_mooncake(shared_file(f"mooncake/{trace}_trace.jsonl")).head(rows)
    cfg = ReplayConfig(capacity_blocks=1, mode=mode)
    enc = encode(w, cfg)
    largest = int(enc.num_blocks.max())
    caps = [largest, largest + 1, 2 * largest, 1000, 3000, 10_000, 60_000]
    curve = lru_curve(w, capacities=caps, encoded=enc, mode=mode)
    assert list(curve.columns) == list(CURVE_COLUMNS)
    assert curve.attrs["largest_request_blocks"] == largest
    assert curve.attrs["diverge_from_blocks"] == float("inf")
    assert curve["exact"].all()
    for row in curve.itertuples():
        run = _exact(w, enc, cfg, row.capacity_blocks)
        assert run.summary["rejected_requests"] == 0
        _assert_row_equal(row, run)
    # below the largest request requests are rejected: one pass per set of admitted requests is exact again,
    # the single pass (one_pass=True) takes them and is flagged
    small = [largest // 8, largest // 4, largest // 2, largest - 1]
    below = lru_curve(w, capacities=small, encoded=enc, mode=mode)
    one = lru_curve(w, capacities=small, encoded=enc, mode=mode, one_pass=True)
    assert below["exact"].all() and not one["exact"].any()
    differ = 0
    for row, approx in zip(below.itertuples(), one.itertuples(), strict=True):
        run = _exact(w, enc, cfg, row.capacity_blocks)
        assert run.summary["rejected_requests"] > 0
        _assert_row_equal(row, run)
        differ += approx.hit_blocks != row.hit_blocks
    assert differ > 0


def test_equals_exact_lru_on_a_token_chat_workload():
    """Token prompts (system prompts, RAG documents, multi-turn sessions) at 16-token blocks: exact everywhere."""
    w = synthetic_chat(600, seed=1)
    cfg = ReplayConfig(capacity_blocks=1, block_size=16)
    enc = encode(w, cfg)
    curve = lru_curve(w, block_size=16, capacities=[40, 150, 400, 1500, 6000], encoded=enc)
    assert curve["exact"].all()
    for row in curve.itertuples():
        _assert_row_equal(row, _exact(w, enc, cfg, row.capacity_blocks))


@pytest.mark.parametrize("mode", ["vllm", "ideal"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_exact_rows_equal_on_adversarial_tokens(mode, block_size):
    """A 3-token vocabulary: duplicates, the hit limit recomputing cached blocks, partial blocks and
    evictions at every capacity. Every row flagged ``exact`` equals the exact replay."""
    checked = 0
    for seed in range(10):
        w = random_token_workload(seed, n=150)
        cfg = ReplayConfig(capacity_blocks=1, block_size=block_size, mode=mode)
        enc = encode(w, cfg)
        curve = lru_curve(w, block_size=block_size, capacities=range(1, 100, 3), mode=mode, encoded=enc)
        assert (curve["capacity_blocks"] < curve.attrs["diverge_from_blocks"])[~curve["exact"]].sum() == 0
        for row in curve[curve["exact"]].itertuples():
            _assert_row_equal(row, _exact(w, enc, cfg, row.capacity_blocks))
            checked += 1
    assert checked > 10


def test_two_copies_of_a_key_make_the_stack_differ():
    """Why ``diverge_from_blocks`` exists: with keys held by two blocks, the cache pins the older copy and
    the stack moves the newer one; from that capacity on, rows may differ (and some do)."""
    differ = 0
    for seed in range(4):
        w = random_token_workload(seed, n=150)
        cfg = ReplayConfig(capacity_blocks=1, block_size=1)
        enc = encode(w, cfg)
        curve = lru_curve(w, block_size=1, capacities=range(1, 100, 3), encoded=enc)
        assert curve.attrs["diverge_from_blocks"] < float("inf")
        flagged = curve[~curve["exact"]]
        for row in flagged.itertuples():
            differ += row.hit_blocks != int(_exact(w, enc, cfg, row.capacity_blocks).requests["hit_blocks"].sum())
    assert differ > 0


def test_full_curve_reaches_the_ideal_hit_rate(shared_file):
    w = load_mooncake(shared_file("mooncake/synthetic_trace.jsonl")).head(800)
    curve = lru_curve(w)
    assert (curve["capacity_blocks"].to_numpy() == np.arange(1, len(curve) + 1)).all()
    # LRU is a stack algorithm: more capacity never loses a hit, once no request is rejected (below the
    # largest request, a rejected request evicts nothing and the exact curve may dip)
    above = curve[curve["capacity_blocks"] >= curve.attrs["largest_request_blocks"]]
    assert (np.diff(above["hit_blocks"].to_numpy()) >= 0).all()
    assert (np.diff(lru_curve(w, one_pass=True)["hit_blocks"].to_numpy()) >= 0).all()
    run = replay(w, capacity_blocks=int(curve["capacity_blocks"].iloc[-1]))
    assert curve["token_hit_rate"].iloc[-1] == pytest.approx(run.summary["ideal_hit_rate"], abs=1e-12)
    assert curve["token_hit_rate"].iloc[-1] == pytest.approx(run.summary["token_hit_rate"], abs=1e-12)


def test_sampled_curve_is_deterministic_and_close(shared_file):
    w = load_mooncake(shared_file("mooncake/synthetic_trace.jsonl")).head(1500)
    enc = encode(w, ReplayConfig(capacity_blocks=1))
    caps = [1000, 3000, 10_000, 30_000]
    exact = lru_curve(w, capacities=caps, encoded=enc)
    assert lru_curve(w, capacities=caps, encoded=enc, sample_rate=1.0).equals(exact)
    a = lru_curve(w, capacities=caps, encoded=enc, sample_rate=0.5, seed=3)
    b = lru_curve(w, capacities=caps, encoded=enc, sample_rate=0.5, seed=3)
    assert a.equals(b)
    assert not a["exact"].any() and (a["sample_rate"] == 0.5).all()
    for adjust in (True, False):
        s = lru_curve(w, capacities=caps, encoded=enc, sample_rate=0.5, seed=3, adjust=adjust)
        err = np.abs(s["token_hit_rate"].to_numpy() - exact["token_hit_rate"].to_numpy())
        assert err.max() < 0.05, (adjust, err)


def test_bad_arguments():
    w = random_token_workload(0, n=20)
    with pytest.raises(ConfigError, match="sample_rate"):
        lru_curve(w, block_size=4, sample_rate=0.0)
    with pytest.raises(ConfigError, match="capacities"):
        lru_curve(w, block_size=4, capacities=[0, 5])
    with pytest.raises(ConfigError, match="mode"):
        lru_curve(w, block_size=4, mode="exact")


def test_mini_simulation_tracks_each_policy(shared_file):
    """Mini-simulations (kvlab.replay.minisim): deterministic, LRU's agrees with the sampled stack, and each
    policy's estimate is near its exact replay on a trace slice (the measured errors: docs/curves.md)."""
    w = load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(3000)
    enc = encode(w, ReplayConfig(capacity_blocks=1))
    caps = [1000, 4000, 20_000]
    mask = key_sample(enc.num_keys, 1.0)
    mini, eligible = sampled_encoding(enc, mask)
    assert (mini.offsets == enc.offsets).all() and (mini.key_ids == enc.key_ids).all()
    assert eligible.sum() == np.minimum(enc.full_blocks, (enc.prompt_tokens - 1) // enc.block_size).sum()
    a = mini_curve(w, "lru", caps, sample_rate=0.5, seed=1, encoded=enc)
    assert list(a.columns) == list(MINI_COLUMNS)
    assert a.equals(mini_curve(w, "lru", caps, sample_rate=0.5, seed=1, encoded=enc))
    stack = lru_curve(w, capacities=caps, encoded=enc, sample_rate=0.5, seed=1)
    assert np.abs(a["token_hit_rate"].to_numpy() - stack["token_hit_rate"].to_numpy()).max() < 0.005
    for policy in ("lru", "arc", "s3fifo"):
        truth = [replay(w, encoded=enc, capacity_blocks=c, policy=policy).summary["token_hit_rate"] for c in caps]
        est = mini_curve(w, policy, caps, sample_rate=0.5, seed=1, encoded=enc)["token_hit_rate"].to_numpy()
        assert np.abs(est - truth).max() < 0.03, (policy, est, truth)
