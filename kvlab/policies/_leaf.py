"""numba machinery of the leaf-only compiled twins (pgdsf, sglang-leaf): not a policy (``_`` module).

Mirrors :class:`kvlab.policies._heap.LeafHeapPolicy`: the evictable blocks are ordered by
``(KEY, STAMP)`` (priority when unpinned, unpin stamp); a non-leaf block (its key has cached children)
that reaches the top is *parked* with its entry, grouped by key; when a key loses its last cached child
its parked blocks rejoin the queue with the same entries; if only parked blocks are evictable, the
smallest parked entry is the victim.

Layout shared by the twins: ``B`` (per block, int64; the transpose of a row-per-block array) has rows
``H, P`` (indexed heap of queued blocks), ``KEY, STAMP`` (the heap keys), ``H2, P2`` (heap of parked
blocks), ``BKEY, BPAR`` (the block's key and parent key, -1 = none), ``GNXT, GPRV`` (its key's parked
group, a linked list), then the policy's own rows from ``LEAF_ROWS`` on. ``M`` starts with
``N, N2, SCLOCK`` (heap sizes, stamp clock). ``K`` (per dense key) rows are the policy's: the functions
take the row of cached-children counts (``child``) and of the first parked block (``ghead``, -1 = none).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.policies._queues import heap_push, heap_push_stamped, heap_remove

H, P, KEY, STAMP, H2, P2, BKEY, BPAR, GNXT, GPRV = range(10)
LEAF_ROWS = 10
N, N2, SCLOCK = range(3)


def key_arrays(encoded) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, key_ids)`` of an EncodedWorkload, contiguous int64: a twin finds the parent key of the
    block at ``pos`` of request ``seq`` at ``key_ids[offsets[seq] + pos - 1]``."""
    return (np.ascontiguousarray(encoded.offsets, dtype=np.int64),
            np.ascontiguousarray(encoded.key_ids, dtype=np.int64))


@nb.njit(cache=True)
def leaf_insert(B, K, b, key, parent, child):
    """``b`` got ``key``; ``parent`` is the previous block's key (-1 for a sequence's first block)."""
    B[BKEY, b] = key
    B[BPAR, b] = parent
    if parent >= 0:
        K[child, parent] += 1


@nb.njit(cache=True)
def _unpark(B, K, M, b, ghead):
    heap_remove(B, M, H2, P2, KEY, STAMP, N2, b)
    prv, nxt = B[GPRV, b], B[GNXT, b]
    if prv >= 0:
        B[GNXT, prv] = nxt
    else:
        K[ghead, B[BKEY, b]] = nxt
    if nxt >= 0:
        B[GPRV, nxt] = prv


@nb.njit(cache=True)
def leaf_drop(B, K, M, b, ghead):
    """Forget evictable ``b``'s entry, queued or parked (a pin or an eviction)."""
    if B[P, b] >= 0:
        heap_remove(B, M, H, P, KEY, STAMP, N, b)
    elif B[P2, b] >= 0:
        _unpark(B, K, M, b, ghead)


@nb.njit(cache=True)
def leaf_push(B, M, b, key):
    """``b`` becomes evictable with heap key ``key`` (its unpin stamp breaks ties)."""
    heap_push_stamped(B, M, H, P, KEY, STAMP, N, SCLOCK, b, key)


@nb.njit(cache=True)
def leaf_victim(B, K, M, child, ghead):
    """The smallest evictable leaf, parking the non-leaves met on the way; else the smallest parked."""
    while M[N] > 0:
        b = B[H, 0]
        k = B[BKEY, b]
        if K[child, k] == 0:
            return b
        heap_remove(B, M, H, P, KEY, STAMP, N, b)
        heap_push(B, M, H2, P2, KEY, STAMP, N2, b)
        head = K[ghead, k]
        B[GPRV, b] = -1
        B[GNXT, b] = head
        if head >= 0:
            B[GPRV, head] = b
        K[ghead, k] = b
    return B[H2, 0]


@nb.njit(cache=True)
def leaf_evict(B, K, M, b, child, ghead):
    """``b`` left the cache: drop its entry; a parent key left without cached children releases its
    parked blocks (same entries)."""
    leaf_drop(B, K, M, b, ghead)
    parent = B[BPAR, b]
    B[BKEY, b] = -1
    B[BPAR, b] = -1
    if parent >= 0:
        left = K[child, parent] - 1
        K[child, parent] = left
        if left == 0:
            x = K[ghead, parent]
            K[ghead, parent] = -1
            while x >= 0:
                nxt = B[GNXT, x]
                heap_remove(B, M, H2, P2, KEY, STAMP, N2, x)
                heap_push(B, M, H, P, KEY, STAMP, N, x)
                x = nxt
