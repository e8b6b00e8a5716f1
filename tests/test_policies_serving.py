"""Behaviour of the serving-system and research policies where the right victim is clear.

Each test builds a tiny cache state by hand (``block_size=1``, ``mode="ideal"``: a prompt of n tokens is
n keyed blocks, chained) and checks which block the policy gives up next. Belady is also checked hit
for hit against libCacheSim's Belady, and the workload-aware policy against a brute-force evaluation
of the paper's Figure 24 on the Alibaba sample.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _util import write_oracle_general

from kvlab.cache import AccessContext, KVBlock, PrefixCache
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.policies import EvictionPolicy, make_cache, make_policy
from kvlab.policies.belady import NEVER, next_use
from kvlab.policies.prefix_aware import prefix_aware
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.workload.alibaba import load_alibaba
from kvlab.workload.objects import object_sequence
from kvlab.workload.workload import from_lists


def keys_of(tokens: list[int]) -> list[tuple]:
    """Chained keys of a block-size-1 prompt: key i names the whole prefix tokens[:i + 1]."""
    out: list[tuple] = []
    for t in tokens:
        out.append((out[-1] if out else None, t))
    return out


def key(tokens: list[int]) -> tuple:
    """The key of a prompt's last block."""
    return keys_of(tokens)[-1]


class Driver:
    """A PrefixCache plus a clock: ``run`` admits and releases a prompt; ``start``/``finish`` split it."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy, **params: object) -> None:
        self.cache = make_cache(capacity, policy, block_size=1, policy_params=params or None)
        self.seq = 0
        self.victims: list[tuple] = []  # keys given up, in order
        policy_obj, original = self.cache.policy, self.cache.policy.victim

        def logged() -> KVBlock:
            block = original()
            self.victims.append(block.key)
            return block

        policy_obj.victim = logged  # type: ignore[method-assign]

    def ctx(self, time: float, **kw: object) -> AccessContext:
        c = AccessContext(time=time, seq=self.seq, request_id=self.seq, **kw)  # type: ignore[arg-type]
        self.seq += 1
        return c

    def start(self, tokens: list[int], time: float = 0.0, **kw: object):
        ctx = self.ctx(time, prompt_tokens=len(tokens), **kw)
        adm = self.cache.admit(keys_of(tokens), len(tokens), ctx, mode="ideal")
        assert adm is not None
        return adm, ctx

    def finish(self, started, time: float | None = None) -> None:
        adm, ctx = started
        if time is not None:
            ctx = AccessContext(time=time, seq=ctx.seq, request_id=ctx.request_id, category=ctx.category,
                                turn=ctx.turn, prompt_tokens=ctx.prompt_tokens)
        self.cache.release(adm.blocks, ctx)

    def run(self, tokens: list[int], time: float = 0.0, **kw: object) -> int:
        started = self.start(tokens, time, **kw)
        self.finish(started)
        return started[0].hit_blocks

    def cached(self, tokens: list[int]) -> bool:
        return keys_of(tokens)[-1] in self.cache


# ---------------------------------------------------------------------- GDSF


def test_gdsf_evicts_the_cheapest_block_first_and_ages_with_its_clock():
    d = Driver(3, "gdsf")
    d.run([1, 2, 3])  # positions 0, 1, 2: cost grows with position, frequency 1 each
    d.run([9])
    assert d.victims == [key([1])]  # the cheapest (first) block goes; GDSF is not prefix-aware
    pol = d.cache.policy
    assert pol.clock == pytest.approx(1 + pol.attention_ratio * 1)  # H of the victim: L=0 + cost(0)
    # frequency counts: a block hit twice outlives a colder, costlier one
    d2 = Driver(3, "gdsf", attention_ratio=0.0)  # constant cost: GDSF = LFU with aging
    d2.run([1])
    d2.run([1])
    d2.run([2])
    d2.run([3])
    d2.run([4])
    assert d2.victims == [key([2])]


def test_gdsf_rejects_a_negative_attention_ratio():
    with pytest.raises(ConfigError):
        make_policy("gdsf", attention_ratio=-1)


# ---------------------------------------------------------------------- PGDSF


def test_pgdsf_evicts_only_leaves_and_keeps_key_frequency_across_eviction():
    d = Driver(3, "pgdsf")
    d.run([1, 2, 3])
    d.run([9])
    assert d.victims == [key([1, 2, 3])]  # the leaf, although the head is the cheapest
    d.run([8])
    assert d.victims[-1] in (key([9]), key([1, 2]))
    assert d.cache.num_orphan_blocks == 0
    pol = d.cache.policy
    stats = pol._stats[key([1, 2, 3])]
    assert stats[0] == 1  # one use of key (1, 2, 3) so far; it stays after its eviction
    d.run([1, 2, 3])
    assert pol._stats[key([1, 2, 3])][0] == 2


def test_pgdsf_cost_depends_on_the_cached_prefix():
    pol = make_policy("pgdsf", attention_ratio=0.01)
    # computing 4 tokens after 0 cached costs less per token than after 100 cached
    assert pol.span_cost(0, 4) < pol.span_cost(100, 4)
    assert pol.span_cost(0, 4) == pytest.approx(1 + 0.01 * 2.5)


# ---------------------------------------------------------------------- SGLang leaf LRU


def test_sglang_leaf_evicts_leaves_by_last_access_not_by_release():
    d = Driver(4, "sglang-leaf")
    a = d.start([1, 2], time=0.0)  # accessed first
    b = d.start([5, 6], time=1.0)  # accessed second, released first
    d.finish(b)
    d.finish(a)
    d.run([9], time=2.0)
    assert d.victims == [key([1, 2])]  # least recently *accessed* leaf; vLLM's LRU would give up (5, 6)
    lru = Driver(4, "lru")
    a = lru.start([1, 2])
    b = lru.start([5, 6])
    lru.finish(b)
    lru.finish(a)
    lru.run([9])
    assert lru.victims == [key([5, 6])]


def test_sglang_leaf_frees_a_chain_tail_first_and_never_orphans():
    d = Driver(3, "sglang-leaf")
    d.run([1, 2, 3])
    d.run([7, 8])
    assert d.victims == [key([1, 2, 3]), key([1, 2])]
    assert d.cache.num_orphan_blocks == 0 and d.cache.stats.orphan_evictions == 0


# ---------------------------------------------------------------------- Mooncake LengthAwareCache


def test_length_aware_is_lfu_first_then_later_positions():
    d = Driver(3, "length-aware")
    d.run([1])  # released first: LFU with LRU ties would give it up
    d.run([5, 6])
    d.run([9])
    assert d.victims == [key([5, 6])]  # equal frequency: the later position goes first
    d2 = Driver(3, "length-aware")
    d2.run([5, 6])
    d2.run([5, 6])  # frequency 2
    d2.run([1])
    d2.run([9])
    assert d2.victims == [key([1])]  # the lower frequency goes first, position 0 or not


# ---------------------------------------------------------------------- TensorRT-LLM priorities


def fake_access(policy: EvictionPolicy, block: KVBlock, key: object, position: int, ctx: AccessContext,
                hit: bool = False) -> None:
    """Drive a policy's hooks for one block used by one request (insert or hit, then release)."""
    if not hit:
        block.key, block.position = key, position
        policy.on_insert(block, ctx)
    else:
        policy.on_hit(block, ctx)
        policy.on_pin(block, ctx)
    policy.on_unpin(block, ctx)


def test_trtllm_lowest_priority_first_lru_within_a_priority():
    d = Driver(4, "trtllm-priority", priorities=[(0, 1, 90)])  # the first block is a "system prompt"
    d.run([1, 2])  # (1,) at 90, (1, 2) at 35
    d.run([5, 6])  # (5,) at 90, (5, 6) at 35
    d.run([8, 9])
    assert d.victims == [key([1, 2]), key([5, 6])]  # both default blocks, oldest first
    d.run([3])
    assert d.victims[-1] == key([8, 9])  # the last default block
    d.run([4])
    assert d.victims[-1] == key([1])  # then LRU among the 90s: (1,) before (5,), (8,) and (3,)


def test_trtllm_expired_priority_falls_to_default_at_the_back():
    pol = make_policy("trtllm-priority", by_category={"sys": [(0, None, 90, 5.0)]})
    cache = PrefixCache(4, pol, block_size=1)
    a, b, c = cache.blocks[:3]
    fake_access(pol, a, "a", 0, AccessContext(time=0.0, category="sys"))  # 90 until t = 5
    fake_access(pol, b, "b", 0, AccessContext(time=1.0, category="user"))  # 35
    fake_access(pol, c, "c", 0, AccessContext(time=2.0, category="sys"))  # 90 until t = 7
    assert pol.victim() is b
    pol.on_evict(b)
    assert pol.victim() is a  # no default block left: LRU among the 90s
    pol.on_hit(c, AccessContext(time=6.0, category="user"))  # a hit without a range: keeps 90, drops expiry
    pol.on_pin(c, AccessContext(time=6.0))
    pol.on_unpin(c, AccessContext(time=6.0, category="user"))
    assert pol.victim() is a  # t = 6: a (expired at 5) is at default 35 now, c stays at 90
    assert pol._prio[a.block_id] == 35 and pol._prio[c.block_id] == 90


def test_trtllm_rejects_bad_ranges():
    with pytest.raises(ConfigError):
        make_policy("trtllm-priority", priorities=[(0, 4, 101)])
    with pytest.raises(ConfigError):
        make_policy("trtllm-priority", priorities=[(4, 2, 50)])
    with pytest.raises(ConfigError):
        make_policy("trtllm-priority", default=-1)


# ---------------------------------------------------------------------- TTL


def test_ttl_evicts_expired_blocks_first_else_lru():
    pol = make_policy("ttl", ttl_s=1000.0, by_category={"short": 10.0})
    cache = PrefixCache(4, pol, block_size=1)
    old, new = cache.blocks[:2]
    fake_access(pol, old, "old", 0, AccessContext(time=0.0, category="long"))  # expires at 1000
    fake_access(pol, new, "new", 0, AccessContext(time=1.0, category="short"))  # expires at 11
    assert pol.victim() is old  # t = 1: nothing expired, LRU
    pol.on_insert(cache.blocks[2], AccessContext(time=20.0))  # the clock moves on
    assert pol.victim() is new  # t = 20: the short-lived block expired


def test_ttl_with_one_ttl_is_lru():
    w = from_lists([[i % 7, i % 3, i % 5, i] for i in range(60)], arrival=np.arange(60, dtype=float))
    a = replay(w, capacity_blocks=6, block_size=1, policy="ttl", engine="python").requests
    b = replay(w, capacity_blocks=6, block_size=1, policy="lru", engine="python").requests
    assert a["hit_blocks"].tolist() == b["hit_blocks"].tolist()


# ---------------------------------------------------------------------- prefix-aware wrapper


def test_prefix_aware_wraps_any_policy_and_evicts_leaves_only():
    plain = Driver(3, "mru")
    plain.run([1, 2, 3])
    plain.run([9])
    assert plain.victims == [key([1])]  # MRU gives up the head: (1, 2) is orphaned, (1, 2, 3) unreachable
    assert plain.cache.num_orphan_blocks == 1
    wrapped = Driver(3, prefix_aware("mru"))
    wrapped.run([1, 2, 3])
    wrapped.run([7, 8, 9])
    assert wrapped.victims == [key([1, 2, 3]), key([1, 2]), key([1])]
    assert wrapped.cache.num_orphan_blocks == 0
    assert len(wrapped.cache.policy) == 3 and wrapped.cache.num_running_blocks == 0  # (7,), (7, 8), (7, 8, 9)


def test_prefix_aware_by_name_with_params():
    pol = make_policy("prefix-aware", inner="trtllm-priority", inner_params={"priorities": [(0, 1, 90)]})
    assert pol.inner.name == "trtllm-priority" and pol.inner.ranges[0][2] == 90
    assert make_policy("prefix-aware-lru").inner.name == "lru"


def test_prefix_aware_lfu_when_lfu_exists():
    try:
        pol = make_policy("prefix-aware-lfu")
    except ConfigError:
        pytest.skip("no 'lfu' policy registered")
    d = Driver(4, pol)
    for _ in range(3):
        d.run([1, 2])  # (1,) and (1, 2) at frequency 3
    d.run([5])
    d.run([6, 7, 8])
    assert d.victims == [key([5]), key([1, 2])]  # never (1,) while its child (1, 2) is cached
    assert d.cache.num_orphan_blocks == 0


# ---------------------------------------------------------------------- Belady vs libCacheSim


@pytest.mark.parametrize("capacity", [2, 10, 40])
def test_belady_matches_libcachesim_hit_for_hit(tmp_path, capacity):
    lcs = pytest.importorskip("libcachesim")
    rng = np.random.default_rng(capacity)
    weights = 1.0 / np.arange(1, 201) ** 0.9
    keys = rng.choice(200, size=4000, p=weights / weights.sum())
    path = tmp_path / "zipf.oracleGeneral.bin"
    write_oracle_general(path, keys)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    ref = lcs.Belady(cache_size=capacity)
    theirs = np.array([ref.get(req) for req in reader])
    ours = replay(object_sequence(keys), capacity_blocks=capacity, block_size=1, mode="ideal", policy="belady",
                  engine="python").requests["hit_blocks"].to_numpy() > 0
    assert len(theirs) == len(keys)
    np.testing.assert_array_equal(ours, theirs)
    assert 0 < ours.sum() < len(keys)


def test_belady_tie_breaks_differ_from_libcachesim_only_among_keys_never_used_again(tmp_path):
    # Ties exist only between keys with no future use; we give up the least recently unpinned,
    # libCacheSim its heap order. The cached sets may differ, but only in such dead keys.
    lcs = pytest.importorskip("libcachesim")
    rng = np.random.default_rng(5)
    weights = 1.0 / np.arange(1, 61) ** 0.8
    keys = rng.choice(60, size=1500, p=weights / weights.sum())
    n = len(keys)
    path = tmp_path / "ties.bin"
    write_oracle_general(path, keys)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    ref = lcs.Belady(cache_size=20)
    pol = make_policy("belady")
    pol.prepare(EncodedWorkload(offsets=np.arange(n + 1), key_ids=keys, num_keys=60, prompt_tokens=np.ones(n, int),
                                num_blocks=np.ones(n, int), block_size=1, hash_label="objects"))
    cache = PrefixCache(20, pol, block_size=1)
    nxt_pos = {}  # key -> next access index after the current one
    future = next_use(np.arange(n + 1), keys)
    differ = 0
    for i, req in enumerate(reader):
        hit_theirs = ref.get(req)
        ctx = AccessContext(time=float(i), seq=i)
        adm = cache.admit([int(keys[i])], 1, ctx, mode="ideal")
        cache.release(adm.blocks, ctx)
        assert (adm.hit_blocks == 1) == hit_theirs
        nxt_pos[int(keys[i])] = int(future[i])
        ours = {b.key for b in cache.blocks if b.key is not None}
        probe = lcs.Request()
        probe.obj_size = 1
        theirs = set()
        for k in range(60):
            probe.obj_id = k + 1
            if ref.find(probe, False) is not None:
                theirs.add(k)
        for k in ours ^ theirs:
            assert nxt_pos[k] == NEVER, f"step {i}: key {k} differs but is used again"
        differ += ours != theirs
    assert differ > 0  # the tie-breaks really differ on this trace


def test_belady_needs_the_future():
    d = make_cache(2, "belady", block_size=1)
    with pytest.raises(ConfigError, match="prepare"):
        d.admit([0], 1, AccessContext(seq=0), mode="ideal")


def test_belady_moves_past_uses_the_cache_never_looked_up():
    # key 5 is in request 1, but request 1's lookup never reaches it (on a prefix trace: an earlier
    # block missed). Once request 2 has started, key 5's next use is request 4, not the past request 1.
    offsets, key_ids = [0, 2, 3, 4, 5, 6], [5, 6, 5, 7, 6, 5]  # requests: [5, 6] [5] [7] [6] [5]
    pol = make_policy("belady")
    pol.prepare(EncodedWorkload(offsets=np.array(offsets), key_ids=np.array(key_ids), num_keys=8,
                                prompt_tokens=np.ones(5, int), num_blocks=np.ones(5, int), block_size=1,
                                hash_label="dense"))
    cache = PrefixCache(4, pol, block_size=1)
    x, y, z = cache.blocks[:3]
    fake_access(pol, x, 5, 0, AccessContext(seq=0))
    fake_access(pol, y, 6, 1, AccessContext(seq=0))
    assert pol.victim() is y  # key 6 next at request 3, key 5 at request 1
    z.key, z.position = 7, 0
    pol.on_insert(z, AccessContext(seq=2))  # request 2 starts; z stays pinned
    assert pol.victim() is x  # key 5 now next at request 4: farther than key 6 (request 3)


# ---------------------------------------------------------------------- workload-aware (ATC'25)


def test_workload_aware_evicts_the_category_unlikely_to_come_back_within_life():
    # category A reuses its block every 1 s, B every 100 s; with a 10 s lifespan window, at equal age
    # B's reuse within the window is unlikely: B goes first. Later, A idle for 5 s (5 mean reuse
    # times) is the less likely one: A goes first. A third block (9,) of category C is hit by the
    # request that needs the room, so the policy sees the new time before it chooses.
    def build() -> Driver:
        d = Driver(3, "workload-aware", life_s=10.0, min_samples=2)
        for t in (0.0, 100.0):
            d.run([2], time=t, category="B")
        for t in range(190, 200):
            d.run([1], time=float(t), category="A")
        d.run([2], time=200.0, category="B")
        d.run([1], time=200.0, category="A")
        d.run([9], time=200.0, category="C")
        return d

    d = build()
    pol = d.cache.policy
    rate_a, _ = pol.fit(pol.categories[("A", -1)])
    rate_b, _ = pol.fit(pol.categories[("B", -1)])
    assert rate_a == pytest.approx(1.0) and rate_b == pytest.approx(0.01)
    d.run([9, 3], time=200.5, category="C")
    assert d.victims == [key([2])]
    d2 = build()
    d2.run([9, 4], time=205.0, category="C")
    assert d2.victims == [key([1])]


def test_workload_aware_offset_breaks_ties_and_falls_back_to_lru():
    d = Driver(3, "workload-aware")  # no samples: one default fit, pure age then offset
    d.run([1, 2], time=0.0)
    d.run([5], time=0.0)
    d.run([7], time=1.0)
    assert d.victims == [key([1, 2])]  # same age as (1,) and (5,), larger offset
    d.run([8], time=2.0)
    assert d.victims[-1] in (key([1]), key([5]))


def brute_force_victim(policy, cache: PrefixCache) -> tuple[float, int]:
    """The paper's Figure 24: scan every evictable block, lowest (ReuseProb, -offset)."""
    return min(policy.priority(b) for b in cache.blocks if b.ref_cnt == 0 and b.key is not None)


def test_workload_aware_on_the_alibaba_sample_matches_the_papers_full_scan(shared_file):
    w = load_alibaba(shared_file("alibaba/sample_traceA_multiturn_20.jsonl"))
    capacity = 160  # every request fits (the longest has 121 blocks); about 1,200 blocks are computed
    enc = encode(w, ReplayConfig(capacity_blocks=capacity))
    pol = make_policy("workload-aware", min_samples=1)
    cache = PrefixCache(capacity, pol, block_size=enc.block_size)
    original, checked = pol.victim, []

    def victim():
        block = original()
        assert pol.priority(block) == pytest.approx(brute_force_victim(pol, cache))
        checked.append(block.block_id)
        return block

    pol.victim = victim
    cats = [str(c) for c in w.category]
    for r in range(len(w)):
        ctx = AccessContext(time=float(w.arrival[r]), seq=r, request_id=int(w.request_id[r]), category=cats[r],
                            turn=int(w.turn[r]), prompt_tokens=int(enc.prompt_tokens[r]))
        adm = cache.admit(enc.keys(r).tolist(), int(enc.prompt_tokens[r]), ctx)
        if adm is not None:
            cache.release(adm.blocks, ctx)
    assert len(checked) > 50
    assert set(pol.categories) == {(c, int(t)) for c, t in zip(cats, w.turn, strict=True)}
    # turn-2+ requests reuse their parent's prefix: reuse times were sampled for the parents' categories
    assert len(pol.categories[("text", 1)].samples) > 0
    rate, logp = pol.fit(pol.categories[("text", 1)])
    assert rate > 0 and math.isfinite(logp)
    # and the replay of the same sample never beats the infinite cache
    req = replay(w, capacity_blocks=capacity, policy="workload-aware", engine="python").requests
    assert (req["hit_tokens"] <= req["ideal_hit_tokens"]).all()


# ---------------------------------------------------------------------- exact order of the heap policies


def heap_order_key(policy, block: KVBlock) -> tuple:
    """The documented order of a heap policy for one evictable block: ``(priority, unpin stamp)``."""
    bid = block.block_id
    name = policy.name
    if name in ("gdsf", "pgdsf"):
        prio = policy._prio[bid]
    elif name == "sglang-leaf":
        prio = policy._last[bid]
    elif name == "length-aware":
        prio = (policy._freq[bid] << 32) | ((1 << 31) - 1 - block.position)
    else:
        raise AssertionError(name)
    return prio, policy._stamp[bid]


@pytest.mark.parametrize("name", ["gdsf", "pgdsf", "sglang-leaf", "length-aware"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heap_policies_pick_the_documented_minimum(name, seed):
    # random concurrent requests over shared stems (vLLM counting mode: duplicates happen); every victim
    # must be the minimum of a brute-force scan (among leaves for the leaf-only policies)
    rng = np.random.default_rng(seed)
    d = Driver(12, name)
    cache, pol = d.cache, d.cache.policy
    leaf_only = name in ("pgdsf", "sglang-leaf")
    original = pol.victim

    def checked():
        block = original()
        evictable = [b for b in cache.blocks if b.ref_cnt == 0 and b.key is not None]
        leaves = [b for b in evictable if cache.num_cached_children(b.key) == 0]
        pool = leaves if leaf_only and leaves else evictable
        assert heap_order_key(pol, block) == min(heap_order_key(pol, b) for b in pool)
        return block

    pol.victim = checked
    stems = [rng.integers(0, 3, size=6).tolist() for _ in range(3)]
    running = []
    for step in range(400):
        if running and (len(running) > 2 or rng.random() < 0.5):
            d.finish(running.pop(int(rng.integers(len(running)))), time=float(step))
            continue
        tokens = stems[int(rng.integers(3))][: int(rng.integers(1, 7))] + rng.integers(0, 3, size=2).tolist()
        ctx = d.ctx(float(step), prompt_tokens=len(tokens))
        adm = cache.admit(keys_of(tokens), len(tokens), ctx)  # vllm mode: the last block is recomputed
        if adm is not None:
            running.append((adm, ctx))
    assert cache.stats.evictions > 50
