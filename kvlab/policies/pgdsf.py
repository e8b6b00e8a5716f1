"""PGDSF: RAGCache's prefix-aware Greedy-Dual-Size-Frequency, on the leaves of the prefix tree.

Source: C. Jin et al., "RAGCache: Efficient Knowledge Caching for Retrieval-Augmented Generation",
arXiv 2404.12457, §5 (knowledge tree, PGDSF replacement). The search tool held only the abstract and
third-party summaries of the paper ("Priority = Clock + Frequency x Cost / Size"; "considers the
document order, size, frequency and recency"); the details below follow the paper's structure as we
read it and are documented as kvlab's choices.

``priority = clock + frequency * cost / size``, lowest evicted first; ``clock`` becomes the victim's
priority (it never decreases). A knowledge-tree node is one cached block here:

* ``size`` = 1 block (all nodes have the same size, so it only fixes the units).
* ``frequency`` = number of requests that used the node's *key* (hits and recomputations), kept across
  evictions: RAGCache counts retrievals of a document, which happen whether or not it is cached.
  (RAGCache counts within a time window; kvlab counts over the whole run.)
* ``cost`` is prefix-aware: the per-token prefill cost of the request span that computed the block,
  which depends on how much of the prefix was cached then. A request with ``c`` cached tokens computes
  ``n`` new ones, token ``i`` attending over ``c + i`` tokens, so its mean per-token cost is
  ``1 + attention_ratio * (c + (n + 1) / 2)`` (units: linear FLOPs per token; ``attention_ratio`` as in
  ``gdsf``, the profiled-time table of RAGCache replaced by this FLOP model). A key's cost is the mean
  over every time it was computed, kept across evictions. ``c`` is the position of the request's first
  inserted block times the block size; ``n = prompt_tokens - c`` (at least one block).
* Only leaves are evicted (blocks whose key has no cached children), as RAGCache evicts leaf nodes of
  its knowledge tree to keep every cached node reachable; see ``kvlab.policies._heap``.
* Ties go to the least recently unpinned block. One clock per cache (per tier).

Units: priorities in cost units; ``block_size`` (from the cache) in tokens.

Cost: O(log n) per event, amortised (Python: the lazy heap of ``kvlab.policies._heap``, a non-leaf
parked at most once per non-leaf period; the fallback when only parked blocks are evictable scans them).

Compiled twin (numba, run by the replay driver's compiled engine; tested hit for hit, every replay
column, against this class). The victim this class picks is, in every case, the smallest entry
``(priority when unpinned, unpin stamp)`` among the evictable leaves, or among all evictable blocks when
none is a leaf (its parked blocks always have cached children: a key's group is released when its last
cached child goes). The twin keeps that order directly: an indexed heap of the queued blocks keyed by
(priority bits, stamp) -- priorities are positive, so their IEEE bits order like the floats -- a second
one of the parked blocks (the fallback is its top, O(1)), per-key linked groups of parked blocks
released as soon as the key's count of cached children (tracked by the twin, the parent of position
``p`` being the request's key at ``p - 1``) drops to 0, and the per-key statistics in arrays over the
dense key ids (they survive eviction). Floats are computed with this class's operations in the same
order (bit-identical). ``compiled_params()`` needs ``prepare(encoded)`` first (the replay driver calls
it): ``([attention_ratio, block_size], prompt_tokens, offsets, key_ids)``.
"""

from __future__ import annotations

from collections.abc import Hashable

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
from kvlab.policies.gdsf import LLAMA2_7B_ATTENTION_RATIO, AttentionRatio


@register_policy("pgdsf")
class PGDSF(LeafHeapPolicy):
    """RAGCache PGDSF: lowest ``clock + key frequency * prefix-aware cost`` among leaf blocks."""

    source = "RAGCache (Jin et al., arXiv 2404.12457) PGDSF; leaf-only; FLOP cost model"

    def __init__(self, attention_ratio: AttentionRatio = LLAMA2_7B_ATTENTION_RATIO) -> None:
        super().__init__()
        self.attention_ratio = float(attention_ratio)
        self.clock = 0.0
        self._stats: dict[Hashable, list] = {}  # key -> [frequency, mean cost, computations]
        self._prio: list[float] = []
        self._block_size = 1
        self._span_seq: int | None = None  # (seq, request_id) of the request whose span cost is cached
        self._span_rid: int | None = None
        self._span_cost = 1.0
        self._encoded: object | None = None

    def prepare(self, encoded: object) -> None:
        """Keep the replay's encoded workload: the compiled twin reads its block size, prompt lengths and
        key ids (a block's parent key)."""
        self._encoded = encoded

    def compiled_params(self) -> tuple:
        """``([attention_ratio, block_size], prompt_tokens, offsets, key_ids)`` of the prepared workload."""
        enc = self.prepared()
        return (
            np.array([self.attention_ratio, enc.block_size], dtype=np.float64),  # type: ignore[attr-defined]
            np.ascontiguousarray(enc.prompt_tokens, dtype=np.int64),  # type: ignore[attr-defined]
            *key_arrays(enc),
        )

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._prio = [0.0] * cache.num_blocks  # type: ignore[attr-defined]
        self._block_size = cache.block_size  # type: ignore[attr-defined]

    def span_cost(self, cached_tokens: int, new_tokens: int) -> float:
        """Mean per-token prefill cost of ``new_tokens`` computed after ``cached_tokens``."""
        return 1.0 + self.attention_ratio * (cached_tokens + (new_tokens + 1) / 2)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.seq != self._span_seq or ctx.request_id != self._span_rid:  # a new request: its span cost
            self._span_seq, self._span_rid = ctx.seq, ctx.request_id
            c = block.position * self._block_size
            self._span_cost = self.span_cost(c, max(ctx.prompt_tokens - c, self._block_size))
        cost = self._span_cost
        key = block.key
        st = self._stats.get(key)
        if st is None:
            self._stats[key] = [1, cost, 1]
            self._prio[block.block_id] = self.clock + cost
        else:
            f, n = st[0] + 1, st[2] + 1
            mean = st[1] + (cost - st[1]) / n
            st[0], st[1], st[2] = f, mean, n
            self._prio[block.block_id] = self.clock + f * mean

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        st = self._stats[block.key]
        f = st[0] + 1
        st[0] = f
        self._prio[block.block_id] = self.clock + f * st[1]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        self._push(bid, self._prio[bid])

    def on_evict(self, block: KVBlock) -> None:
        h = self._prio[block.block_id]
        if h > self.clock:
            self.clock = h
        super().on_evict(block)

    def on_remove(self, block: KVBlock) -> None:
        super().on_evict(block)


# ---------------------------------------------------------------------- compiled twin
# state: (B, Bf, K, Kf, M, F, prompt_tokens, offsets, key_ids), on the leaf machinery of
# kvlab/policies/_leaf.py (its B rows and M slots; heap keys = IEEE bits of the priority when unpinned,
# positive, so their bits order like them). B row PRIO (float bits, Bf = B's float64 view): the current
# priority. K (per dense key, int64; Kf its float64 view): FREQ, CNT (computations), MEAN (float bits:
# mean span cost), CHILD (cached blocks whose parent is this key), GHEAD (first parked block, -1 none).
# B and K are transposes of row-per-block / row-per-key arrays (one block's or key's fields share cache
# lines: about twice as fast on Mooncake as the field-major layout, the key arrays being large).
# M = [queued heap size, parked heap size, stamp clock, seq of the span cost, block size];
# F = [clock, span cost, attention_ratio].
PRIO = LEAF_ROWS
FREQ, CNT, MEAN, CHILD, GHEAD = range(5)
SPAN, BS = 3, 4
CLOCK, SPANC, AR = range(3)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    values, prompt, offsets, key_ids = params
    Bt = np.zeros((capacity, LEAF_ROWS + 1), np.int64)
    B = Bt.T
    Bf = Bt.view(np.float64).T
    for row in (P, P2, BKEY, BPAR, GNXT, GPRV):
        B[row] = -1
    Kt = np.zeros((num_keys, 5), np.int64)
    K = Kt.T
    Kf = Kt.view(np.float64).T
    K[GHEAD] = -1
    M = np.zeros(5, np.int64)
    M[SPAN] = -1
    M[BS] = np.int64(values[1])
    F = np.zeros(3, np.float64)
    F[AR] = values[0]
    return (B, Bf, K, Kf, M, F, prompt, offsets, key_ids)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B, Bf, K, Kf, M, F = state[0], state[1], state[2], state[3], state[4], state[5]
    if seq != M[SPAN]:  # the request's first inserted block: its span cost (PGDSF.span_cost)
        M[SPAN] = seq
        bs = M[BS]
        c = pos * bs
        n = max(state[6][seq] - c, bs)
        F[SPANC] = 1.0 + F[AR] * (c + (n + 1) / 2)
    cost = F[SPANC]
    cnt = K[CNT, key]
    if cnt == 0:
        K[FREQ, key] = 1
        Kf[MEAN, key] = cost
        K[CNT, key] = 1
        Bf[PRIO, b] = F[CLOCK] + cost
    else:
        f = K[FREQ, key] + 1
        n = cnt + 1
        mean = Kf[MEAN, key] + (cost - Kf[MEAN, key]) / n
        K[FREQ, key] = f
        Kf[MEAN, key] = mean
        K[CNT, key] = n
        Bf[PRIO, b] = F[CLOCK] + f * mean
    parent = state[8][state[7][seq] + pos - 1] if pos > 0 else -1
    leaf_insert(B, K, b, key, parent, CHILD)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    # an evictable block's heap key stays (as in Python): on_pin follows and takes it out
    K, Kf = state[2], state[3]
    f = K[FREQ, key] + 1
    K[FREQ, key] = f
    state[1][PRIO, b] = state[5][CLOCK] + f * Kf[MEAN, key]


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    leaf_drop(state[0], state[2], state[4], b, GHEAD)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B = state[0]
    leaf_push(B, state[4], b, B[PRIO, b])


@nb.njit(cache=True)
def _victim(state):
    return leaf_victim(state[0], state[2], state[4], CHILD, GHEAD)


@nb.njit(cache=True)
def _on_evict(state, b):
    Bf, F = state[1], state[5]
    h = Bf[PRIO, b]
    if h > F[CLOCK]:
        F[CLOCK] = h
    leaf_evict(state[0], state[2], state[4], b, CHILD, GHEAD)


PGDSF.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
