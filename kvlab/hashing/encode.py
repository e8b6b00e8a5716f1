"""Whole-workload encoding: every request's full-block keys as dense ids, the input of the fast replay.

Keys come from :class:`~kvlab.hashing.keys.BlockHasher` (its internal chain, so no Python int per key is
built); a numba kernel maps them to dense ids ``0..num_keys-1`` in order of first appearance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

from kvlab.errors import ConfigError
from kvlab.hashing.keys import VALUE_BYTES, BlockHasher, byte_view, check_block_size, le_int64, truth_hasher

if TYPE_CHECKING:  # the workload package may import hashing (loaders, expansion): no runtime import
    from kvlab.workload.workload import Workload

BLOCK_RESIZE_CAVEAT = (
    "Re-blocking a hash trace to a smaller block size (by expanding ids to tokens) cannot reveal sharing "
    "inside an original block: use expansion to run the engine, not to study block size; coarser sizes "
    "are faithful."
)


@dataclass(eq=False)
class EncodedWorkload:
    """A workload's prompts as dense key ids, the input of the fast replay.

    ``key_ids[offsets[i]:offsets[i+1]]`` are request i's full blocks in order; ids are dense
    (``0..num_keys-1``) in order of first appearance, equal ids = equal keys. ``num_blocks`` counts full
    and partial blocks (``ceil(prompt_tokens / block_size)``). ``truth_ids`` (verify mode only) are dense
    ids of each block's exact identity (chained sha256, all extras, untruncated): key id equal but truth id
    different = a collision.
    """

    offsets: np.ndarray  # int64 [n + 1], CSR into key_ids
    key_ids: np.ndarray  # int64 [total full blocks], dense key id per full block
    num_keys: int  # distinct keys
    prompt_tokens: np.ndarray  # int64 [n], = workload.input_length
    num_blocks: np.ndarray  # int64 [n], full + partial blocks
    block_size: int  # tokens per block
    hash_label: str  # BlockHasher.label
    truth_ids: np.ndarray | None = None  # int64 [total full blocks], verify mode only
    num_truth: int | None = None  # distinct true identities, verify mode only
    # per-request context for compiled policies (what the Python core passes in AccessContext):
    arrival: np.ndarray | None = None  # float64 [n], seconds of trace time
    category_codes: np.ndarray | None = None  # int64 [n], index into ``categories``, -1 = none
    categories: tuple = ()  # category labels
    turn: np.ndarray | None = None  # int64 [n], 1-based, -1 = unknown

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def full_blocks(self) -> np.ndarray:
        """int64 [n]: full (keyed) blocks per request."""
        return np.diff(self.offsets)

    def keys(self, i: int) -> np.ndarray:
        """Dense key ids of request row ``i`` (a view)."""
        return self.key_ids[self.offsets[i] : self.offsets[i + 1]]

    def colliding_keys(self) -> int:
        """Key ids that stand for more than one true identity (needs ``verify=True``)."""
        if self.truth_ids is None:
            raise ConfigError("colliding_keys() needs an encoding made with verify=True")
        if len(self.key_ids) == 0:
            return 0
        pairs = np.unique(np.stack([self.key_ids, self.truth_ids], axis=1), axis=0)
        per_key = np.bincount(pairs[:, 0], minlength=self.num_keys)
        return int(np.count_nonzero(per_key > 1))



def encode_workload(
    workload: Workload,
    hasher: BlockHasher,
    block_size: int | None = None,
    *,
    verify: bool = False,
    progress: bool = False,
) -> EncodedWorkload:
    """Hash every request's full blocks and map the keys to dense ids (see :class:`EncodedWorkload`).

    ``block_size`` (tokens) defaults to the trace's for ``kind="blocks"`` and is required for token
    traces; a block trace can only be encoded at a multiple of its own block size. Adapter and salt
    come from the workload's ``adapter`` / ``salt`` columns (missing = absent).
    """
    kind = workload.kind
    if block_size is None:
        if kind != "blocks":
            raise ConfigError("block_size is required to encode a token trace (kind='tokens')")
        block_size = workload.block_size
    block_size = check_block_size(block_size)
    if kind == "blocks":
        trace_bs = int(workload.block_size)
        if block_size % trace_bs:
            raise ConfigError(
                f"block_size {block_size} is not a multiple of this block-id trace's block size {trace_bs}: "
                f"a hash trace can only be re-blocked to a coarser size. To run at a finer size, expand the "
                f"ids to tokens first (kvlab.workload.expand_to_tokens), but note "
                f"(docs/semantics.md, \"Hash traces\"): "
                f"{BLOCK_RESIZE_CAVEAT}"
            )
        stride = (block_size // trace_bs) * VALUE_BYTES
    else:
        stride = block_size * VALUE_BYTES

    prompt_tokens = np.asarray(workload.input_length, dtype=np.int64).copy()
    n = len(prompt_tokens)
    n_full = prompt_tokens // block_size
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_full, out=offsets[1:])
    num_blocks = -(-prompt_tokens // block_size)
    buf = byte_view(le_int64(workload.prompt_values))
    starts = (np.asarray(workload.prompt_offsets[:-1], dtype=np.int64) * VALUE_BYTES).tolist()
    adapters = _category_codes(getattr(workload, "adapter", None), n)
    salts = _category_codes(getattr(workload, "salt", None), n)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n * (2 if verify else 1), unit="req", desc="hashing", leave=False)
    try:
        rows = (buf, starts, stride, n_full.tolist(), adapters, salts, bar)
        key_ids, num_keys = _dense_encode(hasher, *rows)
        truth_ids = num_truth = None
        if verify:
            ref = truth_hasher(hasher)
            if ref.config() == hasher.config():
                truth_ids, num_truth = key_ids.copy(), num_keys
            else:
                truth_ids, num_truth = _dense_encode(ref, *rows)
    finally:
        if bar is not None:
            bar.close()
    return EncodedWorkload(
        offsets=offsets,
        key_ids=key_ids,
        num_keys=num_keys,
        prompt_tokens=prompt_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        hash_label=hasher.label,
        truth_ids=truth_ids,
        num_truth=num_truth,
        arrival=np.asarray(workload.arrival, dtype=np.float64),
        category_codes=(np.asarray(workload.category.codes, dtype=np.int64) if workload.category is not None
                        else np.full(n, -1, np.int64)),
        categories=tuple(str(c) for c in workload.category.categories) if workload.category is not None else (),
        turn=np.asarray(workload.turn, dtype=np.int64) if workload.turn is not None else np.full(n, -1, np.int64),
    )


def _category_codes(column: object, n: int) -> tuple[list[int], list[object]] | None:
    """``(codes, categories)`` of a categorical column (code -1 = absent); None if no column / all absent."""
    if column is None:
        return None
    codes = np.asarray(column.codes)
    if len(codes) != n or not np.any(codes >= 0):
        return None
    return codes.tolist(), list(column.categories)


_CHUNK = 1 << 18  # keys collected as Python objects before they are packed into a words array


def _dense_encode(
    hasher: BlockHasher,
    buf: memoryview,
    starts: list[int],
    stride: int,
    n_full: list[int],
    adapters: tuple[list[int], list[object]] | None,
    salts: tuple[list[int], list[object]] | None,
    bar: object | None,
) -> tuple[np.ndarray, int]:
    """Dense first-appearance ids of every request's full-block keys, concatenated in request order.

    Uses the hasher's internal chain (``_chain`` / ``_fast``, keys in internal form: ints or digests), so the
    ids equal those of :meth:`BlockHasher.token_keys` / :meth:`~BlockHasher.id_keys` mapped densely.
    """
    chain, fast = hasher._chain, hasher._fast
    every_by_cat = [hasher.extra_fields(adapter=a)[0] for a in adapters[1]] if adapters else []
    first_by_cat = [hasher.extra_fields(salt=s)[1] for s in salts[1]] if salts else []
    a_codes = adapters[0] if adapters and any(every_by_cat) else None
    s_codes = salts[0] if salts and any(first_by_cat) else None
    words = hasher._nbytes // 8 if hasher._wide else 1
    parts: list[np.ndarray] = []
    pending: list = []
    done = 0
    for r, (s, nf) in enumerate(zip(starts, n_full, strict=True)):
        if nf:
            every = every_by_cat[a_codes[r]] if a_codes is not None and a_codes[r] >= 0 else b""
            first = first_by_cat[s_codes[r]] if s_codes is not None and s_codes[r] >= 0 else b""
            if every or first:
                chain(buf, s, stride, nf, every, first, None, pending)
            else:
                fast(buf, s, s + nf * stride, stride, pending)
            if len(pending) >= _CHUNK:
                parts.append(_pack(pending, words))
                pending = []
        if bar is not None and (r + 1 - done >= 4096 or r + 1 == len(starts)):
            bar.update(r + 1 - done)
            done = r + 1
    parts.append(_pack(pending, words))
    ids, num = _dense_ids_kernel(np.concatenate(parts))  # always a fresh writable C array: one signature
    return ids, int(num)


def _pack(keys: list, words: int) -> np.ndarray:
    """Internal keys as a uint64 ``[len(keys), words]`` array (ints: one word; digests: their bytes)."""
    if words == 1:
        return np.fromiter(keys, dtype=np.uint64, count=len(keys)).reshape(-1, 1)
    return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, words)


@nb.njit(cache=True, nogil=True)
def _dense_ids_kernel(keys: np.ndarray) -> tuple[np.ndarray, int]:  # pragma: no cover - compiled
    """Dense id per row of ``keys`` (uint64 [n, w]): equal rows share an id, ids follow first appearance.

    Open addressing over a power-of-two table of at least 2n slots holding a representative row; exact
    (rows are compared word by word), O(n) expected, 8 bytes of table per slot.
    """
    n, w = keys.shape
    ids = np.empty(n, dtype=np.int64)
    cap = 2
    while cap < 2 * n:
        cap *= 2
    table = np.full(cap, -1, dtype=np.int64)
    mask = np.uint64(cap - 1)
    num = 0
    for i in range(n):
        h = keys[i, 0]
        for j in range(1, w):
            h = (h ^ keys[i, j]) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(33)  # splitmix64-style finaliser: truncated or structured keys spread too
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        slot = np.int64(h & mask)
        while True:
            r = table[slot]
            if r < 0:
                table[slot] = i
                ids[i] = num
                num += 1
                break
            same = True
            for j in range(w):
                if keys[r, j] != keys[i, j]:
                    same = False
                    break
            if same:
                ids[i] = ids[r]
                break
            slot = (slot + 1) & (cap - 1)
    return ids, num
