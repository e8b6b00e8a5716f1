"""Belady's MIN (OPT), offline: evict the block whose key is next used farthest in the future.

Source: L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
Journal 5(2), 1966; libCacheSim's ``Belady`` (libCacheSim/cache/eviction/Belady.c: a priority queue on
each object's next access time, the farthest evicted) is the reference it is tested against.

``prepare(encoded)`` reads the future from the EncodedWorkload the cache will replay: for every
occurrence of a key in request ``r`` it stores the index of the next *later* request holding that key
(never = infinity). ``ctx.seq`` is the current request's index (the replay's admission order). When
the policy learns that request ``r`` has started, every key of ``r`` moves its next use past ``r``,
whether or not the cache looked it up (stop-at-first-miss), so no block keeps a next use that has
already gone by.

What it means (docs/semantics.md, "Eviction policy interface"): on object sequences (one-block requests,
``mode="ideal"``) this is OPT, a bound for every online policy with the same capacity; on prefix traces the
chain dependency and stop-at-first-miss make it a strong heuristic, not a bound (a block whose key comes back
soon is useless if its parent is evicted first).

Choices:

* Ties (only possible among keys never used again, or duplicate blocks of one key) go to the least
  recently unpinned block. libCacheSim breaks them by its heap order; ties never change a hit, so the
  per-access hit vectors are identical (tested).
* ``victim()`` has no context: it uses the future as of the last event. A request with no hits
  allocates before the policy has seen its index, so that request's own cached-but-unreachable keys
  (orphans behind its first miss) still count as used now and are kept for that one allocation.
* Keys must be the dense key ids of the prepared EncodedWorkload (the Python replay's keys).
* State is per key and survives eviction (it is the trace's future, not the cache's history).

Cost: ``prepare`` is O(m log m) for m key occurrences; then every key occurrence of the trace is
advanced once (O(1) each), plus O(log n) per event and per evictable block whose key's next use moves
(n evictable blocks). A priority policy (kvlab.policies._priority) with the framework's per-key lists of
evictable blocks: a request is learnt at ``on_insert``/``on_hit``/unpin (not ``on_miss``), keys are
advanced at unpin (before the priority) and at each victim (``refresh``), and a key whose next use moved
gets its evictable blocks re-queued (``requeue_key``); ``compiled_params()`` passes the prepared
``(offsets, key_ids, next use)`` arrays, the functions read them as ``s.data``. Tested hit for hit between
both engines and against libCacheSim.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvlab.errors import ConfigError
from kvlab.policies._priority import Priority, PriorityPolicy, requeue_key
from kvlab.policies.base import register_policy

NEVER = 1 << 62


def next_use(offsets: np.ndarray, key_ids: np.ndarray) -> np.ndarray:
    """int64 per key occurrence: index of the next later request holding the same key, or NEVER."""
    offsets = np.asarray(offsets, dtype=np.int64)
    key_ids = np.asarray(key_ids, dtype=np.int64)
    m = len(key_ids)
    req = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    order = np.lexsort((np.arange(m), key_ids))  # grouped by key, in trace order
    nxt = np.full(m, -1, dtype=np.int64)  # next occurrence of the same key
    if m > 1:
        same = key_ids[order[1:]] == key_ids[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    # a key repeated inside one request: jump to the first occurrence in a later request
    while True:
        has = nxt >= 0
        stay = np.zeros(m, dtype=bool)
        stay[has] = req[nxt[has]] == req[has]
        if not stay.any():
            break
        nxt[stay] = nxt[nxt[stay]]
    out = np.full(m, NEVER, dtype=np.int64)
    has = nxt >= 0
    out[has] = req[nxt[has]]
    return out


BKEY = 0  # per-block field: the block's key
KNEXT = 0  # per-key field: the request of its next use (NEVER: none)
DONE, CUR = 0, 1  # global int slots: last request whose keys were advanced, latest request seen
OFF, KEYS, NXT = 0, 1, 2  # s.data: the prepared (offsets, key_ids, next use)


@nb.njit(cache=True)
def _see(s, b, key, pos, r):
    g = s.globi
    if r.seq > g[CUR]:
        if r.seq >= len(s.data[OFF]) - 1:
            raise ConfigError("belady: a request beyond the prepared workload (prepare(encoded) with its future)")
        g[CUR] = r.seq
    s.blk[BKEY][b] = key


@nb.njit(cache=True)
def _advance(s):
    """Move the next use of every key of requests done+1 .. cur past its request (its evictable blocks
    re-queued with the new priority)."""
    g = s.globi
    if g[CUR] > g[DONE]:
        off, keys, nxt = s.data[OFF], s.data[KEYS], s.data[NXT]
        for q in range(g[DONE] + 1, g[CUR] + 1):
            for j in range(off[q], off[q + 1]):
                k = keys[j]
                s.key[KNEXT][k] = nxt[j]
                requeue_key(s, k, NEVER - nxt[j])
        g[DONE] = g[CUR]


@nb.njit(cache=True)
def _priority(s, b, r):
    # keys are advanced when an order is needed (here and at each victim), after the request's hits are
    # pinned, so hit blocks never get an entry they lose at once
    g = s.globi
    if r.seq > g[CUR]:
        g[CUR] = r.seq
    if g[CUR] > g[DONE]:
        _advance(s)
    return NEVER - s.key[KNEXT][s.blk[BKEY][b]]


class _Unprepared:
    def __getitem__(self, i: int) -> None:
        raise ConfigError("belady needs prepare(encoded) with the workload's future before use")


@register_policy("belady")
class Belady(PriorityPolicy):
    """Evict the block whose key's next request is farthest (offline; needs ``prepare``)."""

    source = "Belady 1966 (MIN/OPT), as libCacheSim's Belady; offline, reads the trace's future"
    offline = True
    spec = Priority(_priority, _see, _see, block=(-1,), key=(NEVER,), glob=(-1, -1), refresh=_advance, by_key=True,
                    layout=("offsets", "key_ids", "next_use"), data=("offsets", "key_ids", "next_use"))

    def __init__(self) -> None:
        super().__init__()
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # for the compiled twin
        self._lists: tuple[list, list, list] | None = None  # for the Python core

    def prepare(self, encoded: object) -> None:
        offsets = np.ascontiguousarray(encoded.offsets, dtype=np.int64)  # type: ignore[attr-defined]
        key_ids = np.ascontiguousarray(encoded.key_ids, dtype=np.int64)  # type: ignore[attr-defined]
        nxt = next_use(offsets, key_ids)
        self._arrays = (offsets, key_ids, nxt)
        self._lists = (offsets.tolist(), key_ids.tolist(), nxt.tolist())
        if getattr(self, "state", None) is not None:  # prepared after attach: a fresh future
            self.state.globi[DONE] = self.state.globi[CUR] = -1
            for per_key in self.state.key:
                per_key.clear()
            self.state.data = self._lists

    def data(self) -> tuple:
        return self._lists if self._lists is not None else _Unprepared()

    def compiled_params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prepared future: ``(offsets, key_ids, next use per key occurrence)``, int64."""
        if self._arrays is None:
            raise ConfigError("belady needs prepare(encoded) with the workload's future before use")
        return self._arrays
