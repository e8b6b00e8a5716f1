"""Expansion of block-id traces into token traces: determinism, sharing, partial blocks, memory layout."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import kvlab.workload.expand as expand_mod
from kvlab.errors import ConfigError
from kvlab.workload import block_tokens, expand_to_tokens, from_lists, load_mooncake, zipf_blocks


def small_blocks():
    # Chained ids: requests 0 and 1 share blocks 10, 11; request 2 reuses id 11 as a partial last block.
    return from_lists(
        [[10, 11, 12], [10, 11, 13, 14], [10, 11], [], [15]],
        kind="blocks",
        block_size=4,
        input_length=[12, 14, 7, 0, 1],
        arrival=[0.0, 1.0, 2.0, 3.0, 4.0],
        output_length=[1, 2, 3, 4, 5],
        session=[0, 0, 1, -1, 2],
        turn=[1, 2, 1, -1, 1],
        parent=[-1, 0, -1, -1, -1],
        category=pd.Categorical(["a", "a", "b", "b", "a"]),
    )


def test_expansion_invariants():
    w = small_blocks()
    e = expand_to_tokens(w, seed=3, vocab_size=500, vocab_offset=10)
    assert e.kind == "tokens" and e.block_size is None
    np.testing.assert_array_equal(e.input_length, w.input_length)
    np.testing.assert_array_equal(np.diff(e.prompt_offsets), w.input_length)
    bt = {
        i: row
        for i, row in zip(
            [10, 11, 12, 13, 14, 15],
            block_tokens([10, 11, 12, 13, 14, 15], 4, seed=3, vocab_size=500, vocab_offset=10),
            strict=True,
        )
    }
    for i in range(len(w)):
        ids = w.prompt(i)
        expect = np.concatenate([bt[int(b)] for b in ids]) if len(ids) else np.zeros(0, np.int64)
        np.testing.assert_array_equal(e.prompt(i), expect[: w.input_length[i]])
    # Shared ids → shared tokens; the partial last block is the prefix of its id's block.
    np.testing.assert_array_equal(e.prompt(0)[:8], e.prompt(1)[:8])
    np.testing.assert_array_equal(e.prompt(2)[4:7], bt[11][:3])
    assert not np.array_equal(e.prompt(0)[8:12], e.prompt(1)[8:12])
    assert e.prompt_values.min() >= 10 and e.prompt_values.max() < 500
    for f in ("arrival", "output_length", "session", "turn", "parent", "request_id"):
        np.testing.assert_array_equal(getattr(e, f), getattr(w, f))
    assert e.category.tolist() == w.category.tolist()
    assert e.meta["expanded"] == {"from_block_size": 4, "seed": 3, "vocab_size": 500, "vocab_offset": 10}


def test_expansion_deterministic_and_seeded():
    w = zipf_blocks(300, seed=5)
    a, b = expand_to_tokens(w), expand_to_tokens(w)
    np.testing.assert_array_equal(a.prompt_values, b.prompt_values)
    c = expand_to_tokens(w, seed=1)
    assert np.mean(a.prompt_values == c.prompt_values) < 0.01


def test_distinct_ids_give_distinct_uniform_blocks():
    ids = np.arange(20_000)
    m = block_tokens(ids, 16, vocab_size=32000, vocab_offset=1000)
    assert m.shape == (20_000, 16)
    assert len(np.unique(m, axis=0)) == 20_000
    assert len(np.unique(m[:, :2], axis=0)) > 19_990  # even 2-token prefixes almost never collide
    counts = np.bincount(m.ravel() - 1000, minlength=31000)
    expected = m.size / 31000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 31000 * 1.1  # dof ~31,000: a uniform map gives ~31,000 ± 250
    # Large and negative-looking ids are fine too (ids are hashed as uint64).
    big = block_tokens([2**62, 2**63 - 1], 8)
    assert big.shape == (2, 8) and not np.array_equal(big[0], big[1])


def test_chunking_does_not_change_tokens(monkeypatch):
    w = zipf_blocks(200, seed=2, block_size=7)
    ref = expand_to_tokens(w)
    monkeypatch.setattr(expand_mod, "_CHUNK_TOKENS", 5)  # one block per chunk
    np.testing.assert_array_equal(expand_to_tokens(w).prompt_values, ref.prompt_values)
    monkeypatch.setattr(expand_mod, "_CHUNK_TOKENS", 100)
    np.testing.assert_array_equal(expand_to_tokens(w).prompt_values, ref.prompt_values)


def test_head_then_expand_equals_expand_then_head():
    w = zipf_blocks(100, seed=4)
    a = expand_to_tokens(w.head(30))
    b = expand_to_tokens(w).head(30)
    c = expand_to_tokens(w, max_requests=30)
    np.testing.assert_array_equal(a.prompt_values, b.prompt_values)
    np.testing.assert_array_equal(c.prompt_values, b.prompt_values)
    assert len(c) == 30


def test_expansion_rejects_bad_input():
    with pytest.raises(ConfigError):
        expand_to_tokens(from_lists([[1, 2]]))
    with pytest.raises(ConfigError):
        expand_to_tokens(small_blocks(), vocab_size=10, vocab_offset=10)
    with pytest.raises(ConfigError):
        block_tokens([1], 4, vocab_size=2**33)


def test_empty_workload():
    e = expand_to_tokens(from_lists([], kind="blocks", block_size=16))
    assert len(e) == 0 and e.prompt_values.size == 0


@pytest.mark.shared
def test_expand_mooncake_prefix(shared_file):
    w = load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(200)
    e = expand_to_tokens(w)
    assert e.prompt_values.size == int(w.input_length.sum())
    # Every conversation request starts with block 0 (the shared system prompt): identical 512 tokens.
    first = block_tokens([0], 512)[0]
    for i in range(0, 200, 37):
        np.testing.assert_array_equal(e.prompt(i)[:512], first)
    # Two requests share exactly as many leading tokens as their common leading block ids x 512
    # (or the shorter prompt's length).
    for i, j in [(0, 1), (5, 9), (17, 120)]:
        a, b = w.prompt(i), w.prompt(j)
        k = int(np.argmin(np.append(a[: min(len(a), len(b))] == b[: min(len(a), len(b))], False)))
        ta, tb = e.prompt(i), e.prompt(j)
        n = min(len(ta), len(tb))
        shared = int(np.argmin(np.append(ta[:n] == tb[:n], False)))
        assert shared >= min(k * 512, n) and shared < min(k * 512, n) + 3
