"""Aggregate metrics from per-request rows, with docs/semantics.md's names.

Input: a requests frame with at least ``prompt_tokens``, ``hit_tokens``, ``full_blocks``,
``hit_blocks``, ``evictions`` (blocks) and optionally ``admitted``, ``ideal_hit_tokens``,
``cached_blocks``. Rates are fractions in [0, 1]; ``eviction_rate_per_s`` is per second of trace time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvlab.names import Summary


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def summarize(requests: pd.DataFrame, *, duration_s: float | None = None, capacity: int | None = None) -> dict:
    """Totals of one run (or one group of requests)."""
    prompt = requests["prompt_tokens"].to_numpy()
    hit = requests["hit_tokens"].to_numpy()
    out: dict[str, float | int | None] = Summary({
        "requests": len(requests),
        "prompt_tokens": int(prompt.sum()),
        "reused_tokens": int(hit.sum()),
        "token_hit_rate": _ratio(hit.sum(), prompt.sum()),
        "block_hit_rate": _ratio(requests["hit_blocks"].sum(), requests["full_blocks"].sum()),
        "request_hit_rate": float((requests["hit_blocks"].to_numpy() > 0).mean()) if len(requests) else 0.0,
        "mean_request_hit_rate": float(np.mean(hit[prompt > 0] / prompt[prompt > 0])) if (prompt > 0).any() else 0.0,
        "evictions": int(requests["evictions"].sum()),
    })
    out["eviction_rate_per_request"] = _ratio(out["evictions"], len(requests))
    if duration_s is not None:
        out["eviction_rate_per_s"] = _ratio(out["evictions"], duration_s)
    if "ideal_hit_tokens" in requests:
        ideal = requests["ideal_hit_tokens"].to_numpy()
        out["ideal_hit_rate"] = _ratio(ideal.sum(), prompt.sum())
        out["ideal_mean_request_hit_rate"] = (
            float(np.mean(ideal[prompt > 0] / prompt[prompt > 0])) if (prompt > 0).any() else 0.0
        )
    if "admitted" in requests:
        out["rejected_requests"] = int((~requests["admitted"].to_numpy()).sum())
    if "collisions" in requests:
        out["collisions"] = int(requests["collisions"].sum())
    if "orphan_evictions" in requests:
        out["orphan_evictions"] = int(requests["orphan_evictions"].sum())
        out["mean_orphan_blocks"] = float(requests["orphan_blocks"].mean()) if len(requests) else 0.0
    if "cached_blocks" in requests and capacity:
        out["mean_occupancy"] = float(requests["cached_blocks"].mean()) / capacity
        out["final_cached_blocks"] = int(requests["cached_blocks"].iloc[-1]) if len(requests) else 0
    return out


def breakdown(requests: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    """Per-group metrics (e.g. ``by="tenant"`` or ``["category", "turn"]``), one row per group."""
    rows = []
    for name, group in requests.groupby(by, observed=True, sort=True):
        row = summarize(group)
        keys = name if isinstance(name, tuple) else (name,)
        row.update(dict(zip([by] if isinstance(by, str) else by, keys, strict=True)))
        rows.append(row)
    return pd.DataFrame(rows)
