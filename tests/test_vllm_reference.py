"""Hit-for-hit equality with a reference model written in vLLM v1's own structure.

vLLM keeps ONE free queue holding both unkeyed free blocks and cached (evictable) blocks, allocates from
its head (evicting the key a block held), appends released keyed blocks at the tail and (docs/semantics.md) puts
released unkeyed blocks at the head. kvlab splits that queue into a free list plus an eviction policy.
This test re-implements the single-queue model independently (block_pool.py / kv_cache_utils.py
structure: `get_new_blocks`, `touch`, `free_blocks`, `cached_block_hash_to_block` with duplicates) and
checks that kvlab's replay — both engines — gives the same hits, evictions and block ids on real traces.
"""

from __future__ import annotations

import numpy as np
import pytest
from _util import random_token_workload

from kvlab.policies import make_cache
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.workload import load_trace


class VllmReference:
    """A direct model of vLLM v1's BlockPool + FreeKVCacheBlockQueue (block ids 0..N-1, no null block)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.queue: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion-ordered: head first
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}  # block hash -> {block_id: None}, oldest first

    def _popleft(self) -> int:
        block = next(iter(self.queue))
        del self.queue[block]
        return block

    def step(self, keys: list[int], prompt_tokens: int, ideal: bool) -> tuple[int, int, list[int]] | None:
        bs = self.block_size
        max_hit = len(keys) if ideal else min(len(keys), max(prompt_tokens - 1, 0) // bs)
        computed: list[int] = []
        for k in keys[:max_hit]:  # find_longest_cache_hit
            ids = self.cached.get(k)
            if not ids:
                break
            computed.append(next(iter(ids)))
        need = -(-prompt_tokens // bs) - len(computed)
        evictable_computed = sum(1 for b in computed if self.ref[b] == 0)
        if need > len(self.queue) - evictable_computed:
            return None
        for b in computed:  # touch
            if self.ref[b] == 0:
                del self.queue[b]
            self.ref[b] += 1
        new, evicted = [], 0
        for _ in range(need):  # get_new_blocks: pop the head, evict its hash
            b = self._popleft()
            if self.hash[b] is not None:
                ids = self.cached[self.hash[b]]
                del ids[b]
                if not ids:
                    del self.cached[self.hash[b]]
                self.hash[b] = None
                evicted += 1
            self.ref[b] = 1
            new.append(b)
        for j, b in enumerate(new):  # cache_full_blocks
            pos = len(computed) + j
            if pos < len(keys):
                self.hash[b] = keys[pos]
                self.cached.setdefault(keys[pos], {})[b] = None
        blocks = computed + new
        for b in reversed(blocks):  # free_blocks: tail first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.queue = {b: None, **self.queue}  # unkeyed: to the head
                else:
                    self.queue[b] = None
        return len(computed), evicted, blocks


def reference_run(enc, capacity: int, ideal: bool):
    ref = VllmReference(capacity, enc.block_size)
    hits, evictions = [], []
    for r in range(len(enc.prompt_tokens)):
        keys = enc.key_ids[enc.offsets[r] : enc.offsets[r + 1]].tolist()
        out = ref.step(keys, int(enc.prompt_tokens[r]), ideal)
        hits.append(out[0] if out else 0)
        evictions.append(out[1] if out else 0)
    return np.array(hits), np.array(evictions)


@pytest.mark.parametrize("capacity", [2, 7, 30])
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
def test_equals_vllm_structure_on_random_workloads(capacity, mode):
    w = random_token_workload(100 + capacity, n=400)
    cfg = ReplayConfig(capacity_blocks=capacity, block_size=3, mode=mode)
    enc = encode(w, cfg)
    hits, evictions = reference_run(enc, capacity, mode == "ideal")
    for engine in ("compiled", "python"):
        got = replay(w, cfg, encoded=enc, engine=engine).requests
        np.testing.assert_array_equal(got["hit_blocks"], hits)
        np.testing.assert_array_equal(got["evictions"], evictions)


def test_block_ids_follow_vllm_queue_order():
    w = random_token_workload(9, n=200)
    enc = encode(w, ReplayConfig(capacity_blocks=11, block_size=2))
    ref = VllmReference(11, 2)
    cache = make_cache(11, block_size=2)
    for r in range(len(w)):
        keys = enc.key_ids[enc.offsets[r] : enc.offsets[r + 1]].tolist()
        expected = ref.step(keys, int(enc.prompt_tokens[r]), False)
        adm = cache.admit(keys, int(enc.prompt_tokens[r]))
        assert (adm is None) == (expected is None)
        if adm is not None:
            assert [b.block_id for b in adm.blocks] == expected[2]
            cache.release(adm.blocks)


@pytest.mark.shared
@pytest.mark.parametrize("capacity", [1_000, 10_000])
def test_equals_vllm_structure_on_mooncake(shared_traces, capacity):
    w = load_trace(str(shared_traces / "mooncake" / "conversation_trace.jsonl"))
    enc = encode(w, ReplayConfig(capacity_blocks=capacity))
    hits, evictions = reference_run(enc, capacity, False)
    got = replay(w, capacity_blocks=capacity, encoded=enc).requests
    np.testing.assert_array_equal(got["hit_blocks"], hits)
    np.testing.assert_array_equal(got["evictions"], evictions)
    assert hits.sum() > 0 and evictions.sum() > 0
