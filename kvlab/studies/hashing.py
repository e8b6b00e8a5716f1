"""Block size and hashing studies (notebook 06): hit rate vs block size, hashing speed, truncated-key collisions.

* :func:`block_size_sweep`: a token workload replayed at several block sizes, each at fixed capacities in
  tokens and unbounded; with the keys hashed and indexed per block size. A hash trace is expanded to
  tokens first (:func:`kvlab.workload.expand_to_tokens`); expansion cannot reveal sharing inside an original
  block (docs/hashing.md), so below the trace's block size only partial-block tails can add hits.
* :func:`hashing_throughput`: best-of-N seconds of :func:`~kvlab.hashing.encode_workload` per scheme and block
  size (hashing plus dense ids, one thread), as prompt tokens/s and keyed blocks/s.
* :func:`truncation_collisions`: chained keys truncated to ``k`` bits (``BlockHasher(truncate_bits=k)``) against
  the exact identities (chained sha256, :func:`~kvlab.hashing.truth_hasher`): colliding pairs of distinct
  prefixes, measured and as the birthday expectation :func:`birthday_pairs`.

On the studies floor (it drives the replay, which imports kvlab.hashing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.hashing.encode import EncodedWorkload, encode_workload
from kvlab.hashing.keys import KEY_BYTES, SCHEMES, BlockHasher, truth_hasher
from kvlab.replay import replay
from kvlab.workload.workload import Workload


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` wall-clock runs of ``fn()``, in seconds (``repeat >= 1``)."""
    if repeat < 1:
        raise ConfigError(f"repeat must be >= 1, got {repeat!r}")
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def partial_tail_tokens(prompt_tokens: np.ndarray, block_size: int) -> int:
    """Prompt tokens in partial last blocks (``Σ L mod block_size``): tokens no prefix cache can key or hit."""
    return int((np.asarray(prompt_tokens, dtype=np.int64) % int(block_size)).sum())


def block_size_sweep(
    workload: Workload,
    block_sizes: Sequence[int],
    capacities_tokens: Sequence[int | None] = (None,),
    *,
    policy: str = "lru",
    scheme: str = "xxh3_64",
    mode: str = "vllm",
) -> pd.DataFrame:
    """Token hit rate of ``workload`` (a token trace) per block size and capacity (tokens; None = unbounded).

    The capacity in blocks is ``capacity_tokens // block_size`` (pass multiples of every block size to keep
    the bytes equal); unbounded is the trace's total block count (nothing is ever evicted). One row per
    (block size, capacity): ``block_size`` (tokens), ``capacity`` (label: tokens or "unbounded"),
    ``capacity_tokens`` (NaN when unbounded), ``capacity_blocks``, ``token_hit_rate`` (fraction),
    ``hit_tokens``, ``prompt_tokens``, ``keyed_blocks`` (full blocks hashed, one key each),
    ``distinct_keys`` (index entries an unbounded cache holds), ``tail_tokens`` (:func:`partial_tail_tokens`).
    Deterministic (no timings: :func:`hashing_throughput` measures the hashing cost per block size).
    """
    if workload.kind != "tokens":
        raise ConfigError("block_size_sweep needs a token workload: expand a hash trace with expand_to_tokens first")
    prompt = int(workload.input_length.sum())
    rows = []
    for bs in block_sizes:
        enc = encode_workload(workload, BlockHasher(scheme), int(bs))
        total_blocks = int(enc.num_blocks.sum())
        for cap in capacities_tokens:
            blocks = total_blocks + 1 if cap is None else int(cap) // int(bs)
            res = replay(workload, encoded=enc, capacity_blocks=blocks, block_size=int(bs), policy=policy,
                         hash=scheme, mode=mode)
            rows.append({
                "block_size": int(bs), "capacity": "unbounded" if cap is None else f"{int(cap):,} tokens",
                "capacity_tokens": math.nan if cap is None else float(cap), "capacity_blocks": blocks,
                "token_hit_rate": float(res.summary["token_hit_rate"]),
                "hit_tokens": int(res.requests["hit_tokens"].sum()), "prompt_tokens": prompt,
                "keyed_blocks": len(enc.key_ids), "distinct_keys": enc.num_keys,
                "tail_tokens": partial_tail_tokens(enc.prompt_tokens, int(bs)),
            })
    return pd.DataFrame(rows)


def hashing_throughput(
    workload: Workload,
    schemes: Iterable[str] = SCHEMES,
    block_sizes: Iterable[int] = (16,),
    *,
    repeat: int = 3,
) -> pd.DataFrame:
    """Best-of-``repeat`` time of one ``encode_workload`` call (hashing + dense ids, one thread) per scheme and
    block size. Columns: ``scheme``, ``block_size`` (tokens), ``seconds``, ``tokens_per_s`` (all prompt tokens,
    partial blocks included, per second), ``blocks_per_s`` (keyed full blocks per second), ``keyed_blocks``.
    Each (scheme, block size) is encoded once untimed first (the dense-id kernel compiles on first use)."""
    tokens = int(workload.input_length.sum())
    rows = []
    for scheme in schemes:
        hasher = BlockHasher(scheme)
        for bs in block_sizes:
            enc = encode_workload(workload, hasher, int(bs))
            sec = best_of(lambda h=hasher, bs=bs: encode_workload(workload, h, int(bs)), repeat)
            rows.append({"scheme": scheme, "block_size": int(bs), "seconds": sec, "tokens_per_s": tokens / sec,
                         "blocks_per_s": len(enc.key_ids) / sec, "keyed_blocks": len(enc.key_ids)})
    return pd.DataFrame(rows)


def collision_counts(key_ids: np.ndarray, truth_ids: np.ndarray) -> dict[str, int]:
    """Collisions among distinct prefixes, from per-block key ids and exact identity ids (equal length).

    ``prefixes``: distinct identities; ``keys``: distinct keys among them; ``colliding_pairs``: unordered
    pairs of distinct identities sharing a key (Σ over keys of C(c, 2), c = identities per key, the quantity
    the birthday bound estimates); ``colliding_keys``: keys standing for more than one identity;
    ``merged_prefixes``: ``prefixes - keys`` (identities that lost a key of their own).
    """
    key_ids = np.asarray(key_ids, dtype=np.int64)
    truth_ids = np.asarray(truth_ids, dtype=np.int64)
    if key_ids.shape != truth_ids.shape:
        raise ConfigError(f"key_ids and truth_ids differ in shape: {key_ids.shape} vs {truth_ids.shape}")
    if len(key_ids) == 0:
        return {"prefixes": 0, "keys": 0, "colliding_pairs": 0, "colliding_keys": 0, "merged_prefixes": 0}
    if key_ids.min() < 0 or truth_ids.min() < 0:
        raise ConfigError("key_ids and truth_ids must be non-negative (dense ids)")
    width = int(truth_ids.max()) + 1
    if int(key_ids.max()) >= np.iinfo(np.int64).max // width:
        raise ConfigError("ids too large to pair in int64: pass dense ids (encode_workload's)")
    codes = np.sort(key_ids * width + truth_ids)  # (key, identity) codes, by key (np.unique is far slower)
    pairs = codes[np.r_[True, codes[1:] != codes[:-1]]]  # one code per distinct (key, identity)
    keys, truths = pairs // width, pairs % width
    sorted_truths = np.sort(truths)
    if np.any(sorted_truths[1:] == sorted_truths[:-1]):
        raise ConfigError("one identity maps to several keys: key_ids are not a function of truth_ids")
    per_key = np.diff(np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True]))  # identities per key
    return {"prefixes": len(pairs), "keys": len(per_key),
            "colliding_pairs": int((per_key * (per_key - 1) // 2).sum()),
            "colliding_keys": int(np.count_nonzero(per_key > 1)), "merged_prefixes": len(pairs) - len(per_key)}


def birthday_pairs(n: int, bits: int) -> float:
    """Expected colliding pairs among ``n`` distinct items under uniform ``bits``-bit keys: ``C(n, 2) / 2**bits``
    (≈ ``n² / 2^(bits+1)``)."""
    return n * (n - 1) / 2 / 2.0**bits


def truncation_collisions(
    workload: Workload,
    bits: Iterable[int],
    *,
    scheme: str = "xxh3_64",
    block_size: int | None = None,
    truth: EncodedWorkload | None = None,
) -> pd.DataFrame:
    """Collisions of ``scheme``'s chained keys truncated to each of ``bits`` (the chain continues from the
    truncated key, as ``BlockHasher(truncate_bits=k)`` does; ``k`` = the scheme's width means untruncated).

    One row per k: ``bits``, the :func:`collision_counts` fields, ``expected_pairs`` (:func:`birthday_pairs`
    of the distinct prefixes). The exact identities are encoded once (``truth``: pass an encoding by
    :func:`~kvlab.hashing.truth_hasher` of ``BlockHasher(scheme)`` at the same block size to reuse one).
    """
    width = KEY_BYTES[scheme] * 8
    if truth is None:
        truth = encode_workload(workload, truth_hasher(BlockHasher(scheme)), block_size)
    rows = []
    for k in bits:
        if not isinstance(k, int | np.integer) or not 1 <= k <= width:
            raise ConfigError(f"bits must be ints in 1..{width} for {scheme}, got {k!r}")
        hasher = BlockHasher(scheme, truncate_bits=None if k == width else int(k))
        enc = encode_workload(workload, hasher, truth.block_size)
        counts = collision_counts(enc.key_ids, truth.key_ids)
        rows.append({"bits": int(k), **counts, "expected_pairs": birthday_pairs(counts["prefixes"], int(k))})
    return pd.DataFrame(rows)


def vanishing_bits(frame: pd.DataFrame, column: str = "colliding_pairs") -> int | None:
    """The smallest ``bits`` from which ``column`` is 0 at every larger ``bits`` of ``frame`` (None: never)."""
    f = frame.sort_values("bits")
    nonzero = f.loc[f[column] > 0, "bits"]
    if nonzero.empty:
        return int(f["bits"].min())
    later = f.loc[f["bits"] > nonzero.max(), "bits"]
    return int(later.min()) if not later.empty else None


__all__ = ["best_of", "birthday_pairs", "block_size_sweep", "collision_counts", "hashing_throughput",
           "partial_tail_tokens", "truncation_collisions", "vanishing_bits"]
