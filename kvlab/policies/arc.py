"""ARC: adaptive replacement between a recency list T1 and a frequency list T2, steered by ghost lists.

Source: Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03, in libCacheSim's
form (``ARC.c``: float target ``p``, ``delta = max(|B2|/|B1|, 1)`` on a B1 ghost hit and
``max(|B1|/|B2|, 1)`` on a B2 ghost hit). A first access enters T1, a hit moves the block to T2's MRU
end; an evicted T1 (T2) block leaves its key at the MRU end of ghost list B1 (B2).

The paper's order, through the ``on_miss`` hook (the core names the keys a request is about to compute
before it asks for any victim): a missed key found in B1 / B2 adapts ``p`` and leaves its ghost list
at once (the block will enter T2). Then each ``victim()`` is, for a request with a ghost hit, REPLACE:
T1's LRU block if ``|T1| > 0`` and (``|T1| > p``, or ``|T1| == p`` and the key was in B2), or T2 is
empty; else T2's LRU block. For a request without a ghost hit it is case IV: if ``|T1| + |B1| + 1 > C``,
B1's LRU key is dropped and REPLACE runs, or with B1 empty T1's LRU block is evicted *without* a ghost
entry; otherwise, if the directory holds ``2C`` entries, B2's LRU key is dropped, then REPLACE. On object
sequences this is libCacheSim's ARC hit for hit.

Documented choices for the prefix cache:

* a request with several missed keys adapts ``p`` once per ghost key, in order, before its first
  victim; "the key was in B2" holds if any of them was; the flags end at the request's first keyed
  block (``on_insert``) or unpin, so a later allocation without named keys (a decode block) is case IV;
* a new block is placed (T1, or T2 after a ghost hit or a hit before placement) when first unpinned
  (its request released); a key still in a ghost list at placement (not named by ``on_miss``, e.g.
  evicted by its own request) adapts ``p`` there; placement keeps the directory bounds
  ``|T1| + |B1| <= C`` and ``|T1| + |T2| + |B1| + |B2| <= 2C`` (a no-op on object sequences);
* lists are ordered by unpin time (vLLM's LRU order, tail first); a pinned block leaves its list and
  rejoins it at the MRU end; ``|T1|``, ``|T2|`` count placed blocks, pinned or not; if REPLACE's list
  has no evictable block the other list's LRU block is taken;
* ``C`` is the cache's capacity in blocks; per-block state does not survive eviction; ghost keys do.

O(1) per event. On a ``reset`` a removed block leaves T1 / T2 without a ghost entry.
Written once, as compiled hooks: the replay kernel and, through kvlab.policies._adapter, the Python core
run them.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies._adapter import CompiledAdapter
from kvlab.policies._queues import dl_append, dl_unlink, grow_keys
from kvlab.policies.base import register_policy

# state: (B, K, M, F). B (per block): lists T1 / T2 on NXT / PRV with sentinel columns C / C + 1 (sentinel
# NXT = LRU end), LABEL (0 = not placed), LINKED (evictable), HITP (hit before placement), BKEY.
# K (per key): ghost lists B1 / B2 on GNXT / GPRV with sentinel columns N / N + 1, GLAB (0 = none),
# TOT2 (ghost hit taken by on_miss, block not placed yet).
# M = [|T1|, |T2|, |B1|, |B2|, C, ghost miss, x in B2, plan block, plan action]; F = [p].
NXT, PRV, LABEL, LINKED, HITP, BKEY = range(6)
GNXT, GPRV, GLAB, TOT2 = range(4)
GHOST_MISS, X_IN_B2, PLAN_B, PLAN_A = range(5, 9)


@nb.njit(cache=True)
def _init(capacity, num_keys, params):
    B = np.zeros((6, capacity + 2), np.int64)
    B[NXT] = np.arange(capacity + 2)
    B[PRV] = np.arange(capacity + 2)
    K = np.zeros((4, num_keys + 2), np.int64)
    K[GNXT] = np.arange(num_keys + 2)
    K[GPRV] = np.arange(num_keys + 2)
    M = np.zeros(9, np.int64)
    M[4] = capacity
    M[PLAN_B] = -1
    return (B, K, M, np.zeros(1, np.float64))


@nb.njit(cache=True)
def _ghost_drop(K, M, k):
    dl_unlink(K, GNXT, GPRV, k)
    M[1 + K[GLAB, k]] -= 1
    K[GLAB, k] = 0


@nb.njit(cache=True)
def _on_miss(state, key, seq, pos):
    K, M, F = state[1], state[2], state[3]
    g = K[GLAB, key]
    if g == 1:
        F[0] = min(F[0] + max(M[3] / M[2], 1.0), float(M[4]))
    elif g == 2:
        F[0] = max(F[0] - max(M[2] / M[3], 1.0), 0.0)
        M[X_IN_B2] = 1
    else:
        return
    _ghost_drop(K, M, key)
    K[TOT2, key] = 1
    M[GHOST_MISS] = 1


@nb.njit(cache=True)
def _on_insert(state, b, key, seq, pos):
    state[0][BKEY, b] = key
    M = state[2]
    M[GHOST_MISS] = 0
    M[X_IN_B2] = 0


@nb.njit(cache=True)
def _on_hit(state, b, key, seq, pos):
    B, M = state[0], state[2]
    lab = B[LABEL, b]
    if lab == 0:
        B[HITP, b] = 1
        return
    if lab == 1:
        B[LABEL, b] = 2
        M[0] -= 1
        M[1] += 1
    if B[LINKED, b]:
        dl_unlink(B, NXT, PRV, b)
        dl_append(B, NXT, PRV, B.shape[1] - 1, b)


@nb.njit(cache=True)
def _on_pin(state, b, seq):
    B = state[0]
    dl_unlink(B, NXT, PRV, b)
    B[LINKED, b] = 0


@nb.njit(cache=True)
def _on_unpin(state, b, seq):
    B, K, M, F = state
    M[GHOST_MISS] = 0
    M[X_IN_B2] = 0
    cap = M[4]
    lab = B[LABEL, b]
    if lab == 0:  # first unpin: placement (ghost hits not taken by on_miss adapt here)
        k = B[BKEY, b]
        g = K[GLAB, k]
        if K[TOT2, k]:
            K[TOT2, k] = 0
            lab = 2
        elif g == 1:
            F[0] = min(F[0] + max(M[3] / M[2], 1.0), float(cap))
            _ghost_drop(K, M, k)
            lab = 2
        elif g == 2:
            F[0] = max(F[0] - max(M[2] / M[3], 1.0), 0.0)
            _ghost_drop(K, M, k)
            lab = 2
        else:
            lab = 2 if B[HITP, b] else 1
        B[HITP, b] = 0
        B[LABEL, b] = lab
        M[lab - 1] += 1
        s1 = K.shape[1] - 2
        while M[2] > 0 and M[0] + M[2] > cap:
            _ghost_drop(K, M, K[GNXT, s1])
        while M[3] > 0 and M[0] + M[1] + M[2] + M[3] > 2 * cap:
            _ghost_drop(K, M, K[GNXT, s1 + 1])
    dl_append(B, NXT, PRV, cap + lab - 1, b)
    B[LINKED, b] = 1


@nb.njit(cache=True)
def _replace(B, M, F, x_in_b2):
    cap = M[4]
    n1 = M[0]
    s = cap if (n1 > 0 and (n1 > F[0] or (n1 == F[0] and x_in_b2))) or M[1] == 0 else cap + 1
    if B[NXT, s] == s:
        s = 2 * cap + 1 - s
    return B[NXT, s]


@nb.njit(cache=True)
def _victim(state):
    B, M, F = state[0], state[2], state[3]
    M[PLAN_B] = -1
    if M[GHOST_MISS]:
        return _replace(B, M, F, M[X_IN_B2] != 0)
    cap = M[4]
    if M[0] + M[2] + 1 > cap:
        if M[2] == 0 and B[NXT, cap] != cap:
            b = B[NXT, cap]
            M[PLAN_B] = b
            M[PLAN_A] = 0
            return b
        b = _replace(B, M, F, False)
        if M[2] > 0:
            M[PLAN_B] = b
            M[PLAN_A] = 1
        return b
    b = _replace(B, M, F, False)
    if M[3] > 0 and M[0] + M[1] + M[2] + M[3] >= 2 * cap:
        M[PLAN_B] = b
        M[PLAN_A] = 2
    return b


@nb.njit(cache=True)
def _drop(B, M, b):
    """``b`` leaves T1 / T2 (and its pending hit is forgotten); returns its list (0: not placed). (Written out
    again in ``_on_evict``: the kernel is measurably slower calling it there.)"""
    B[HITP, b] = 0
    lab = B[LABEL, b]
    if lab != 0:
        if B[LINKED, b]:
            dl_unlink(B, NXT, PRV, b)
            B[LINKED, b] = 0
        B[LABEL, b] = 0
        M[lab - 1] -= 1
    return lab


@nb.njit(cache=True)
def _on_evict(state, b):
    """Case IV's planned ghost drop, then ``b``'s key to the MRU end of B1 / B2 (none after case IV's
    ghost-less eviction of T1's LRU block)."""
    B, K, M = state[0], state[1], state[2]
    action = M[PLAN_A] if M[PLAN_B] == b else -1
    M[PLAN_B] = -1
    if action > 0:
        _ghost_drop(K, M, K[GNXT, K.shape[1] - 3 + action])
    B[HITP, b] = 0
    lab = B[LABEL, b]
    if lab == 0:
        return
    if B[LINKED, b]:
        dl_unlink(B, NXT, PRV, b)
        B[LINKED, b] = 0
    B[LABEL, b] = 0
    M[lab - 1] -= 1
    if action == 0:
        return
    k = B[BKEY, b]
    if K[GLAB, k] != 0:
        _ghost_drop(K, M, k)
    K[GLAB, k] = lab
    M[1 + lab] += 1
    dl_append(K, GNXT, GPRV, K.shape[1] - 3 + lab, k)


@nb.njit(cache=True)
def _on_remove(state, b):
    _drop(state[0], state[2], b)


def _grow(state, num_keys):
    B, K, M, F = state
    return (B, grow_keys(K, num_keys, 2, (GNXT, GPRV)), M, F)


@register_policy("arc")
class ARC(CompiledAdapter):
    """T1, T2 (linked lists over block ids, LRU end first), ghost lists B1, B2 (over dense key ids), ``p``."""

    source = "ARC (Megiddo & Modha, FAST'03; libCacheSim ARC)"
    compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict, _on_miss,
                              on_remove=_on_remove, grow=_grow)

    @property
    def p(self) -> float:
        """The target size of T1 (0 before ``attach``)."""
        return float(self.state[3][0]) if self._hooks is not None else 0.0
