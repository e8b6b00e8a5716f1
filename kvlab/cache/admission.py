"""The admission sequence: how one request's blocks enter the cache, the same steps for every driver.

    lookup → lower-tier lookup → fit → pin (all tiers) → on_miss → allocate → load → key

The replay core (:meth:`PrefixCache.admit <kvlab.cache.prefix_cache.PrefixCache.admit>`) and the KV
manager (:class:`~kvlab.cache.manager.KVCacheManager`: the simulator's scheduler and the real engine's
sequential driver) admit requests through these functions and nothing else; the compiled replay kernel
(:mod:`kvlab.cache.compiled`) mirrors them on dense ids. The block-level state transitions (index, ref
counts, free queue, policy hooks) are :class:`~kvlab.cache.prefix_cache.PrefixCache`'s primitives; this
module only orders them. docs/semantics.md, "Admission sequence", has the same steps in prose.

Units: ``keys`` are the chained keys of a request's *full* blocks, in sequence order, so a block's index in
``keys`` is its position (0 = the sequence's first block); block counts (``num_new``, ``start``, hits) are
in blocks; ``num_tokens`` is in tokens; ``bs`` is the block size in tokens.

1. **lookup** (:func:`lookup`, no side effects): device hits, walking ``keys`` from position 0 and stopping
   at the first miss, at most :func:`max_hit_blocks` (mode ``vllm``: ``(num_tokens - 1) // bs``, so the last
   known token is always computed). With ``truths`` (verify mode) a key held by a block of other content is
   a collision, counted and treated as the first miss.
2. **lower-tier lookup** (:func:`lookup_lower`, no side effects): continues from the device's first miss
   through the tiers below the device (DRAM, SSD), up to the same cap: tier ``k`` starts at the first miss of
   the tiers above and never returns upward (:class:`kvlab.tiers.TierStack`). Without tiers: never a hit.
3. **fit** (:func:`fits`): the request's new device blocks must not exceed the free plus evictable blocks
   minus its device hits that are evictable now (they are pinned first, so they cannot be victims). Lower-tier
   hits need new device blocks too (they are loaded into them). A request that does not fit changes nothing:
   no hook is called, no ref count, key or block moves.
4. **pin** (:func:`pin`): every hit counts (``on_hit``) and is pinned (ref count + 1; ``on_pin`` when it
   leaves the evictable set), on every tier, before anything is allocated: a request never evicts its own
   hits, and a lower-tier hit stays put until it is loaded.
5. **on_miss** (:func:`on_miss`): the device policy is told the keys of the new blocks that have keys
   (positions ``start ..`` of ``keys``), in order, before any victim is chosen.
6. **allocate** (:func:`allocate`): ``num_new`` device blocks, free queue front first, then policy victims
   (each victim's key is dropped: an eviction). New blocks have ref count 1 and no key.
7. **load** (:func:`load`): lower-tier hits are copied into the first new blocks; the lower tiers release
   their pins and touch the request's other blocks they hold. Without tiers: nothing.
8. **key** (:func:`key`): a full block gets its key only once its K/V is in the pool: loaded blocks after
   the load, computed blocks after the forward pass that wrote them. The replay keys at once (its prompt is
   "computed" on admission); the simulator at schedule or compute time (``cache_at``); the engine right after
   its forward pass, so a failed forward leaves no key over unwritten K/V. Partial blocks are never keyed.

:func:`admit` runs steps 3-7 for a request that holds no blocks (after steps 1-2 and the caller's choice of
how many blocks to allocate now); :func:`grow` runs steps 3, 5 and 6 for a running request that needs more
blocks (no lookup, nothing to pin or load). Release is not part of admission: the request's blocks are
unpinned tail first (:meth:`PrefixCache.release <kvlab.cache.prefix_cache.PrefixCache.release>`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError

if TYPE_CHECKING:
    from kvlab.cache.prefix_cache import PrefixCache

COUNTING_MODES = ("vllm", "ideal")


@dataclass(slots=True)
class Lookup:
    """What steps 1-2 found for one request (no side effects; units: blocks).

    ``hits``: device blocks holding ``keys[0 : len(hits)]``, in order. ``lower``: lower-tier hits for
    ``keys[len(hits) : num_blocks]`` (a :class:`kvlab.tiers.stack.TierHits`, its length the blocks that will be
    loaded; ``()`` without tiers). ``collisions``: 1 when the device walk
    stopped at a key whose block holds other content (verify mode), else 0.
    """

    hits: list[KVBlock]
    lower: Sequence = ()
    collisions: int = 0

    @property
    def num_blocks(self) -> int:
        """Hit blocks on all tiers: the request's cached prefix, in blocks."""
        return len(self.hits) + len(self.lower)


@dataclass(slots=True)
class Placement:
    """What steps 4-7 did: the new device blocks (positions ``start ..`` of the sequence, in order; ref count
    1, no key yet), the keyed blocks evicted to get them, and how many of those were orphans."""

    blocks: list[KVBlock]
    evictions: int
    orphan_evictions: int
    loaded: list[int] = field(default_factory=list)  # blocks loaded into ``blocks`` per lower tier (level 1 first)


def max_hit_blocks(num_tokens: int, num_keys: int, block_size: int, mode: str = "vllm") -> int:
    """Most blocks a lookup may hit: every full block (``ideal``) or ``(num_tokens - 1) // block_size``
    (``vllm``: the last known token is always computed). ``num_tokens`` in tokens, the rest in blocks."""
    if mode == "ideal":
        return num_keys
    if mode != "vllm":
        raise ConfigError(f"counting mode must be one of {COUNTING_MODES}, got {mode!r}")
    return min(num_keys, max(num_tokens - 1, 0) // block_size)


# ---------------------------------------------------------------------- steps 1-2: no side effects
def lookup(
    cache: PrefixCache, keys: Sequence[Hashable], num_tokens: int, *, mode: str = "vllm",
    truths: Sequence | None = None,
) -> Lookup:
    """Steps 1-2 for a sequence of ``num_tokens`` known tokens whose full blocks have ``keys``."""
    limit = max_hit_blocks(num_tokens, len(keys), cache.block_size, mode)
    hits, collisions = cache.lookup(keys, limit, truths)
    lower = lookup_lower(cache, keys, len(hits), limit) if cache.tiers is not None and len(hits) < limit else ()
    return Lookup(hits, lower, collisions)


def lookup_lower(cache: PrefixCache, keys: Sequence[Hashable], start: int, limit: int) -> Sequence:
    """Step 2: hits of ``keys[start:limit]`` on the tiers below ``cache``, from ``start`` (the device's first
    miss) on, each tier from the first miss of the tiers above. ``()`` without tiers."""
    return cache.tiers.lookup(keys, start, limit) if cache.tiers is not None else ()


# ---------------------------------------------------------------------- steps 3-7
def fits(cache: PrefixCache, found: Lookup, num_new: int) -> bool:
    """Step 3: whether ``num_new`` new device blocks fit beside ``found``'s device hits (no side effects)."""
    return cache.can_allocate(num_new, found.hits)


def pin(cache: PrefixCache, found: Lookup, ctx: AccessContext) -> None:
    """Step 4: count and pin every hit, device hits in prefix order, then each lower tier's."""
    if found.hits:
        cache.touch(found.hits, ctx)
    if cache.tiers is not None:
        cache.tiers.pin(found.lower, ctx) if found.lower else cache.tiers.begin(ctx)


def on_miss(cache: PrefixCache, keys: Sequence[Hashable], ctx: AccessContext) -> None:
    """Step 5: tell the device policy the keys of the new blocks that will carry one (none: no call)."""
    if keys:
        cache.policy.on_miss(keys, ctx)


def allocate(cache: PrefixCache, num_new: int, ctx: AccessContext) -> Placement:
    """Step 6: take ``num_new`` device blocks (the caller has checked that they fit)."""
    orphans = cache.stats.orphan_evictions
    blocks, evicted = cache.allocate(num_new, ctx)
    return Placement(blocks, evicted, cache.stats.orphan_evictions - orphans)


def load(cache: PrefixCache, found: Lookup, placed: Placement, keys: Sequence[Hashable], ctx: AccessContext) -> None:
    """Step 7: copy ``found.lower`` into ``placed.blocks[:len(found.lower)]``; the lower tiers release their pins
    and touch the request's blocks they hold (``placed.loaded``: blocks per tier). Without tiers: nothing."""
    if cache.tiers is not None:
        placed.loaded = cache.tiers.load(found.lower, keys, len(found.hits), ctx, placed.blocks)


def admit(
    cache: PrefixCache, found: Lookup, keys: Sequence[Hashable], num_new: int, ctx: AccessContext
) -> Placement | None:
    """Steps 3-7 for a request that holds no blocks: ``num_new`` new device blocks at positions
    ``len(found.hits) ..`` after its hits. None, with nothing changed, when they do not fit."""
    num_new = max(num_new, 0)
    if not fits(cache, found, num_new):
        return None
    pin(cache, found, ctx)
    start = len(found.hits)
    on_miss(cache, keys[start : start + num_new], ctx)
    placed = allocate(cache, num_new, ctx)
    load(cache, found, placed, keys, ctx)
    return placed


def grow(
    cache: PrefixCache, keys: Sequence[Hashable], start: int, num_new: int, ctx: AccessContext
) -> Placement | None:
    """Steps 3, 5 and 6 for a running request that holds ``start`` blocks and needs ``num_new`` more.
    None, with nothing changed, when they do not fit."""
    if num_new > cache.num_free_blocks:
        return None
    on_miss(cache, keys[start : start + num_new], ctx)
    return allocate(cache, num_new, ctx)


# ---------------------------------------------------------------------- step 8
def key(
    cache: PrefixCache, blocks: Sequence[KVBlock], keys: Sequence[Hashable], start: int, ctx: AccessContext,
    truths: Sequence | None = None, loaded: int = 0,
) -> None:
    """Step 8: ``blocks`` (pinned, full, their K/V written) become positions ``start ..`` of the sequence with
    ``keys``: they get ``keys[start : start + len(blocks)]`` (and ``truths``, for verify mode and false-hit
    counting) and become findable. ``blocks[:loaded]`` were loaded from lower tiers, the rest computed: the
    lower tiers store what their write policy asks (:meth:`kvlab.tiers.TierStack.keyed`)."""
    if blocks:
        cache.cache_blocks(blocks, keys, start, ctx, truths)
        if cache.tiers is not None:
            cache.tiers.keyed(keys, start, start + len(blocks), loaded, ctx)
