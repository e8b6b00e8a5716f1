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

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, register_policy

MIN_MEAN_S = 1e-3


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


# ---------------------------------------------------------------------- compiled twin
# The replay kernel's hooks get the request index ``seq``; ``compiled_params`` turns the per-request
# context of the workload given to ``prepare`` into arrays: ``arrival`` (s) and rows TKEY (the arrival's
# float key: an int64 ordered like the float, -0.0 == 0.0) and RCAT (dense id of the category
# ``(label, min(turn, max_turn))``).
#
# State: (B, I, F), three arrays (numba increments and decrements the reference count of every array a
# hook unpacks or passes on: few arrays keep the hooks cheap).
# * B (int64, row x block): the block's last access (LSEQ request, LCAT category), its position POS, its
#   queue entry (QCAT category or -1, TK = TKEY of its access time, NPOS = -position, STAMP = unpin
#   stamp, ESEQ = request of its access time) and its node in the category's pairing heap (CH first
#   child, SB next sibling, PV previous sibling or parent; -1 = none). A category's queue is a pairing
#   heap ordered by (TK, NPOS, STAMP), the Python queue's (time, -position, stamp): O(1) push, O(log n)
#   amortised removal, per-block storage only, however many categories there are.
# * I (int64, flat): meta slots (CLOCK stamp clock, NCATS categories created, POOLED pooled fit current,
#   sizes and section offsets), then per category rows ROOT (heap root), NS (samples in the window), RH
#   (ring start), FIT (1 when its fit in F is current), ORD (the categories in creation order: the Python
#   list ``_cats``); per key rows KSEQ (request of its last access, -1 never), KCAT (its category); per
#   request rows TKEY, RCAT.
# * F (float64, flat): NOW (latest time seen), LIFE (life_s); per category rows TOTAL, ACC, REU (the Python
#   fields), RATE, LOGP, LOGT (its fit and the fit's log(-expm1(-rate life)) term), with one more column
#   for the pooled fit; the sample windows (ring per category, ``window`` slots); the arrival times.
LSEQ, LCAT, POS, QCAT, TK, NPOS, STAMP, ESEQ, CH, SB, PV = range(11)
CLOCK, NCATS, POOLED, NCAT, NKEYS, NREQ, WINDOW, MINS, IC, IK, IR, FC, FS, FA = range(14)
ROOT, NS, RH, FIT, ORD = range(5)
KSEQ, KCAT = range(2)
TKEY, RCAT = range(2)
NOW, LIFE = range(2)
TOTAL, ACC, REU, RATE, LOGP, LOGT = range(6)


def request_categories(encoded: object, max_turn: int) -> tuple[np.ndarray, np.ndarray]:
    """``(arrival float64, int64 rows [TKEY, RCAT] x requests)`` of an EncodedWorkload (see above)."""
    n = len(encoded.prompt_tokens)  # type: ignore[attr-defined]
    arrival = getattr(encoded, "arrival", None)
    codes = getattr(encoded, "category_codes", None)
    turn = getattr(encoded, "turn", None)
    arrival = np.zeros(n) if arrival is None else np.ascontiguousarray(arrival, dtype=np.float64)
    codes = np.full(n, -1, np.int64) if codes is None else np.asarray(codes, dtype=np.int64)
    turn = np.full(n, -1, np.int64) if turn is None else np.asarray(turn, dtype=np.int64)
    rq = np.zeros((2, n), np.int64)
    bits = arrival.view(np.int64)
    rq[TKEY] = np.where(bits < 0, -(bits & 0x7FFFFFFFFFFFFFFF), bits)
    if n:
        pairs = np.stack([codes, np.minimum(turn, max_turn)], axis=1)
        rq[RCAT] = np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1)
    return arrival, rq


@nb.njit(cache=True, inline="always")
def _ci(I, row, c):
    """Index in I of per-category ``row`` of category ``c``."""
    return I[IC] + row * I[NCAT] + c


@nb.njit(cache=True, inline="always")
def _fi(I, row, c):
    """Index in F of per-category ``row`` of category ``c`` (``c`` = NCAT: the pooled fit)."""
    return I[FC] + row * (I[NCAT] + 1) + c


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    par, arrival, rq = params
    n = arrival.shape[0]
    window = np.int64(par[1])
    ncat = 1
    for r in range(n):
        if rq[RCAT, r] >= ncat:
            ncat = rq[RCAT, r] + 1
    B = np.full((11, capacity), -1, np.int64)
    ic = 14
    ik = ic + 5 * ncat
    ir = ik + 2 * num_keys
    I = np.zeros(ir + 2 * n, np.int64)
    I[CLOCK] = 1
    I[NCAT] = ncat
    I[NKEYS] = num_keys
    I[NREQ] = n
    I[WINDOW] = window
    I[MINS] = np.int64(par[2])
    I[IC] = ic
    I[IK] = ik
    I[IR] = ir
    I[ic + ROOT * ncat : ic + (ROOT + 1) * ncat] = -1
    I[ik:ir] = -1
    I[ir : ir + n] = rq[TKEY]
    I[ir + n : ir + 2 * n] = rq[RCAT]
    fc = 2
    fs = fc + 6 * (ncat + 1)
    fa = fs + ncat * window
    F = np.zeros(fa + n, np.float64)
    F[NOW] = -np.inf
    F[LIFE] = par[0]
    F[fa:] = arrival
    I[FC] = fc
    I[FS] = fs
    I[FA] = fa
    return (B, I, F)


@nb.njit(cache=True, inline="always")
def _less(B, a, b):
    """Queue order (time, -position, stamp): entry ``a`` before entry ``b``."""
    if B[TK, a] != B[TK, b]:
        return B[TK, a] < B[TK, b]
    if B[NPOS, a] != B[NPOS, b]:
        return B[NPOS, a] < B[NPOS, b]
    return B[STAMP, a] < B[STAMP, b]


@nb.njit(cache=True)
def _link(B, a, b):
    """Meld two pairing-heap roots; returns the new root (the other becomes its first child)."""
    if _less(B, b, a):
        a, b = b, a
    c = B[CH, a]
    B[SB, b] = c
    if c >= 0:
        B[PV, c] = b
    B[PV, b] = a
    B[CH, a] = b
    return a


@nb.njit(cache=True)
def _combine(B, first):
    """One root for the sibling list starting at ``first`` (two-pass pairing); -1 if empty."""
    stack = -1
    x = first
    while x >= 0:  # pass 1: meld pairs left to right, stacking the results (linked through SB)
        y = B[SB, x]
        if y < 0:
            nxt = -1
            r = x
        else:
            nxt = B[SB, y]
            B[SB, y] = -1
            B[PV, y] = -1
            r = _link(B, x, y)
        B[PV, r] = -1
        B[SB, r] = stack
        stack = r
        x = nxt
    if stack < 0:
        return -1
    root = stack  # pass 2: meld the pairs right to left
    stack = B[SB, root]
    B[SB, root] = -1
    while stack >= 0:
        nxt = B[SB, stack]
        B[SB, stack] = -1
        root = _link(B, root, stack)
        stack = nxt
    return root


@nb.njit(cache=True)
def _queue_remove(B, I, b):
    """Take ``b``'s entry out of its category's queue."""
    i = _ci(I, ROOT, B[QCAT, b])
    if I[i] == b:
        I[i] = _combine(B, B[CH, b])
    else:
        p = B[PV, b]
        s = B[SB, b]
        if B[CH, p] == b:
            B[CH, p] = s
        else:
            B[SB, p] = s
        if s >= 0:
            B[PV, s] = p
        sub = _combine(B, B[CH, b])
        if sub >= 0:
            I[i] = _link(B, I[i], sub)
    B[CH, b] = -1
    B[SB, b] = -1
    B[PV, b] = -1
    B[QCAT, b] = -1


@nb.njit(cache=True)
def _access(state, b, key, seq):
    """WorkloadAware._access: the same samples and counts, the same float operations."""
    B, I, F = state
    t = F[I[FA] + seq]
    if t > F[NOW]:
        F[NOW] = t
    c = I[I[IR] + RCAT * I[NREQ] + seq]
    if F[_fi(I, ACC, c)] == 0.0:  # first access (ACC >= 1 afterwards): the category is created
        I[_ci(I, ORD, I[NCATS])] = c
        I[NCATS] += 1
    ks = I[IK] + KSEQ * I[NKEYS] + key
    kc = I[IK] + KCAT * I[NKEYS] + key
    ps = I[ks]
    if ps >= 0:  # a reuse of ``key``: one sample for the category of its previous access
        dt = t - F[I[FA] + ps]
        if dt < 0.0:
            dt = 0.0
        pc = I[kc]
        window = I[WINDOW]
        ring = I[FS] + pc * window
        ns = I[_ci(I, NS, pc)]
        if ns >= window:
            rh = _ci(I, RH, pc)
            h = I[rh]
            F[_fi(I, TOTAL, pc)] -= F[ring + h]
            F[ring + h] = dt
            I[rh] = h + 1 if h + 1 < window else 0
        else:
            F[ring + ns] = dt
            I[_ci(I, NS, pc)] = ns + 1
        F[_fi(I, TOTAL, pc)] += dt
        F[_fi(I, REU, pc)] += 1.0
        I[_ci(I, FIT, pc)] = 0
    a = F[_fi(I, ACC, c)] + 1.0
    if a >= 2 * I[WINDOW]:
        a *= 0.5
        F[_fi(I, REU, c)] *= 0.5
    F[_fi(I, ACC, c)] = a
    I[_ci(I, FIT, c)] = 0
    I[POOLED] = 0
    I[ks] = seq
    I[kc] = c
    B[LSEQ, b] = seq
    B[LCAT, b] = c


@nb.njit(cache=True)
def _fit_into(I, F, c, n, total, reuses, accesses):
    """The module's ``fit`` (the same operations) and its log(-expm1(-rate life)) term, into column ``c``."""
    m = n * MIN_MEAN_S
    rate = n / (m if m > total else total)
    if accesses > 0:
        q = reuses / accesses
        p = q if q < 1.0 else 1.0
    else:
        p = 1.0
    F[_fi(I, RATE, c)] = rate
    F[_fi(I, LOGP, c)] = math.log(1e-300 if p < 1e-300 else p)
    F[_fi(I, LOGT, c)] = math.log(-math.expm1(-rate * F[LIFE]))


@nb.njit(cache=True)
def _log_reuse_prob(I, F, c, age):
    """WorkloadAware.log_reuse_prob for category ``c``: the same fit, the same float operations."""
    if I[_ci(I, NS, c)] >= I[MINS]:
        if I[_ci(I, FIT, c)] == 0:
            _fit_into(I, F, c, I[_ci(I, NS, c)], F[_fi(I, TOTAL, c)], F[_fi(I, REU, c)], F[_fi(I, ACC, c)])
            I[_ci(I, FIT, c)] = 1
        col = c
    else:  # the pooled fit, summed in creation order as the Python class does
        col = I[NCAT]
        if I[POOLED] == 0:
            n = 0
            for i in range(I[NCATS]):
                n += I[_ci(I, NS, I[_ci(I, ORD, i)])]
            if n >= I[MINS]:
                total = 0.0
                for i in range(I[NCATS]):
                    total += F[_fi(I, TOTAL, I[_ci(I, ORD, i)])]
                reuses = 0.0
                for i in range(I[NCATS]):
                    reuses += F[_fi(I, REU, I[_ci(I, ORD, i)])]
                accesses = 0.0
                for i in range(I[NCATS]):
                    accesses += F[_fi(I, ACC, I[_ci(I, ORD, i)])]
                _fit_into(I, F, col, n, total, reuses, accesses)
            else:
                rate = 1.0 / F[LIFE]
                F[_fi(I, RATE, col)] = rate
                F[_fi(I, LOGP, col)] = 0.0
                F[_fi(I, LOGT, col)] = math.log(-math.expm1(-rate * F[LIFE]))
            I[POOLED] = 1
    rate = F[_fi(I, RATE, col)]
    return F[_fi(I, LOGP, col)] - rate * (0.0 if age < 0.0 else age) + F[_fi(I, LOGT, col)]


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][POS, b] = pos
    _access(state, b, key, seq)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    _access(state, b, key, seq)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    _queue_remove(state[0], state[1], b)


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, I, F = state
    t = F[I[FA] + seq]
    if t > F[NOW]:
        F[NOW] = t
    c = B[LCAT, b]
    es = B[LSEQ, b]
    B[QCAT, b] = c
    B[TK, b] = I[I[IR] + TKEY * I[NREQ] + es]
    B[NPOS, b] = -B[POS, b]
    B[STAMP, b] = I[CLOCK]
    I[CLOCK] += 1
    B[ESEQ, b] = es
    B[CH, b] = -1
    B[SB, b] = -1
    B[PV, b] = -1
    i = _ci(I, ROOT, c)
    root = I[i]
    I[i] = b if root < 0 else _link(B, root, b)


@nb.njit(cache=True)
def _victim(state):
    """The smallest (log reuse probability, -position, time, stamp) over the category queues' heads."""
    B, I, F = state
    now = F[NOW]
    fa = I[FA]
    best = -1
    best_c = -1
    best_lp = 0.0
    count = 0
    for i in range(I[NCATS]):
        c = I[_ci(I, ORD, i)]
        e = I[_ci(I, ROOT, c)]
        if e < 0:
            continue
        count += 1
        if count == 1:
            best, best_c = e, c
            continue
        if count == 2:  # more than one candidate: score them
            best_lp = _log_reuse_prob(I, F, best_c, now - F[fa + B[ESEQ, best]])
        lp = _log_reuse_prob(I, F, c, now - F[fa + B[ESEQ, e]])
        if lp != best_lp:
            better = lp < best_lp
        elif B[NPOS, e] != B[NPOS, best]:
            better = B[NPOS, e] < B[NPOS, best]
        elif B[TK, e] != B[TK, best]:
            better = B[TK, e] < B[TK, best]
        else:
            better = B[STAMP, e] < B[STAMP, best]
        if better:
            best, best_c, best_lp = e, c, lp
    return best


@nb.njit(cache=True)
def _on_evict(state, b):
    _queue_remove(state[0], state[1], b)


WorkloadAware.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)
