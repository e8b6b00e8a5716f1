"""The prefix-cache core shared by all drivers: block pool, key index, ref counts, one eviction policy.

Semantics follow vLLM v1 automatic prefix caching (docs/semantics.md,
"Lookup, admission and release (one request)"):

* Every block is in exactly one state: *running* (``ref_cnt > 0``), *evictable* (``ref_cnt == 0`` with
  a key; ordered by the policy) or *free* (``ref_cnt == 0`` without a key; in the free queue).
* The free queue starts in block-id order; allocation takes a free block from its front, and only
  when it is empty asks the policy for a victim, whose key is then evicted. (vLLM keeps both kinds in
  one queue whose unkeyed blocks always precede the keyed ones, so this is the same order.)
* ``release`` walks a request's blocks tail first; a block reaching ref count 0 with a key becomes
  evictable, one without a key goes to the *front* of the free queue.
* The index maps a key to the blocks holding it, oldest first; lookup returns the oldest. Identical
  content may sit in two blocks; evicting one leaves the other findable.
* Lookup walks keys in order and stops at the first miss. ``admit`` caps hits at ``prompt_len - 1``
  tokens (mode ``vllm``) and admits a request only if its new blocks fit in the free blocks minus its
  own evictable hits; a request that does not fit changes nothing.

The methods here are the block-level primitives (each one state transition, with its policy hooks);
the order in which a request goes through them is the admission sequence of :mod:`kvlab.cache.admission`,
which ``admit`` runs for the replay.

Units: capacities and counts in blocks; ``block_size`` in tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.cache import admission
from kvlab.cache.admission import COUNTING_MODES
from kvlab.cache.block import KVBlock
from kvlab.cache.context import NO_CONTEXT, AccessContext
from kvlab.errors import CapacityError, ConfigError
from kvlab.names import renamed_attribute, renamed_keyword

if TYPE_CHECKING:  # kvlab.policies sits above the cache (it builds on the cache's block types): types only
    from kvlab.cache.lower import LowerTiers
    from kvlab.policies import EvictionPolicy

__all__ = ["COUNTING_MODES", "Admission", "CacheStats", "PrefixCache", "pool_blocks"]


def pool_blocks(capacity_blocks: int, demand_blocks: int) -> int:
    """Blocks to allocate for a cache of ``capacity_blocks``: no more than ``demand_blocks``, an upper bound
    on the blocks a workload can ever hold at once (e.g. every block it ever allocates), so a capacity of
    10**12 blocks costs the workload's size, not 10**12 blocks. A pool of at least the demand never evicts,
    so the numbers equal the full capacity's; drivers record ``capacity_blocks`` unchanged."""
    return max(1, min(int(capacity_blocks), int(demand_blocks)))


@dataclass(slots=True)
class Admission:
    """What ``admit`` did for one request. ``blocks`` = hit blocks then new blocks, in prompt order."""

    blocks: list[KVBlock]
    hit_blocks: int
    new_blocks: int
    evictions: int
    collisions: int = 0
    orphan_evictions: int = 0
    tier_hits: list[int] = field(default_factory=list)  # hit blocks loaded from each lower tier (level 1 first)


@dataclass(slots=True)
class CacheStats:
    """Running totals since construction or ``reset`` (blocks)."""

    evictions: int = 0
    orphan_evictions: int = 0
    inserts: int = 0
    hits: int = 0
    collisions: int = 0
    extra: dict = field(default_factory=dict)


class PrefixCache:
    """A pool of ``capacity_blocks`` usable KV blocks with a key index and one eviction policy.

    ``policy`` is a policy object (:class:`kvlab.policies.EvictionPolicy`, not yet attached to another cache):
    the cache never looks a name up; ``kvlab.policies.make_policy(name, **params)`` does, and
    :func:`kvlab.policies.make_cache` builds a cache from a policy name. ``block_size`` in tokens. The old
    keyword and attribute ``num_blocks`` still mean ``capacity_blocks`` (:data:`kvlab.names.KEYWORD_ALIASES`).
    """

    num_blocks = renamed_attribute("capacity_blocks")

    def __init__(
        self,
        capacity_blocks: int | None = None,
        policy: EvictionPolicy | None = None,
        *,
        block_size: int = 16,
        **old_names: int,
    ) -> None:
        capacity_blocks = renamed_keyword("PrefixCache", "capacity_blocks", capacity_blocks, old_names)
        if capacity_blocks is None:
            raise TypeError("PrefixCache() missing required argument: 'capacity_blocks'")
        if policy is None or isinstance(policy, str):
            raise TypeError("PrefixCache() takes a policy object: kvlab.policies.make_policy(name, **params), or "
                            "kvlab.policies.make_cache(capacity_blocks, name, ...) for a cache by policy name")
        if capacity_blocks <= 0:
            raise ConfigError(f"capacity must be >= 1 block, got {capacity_blocks}")
        if block_size <= 0:
            raise ConfigError(f"block_size must be >= 1 token, got {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(capacity_blocks)]
        self.policy = policy
        self.policy.attach(self)
        self._free: deque[KVBlock] = deque(self.blocks)
        self._index: dict[Hashable, dict[int, KVBlock]] = {}
        self._cached = 0  # blocks holding a key (running or evictable)
        self._children: dict[Hashable, int] = {}  # key -> cached blocks whose parent is that key
        self._orphans = 0  # cached blocks whose parent key is not cached (unreachable)
        self.stats = CacheStats()
        #: the tiers below this cache (a kvlab.tiers.TierStack, which sets it), None without lower tiers
        self.tiers: LowerTiers | None = None
        #: called as ``key_listener(block, last)`` for each block whose key is dropped (evicted or removed),
        #: before its key is cleared; ``last``: no other block holds the key now. Set by the TierStack.
        self.key_listener: Callable[[KVBlock, bool], None] | None = None

    # ------------------------------------------------------------------ state
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable."""
        return len(self._free) + len(self.policy)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.policy)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a key, running or evictable."""
        return self._cached

    @property
    def num_orphan_blocks(self) -> int:
        """Cached blocks whose parent key is not cached: unreachable by any lookup."""
        return self._orphans

    def num_cached_children(self, key: Hashable) -> int:
        """Cached blocks whose parent is ``key`` (a block with none is a leaf of the prefix tree)."""
        return self._children.get(key, 0)

    def is_orphan(self, block: KVBlock) -> bool:
        return block.parent is not None and block.parent not in self._index

    @property
    def num_running_blocks(self) -> int:
        return self.capacity_blocks - len(self._free) - len(self.policy)

    def get(self, key: Hashable) -> KVBlock | None:
        """The oldest block holding ``key``, or None."""
        held = self._index.get(key)
        return next(iter(held.values())) if held else None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    # ------------------------------------------------------------------ primitives
    def lookup(
        self, keys: Sequence[Hashable], max_blocks: int | None = None, truths: Sequence | None = None
    ) -> tuple[list[KVBlock], int]:
        """Blocks of the longest cached prefix of ``keys`` (at most ``max_blocks``); no side effects.

        With ``truths`` (verify mode) a key match whose block holds a different truth is a collision:
        it counts as a miss and the walk stops. Returns ``(blocks, collisions)``.
        """
        hits: list[KVBlock] = []
        limit = len(keys) if max_blocks is None else min(max_blocks, len(keys))
        index = self._index
        for i in range(limit):
            held = index.get(keys[i])
            if not held:
                break
            block = next(iter(held.values()))
            if truths is not None and block.truth != truths[i]:
                return hits, 1
            hits.append(block)
        return hits, 0

    def can_allocate(self, num_new: int, hits: Sequence[KVBlock] = ()) -> bool:
        """Whether ``num_new`` blocks fit beside ``hits`` (whose evictable ones will be pinned first)."""
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return num_new <= self.num_free_blocks - evictable_hits

    def touch(self, blocks: Sequence[KVBlock], ctx: AccessContext = NO_CONTEXT) -> None:
        """Count a hit on each block and pin it (ref count + 1), taking it out of the evictable set."""
        policy = self.policy
        for block in blocks:
            policy.on_hit(block, ctx)
            if block.ref_cnt == 0:
                policy.on_pin(block, ctx)
            block.ref_cnt += 1
        self.stats.hits += len(blocks)

    def allocate(self, num: int, ctx: AccessContext = NO_CONTEXT) -> tuple[list[KVBlock], int]:
        """Take ``num`` blocks (ref count 1, no key): free ones first, then policy victims, whose keys are
        dropped. Returns ``(blocks, evictions)``. Raises CapacityError (changing nothing) if they do not fit.
        (The admission sequence names the keys the new blocks will get to the policy first: ``on_miss``.)
        """
        if num > self.num_free_blocks:
            raise CapacityError(f"cannot allocate {num} blocks: {self.num_free_blocks} free or evictable")
        free = self._free
        take = min(num, len(free))
        out: list[KVBlock] = [free.popleft() for _ in range(take)]
        evicted = num - take
        if evicted:
            orphaned = self._drop_keys(evicted, self.policy.victim, self.policy.on_evict, out)
            self.stats.evictions += evicted
            self.stats.orphan_evictions += orphaned
        for block in out:
            block.ref_cnt = 1
        return out, evicted

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        keys: Sequence[Hashable],
        start: int,
        ctx: AccessContext = NO_CONTEXT,
        truths: Sequence | None = None,
    ) -> None:
        """Give full, computed, pinned blocks their keys: ``blocks[j]`` is position ``start + j`` of the
        sequence whose full-block keys are ``keys`` (its parent is ``keys[start + j - 1]``). The blocks
        become findable; a key already cached is kept twice (duplicates are allowed)."""
        index, children, on_insert = self._index, self._children, self.policy.on_insert
        orphans = self._orphans
        pos = start
        parent = keys[pos - 1] if pos else None
        for block in blocks:
            key = keys[pos]
            if block.key is not None:
                self._orphans = orphans
                raise CapacityError(f"block {block.block_id} already holds a key")
            block.key, block.position, block.parent = key, pos, parent
            if truths is not None:
                block.truth = truths[pos]
            held = index.get(key)
            if held is None:
                orphans -= children.get(key, 0)  # its cached children become reachable
            if parent is not None:  # (same order as the compiled kernel, also when parent == key)
                children[parent] = children.get(parent, 0) + 1
                if parent not in index:
                    orphans += 1
            if held is None:
                index[key] = {block.block_id: block}
            else:
                held[block.block_id] = block
            self._orphans = orphans
            on_insert(block, ctx)
            parent = key
            pos += 1
        self._cached += len(blocks)
        self.stats.inserts += len(blocks)

    def release(self, blocks: Sequence[KVBlock], ctx: AccessContext = NO_CONTEXT) -> None:
        """Drop one reference to each block, tail first (``blocks`` in prompt order)."""
        on_unpin, free = self.policy.on_unpin, self._free
        for block in reversed(blocks):
            ref = block.ref_cnt - 1
            if ref < 0:
                raise CapacityError(f"block {block.block_id} released more often than taken")
            block.ref_cnt = ref
            if ref == 0:
                if block.key is not None:
                    on_unpin(block, ctx)
                else:
                    free.appendleft(block)

    def remove(self, block: KVBlock, *, notify: bool = True) -> None:
        """Drop an evictable block's key (``on_remove``, not an eviction) and put it at the front of the free
        queue (a lower tier's exclusive move up). ``notify=False``: the key listener is not called."""
        if block.ref_cnt or block.key is None:
            raise CapacityError(f"block {block.block_id} is not evictable")
        listener = self.key_listener
        if not notify:
            self.key_listener = None
        try:
            self._drop_keys(1, lambda: block, self.policy.on_remove, [])
        finally:
            self.key_listener = listener
        self._free.appendleft(block)

    def reset(self) -> None:
        """Drop every cached key. Allowed only while no block is in use (vLLM: reset_prefix_cache)."""
        if self.num_running_blocks:
            raise CapacityError(f"cannot reset: {self.num_running_blocks} blocks are in use")
        cached = [block for held in self._index.values() for block in held.values()]
        self._drop_keys(len(cached), iter(cached).__next__, self.policy.on_remove, [])
        self._free = deque(self.blocks)
        self._children.clear()
        self._orphans = 0
        self.stats = CacheStats()

    def _drop_keys(
        self, num: int, pick: Callable[[], KVBlock], hook: Callable[[KVBlock], None], out: list[KVBlock]
    ) -> int:
        """Take ``num`` keyed blocks, each chosen by ``pick()`` and told to the policy by ``hook(block)`` (the
        policy's ``victim`` / ``on_evict`` for evictions, the cached blocks / ``on_remove`` for ``reset``), and
        forget their keys: index, orphan accounting, cached count. The one place a key leaves the cache
        (``cache_blocks`` is the one place a key enters it). The blocks are appended to ``out``; returns how
        many of them were orphans (parent key not cached). The state is current after each block: the
        policy may read the cache in ``pick`` and ``hook``. (One loop, not a call per block: the replay's
        eviction hot path.)"""
        index, children, listener = self._index, self._children, self.key_listener
        orphaned = 0
        for _ in range(num):
            block = pick()
            hook(block)
            key, parent = block.key, block.parent
            if parent is not None:
                left = children[parent] - 1
                if left:
                    children[parent] = left
                else:
                    del children[parent]
                if parent not in index:  # an orphan leaves
                    orphaned += 1
                    self._orphans -= 1
            held = index[key]
            del held[block.block_id]
            if not held:
                del index[key]
                self._orphans += children.get(key, 0)  # its cached children become unreachable
            if listener is not None:
                listener(block, not held)
            block.key = block.parent = block.truth = None
            block.position = -1
            self._cached -= 1
            out.append(block)
        return orphaned

    # ------------------------------------------------------------------ request level
    def max_hit_blocks(self, prompt_tokens: int, num_full: int, mode: str = "vllm") -> int:
        """Most blocks a lookup may hit: all full blocks (``ideal``) or ``(prompt_len - 1) // block_size``."""
        return admission.max_hit_blocks(prompt_tokens, num_full, self.block_size, mode)

    def admit(
        self,
        keys: Sequence[Hashable],
        prompt_tokens: int,
        ctx: AccessContext = NO_CONTEXT,
        *,
        mode: str = "vllm",
        truths: Sequence | None = None,
    ) -> Admission | None:
        """The replay's admission of a whole prompt (``keys`` = its full blocks' keys, in order): the
        admission sequence (:mod:`kvlab.cache.admission`) with every new full block keyed at once (the prompt
        counts as computed); the partial last block stays unkeyed. Returns None and changes nothing if the
        request does not fit."""
        found = admission.lookup(self, keys, prompt_tokens, mode=mode, truths=truths)
        d = len(found.hits)  # device hits; lower-tier hits are loaded into new device blocks
        num_new = -(-prompt_tokens // self.block_size) - d
        placed = admission.admit(self, found, keys, num_new, ctx)
        if placed is None:
            return None
        loaded = len(found.lower)  # lower-tier hits, loaded into the first new blocks; then the computed ones
        if loaded:
            admission.key(self, placed.blocks[:loaded], keys, d, ctx, truths, loaded=loaded)
        admission.key(self, placed.blocks[loaded : len(keys) - d], keys, d + loaded, ctx, truths)
        self.stats.collisions += found.collisions
        return Admission(found.hits + placed.blocks, found.num_blocks, num_new, placed.evictions, found.collisions,
                         placed.orphan_evictions, placed.loaded)
