"""Batched forward over the paged pool (kvlab.engine.batched, issue 13) on CPU with tiny random-weight models.

Oracle: :meth:`PagedModel.forward_tokens` run on each entry one at a time on a second pool. fp32 logits and
pool contents agree within 1e-5 x max(1, max |reference|) (measured <= 1.5e-5 on logits of magnitude ~15,
~1e-6 relative: the packed GEMMs and SDPA calls block the sums differently); greedy
tokens are identical. bf16: the agreement rate of greedy tokens is asserted >= 0.95 and max |Δlogit| printed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.engine import PagedModel, build_random_model
from kvlab.engine.batched import ATTN_NAME, BatchEntry, forward_batch, plan_batch
from kvlab.engine.verify import reference_prefill
from kvlab.errors import ConfigError

BS = 8
VOCAB = 1024
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_model("tiny-llama", seed=0)


def paged(model, blocks: int = 96) -> PagedModel:
    return PagedModel(model, capacity_blocks=blocks, block_size=BS, num_threads=1)


def table(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within ``ATOL x max(1, max |want|)`` (fp32 rounding scales with the magnitude; logits reach ~15)."""
    return (got - want).abs().max().item() <= ATOL * max(1.0, want.abs().max().item())


def check_pools(a: PagedModel, b: PagedModel) -> None:
    assert close(b.pool.data, a.pool.data), (a.pool.data - b.pool.data).abs().max()


# ---------------------------------------------------------------------- equality with forward_tokens
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_matches_forward_tokens(model, seed):
    rng = np.random.default_rng(seed)
    seq, bat = paged(model), paged(model)
    entries, kinds = [], []
    for i in range(int(rng.integers(3, 7))):
        blocks = table(8 * i + int(rng.integers(0, 2)), 7)  # disjoint tables of 7 blocks (56 positions)
        kind = ["prefill", "continue", "decode"][int(rng.integers(0, 3))]
        start = 0
        if kind != "prefill":  # earlier positions already in both pools
            start = int(rng.integers(1, 30))
            prefix = rng.integers(0, VOCAB, start)
            seq.forward_tokens(prefix, blocks, 0)
            bat.forward_tokens(prefix, blocks, 0)
        n = 1 if kind == "decode" else int(rng.integers(2, 20))
        entries.append(BatchEntry(blocks, start, rng.integers(0, VOCAB, n)))
        kinds.append(kind)
    order = rng.permutation(len(entries))
    entries = [entries[i] for i in order]
    times = {}
    out = bat.forward_batch(entries, all_logits=True, times=times)
    for e, got in zip(entries, out, strict=True):
        want = seq.forward_tokens(e.tokens, e.block_ids, e.start)[0]
        assert got.shape == (len(e.tokens), VOCAB)
        assert close(got[-1], want)
    check_pools(seq, bat)
    assert times["attn_calls"] == 4 and times["attn_masks"] == 0
    assert model.config._attn_implementation == "sdpa"  # restored


def test_last_logits_match_all_logits(model):
    rng = np.random.default_rng(5)
    entries = [BatchEntry(table(0, 3), 0, rng.integers(0, VOCAB, 17)), BatchEntry(table(3, 1), 0, [7])]
    a, b = paged(model), paged(model)
    last = a.forward_batch(entries)
    full = b.forward_batch(entries, all_logits=True)
    for x, y in zip(last, full, strict=True):
        assert x.shape == (VOCAB,) and close(x, y[-1])


def test_shared_prefix_blocks(model):
    """Two entries whose tables share two leading (hit) blocks, and one sharing one block, each continuing
    with its own tokens: equal to the uncached forward of the whole sequence."""
    rng = np.random.default_rng(3)
    doc = rng.integers(0, VOCAB, 2 * BS)
    bat = paged(model)
    bat.forward_tokens(doc, [0, 1], 0)
    tails = [rng.integers(0, VOCAB, n) for n in (5, 1, 11)]
    entries = [BatchEntry([0, 1, 10, 11], 2 * BS, tails[0]), BatchEntry([0, 1, 20], 2 * BS, tails[1]),
               BatchEntry([0, 30, 31], BS, tails[2])]
    full = [np.concatenate([doc, tails[0]]), np.concatenate([doc, tails[1]]), np.concatenate([doc[:BS], tails[2]])]
    out = bat.forward_batch(entries)
    for got, tokens in zip(out, full, strict=True):
        with torch.no_grad():
            want, _ = reference_prefill(model, torch.as_tensor(tokens))
        assert (got - want).abs().max().item() < 1e-4
    shared = bat.pool.data[[0, 1]].clone()
    bat.forward_batch([BatchEntry([0, 1, 10, 11], 2 * BS + 5, [1]), BatchEntry([0, 1, 20], 2 * BS + 1, [2])])
    assert torch.equal(bat.pool.data[[0, 1]], shared)  # shared blocks are read, never written


def test_a_block_written_in_the_batch_is_read_by_a_later_entry(model):
    """cache_at="schedule": entry 0 completes block 1 in this forward, entry 1 hits blocks 0-1 in the same
    forward (each layer writes every entry's K/V before any entry reads): equal to running them in turn."""
    rng = np.random.default_rng(7)
    doc = rng.integers(0, VOCAB, 2 * BS)
    tail = rng.integers(0, VOCAB, 3)
    seq = paged(model)
    seq.forward_tokens(doc[:BS], [0], 0)
    want0, _ = seq.forward_tokens(doc[BS:], [0, 1], BS)
    want1, _ = seq.forward_tokens(tail, [0, 1, 2], 2 * BS)
    bat = paged(model)
    bat.forward_tokens(doc[:BS], [0], 0)
    got0, got1 = bat.forward_batch([BatchEntry([0, 1], BS, doc[BS:]), BatchEntry([0, 1, 2], 2 * BS, tail)])
    assert close(got0, want0) and close(got1, want1)
    check_pools(seq, bat)


def test_greedy_decode_together_vs_one_by_one(model):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, int(n)) for n in rng.integers(3, 30, 6)]
    tables = [table(10 * i, 8) for i in range(len(prompts))]
    seq, bat = paged(model), paged(model)
    # one by one: the driver's way (a working cache per sequence)
    seq_tokens = []
    for p, t in zip(prompts, tables, strict=True):
        logits, cache = seq.forward_tokens(p, t, 0)
        toks = [int(logits.argmax())]
        for step in range(5):
            logits, cache = seq.forward_tokens([toks[-1]], t, len(p) + step, working=cache)
            toks.append(int(logits.argmax()))
        seq_tokens.append(toks)
    # together: batched prefill, then batched decode steps
    logits = bat.forward_batch([BatchEntry(t, 0, p) for p, t in zip(prompts, tables, strict=True)])
    bat_tokens = [[int(x.argmax())] for x in logits]
    for step in range(5):
        logits = bat.forward_batch([BatchEntry(t, len(p) + step, [toks[-1]])
                                    for p, t, toks in zip(prompts, tables, bat_tokens, strict=True)])
        for toks, x in zip(bat_tokens, logits, strict=True):
            toks.append(int(x.argmax()))
    assert bat_tokens == seq_tokens
    check_pools(seq, bat)


# ---------------------------------------------------------------------- no packed mask, memory per layer
def test_no_packed_mask(model, monkeypatch):
    """transformers passes no mask; each SDPA call sees its own entry's keys and at most an n x (start + n)
    mask; the per-layer gather is sum over entries of their block-rounded lengths (O(sum of lengths))."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[2], k.shape[2], None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    rng = np.random.default_rng(11)
    bat = paged(model)
    bat.forward_tokens(rng.integers(0, VOCAB, 20), table(0, 4), 0)
    entries = [BatchEntry(table(0, 4), 20, rng.integers(0, VOCAB, 6)),  # continue: 6 x 26 mask
               BatchEntry(table(4, 3), 0, rng.integers(0, VOCAB, 18)),  # from 0: is_causal, no mask
               BatchEntry(table(7, 1), 0, [3])]  # one token
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    times = {}
    bat.forward_batch(entries, times=times)
    assert times["attn_masks"] == 0
    assert calls == [(6, 26, (6, 26)), (18, 18, None), (1, 1, None)] * 4
    assert times["gather_tokens"] == (4 + 3 + 1) * BS


def test_attention_implementation_restored_on_error(model):
    bat = paged(model)
    with pytest.raises(IndexError):
        bat.forward_batch([BatchEntry([0], 0, [VOCAB + 5])])  # token id out of the vocabulary
    assert model.config._attn_implementation == "sdpa" != ATTN_NAME


# ---------------------------------------------------------------------- validation
def test_bad_batches_are_refused(model):
    pool = paged(model, blocks=8).pool.data
    with pytest.raises(ConfigError, match="at least one"):
        plan_batch([], pool, BS)
    with pytest.raises(ConfigError, match="no tokens"):
        plan_batch([BatchEntry([0], 0, [])], pool, BS)
    with pytest.raises(ConfigError, match="cannot hold"):
        plan_batch([BatchEntry([0], 5, [1, 2, 3, 4])], pool, BS)
    with pytest.raises(ConfigError, match="block ids"):
        plan_batch([BatchEntry([8], 0, [1])], pool, BS)
    with pytest.raises(ConfigError, match="written by batch entries"):
        plan_batch([BatchEntry([0], 0, [1]), BatchEntry([0], 1, [2])], pool, BS)
    with pytest.raises(ConfigError, match="AdapterSet"):
        forward_batch(paged(model, blocks=8), [BatchEntry([0], 0, [1])], adapter="x")


# ---------------------------------------------------------------------- bf16
def test_bf16_agreement(capsys):
    model = build_random_model("tiny-llama", seed=1, dtype="bfloat16")
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, VOCAB, int(n)) for n in rng.integers(4, 40, 8)]
    tables = [table(10 * i, 8) for i in range(len(prompts))]
    seq, bat = paged(model), paged(model)
    steps, agree, total, max_diff = 6, 0, 0, 0.0
    logits = bat.forward_batch([BatchEntry(t, 0, p) for p, t in zip(prompts, tables, strict=True)])
    ref = [seq.forward_tokens(p, t, 0)[0] for p, t in zip(prompts, tables, strict=True)]
    for step in range(steps + 1):
        for i, (x, y) in enumerate(zip(logits, ref, strict=True)):
            max_diff = max(max_diff, (x.float() - y.float()).abs().max().item())
            agree += int(x.argmax()) == int(y.argmax())
            total += 1
            prompts[i] = np.append(prompts[i], int(y.argmax()))  # both follow the sequential tokens
        if step == steps:
            break
        pos = [len(p) - 1 for p in prompts]
        logits = bat.forward_batch([BatchEntry(t, s, p[-1:]) for p, t, s in zip(prompts, tables, pos, strict=True)])
        ref = [seq.forward_tokens(p[-1:], t, s)[0] for p, t, s in zip(prompts, tables, pos, strict=True)]
    with capsys.disabled():
        print(f"\nbf16 batched vs sequential: greedy agreement {agree}/{total} = {agree / total:.3f}, "
              f"max |dlogit| {max_diff:.4f}")
    assert agree / total >= 0.95


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-gpt2"])
def test_other_architectures(shape):
    """Any model whose attention goes through transformers' AttentionInterface and has ``layer_idx``."""
    model = build_random_model(shape, seed=0)
    rng = np.random.default_rng(17)
    seq, bat = paged(model, blocks=32), paged(model, blocks=32)
    prefix = rng.integers(0, VOCAB, 10)
    for pm in (seq, bat):
        pm.forward_tokens(prefix, table(0, 4), 0)
    entries = [BatchEntry(table(0, 4), 10, rng.integers(0, VOCAB, 9)), BatchEntry(table(10, 2), 0,
               rng.integers(0, VOCAB, 13)), BatchEntry(table(20, 1), 0, [4])]
    out = bat.forward_batch(entries)
    for e, got in zip(entries, out, strict=True):
        assert close(got, seq.forward_tokens(e.tokens, e.block_ids, e.start)[0])
    check_pools(seq, bat)
