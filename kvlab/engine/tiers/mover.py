"""The engine's data mover: :class:`TierIO` copies K/V bytes between the device pool and the tiers' stores.

:class:`TierIO` is the stack's :class:`~kvlab.tiers.stack.TierMover`: it copies pool blocks into a slot when
the stack stores, the slot into the device blocks the admission placed when it loads, and frees a slot when
it is dropped. It sees each tier's store only through :class:`~kvlab.engine.tiers.store.TierStore`. A slot
of a ``checked`` store (disk) is loaded and verified when a lookup finds it (``check``; the bytes are staged
in host memory for the load that follows): an unreadable slot is a miss there, its blocks are recomputed,
never served, and the read error is counted. A failed store (``OSError``: ENOSPC, EIO) is counted and the slot
is not stored. Counters per tier: :class:`TierIOCounters`.

Units: bytes, seconds, slots and blocks by id.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvlab.engine.kv_pool import KVPool
from kvlab.engine.tiers.store import TierDir, TierReadError, TierStore


@dataclass
class TierIOCounters:
    """One tier's data movement (chunks; bytes; seconds of the copies and file I/O)."""

    stores: int = 0
    loads: int = 0  # chunk reads into device blocks (a partial chunk counts once)
    bytes_written: int = 0
    bytes_read: int = 0  # bytes copied into device blocks
    write_s: float = 0.0
    read_s: float = 0.0  # reads and checks at lookup (disk) plus the copies into the pool
    read_errors: int = 0  # unreadable slots found (corrupt, truncated, missing): recomputed, never served
    write_errors: int = 0  # failed stores (OSError: ENOSPC, EIO, a quota): not stored



class TierIO:
    """The :class:`~kvlab.tiers.stack.TierMover` of one engine: ``stores[level - 1]`` holds tier ``level``'s
    slots; ``pool`` is the device pool. ``defer``: stores from blocks keyed now wait for :meth:`flush` (the
    scheduler keys blocks when it schedules them, before the forward writes their K/V)."""

    def __init__(self, pool: KVPool, stores: Sequence[TierStore], *, defer: bool = False,
                 tier_dir: TierDir | None = None) -> None:
        self.pool, self.stores, self.defer, self.dir = pool, list(stores), defer, tier_dir
        self.counters = [TierIOCounters() for _ in self.stores]
        self._staged: dict[tuple[int, int], torch.Tensor | None] = {}  # (level, slot) -> verified chunk, or bad
        self._pending: dict[tuple[int, int], Callable] = {}  # deferred stores: (level, slot) -> its source
        self.stack: object | None = None  # the TierStack it moves for, its tiers and load limit (attach_tiers)
        self.tiers: list = []
        self.max_load_tokens: int | None = None

    # ------------------------------------------------------------------ the mover
    def check(self, level: int, slot: int) -> bool:
        if (level, slot) in self._pending:
            return True
        store = self.stores[level - 1]
        if not store.checked or not store.contains(slot):  # (no data: a failed deferred write, counted there)
            return store.contains(slot)
        key = (level, slot)
        if key in self._staged:
            return self._staged[key] is not None
        t0 = time.perf_counter()
        try:
            data = store.load(slot)
        except TierReadError:
            data = None
            self.counters[level - 1].read_errors += 1
        self.counters[level - 1].read_s += time.perf_counter() - t0
        self._staged[key] = data
        return data is not None

    def store(self, level: int, slot: int, src_level: int, src: Sequence[int] | Callable, keyed: bool) -> bool:
        key = (level, slot)
        self._unstage(key)
        self._pending.pop(key, None)
        if keyed and self.defer:
            self._pending[key] = src  # resolved after the forward pass (flush): the blocks holding the keys then
            return True
        if src_level and (src_level, src[0]) in self._pending:  # its K/V is not written yet: store it later too
            self._pending[key] = self._pending[(src_level, src[0])]
            return True
        if src_level == 0:
            return self._write_from_pool(level, slot, src() if keyed else src)
        data = self._source(src_level, src[0])
        if data is None:
            return False
        try:
            return self._write(level, slot, lambda: data)
        finally:
            if (src_level, src[0]) not in self._staged:
                self.stores[src_level - 1].release(data)

    def load(self, level: int, slot: int, first: int, blocks: Sequence[int]) -> None:
        key = (level, slot)
        if key in self._pending:
            self._flush_one(key)
        c = self.counters[level - 1]
        t0 = time.perf_counter()
        data = self._staged.pop(key, None)
        if data is None:
            data = self._source(level, slot)
            if data is None:  # (check passed at lookup: only a failure between lookup and load gets here)
                raise TierReadError(errno.EIO, f"tier level {level}: slot {slot} became unreadable during a load")
        store = self.stores[level - 1]
        self.pool.data[self._ids(blocks)] = data[first:first + len(blocks)].to(
            self.pool.device, non_blocking=store.stable_loads)  # (a disk read buffer is reused right after)
        store.release(data)
        c.loads += 1
        c.bytes_read += len(blocks) * self.pool.layout.bytes_per_block
        c.read_s += time.perf_counter() - t0

    def drop(self, level: int, slot: int) -> None:
        key = (level, slot)
        self._unstage(key)
        self._pending.pop(key, None)
        self.stores[level - 1].remove(slot)

    # ------------------------------------------------------------------ engine side
    def flush(self) -> None:
        """Run the deferred stores (their blocks' K/V is in the pool now)."""
        while self._pending:
            self._flush_one(next(iter(self._pending)))

    def admitted(self) -> None:
        """Forget staged reads that no load used (a request that did not fit looks its chunks up again)."""
        for key in list(self._staged):
            self._unstage(key)

    def close(self) -> None:
        """Free every slot (delete this run's files) and release the tier directory."""
        self._pending.clear()
        self._staged.clear()
        for s in self.stores:
            s.close()
        if self.dir is not None:
            self.dir.close()

    def summary(self) -> list[dict]:
        """Per tier (level 1 first): its store kind, read and write errors and seconds (the bytes and blocks
        moved are the tier counters', kvlab.tiers.results)."""
        return [{"store": s.kind, "read_errors": c.read_errors, "write_errors": c.write_errors, "read_s": c.read_s,
                 "write_s": c.write_s} for s, c in zip(self.stores, self.counters, strict=True)]

    # ------------------------------------------------------------------ mechanics
    def _unstage(self, key: tuple[int, int]) -> None:
        data = self._staged.pop(key, None)
        if data is not None:
            self.stores[key[0] - 1].release(data)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(ids), dtype=torch.long, device=self.pool.device)

    def _flush_one(self, key: tuple[int, int]) -> None:
        self._write_from_pool(key[0], key[1], self._pending.pop(key)())  # failed: check() finds no data there

    def _write_from_pool(self, level: int, slot: int, ids: Sequence[int] | None) -> bool:
        """Copy pool blocks ``ids`` into ``slot`` (None: the keys left the device before the copy, a failure)."""
        if ids is None:
            self.counters[level - 1].write_errors += 1
            return False
        return self._write(level, slot, lambda: self.pool.data[self._ids(ids)])

    def _source(self, level: int, slot: int) -> torch.Tensor | None:
        """Tier ``level``'s chunk in ``slot`` (staged, or read now), None (counted) if unreadable."""
        data = self._staged.get((level, slot))
        if data is not None:
            return data
        if not self.stores[level - 1].contains(slot):
            return None
        t0 = time.perf_counter()
        try:
            return self.stores[level - 1].load(slot)
        except TierReadError:
            self.counters[level - 1].read_errors += 1
            return None
        finally:
            self.counters[level - 1].read_s += time.perf_counter() - t0

    def _write(self, level: int, slot: int, data: object) -> bool:
        """Write ``data()`` (a chunk) into ``slot``; False (counted) on OSError."""
        store, c = self.stores[level - 1], self.counters[level - 1]
        t0 = time.perf_counter()
        try:
            store.store(slot, data())
        except OSError:
            c.write_errors += 1
            store.remove(slot)
            return False
        finally:
            c.write_s += time.perf_counter() - t0
        c.stores += 1
        c.bytes_written += store.shape[0] * self.pool.layout.bytes_per_block
        return True
