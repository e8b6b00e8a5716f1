"""The adapter that lets the Python core drive a policy's compiled hooks (kvlab.policies._adapter): any
hashable keys, a state that grows with the keys, hooks a subclass or a test overrides, refusal before
``attach``. (That both cores agree column for column is tested for every compiled policy in
test_policies_classic.py; that the interleaved core keeps every invariant, in test_policy_properties.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from _util import assert_twin_equal, random_token_workload

from kvlab.cache import AccessContext, PrefixCache
from kvlab.errors import ConfigError
from kvlab.policies import available_policies, make_cache, make_policy
from kvlab.policies._adapter import CompiledAdapter, grow_state, reads_argument
from kvlab.replay import ReplayConfig, encode

ADAPTED = [name for name in available_policies() if isinstance(make_policy(name), CompiledAdapter)]


def test_queue_policies_are_their_compiled_hooks():
    assert {"lru", "fifo", "clock", "sieve", "arc", "s3fifo", "2q", "slru", "wtinylfu"} <= set(ADAPTED)


def admissions(policy, requests: list[list], capacity: int) -> list[tuple]:
    """Admit and release ``requests`` (lists of keys, block size 1) in order; what each admission did."""
    cache = make_cache(capacity, policy, block_size=1)
    out = []
    for seq, keys in enumerate(requests):
        ctx = AccessContext(time=float(seq), seq=seq)
        adm = cache.admit(keys, len(keys), ctx, mode="ideal")
        if adm is None:
            out.append(None)
            continue
        out.append((adm.hit_blocks, adm.evictions, [b.block_id for b in adm.blocks], len(policy)))
        cache.release(adm.blocks, ctx)
    return out


def chained_requests(seed: int, n: int = 300) -> list[list[int]]:
    enc = encode(random_token_workload(seed, n=n), ReplayConfig(capacity_blocks=1, block_size=2))
    keys = enc.key_ids.tolist()
    return [keys[enc.offsets[r]:enc.offsets[r + 1]] for r in range(n) if enc.offsets[r + 1] > enc.offsets[r]]


@pytest.mark.parametrize("policy", ADAPTED)
def test_any_hashable_key(policy):
    requests = chained_requests(3)
    as_text = [[f"key-{k}" for k in keys] for keys in requests]
    as_tuples = [[(k % 7, str(k)) for k in keys] for keys in requests]
    want = admissions(make_policy(policy), requests, 13)
    assert sum(a[1] for a in want if a) > 50
    assert admissions(make_policy(policy), as_text, 13) == want
    assert admissions(make_policy(policy), as_tuples, 13) == want


@pytest.mark.parametrize("policy", ADAPTED)
def test_state_grows_with_the_keys(monkeypatch, policy):
    """With one key column to start with, the state grows many times; both cores still agree."""
    monkeypatch.setattr(CompiledAdapter, "initial_keys", 1)
    pol = make_policy(policy)
    PrefixCache(4, pol, block_size=1)
    assert pol._hooks["num_keys"]() == 8  # 2 x capacity
    admissions(pol, chained_requests(5), 4)
    c = pol.compiled
    keyed = any(reads_argument(h, "key") for h in (c.on_insert, c.on_hit, c.on_miss))
    assert (pol._hooks["num_keys"]() > 8) == keyed  # keys get ids only where a hook reads them
    w = random_token_workload(5, n=300)
    assert assert_twin_equal(w, ReplayConfig(capacity_blocks=6, block_size=2, policy=policy))["evictions"].sum() > 50


def test_growth_keeps_every_key_and_moves_list_sentinels(monkeypatch):
    monkeypatch.setattr(CompiledAdapter, "initial_keys", 1)
    pol = make_policy("arc")
    cache = PrefixCache(3, pol, block_size=1)
    start = pol._hooks["num_keys"]()
    keys = np.random.default_rng(0).zipf(1.3, 300) % 60  # 60 keys through 3 blocks: ghosts in B1 and B2
    for seq, key in enumerate(keys.tolist()):
        ctx = AccessContext(seq=seq)
        cache.release(cache.admit([key], 1, ctx, mode="ideal").blocks, ctx)
    assert pol._hooks["num_keys"]() > start
    B, K, M, F = pol.state
    n1, n2 = int(M[2]), int(M[3])
    assert n1 > 0 and n2 > 0 and K.shape[1] == pol._hooks["num_keys"]() + 2
    for sentinel, count in ((K.shape[1] - 2, n1), (K.shape[1] - 1, n2)):  # each ghost list walks back to its sentinel
        x, seen = K[0, sentinel], 0
        while x != sentinel:
            x, seen = K[0, x], seen + 1
        assert seen == count


def test_grow_state_copies_key_columns_along_their_axis():
    old = (np.arange(6).reshape(2, 3), np.ones(4), (np.full((3, 5), 7),))
    fresh = (np.zeros((2, 6), np.int64), np.zeros(4), (np.zeros((6, 5)),))
    new = grow_state(fresh, old, 3, 6)
    assert new[0].tolist() == [[0, 1, 2, 0, 0, 0], [3, 4, 5, 0, 0, 0]]
    assert new[1] is old[1]  # not per key: kept
    assert new[2][0][:3].tolist() == [[7] * 5] * 3 and new[2][0][3:].sum() == 0
    with pytest.raises(ConfigError, match="needs a grow hook"):
        grow_state((np.zeros(8),), (np.zeros(5),), 3, 6)  # key columns plus sentinels


def test_reads_argument():
    from kvlab.policies import arc, lru, sieve

    assert reads_argument(arc._on_insert, "key")
    assert not reads_argument(sieve._on_insert, "key")
    assert not reads_argument(lru._on_pin, "key")


def test_hooks_before_attach_refuse():
    pol = make_policy("s3fifo")
    assert len(pol) == 0
    with pytest.raises(ConfigError, match="attached to a PrefixCache"):
        pol.victim()


def test_a_subclass_override_and_an_instance_guard_are_called():
    calls = []

    class Counted(type(make_policy("arc"))):
        def victim(self):
            calls.append(1)
            return super().victim()

    requests = chained_requests(4)
    want = admissions(make_policy("arc"), requests, 9)
    assert admissions(Counted(), requests, 9) == want
    assert len(calls) == sum(a[1] for a in want if a) > 50

    pol, guarded = make_policy("arc"), []
    cache = PrefixCache(9, pol, block_size=1)
    inner = pol.victim
    pol.victim = lambda: guarded.append(1) or inner()  # as test_policy_properties guards victims
    for seq, keys in enumerate(requests):
        ctx = AccessContext(seq=seq)
        adm = cache.admit(keys, len(keys), ctx, mode="ideal")
        if adm is not None:
            cache.release(adm.blocks, ctx)
    assert len(guarded) == len(calls)
