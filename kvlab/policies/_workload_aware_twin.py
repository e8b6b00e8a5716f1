"""The compiled twin of the workload-aware policy (kvlab.policies.workload_aware, ATC'25): the same statistics
and order in numba arrays, run by the replay's compiled backend and equal to the Python class on every replay
column (tests/test_compiled_atc25.py). Written twice on purpose: the class serves every driver from the access
context (the simulator and the engine have no encoded workload), the twin reads the per-request time and
category precomputed from the EncodedWorkload (``request_categories``). Not a policy (``_`` module).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

MIN_MEAN_S = 1e-3  # the smallest mean reuse time of a fit, s (shared with the Python class)

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
