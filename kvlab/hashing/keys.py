"""Chained block keys (docs/semantics.md, "Blocks and keys"): one :class:`BlockHasher` fixes scheme, root and extras.

Key formula (docs/hashing.md has the byte-level definition)::

    key_{-1} = H(0, ROOT_TAG || u64 root_seed || model field)        # the root
    key_i    = H(key_{i-1}, block payload || extras_i)                # chained (default)
    key_i    = H(key_{-1},  block payload || extras_i)                # chained=False (unsafe)

The payload of a block is its values (token ids, or a block-id trace's ids) as little-endian int64;
``extras_i`` = adapter field (every block), multimodal fields (blocks overlapping a placeholder),
salt field (block 0 only). Keys are non-negative Python ints of ``key_bits`` bits, identical across
processes and machines for every scheme but ``builtin``.

Internally the sha256 and xxh3_128 schemes chain on the key's big-endian bytes (their digest), the
64-bit schemes on the int; both forms are one-to-one with the public int key. Whole workloads are
encoded to dense key ids in :mod:`kvlab.hashing.encode`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvlab.errors import ConfigError

SCHEMES = ("sha256", "xxh3_128", "xxh3_64", "builtin")
STABLE_SCHEMES = ("sha256", "xxh3_128", "xxh3_64")  # identical keys in every process and machine
KEY_BYTES = {"sha256": 32, "xxh3_128": 16, "xxh3_64": 8, "builtin": 8}
ENCODING_VERSION = 1
ROOT_TAG = b"kvlab/block-key/v1\x00"  # 19 bytes, starts every root message
TAG_ADAPTER, TAG_MM, TAG_SALT = 0x01, 0x02, 0x03
VALUE_BYTES = 8  # every token id / block id is hashed as one little-endian int64

_M64 = (1 << 64) - 1
_xxh3_64 = xxhash.xxh3_64_intdigest
_xxh3_128 = xxhash.xxh3_128_digest
_sha256 = hashlib.sha256

KeyRepr = int | bytes  # internal key form: int (64-bit schemes), big-endian digest bytes (wide schemes)
MMItem = tuple[str, int, int]  # (mm_hash, start token, length in tokens)


def _field(tag: int, value: str) -> bytes:
    """One extra-key field: tag byte, u32 LE length, UTF-8 bytes."""
    data = value.encode("utf-8")
    return bytes((tag,)) + len(data).to_bytes(4, "little") + data


def _absent(value: object) -> bool:
    """None, NaN and pandas' NA mean "no adapter / no salt"."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")


def le_int64(values: np.ndarray | Sequence[int]) -> np.ndarray:
    """A contiguous little-endian int64 copy or view of ``values`` (no copy on little-endian int64 input)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigError(f"expected a 1-D array of ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(f"token/block ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ConfigError("ids must fit in int64")
    return np.ascontiguousarray(arr, dtype="<i8")


def byte_view(values: np.ndarray) -> memoryview:
    """Read-only byte view of a contiguous little-endian int64 array (from :func:`le_int64`; no copy)."""
    return memoryview(values.view(np.uint8)).toreadonly()


class BlockHasher:
    """Computes chained block keys; one instance fixes scheme, root and which extra keys count.

    Invariants: keys are ints in ``[0, 2**key_bits)``; with ``chained=True`` (default) a block's key
    depends on every earlier block of the request; a partial last block is never keyed.
    ``truncate_bits=N`` keeps the low N bits of every key and chains on the truncated key.
    """

    def __init__(
        self,
        scheme: str = "xxh3_128",
        *,
        root_seed: int = 0,
        model_id: str = "kvlab",
        chained: bool = True,
        truncate_bits: int | None = None,
        include_model: bool = True,
        include_adapter: bool = True,
        include_salt: bool = True,
    ) -> None:
        if scheme not in SCHEMES:
            raise ConfigError(f"hash scheme must be one of {SCHEMES}, got {scheme!r}")
        if not isinstance(root_seed, int) or isinstance(root_seed, bool) or not 0 <= root_seed < 1 << 64:
            raise ConfigError(f"root_seed must be an int in [0, 2**64), got {root_seed!r}")
        if not isinstance(model_id, str):
            raise ConfigError(f"model_id must be a str, got {type(model_id).__name__}")
        width = KEY_BYTES[scheme] * 8
        bad_bits = not isinstance(truncate_bits, int) or isinstance(truncate_bits, bool)
        if truncate_bits is not None and (bad_bits or not 1 <= truncate_bits < width):
            raise ConfigError(
                f"truncate_bits must be an int in 1..{width - 1} for {scheme} "
                f"(None keeps all {width} bits), got {truncate_bits!r}"
            )
        self.scheme = scheme
        self.root_seed = root_seed
        self.model_id = model_id
        self.chained = bool(chained)
        self.truncate_bits = truncate_bits
        self.include_model = bool(include_model)
        self.include_adapter = bool(include_adapter)
        self.include_salt = bool(include_salt)
        self._nbytes = KEY_BYTES[scheme]
        self._wide = scheme in ("sha256", "xxh3_128")
        self._mask = None if truncate_bits is None else (1 << truncate_bits) - 1
        self._step = self._make_step()
        self._root: KeyRepr = self._step(self._zero(), self.root_message())
        self._fast = self._make_fast()

    # ------------------------------------------------------------------ description
    @property
    def key_bits(self) -> int:
        """Bits per key: ``truncate_bits`` or the scheme's width (256 / 128 / 64 / 64)."""
        return self.truncate_bits if self.truncate_bits is not None else self._nbytes * 8

    @property
    def unsafe(self) -> bool:
        """True for the research variants that loosen identity (unchained, truncated, dropped extras)."""
        return (
            not self.chained
            or self.truncate_bits is not None
            or not (self.include_model and self.include_adapter and self.include_salt)
        )

    @property
    def label(self) -> str:
        """Scheme plus every deviation, e.g. ``"xxh3_128"`` or ``"xxh3_64/unchained/trunc16/unsafe"``."""
        parts = [self.scheme]
        if not self.chained:
            parts.append("unchained")
        if self.truncate_bits is not None:
            parts.append(f"trunc{self.truncate_bits}")
        for name, included in (
            ("model", self.include_model),
            ("adapter", self.include_adapter),
            ("salt", self.include_salt),
        ):
            if not included:
                parts.append(f"no-{name}")
        if self.unsafe:
            parts.append("unsafe")
        return "/".join(parts)

    @property
    def stable(self) -> bool:
        """Whether keys are identical across processes and machines (all schemes but ``builtin``)."""
        return self.scheme in STABLE_SCHEMES

    @property
    def root(self) -> int:
        """``key_{-1}``: the root key every request's chain starts from."""
        return self._to_int(self._root)

    def config(self) -> dict:
        """Constructor arguments plus label, key bits and encoding version (for manifests)."""
        return {
            "scheme": self.scheme,
            "root_seed": self.root_seed,
            "model_id": self.model_id,
            "chained": self.chained,
            "truncate_bits": self.truncate_bits,
            "include_model": self.include_model,
            "include_adapter": self.include_adapter,
            "include_salt": self.include_salt,
            "label": self.label,
            "unsafe": self.unsafe,
            "key_bits": self.key_bits,
            "encoding_version": ENCODING_VERSION,
        }

    def __repr__(self) -> str:
        return f"BlockHasher({self.label!r}, root_seed={self.root_seed}, model_id={self.model_id!r})"

    def root_message(self) -> bytes:
        """Bytes hashed (with parent 0) into the root: tag, u64 LE root seed, model field or ``0x00``."""
        seed = self.root_seed.to_bytes(8, "little")
        if not self.include_model:
            return ROOT_TAG + seed + b"\x00"
        model = self.model_id.encode("utf-8")
        return ROOT_TAG + seed + b"\x01" + len(model).to_bytes(4, "little") + model

    def extra_fields(self, *, adapter: object = None, salt: object = None) -> tuple[bytes, bytes]:
        """``(every, first)``: the adapter field appended to every block, the salt field to block 0."""
        every = b"" if (not self.include_adapter or _absent(adapter)) else _field(TAG_ADAPTER, str(adapter))
        first = b"" if (not self.include_salt or _absent(salt)) else _field(TAG_SALT, str(salt))
        return every, first

    # ------------------------------------------------------------------ public per-request API
    def token_keys(
        self,
        tokens: np.ndarray | Sequence[int],
        block_size: int,
        *,
        adapter: object = None,
        salt: object = None,
        mm: Iterable[MMItem] | None = None,
    ) -> list[int]:
        """Keys of the full blocks of one token prompt (``len(tokens) // block_size`` of them).

        ``mm``: multimodal placeholders ``(mm_hash, start, length)`` in token positions; a block that
        overlaps ``[start, start + length)`` gets the field ``(mm_hash, block_start - start)``.
        """
        block_size = check_block_size(block_size)
        values = le_int64(tokens)
        n_full = len(values) // block_size
        every, first = self.extra_fields(adapter=adapter, salt=salt)
        mm_fields = _mm_fields(mm, block_size, n_full) if mm is not None else None
        reprs = self._chain(byte_view(values), 0, block_size * VALUE_BYTES, n_full, every, first, mm_fields)
        return [self._to_int(k) for k in reprs]

    def id_keys(
        self,
        ids: np.ndarray | Sequence[int],
        n_full: int,
        *,
        group: int = 1,
        adapter: object = None,
        salt: object = None,
    ) -> list[int]:
        """Keys of the first ``n_full`` full blocks of a block-id trace prompt.

        Block j hashes ``ids[j*group : (j+1)*group]`` (``group > 1`` re-blocks to ``group`` times the
        trace's block size); ``n_full`` counts blocks of the new size.
        """
        group = check_block_size(group, "group")
        values = le_int64(ids)
        if not isinstance(n_full, int | np.integer) or n_full < 0 or n_full * group > len(values):
            raise ConfigError(
                f"n_full must be an int in 0..{len(values) // group} for {len(values)} ids and "
                f"group {group}, got {n_full!r}"
            )
        every, first = self.extra_fields(adapter=adapter, salt=salt)
        reprs = self._chain(byte_view(values), 0, group * VALUE_BYTES, int(n_full), every, first, None)
        return [self._to_int(k) for k in reprs]

    # ------------------------------------------------------------------ internals (also used by hashing.encode)
    def _zero(self) -> KeyRepr:
        return bytes(self._nbytes) if self._wide else 0

    def _to_int(self, key: KeyRepr) -> int:
        return int.from_bytes(key, "big") if isinstance(key, bytes) else key

    def _make_step(self) -> Callable[[KeyRepr, bytes | memoryview], KeyRepr]:
        """``step(parent, message) -> key`` in internal form, truncation included."""
        mask, nbytes = self._mask, self._nbytes
        if self.scheme == "xxh3_64":
            if mask is None:
                return lambda p, m: _xxh3_64(m, p)
            return lambda p, m: _xxh3_64(m, p) & mask
        if self.scheme == "builtin":
            full = _M64 if mask is None else mask
            return lambda p, m: hash((p, bytes(m))) & full
        digest: Callable[[bytes], bytes]
        digest = _xxh3_128 if self.scheme == "xxh3_128" else (lambda b: _sha256(b).digest())
        if mask is None:
            return lambda p, m: digest(p + m)
        return lambda p, m: (int.from_bytes(digest(p + m), "big") & mask).to_bytes(nbytes, "big")

    def _make_fast(self) -> Callable[[memoryview, int, int, int, list], None]:
        """A loop ``fast(buf, start, stop, stride, out)`` for blocks without extras (the hot path)."""
        root, step, chained, mask = self._root, self._step, self.chained, self._mask
        scheme = self.scheme

        if scheme == "xxh3_64" and chained:
            if mask is None:

                def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                    p, h, app = root, _xxh3_64, out.append
                    for x in range(s, e, st):
                        p = h(buf[x : x + st], p)
                        app(p)
            else:

                def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                    p, h, app = root, _xxh3_64, out.append
                    for x in range(s, e, st):
                        p = h(buf[x : x + st], p) & mask
                        app(p)
        elif scheme == "xxh3_128" and chained and mask is None:

            def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                p, h, app = root, _xxh3_128, out.append
                for x in range(s, e, st):
                    p = h(p + buf[x : x + st])
                    app(p)
        elif scheme == "sha256" and chained and mask is None:

            def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                p, h, app = root, _sha256, out.append
                for x in range(s, e, st):
                    p = h(p + buf[x : x + st]).digest()
                    app(p)
        elif scheme == "builtin" and chained:
            full = _M64 if mask is None else mask

            def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                p, app = root, out.append
                for x in range(s, e, st):
                    p = hash((p, bytes(buf[x : x + st]))) & full
                    app(p)

        elif chained:

            def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                p, app = root, out.append
                for x in range(s, e, st):
                    p = step(p, buf[x : x + st])
                    app(p)
        else:

            def fast(buf: memoryview, s: int, e: int, st: int, out: list) -> None:
                out.extend([step(root, buf[x : x + st]) for x in range(s, e, st)])

        return fast

    def _chain(
        self,
        buf: memoryview,
        start: int,
        stride: int,
        n_full: int,
        every: bytes = b"",
        first: bytes = b"",
        mm_fields: dict[int, bytes] | None = None,
        out: list | None = None,
    ) -> list:
        """Append internal keys of ``n_full`` blocks (``stride`` bytes each, from ``start``) to ``out``."""
        if out is None:
            out = []
        if n_full <= 0:
            return out
        if not every and not first and not mm_fields:
            self._fast(buf, start, start + n_full * stride, stride, out)
            return out
        step, root, chained = self._step, self._root, self.chained
        p = root
        app = out.append
        for j in range(n_full):
            x = start + j * stride
            extra = every
            if mm_fields and j in mm_fields:
                extra += mm_fields[j]
            if j == 0:
                extra += first
            k = step(p, bytes(buf[x : x + stride]) + extra) if extra else step(p, buf[x : x + stride])
            app(k)
            if chained:
                p = k
        return out


def check_block_size(value: object, name: str = "block_size") -> int:
    """``value`` as a positive int (numpy ints accepted, bools refused), else a ConfigError naming ``name``."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or int(value) < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _mm_fields(mm: Iterable[MMItem], block_size: int, n_full: int) -> dict[int, bytes]:
    """Per full block, the concatenated ``(mm_hash, offset)`` fields of the placeholders it overlaps."""
    items = []
    for item in mm:
        try:
            mm_hash, start, length = item
        except (TypeError, ValueError):
            raise ConfigError(f"mm entries must be (mm_hash, start, length), got {item!r}") from None
        if not isinstance(mm_hash, str) or int(start) < 0 or int(length) < 1:
            raise ConfigError(f"mm entry needs a str hash, start >= 0 and length >= 1, got {item!r}")
        items.append((int(start), int(length), mm_hash))
    items.sort(key=lambda t: t[0])  # stable: equal starts keep the caller's order
    fields: dict[int, bytes] = {}
    for start, length, mm_hash in items:
        for j in range(start // block_size, min((start + length - 1) // block_size, n_full - 1) + 1):
            offset = j * block_size - start
            field = _field(TAG_MM, mm_hash) + offset.to_bytes(8, "little", signed=True)
            fields[j] = fields.get(j, b"") + field
    return fields



def truth_hasher(hasher: BlockHasher) -> BlockHasher:
    """The collision-free reference of ``hasher``: chained sha256, all extras, same root seed and model."""
    return BlockHasher("sha256", root_seed=hasher.root_seed, model_id=hasher.model_id)
