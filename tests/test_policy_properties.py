"""Properties every registered eviction policy must keep, checked on generated schedules.

The policy list is read at test time (``available_policies()``), so a policy registered later (a new
file in kvlab/policies, a plugin) is covered without editing this file.

* Interleaved schedules drive a :class:`PrefixCache` directly: admissions of small chained-key prompts
  while others run, releases in random order, preemptions (a running request releases its blocks early
  and is admitted again later). After every step the block states must partition the pool, the policy
  must track exactly the evictable blocks, every ref count must equal the number of running requests
  holding the block, and ``victim()`` must never return a pinned (or unkeyed) block.
* Sequential replays never beat the infinite cache (``ideal_hit_tokens``), request by request.
* On object sequences Belady (OPT) hits at least as often as every other policy.
* Leaf-only policies (SGLang, PGDSF, the prefix-aware wrapper) never leave a cached block unreachable.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from _util import random_token_workload
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache import AccessContext, PrefixCache
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.policies import available_policies, make_policy
from kvlab.policies._heap import LeafHeapPolicy
from kvlab.policies.prefix_aware import PrefixAware
from kvlab.replay import replay
from kvlab.workload.objects import object_sequence


def policies() -> list[str]:
    """Every registered policy that can be built with its defaults.

    Only a wrapper whose inner policy is not registered (``prefix-aware-lfu`` while no ``lfu`` exists)
    is left out; any other construction error fails the test.
    """
    names = []
    for name in available_policies():
        try:
            make_policy(name)
        except ConfigError as exc:
            if "unknown policy" in str(exc) and name.startswith("prefix-aware-"):
                continue
            raise
        names.append(name)
    return names


# ---------------------------------------------------------------------- interleaved schedules


def leaf_only(policy: object) -> bool:
    """Policies that evict only blocks without cached children (they never create orphans)."""
    return isinstance(policy, LeafHeapPolicy | PrefixAware)


def chained_keys(tokens: list[int], block_size: int, ids: dict) -> list[int]:
    """Dense ids of the full blocks' chained keys (same prefix and block -> same id)."""
    keys: list[int] = []
    parent = -1
    for i in range(len(tokens) // block_size):
        parent = ids.setdefault((parent, tuple(tokens[i * block_size : (i + 1) * block_size])), len(ids))
        keys.append(parent)
    return keys


def make_schedule(seed: int, n_ops: int, block_size: int) -> tuple[list[tuple], list[tuple], int]:
    """Ops and the admission attempts they may make (the future Belady reads), planned up front.

    Ops: ``("admit", rid)``, ``("readmit", rid)`` (attempts, numbered in order), ``("release", rid)``,
    ``("preempt", rid)``. They are planned as if every admission succeeded; at run time an op on a
    request that is not in the expected state is skipped, so the attempt list never depends on the
    policy. Returns ``(ops, attempts, num_keys)``; an attempt is ``(rid, keys, prompt_tokens)``.
    """
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 3, size=int(rng.integers(0, 14))).tolist() for _ in range(4)]
    ids: dict = {}
    ops: list[tuple] = []
    attempts: list[tuple] = []
    prompts: dict[int, tuple[list[int], int]] = {}
    running: list[int] = []
    preempted: list[int] = []
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.45 or not (running or preempted):
            rid = len(prompts)
            stem = stems[int(rng.integers(len(stems)))][: int(rng.integers(0, 14))]
            tokens = stem + rng.integers(0, 3, size=int(rng.integers(1, 8))).tolist()
            prompts[rid] = (chained_keys(tokens, block_size, ids), len(tokens))
            ops.append(("admit", rid))
            attempts.append((rid, *prompts[rid]))
            running.append(rid)
        elif r < 0.75 and running:
            ops.append(("release", running.pop(int(rng.integers(len(running))))))
        elif r < 0.87 and running:
            rid = running.pop(int(rng.integers(len(running))))
            ops.append(("preempt", rid))
            preempted.append(rid)
        elif preempted:
            rid = preempted.pop(0)
            ops.append(("readmit", rid))
            attempts.append((rid, *prompts[rid]))
            running.append(rid)
    for rid in running:  # drain
        ops.append(("release", rid))
    return ops, attempts, len(ids)


def encoded_attempts(attempts: list[tuple], num_keys: int, block_size: int) -> EncodedWorkload:
    """The attempts as an EncodedWorkload: request ``seq`` = attempt ``seq`` (what ``prepare`` reads)."""
    counts = [len(a[1]) for a in attempts]
    prompt = np.array([a[2] for a in attempts], dtype=np.int64)
    return EncodedWorkload(
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        key_ids=np.array([k for a in attempts for k in a[1]], dtype=np.int64),
        num_keys=num_keys,
        prompt_tokens=prompt,
        num_blocks=-(-prompt // block_size),
        block_size=block_size,
        hash_label="test-dense",
    )


def check_state(cache: PrefixCache, running: dict[int, list]) -> None:
    held = Counter(b.block_id for blocks in running.values() for b in blocks)
    n_run = n_free = n_evictable = n_keyed = 0
    for b in cache.blocks:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != {held[b.block_id]} holders"
        n_keyed += b.key is not None
        if b.ref_cnt > 0:
            n_run += 1
        elif b.key is None:
            n_free += 1
        else:
            n_evictable += 1
    assert n_run + n_free + n_evictable == cache.capacity_blocks
    assert len(cache.policy) == n_evictable == cache.num_evictable_blocks
    assert cache.num_free_blocks == n_free + n_evictable
    assert cache.num_running_blocks == n_run
    assert cache.num_cached_blocks == n_keyed


def guard_victims(cache: PrefixCache) -> list[int]:
    """Wrap the policy's ``victim()``: a pinned or unkeyed victim fails at once. Returns the victim log."""
    policy, chosen = cache.policy, []
    original = policy.victim

    def checked():
        block = original()
        assert block.ref_cnt == 0, f"{policy.name}: victim {block.block_id} is pinned (ref {block.ref_cnt})"
        assert block.key is not None, f"{policy.name}: victim {block.block_id} holds no key"
        chosen.append(block.block_id)
        return block

    policy.victim = checked  # type: ignore[method-assign]
    return chosen


def run_interleaved(name: str, seed: int, capacity: int, block_size: int, n_ops: int) -> int:
    """Run one schedule on a fresh cache with policy ``name``; returns the number of evictions."""
    ops, attempts, num_keys = make_schedule(seed, n_ops, block_size)
    policy = make_policy(name)
    policy.prepare(encoded_attempts(attempts, num_keys, block_size))  # offline policies read the future
    cache = PrefixCache(capacity, policy, block_size=block_size)
    victims = guard_victims(cache)
    rng = np.random.default_rng(seed + 1)
    running: dict[int, list] = {}
    preempted: set[int] = set()
    ctxs: dict[int, AccessContext] = {}
    prompts = {a[0]: a for a in attempts}
    clock, seq = 0.0, 0
    for op, rid in ops:
        clock += float(rng.exponential(1.0))
        if op in ("admit", "readmit"):
            this_seq, seq = seq, seq + 1
            if op == "readmit" and rid not in preempted:
                continue
            preempted.discard(rid)
            _, keys, tokens = prompts[rid]
            ctx = AccessContext(time=clock, seq=this_seq, request_id=rid, prompt_tokens=tokens,
                                category="ab"[rid % 2], turn=1 + rid % 3, tenant=None)
            adm = cache.admit(keys, tokens, ctx)
            if adm is not None:
                running[rid] = adm.blocks
                ctxs[rid] = ctx
        elif rid in running:
            old = ctxs[rid]
            ctx = AccessContext(time=clock, seq=old.seq, request_id=rid, prompt_tokens=old.prompt_tokens,
                                category=old.category, turn=old.turn)
            cache.release(running.pop(rid), ctx)
            if op == "preempt":
                preempted.add(rid)
        check_state(cache, running)
        if leaf_only(policy):
            assert cache.num_orphan_blocks == 0, f"{name} orphaned a block"
    assert not running and cache.num_running_blocks == 0
    cache.reset()  # every cached key removed through on_remove
    assert len(cache.policy) == 0 and cache.num_cached_blocks == 0
    check_state(cache, running)
    return len(victims)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    capacity=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 3]),
    n_ops=st.integers(10, 90),
)
def test_interleaved_schedules_keep_every_invariant(seed, capacity, block_size, n_ops):
    for name in policies():
        run_interleaved(name, seed, capacity, block_size, n_ops)


def test_interleaved_schedules_do_evict():
    # the generator is not vacuous: a small cache evicts under every policy
    for name in policies():
        assert run_interleaved(name, 7, 6, 1, 120) > 0, name


# ---------------------------------------------------------------------- sequential replay


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 40), bs=st.sampled_from([1, 2, 4]),
       mode=st.sampled_from(["vllm", "ideal"]))
def test_sequential_replay_never_beats_the_infinite_cache(seed, capacity, bs, mode):
    w = random_token_workload(seed, n=60)
    for name in policies():
        req = replay(w, capacity_blocks=capacity, block_size=bs, policy=name, engine="python", mode=mode).requests
        assert (req["hit_tokens"] <= req["ideal_hit_tokens"]).all(), name
        assert (req["cached_blocks"] <= capacity).all(), name
        if leaf_only(make_policy(name)):
            assert req["orphan_blocks"].max() == 0 and req["orphan_evictions"].sum() == 0, name


# ---------------------------------------------------------------------- object sequences: OPT bounds all


def zipf_keys(seed: int, n: int, universe: int, a: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, universe + 1) ** a
    return rng.choice(universe, size=n, p=weights / weights.sum())


def object_hits(keys: np.ndarray, capacity: int, name: str) -> int:
    w = object_sequence(keys)
    r = replay(w, capacity_blocks=capacity, block_size=1, mode="ideal", policy=name, engine="python")
    return int(r.requests["hit_blocks"].sum())


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 30), universe=st.integers(5, 60),
       a=st.floats(0.5, 1.5))
def test_belady_bounds_every_policy_on_object_sequences(seed, capacity, universe, a):
    keys = zipf_keys(seed, 300, universe, a)
    opt = object_hits(keys, capacity, "belady")
    for name in policies():
        assert object_hits(keys, capacity, name) <= opt, name


@pytest.mark.parametrize("capacity", [4, 16])
def test_belady_is_strictly_better_somewhere(capacity):
    keys = zipf_keys(3, 2000, 100, 0.9)
    opt = object_hits(keys, capacity, "belady")
    assert opt > object_hits(keys, capacity, "lru")
