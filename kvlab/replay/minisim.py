"""Mini-simulations: any policy's hit-rate-vs-capacity curve, approximated by exact replays of a scaled-down
cache on a spatial sample of the keys (the "miniature simulation" of SHARDS, Waldspurger et al. ATC'17).

Not exact, for any policy: the error against the exact replay is measured in docs/curves.md. The sample is
:func:`kvlab.replay.curves.key_sample` (the same keys the sampled LRU curve keeps). Each request keeps its
sampled full blocks, in order, and is replayed (``kvlab.replay.replay``, any registered policy) in a cache
of ``round(C * R)`` blocks with no partial block and no hit limit (``ideal`` mode; the hit limit is applied
when counting: only sampled blocks below the request's own limit count). Lookup still stops at the first
sampled miss. Hits are estimated as in SHARDS-adj: the sampled misses scaled by 1/R and subtracted from the
known number of hit-eligible blocks. Counts are in blocks; rates use kvlab.metrics definitions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import pandas as pd

from kvlab.arguments import require_instance, require_int_list, require_ints, require_real
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.replay.curves import key_sample
from kvlab.replay.replay import ReplayConfig, encode, replay
from kvlab.schema import BlockSize, Seed
from kvlab.workload.workload import Workload, require_workload

MINI_COLUMNS = ("capacity_blocks", "mini_capacity_blocks", "hit_blocks", "reused_tokens", "token_hit_rate",
                "block_hit_rate", "policy", "sample_rate")


def sampled_encoding(enc: EncodedWorkload, mask: np.ndarray) -> tuple[EncodedWorkload, np.ndarray]:
    """``enc`` with each request's full blocks cut to the sampled keys (``mask``: bool per dense key id), each
    sampled block a full block (no partial block), and per request the number of its sampled blocks that lie
    below its hit limit in mode ``vllm`` of the original (they come first: the limit is a prefix)."""
    keep = mask[enc.key_ids]
    row = np.repeat(np.arange(len(enc.prompt_tokens)), enc.full_blocks)
    pos = np.arange(len(enc.key_ids)) - enc.offsets[row]
    counts = np.bincount(row[keep], minlength=len(enc.prompt_tokens)).astype(np.int64)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    cap = np.minimum(enc.full_blocks, np.maximum(enc.prompt_tokens - 1, 0) // enc.block_size)
    eligible = np.bincount(row[keep & (pos < cap[row])], minlength=len(counts)).astype(np.int64)
    mini = dataclasses.replace(enc, offsets=offsets, key_ids=enc.key_ids[keep], prompt_tokens=counts * enc.block_size,
                               num_blocks=counts.copy(), truth_ids=None, num_truth=None)
    return mini, eligible


def mini_curve(
    workload: Workload,
    policy: str,
    capacities: Iterable[int],
    *,
    sample_rate: float,
    seed: int = 0,
    policy_params: dict | None = None,
    block_size: int | None = None,
    mode: str = "vllm",
    encoded: EncodedWorkload | None = None,
) -> pd.DataFrame:
    """``policy``'s approximate curve: one scaled-down exact replay per capacity (blocks) on the keys sampled
    at ``sample_rate`` (``seed`` chooses them). ``mode``: the counting mode estimated (``vllm`` or ``ideal``).
    Columns: ``capacity_blocks``, ``mini_capacity_blocks`` (the replayed cache), ``hit_blocks`` (estimated,
    blocks), ``reused_tokens`` (tokens), ``token_hit_rate``, ``block_hit_rate``, ``policy``, ``sample_rate``."""
    workload = require_workload(workload)
    require_instance(encoded, EncodedWorkload, "encoded", optional=True)
    require_ints("mini_curve", block_size=(BlockSize | None, block_size), seed=(Seed, seed))
    capacities = require_int_list("mini_curve", "capacities", capacities)
    rate = require_real("mini_curve", "sample_rate", sample_rate)
    if not 0.0 < rate <= 1.0:
        raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if mode not in ("vllm", "ideal"):
        raise ConfigError(f"mode must be 'vllm' or 'ideal', got {mode!r}")
    config = ReplayConfig(capacity_blocks=1, block_size=block_size, policy=policy, policy_params=policy_params or {})
    enc = encoded if encoded is not None else encode(workload, config)
    mini, eligible = sampled_encoding(enc, key_sample(enc.num_keys, rate, seed))
    if mode == "ideal":
        eligible = mini.full_blocks
        all_eligible = int(enc.full_blocks.sum())
    else:
        all_eligible = int(np.minimum(enc.full_blocks, np.maximum(enc.prompt_tokens - 1, 0) // enc.block_size).sum())
    rows = []
    for c in capacities:
        if int(c) < 1:
            raise ConfigError(f"capacities must be >= 1 block, got {c}")
        small = max(1, round(int(c) * rate))
        run = replay(workload, config, encoded=mini, capacity_blocks=small, mode="ideal", block_size=enc.block_size)
        hits = int(np.minimum(run.requests["hit_blocks"].to_numpy(), eligible).sum())
        est = min(max(all_eligible - (int(eligible.sum()) - hits) / rate, 0.0), all_eligible)
        rows.append({"capacity_blocks": int(c), "mini_capacity_blocks": small, "hit_blocks": est,
                     "reused_tokens": est * enc.block_size,
                     "token_hit_rate": est * enc.block_size / max(int(enc.prompt_tokens.sum()), 1),
                     "block_hit_rate": est / max(int(enc.full_blocks.sum()), 1), "policy": policy,
                     "sample_rate": rate})
    return pd.DataFrame(rows, columns=list(MINI_COLUMNS))


__all__ = ["MINI_COLUMNS", "mini_curve", "sampled_encoding"]
