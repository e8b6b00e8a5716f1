"""Real lower tiers for the engine: the bytes behind the slots of :class:`kvlab.tiers.TierStack`'s tiers.

A lower tier's slot holds one chunk of ``chunk_blocks`` pool blocks; its bytes live in a store, in the pool's
block layout (``[chunk_blocks, layers, 2, kv_heads, block_size, head_dim]``, block-major, the pool dtype):

* :class:`DramStore`: CPU tensors, allocated in pages of slots as they are first written (pinned memory when
  the engine's device is CUDA, so host-to-device copies can run at PCIe speed). A write or read is a copy.
* :class:`DiskStore`: one file per slot, ``<tier>-<slot>.kvb`` under a cache directory. A write goes to a
  temporary name, is fsynced, then atomically renamed (``os.replace``): a reader never sees a partial file.
  The file holds a header (magic, version, blocks, bytes per block, a generation number) and one xxh3-64
  checksum per block, padded to 4096 bytes, then the blocks. A read checks the file size, the header against
  what this store wrote last into that slot, and every block's checksum: anything else (corrupt, truncated,
  missing, stale) is a :class:`TierReadError`. ``quota_bytes`` caps the bytes of its files: a write past it
  fails with ``OSError(ENOSPC)``, as a full disk does.

:class:`TierIO` is the stack's :class:`~kvlab.tiers.stack.TierMover`: it copies pool blocks into a slot when
the stack stores, the slot into the device blocks the admission placed when it loads, and frees a slot when
it is dropped. A disk slot is read and verified when a lookup finds it (``check``; the bytes are staged in
host memory for the load that follows): an unreadable slot is a miss there, its blocks are recomputed, never
served, and the read error is counted. A failed write (``OSError``: ENOSPC, EIO) is counted and the slot is
not stored. Counters per tier: :class:`TierIOCounters`.

Units: sizes in bytes, times in seconds, slots and blocks by id.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvlab.engine.kv_pool import KVLayout, KVPool
from kvlab.errors import ConfigError

MAGIC = b"KVLBTIER"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQ")  # magic, version, blocks, bytes per block, generation
ALIGN = 4096  # the header is padded to this, so the blocks start aligned (O_DIRECT reads)
MARKER = ".kvlab-tier-dir"  # a directory kvlab uses for disk tiers holds this file
_OWN = re.compile(r"^\.?[A-Za-z][A-Za-z0-9_]*-\d{8}\.kvb(\.tmp)?$")  # names of the files a DiskStore writes


class TierReadError(OSError):
    """A disk slot's file is missing, truncated, corrupt or stale."""


def header_bytes(blocks: int) -> int:
    """Bytes of a slot file's header (fixed part and one 8-byte checksum per block, padded to 4096)."""
    return -(-(_HEAD.size + 8 * blocks) // ALIGN) * ALIGN


def checksums(data: memoryview, block_bytes: int) -> list[int]:
    """xxh3-64 of each ``block_bytes`` block of ``data``."""
    return [xxhash.xxh3_64_intdigest(data[i:i + block_bytes]) for i in range(0, len(data), block_bytes)]


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype)."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class DramStore:
    """``slots`` chunks of ``chunk`` blocks in host memory (module docstring). ``pin``: page-locked memory."""

    kind = "dram"

    def __init__(self, layout: KVLayout, chunk: int, slots: int, *, pin: bool = False, page_slots: int = 64) -> None:
        self.shape = (chunk, *layout.pool_shape(1)[1:])
        self.dtype, self.pin = layout.dtype, pin
        self.page_slots = max(1, min(page_slots, slots))
        self.pages: dict[int, torch.Tensor] = {}
        self.held: set[int] = set()

    def _view(self, slot: int) -> torch.Tensor:
        p, i = divmod(slot, self.page_slots)
        page = self.pages.get(p)
        if page is None:
            page = self.pages[p] = torch.empty((self.page_slots, *self.shape), dtype=self.dtype, pin_memory=self.pin)
        return page[i]

    def write(self, slot: int, data: torch.Tensor) -> None:
        self._view(slot).copy_(data)  # (blocking: the host copy is read right after, e.g. by a disk write)
        self.held.add(slot)

    def read(self, slot: int) -> torch.Tensor:
        """The slot's chunk (a view: copy it before the slot is written again)."""
        if slot not in self.held:
            raise TierReadError(errno.ENOENT, f"DRAM slot {slot} holds nothing")
        return self._view(slot)

    def has(self, slot: int) -> bool:
        return slot in self.held

    def recycle(self, chunk: torch.Tensor) -> None:
        """(Reads are views of the store: nothing to give back.)"""

    def free(self, slot: int) -> None:
        self.held.discard(slot)

    @property
    def nbytes(self) -> int:
        """Host bytes allocated (pages)."""
        return sum(p.numel() * p.element_size() for p in self.pages.values())

    def close(self) -> None:
        self.pages.clear()
        self.held.clear()


_LIVE: set[Path] = set()  # tier directories in use in this process


class TierDir:
    """A cache directory for disk tiers: created with a marker file, or an existing one that is empty or holds
    kvlab's marker; ConfigError otherwise (kvlab never writes into a directory of someone else's files), or
    if another open TierDir of this process uses it. Files left by an earlier kvlab run (names a DiskStore
    writes) are removed; nothing else is touched."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.closed = False
        if self.path.resolve() in _LIVE:
            raise ConfigError(f"tier_dir {str(self.path)!r} is in use by another engine of this process (close its "
                              "tiers first: engine.tier_io.close())")
        self.created = not self.path.exists()
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"tier_dir {str(self.path)!r} is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        names = os.listdir(self.path)
        if names and MARKER not in names:
            raise ConfigError(f"tier_dir {str(self.path)!r} is not empty and has no {MARKER} file: kvlab writes "
                              "only into a new or empty directory, or one it created")
        self.token = (f"kvlab disk tier directory ({os.getpid()}-{id(self):x}-{time.time_ns()}): kvlab deletes "
                      "only its own *.kvb files\n")
        tmp = self.path / (MARKER + ".tmp")
        tmp.write_text(self.token)
        tmp.replace(self.path / MARKER)  # (the marker is kvlab's: its last user's token)
        _LIVE.add(self.path.resolve())
        for name in names:
            if _OWN.match(name):
                (self.path / name).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the marker kvlab wrote and the directory it created, if nothing else is left in it (once)."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self.path.resolve())
        marker = self.path / MARKER
        left = [n for n in os.listdir(self.path) if n != MARKER] if self.path.exists() else ["?"]
        if left or not marker.exists() or marker.read_text() != self.token:  # in use again since: leave it
            return
        marker.unlink()
        if self.created:
            with contextlib.suppress(OSError):
                self.path.rmdir()


class DiskStore:
    """A tier's slots as files under ``directory`` (module docstring: format, checks, quota). ``fsync``: flush
    each file to the device before its rename (the directory is not fsynced: the tier's index is in memory)."""

    kind = "disk"

    def __init__(self, directory: Path, name: str, layout: KVLayout, chunk: int, *, fsync: bool = True,
                 quota_bytes: int | None = None, pin: bool = False, spare_bytes: int = 256 << 20) -> None:
        if quota_bytes is not None and quota_bytes < 0:
            raise ConfigError(f"tier {name!r}: quota_bytes must be >= 0, got {quota_bytes}")
        self.dir, self.name, self.layout, self.chunk = Path(directory), name, layout, chunk
        self.shape = (chunk, *layout.pool_shape(1)[1:])
        self.block_bytes = layout.bytes_per_block
        self.head = header_bytes(chunk)
        self.file_bytes = self.head + chunk * self.block_bytes
        self.fsync, self.quota = fsync, quota_bytes
        self.sums: dict[int, tuple[int, list[int]]] = {}  # slot -> (generation, block checksums) of its file
        self.used = 0  # bytes of this store's files
        self._gen = 0
        self.pin = pin  # read buffers in page-locked memory (a CUDA engine)
        self._spare: list[torch.Tensor] = []  # read buffers to reuse (fresh memory costs a page fault per page)
        self._spare_max = max(1, spare_bytes // self.file_bytes)
        self._lent: dict[int, torch.Tensor] = {}  # data pointer of a chunk read -> its buffer

    def path(self, slot: int) -> Path:
        return self.dir / f"{self.name}-{slot:08d}.kvb"

    def write(self, slot: int, data: torch.Tensor) -> None:
        """Write ``data`` (one chunk) into ``slot``'s file atomically; OSError (ENOSPC past the quota)."""
        raw = _raw(data.to("cpu"))
        sums = checksums(raw, self.block_bytes)
        grow = 0 if slot in self.sums else self.file_bytes
        if self.quota is not None and self.used + grow > self.quota:
            raise OSError(errno.ENOSPC, f"tier {self.name!r}: quota of {self.quota} bytes reached")
        self._gen += 1
        head = _HEAD.pack(MAGIC, VERSION, self.chunk, self.block_bytes, self._gen) + struct.pack(
            f"<{self.chunk}Q", *sums)
        final = self.path(slot)
        tmp = final.with_name("." + final.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head.ljust(self.head, b"\0"))
                f.write(raw)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.used += grow
        self.sums[slot] = (self._gen, sums)

    def read(self, slot: int) -> torch.Tensor:
        """``slot``'s chunk, read and verified, in a read buffer of this store (give it back with
        :meth:`recycle` once copied out); TierReadError if the file is not what was written into ``slot``."""
        want = self.sums.get(slot)
        where = f"tier {self.name!r}: slot {slot}"
        if want is None:
            raise TierReadError(errno.ENOENT, f"{where} holds nothing")
        buf = self._spare.pop() if self._spare else torch.empty(self.file_bytes, dtype=torch.uint8, pin_memory=self.pin)
        try:
            with open(self.path(slot), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                n = f.readinto(buf.numpy()) if size == self.file_bytes else size
            if n != self.file_bytes:
                raise TierReadError(errno.EIO, f"{where}: {n} bytes, expected {self.file_bytes} (truncated?)")
            raw = buf.numpy()
            if _HEAD.unpack_from(raw) != (MAGIC, VERSION, self.chunk, self.block_bytes, want[0]):
                raise TierReadError(errno.EIO, f"{where}: header does not match what was written")
            stored = list(struct.unpack_from(f"<{self.chunk}Q", raw, _HEAD.size))
            if stored != want[1] or checksums(memoryview(raw)[self.head:], self.block_bytes) != want[1]:
                raise TierReadError(errno.EIO, f"{where}: checksum mismatch (corrupt)")
        except OSError as err:
            self._give_back(buf)
            if isinstance(err, TierReadError):
                raise
            raise TierReadError(err.errno or errno.EIO, f"{where}: {err}") from None
        out = buf[self.head:].view(self.layout.dtype).view(self.shape)
        self._lent[out.data_ptr()] = buf
        return out

    def recycle(self, chunk: torch.Tensor) -> None:
        """A chunk :meth:`read` returned is no longer used: its buffer serves a later read."""
        buf = self._lent.pop(chunk.data_ptr(), None)
        if buf is not None:
            self._give_back(buf)

    def _give_back(self, buf: torch.Tensor) -> None:
        if len(self._spare) < self._spare_max:
            self._spare.append(buf)

    def has(self, slot: int) -> bool:
        return slot in self.sums

    def free(self, slot: int) -> None:
        if self.sums.pop(slot, None) is not None:
            self.used -= self.file_bytes
            self.path(slot).unlink(missing_ok=True)

    def close(self) -> None:
        for slot in list(self.sums):
            self.free(slot)
        self._spare.clear()
        self._lent.clear()


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


Store = DramStore | DiskStore


class TierIO:
    """The :class:`~kvlab.tiers.stack.TierMover` of one engine: ``stores[level - 1]`` holds tier ``level``'s
    slots; ``pool`` is the device pool. ``defer``: stores from blocks keyed now wait for :meth:`flush` (the
    scheduler keys blocks when it schedules them, before the forward writes their K/V)."""

    def __init__(self, pool: KVPool, stores: Sequence[Store], *, defer: bool = False,
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
        if store.kind == "dram" or not store.has(slot):  # (no data: a failed deferred write, counted there)
            return store.has(slot)
        key = (level, slot)
        if key in self._staged:
            return self._staged[key] is not None
        t0 = time.perf_counter()
        try:
            data = store.read(slot)
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
                self.stores[src_level - 1].recycle(data)

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
            self.pool.device, non_blocking=store.kind == "dram")  # (a disk read buffer is reused right after)
        store.recycle(data)
        c.loads += 1
        c.bytes_read += len(blocks) * self.pool.layout.bytes_per_block
        c.read_s += time.perf_counter() - t0

    def drop(self, level: int, slot: int) -> None:
        key = (level, slot)
        self._unstage(key)
        self._pending.pop(key, None)
        self.stores[level - 1].free(slot)

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
            self.stores[key[0] - 1].recycle(data)

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
        if not self.stores[level - 1].has(slot):
            return None
        t0 = time.perf_counter()
        try:
            return self.stores[level - 1].read(slot)
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
            store.write(slot, data())
        except OSError:
            c.write_errors += 1
            store.free(slot)
            return False
        finally:
            c.write_s += time.perf_counter() - t0
        c.stores += 1
        c.bytes_written += store.shape[0] * self.pool.layout.bytes_per_block
        return True
