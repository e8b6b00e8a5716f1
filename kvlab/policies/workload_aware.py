"""Workload-aware eviction of "KVCache Cache in the Wild" (Wang et al., USENIX ATC'25, arXiv 2506.02634).

Source: §3.3-3.4 (a request *category* is the request type plus its turn number; per category, the
KV$ reuse time follows an exponential distribution that is stable over an hour) and §4.2 (the policy,
Figure 24): ``Priority = (ReuseProb_w(t, life), -Offset)`` compared lexicographically, lowest evicted
first, where ``t`` is the time since the block's last access, ``ReuseProb_w`` the probability, from the
exponential fitted to recently sampled reuse times of the block's category ``w``, that the block is
reused within ``[t, t + life)``, ``life`` the expected lifespan of KV$ blocks, and ``Offset`` the
block's position in its request (head blocks are kept). Frequency is deliberately not used. The
paper's optimisation keeps one queue per category ordered by last access and compares only the
queue heads at eviction time (O(categories)); this implementation does the same (a queue is a run of
entries pushed in order plus a heap for the rest, so the usual in-order pushes cost O(1)).

kvlab's reading, with the parameters:

* Category ``w = (ctx.category, min(ctx.turn, max_turn))`` of the request that last accessed the block
  (turns above ``max_turn`` share one category, so the number of queues stays in the tens).
* Reuse samples are observed per *key* (a later request using the same key, hit or recomputed after
  eviction, is a reuse), attributed to the category of the previous access: the workload's reuse times,
  not only those the cache happened to keep. Each category keeps a sliding window of its last
  ``window`` samples; the exponential's rate is their maximum-likelihood estimate
  ``lambda = n / sum(samples)`` (mean clipped to >= 1 ms). ``p_w``, the share of accesses that are ever
  reused (the plateau of the fitted CDF; e.g. single-turn requests are reused less), is the reuses over
  the accesses of the category, both halved whenever the accesses reach ``2 * window``.
* ``ReuseProb_w(t, life) = p_w * (exp(-lambda t) - exp(-lambda (t + life)))``, compared as its
  logarithm (no underflow for old blocks). Within a category it decreases with ``t``, so the queue
  head (oldest last access; on equal times the larger position) is that category's candidate.
* A category with fewer than ``min_samples`` samples uses the pooled fit (all categories' windows and
  counts together); with no samples at all, ``lambda = 1 / life`` and ``p = 1``. With one category
  (traces without category information) the policy orders by last access (LRU) with the tail of a
  request first, as the paper reports for such traces.
* Time is ``ctx.time`` in seconds; last access = time of the insert or hit; "now" for ``victim()`` is the
  latest time seen (``victim()`` gets no context). Ties: larger position, older access, then push order.
* Reuse statistics are per key and category and survive eviction; a block's queue entry does not.

Defaults: ``life_s=600`` (Trace A: 90 % of blocks are not reused after 612 s, §3.5), ``window=1000``,
``min_samples=10``, ``max_turn=10``.

Cost: an insert or hit is O(1) (one sample, one count); an unpin O(1) when in queue order (the usual
case), else O(log n); a pin is O(1) (lazy deletion); ``victim()`` is O(categories) plus, when two or
more queues are non-empty, one fit per category (cached until its statistics change; the pooled fit
sums all categories, O(categories)).

Compiled twin (``WorkloadAware.compiled``, run by the replay's compiled engine; tens of times the
Python speed): the same statistics and order in numba arrays (layout in the comment above it), equal
to this class on every replay column (tests/test_compiled_atc25.py). The per-request time, category and
turn come from the EncodedWorkload given to ``prepare`` (``compiled_params()``); each category's queue
is a pairing heap over block ids ordered by (time, -position, unpin stamp): O(1) push, O(log n)
amortised removal. Floats are bit-identical: the same operations in the same order (``math.log`` and
``math.expm1`` are libm's in both; the pooled sums are plain left-to-right additions in category
creation order, here and in the Python class), times compared through int64 keys ordered like them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from heapq import heapify, heappop, heappush
from typing import Annotated

import numpy as np
from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._workload_aware_twin import (
    MIN_MEAN_S,
    _init,
    _on_evict,
    _on_hit,
    _on_insert,
    _on_pin,
    _on_unpin,
    _victim,
    request_categories,
)
from kvlab.policies.base import EvictionPolicy, register_policy


class Category:
    """Reuse statistics and the eviction queue of one workload category."""

    __slots__ = ("name", "heap", "run", "samples", "total", "accesses", "reuses", "fitted")

    def __init__(self, name: Hashable) -> None:
        self.name = name
        # the queue, entries (last access, -position, stamp, block_id): a run of entries pushed in
        # order (the usual case: requests arrive in time order and release tail first) plus a heap
        self.heap: list[tuple[float, int, int, int]] = []
        self.run: deque[tuple[float, int, int, int]] = deque()
        self.samples: deque[float] = deque()  # the last ``window`` reuse times (s)
        self.total = 0.0  # their sum
        self.accesses = 0.0
        self.reuses = 0.0
        self.fitted: tuple[float, float] | None = None  # cached (rate, log p); None = stale


def fit(n: int, total: float, reuses: float, accesses: float) -> tuple[float, float]:
    """``(lambda per second, log p)`` of an exponential fitted to ``n`` reuse times summing to ``total``."""
    rate = n / max(total, n * MIN_MEAN_S)
    p = min(1.0, reuses / accesses) if accesses > 0 else 1.0
    return rate, math.log(max(p, 1e-300))


@register_policy("workload-aware")
class WorkloadAware(EvictionPolicy):
    """Evict the lowest (reuse probability within ``life_s``, -position) over per-category LRU heads."""

    source = "Wang et al., KVCache Cache in the Wild (USENIX ATC'25, arXiv 2506.02634) §4.2"

    def __init__(
        self,
        life_s: Annotated[float, Field(ge=MIN_MEAN_S)] = 600.0,  # below, log(1 - exp(-rate * life)) underflows
        window: Annotated[int, Field(ge=1, le=100_000)] = 1000,  # the compiled twin keeps categories x window
        min_samples: Annotated[int, Field(ge=1, le=100_000)] = 10,
        max_turn: Annotated[int, Field(ge=1, le=1000)] = 10,
    ) -> None:
        self.life_s = float(life_s)
        self.window = int(window)
        self.min_samples = int(min_samples)
        self.max_turn = int(max_turn)
        self.categories: dict[Hashable, Category] = {}
        self._cats: list[Category] = []
        self._seen: dict[Hashable, tuple[float, Category]] = {}  # key -> (last access time, category)
        self._block_use: list[tuple[float, Category] | None] = []  # block_id -> (last access time, category)
        self._stamp: list[int] = []
        self._blocks: list[KVBlock] = []
        self._last: tuple = (object(), None, None)  # (category, turn, Category) of the latest access
        self._next = 1
        self._n = 0
        self._stale = 0
        self.now = float("-inf")
        self._encoded: object | None = None

    def prepare(self, encoded: object) -> None:
        """Keep the replay's EncodedWorkload: the compiled twin reads its per-request context (the Python
        hooks read ``ctx``)."""
        self._encoded = encoded

    def compiled_params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``([life_s, window, min_samples], arrival, [TKEY, RCAT] rows)`` (see the compiled twin) of the
        workload given to ``prepare``."""
        arrival, rq = request_categories(self.prepared(), self.max_turn)
        return np.array([self.life_s, self.window, self.min_samples], dtype=np.float64), arrival, rq

    def attach(self, cache: object) -> None:
        n = cache.capacity_blocks  # type: ignore[attr-defined]
        self._blocks = cache.blocks  # type: ignore[attr-defined]
        self._block_use = [None] * n
        self._stamp = [0] * n

    def category(self, ctx: AccessContext) -> Category:
        """The statistics and queue of ``ctx``'s category (created on first use)."""
        turn = ctx.turn if ctx.turn <= self.max_turn else self.max_turn
        name = (ctx.category, turn)
        cat = self.categories.get(name)
        if cat is None:
            cat = self.categories[name] = Category(name)
            self._cats.append(cat)
        return cat

    def fit(self, cat: Category) -> tuple[float, float]:
        """``(lambda, log p)`` used for ``cat``: its own fit, the pooled one, or the no-data default."""
        if cat.fitted is None:
            if len(cat.samples) >= self.min_samples:
                cat.fitted = fit(len(cat.samples), cat.total, cat.reuses, cat.accesses)
            else:
                cats = self._cats
                n = sum(len(c.samples) for c in cats)
                if n >= self.min_samples:
                    # plain left-to-right float sums (not sum(), compensated from Python 3.12): the
                    # compiled twin adds in the same order
                    total = reuses = accesses = 0.0
                    for c in cats:
                        total += c.total
                    for c in cats:
                        reuses += c.reuses
                    for c in cats:
                        accesses += c.accesses
                    pooled = fit(n, total, reuses, accesses)
                else:
                    pooled = (1.0 / self.life_s, 0.0)
                return pooled  # not cached: other categories' samples change it
        return cat.fitted

    def log_reuse_prob(self, cat: Category, age_s: float) -> float:
        """log ReuseProb_w(t=age_s, life): reuse within ``[age, age + life)`` for a block of ``cat``."""
        rate, logp = self.fit(cat)
        return logp - rate * max(age_s, 0.0) + math.log(-math.expm1(-rate * self.life_s))

    def priority(self, block: KVBlock) -> tuple[float, int]:
        """``(log ReuseProb, -position)`` of an evictable or pinned cached block now (lowest is evicted)."""
        t, cat = self._block_use[block.block_id]  # type: ignore[misc]
        return self.log_reuse_prob(cat, self.now - t), -block.position

    def _access(self, block: KVBlock, ctx: AccessContext) -> None:
        t = ctx.time
        if t > self.now:
            self.now = t
        last = self._last
        if ctx.category != last[0] or ctx.turn != last[1]:
            last = self._last = (ctx.category, ctx.turn, self.category(ctx))
        cat = last[2]
        key = block.key
        prev = self._seen.get(key)
        if prev is not None:  # a reuse of ``key``: one sample for the category of its previous access
            dt = t - prev[0]
            if dt < 0.0:
                dt = 0.0
            pc = prev[1]
            samples = pc.samples
            if len(samples) >= self.window:
                pc.total -= samples.popleft()
            samples.append(dt)
            pc.total += dt
            pc.reuses += 1.0
            pc.fitted = None
        a = cat.accesses + 1.0
        if a >= 2 * self.window:
            a *= 0.5
            cat.reuses *= 0.5
        cat.accesses = a
        cat.fitted = None
        self._seen[key] = self._block_use[block.block_id] = (t, cat)

    on_insert = _access
    on_hit = _access

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        if ctx.time > self.now:
            self.now = ctx.time
        bid = block.block_id
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        t, cat = self._block_use[bid]  # type: ignore[misc]
        e = (t, -block.position, s, bid)
        run = cat.run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(cat.heap, e)
        self._n += 1

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._stamp[block.block_id] = 0
        self._n -= 1
        self._stale += 1
        if self._stale > self._n + 1024:
            self._compact()

    def on_evict(self, block: KVBlock) -> None:
        # the victim is a queue head: its entry is popped at the next victim()
        self._stamp[block.block_id] = 0
        self._n -= 1

    def _compact(self) -> None:
        stamp = self._stamp
        for cat in self._cats:
            cat.heap = [e for e in cat.heap if stamp[e[3]] == e[2]]
            heapify(cat.heap)
            cat.run = deque(e for e in cat.run if stamp[e[3]] == e[2])
        self._stale = 0

    def victim(self) -> KVBlock:
        stamp = self._stamp
        best = None
        best_cat = None
        count = 0
        for cat in self._cats:
            heap, run = cat.heap, cat.run
            while heap and stamp[heap[0][3]] != heap[0][2]:
                heappop(heap)
            while run and stamp[run[0][3]] != run[0][2]:
                run.popleft()
            if heap:
                e = run[0] if run and run[0] < heap[0] else heap[0]
            elif run:
                e = run[0]
            else:
                continue
            count += 1
            if best is None:
                best, best_cat = e, cat
            else:
                if count == 2:  # more than one candidate: score them
                    best = (self.log_reuse_prob(best_cat, self.now - best[0]), best[1], best[0], best[2], best[3])
                cand = (self.log_reuse_prob(cat, self.now - e[0]), e[1], e[0], e[2], e[3])
                if cand < best:
                    best = cand
        if best is None:
            raise IndexError("victim() called with no evictable block")
        return self._blocks[best[-1]]

    def __len__(self) -> int:
        return self._n



WorkloadAware.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
