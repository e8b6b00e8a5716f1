"""A tiered run's results: per-request hit tokens per tier and the ``tiers`` list of summary.json.

Units: tokens in ``hit_tokens_*``, ``found_hit_tokens`` and ``loaded_tokens``; blocks (of the run's block
size) in ``blocks_stored``, ``stores_skipped``, ``stores_never_read``, ``evictions``; bytes with a model.
Mechanism only: a model's KV bytes per block and tiers sized in GiB come from :mod:`kvlab.profiles`
(:func:`~kvlab.profiles.kv_bytes_per_block`, :func:`~kvlab.profiles.resolve_tiers`).
Shares are fractions of all prompt tokens, so ``device_token_hit_rate`` plus every tier's ``hit_share``
is ``token_hit_rate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvlab.tiers.spec import Tier
from kvlab.tiers.stack import TierCounters
from kvlab.units import GIB

#: the per-request column of the device's hit tokens; a lower tier's is ``hit_tokens_<name>``
DEVICE_COLUMN = "hit_tokens_device"


def tier_column(name: str) -> str:
    return f"hit_tokens_{name}"


def compiled_tiers(tiers: Sequence[Tier]) -> bool:
    """Whether a compiled replay kernel runs these tiers: none (kvlab.cache.compiled's single-tier kernel), or
    tiers whose policies the tiered kernel runs (kvlab.tiers.compiled: any number of tiers, write policy,
    inclusion, chunk size, touch and max_load_tokens). False, so that the replay runs the Python core, when a
    tier's policy has no compiled hooks or hooks that read a block's data by request and position (belady,
    pgdsf, sglang-leaf, prefix-aware*: :func:`kvlab.tiers.compiled.tier_policy_compiled`)."""
    from kvlab.tiers.compiled import tier_policy_compiled

    return all(tier_policy_compiled(t) for t in tiers)


def tier_columns(frame: pd.DataFrame, cols: dict, tiers: Sequence[Tier], block_size: int) -> pd.DataFrame:
    """``frame`` with ``hit_tokens_device`` and ``hit_tokens_<tier>`` per tier (they sum to ``hit_tokens``)."""
    lower = np.asarray(cols["tier_hit_blocks"], np.int64).reshape(len(frame), len(tiers))
    frame[DEVICE_COLUMN] = (frame["hit_blocks"].to_numpy() - lower.sum(axis=1)) * block_size
    for i, t in enumerate(tiers):
        frame[tier_column(t.name)] = lower[:, i] * block_size
    return frame


def tier_summary(frame: pd.DataFrame, counters: Sequence[TierCounters], tiers: Sequence[Tier], block_size: int,
                 per_block: int | None = None) -> dict:
    """``device_token_hit_rate`` and the ``tiers`` list (one dict per lower tier, level 1 first) from each
    tier's counters (a TierStack's ``[t.counters for t in stack.tiers]``, or the compiled kernel's). Bytes from
    ``per_block`` (KV bytes of one block: :func:`kvlab.profiles.kv_bytes_per_block` of the run's model, or the
    engine's pool layout); None (no model): byte fields null."""
    prompt = float(frame["prompt_tokens"].sum())
    out: list[dict] = []
    for t, c in zip(tiers, counters, strict=True):
        chunk = t.chunk_blocks
        hit = int(frame[tier_column(t.name)].sum())
        written = c.stored_chunks * chunk * per_block if per_block else None
        read = c.loaded_blocks * per_block if per_block else None
        out.append({
            "name": t.name,
            "capacity_blocks": t.capacity_blocks,
            "capacity_gib": t.capacity_blocks * per_block / GIB if per_block else t.capacity_gib,
            "policy": t.policy,
            "write": t.write,
            "selective_hits": t.selective_hits if t.write == "write_through_selective" else None,
            "inclusion": t.inclusion,
            "chunk_blocks": chunk,
            "touch": t.touch,
            "hit_share": hit / prompt if prompt else 0.0,
            "local_hit_rate": c.found_blocks / c.looked_up_blocks if c.looked_up_blocks else 0.0,
            "found_hit_tokens": c.found_blocks * block_size,
            "loaded_tokens": c.loaded_blocks * block_size,
            "blocks_stored": c.stored_chunks * chunk,
            "stores_skipped": c.stores_skipped * chunk,
            "stores_never_read": c.evicted_unread * chunk,
            "evictions": c.evictions * chunk,
            "moved_up_blocks": c.removed_exclusive * chunk,
            "bytes_written": written,
            "bytes_read": read,
            "write_amplification": written / read if written is not None and read else None,
        })
    device = int(frame[DEVICE_COLUMN].sum())
    return {"device_token_hit_rate": device / prompt if prompt else 0.0, "tiers": out}
