"""SGLang RadixAttention eviction: least recently used among the leaves of the prefix tree.

Source: L. Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(NeurIPS'24), §3 RadixAttention: "an LRU eviction policy that recursively evicts leaf nodes";
sglang/srt/mem_cache/radix_cache.py (``evict`` pops leaves from a heap on ``last_access_time``;
``match_prefix`` and ``insert`` refresh it; nodes with a lock (ref) count are skipped).

Choices:

* Candidates are evictable blocks without cached children (``cache.num_cached_children(key) == 0``);
  evicting a leaf can make its parent a candidate (see ``kvlab.policies._heap``). A radix node spans a
  run of tokens; here a node is one block.
* Recency is the last *access* (a hit or the insert), not the unpin as in vLLM's LRU: SGLang refreshes
  ``last_access_time`` on match and insert. Accesses are numbered per request by a logical clock (a
  new request = a new ``(ctx.seq, ctx.request_id)``; SGLang uses wall time), so runs are deterministic.
  Within one request the deeper block counts as older. One request's blocks lie on one path, of which
  only the deepest cached block can be a leaf, so among leaves this is exactly SGLang's order; it only
  spares the policy from skipping over the path's interior blocks.
* If no evictable block is a leaf (only when every evictable block has a pinned child, e.g. duplicates),
  the least recently accessed evictable block is evicted.
* State does not survive eviction.

Cost: O(log n) per event, amortised (Python: the lazy heap of ``kvlab.policies._heap``, mostly its O(1)
run since last accesses grow with time; a non-leaf parked at most once per non-leaf period; the
fallback scans the parked blocks).

Compiled twin (numba, run by the replay driver's compiled engine; tested hit for hit, every replay
column, against this class): the layout of pgdsf's twin with an integer priority. The victim this class
picks is the smallest entry ``(last access when unpinned, unpin stamp)`` among the evictable leaves, or
among all evictable blocks when none is a leaf; the twin keeps an indexed heap of the queued blocks and
one of the parked blocks (the fallback is its top), per-key groups of parked blocks released as soon as
the key's count of cached children (tracked by the twin, the parent of position ``p`` being the
request's key at ``p - 1``) drops to 0, and the request clock ticking on a new ``seq``. O(log n) per
event. ``compiled_params()`` needs ``prepare(encoded)`` first: ``(offsets, key_ids)``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._heap import LeafHeapPolicy
from kvlab.policies._leaf import (
    BKEY,
    BPAR,
    GNXT,
    GPRV,
    LEAF_ROWS,
    P2,
    P,
    key_arrays,
    leaf_drop,
    leaf_evict,
    leaf_insert,
    leaf_push,
    leaf_victim,
)
from kvlab.policies.base import register_policy

_POS_LIMIT = (1 << 31) - 1


@register_policy("sglang-leaf")
class SGLangLeaf(LeafHeapPolicy):
    """Least recently accessed leaf first."""

    source = "SGLang RadixAttention (radix_cache.py): LRU over leaf nodes by last access"

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0
        self._seq: int | None = None
        self._rid: int | None = None
        self._last: list[int] = []
        self._encoded: object | None = None

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._last = [0] * cache.num_blocks  # type: ignore[attr-defined]

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq != self._seq or ctx.request_id != self._rid:
            self._seq, self._rid = ctx.seq, ctx.request_id
            self._clock += 1
        # (request clock, -position) in one int; positions below 2**31
        self._last[block.block_id] = (self._clock << 31) | (_POS_LIMIT - block.position)

    on_hit = on_insert

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        self._push(bid, self._last[bid])

    def prepare(self, encoded: object) -> None:
        """Keep the replay's encoded workload: the compiled twin reads its key ids (a block's parent key)."""
        self._encoded = encoded

    def compiled_params(self) -> tuple:
        """``(offsets, key_ids)`` of the prepared workload."""
        return key_arrays(self.prepared())


# ---------------------------------------------------------------------- compiled twin
# state: (B, K, M, offsets, key_ids), on the leaf machinery of kvlab/policies/_leaf.py (its B rows and
# M slots) with an integer priority: B row LAST = the last access, as in the class (request clock << 31 |
# -position), the heap key at unpin. K (per dense key): CHILD (cached blocks whose parent is this key),
# GHEAD (first parked block, -1 none). M = [queued heap size, parked heap size, stamp clock, request
# clock, seq of the request clock].
LAST = LEAF_ROWS
CHILD, GHEAD = range(2)
RCLOCK, RSEQ = 3, 4


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    offsets, key_ids = params
    Bt = np.zeros((capacity, LEAF_ROWS + 1), np.int64)
    B = Bt.T
    for row in (P, P2, BKEY, BPAR, GNXT, GPRV):
        B[row] = -1
    Kt = np.zeros((num_keys, 2), np.int64)
    K = Kt.T
    K[GHEAD] = -1
    M = np.zeros(5, np.int64)
    M[RSEQ] = -1
    return (B, K, M, offsets, key_ids)


@nb.njit(cache=True, inline="always")
def _touch(state, b, seq, pos):
    M = state[2]
    if seq != M[RSEQ]:  # a new request: the logical clock ticks
        M[RSEQ] = seq
        M[RCLOCK] += 1
    state[0][LAST, b] = (M[RCLOCK] << 31) | (_POS_LIMIT - pos)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    _touch(state, b, seq, pos)
    parent = state[4][state[3][seq] + pos - 1] if pos > 0 else -1
    leaf_insert(state[0], state[1], b, key, parent, CHILD)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    # an evictable block's heap entry stays (as in Python): on_pin follows and takes it out
    _touch(state, b, seq, pos)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    leaf_drop(state[0], state[1], state[2], b, GHEAD)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B = state[0]
    leaf_push(B, state[2], b, B[LAST, b])


@nb.njit(cache=True)
def _victim(state):
    return leaf_victim(state[0], state[1], state[2], CHILD, GHEAD)


@nb.njit(cache=True)
def _on_evict(state, b):
    leaf_evict(state[0], state[1], state[2], b, CHILD, GHEAD)


SGLangLeaf.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
