"""W-TinyLFU: a small LRU window in front of a segmented-LRU main area, admission by frequency.

Source: Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM ToS 2017
(W-TinyLFU, as in Caffeine and libCacheSim's ``WTinyLFU``). A new block enters the window (LRU, 1 % of
the capacity); the main area is an SLRU: probation, and protected (80 % of the main area) for blocks hit
while in probation. An eviction makes room for a block that will enter the window, so when the
window is full (at or over its size) its LRU block is the *candidate*: with room in the main area it
moves to probation; otherwise it is compared with the main area's victim (probation's LRU block, else
protected's) by access frequency, and the one with the lower frequency is evicted (the candidate on a
tie); an admitted candidate moves to probation. (Caffeine adds the new entry first and then evicts; in
a prefix cache the victim is chosen before the new block is placed, hence "full", not "over".)

Documented choices:

* Frequency: an exact per-key counter in place of the count-min sketch (no hash collisions, so runs
  are deterministic for any key type), with the sketch's semantics: counters saturate at
  ``max_count`` (15: 4 bits), every access counts (``on_hit`` and ``on_insert``), and every
  ``sample_factor × C`` accesses all counters are halved (TinyLFU's reset; keys at 0 are dropped).
  No doorkeeper. Counters are per key and survive eviction (that is the admission history).
* A block is placed at its first unpin (window MRU); while the window is over its size and the main
  area has room, the window's LRU blocks move to probation at once. With the main area full the
  comparison and the candidate's move happen in ``victim()`` (Caffeine's maintenance step), so a
  request's own new blocks are compared only after they are placed.
* Lists are ordered by unpin time (vLLM's LRU order); a hit in probation promotes the block to
  protected (if protected is then over its size, its LRU evictable block is demoted to probation's MRU
  end); segment sizes count placed blocks, pinned or not; a segment without an evictable block is
  skipped.
* libCacheSim's WTinyLFU uses a count-min sketch and its own SLRU, so hit vectors are not equal; the
  tests bound the difference of hit ratios on a Zipf trace.

Parameters: ``window_ratio`` (0.01), ``protected_ratio`` (0.8 of the main area), ``sample_factor``
(10), ``max_count`` (15). Sizes in blocks: window ``max(1, int(C * window_ratio))``. O(1) per event
(amortised: a reset touches every counter once per ``sample_factor × C`` accesses).

The compiled hooks (run in both engines, kvlab.policies._adapter): a linked list per segment over block
ids, counters in an int64 array over dense key ids (0 = never seen or halved to 0), a reset halving all
``num_keys`` counters (O(num_keys) per ``sample_factor × C`` accesses; tests/test_compiled_slru_wtinylfu.py
checks them against a readable reference).
"""

from __future__ import annotations

from typing import Annotated

import numba as nb
import numpy as np
from pydantic import Field

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink
from kvlab.policies.base import register_policy

WINDOW, PROBATION, PROTECTED = 0, 1, 2

# state: (B, F, M). B (per block; sentinel columns C + s = segment s's list): NXT / PRV, a linked list
# per segment (window, probation, protected) of its evictable blocks in LRU order, SEG (-1 not placed),
# LINKED (in its list), BKEY. F: the frequency of each dense key id (0 = absent from the Python dict).
# M: counts per segment (slots 0..2), sizes and counters (slots below).
NXT, PRV, SEG, LINKED, BKEY = range(5)
W_SIZE, MAIN_SIZE, PROT_SIZE, SAMPLE, ACCESSES, MAX_COUNT = range(3, 9)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((5, capacity + 3), np.int64)
    B[NXT] = np.arange(capacity + 3)
    B[PRV] = np.arange(capacity + 3)
    B[SEG] = -1
    F = np.zeros(num_keys, np.int64)
    M = np.zeros(9, np.int64)
    window = max(1, np.int64(capacity * params[0]))
    main = max(capacity - window, 0)
    M[W_SIZE] = window
    M[MAIN_SIZE] = main
    M[PROT_SIZE] = np.int64(main * params[1])
    M[SAMPLE] = max(1, np.int64(params[2] * capacity))
    M[MAX_COUNT] = np.int64(params[3])
    return (B, F, M)


@nb.njit(cache=True)
def _record(F, M, key):
    if F[key] < M[MAX_COUNT]:
        F[key] += 1
    M[ACCESSES] += 1
    if M[ACCESSES] >= M[SAMPLE]:
        for k in range(F.shape[0]):
            F[k] >>= 1
        M[ACCESSES] //= 2


@nb.njit(cache=True)
def _to_probation(B, M, b):
    dl_unlink(B, NXT, PRV, b)
    B[SEG, b] = PROBATION
    M[WINDOW] -= 1
    M[PROBATION] += 1
    dl_append(B, NXT, PRV, B.shape[1] - 3 + PROBATION, b)


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    B, F, M = state
    B[BKEY, b] = key
    _record(F, M, key)


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    B, F, M = state
    _record(F, M, key)
    seg = B[SEG, b]
    if seg < 0:
        return
    base = B.shape[1] - 3
    if seg == PROBATION:
        B[SEG, b] = PROTECTED
        M[PROBATION] -= 1
        M[PROTECTED] += 1
        if B[LINKED, b]:
            dl_unlink(B, NXT, PRV, b)
            dl_append(B, NXT, PRV, base + PROTECTED, b)
        sp = base + PROTECTED
        if M[PROTECTED] > M[PROT_SIZE] and B[NXT, sp] != sp:
            d = B[NXT, sp]
            dl_unlink(B, NXT, PRV, d)
            B[SEG, d] = PROBATION
            M[PROTECTED] -= 1
            M[PROBATION] += 1
            dl_append(B, NXT, PRV, base + PROBATION, d)
    elif B[LINKED, b]:
        dl_unlink(B, NXT, PRV, b)
        dl_append(B, NXT, PRV, base + seg, b)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B = state[0]
    dl_unlink(B, NXT, PRV, b)
    B[LINKED, b] = 0


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, F, M = state
    base = B.shape[1] - 3
    seg = B[SEG, b]
    if seg < 0:
        seg = WINDOW
        B[SEG, b] = WINDOW
        M[WINDOW] += 1
    dl_append(B, NXT, PRV, base + seg, b)
    B[LINKED, b] = 1
    if seg == WINDOW:  # window overflow moves to probation while the main area has room
        sw = base + WINDOW
        while M[WINDOW] > M[W_SIZE] and M[PROBATION] + M[PROTECTED] < M[MAIN_SIZE] and B[NXT, sw] != sw:
            _to_probation(B, M, B[NXT, sw])


@nb.njit(cache=True)
def _victim(state):
    B, F, M = state
    base = B.shape[1] - 3
    sw, sp, sq = base + WINDOW, base + PROBATION, base + PROTECTED
    while M[WINDOW] >= M[W_SIZE] and B[NXT, sw] != sw:
        cand = B[NXT, sw]
        if M[PROBATION] + M[PROTECTED] < M[MAIN_SIZE]:
            _to_probation(B, M, cand)  # room in the main area: no comparison
            continue
        if B[NXT, sp] != sp:
            mv = B[NXT, sp]
        elif B[NXT, sq] != sq:
            mv = B[NXT, sq]
        else:
            return cand
        if F[B[BKEY, cand]] > F[B[BKEY, mv]]:
            _to_probation(B, M, cand)
            return mv
        return cand
    for s in (sp, sq, sw):
        if B[NXT, s] != s:
            return B[NXT, s]
    return -1


@nb.njit(cache=True)
def _on_evict(state, b):
    B, F, M = state
    seg = B[SEG, b]
    if seg >= 0:
        if B[LINKED, b]:
            dl_unlink(B, NXT, PRV, b)
            B[LINKED, b] = 0
        B[SEG, b] = -1
        M[seg] -= 1


@register_policy("wtinylfu")
class WTinyLFU(CompiledAdapter):
    """A linked list per segment (window, probation, protected) of its evictable blocks in LRU order;
    segment sizes count placed blocks; ``0 <= F[key] <= max_count``."""

    source = "W-TinyLFU (Einziger et al., ToS 2017; Caffeine, libCacheSim WTinyLFU); exact counters"
    compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict)

    def __init__(
        self,
        window_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.01,
        protected_ratio: Annotated[float, Field(ge=0, le=1)] = 0.8,
        sample_factor: Annotated[float, Field(gt=0, le=10**6)] = 10.0,  # sample_factor * C must fit an int64
        max_count: Annotated[int, Field(ge=1, le=10**6)] = 15,
    ) -> None:
        self.window_ratio = float(window_ratio)
        self.protected_ratio = float(protected_ratio)
        self.sample_factor = float(sample_factor)
        self.max_count = int(max_count)

    def compiled_params(self) -> np.ndarray:
        return np.array([self.window_ratio, self.protected_ratio, self.sample_factor, self.max_count],
                        dtype=np.float64)
