"""One-pass LRU hit-rate-vs-capacity curves (Mattson stack distances), exact or SHARDS-sampled (docs/curves.md).

The stack mirrors the exact LRU replay (``kvlab.replay.replay``, policy ``lru``; docs/semantics.md): after a
request its blocks sit on top in release order reversed (head on top, tail below it: the tail is unpinned
first, so LRU evicts it first), above every other entry in its previous order. An LRU cache of ``C`` blocks
holds the top ``C - F`` entries, ``F`` in {0, 1} once it is full: the free block the last request's partial
block went back to (vllm mode: every request allocates at least one block; ideal mode tracks when it does not).
A key is a hit at ``C`` when its stack depth, and every earlier key's of the request, is within that.

A block recomputed while its key is still cached (the ``vllm`` hit limit recomputes a cached last block; a
key after the first miss) leaves its old copy in the stack as a *ghost* entry: it occupies a slot exactly
where the cache keeps the duplicate copy, and lies beyond the cache where the old copy was already gone.

Exactness (tested against the exact replay block for block, tests/test_curves.py):

* every request the pass takes must be admitted: a request of more blocks than the cache is rejected and
  changes nothing. One pass over all requests is exact at capacities of at least the largest request
  (``largest_request_blocks``); below it :func:`lru_curve` runs one pass per distinct set of admitted
  requests (``one_pass=True``: not, and the rows there are approximate);
* capacities below ``diverge_from_blocks``: when a key held by two blocks is hit again, the cache pins its
  older copy (the one found first) while the stack moves its newer one; from the capacity at which the older
  copy was still cached, the orders below may differ. Also counted there: a key whose earlier key in the
  request is deeper in the stack (keys that are not chained). ``inf`` when it never happens.

The frame's ``exact`` column is True at capacities where both hold (and no sampling). Counts are in blocks,
``reused_tokens`` in tokens; rates use :func:`kvlab.metrics.summarize`'s definitions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numba as nb
import numpy as np
import pandas as pd

from kvlab.arguments import require_instance, require_int_list, require_ints, require_real
from kvlab.cache.compiled import max_hit_blocks
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.replay.replay import ReplayConfig, encode
from kvlab.schema import BlockSize, Seed
from kvlab.workload.workload import Workload, require_workload

NEVER = np.iinfo(np.int64).max // 4  # depth of a key not in the stack; a threshold never reached
_MASK64 = (1 << 64) - 1

CURVE_COLUMNS = ("capacity_blocks", "hit_blocks", "reused_tokens", "token_hit_rate", "block_hit_rate",
                 "request_hit_rate", "mean_request_hit_rate", "exact", "sample_rate")


@nb.njit(cache=True, inline="always")
def _mix64(x: np.uint64) -> np.uint64:
    """splitmix64's finaliser: spreads dense key ids uniformly (key sampling only, not block hashing)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@nb.njit(cache=True)
def _sample_kernel(num_keys: int, below: np.uint64, salt: np.uint64) -> np.ndarray:
    out = np.empty(num_keys, np.bool_)
    for k in range(num_keys):
        out[k] = _mix64(np.uint64(k) ^ salt) < below
    return out


def key_sample(num_keys: int, rate: float, seed: int = 0) -> np.ndarray:
    """bool [num_keys]: the dense key ids in a SHARDS-style spatial sample of rate ``rate`` (in (0, 1]): those
    whose mixed id (splitmix64's finaliser, salted by ``seed``) falls in a fraction ``rate`` of the 64-bit
    space. Every key at rate 1; nested across rates for one seed."""
    if not 0.0 < float(rate) <= 1.0:
        raise ConfigError(f"sample_rate must be in (0, 1], got {rate!r}")
    if rate == 1.0:
        return np.ones(num_keys, np.bool_)
    salt = _mix64_py(int(seed) + 0x9E3779B97F4A7C15) if seed else 0
    return _sample_kernel(num_keys, np.uint64(int(rate * 2.0**64)), np.uint64(salt))


@nb.njit(cache=True, inline="always")
def _add(tree: np.ndarray, i: int, v: int) -> None:
    """Fenwick tree (1-based ``i``) point update."""
    n = tree.shape[0]
    while i < n:
        tree[i] += v
        i += i & -i


@nb.njit(cache=True, inline="always")
def _prefix(tree: np.ndarray, i: int) -> int:
    """Fenwick tree: sum of entries 1..i."""
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@nb.njit(cache=True, inline="always")
def _threshold(depth: int, scale: float, theta: int) -> int:
    """Smallest capacity (blocks) whose cache holds an entry at stack ``depth``: the top ``C - F(C)`` entries
    are cached, ``F(C) = 1`` for ``C >= theta`` (the free block a partial block went back to), else 0."""
    if depth >= NEVER:
        return NEVER
    t = depth if scale == 1.0 else int(math.ceil(depth * scale - 1e-9))
    if t >= theta:
        t += 1
    return t


@nb.njit(cache=True, nogil=True)
def stack_kernel(
    offsets: np.ndarray,  # int64 [n+1] into key_ids
    key_ids: np.ndarray,  # int64 dense key per full block
    prompt_tokens: np.ndarray,  # int64 [n]
    num_blocks: np.ndarray,  # int64 [n], full + partial blocks
    num_keys: int,
    block_size: int,  # tokens
    ideal: bool,
    sampled: np.ndarray,  # bool [num_keys]: the keys in the stack (key_sample)
    scale: float,  # 1 / sample rate: sampled depths scale to full-cache blocks
    limit: int,  # blocks: requests needing more (rejected by a cache of ``limit`` blocks) are skipped
):
    """One pass over the requests: per capacity threshold ``t`` (blocks), the sampled hit blocks first hit
    at ``C = t`` (``hits``), requests whose first block does (``req_hits``) and their ``hit_tokens /
    prompt_tokens`` (``frac``); the number of sampled hit-eligible blocks, their ``frac`` sum, the sampled first
    blocks within the cap; and the smallest
    capacity from which the stack may differ from the exact cache (``diverge``; NEVER if none)."""
    n = len(prompt_tokens)
    every = scale == 1.0
    n_slots = 0
    for j in range(len(key_ids)):
        if sampled[key_ids[j]]:
            n_slots += 1
    size = int(math.ceil(n_slots * scale)) + 3
    hits = np.zeros(size, np.int64)
    req_hits = np.zeros(size, np.int64)
    frac = np.zeros(size, np.float64)
    tree = np.zeros(n_slots + 1, np.int64)  # slot s (1-based, later = more recent) holds an entry
    slot = np.full(num_keys, -1, np.int64)  # the key's live (newest) entry
    ghost = np.full(num_keys, -1, np.int64)  # the key's newest ghost entry (an older copy left in place)
    total = 0  # entries in the stack
    next_slot = 1
    theta = NEVER
    eligible = 0  # sampled full blocks within the hit cap
    eligible_frac = 0.0  # their sum of block_size / prompt_tokens
    first_blocks = 0  # requests whose first block is sampled and within the hit cap
    diverge = NEVER
    for r in range(n):
        if num_blocks[r] > limit:  # rejected: changes nothing (not even the free block)
            continue
        start = offsets[r]
        nfull = offsets[r + 1] - start
        cap = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        m = 0
        last_t = NEVER if nfull > 0 else 0
        n_s = 0
        for i in range(nfull):
            k = key_ids[start + i]
            if not sampled[k]:
                continue
            n_s += 1
            s = slot[k]
            d = NEVER if s < 0 else total - _prefix(tree, s - 1)
            if d < m and i < cap:  # not chained: the cache may keep a copy the stack moves
                diverge = min(diverge, _threshold(d, scale, theta))
            m = max(m, d)
            t = _threshold(m, scale, theta)
            last_t = t
            if i >= cap:
                continue
            eligible += 1
            eligible_frac += block_size / prompt_tokens[r]
            if i == 0:
                first_blocks += 1
            if t >= NEVER:
                continue
            hits[t] += 1
            frac[t] += block_size / prompt_tokens[r]
            if i == 0:
                req_hits[t] += 1
            g = ghost[k]
            if g >= 0 and every:  # the cache pins the older copy where it is still cached
                gd = total - _prefix(tree, g - 1)
                diverge = min(diverge, _threshold(max(gd, m), scale, theta))
        # the request's entries on top: key 0 newest; recomputed keys leave their old entry as a ghost
        j = 0
        for i in range(nfull):
            k = key_ids[start + i]
            if not sampled[k]:
                continue
            new = next_slot + n_s - 1 - j
            j += 1
            s = slot[k]
            if s >= 0:
                if i < cap:
                    _add(tree, s, -1)
                    total -= 1
                else:
                    ghost[k] = s
            _add(tree, new, 1)
            total += 1
            slot[k] = new
        next_slot += n_s
        # the free block: a partial block goes back to it (F = 1 at every full capacity); a request that
        # allocates nothing (ideal mode, every block hit) leaves it as it was
        if num_blocks[r] > nfull:
            theta = 0
        elif cap == nfull:
            theta = max(theta, last_t)
        else:
            theta = NEVER
    return hits, req_hits, frac, eligible, eligible_frac, first_blocks, diverge


def lru_curve(
    workload: Workload,
    block_size: int | None = None,
    capacities: Iterable[int] | None = None,
    *,
    mode: str = "vllm",
    sample_rate: float = 1.0,
    seed: int = 0,
    adjust: bool = True,
    one_pass: bool = False,
    config: ReplayConfig | None = None,
    encoded: EncodedWorkload | None = None,
) -> pd.DataFrame:
    """The LRU hit-rate-vs-capacity curve of ``workload`` from one stack pass: one row per capacity (blocks).

    ``capacities`` (blocks, each >= 1): default every capacity from 1 to where the curve stops rising.
    ``block_size`` (tokens) and ``mode`` as in :class:`~kvlab.replay.ReplayConfig`; ``config`` gives the hash
    settings (its capacity and policy are ignored); ``encoded`` skips hashing.

    ``sample_rate`` R in (0, 1]: SHARDS-style spatial sampling: only keys whose hashed dense id falls in a
    fraction R of the hash space enter the stack, their depths scaled by 1/R; the sampled *misses* are scaled
    by 1/R and subtracted from the known hit-eligible totals (SHARDS-adj: the difference between the sampled
    and the expected number of references is counted as hits, which keeps one hot key that happens to be
    sampled, or not, from tilting the curve); ``request_hit_rate`` likewise from the requests' first blocks.
    ``adjust=False``: the sampled hits scaled by (hit-eligible blocks) / (sampled hit-eligible blocks) instead.
    ``seed`` chooses the sample. Not exact: the error is measured in docs/curves.md.

    Capacities below the largest request (``largest_request_blocks``): a request of more blocks than the
    cache is rejected there and changes nothing. By default each distinct set of admitted requests among the
    capacities asked for gets its own pass over those requests (exact again; for the full curve that is up
    to one pass per distinct request size); ``one_pass=True`` skips that and takes every request, which is
    not exact there (the error is measured in docs/curves.md).

    Columns: ``capacity_blocks``, ``hit_blocks`` (blocks), ``reused_tokens`` (tokens), ``token_hit_rate``,
    ``block_hit_rate``, ``request_hit_rate``, ``mean_request_hit_rate`` (kvlab.metrics definitions),
    ``exact`` (equal to the exact LRU replay by construction: no sampling, every request the pass takes is
    admitted at that capacity, and the capacity is below its pass's ``diverge_from``), ``sample_rate``.
    ``frame.attrs``: ``largest_request_blocks``, ``diverge_from_blocks`` (the smallest capacity from which
    a pass may differ, inf when none may; see the module docstring), ``block_size``, ``mode``.
    """
    workload = require_workload(workload)
    require_instance(config, ReplayConfig, "config", optional=True)
    require_instance(encoded, EncodedWorkload, "encoded", optional=True)
    require_ints("lru_curve", block_size=(BlockSize | None, block_size), seed=(Seed, seed))
    if not 0.0 < require_real("lru_curve", "sample_rate", sample_rate) <= 1.0:
        raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if mode not in ("vllm", "ideal"):
        raise ConfigError(f"mode must be 'vllm' or 'ideal', got {mode!r}")
    if capacities is not None:
        capacities = require_int_list("lru_curve", "capacities", capacities)
    if config is None:
        config = ReplayConfig(capacity_blocks=1, block_size=block_size, mode=mode)
    else:
        config = ReplayConfig(**{**config.to_dict(), "block_size": block_size or config.block_size, "mode": mode})
    if encoded is None:
        encoded = encode(workload, config)
    enc = encoded
    rate = float(sample_rate)
    largest = int(enc.num_blocks.max()) if len(enc.num_blocks) else 0
    if capacities is None:
        top = _pass(enc, mode, rate, seed, adjust, largest, None)[0]["capacity_blocks"].max()
        capacities = np.arange(1, max(int(top), 1) + 1)
    capacities = np.asarray(list(capacities), np.int64)
    if len(capacities) and capacities.min() < 1:
        raise ConfigError(f"capacities must be >= 1 block, got {capacities.min()}")
    # one pass for every capacity >= the largest request; below it (unless one_pass), one pass per distinct set
    # of admitted requests (those of at most C blocks), since a rejected request changes nothing
    limits = np.full(len(capacities), largest, np.int64)
    if not one_pass:
        sizes = np.unique(enc.num_blocks)
        idx = np.searchsorted(sizes, capacities, side="right") - 1
        limits = np.where(idx >= 0, sizes[np.maximum(idx, 0)], 0)  # the largest admitted request's blocks
    parts, diverge_from = [], math.inf
    for limit in np.unique(limits):
        part, div = _pass(enc, mode, rate, seed, adjust, int(limit), capacities[limits == limit])
        part.index = np.flatnonzero(limits == limit)
        parts.append(part)
        diverge_from = min(diverge_from, div)
        part["exact"] = (rate == 1.0) & (part["capacity_blocks"] >= limit) & (part["capacity_blocks"] < div)
    frame = pd.concat(parts).sort_index() if parts else _pass(enc, mode, rate, seed, adjust, largest, capacities)[0]
    frame["sample_rate"] = rate
    frame = frame[list(CURVE_COLUMNS)].reset_index(drop=True)
    frame.attrs.update(largest_request_blocks=largest, diverge_from_blocks=diverge_from,
                       block_size=enc.block_size, mode=mode)
    return frame


def _pass(
    enc: EncodedWorkload, mode: str, rate: float, seed: int, adjust: bool, limit: int, capacities: np.ndarray | None,
) -> tuple[pd.DataFrame, float]:
    """One stack pass over the requests of at most ``limit`` blocks (the others are rejected at the
    ``capacities`` asked for; ``None``: up to where the curve stops rising), and its ``diverge_from``."""
    hits, req_hits, frac, eligible, eligible_frac, first_blocks, diverge = stack_kernel(
        enc.offsets, enc.key_ids, enc.prompt_tokens, enc.num_blocks, enc.num_keys, enc.block_size,
        mode == "ideal", key_sample(enc.num_keys, rate, seed), 1.0 / rate, limit,
    )
    full = enc.full_blocks
    prompt = enc.prompt_tokens
    admitted = enc.num_blocks <= limit
    # the hit cap per request (compiled.max_hit_blocks, vectorised), 0 for rejected requests
    caps = full if mode == "ideal" else np.minimum(full, np.maximum(prompt - 1, 0) // enc.block_size)
    caps = np.where(admitted, caps, 0)
    all_eligible = int(caps.sum())
    all_first = int((caps > 0).sum())
    n_prompted = int((prompt > 0).sum())
    if capacities is None:
        capacities = np.array([int(np.flatnonzero(hits).max()) if hits.any() else 1], np.int64)
    at = np.minimum(capacities, len(hits) - 1)
    cum_hits = np.cumsum(hits)[at]
    cum_req = np.cumsum(req_hits)[at]
    cum_frac = np.cumsum(frac)[at]
    if rate == 1.0:
        hit_blocks = cum_hits.astype(np.int64)
        requests_hit = cum_req / max(len(prompt), 1)
        mean_rate = cum_frac / max(n_prompted, 1)
    elif adjust:  # SHARDS-adj: the sampled misses scale by 1/R, the sampling's count error goes to the hits
        safe = prompt > 0
        all_frac = float(np.sum(caps[safe] * enc.block_size / prompt[safe]))
        hit_blocks = np.clip(all_eligible - (eligible - cum_hits) / rate, 0.0, all_eligible)
        requests_hit = np.clip(all_first - (first_blocks - cum_req) / rate, 0.0, all_first) / max(len(prompt), 1)
        mean_rate = np.clip(all_frac - (eligible_frac - cum_frac) / rate, 0.0, all_frac) / max(n_prompted, 1)
    else:  # ratio: the sampled hits scale by (hit-eligible blocks) / (sampled hit-eligible blocks)
        hit_blocks = cum_hits * (all_eligible / eligible if eligible else 0.0)
        requests_hit = cum_req * (all_first / first_blocks if first_blocks else 0.0) / max(len(prompt), 1)
        mean_rate = cum_frac * (all_eligible / eligible if eligible else 0.0) / max(n_prompted, 1)
    frame = pd.DataFrame({
        "capacity_blocks": capacities,
        "hit_blocks": hit_blocks,
        "reused_tokens": hit_blocks * enc.block_size,
        "token_hit_rate": hit_blocks * enc.block_size / max(int(prompt.sum()), 1),
        "block_hit_rate": hit_blocks / max(int(full.sum()), 1),
        "request_hit_rate": requests_hit,
        "mean_request_hit_rate": mean_rate,
        "exact": False,
    })
    return frame, math.inf if diverge >= NEVER else int(diverge)


def _mix64_py(x: int) -> int:
    """Python twin of :func:`_mix64` (for the seed's salt)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


__all__ = ["CURVE_COLUMNS", "key_sample", "lru_curve", "stack_kernel"]
