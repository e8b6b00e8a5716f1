"""The tiers below the device in the Python core: lookup cascade, pins, loads, stores (docs/tiers.md).

A :class:`TierStack` is attached to the device :class:`~kvlab.cache.prefix_cache.PrefixCache`
(``device.tiers``); the admission sequence (kvlab.cache.admission) calls it at its lower-tier steps:

* **lower-tier lookup** (:meth:`TierStack.lookup`, no side effects): tier ``k`` starts at the first miss of
  the tiers above and never returns upward; a chunked tier (``c`` blocks per chunk) starts at the chunk that
  holds that miss, counts whole chunks, and contributes only the blocks past the hits above. The total is
  capped at the request's hit limit (the last prompt token is computed). At most ``max_load_blocks`` of the
  hits found below are loaded (a prefix); the rest are recomputed.
* **pin** (:meth:`TierStack.pin`): each found chunk counts a hit and is pinned, before the device allocates.
* **load** (:meth:`TierStack.load`): the loaded chunks are read (an ``exclusive`` tier drops them: they moved
  up); the pins are released tail first; then, with ``touch``, every other chunk of the request the tier holds
  is touched (hit, pin, unpin: the most recent for recency policies), tail first.
* **keyed** (:meth:`TierStack.keyed`): blocks the device computed are stored in every ``write_through``
  tier (a chunk once its last block is computed), held pinned until the request's stores are done and then
  released tail first (as the device releases a request: a recency policy evicts its tail first); an
  ``exclusive`` tier drops keys the device now holds; an ``inclusive`` tier pins them.
* A key's last copy leaving tier ``k`` (device: ``k = 0``) is stored in tier ``k + 1`` if that tier is
  ``write_back``; ``inclusive`` tiers hold a pin on each key resident in a tier above them.
* ``write_through_selective`` stores a key once it has had ``selective_hits`` hits (device or lower) while
  resident on the device.

A store that finds no free or evictable slot is skipped and counted. Units: blocks of the device's block
size unless a name says chunks (a chunked tier's slots); tokens only in ``max_load_tokens``.

Data movement (the real engine, kvlab.engine.tiers.store): a :class:`TierMover` given to :meth:`TierStack.attach`
moves the K/V bytes of every slot event: ``store`` when a slot gets its key (from device blocks, or from the
slot of the tier above that evicts it: called before the evicting allocation reuses the source), ``load`` into
the device blocks the admission placed, ``drop`` when a slot loses its key, and ``check`` at lookup: a slot
whose data cannot be read (corrupt, missing, a failed write) is a miss there, dropped at the next admission, so
its blocks are recomputed, never served; a failed ``store`` leaves the slot free. Without a mover (the replay)
nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvlab.cache.block import KVBlock
from kvlab.cache.context import NO_CONTEXT, AccessContext
from kvlab.cache.prefix_cache import PrefixCache, pool_blocks
from kvlab.errors import ConfigError
from kvlab.policies import make_policy
from kvlab.tiers.spec import Tier, check_tiers


@dataclass(slots=True)
class TierCounters:
    """Running totals of one lower tier (blocks; ``*_chunks`` in its chunks)."""

    looked_up_blocks: int = 0  # blocks past the hits above, up to the hit limit, when it was looked up
    found_blocks: int = 0  # hits found here (past the hits above)
    loaded_blocks: int = 0  # of those, loaded into device blocks (the request's hits from this tier)
    stored_chunks: int = 0
    stores_skipped: int = 0  # no free or evictable slot
    evictions: int = 0
    evicted_unread: int = 0  # chunks evicted that were never loaded since they were stored
    removed_exclusive: int = 0  # chunks dropped because the key moved up (exclusive)


class TierMover(Protocol):
    """Moves the K/V bytes of lower-tier slots (module docstring). ``level``: 1 = just below the device;
    ``slot``: the tier's block id (one chunk); device ids are KV-pool block ids."""

    def check(self, level: int, slot: int) -> bool:
        """Whether ``slot``'s data can be served (read and verified now; no change to the tiers)."""

    def store(self, level: int, slot: int, src_level: int, src: Sequence[int] | Callable[[], list[int]],
              keyed: bool) -> bool:
        """Copy a chunk into ``slot``: from device blocks ``src`` (``src_level`` 0) or from slot ``src[0]`` of
        tier ``src_level``. ``keyed``: blocks keyed now, whose K/V may be written later in the step; ``src`` is
        then a function giving the device blocks that hold the chunk's keys when it is called (None: a key
        left the device). False: nothing stored (the slot stays free)."""

    def load(self, level: int, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Copy blocks ``first .. first + len(blocks) - 1`` of ``slot``'s chunk into device blocks ``blocks``."""

    def drop(self, level: int, slot: int) -> None:
        """``slot`` lost its key (evicted, moved up, bad): free its data."""

    def admitted(self) -> None:
        """An admission's loads are done (reads staged by ``check`` that no load used may go)."""


class _Pair(Sequence):
    """``keys`` for ``PrefixCache.cache_blocks`` storing one key at ``pos`` with parent ``parent``."""

    __slots__ = ("key", "parent", "pos")

    def __init__(self, key: Hashable, parent: Hashable | None, pos: int) -> None:
        self.key, self.parent, self.pos = key, parent, pos

    def __getitem__(self, i: int) -> Hashable | None:  # type: ignore[override]
        return self.key if i == self.pos else self.parent

    def __len__(self) -> int:
        return self.pos + 1


class LowerTier:
    """One tier below the device: a :class:`PrefixCache` of ``capacity_blocks // chunk_blocks`` slots (a slot
    holds one chunk, keyed by the key of the chunk's last block, its parent the previous chunk's key), with the
    tier's own policy. Owned by its :class:`TierStack`, or shared by several: a shared pool (kvlab.replay.cluster)
    is one LowerTier passed as the last tier of every node's stack; nothing else changes it."""

    def __init__(self, spec: Tier, level: int, block_size: int, demand_blocks: int | None = None) -> None:
        self.spec = spec
        self.level = level  # 1 = just below the device
        self.chunk = spec.chunk_blocks
        slots = spec.chunk_slots if demand_blocks is None else pool_blocks(spec.chunk_slots,
                                                                           demand_blocks // self.chunk + 1)
        self.cache = PrefixCache(slots, make_policy(spec.policy, **(spec.policy_params or {})),
                                 block_size=block_size * spec.chunk_blocks)
        self.counters = TierCounters()
        self.unread: set[int] = set()  # slots stored and not loaded since
        self.pinned_above: set[Hashable] = set()  # inclusive: keys this tier pins (resident above)

    def chunk_key(self, keys: Sequence[Hashable], j: int) -> Hashable:
        return keys[(j + 1) * self.chunk - 1]

    def slot(self, key: Hashable) -> KVBlock | None:
        return self.cache.get(key)


@dataclass(slots=True)
class TierHits:
    """What the lower-tier lookup found for one request (no side effects; blocks). ``segments[i]`` =
    ``(level, start, end, slots)``: tier ``level`` holds positions ``start .. end - 1`` past the hits above,
    in chunks ``slots``. ``loaded`` = blocks that will be loaded (a prefix of the found ones)."""

    segments: list[tuple[int, int, int, list[KVBlock]]] = field(default_factory=list)
    looked_up: list[tuple[int, int]] = field(default_factory=list)  # (level, blocks looked up)
    loaded: int = 0

    def __len__(self) -> int:
        """Blocks that will be loaded (hits from the lower tiers)."""
        return self.loaded

    def __bool__(self) -> bool:
        """Whether anything was found (to pin), loaded or not."""
        return bool(self.segments)

    def loaded_by_level(self, levels: int) -> list[int]:
        """Loaded blocks per lower tier (index 0 = level 1)."""
        out = [0] * levels
        left = self.loaded
        for level, start, end, _ in self.segments:
            take = min(end - start, left)
            out[level - 1] += take
            left -= take
        return out


class TierStack:
    """The lower tiers of one device cache, in order (see the module docstring)."""

    def __init__(self, device: PrefixCache, tiers: Sequence[Tier | LowerTier], *,
                 max_load_tokens: int | None = None, demand_blocks: int | None = None) -> None:
        """``demand_blocks``: an upper bound on the blocks the workload can store (state is allocated for at
        most that many, as for the device: kvlab.cache.pool_blocks; numbers unchanged). A :class:`LowerTier`
        in ``tiers`` is used as is, shared with the other stacks given it (a pool below several devices): it
        must be the last tier, at its level, with ``inclusion="none"`` (its evictions then touch no other
        tier, so any stack's listener serves it)."""
        check_tiers([t.spec if isinstance(t, LowerTier) else t for t in tiers], max_load_tokens=max_load_tokens)
        bs = device.block_size
        self.device = device
        self.tiers = [t if isinstance(t, LowerTier) else
                      LowerTier(t if t.capacity_blocks is not None else _unresolved(t), i + 1, bs, demand_blocks)
                      for i, t in enumerate(tiers)]
        for i, t in enumerate(tiers):
            if isinstance(t, LowerTier):
                _check_shared(t, i + 1, len(tiers), bs)
        self.max_load_blocks = None if max_load_tokens is None else max_load_tokens // bs
        self.ctx: AccessContext = NO_CONTEXT  # the request being admitted (for hooks run by evictions)
        self.hits: dict[Hashable, int] = {}  # selective: hits of a key while resident on the device
        self._selective = any(t.spec.write == "write_through_selective" for t in self.tiers)
        self.mover: TierMover | None = None  # moves the K/V bytes (the real engine); None: metadata only
        self._check = None  # mover.check, or None
        self._bad: list[tuple[LowerTier, KVBlock]] = []  # slots a lookup found unreadable: dropped at admission
        device.tiers = self
        device.key_listener = self._device_dropped
        for t in self.tiers:
            t.cache.key_listener = self._listener(t)

    def attach(self, mover: TierMover) -> None:
        """Move K/V bytes with ``mover`` from now on (before the first request: the tiers must be empty)."""
        if any(t.cache.num_cached_blocks for t in self.tiers):
            raise ConfigError("attach a tier mover before the tiers hold anything")
        self.mover = mover
        self._check = mover.check

    # ------------------------------------------------------------------ admission steps
    def lookup(self, keys: Sequence[Hashable], start: int, limit: int) -> TierHits:
        """Lower-tier lookup for positions ``start .. limit - 1`` (``start`` = device hits)."""
        out = TierHits()
        h = start
        check = self._check
        for t in self.tiers:
            if h >= limit:
                break
            out.looked_up.append((t.level, limit - h))
            c = t.chunk
            j = h // c
            end = h
            slots: list[KVBlock] = []
            index = t.cache
            while end < limit and (j + 1) * c <= len(keys):
                slot = index.get(keys[(j + 1) * c - 1])
                if slot is None:
                    break
                if check is not None and not check(t.level, slot.block_id):
                    self._bad.append((t, slot))  # unreadable: a miss here (dropped at the next admission)
                    break
                slots.append(slot)
                end = (j + 1) * c
                j += 1
            end = min(end, limit)
            if end > h:
                out.segments.append((t.level, h, end, slots))
                h = end
        found = h - start
        out.loaded = found if self.max_load_blocks is None else min(found, self.max_load_blocks)
        return out

    def pin(self, found: TierHits, ctx: AccessContext) -> None:
        """Count a hit on each found chunk and pin it (before the device allocates)."""
        self.ctx = ctx
        if self._bad:
            self._drop_bad()
        for level, _, _, slots in found.segments:
            t = self.tiers[level - 1]
            t.cache.touch(slots, ctx)

    def begin(self, ctx: AccessContext) -> None:
        """The request whose admission runs now (hooks run by evictions see its context)."""
        self.ctx = ctx
        if self._bad:
            self._drop_bad()

    def load(self, found: TierHits | tuple, keys: Sequence[Hashable], device_hits: int,
             ctx: AccessContext, into: Sequence[KVBlock] = ()) -> list[int]:
        """Read the loaded chunks into the device blocks ``into`` (the new blocks, positions ``device_hits ..``;
        an exclusive tier drops the chunks in :meth:`keyed`, when the device keys them), release the pins, touch
        the request's other chunks; returns the loaded blocks per lower tier (index 0 = level 1). Selective hit
        counts are updated here. ``found`` is ``()`` when the device hits reached the hit limit (no lower-tier
        lookup)."""
        if not isinstance(found, TierHits):
            found = TierHits()
        left = found.loaded
        for level, start, end, slots in found.segments:
            t = self.tiers[level - 1]
            c = t.counters
            c.found_blocks += end - start
            take = min(end - start, left)
            left -= take
            c.loaded_blocks += take
            if take and self.mover is not None:
                self._move_in(t, start, take, slots, [b.block_id for b in into[start - device_hits:
                                                                               start - device_hits + take]])
            if take:
                for slot in slots[: (start + take - 1) // t.chunk - start // t.chunk + 1]:
                    t.unread.discard(slot.block_id)
            t.cache.release(slots, ctx)
        for level, blocks in found.looked_up:
            self.tiers[level - 1].counters.looked_up_blocks += blocks
        hit_slots = {id(s) for _, _, _, slots in found.segments for s in slots}
        for t in self.tiers:
            if t.spec.touch:
                self._touch(t, keys, hit_slots, ctx)
        if self._selective:
            hits = self.hits
            for i in range(device_hits + found.loaded):
                k = keys[i]
                n = hits.get(k, 0) + 1
                hits[k] = n
                self._store_selective(keys, i, n, into, device_hits)
        if self.mover is not None:
            self.mover.admitted()
        return found.loaded_by_level(len(self.tiers))

    def keyed(self, keys: Sequence[Hashable], start: int, end: int, loaded: int, ctx: AccessContext) -> None:
        """The device keyed positions ``start .. end - 1`` of ``keys``: the first ``loaded`` were loaded, the
        rest computed. ``write_through`` tiers store the computed ones (a chunk once its last block is
        computed); ``exclusive`` tiers drop every one (it is above now); ``inclusive`` tiers pin them."""
        self.ctx = ctx
        computed = start + loaded
        for t in self.tiers:
            spec = t.spec
            if spec.inclusion == "exclusive":
                for pos in range(start, end):
                    self._remove(t, keys[pos])
            elif spec.inclusion == "inclusive":
                for pos in range(start, end):
                    self._pin_above(t, keys[pos])
            if spec.write == "write_through":
                c = t.chunk
                held: list[KVBlock] = []  # this request's stores, pinned until all are stored
                for j in range(computed // c, end // c):  # chunks whose last block was computed now
                    src = self._resolver(keys, j * c, c) if self.mover is not None else None
                    self._store(t, keys[(j + 1) * c - 1], keys[j * c - 1] if j else None, j, held, src, True)
                if held:
                    t.cache.release(held, ctx)  # tail first, as the device releases: the tail is evicted first

    # ------------------------------------------------------------------ mechanics
    def _move_in(self, t: LowerTier, start: int, take: int, slots: list[KVBlock], blocks: list[int]) -> None:
        """The mover copies positions ``start .. start + take - 1`` (held by ``slots``, chunks of ``t``) into
        device blocks ``blocks``."""
        c = t.chunk
        pos, stop = start, start + take
        for slot in slots:
            if pos >= stop:
                break
            first = pos % c
            n = min(c - first, stop - pos)
            self.mover.load(t.level, slot.block_id, first, blocks[pos - start: pos - start + n])
            pos += n

    def _device_ids(self, keys: Sequence[Hashable], start: int, n: int) -> list[int] | None:
        """Device block ids holding positions ``start .. start + n - 1`` of ``keys`` now (any block with the
        key); None if one of the keys is not on the device."""
        get = self.device.get
        out = []
        for p in range(start, start + n):
            block = get(keys[p])
            if block is None:
                return None
            out.append(block.block_id)
        return out

    def _resolver(self, keys: Sequence[Hashable], start: int, n: int) -> Callable[[], list[int] | None]:
        """:meth:`_device_ids` when called (a deferred store resolves its source after the forward pass)."""
        return lambda: self._device_ids(keys, start, n)

    def _drop_bad(self) -> None:
        """Drop the slots a lookup found unreadable (still unreadable and evictable) from their tiers."""
        bad, self._bad = self._bad, []
        for t, slot in bad:
            if slot.key is None or slot.ref_cnt or self.mover.check(t.level, slot.block_id):
                continue
            key = slot.key
            t.cache.remove(slot, notify=False)
            t.unread.discard(slot.block_id)
            self.mover.drop(t.level, slot.block_id)
            if key not in t.cache:
                self._unpin_above(t.level, key)

    def _touch(self, t: LowerTier, keys: Sequence[Hashable], skip: set[int], ctx: AccessContext) -> None:
        c = t.chunk
        cache, policy = t.cache, t.cache.policy
        for j in range(len(keys) // c - 1, -1, -1):
            slot = cache.get(keys[(j + 1) * c - 1])
            if slot is None or id(slot) in skip:
                continue
            policy.on_hit(slot, ctx)
            if slot.ref_cnt == 0:
                policy.on_pin(slot, ctx)
                policy.on_unpin(slot, ctx)

    def _store(self, t: LowerTier, key: Hashable, parent: Hashable | None, pos: int,
               held: list[KVBlock] | None = None, src: Sequence[int] | Callable | None = None,
               keyed: bool = False, src_level: int = 0) -> None:
        """Store ``key`` (position ``pos``, parent ``parent``) in ``t``: skipped if present, if ``t`` is
        exclusive and a tier above holds it, or (counted) if no slot is free or evictable. The new slot is
        released at once, or kept pinned in ``held`` for the caller to release, or kept pinned while a tier
        above holds the key (inclusive). With a mover, its data comes from ``src`` (device block ids, or the
        slot of tier ``src_level``); a failed copy leaves the slot free and the key not stored."""
        cache = t.cache
        if cache.get(key) is not None:
            return
        if t.spec.inclusion == "exclusive" and self._resident_above(t, key):
            return  # stored when it leaves the tiers above
        if cache.num_free_blocks == 0:
            t.counters.stores_skipped += 1
            return
        (slot,), evicted = cache.allocate(1, self.ctx)
        t.counters.evictions += evicted
        if self.mover is not None and not self.mover.store(t.level, slot.block_id, src_level, src, keyed):
            cache.release([slot], self.ctx)  # no key: back to the free queue
            return
        cache.cache_blocks([slot], _Pair(key, parent, pos), pos, self.ctx)
        t.counters.stored_chunks += 1
        t.unread.add(slot.block_id)
        if t.spec.inclusion == "inclusive" and self._resident_above(t, key):
            t.pinned_above.add(key)  # stays pinned (ref count 1) while resident above
        elif held is not None:
            held.append(slot)
        else:
            cache.release([slot], self.ctx)

    def _remove(self, t: LowerTier, key: Hashable) -> None:
        """Drop ``key`` from tier ``t`` (exclusive: it moved up). Its slot becomes free."""
        slot = t.cache.get(key)
        if slot is None or slot.ref_cnt:
            return
        t.cache.remove(slot, notify=False)
        t.unread.discard(slot.block_id)
        t.counters.removed_exclusive += 1
        if self.mover is not None:
            self.mover.drop(t.level, slot.block_id)

    def _resident_above(self, t: LowerTier, key: Hashable) -> bool:
        if key in self.device:
            return True
        return any(key in u.cache for u in self.tiers[: t.level - 1])

    def _pin_above(self, t: LowerTier, key: Hashable) -> None:
        if key in t.pinned_above:
            return
        slot = t.slot(key)
        if slot is not None:
            t.cache.touch([slot], self.ctx)
            t.pinned_above.add(key)

    def _unpin_above(self, level: int, key: Hashable) -> None:
        """``key``'s last copy left tier ``level``: release inclusive pins no tier above holds any more."""
        for t in self.tiers[level:]:
            if t.spec.inclusion == "inclusive" and key in t.pinned_above and not self._resident_above(t, key):
                t.pinned_above.discard(key)
                slot = t.slot(key)
                if slot is not None:
                    t.cache.release([slot], self.ctx)

    def _store_selective(self, keys: Sequence[Hashable], pos: int, hits: int, into: Sequence[KVBlock],
                         first: int) -> None:
        """Store ``keys[pos]`` (``hits`` hits so far) in the selective tiers it qualifies for; its device block is
        a hit (``pos < first``) or ``into[pos - first]`` (loaded now, not keyed yet)."""
        for t in self.tiers:
            if t.spec.write == "write_through_selective" and hits >= t.spec.selective_hits:
                src = None
                if self.mover is not None:
                    src = [into[pos - first].block_id] if pos >= first else self._device_ids(keys, pos, 1)
                self._store(t, keys[pos], keys[pos - 1] if pos else None, pos, None, src)

    def _device_dropped(self, block: KVBlock, last: bool) -> None:
        if not last:
            return
        key = block.key
        self.hits.pop(key, None)
        if self.tiers and self.tiers[0].spec.write == "write_back":
            self._store(self.tiers[0], key, block.parent, block.position, None, [block.block_id])
        self._unpin_above(0, key)

    def _listener(self, t: LowerTier):  # noqa: ANN202 - a closure per tier
        below = self.tiers[t.level] if t.level < len(self.tiers) else None

        def dropped(slot: KVBlock, last: bool) -> None:
            if slot.block_id in t.unread:
                t.unread.discard(slot.block_id)
                t.counters.evicted_unread += 1
            if last and below is not None and below.spec.write == "write_back":
                self._store(below, slot.key, slot.parent, slot.position, None, [slot.block_id], False, t.level)
            if last:
                self._unpin_above(t.level, slot.key)
            if self.mover is not None:
                self.mover.drop(t.level, slot.block_id)

        return dropped

    # ------------------------------------------------------------------ results
    def resident_levels(self, key: Hashable) -> list[int]:
        """Levels holding ``key`` (0 = device), for invariant checks."""
        out = [0] if key in self.device else []
        return out + [t.level for t in self.tiers if key in t.cache]


def _check_shared(t: LowerTier, level: int, levels: int, block_size: int) -> None:
    """A shared :class:`LowerTier` given as tier ``level`` of ``levels``: ConfigError unless it can be shared."""
    name = t.spec.name
    if t.spec.inclusion != "none":
        raise ConfigError(f"shared tier {name!r}: inclusion={t.spec.inclusion} is per stack; a shared tier needs "
                          "inclusion=none")
    if level != levels or t.level != level:
        raise ConfigError(f"shared tier {name!r} (level {t.level}) must be the last tier, level {levels}")
    if t.cache.block_size != block_size * t.chunk:
        raise ConfigError(f"shared tier {name!r}: built for {t.cache.block_size // t.chunk}-token blocks, the "
                          f"device has {block_size}")


def _unresolved(t: Tier) -> Tier:
    raise ConfigError(f"tier {t.name!r}: gib={t.capacity_gib} is not resolved to blocks (give a model)")
