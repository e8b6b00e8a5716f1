"""Tiered storage in the Python core (kvlab.tiers): the invariants of docs/tiers.md, on sequential replays and
interleaved schedules through the KV manager, for random tier configurations."""

from __future__ import annotations

import numpy as np
import pytest
from _util import conversation_workload, random_token_workload
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache import PrefixCache
from kvlab.cache.context import AccessContext
from kvlab.cache.manager import KVCacheManager, KVRequest
from kvlab.errors import ConfigError
from kvlab.policies import available_policies, make_cache, make_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.tiers import Tier, TierStack, parse_tier

COLUMNS = ["hit_blocks", "hit_tokens", "new_blocks", "evictions", "orphan_evictions", "admitted", "cached_blocks",
           "orphan_blocks"]


def tier(name: str = "dram", blocks: int = 40, **kw) -> Tier:
    return Tier(name=name, capacity_blocks=blocks, **kw)


# ---------------------------------------------------------------------- no lower tier = today's replay
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_an_empty_tier_stack_changes_nothing(policy, mode):
    """The device cache with a TierStack of no tiers (every admission step runs its tier calls) admits
    exactly as the cache without one, request for request (every policy, both counting modes)."""
    w = random_token_workload(3, n=150)
    enc = encode(w, ReplayConfig(capacity_blocks=30, block_size=4))
    keys, offsets = enc.key_ids.tolist(), enc.offsets.tolist()
    caches = [PrefixCache(30, make_policy(policy), block_size=4) for _ in range(2)]
    TierStack(caches[1], [])
    for policy_obj in (c.policy for c in caches):
        policy_obj.prepare(enc)
    for r, p in enumerate(enc.prompt_tokens.tolist()):
        got = []
        for cache in caches:
            ctx = AccessContext(time=float(r), seq=r, request_id=r, prompt_tokens=p)
            adm = cache.admit(keys[offsets[r]:offsets[r + 1]], p, ctx, mode=mode)
            got.append(None if adm is None else (adm.hit_blocks, adm.new_blocks, adm.evictions,
                                                 [b.block_id for b in adm.blocks]))
            if adm is not None:
                cache.release(adm.blocks, ctx)
        assert got[0] == got[1], (r, got)


def test_a_plain_python_plugin_runs_as_a_tier_policy_and_on_the_device(tmp_path):
    from kvlab.policies import EvictionPolicy, register_policy

    @register_policy("test-tier-mru")
    class NewestFirst(EvictionPolicy):
        """Most recently unpinned first (a plain plugin: a dict in unpin order)."""

        def __init__(self) -> None:
            self.order: dict = {}

        def on_unpin(self, block, ctx) -> None:
            self.order[block] = None

        def on_pin(self, block, ctx) -> None:
            self.order.pop(block, None)

        def on_evict(self, block) -> None:
            self.order.pop(block, None)

        on_remove = on_evict

        def victim(self):
            return next(reversed(self.order))

        def __len__(self) -> int:
            return len(self.order)

    w = random_token_workload(5, n=200)
    plain = replay(w, capacity_blocks=25, block_size=4, policy="test-tier-mru")
    tiered = replay(w, capacity_blocks=25, block_size=4, policy="test-tier-mru", backend="python",
                    tiers=[tier(policy="test-tier-mru", blocks=10**6)])
    assert (tiered.requests["hit_tokens_device"] <= tiered.requests["hit_tokens"]).all()
    assert tiered.summary["device_token_hit_rate"] == pytest.approx(plain.summary["token_hit_rate"])
    assert tiered.summary["token_hit_rate"] == pytest.approx(tiered.summary["ideal_hit_rate"])


# ---------------------------------------------------------------------- device + unbounded tier = infinite cache
@pytest.mark.parametrize("write", ["write_through", "write_back"])
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
@pytest.mark.parametrize("make", [random_token_workload, conversation_workload])
def test_an_unbounded_lower_tier_reaches_the_infinite_cache_hit_rate(write, mode, make):
    """LRU device (it never orphans a block, so the cascade never needs to return upward) + an unbounded
    tier: every request hits exactly what an infinite cache gives it."""
    w = make(7, n=300)
    r = replay(w, capacity_blocks=40, block_size=4, mode=mode, backend="python", tiers=[tier(blocks=10**9,
                                                                                                 write=write)])
    f = r.requests
    assert r.summary["device_token_hit_rate"] < r.summary["token_hit_rate"]  # the device alone evicts
    assert f["admitted"].all()
    np.testing.assert_array_equal(f["hit_tokens"], f["ideal_hit_tokens"])
    assert r.summary["tiers"][0]["stores_skipped"] == 0 and r.summary["tiers"][0]["evictions"] == 0


# ---------------------------------------------------------------------- invariants, random configurations
def tier_strategy(name: str, first: bool):
    return st.builds(
        lambda blocks, policy, write, k, inclusion, chunk, touch: _tier(name, blocks, policy, write, k, inclusion,
                                                                         chunk, touch, first),
        st.integers(1, 60), st.sampled_from(["lru", "fifo", "lfu", "arc", "s3fifo", "sieve"]),
        st.sampled_from(["write_through", "write_through_selective", "write_back"]), st.integers(1, 3),
        st.sampled_from(["none", "inclusive", "exclusive"]), st.sampled_from([1, 1, 2, 3]), st.booleans())


def _tier(name, blocks, policy, write, k, inclusion, chunk, touch, first) -> Tier:
    if inclusion == "exclusive":
        write = "write_back"
    if write != "write_through" or not first:
        chunk = 1  # write_back / selective below a 1-block tier; chunking only on the first tier here
    k = k if write == "write_through_selective" else 1  # selective_hits means something with selective only
    return Tier(name=name, capacity_blocks=max(blocks, chunk), policy=policy, write=write, selective_hits=k,
                inclusion=inclusion, chunk_blocks=chunk, touch=touch)  # at least one whole chunk


TIERS = st.one_of(
    st.tuples(tier_strategy("dram", True)),
    st.tuples(tier_strategy("dram", True), tier_strategy("ssd", False)).filter(
        lambda ts: ts[1].write != "write_back" or ts[1].chunk_blocks == ts[0].chunk_blocks),
)


class Checker:
    """Wraps a device cache and its stack; checks the invariants after every operation and that no pinned
    block of any tier is ever evicted."""

    def __init__(self, capacity: int, policy: str, tiers, block_size: int, max_load_tokens=None) -> None:
        self.device = make_cache(capacity, policy, block_size=block_size)
        self.stack = TierStack(self.device, tiers, max_load_tokens=max_load_tokens)
        for cache in [self.device] + [t.cache for t in self.stack.tiers]:
            inner = cache.key_listener

            def checked(block, last, inner=inner) -> None:
                assert block.ref_cnt == 0, f"pinned block {block.block_id} dropped"
                inner(block, last)

            cache.key_listener = checked

    def check(self) -> None:
        stack = self.stack
        for t in stack.tiers:
            for key, held in t.cache._index.items():
                (slot,) = held.values()  # a lower tier never holds a key twice
                above = stack._resident_above(t, key)
                if t.spec.inclusion == "exclusive":
                    assert not above, f"{t.spec.name} holds {key!r} that a tier above holds"
                if t.spec.inclusion == "inclusive":
                    assert (slot.ref_cnt > 0) == above, (t.spec.name, key, slot.ref_cnt, above)
                else:
                    assert slot.ref_cnt == 0, "a lower-tier pin outlived its admission"


def sequential(checker: Checker, enc, mode: str) -> list:
    keys, offsets = enc.key_ids.tolist(), enc.offsets.tolist()
    rows = []
    for r, p in enumerate(enc.prompt_tokens.tolist()):
        ctx = AccessContext(time=float(r), seq=r, request_id=r, prompt_tokens=p)
        adm = checker.device.admit(keys[offsets[r]:offsets[r + 1]], p, ctx, mode=mode)
        if adm is not None:
            assert sum(adm.tier_hits) <= adm.hit_blocks
            rows.append((adm.hit_blocks, list(adm.tier_hits)))
            checker.device.release(adm.blocks, ctx)
        checker.check()
    return rows


@settings(max_examples=200, deadline=None)
@given(tiers=TIERS, capacity=st.integers(4, 40), seed=st.integers(0, 10**6), mode=st.sampled_from(["vllm", "ideal"]),
       max_load=st.sampled_from([None, 0, 4, 12]), policy=st.sampled_from(["lru", "lfu", "s3fifo"]))
def test_sequential_invariants_hold_for_random_tier_configurations(tiers, capacity, seed, mode, max_load, policy):
    w = random_token_workload(seed, n=120)
    enc = encode(w, ReplayConfig(capacity_blocks=capacity, block_size=2))
    checker = Checker(capacity, policy, list(tiers), 2, max_load)
    rows = sequential(checker, enc, mode)
    if max_load is not None:
        assert all(sum(t) * 2 <= max_load for _, t in rows)


@settings(max_examples=120, deadline=None)
@given(tiers=TIERS, capacity=st.integers(12, 60), seed=st.integers(0, 10**6), ops=st.integers(50, 200))
def test_interleaved_schedules_through_the_kv_manager_keep_the_invariants(tiers, capacity, seed, ops):
    """Requests admitted and freed in random order, several running at once (the simulator's pattern): hit
    blocks split over the tiers, running requests' device blocks stay pinned, lower-tier pins end with
    their admission (inclusive pins excepted), exclusive / inclusive hold."""
    rng = np.random.default_rng(seed)
    w = random_token_workload(seed, n=ops)
    enc = encode(w, ReplayConfig(capacity_blocks=capacity, block_size=2))
    keys, offsets, prompt = enc.key_ids.tolist(), enc.offsets.tolist(), enc.prompt_tokens.tolist()
    checker = Checker(capacity, "lru", list(tiers), 2)
    manager = KVCacheManager(checker.device)
    running: list[KVRequest] = []
    for i in range(ops):
        if running and (rng.random() < 0.45 or len(running) > 6):
            req = running.pop(int(rng.integers(len(running))))
            req.num_computed_tokens = req.num_tokens
            manager.free(req)
        req = KVRequest(request_id=i, prompt_tokens=prompt[i], keys=keys[offsets[i]:offsets[i + 1]])
        req.ctx.seq = i
        hits, hit_tokens = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, prompt[i] - hit_tokens, hits):
            assert sum(req.tier_hits) <= req.hit_blocks
            assert req.hit_blocks * 2 == hit_tokens
            running.append(req)
            assert all(b.ref_cnt > 0 for b in req.blocks)
        checker.check()
    for req in running:
        manager.free(req)
    checker.check()


def test_kv_manager_one_request_at_a_time_equals_the_replay():
    """Through the KV manager, one request at a time, the tiers give the replay's hits per tier."""
    tiers = [tier(blocks=30, write="write_back", inclusion="exclusive"), tier("ssd", blocks=80)]
    w = conversation_workload(2, n=200)
    r = replay(w, capacity_blocks=15, block_size=4, backend="python", tiers=tiers)
    enc = encode(w, ReplayConfig(capacity_blocks=15, block_size=4))
    cache = make_cache(15, "lru", block_size=4)
    TierStack(cache, tiers)
    manager = KVCacheManager(cache)
    keys, offsets = enc.key_ids.tolist(), enc.offsets.tolist()
    got = []
    for i, p in enumerate(enc.prompt_tokens.tolist()):
        req = KVRequest(request_id=i, prompt_tokens=p, keys=keys[offsets[i]:offsets[i + 1]])
        req.ctx.seq = i
        req.ctx.time = float(i)
        manager.now = float(i)
        hits, hit_tokens = manager.get_computed_blocks(req)
        ok = manager.allocate_slots(req, p - hit_tokens, hits)
        if ok:
            req.num_computed_tokens = p
            manager.free(req)
        got.append([req.hit_blocks * 4, *(np.asarray(req.tier_hits or [0, 0]) * 4), ok])
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:, 3], r.requests["admitted"])
    np.testing.assert_array_equal(got[:, 0], r.requests["hit_tokens"])
    np.testing.assert_array_equal(got[:, 1], r.requests["hit_tokens_dram"])
    np.testing.assert_array_equal(got[:, 2], r.requests["hit_tokens_ssd"])


# ---------------------------------------------------------------------- per-request and summary accounting
def test_hit_tokens_split_over_tiers_and_shares_sum_to_the_hit_rate():
    w = conversation_workload(4, n=300)
    tiers = [tier(blocks=20, write="write_back"), tier("ssd", blocks=200, write="write_back")]
    r = replay(w, capacity_blocks=10, block_size=4, backend="python", tiers=tiers, model="llama-3-8b")
    f, s = r.requests, r.summary
    np.testing.assert_array_equal(f["hit_tokens_device"] + f["hit_tokens_dram"] + f["hit_tokens_ssd"], f["hit_tokens"])
    assert s["device_token_hit_rate"] + sum(t["hit_share"] for t in s["tiers"]) == pytest.approx(s["token_hit_rate"])
    assert all(t["hit_share"] > 0 for t in s["tiers"])
    dram = s["tiers"][0]
    assert dram["loaded_tokens"] == f["hit_tokens_dram"].sum() <= dram["found_hit_tokens"]
    assert dram["bytes_read"] == dram["loaded_tokens"] * 128 * 1024  # Llama-3-8B: 128 KiB per token (bf16)
    assert 0 <= dram["stores_never_read"] <= dram["evictions"] <= dram["blocks_stored"]


def test_max_load_tokens_caps_the_loads_per_request():
    w = conversation_workload(4, n=200)
    base = dict(capacity_blocks=8, block_size=4, backend="python", tiers=[tier(blocks=10**6)])
    full, capped = replay(w, **base), replay(w, **base, max_load_tokens=8)
    assert capped.requests["hit_tokens_dram"].max() <= 8 < full.requests["hit_tokens_dram"].max()
    assert capped.summary["tiers"][0]["found_hit_tokens"] > capped.summary["tiers"][0]["loaded_tokens"]


def test_a_chunked_tier_finds_whole_chunks_only():
    """LMCache-style chunks of 3 blocks: a tier's hits end on a chunk boundary (or the hit limit)."""
    w = random_token_workload(9, n=250, max_len=60)
    r = replay(w, capacity_blocks=6, block_size=2, backend="python", tiers=[tier(blocks=10**6, chunk_blocks=3)])
    f = r.requests
    lower_end = (f["hit_tokens"] // 2).to_numpy()
    from_tier = (f["hit_tokens_dram"] > 0).to_numpy()
    limit = np.minimum((f["prompt_tokens"] - 1) // 2, f["full_blocks"]).to_numpy()
    assert from_tier.any()
    assert ((lower_end[from_tier] % 3 == 0) | (lower_end[from_tier] == limit[from_tier])).all()


def test_write_policies_differ_where_they_should():
    w = conversation_workload(11, n=300)
    run = {wr: replay(w, capacity_blocks=10, block_size=4, backend="python", tiers=[tier(blocks=40, write=wr)])
           for wr in ("write_through", "write_back", "write_through_selective")}
    stored = {wr: r.summary["tiers"][0]["blocks_stored"] for wr, r in run.items()}
    assert stored["write_through"] > stored["write_back"] > 0
    assert stored["write_through"] > stored["write_through_selective"] > 0


# ---------------------------------------------------------------------- spec and CLI spelling
def test_parse_tier_round_trips_and_refuses_bad_specs():
    t = parse_tier("dram:blocks=1000:policy=lfu:write=write_back:inclusion=exclusive:touch=off")
    assert (t.name, t.capacity_blocks, t.policy, t.write, t.inclusion, t.touch) == (
        "dram", 1000, "lfu", "write_back", "exclusive", False)
    assert parse_tier(t.label()) == t
    assert parse_tier("ssd:gib=2048:selective=3").write == "write_through_selective"
    for bad, words in [("dram", "blocks=N"), ("dram:blocks=ten", "integer"),
                       ("dram:blocks=5:inclusion=exclusive", "write_back"),
                       ("device:blocks=5", "reserved"), ("dram:blocks=5:policy=nope", "nope"),
                       ("dram:blocks=0", "blocks"), ("dram:blocks", "key=value")]:
        with pytest.raises(ConfigError) as err:
            parse_tier(bad)
        message = str(err.value)
        assert bad in message and words in message and "\n" not in message, message


def test_tier_sizes_in_gib_need_a_model_and_convert_to_whole_blocks():
    w = random_token_workload(1, n=20)
    with pytest.raises(ConfigError, match="needs a model"):
        replay(w, capacity_blocks=8, block_size=16, tiers=[Tier(name="dram", capacity_gib=1.0)])
    r = replay(w, capacity_blocks=8, block_size=16, backend="python", model="llama-3-8b",
               tiers=[Tier(name="dram", capacity_gib=1.0)])
    assert r.summary["tiers"][0]["capacity_blocks"] == (1 << 30) // (16 * 128 * 1024)  # 512 blocks of 2 MiB


def test_tier_configs_that_cannot_work_are_refused_before_any_work():
    device = make_cache(4, "lru", block_size=2)
    with pytest.raises(ConfigError, match="chunk=2 needs write=write_through"):
        TierStack(device, [tier(chunk_blocks=2, write="write_back")])
    with pytest.raises(ConfigError, match="given twice"):
        ReplayConfig(capacity_blocks=4, tiers=[tier(), tier()])
    with pytest.raises(ConfigError, match="offline"):  # belady reads the trace's future: device only
        ReplayConfig(capacity_blocks=4, tiers=[tier(policy="belady")])
