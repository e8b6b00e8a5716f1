"""The cache core against vLLM v1's prefix-caching behaviours (tests/v1/core/test_prefix_caching.py,
ported in our own words) and docs/semantics.md ("Lookup, admission and release (one request)"). Keys here are built by a
tiny chained tuple scheme so the core is tested independently of the hasher."""

from __future__ import annotations

import pytest

from kvlab.cache import AccessContext, PrefixCache, admission
from kvlab.errors import CapacityError, ConfigError
from kvlab.policies import make_cache, make_policy
from kvlab.policies.base import EvictionPolicy


def chain(tokens: list, bs: int, root: object = "root") -> list:
    """Chained keys of the full blocks of ``tokens``: key_i = (key_{i-1}, block tokens)."""
    keys, prev = [], root
    for i in range(len(tokens) // bs):
        prev = (prev, tuple(tokens[i * bs : (i + 1) * bs]))
        keys.append(prev)
    return keys


def run(cache: PrefixCache, tokens: list, mode: str = "vllm", release: bool = True):
    adm = cache.admit(chain(tokens, cache.block_size), len(tokens), mode=mode)
    if adm is not None and release:
        cache.release(adm.blocks)
    return adm


def alloc_order(cache: PrefixCache) -> list[int]:
    """Block ids in the order allocation would take them (the free queue, front first)."""
    blocks, _ = cache.allocate(cache.num_free_blocks)
    ids = [b.block_id for b in blocks]
    cache.release(list(reversed(blocks)))  # give them back without keys
    return ids


def test_prefill_then_hit():
    cache = make_cache(10, block_size=4)
    common = list(range(12))  # 3 full blocks
    a = run(cache, common + [100, 101, 102], release=False)
    assert (a.hit_blocks, a.new_blocks) == (0, 4)
    assert [b.block_id for b in a.blocks] == [0, 1, 2, 3]
    assert cache.num_cached_blocks == 3  # the partial block holds no key
    b = run(cache, common + [200, 201], release=False)
    assert b.hit_blocks == 3 and b.new_blocks == 1
    assert [blk.block_id for blk in b.blocks[:3]] == [0, 1, 2]
    assert all(blk.ref_cnt == 2 for blk in b.blocks[:3])
    cache.release(a.blocks)
    cache.release(b.blocks)
    assert cache.num_running_blocks == 0


def test_release_order_tail_first_and_partial_block_to_front():
    cache = make_cache(6, block_size=2)
    run(cache, [1, 2, 3, 4, 5, 6, 7])  # blocks 0,1,2 keyed; 3 partial
    # free queue: unkeyed partial (3) at the front, untouched 4,5, then keyed tail first: 2,1,0
    assert alloc_order(cache) == [3, 4, 5, 2, 1, 0]


def test_lru_evicts_tail_of_sequence_before_head():
    cache = make_cache(4, block_size=2)
    run(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # 4 full blocks, keys k0..k3 in blocks 0..3
    keys = chain([1, 2, 3, 4, 5, 6, 7, 8], 2)
    adm = run(cache, [9, 9])  # needs one block: evicts the sequence's last block first
    assert adm.evictions == 1
    assert keys[3] not in cache and all(k in cache for k in keys[:3])
    run(cache, [8, 8, 8, 8])  # two more blocks: the next victims are k2 then k1, before [9, 9]
    assert keys[2] not in cache and keys[1] not in cache
    assert keys[0] in cache and chain([9, 9], 2)[0] in cache


def test_eviction_order_follows_unpin_time():
    cache = make_cache(4, block_size=2)
    run(cache, [1, 1, 2, 2])  # blocks 0,1 -> queue [1, 0] after release (tail first) behind free 2,3
    run(cache, [3, 3, 4, 4])  # takes 2,3 -> queue [1, 0, 3, 2]
    run(cache, [1, 1])  # last-token cap: 0 hits (prompt of one block), allocates 1 -> evicts block 1
    assert chain([1, 1, 2, 2], 2)[1] not in cache
    hit = run(cache, [1, 1, 2, 2, 5])
    assert hit.hit_blocks == 1  # the head survived, the tail was evicted first


def test_hits_are_protected_from_eviction_by_their_own_request():
    cache = make_cache(4, block_size=2)
    run(cache, [1, 1, 2, 2, 3, 3])  # 3 cached blocks + 1 free
    # second request hits 2 blocks and needs 2 new: the free one and one victim, never its own hits
    adm = run(cache, [1, 1, 2, 2, 9, 9, 9], release=False)
    assert adm.hit_blocks == 2 and adm.new_blocks == 2 and adm.evictions == 1
    assert chain([1, 1, 2, 2, 3, 3], 2)[2] not in cache  # the victim was the unhit block
    assert all(b.ref_cnt == 1 for b in adm.blocks)


def test_running_blocks_are_never_evicted():
    cache = make_cache(4, block_size=2)
    a = run(cache, [1, 1, 2, 2, 3, 3], release=False)  # 3 running
    assert run(cache, [5, 5, 6, 6]) is None  # needs 2, only 1 free
    b = run(cache, [5, 5], release=False)
    assert b is not None and b.evictions == 0
    assert all(blk.ref_cnt == 1 for blk in a.blocks)


def test_last_prompt_token_is_always_recomputed():
    cache = make_cache(8, block_size=4)
    tokens = list(range(8))  # exactly 2 full blocks
    run(cache, tokens)
    assert run(cache, tokens).hit_blocks == 1  # capped at (8 - 1) // 4 = 1 block
    assert run(cache, tokens + [99]).hit_blocks == 2
    assert run(cache, tokens, mode="ideal").hit_blocks == 2


def test_recomputed_last_block_is_a_duplicate_and_either_copy_serves():
    cache = make_cache(8, block_size=2)
    tokens = [1, 2, 3, 4]
    first = run(cache, tokens, release=False)
    second = run(cache, tokens, release=False)  # hits block 0, recomputes block 1 into another block
    k1 = chain(tokens, 2)[1]
    assert second.hit_blocks == 1
    assert second.blocks[1] is not first.blocks[1] and second.blocks[1].key == k1
    assert cache.get(k1) is first.blocks[1]  # lookup returns the oldest copy
    cache.release(first.blocks)
    cache.release(second.blocks)
    # evict the older copy only: the other stays findable
    cache._drop_keys(1, iter([first.blocks[1]]).__next__, cache.policy.on_evict, cache._free)
    assert cache.get(k1) is second.blocks[1]
    assert run(cache, tokens + [5]).hit_blocks == 2


def test_lookup_stops_at_first_miss():
    cache = make_cache(16, block_size=2)
    run(cache, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # same later blocks after a different first block: zero hits (chained keys)
    assert run(cache, [9, 9, 3, 4, 5, 6, 7, 8, 0]).hit_blocks == 0


@pytest.mark.parametrize(
    ("changed", "expected_hits"), [(7, 3), (0, 0)], ids=["X-replaces-H", "X-replaces-A"]
)
def test_seed_002_worked_example(changed, expected_hits):
    """Seed 002: cache holds A..H in blocks of 2; one position changed to X."""
    cache = make_cache(16, block_size=2)
    text = list("ABCDEFGH")
    run(cache, text, mode="ideal")
    new = list(text)
    new[changed] = "X"
    adm = run(cache, new, mode="ideal")
    assert adm.hit_blocks == expected_hits
    if changed == 7:  # 7 common tokens, only 6 in full blocks
        assert adm.hit_blocks * 2 == 6


def test_failed_allocation_has_no_side_effects():
    def cache_with_one_running() -> tuple[PrefixCache, object]:
        cache = make_cache(5, block_size=2)
        run(cache, [1, 1, 2, 2, 3, 3])  # 3 evictable
        return cache, run(cache, [7, 7], release=False)  # 1 running (took a free block)

    cache, hold = cache_with_one_running()
    twin, twin_hold = cache_with_one_running()  # the same state, never offered the request
    before = (cache.num_cached_blocks, cache.num_evictable_blocks, cache.stats.hits, cache.stats.evictions)
    # hits 2 evictable blocks and needs 3 new: free+evictable = 4, minus its 2 evictable hits = 2 < 3
    assert run(cache, [1, 1, 2, 2, 4, 4, 5, 5, 6]) is None
    after = (cache.num_cached_blocks, cache.num_evictable_blocks, cache.stats.hits, cache.stats.evictions)
    assert before == after
    cache.release(hold.blocks)
    twin.release(twin_hold.blocks)
    assert alloc_order(cache) == alloc_order(twin)  # free queue and eviction order untouched


def test_fit_check_counts_own_evictable_hits():
    cache = make_cache(4, block_size=2)
    run(cache, [1, 1, 2, 2])  # 2 evictable + 2 free
    # 2 hits (evictable) + 2 new = 4 = capacity: fits exactly
    adm = run(cache, [1, 1, 2, 2, 3, 3, 4], release=False)
    assert adm is not None and adm.hit_blocks == 2 and adm.new_blocks == 2


def test_salt_isolation():
    cache = make_cache(16, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    cache.release(cache.admit(chain(tokens, 2, root=("salt", "a")), 5).blocks)
    assert cache.admit(chain(tokens, 2, root=("salt", "b")), 5).hit_blocks == 0


def test_reset_only_when_nothing_runs():
    cache = make_cache(4, block_size=2)
    a = run(cache, [1, 1, 2, 2, 3], release=False)
    with pytest.raises(CapacityError, match="in use"):
        cache.reset()
    cache.release(a.blocks)
    cache.reset()
    assert cache.num_cached_blocks == 0 and cache.num_free_blocks == 4
    assert run(cache, [1, 1, 2, 2, 3]).hit_blocks == 0
    assert alloc_order(cache)[0] == 2  # the partial block again went to the front


def test_capacity_never_exceeded_and_refcounts_balance():
    import random

    rnd = random.Random(7)
    cache = make_cache(12, block_size=2)
    running = []
    for step in range(400):
        if running and rnd.random() < 0.45:
            cache.release(running.pop(rnd.randrange(len(running))).blocks)
        else:
            tokens = [rnd.randrange(3) for _ in range(rnd.randrange(1, 9))]
            adm = cache.admit(chain(tokens, 2), len(tokens), AccessContext(seq=step))
            if adm is not None:
                running.append(adm)
        assert cache.num_running_blocks + cache.num_free_blocks == 12
        assert all(b.ref_cnt >= 0 for b in cache.blocks)
        pinned = {id(b) for a in running for b in a.blocks}
        assert all(b.ref_cnt > 0 for b in cache.blocks if id(b) in pinned)
        # the policy's evictable set is exactly the unpinned keyed blocks (its size; victims below)
        assert len(cache.policy) == sum(1 for b in cache.blocks if b.ref_cnt == 0 and b.key is not None)
    assert running
    taken, _ = cache.allocate(cache.num_free_blocks)  # every free and evictable block: none is pinned
    assert all(id(b) not in pinned for b in taken)
    cache.release(taken)
    for a in running:
        cache.release(a.blocks)
    assert cache.num_running_blocks == 0


def test_bad_config():
    with pytest.raises(ConfigError):
        make_cache(0)
    with pytest.raises(ConfigError, match="unknown policy"):
        make_cache(4, "nope")
    with pytest.raises(ConfigError, match="counting mode"):
        make_cache(4).max_hit_blocks(10, 2, "sometimes")


def test_the_cache_takes_a_policy_object_and_make_cache_a_name():
    """PrefixCache never looks a policy name up (kvlab.policies sits above it): a name or no policy is one
    TypeError naming the way; make_cache builds the same cache from a name."""
    for policy in ("lru", None):
        with pytest.raises(TypeError, match="make_policy"):
            PrefixCache(4, policy, block_size=2)  # type: ignore[arg-type]
    by_name = make_cache(4, "lru", block_size=2)
    assert type(by_name.policy).__name__ == type(make_policy("lru")).__name__ and by_name.capacity_blocks == 4


def test_old_capacity_keyword_still_works():
    """``num_blocks`` is the old name of ``capacity_blocks`` (kvlab.names.KEYWORD_ALIASES)."""
    cache = make_cache(num_blocks=6, block_size=2)
    assert cache.capacity_blocks == cache.num_blocks == len(cache.blocks) == 6
    assert make_cache(capacity_blocks=3).num_free_blocks == 3
    with pytest.raises(TypeError, match="old name"):
        make_cache(4, num_blocks=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
        make_cache(4, size=4)
    with pytest.raises(TypeError, match="missing required argument"):
        make_cache()


# ---------------------------------------------------------------------- the admission sequence
class Recorder(EvictionPolicy):
    """FIFO over evictable blocks that logs every hook call (block ids, keys)."""

    name = "recorder"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._queue: dict[int, object] = {}

    def on_insert(self, block, ctx):
        self.log.append(("insert", block.block_id, block.key))

    def on_hit(self, block, ctx):
        self.log.append(("hit", block.block_id))

    def on_miss(self, keys, ctx):
        self.log.append(("miss", *keys))

    def on_pin(self, block, ctx):
        self.log.append(("pin", block.block_id))
        del self._queue[block.block_id]

    def on_unpin(self, block, ctx):
        self._queue[block.block_id] = block

    def victim(self):
        block = next(iter(self._queue.values()))
        self.log.append(("victim", block.block_id))
        return block

    def on_evict(self, block):
        self.log.append(("evict", block.block_id, block.key))
        del self._queue[block.block_id]

    def __len__(self):
        return len(self._queue)


def test_admission_sequence_order_and_a_refused_request_calls_no_hook():
    """lookup -> (lower-tier lookup) -> fit -> pin -> on_miss -> allocate -> (load) -> key, in that order."""
    policy = Recorder()
    cache = PrefixCache(4, policy, block_size=2)
    run(cache, [1, 1, 2, 2, 3, 3])  # blocks 0-2 keyed (keys a, b, c), 3 free
    a, b, c = chain([1, 1, 2, 2, 3, 3], 2)
    policy.log.clear()
    assert run(cache, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7]) is None  # 7 blocks > 4: refused
    assert policy.log == []
    keys = chain([1, 1, 9, 9, 8, 8, 7], 2)  # hits a; misses 2 keys; 4 blocks: 1 hit, 1 free, 2 victims
    adm = run(cache, [1, 1, 9, 9, 8, 8, 7], release=False)
    assert (adm.hit_blocks, adm.new_blocks, adm.evictions) == (1, 3, 2)
    assert policy.log == [
        ("hit", 0), ("pin", 0),  # pin: before anything is allocated
        ("miss", keys[1], keys[2]),  # on_miss: the keys of the new full blocks, before any victim
        ("victim", 2), ("evict", 2, c), ("victim", 1), ("evict", 1, b),  # allocate: free block 3 first
        ("insert", 3, keys[1]), ("insert", 2, keys[2]),  # key: the new full blocks, partial block 1 unkeyed
    ]
    assert [blk.block_id for blk in adm.blocks] == [0, 3, 2, 1] and adm.blocks[3].key is None


def test_admission_steps_compose_to_admit():
    """The replay's admit is the sequence's functions with the new full blocks keyed at once."""
    cache, twin = make_cache(6, block_size=2), make_cache(6, block_size=2)
    for tokens in ([1, 1, 2, 2, 3], [1, 1, 2, 2, 4, 4, 5], [6, 6, 7, 7, 8, 8, 9], [1, 1, 2, 2, 3]):
        keys = chain(tokens, 2)
        adm = run(cache, tokens, release=False)
        found = admission.lookup(twin, keys, len(tokens))
        assert found.lower == () and found.num_blocks == len(found.hits)  # no lower tier yet
        placed = admission.admit(twin, found, keys, -(-len(tokens) // 2) - found.num_blocks, AccessContext())
        h = found.num_blocks
        admission.key(twin, placed.blocks[: len(keys) - h], keys, h, AccessContext())
        got = [blk.block_id for blk in found.hits + placed.blocks]
        assert got == [blk.block_id for blk in adm.blocks] and (h, placed.evictions) == (adm.hit_blocks, adm.evictions)
        cache.release(adm.blocks)
        twin.release(found.hits + placed.blocks)
    assert admission.grow(twin, [], 0, 7, AccessContext()) is None  # 7 > 6 blocks: nothing changes
    assert twin.num_free_blocks == 6 and twin.num_cached_blocks == cache.num_cached_blocks
