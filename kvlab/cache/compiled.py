"""Compiled (numba) sequential replay: the fast path of the replay driver, for policies with compiled hooks.

It implements exactly the rules of :class:`kvlab.cache.PrefixCache` on dense key ids (0..num_keys-1):
free blocks form a stack whose top is the free queue's front, each key a doubly linked list of the
blocks holding it (oldest first), and the eviction policy is a :class:`CompiledPolicy`: numba functions
over a policy-owned state tuple, called at the same events as the Python hooks. The tests check every
compiled policy hit for hit against its Python twin running in the Python core. Counts are in blocks.

Orphans: a cached block is *orphaned* while its parent key (the previous block of its sequence) is not
cached; it is then unreachable. ``orphan_blocks`` is their number after each request and
``orphan_evictions`` the evictions of orphaned blocks.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numba as nb
import numpy as np


@nb.njit(cache=True)
def no_miss(state, key, seq, pos):
    """The default ``on_miss`` hook: ignore the keys about to be computed."""


class CompiledPolicy(NamedTuple):
    """numba-compiled hooks of one policy (block ids ``b``, dense key ids ``key``, ``seq`` = request index).

    ``init(capacity, num_keys, params) -> state``; ``on_insert(state, b, key, seq, pos)``;
    ``on_hit(state, b, key, seq, pos)``; ``on_pin(state, b, seq)``; ``on_unpin(state, b, seq)``;
    ``victim(state) -> b`` (only called with at least one evictable block); ``on_evict(state, b)``;
    ``on_miss(state, key, seq, pos)`` (optional): once per missed full block of an admitted request, in
    order, after its hits are touched and before any block is allocated for it (the Python
    ``on_miss(keys, ctx)``). ``params`` is what the policy's ``compiled_params()`` returns: a float64
    array of its numeric parameters, or a tuple of arrays (e.g. parameters and per-request data).
    """

    init: object
    on_insert: object
    on_hit: object
    on_pin: object
    on_unpin: object
    victim: object
    on_evict: object
    on_miss: object = no_miss


@nb.njit(cache=True, inline="always")
def max_hit_blocks(nfull: int, prompt_tokens: int, block_size: int, ideal: bool) -> int:
    """Hit cap in blocks: every full block (ideal) or ``(prompt_tokens - 1) // block_size`` (vllm)."""
    if ideal:
        return nfull
    return min(nfull, max(prompt_tokens - 1, 0) // block_size)


@nb.njit(nogil=True)
def replay_kernel(
    offsets: np.ndarray,  # int64 [n+1] into key_ids
    key_ids: np.ndarray,  # int64 dense key per full block
    truth_ids: np.ndarray,  # int64 per full block, or empty (no verify)
    prompt_tokens: np.ndarray,  # int64 [n]
    num_blocks: np.ndarray,  # int64 [n] = ceil(prompt_tokens / block_size)
    num_keys: int,
    capacity: int,
    block_size: int,
    ideal: bool,
    params,  # the policy's compiled_params(): float64 array or tuple of arrays
    init,
    on_insert,
    on_hit,
    on_pin,
    on_unpin,
    victim,
    on_evict,
    on_miss,
):
    n = len(prompt_tokens)
    verify = len(truth_ids) > 0
    hit_blocks = np.zeros(n, np.int64)
    new_blocks = np.zeros(n, np.int64)
    evictions = np.zeros(n, np.int64)
    orphan_evictions = np.zeros(n, np.int64)
    collisions = np.zeros(n, np.int64)
    admitted = np.zeros(n, np.bool_)
    cached_after = np.zeros(n, np.int64)
    orphans_after = np.zeros(n, np.int64)

    state = init(capacity, num_keys, params)
    free_stack = np.arange(capacity - 1, -1, -1).astype(np.int64)  # top = front of the free queue
    free_top = capacity
    n_evictable = 0
    ref = np.zeros(capacity, np.int64)
    bkey = np.full(capacity, -1, np.int64)
    bparent = np.full(capacity, -1, np.int64)
    btruth = np.full(capacity, -1, np.int64)
    key_head = np.full(num_keys, -1, np.int64)
    key_tail = np.full(num_keys, -1, np.int64)
    children = np.zeros(num_keys, np.int64)  # cached blocks whose parent is this key
    same_next = np.full(capacity, -1, np.int64)
    same_prev = np.full(capacity, -1, np.int64)
    n_cached = 0
    n_orphans = 0
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
            orphans_after[r] = n_orphans
            continue
        admitted[r] = True
        hit_blocks[r] = h
        new_blocks[r] = need
        # touch: count the hit and pin
        for i in range(h):
            b = req_blocks[i]
            on_hit(state, b, bkey[b], r, i)
            if ref[b] == 0:
                on_pin(state, b, r)
                n_evictable -= 1
            ref[b] += 1
        # name the keys about to be computed, then allocate: free queue front first, then policy victims
        for pos in range(h, nfull):
            on_miss(state, key_ids[start + pos], r, pos)
        ev = 0
        for j in range(need):
            if free_top > 0:
                free_top -= 1
                b = free_stack[free_top]
            else:
                b = victim(state)
                on_evict(state, b)
                n_evictable -= 1
                k = bkey[b]
                p = bparent[b]
                if p >= 0:
                    children[p] -= 1
                    if key_head[p] < 0:
                        n_orphans -= 1
                        orphan_evictions[r] += 1
                prev_b, next_b = same_prev[b], same_next[b]
                if prev_b >= 0:
                    same_next[prev_b] = next_b
                else:
                    key_head[k] = next_b
                if next_b >= 0:
                    same_prev[next_b] = prev_b
                else:
                    key_tail[k] = prev_b
                if key_head[k] < 0:
                    n_orphans += children[k]
                bkey[b] = -1
                bparent[b] = -1
                n_cached -= 1
                ev += 1
            ref[b] = 1
            req_blocks[h + j] = b
        evictions[r] = ev
        # key the new full blocks (after all allocations, as vLLM's cache_full_blocks does)
        for pos in range(h, nfull):
            b = req_blocks[pos]
            k = key_ids[start + pos]
            p = key_ids[start + pos - 1] if pos > 0 else -1
            if key_head[k] < 0:
                n_orphans -= children[k]
            if p >= 0:
                children[p] += 1
                if key_head[p] < 0:
                    n_orphans += 1
            bkey[b] = k
            bparent[b] = p
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
            on_insert(state, b, k, r, pos)
        # release tail first: keyed -> evictable (policy), unkeyed -> free queue front
        for i in range(total - 1, -1, -1):
            b = req_blocks[i]
            ref[b] -= 1
            if ref[b] == 0:
                if bkey[b] >= 0:
                    on_unpin(state, b, r)
                    n_evictable += 1
                else:
                    free_stack[free_top] = b
                    free_top += 1
        cached_after[r] = n_cached
        orphans_after[r] = n_orphans
    return (hit_blocks, new_blocks, evictions, orphan_evictions, collisions, admitted, cached_after,
            orphans_after)


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


def _kernel_args(policy: CompiledPolicy, enc, capacity: int, ideal: bool, params) -> tuple:
    truth = enc.truth_ids if enc.truth_ids is not None else np.zeros(0, np.int64)
    if not isinstance(params, tuple):
        params = np.asarray(params, dtype=np.float64)
    return (enc.offsets, enc.key_ids, truth, enc.prompt_tokens, enc.num_blocks, enc.num_keys, capacity,
            enc.block_size, ideal, params, *policy)


def warm_up(policy: CompiledPolicy, enc, capacity: int, ideal: bool, params) -> float:
    """Compile ``replay_kernel`` for these arguments' types without running it; returns seconds (0 when
    that specialisation exists). Called before a timed replay so that ``replay_seconds`` excludes JIT
    compilation."""
    args = _kernel_args(policy, enc, capacity, ideal, params)
    sig = tuple(nb.typeof(a) for a in args)
    if sig in replay_kernel.overloads:
        return 0.0
    t0 = time.perf_counter()
    replay_kernel.compile(sig)
    return time.perf_counter() - t0


def run_compiled(policy: CompiledPolicy, enc, capacity: int, ideal: bool, params) -> dict[str, np.ndarray]:
    """Run ``replay_kernel`` for an EncodedWorkload; returns the per-request columns by name."""
    out = replay_kernel(*_kernel_args(policy, enc, capacity, ideal, params))
    names = ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "collisions", "admitted",
             "cached_blocks", "orphan_blocks")
    return dict(zip(names, out, strict=True))
