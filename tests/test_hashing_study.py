"""kvlab.studies.hashing: collision counting on constructed cases, the birthday expectation, the block-size sweep
(exactness of expansion at the trace's block size; partial-tail gains below it) and the throughput table."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher, encode_workload, truth_hasher
from kvlab.replay import replay
from kvlab.studies.hashing import (
    best_of,
    birthday_pairs,
    block_size_sweep,
    collision_counts,
    hashing_throughput,
    partial_tail_tokens,
    truncation_collisions,
    vanishing_bits,
)
from kvlab.workload import expand_to_tokens, from_lists, load_mooncake


def test_collision_counts_constructed_case():
    # identities 0..5 (identity 2 appears twice, as a repeated block would); key 7 holds identities 0, 1, 2,
    # key 3 holds 3 and 4, key 9 only 5: pairs C(3,2) + C(2,2) = 4, two colliding keys, 3 prefixes merged
    keys = np.array([7, 7, 7, 3, 3, 9, 7])
    truth = np.array([0, 1, 2, 3, 4, 5, 2])
    assert collision_counts(keys, truth) == {"prefixes": 6, "keys": 3, "colliding_pairs": 4, "colliding_keys": 2,
                                             "merged_prefixes": 3}
    assert collision_counts(truth, truth)["colliding_pairs"] == 0
    assert collision_counts(np.array([], np.int64), np.array([], np.int64))["prefixes"] == 0


def test_collision_counts_refuses_bad_input():
    with pytest.raises(ConfigError, match="several keys"):
        collision_counts(np.array([0, 1]), np.array([5, 5]))  # one identity under two keys: not a hash
    with pytest.raises(ConfigError, match="shape"):
        collision_counts(np.array([0, 1]), np.array([0]))


def test_birthday_pairs():
    assert birthday_pairs(2, 1) == 0.5
    assert birthday_pairs(1, 8) == 0.0
    assert birthday_pairs(1001, 10) == pytest.approx(1001 * 1000 / 2 / 1024)


def test_truncation_collisions_match_encoded_workload():
    rng = np.random.default_rng(0)
    w = from_lists([rng.integers(0, 1000, size=int(rng.integers(40, 200))) for _ in range(60)], kind="tokens")
    frame = truncation_collisions(w, [4, 12, 64], block_size=8)
    # the reference: encode_workload's own verify mode counts the same colliding keys
    for k in (4, 12):
        enc = encode_workload(w, BlockHasher("xxh3_64", truncate_bits=k), 8, verify=True)
        row = frame[frame["bits"] == k].iloc[0]
        assert row["colliding_keys"] == enc.colliding_keys()
        assert row["prefixes"] == enc.num_truth and row["keys"] == enc.num_keys
    assert frame.loc[frame["bits"] == 4, "keys"].iloc[0] <= 16  # at most 2^4 keys
    assert frame.loc[frame["bits"] == 64, "colliding_pairs"].iloc[0] == 0
    assert vanishing_bits(frame) in (12, 64)
    with pytest.raises(ConfigError, match="bits"):
        truncation_collisions(w, [65], block_size=8)


def test_vanishing_bits():
    import pandas as pd

    f = pd.DataFrame({"bits": [8, 16, 24, 32], "colliding_pairs": [9, 0, 1, 0]})
    assert vanishing_bits(f) == 32
    assert vanishing_bits(f.assign(colliding_pairs=[1, 1, 1, 1])) is None
    assert vanishing_bits(f.assign(colliding_pairs=0)) == 8


def test_partial_tail_tokens():
    assert partial_tail_tokens(np.array([10, 16, 33]), 16) == 10 + 0 + 1
    assert partial_tail_tokens(np.array([10, 16, 33]), 1) == 0


def _block_trace():
    """A small hash trace (8-token blocks, chained ids): a shared first block, repeats, partial tails."""
    prompts = [[0, 1, 2], [0, 1, 3, 4], [0, 1, 2], [0, 5], [0, 1, 3, 4, 6], [0, 5]]
    lengths = [20, 27, 20, 13, 36, 16]  # partial last blocks except 16 = 2 full blocks
    return from_lists(prompts, kind="blocks", block_size=8, input_length=lengths)


def test_block_size_sweep_expansion_is_exact_at_the_trace_block_size():
    w = _block_trace()
    tokens = expand_to_tokens(w)
    plain = replay(w, capacity_blocks=100)
    frame = block_size_sweep(tokens, [1, 2, 4, 8], [None, 24])
    at8 = frame[(frame["block_size"] == 8) & (frame["capacity"] == "unbounded")].iloc[0]
    assert at8["token_hit_rate"] == plain.summary["token_hit_rate"]
    assert at8["hit_tokens"] == int(plain.requests["hit_tokens"].sum())
    limited = replay(w, capacity_blocks=3)  # 24 tokens of 8-token blocks
    at8_cap = frame[(frame["block_size"] == 8) & (frame["capacity_tokens"] == 24)].iloc[0]
    assert at8_cap["capacity_blocks"] == 3 and at8_cap["token_hit_rate"] == limited.summary["token_hit_rate"]
    # below the trace's block size only partial tails can add hits, and they can only add
    unbounded = frame[frame["capacity"] == "unbounded"].sort_values("block_size")
    assert np.all(np.diff(unbounded["hit_tokens"].to_numpy()) <= 0)
    assert set(frame.columns) >= {"keyed_blocks", "distinct_keys", "tail_tokens", "prompt_tokens"}
    assert (unbounded["keyed_blocks"] == [int((w.input_length // b).sum()) for b in (1, 2, 4, 8)]).all()


def test_block_size_sweep_expansion_matches_mooncake(shared_file):
    mc = load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(150)
    frame = block_size_sweep(expand_to_tokens(mc), [512])
    assert frame["token_hit_rate"].iloc[0] == replay(mc, capacity_blocks=10**6).summary["token_hit_rate"]


def test_block_size_sweep_refuses_hash_traces():
    with pytest.raises(ConfigError, match="expand_to_tokens"):
        block_size_sweep(_block_trace(), [8])


def test_hashing_throughput_table():
    w = expand_to_tokens(_block_trace())
    frame = hashing_throughput(w, ["xxh3_64", "sha256"], [1, 4], repeat=1)
    assert list(frame["scheme"]) == ["xxh3_64", "xxh3_64", "sha256", "sha256"]
    assert (frame["seconds"] > 0).all()
    np.testing.assert_allclose(frame["tokens_per_s"] * frame["seconds"], int(w.input_length.sum()))
    assert list(frame["keyed_blocks"][:2]) == [int((w.input_length // b).sum()) for b in (1, 4)]


def test_best_of():
    calls = []
    assert best_of(lambda: calls.append(1), 3) >= 0 and len(calls) == 3
    with pytest.raises(ConfigError):
        best_of(lambda: None, 0)


def test_truth_reuse_gives_the_same_counts():
    rng = np.random.default_rng(1)
    w = from_lists([rng.integers(0, 50, size=40) for _ in range(30)], kind="tokens")
    truth = encode_workload(w, truth_hasher(BlockHasher("xxh3_64")), 4)
    a = truncation_collisions(w, [6, 10], block_size=4)
    b = truncation_collisions(w, [6, 10], truth=truth)
    assert a.equals(b)
