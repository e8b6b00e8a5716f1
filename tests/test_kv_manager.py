"""The per-request KV manager: one request at a time it reproduces the replay driver hit for hit."""

from __future__ import annotations

import numpy as np
import pytest
from _util import random_token_workload

from kvlab.cache.manager import KVCacheManager, KVRequest
from kvlab.errors import ConfigError
from kvlab.policies import make_cache
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.workload import zipf_blocks


def manager_replay(workload, capacity: int, policy: str, cache_at: str, block_size: int | None = None) -> dict:
    """Each request looked up, admitted with its whole prompt, computed and freed before the next."""
    config = ReplayConfig(capacity_blocks=capacity, policy=policy, block_size=block_size)
    enc = encode(workload, config)
    cache = make_cache(capacity, policy, block_size=enc.block_size)
    manager = KVCacheManager(cache, cache_at=cache_at)
    keys = enc.key_ids.tolist()
    offsets = enc.offsets.tolist()
    out = {name: [] for name in ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "admitted")}
    for i, p in enumerate(enc.prompt_tokens.tolist()):
        req = KVRequest(request_id=i, prompt_tokens=p, keys=keys[offsets[i]:offsets[i + 1]])
        req.ctx.seq = i
        hits, hit_tokens = manager.get_computed_blocks(req)
        ok = manager.allocate_slots(req, p - hit_tokens, hits)
        out["admitted"].append(ok)
        if ok:
            req.num_computed_tokens = p
            manager.free(req)
        for name in ("hit_blocks", "new_blocks", "evictions", "orphan_evictions"):
            out[name].append(getattr(req, name))
    return {k: np.asarray(v) for k, v in out.items()}


CASES = [
    ("tokens", 8, "lru"), ("tokens", 40, "lru"), ("tokens", 40, "fifo"), ("tokens", 25, "s3fifo"),
    ("tokens", 30, "prefix-aware-lru"), ("blocks", 60, "lru"), ("blocks", 300, "lfu"), ("blocks", 120, "arc"),
]


@pytest.mark.parametrize("cache_at", ["schedule", "compute"])
@pytest.mark.parametrize(("kind", "capacity", "policy"), CASES)
def test_single_request_at_a_time_reproduces_replay(kind, capacity, policy, cache_at):
    if kind == "tokens":
        workload, block_size = random_token_workload(seed=capacity, n=300), 4
    else:
        workload, block_size = zipf_blocks(400, seed=capacity, n_prefixes=30), None
    ref = replay(workload, capacity_blocks=capacity, policy=policy, block_size=block_size, engine="python").requests
    got = manager_replay(workload, capacity, policy, cache_at, block_size)
    for name in ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "admitted"):
        np.testing.assert_array_equal(got[name], ref[name].to_numpy(), err_msg=name)
    assert ref["hit_blocks"].sum() > 0 and ref["evictions"].sum() > 0


def test_failed_allocation_changes_nothing():
    cache = make_cache(4, "lru", block_size=4)
    manager = KVCacheManager(cache)
    a = KVRequest(0, 8, keys=[10, 11])
    assert manager.allocate_slots(a, 8, [])
    a.num_computed_tokens = 8
    manager.free(a)  # two keyed, evictable blocks
    b = KVRequest(1, 20, keys=[10, 11, 12, 13, 14])
    hits, hit_tokens = manager.get_computed_blocks(b)
    assert [blk.key for blk in hits] == [10, 11] and hit_tokens == 8
    before = (cache.num_free_blocks, cache.num_evictable_blocks, cache.stats.hits, cache.stats.evictions)
    # 5 blocks in all: 3 new ones do not fit beside 2 evictable hits in a pool of 4
    assert not manager.allocate_slots(b, 12, hits)
    assert (cache.num_free_blocks, cache.num_evictable_blocks, cache.stats.hits, cache.stats.evictions) == before
    assert b.blocks == [] and b.admissions == 0 and cache.get(10) is not None


def test_blocks_grow_with_tokens_and_are_keyed_when_full():
    cache = make_cache(16, "lru", block_size=4)
    manager = KVCacheManager(cache, cache_at="compute")
    req = KVRequest(0, 6, keys=[1, 2, 3])  # 6 prompt tokens + known output: keys for 3 full blocks
    assert manager.allocate_slots(req, 6, [])
    assert len(req.blocks) == 2 and req.num_keyed_blocks == 0  # nothing computed yet
    req.num_computed_tokens = 6
    req.num_tokens = 7  # one sampled token
    assert manager.allocate_slots(req, 1)
    assert req.num_keyed_blocks == 1 and req.blocks[0].key == 1  # block 0 was computed last step
    req.num_computed_tokens, req.num_tokens = 7, 8
    assert manager.allocate_slots(req, 1) and len(req.blocks) == 2
    req.num_computed_tokens, req.num_tokens = 8, 9
    assert manager.allocate_slots(req, 1) and len(req.blocks) == 3 and req.num_keyed_blocks == 2
    req.num_computed_tokens = 9
    manager.free(req)
    assert cache.num_running_blocks == 0 and cache.num_cached_blocks == 2
    with pytest.raises(ConfigError):
        KVCacheManager(cache, cache_at="later")


def test_truths_growing_keys_keying_after_compute_and_request_time():
    """What the engine's sequential driver uses: truths recorded on keyed blocks, keys appended as tokens are
    sampled (re-arming the keying trigger), blocks keyed right after the forward pass (never over K/V that a
    failed forward did not write), and ``now=None``: each request's own ``ctx.time``."""
    cache = make_cache(8, "lru", block_size=4)
    manager = KVCacheManager(cache, cache_at="compute", now=None)
    req = KVRequest(0, 6, keys=[1], truths=["t1"])
    req.ctx.time = 12.5
    assert manager.allocate_slots(req, 12, []) and len(req.blocks) == 3  # slots for 6 more tokens ahead
    assert req.num_keyed_blocks == 0
    req.num_computed_tokens = 6  # the forward wrote positions 0..5
    assert manager.cache_computed(req) == 1 and req.blocks[0].key == 1 and req.blocks[0].truth == "t1"
    assert manager.cache_computed(req) == 0 and req.key_at > 10**9  # every known key placed
    req.num_tokens = req.num_computed_tokens = 8  # two sampled tokens computed: block 1 is full
    manager.extend_keys(req, [2], ["t2"])  # its key is known now
    assert req.key_at == 8 and req.keys == [1, 2]
    req.num_tokens = 9
    assert manager.allocate_slots(req, 1) and len(req.blocks) == 3  # room in the held blocks, yet keyed
    assert req.num_keyed_blocks == 2 and req.blocks[1].key == 2 and req.blocks[1].truth == "t2"
    with pytest.raises(ConfigError, match="truths"):
        manager.extend_keys(req, [3])
    req.num_computed_tokens = 9
    manager.free(req)
    assert req.ctx.time == 12.5 and cache.num_cached_blocks == 2
    # a failed forward: the request is freed without advancing num_computed_tokens, so nothing is keyed
    other = KVRequest(1, 12, keys=[1, 2, 7], truths=["t1", "t2", "t7"])
    hits, hit_tokens = manager.get_computed_blocks(other)
    assert hit_tokens == 8 and manager.allocate_slots(other, 12 - hit_tokens, hits)
    assert other.num_computed_tokens == 8 and other.hit_blocks == 2
    manager.free(other)
    assert cache.get(7) is None and cache.num_cached_blocks == 2 and cache.num_running_blocks == 0
