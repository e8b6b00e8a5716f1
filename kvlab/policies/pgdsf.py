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

A leaf-only priority policy (kvlab.policies._priority; the clock is its aging slot): the same float
operations in both engines (bit-identical), the per-key statistics in per-key fields (arrays over the
dense key ids in the compiled twin). ``compiled_params()`` needs ``prepare(encoded)`` first (the replay
driver calls it): ``([attention_ratio, block_size], prompt_tokens, offsets, key_ids)``.
"""

from __future__ import annotations

import numba as nb

from kvlab.policies._priority import LeafPriorityPolicy, Priority, field
from kvlab.policies.base import register_policy
from kvlab.policies.gdsf import LLAMA2_7B_ATTENTION_RATIO, AttentionRatio

PRIO = 0  # per-block float field: the current priority
FREQ, MEAN, CNT = 0, 1, 2  # per-key fields: frequency, mean span cost (float), computations
CLOCK, SPAN_COST, SPAN_SEQ, SPAN_RID = 0, 1, 2, 3  # global slots: float, float, int, int
AR, BS = 0, 1  # parameters: attention_ratio, block size


@nb.njit(cache=True)
def span_cost(attention_ratio, cached_tokens, new_tokens):
    """Mean per-token prefill cost of ``new_tokens`` computed after ``cached_tokens``."""
    return 1.0 + attention_ratio * (cached_tokens + (new_tokens + 1) / 2)


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    g = s.globi
    if r.seq != g[SPAN_SEQ] or r.request_id != g[SPAN_RID]:  # a new request: its span cost
        g[SPAN_SEQ] = r.seq
        g[SPAN_RID] = r.request_id
        bs = int(s.par[BS])
        c = pos * bs
        s.glob[SPAN_COST] = span_cost(s.par[AR], c, max(r.prompt_tokens - c, bs))
    cost = s.glob[SPAN_COST]
    freq, mean, cnt = s.key[FREQ], s.keyf[MEAN], s.key[CNT]
    n = cnt[key] + 1
    if n == 1:
        freq[key] = 1
        mean[key] = cost
        cnt[key] = 1
        s.blkf[PRIO][b] = s.glob[CLOCK] + cost
    else:
        f = freq[key] + 1
        m = mean[key] + (cost - mean[key]) / n
        freq[key] = f
        mean[key] = m
        cnt[key] = n
        s.blkf[PRIO][b] = s.glob[CLOCK] + f * m


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    f = s.key[FREQ][key] + 1
    s.key[FREQ][key] = f
    s.blkf[PRIO][b] = s.glob[CLOCK] + f * s.keyf[MEAN][key]


@nb.njit(cache=True)
def _priority(s, b, r):
    return s.blkf[PRIO][b]


class _KeyStats:
    """A key's statistics as a list (read-only view of the Python state's per-key fields)."""

    def __init__(self, fields: list) -> None:
        self.fields = fields

    def __getitem__(self, key: object) -> list:
        return [self.fields[FREQ][key], self.fields[MEAN][key], self.fields[CNT][key]]


@register_policy("pgdsf")
class PGDSF(LeafPriorityPolicy):
    """RAGCache PGDSF: lowest ``clock + key frequency * prefix-aware cost`` among leaf blocks."""

    source = "RAGCache (Jin et al., arXiv 2404.12457) PGDSF; leaf-only; FLOP cost model"
    spec = Priority(_priority, _insert, _hit, block=(0.0,), key=(0, 0.0, 0), glob=(0.0, 1.0, -1, -1),
                    float_priority=True, aging=CLOCK, layout=("par", "prompt_tokens", "offsets", "key_ids"))
    clock = property(lambda self: self.state.glob[CLOCK])
    _prio = field(PRIO)
    _stats = property(lambda self: _KeyStats(self.state.key))  # key -> [frequency, mean cost, computations]

    def __init__(self, attention_ratio: AttentionRatio = LLAMA2_7B_ATTENTION_RATIO) -> None:
        super().__init__()
        self.attention_ratio = float(attention_ratio)

    def params(self) -> list[float]:
        return [self.attention_ratio, self.block_size]

    def span_cost(self, cached_tokens: int, new_tokens: int) -> float:
        """Mean per-token prefill cost of ``new_tokens`` computed after ``cached_tokens``."""
        return span_cost(self.attention_ratio, cached_tokens, new_tokens)
