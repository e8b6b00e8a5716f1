"""Compiled (numba) sequential replay with vLLM-exact LRU: the fast path of the replay driver.

It implements the same rules as :class:`kvlab.cache.PrefixCache` with the ``lru`` policy, on dense
key ids (0..num_keys-1) instead of hashable keys: free blocks form a stack whose top is the free
queue's front, evictable blocks a doubly linked list in unpin order, and each key a doubly linked
list of the blocks holding it (oldest first). ``tests/test_replay.py`` checks it hit for hit against
the Python core. Counts are in blocks.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, inline="always")
def max_hit_blocks(nfull: int, prompt_tokens: int, block_size: int, ideal: bool) -> int:
    """Hit cap in blocks: every full block (ideal) or ``(prompt_tokens - 1) // block_size`` (vllm)."""
    if ideal:
        return nfull
    return min(nfull, max(prompt_tokens - 1, 0) // block_size)


@nb.njit(cache=True, nogil=True)
def replay_lru_kernel(
    offsets: np.ndarray,  # int64 [n+1] into key_ids
    key_ids: np.ndarray,  # int64 dense key per full block
    truth_ids: np.ndarray,  # int64 per full block, or empty (no verify)
    prompt_tokens: np.ndarray,  # int64 [n]
    num_blocks: np.ndarray,  # int64 [n] = ceil(prompt_tokens / block_size)
    num_keys: int,
    capacity: int,
    block_size: int,
    ideal: bool,
):
    n = len(prompt_tokens)
    verify = len(truth_ids) > 0
    hit_blocks = np.zeros(n, np.int64)
    new_blocks = np.zeros(n, np.int64)
    evictions = np.zeros(n, np.int64)
    collisions = np.zeros(n, np.int64)
    admitted = np.zeros(n, np.bool_)
    cached_after = np.zeros(n, np.int64)

    S = capacity  # sentinel index of the evictable list
    nxt = np.full(capacity + 1, -1, np.int64)
    prv = np.full(capacity + 1, -1, np.int64)
    nxt[S] = S
    prv[S] = S
    n_evictable = 0
    free_stack = np.arange(capacity - 1, -1, -1).astype(np.int64)  # top = front of the free queue
    free_top = capacity
    ref = np.zeros(capacity, np.int64)
    bkey = np.full(capacity, -1, np.int64)
    btruth = np.full(capacity, -1, np.int64)
    key_head = np.full(num_keys, -1, np.int64)
    key_tail = np.full(num_keys, -1, np.int64)
    same_next = np.full(capacity, -1, np.int64)
    same_prev = np.full(capacity, -1, np.int64)
    n_cached = 0
    req_blocks = np.empty(0, np.int64)

    for r in range(n):
        start = offsets[r]
        nfull = offsets[r + 1] - start
        total = num_blocks[r]
        if total > req_blocks.shape[0]:
            req_blocks = np.empty(total, np.int64)
        max_hit = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        h = 0
        while h < max_hit:
            b = key_head[key_ids[start + h]]
            if b < 0:
                break
            if verify and btruth[b] != truth_ids[start + h]:
                collisions[r] = 1
                break
            req_blocks[h] = b
            h += 1
        need = total - h
        evictable_hits = 0
        for i in range(h):
            if ref[req_blocks[i]] == 0:
                evictable_hits += 1
        if need > free_top + n_evictable - evictable_hits:
            cached_after[r] = n_cached
            continue
        admitted[r] = True
        hit_blocks[r] = h
        new_blocks[r] = need
        # pin the hits
        for i in range(h):
            b = req_blocks[i]
            if ref[b] == 0:
                nxt[prv[b]] = nxt[b]
                prv[nxt[b]] = prv[b]
                n_evictable -= 1
            ref[b] += 1
        # allocate the rest: free queue front first, then the LRU head
        ev = 0
        for j in range(need):
            if free_top > 0:
                free_top -= 1
                b = free_stack[free_top]
            else:
                b = nxt[S]
                nxt[S] = nxt[b]
                prv[nxt[b]] = S
                n_evictable -= 1
                k = bkey[b]
                p, q = same_prev[b], same_next[b]
                if p >= 0:
                    same_next[p] = q
                else:
                    key_head[k] = q
                if q >= 0:
                    same_prev[q] = p
                else:
                    key_tail[k] = p
                bkey[b] = -1
                n_cached -= 1
                ev += 1
            ref[b] = 1
            pos = h + j
            if pos < nfull:
                k = key_ids[start + pos]
                bkey[b] = k
                if verify:
                    btruth[b] = truth_ids[start + pos]
                t = key_tail[k]
                same_prev[b] = t
                same_next[b] = -1
                if t >= 0:
                    same_next[t] = b
                else:
                    key_head[k] = b
                key_tail[k] = b
                n_cached += 1
            req_blocks[pos] = b
        evictions[r] = ev
        # release tail first: keyed -> LRU tail, unkeyed -> free queue front
        for i in range(total - 1, -1, -1):
            b = req_blocks[i]
            ref[b] -= 1
            if ref[b] == 0:
                if bkey[b] >= 0:
                    t = prv[S]
                    nxt[t] = b
                    prv[b] = t
                    nxt[b] = S
                    prv[S] = b
                    n_evictable += 1
                else:
                    free_stack[free_top] = b
                    free_top += 1
        cached_after[r] = n_cached
    return hit_blocks, new_blocks, evictions, collisions, admitted, cached_after


@nb.njit(cache=True, nogil=True)
def ideal_hits_kernel(
    offsets: np.ndarray,
    key_ids: np.ndarray,
    prompt_tokens: np.ndarray,
    num_keys: int,
    block_size: int,
    ideal: bool,
) -> np.ndarray:
    """Hit blocks per request with unbounded capacity (every computed full block stays cached)."""
    n = len(prompt_tokens)
    seen = np.zeros(num_keys, np.bool_)
    hits = np.zeros(n, np.int64)
    for r in range(n):
        start = offsets[r]
        nfull = offsets[r + 1] - start
        max_hit = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        h = 0
        while h < max_hit and seen[key_ids[start + h]]:
            h += 1
        hits[r] = h
        for i in range(nfull):
            seen[key_ids[start + i]] = True
    return hits
