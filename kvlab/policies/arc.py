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

O(1) per event. Python class and compiled twin are equal hit for hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.policies._queues import dl_append, dl_unlink
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("arc")
class ARC(EvictionPolicy):
    """Invariants: ``_label`` maps placed blocks to 1 (T1) or 2 (T2), ``_n`` counts them; ``_lists[l]``
    holds the evictable ones in LRU order; ``_ghost[l]`` holds ghost keys in LRU order; ``0 <= p <= C``;
    ``_to_t2`` holds keys whose ghost hit was taken by ``on_miss`` and whose block is not placed yet."""

    source = "ARC (Megiddo & Modha, FAST'03; libCacheSim ARC)"

    def __init__(self) -> None:
        self.capacity = 0
        self.p = 0.0
        self._lists: dict[int, OrderedDict[int, KVBlock]] = {1: OrderedDict(), 2: OrderedDict()}
        self._ghost: dict[int, OrderedDict[Hashable, None]] = {1: OrderedDict(), 2: OrderedDict()}
        self._label: dict[int, int] = {}
        self._n = {1: 0, 2: 0}
        self._hit_pending: set[int] = set()
        self._to_t2: set[Hashable] = set()
        self._ghost_miss = False  # the current request had a ghost hit ...
        self._x_in_b2 = False  # ... in B2
        self._plan: tuple[int, int] | None = None  # (block id, 0 no ghost | 1 drop B1 LRU | 2 drop B2 LRU)

    def attach(self, cache: object) -> None:
        """``C`` = the cache's capacity in blocks."""
        self.capacity = cache.num_blocks  # type: ignore[attr-defined]

    def on_miss(self, keys: Sequence[Hashable], ctx: AccessContext) -> None:
        b1, b2 = self._ghost[1], self._ghost[2]
        for key in keys:
            if key in b1:
                self.p = min(self.p + max(len(b2) / len(b1), 1.0), float(self.capacity))
                del b1[key]
            elif key in b2:
                self.p = max(self.p - max(len(b1) / len(b2), 1.0), 0.0)
                del b2[key]
                self._x_in_b2 = True
            else:
                continue
            self._to_t2.add(key)
            self._ghost_miss = True

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ghost_miss = self._x_in_b2 = False

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        lab = self._label.get(bid)
        if lab is None:
            self._hit_pending.add(bid)
        elif lab == 1:
            self._label[bid] = 2
            self._n[1] -= 1
            self._n[2] += 1
            if self._lists[1].pop(bid, None) is not None:
                self._lists[2][bid] = block
        elif bid in self._lists[2]:
            self._lists[2].move_to_end(bid)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        del self._lists[self._label[block.block_id]][block.block_id]

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ghost_miss = self._x_in_b2 = False
        bid = block.block_id
        lab = self._label.get(bid)
        if lab is None:
            lab = self._place(block)
            self._trim()  # only a placement can break the directory bounds
        self._lists[lab][bid] = block

    def _place(self, block: KVBlock) -> int:
        b1, b2 = self._ghost[1], self._ghost[2]
        key = block.key
        if key in self._to_t2:
            self._to_t2.discard(key)
            lab = 2
        elif key in b1:
            self.p = min(self.p + max(len(b2) / len(b1), 1.0), float(self.capacity))
            del b1[key]
            lab = 2
        elif key in b2:
            self.p = max(self.p - max(len(b1) / len(b2), 1.0), 0.0)
            del b2[key]
            lab = 2
        else:
            lab = 2 if block.block_id in self._hit_pending else 1
        self._hit_pending.discard(block.block_id)
        self._label[block.block_id] = lab
        self._n[lab] += 1
        return lab

    def _trim(self) -> None:
        b1, b2, c = self._ghost[1], self._ghost[2], self.capacity
        n1 = self._n[1]
        while b1 and n1 + len(b1) > c:
            b1.popitem(last=False)
        total = n1 + self._n[2] + len(b1)
        while b2 and total + len(b2) > 2 * c:
            b2.popitem(last=False)

    def _replace(self, x_in_b2: bool) -> KVBlock:
        n1, p = self._n[1], self.p
        lab = 1 if (n1 > 0 and (n1 > p or (n1 == p and x_in_b2))) or self._n[2] == 0 else 2
        lst = self._lists[lab] or self._lists[3 - lab]
        return next(iter(lst.values()))

    def victim(self) -> KVBlock:
        """REPLACE or case IV (see the module docstring); what case IV drops happens in ``on_evict``."""
        if self._ghost_miss:
            self._plan = None
            return self._replace(self._x_in_b2)
        n1, c = self._n[1], self.capacity
        b1, b2 = self._ghost[1], self._ghost[2]
        if n1 + len(b1) + 1 > c:
            if not b1 and self._lists[1]:
                block = next(iter(self._lists[1].values()))
                self._plan = (block.block_id, 0)
                return block
            block = self._replace(False)
            self._plan = (block.block_id, 1) if b1 else None
            return block
        block = self._replace(False)
        self._plan = (block.block_id, 2) if b2 and n1 + self._n[2] + len(b1) + len(b2) >= 2 * c else None
        return block

    def _drop(self, block: KVBlock) -> int | None:
        bid = block.block_id
        self._hit_pending.discard(bid)
        lab = self._label.pop(bid, None)
        if lab is not None:
            self._lists[lab].pop(bid, None)
            self._n[lab] -= 1
        return lab

    def on_evict(self, block: KVBlock) -> None:
        plan, self._plan = self._plan, None
        action = plan[1] if plan is not None and plan[0] == block.block_id else -1
        if action > 0:
            self._ghost[action].popitem(last=False)
        lab = self._drop(block)
        if lab is not None and action != 0:
            self._ghost[3 - lab].pop(block.key, None)  # a key sits in at most one ghost list
            ghost = self._ghost[lab]
            ghost[block.key] = None
            ghost.move_to_end(block.key)

    def on_remove(self, block: KVBlock) -> None:
        self._drop(block)

    def __len__(self) -> int:
        return len(self._lists[1]) + len(self._lists[2])


# ---------------------------------------------------------------------- compiled twin
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
def _on_evict(state, b):
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


ARC.compiled = CompiledPolicy(_init, _on_insert, _on_hit, _on_pin, _on_unpin, _victim, _on_evict, _on_miss)
