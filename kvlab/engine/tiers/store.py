"""Real lower tiers for the engine: the stores holding the bytes of :class:`kvlab.tiers.TierStack`'s slots.

Every store implements one interface, :class:`TierStore` (``contains``, ``load``, ``store``, ``remove``,
``close``; shaped after LMCache's ``StorageBackendInterface``). A key is a slot id (the tier's block id); a
value is one chunk of ``chunk_blocks`` pool blocks in the pool's block layout
(``[chunk_blocks, layers, 2, kv_heads, block_size, head_dim]``, block-major, the pool dtype). Media are chosen
by name: :data:`STORES` maps each name to its class, :func:`make_store` builds one from a :class:`StoreSpec`.

* ``"dram"`` (:class:`DramStore`): CPU tensors, allocated in pages of slots as they are first written (pinned
  memory when the engine's device is CUDA, so host-to-device copies can run at PCIe speed). A store or load is
  a copy; nothing can go wrong between them, so loads are not checked at lookup.
* ``"disk"`` (:class:`DiskStore`): one file per slot, ``<tier>-<slot>.kvb`` under a cache directory. A store
  goes to a temporary name, is fsynced, then atomically renamed (``os.replace``): a reader never sees a
  partial file. The file holds a header (magic, version, blocks, bytes per block, a generation number) and one
  xxh3-64 checksum per block, padded to 4096 bytes, then the blocks. A load checks the file size, the header
  against what this store wrote last into that slot, and every block's checksum: anything else (corrupt,
  truncated, missing, stale) is a :class:`TierReadError`. ``quota_bytes`` caps the bytes of its files: a store
  past it fails with ``OSError(ENOSPC)``, as a full disk does.

The data mover that calls the stores (lookup checks, loads into the pool, counters) is
:class:`kvlab.engine.tiers.mover.TierIO`. Adding a medium: a class implementing :class:`TierStore` (with
``kind``, ``needs_dir`` and ``from_spec``) and one :data:`STORES` entry; tests/test_engine_store_contract.py
runs the shared contract on every entry.

Units: sizes in bytes, slots and blocks by id, capacities in blocks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import torch
import xxhash

from kvlab.engine.kv_pool import KVLayout
from kvlab.errors import ConfigError

MAGIC = b"KVLBTIER"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQ")  # magic, version, blocks, bytes per block, generation
ALIGN = 4096  # the header is padded to this, so the blocks start aligned (O_DIRECT reads)
MARKER = ".kvlab-tier-dir"  # a directory kvlab uses for disk tiers holds this file
_OWN = re.compile(r"^\.?[A-Za-z][A-Za-z0-9_]*-\d{8}\.kvb(\.tmp)?$")  # names of the files a DiskStore writes


class TierReadError(OSError):
    """A slot that cannot be loaded: not held (``errno.ENOENT``), or its file missing, truncated, corrupt or
    stale (``errno.EIO``)."""


@dataclass(frozen=True)
class StoreSpec:
    """What a medium's :meth:`TierStore.from_spec` is given: the tier's ``name`` (file names), the pool's
    ``layout``, ``chunk`` blocks per slot, the tier's ``slots``, ``pin`` (page-locked host memory: a CUDA
    engine), and the disk options: ``directory`` (a :class:`TierDir`'s path), ``fsync``, ``quota_bytes``."""

    name: str
    layout: KVLayout
    chunk: int
    slots: int
    pin: bool = False
    directory: Path | None = None
    fsync: bool = True
    quota_bytes: int | None = None


@dataclass(frozen=True)
class StoreStats:
    """What a store holds now: ``slots`` held and ``bytes`` of memory or files it has taken for them."""

    slots: int
    bytes: int


@runtime_checkable
class TierStore(Protocol):
    """One lower tier's slots in one medium (module docstring). Keys are slot ids (ints >= 0); values are
    chunks of shape :attr:`shape` in the layout's dtype.

    The contract (every store, tests/test_engine_store_contract.py): after ``store(k, x)`` returns,
    ``contains(k)`` is True and ``load(k)`` returns ``x``'s bytes exactly, until ``k`` is stored again or
    removed; a store that raises ``OSError`` (a full disk, a quota) leaves no new data for ``k`` (the caller
    removes ``k``). ``load`` of a key not held raises :class:`TierReadError` with ``errno.ENOENT``; it never
    returns other bytes than were stored. ``remove`` says whether ``k`` was held. ``close`` removes every key
    and releases the store's memory and files; closing twice is harmless."""

    #: the medium's name: its :data:`STORES` key, the ``store`` of its tier in results
    kind: ClassVar[str]
    #: needs ``StoreSpec.directory`` (a ``tier_dir``)
    needs_dir: ClassVar[bool]
    #: loads can fail after a store (a file altered underneath): the mover loads and verifies a slot when a
    #: lookup finds it, so a bad one is a miss, never served
    checked: ClassVar[bool]
    #: a loaded chunk stays valid after :meth:`release` (a view of the store's memory, until ``k`` is stored
    #: again): the copy into the device may run asynchronously
    stable_loads: ClassVar[bool]
    #: one slot's chunk: ``(chunk_blocks, layers, 2, kv_heads, block_size, head_dim)``
    shape: tuple[int, ...]

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> TierStore:
        """The store for one tier; ConfigError if ``spec`` does not fit this medium."""
        ...

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks this store can hold at most (None: bounded only by its tier's capacity)."""
        ...

    def contains(self, key: int) -> bool:
        """Whether ``key`` holds data (a disk store does not read its file: :meth:`load` verifies)."""
        ...

    def load(self, key: int) -> torch.Tensor:
        """``key``'s chunk; TierReadError if not held or unreadable. Give it back with :meth:`release` once
        copied out; it stays valid until then, while ``key`` is not stored again."""
        ...

    def release(self, chunk: torch.Tensor) -> None:
        """A chunk :meth:`load` returned is no longer used."""
        ...

    def store(self, key: int, data: torch.Tensor) -> None:
        """Put one chunk (shape :attr:`shape`) into ``key``, replacing what it held; OSError if it cannot."""
        ...

    def remove(self, key: int) -> bool:
        """Free ``key``'s data; whether it held any."""
        ...

    def stats(self) -> StoreStats:
        """Slots held and bytes taken now."""
        ...

    def close(self) -> None:
        """Remove every key; release memory and files (idempotent)."""
        ...


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

    kind: ClassVar[str] = "dram"
    needs_dir: ClassVar[bool] = False
    checked: ClassVar[bool] = False
    stable_loads: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, chunk: int, slots: int, *, pin: bool = False, page_slots: int = 64) -> None:
        self.shape = (chunk, *layout.pool_shape(1)[1:])
        self.dtype, self.pin, self.slots = layout.dtype, pin, slots
        self.page_slots = max(1, min(page_slots, slots))
        self.pages: dict[int, torch.Tensor] = {}
        self.held: set[int] = set()

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> DramStore:
        return cls(spec.layout, spec.chunk, spec.slots, pin=spec.pin)

    @property
    def capacity_blocks(self) -> int:
        """The tier's slots times blocks per slot (pages are allocated as slots are first written)."""
        return self.slots * self.shape[0]

    def _view(self, slot: int) -> torch.Tensor:
        p, i = divmod(slot, self.page_slots)
        page = self.pages.get(p)
        if page is None:
            page = self.pages[p] = torch.empty((self.page_slots, *self.shape), dtype=self.dtype, pin_memory=self.pin)
        return page[i]

    def store(self, key: int, data: torch.Tensor) -> None:
        self._view(key).copy_(data)  # (blocking: the host copy is read right after, e.g. by a disk write)
        self.held.add(key)

    def load(self, key: int) -> torch.Tensor:
        """The slot's chunk (a view: valid until ``key`` is stored again)."""
        if key not in self.held:
            raise TierReadError(errno.ENOENT, f"DRAM slot {key} holds nothing")
        return self._view(key)

    def contains(self, key: int) -> bool:
        return key in self.held

    def release(self, chunk: torch.Tensor) -> None:
        """(Loads are views of the store: nothing to give back.)"""

    def remove(self, key: int) -> bool:
        if key not in self.held:
            return False
        self.held.discard(key)
        return True

    def stats(self) -> StoreStats:
        """Slots held; host bytes allocated (whole pages)."""
        return StoreStats(len(self.held), sum(p.numel() * p.element_size() for p in self.pages.values()))

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

    kind: ClassVar[str] = "disk"
    needs_dir: ClassVar[bool] = True
    checked: ClassVar[bool] = True
    stable_loads: ClassVar[bool] = False  # (a load's read buffer serves a later load once released)

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

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> DiskStore:
        if spec.directory is None:
            raise ConfigError(f"tier {spec.name!r}: store 'disk' needs tier_dir (the directory of its files)")
        return cls(spec.directory, spec.name, spec.layout, spec.chunk, fsync=spec.fsync,
                   quota_bytes=spec.quota_bytes, pin=spec.pin)

    @property
    def capacity_blocks(self) -> int | None:
        """The blocks of the files ``quota_bytes`` allows (None without a quota)."""
        return None if self.quota is None else self.quota // self.file_bytes * self.chunk

    def path(self, slot: int) -> Path:
        return self.dir / f"{self.name}-{slot:08d}.kvb"

    def store(self, key: int, data: torch.Tensor) -> None:
        """Write ``data`` (one chunk) into ``key``'s file atomically; OSError (ENOSPC past the quota)."""
        raw = _raw(data.to("cpu"))
        sums = checksums(raw, self.block_bytes)
        grow = 0 if key in self.sums else self.file_bytes
        if self.quota is not None and self.used + grow > self.quota:
            raise OSError(errno.ENOSPC, f"tier {self.name!r}: quota of {self.quota} bytes reached")
        self._gen += 1
        head = _HEAD.pack(MAGIC, VERSION, self.chunk, self.block_bytes, self._gen) + struct.pack(
            f"<{self.chunk}Q", *sums)
        final = self.path(key)
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
        self.sums[key] = (self._gen, sums)

    def load(self, key: int) -> torch.Tensor:
        """``key``'s chunk, read and verified, in a read buffer of this store (give it back with
        :meth:`release` once copied out); TierReadError if the file is not what was written into ``key``."""
        want = self.sums.get(key)
        where = f"tier {self.name!r}: slot {key}"
        if want is None:
            raise TierReadError(errno.ENOENT, f"{where} holds nothing")
        buf = self._spare.pop() if self._spare else torch.empty(self.file_bytes, dtype=torch.uint8, pin_memory=self.pin)
        try:
            with open(self.path(key), "rb", buffering=0) as f:
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

    def release(self, chunk: torch.Tensor) -> None:
        """A chunk :meth:`load` returned is no longer used: its buffer serves a later read."""
        buf = self._lent.pop(chunk.data_ptr(), None)
        if buf is not None:
            self._give_back(buf)

    def _give_back(self, buf: torch.Tensor) -> None:
        if len(self._spare) < self._spare_max:
            self._spare.append(buf)

    def contains(self, key: int) -> bool:
        return key in self.sums

    def remove(self, key: int) -> bool:
        if self.sums.pop(key, None) is None:
            return False
        self.used -= self.file_bytes
        self.path(key).unlink(missing_ok=True)
        return True

    def stats(self) -> StoreStats:
        """Slots held; bytes of their files."""
        return StoreStats(len(self.sums), self.used)

    def close(self) -> None:
        for slot in list(self.sums):
            self.remove(slot)
        self._spare.clear()
        self._lent.clear()


#: every medium by name (its ``kind``): a tier's store is chosen by this name, never by its position
STORES: dict[str, type[TierStore]] = {"dram": DramStore, "disk": DiskStore}


def check_stores(names: list[str], tiers: list[str], *, has_dir: bool) -> None:
    """ConfigError, before any work, unless ``names`` gives one known medium per tier (``tiers``: their names)
    and a ``tier_dir`` (``has_dir``) exactly when a named medium needs one."""
    if len(names) != len(tiers):
        raise ConfigError(f"stores: {len(names)} names {names} for {len(tiers)} tiers {tiers}: give one per tier")
    for name, medium in zip(tiers, names, strict=True):
        if medium not in STORES:
            raise ConfigError(f"tier {name!r}: store {medium!r} is not one of {', '.join(sorted(STORES))}")
        if STORES[medium].needs_dir and not has_dir:
            raise ConfigError(f"tier {name!r}: store {medium!r} needs tier_dir (the directory of its files)")
    if has_dir and not any(STORES[m].needs_dir for m in names):
        raise ConfigError(f"tier_dir holds the files of a store like 'disk': stores {names} name none")


def make_store(medium: str, spec: StoreSpec) -> TierStore:
    """The :data:`STORES` medium ``medium`` for the tier ``spec`` describes; ConfigError for an unknown name."""
    cls = STORES.get(medium)
    if cls is None:
        raise ConfigError(f"tier {spec.name!r}: store {medium!r} is not one of {', '.join(sorted(STORES))}")
    return cls.from_spec(spec)
