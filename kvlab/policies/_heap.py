"""Shared machinery of the priority policies: lazy min-queues over evictable blocks, optionally leaf-only.

Not a policy (the package skips modules starting with ``_``). An entry is a tuple
``(priority, stamp, block_id)``; ``stamp`` is unique per push, so equal priorities come out in push order
(least recently unpinned first) and every policy built on this is deterministic. Entries live in two
structures: a *run* (a deque) that takes every entry not smaller than its last one, and a binary heap
for the rest; the minimum is the smaller of the two fronts. Policies whose priorities mostly grow with
time (last access, SGLang; expiry) then pay O(1) instead of O(log n) per event, others O(log n). A pin,
eviction or removal invalidates the block's entry by clearing its stamp; stale entries are dropped when
they reach a front, and both structures are compacted once the entries left behind by pins outnumber
the live ones.

Leaf-only variant (RAGCache's knowledge tree, SGLang's radix tree): ``victim()`` skips blocks whose key
has cached children (``cache.num_cached_children(key) > 0``). A non-leaf that reaches the top is
*parked* (taken off the heap with its entry kept, grouped by key). When a block is evicted or removed
and its parent key has at most one cached child left, the parent key is marked; at the next
``victim()`` the parked blocks of every marked key that has no cached children left are pushed back
with their original entry, so the order among leaves is exactly the priority order. Each block is
parked at most once per non-leaf period, so this stays amortised O(log n). If only parked blocks are
evictable (every evictable block has a cached child; possible only when those children are pinned,
e.g. duplicates of a pinned prefix), the lowest parked entry is chosen (an O(parked) scan, rare).

Bucket variant (:class:`BucketHeapPolicy`), for integer priorities with few distinct values (LFU
frequencies, retention levels): the same order from one insertion-ordered bucket per priority and a heap
of the priorities in use, O(1) per event but when a priority gets its first block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from heapq import heapify, heappop, heappush

from kvlab.cache.block import KVBlock
from kvlab.errors import ConfigError
from kvlab.policies.base import EvictionPolicy


class HeapPolicy(EvictionPolicy):
    """Evictable blocks ordered by ``(priority, stamp)``; subclasses call ``_push(block_id, priority)`` on unpin."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._run: deque[tuple] = deque()  # entries pushed in non-decreasing order
        self._stamp: list[int] = []  # block_id -> stamp of its live entry, 0 = none
        self._next = 1
        self._n = 0
        self._stale = 0  # entries invalidated by pins since the last compaction
        self._cache: object | None = None
        self._blocks: list[KVBlock] = []

    def attach(self, cache: object) -> None:
        n = cache.capacity_blocks  # type: ignore[attr-defined]
        self._cache = cache
        self._blocks = cache.blocks  # type: ignore[attr-defined]
        self._stamp = [0] * n

    def _push(self, bid: int, priority: object) -> None:
        """Make ``bid`` evictable with ``priority``."""
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        e = (priority, s, bid)
        run = self._run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(self._heap, e)
        self._n += 1

    def _repush(self, bid: int, priority: object) -> None:
        """A new entry (a new stamp: the newest of its priority) for an evictable block; the old one goes stale."""
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        self._put((priority, s, bid))
        self._stale += 1

    def _put(self, e: tuple) -> None:
        """Put back an entry taken off earlier (its stamp is still live)."""
        run = self._run
        if not run or e > run[-1]:
            run.append(e)
        else:
            heappush(self._heap, e)

    def _compact(self) -> None:
        stamp = self._stamp
        self._heap = [e for e in self._heap if stamp[e[2]] == e[1]]
        heapify(self._heap)
        self._run = deque(e for e in self._run if stamp[e[2]] == e[1])
        self._stale = 0

    def on_pin(self, block: KVBlock, ctx: object) -> None:
        # a pinned block's entry stays behind, stale; a victim's entry is at a front and goes next
        self._stamp[block.block_id] = 0
        self._n -= 1
        self._stale += 1
        if self._stale > self._n + 1024:
            self._compact()

    def on_evict(self, block: KVBlock) -> None:
        self._stamp[block.block_id] = 0
        self._n -= 1

    def _front(self) -> tuple | None:
        """The smallest live entry (stale fronts are dropped), or None."""
        heap, run, stamp = self._heap, self._run, self._stamp
        while heap and stamp[heap[0][2]] != heap[0][1]:
            heappop(heap)
        while run and stamp[run[0][2]] != run[0][1]:
            run.popleft()
        if heap:
            return run[0] if run and run[0] < heap[0] else heap[0]
        return run[0] if run else None

    def _take(self, e: tuple) -> None:
        """Remove the front entry ``e`` (from whichever structure holds it)."""
        if self._run and self._run[0] is e:
            self._run.popleft()
        else:
            heappop(self._heap)

    def victim(self) -> KVBlock:
        e = self._front()
        if e is not None:
            return self._blocks[e[2]]
        if self._cache is None:
            raise ConfigError(f"policy {self.name!r} must be attached to a PrefixCache before use")
        raise IndexError("victim() called with no evictable block")

    def __len__(self) -> int:
        return self._n


class BucketHeapPolicy(HeapPolicy):
    """:class:`HeapPolicy`'s order (priority, then push order) for integer priorities, in buckets.

    Invariants: ``_bucket[bid]`` is the bucket (an OrderedDict in push order) holding each evictable block
    (None otherwise); every non-empty bucket's priority is in ``_keys`` (a heap; keys of emptied buckets
    are dropped when they reach its top). ``_stamp`` is as in HeapPolicy (a push's stamp, 0 when none)."""

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._buckets: dict[int, OrderedDict[int, KVBlock]] = {}
        self._bucket: list[OrderedDict | None] = [None] * cache.capacity_blocks  # type: ignore[attr-defined]
        self._keys: list[int] = []

    def _push(self, bid: int, priority: int) -> None:
        s = self._next
        self._next = s + 1
        self._stamp[bid] = s
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = OrderedDict()
            heappush(self._keys, priority)
        bucket[bid] = self._blocks[bid]
        self._bucket[bid] = bucket
        self._n += 1

    def _drop(self, bid: int) -> None:
        bucket = self._bucket[bid]
        del bucket[bid]  # type: ignore[attr-defined]
        self._bucket[bid] = None
        self._stamp[bid] = 0
        self._n -= 1

    def _repush(self, bid: int, priority: int) -> None:
        self._drop(bid)
        self._push(bid, priority)

    def on_pin(self, block: KVBlock, ctx: object) -> None:
        bid = block.block_id  # (_drop, inlined: a hot path)
        bucket = self._bucket[bid]
        del bucket[bid]  # type: ignore[attr-defined]
        self._bucket[bid] = None
        self._stamp[bid] = 0
        self._n -= 1

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        bucket = self._bucket[bid]
        del bucket[bid]  # type: ignore[attr-defined]
        self._bucket[bid] = None
        self._stamp[bid] = 0
        self._n -= 1

    def victim(self) -> KVBlock:
        keys, buckets = self._keys, self._buckets
        while keys:
            bucket = buckets[keys[0]]
            if bucket:
                return next(iter(bucket.values()))
            del buckets[heappop(keys)]
        if self._cache is None:
            raise ConfigError(f"policy {self.name!r} must be attached to a PrefixCache before use")
        raise IndexError("victim() called with no evictable block")


class LeafHeapPolicy(HeapPolicy):
    """A :class:`HeapPolicy` whose victims are leaves: blocks whose key has no cached children."""

    def __init__(self) -> None:
        super().__init__()
        self._parked: dict[Hashable, dict[int, tuple]] = {}  # key -> {block_id: entry}
        self._is_parked: list[bool] = []
        self._dirty: list[Hashable] = []

    def attach(self, cache: object) -> None:
        super().attach(cache)
        self._children = cache.num_cached_children  # type: ignore[attr-defined]
        self._is_parked = [False] * cache.capacity_blocks  # type: ignore[attr-defined]

    def _drop_any(self, block: KVBlock) -> None:
        """Forget ``block``'s entry, parked or queued."""
        bid = block.block_id
        if self._is_parked[bid]:
            self._is_parked[bid] = False
            group = self._parked[block.key]
            del group[bid]
            if not group:
                del self._parked[block.key]
        self._stamp[bid] = 0
        self._n -= 1

    def on_pin(self, block: KVBlock, ctx: object) -> None:
        self._drop_any(block)
        self._stale += 1
        if self._stale > self._n + 1024:
            self._compact()

    def on_evict(self, block: KVBlock) -> None:
        self._drop_any(block)
        parent = block.parent
        # <= 1: the count may or may not include this block yet; either way 0 children is caught
        if parent is not None and parent in self._parked and self._children(parent) <= 1:
            self._dirty.append(parent)

    def _release_parked(self) -> None:
        parked, children, is_parked = self._parked, self._children, self._is_parked
        for key in self._dirty:
            group = parked.get(key)
            if group is not None and children(key) == 0:
                del parked[key]
                for bid, e in sorted(group.items(), key=lambda item: item[1]):
                    is_parked[bid] = False
                    self._put(e)
        self._dirty.clear()

    def victim(self) -> KVBlock:
        if self._dirty:
            self._release_parked()
        blocks, children = self._blocks, self._children
        while True:
            e = self._front()
            if e is None:
                break
            bid = e[2]
            block = blocks[bid]
            if children(block.key) == 0:
                return block
            self._take(e)
            self._is_parked[bid] = True
            group = self._parked.get(block.key)
            if group is None:
                self._parked[block.key] = {bid: e}
            else:
                group[bid] = e
        if self._n == 0:
            raise IndexError("victim() called with no evictable block")
        best = min(e for group in self._parked.values() for e in group.values())
        return blocks[best[2]]
