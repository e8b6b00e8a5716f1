"""Per-tenant / per-category / per-turn breakdowns of hit rate and TTFT, and SLO attainment (goodput).

Hit rates come from :func:`kvlab.metrics.breakdown` (the same :func:`kvlab.metrics.summarize` as a run's
totals, so group sums equal the totals); TTFT and TPOT statistics use the names and definitions of
:data:`kvlab.metrics.METRICS` (``ttft_p50_s`` ...: over admitted requests, seconds). The inputs are the
per-request frames of :mod:`kvlab.replay` (hit rates only), :mod:`kvlab.sim` (``ttft_s``, ``tpot_s``: seconds)
and the engine drivers. Every function takes the warm-up options of :mod:`kvlab.analysis.warmup`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlab.analysis.warmup import after_warmup
from kvlab.errors import ConfigError
from kvlab.metrics import LATENCY_STATS, latency_stats
from kvlab.metrics import breakdown as metrics_breakdown

#: the columns :func:`slo_attainment` adds (names proposed for kvlab.metrics.METRICS)
SLO_COLUMNS = ("slo_requests", "slo_met", "slo_attainment", "ttft_target_s", "tpot_target_s")
#: groupings the helpers below know (kvlab.results.frame.LABELS)
GROUPS = ("tenant", "category", "turn", "session")


def _group_keys(requests: pd.DataFrame, by: str | list[str]) -> list[str]:
    keys = [by] if isinstance(by, str) else list(by)
    if not keys:
        raise ConfigError("by must name at least one column (e.g. 'tenant', 'category', 'turn')")
    for key in keys:
        if not isinstance(key, str) or key not in requests:
            raise ConfigError(f"by: the requests frame has no column {key!r} (its workload has no such label); "
                              f"columns: {', '.join(map(str, requests.columns))}")
    return keys


def breakdown(requests: pd.DataFrame, by: str | list[str], *, warmup_requests: int = 0,
              warmup_seconds: float = 0.0, max_turn: int | None = None) -> pd.DataFrame:
    """Tidy per-group metrics: one row per group of ``by`` (``"tenant"``, ``"category"``, ``"turn"``, a list),
    the group columns first, then :func:`kvlab.metrics.summarize`'s names (``requests``, ``prompt_tokens``,
    ``reused_tokens``, ``token_hit_rate`` ...) and, when the frame has ``ttft_s``, :data:`LATENCY_STATS`.

    ``max_turn``: turns above it are counted as ``max_turn`` (a "max_turn or later" group), so long sessions
    do not leave a tail of one-request groups. Warm-up first (:mod:`kvlab.analysis.warmup`).
    """
    keys = _group_keys(requests, by)
    frame = after_warmup(requests, warmup_requests=warmup_requests, warmup_seconds=warmup_seconds)
    if max_turn is not None:
        if isinstance(max_turn, bool) or not isinstance(max_turn, int | np.integer) or max_turn < 1:
            raise ConfigError(f"max_turn must be a positive int (turns) or None, got {max_turn!r}")
        if "turn" in keys:
            frame = frame.assign(turn=np.minimum(frame["turn"].to_numpy(), int(max_turn)))
    out = metrics_breakdown(frame, keys if len(keys) > 1 else keys[0])
    if "ttft_s" in frame and len(out):
        lat = [latency_stats(group) for _, group in frame.groupby(keys, observed=True, sort=True)]
        out = pd.concat([out, pd.DataFrame(lat)], axis=1)
    return out[keys + [c for c in out.columns if c not in keys]]


def tenant_breakdown(requests: pd.DataFrame, **kw: object) -> pd.DataFrame:
    """:func:`breakdown` by ``tenant``."""
    return breakdown(requests, "tenant", **kw)


def category_breakdown(requests: pd.DataFrame, **kw: object) -> pd.DataFrame:
    """:func:`breakdown` by ``category`` (request type)."""
    return breakdown(requests, "category", **kw)


def turn_breakdown(requests: pd.DataFrame, **kw: object) -> pd.DataFrame:
    """:func:`breakdown` by ``turn`` (1-based; -1 unknown)."""
    return breakdown(requests, "turn", **kw)


def _check_target(name: str, value: float | None) -> float:
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def slo_met(requests: pd.DataFrame, *, ttft_s: float | None, tpot_s: float | None) -> np.ndarray:
    """Per request: True if it was admitted, its ``ttft_s`` <= the TTFT target and its ``tpot_s`` <= the TPOT
    target (targets in seconds; None: no target). A request without decode (``tpot_s`` NaN: one output
    token) meets any TPOT target; one never served (not admitted, rejected, ``ttft_s`` NaN) meets none."""
    ttft_target, tpot_target = _check_target("ttft_s", ttft_s), _check_target("tpot_s", tpot_s)
    if math.isinf(ttft_target) and math.isinf(tpot_target):
        raise ConfigError("ttft_s, tpot_s: give at least one target (seconds)")
    for col, target in (("ttft_s", ttft_target), ("tpot_s", tpot_target)):
        if not math.isinf(target) and col not in requests:
            raise ConfigError(f"{col}: the requests frame has no {col!r} column (a replay has no timing; use the "
                              "simulator or an engine driver)")
    n = len(requests)
    ok = requests["admitted"].to_numpy(dtype=bool).copy() if "admitted" in requests else np.ones(n, bool)
    if "rejected" in requests:
        ok &= ~requests["rejected"].to_numpy(dtype=bool)
    if "ttft_s" in requests:  # served at all: a finite time to first token
        ttft = requests["ttft_s"].to_numpy(dtype=np.float64)
        ok &= np.isfinite(ttft) & (ttft <= ttft_target)
    if not math.isinf(tpot_target):
        tpot = requests["tpot_s"].to_numpy(dtype=np.float64)
        ok &= np.isnan(tpot) | (tpot <= tpot_target)
    return ok


def slo_attainment(requests: pd.DataFrame, *, ttft_s: float | None, tpot_s: float | None,
                   by: str | list[str] | None = None, warmup_requests: int = 0,
                   warmup_seconds: float = 0.0) -> pd.DataFrame:
    """SLO attainment (goodput as a share): requests meeting both targets (:func:`slo_met`) / all requests.

    One row (``by`` None) or one per group: the group columns, ``slo_requests`` (requests, after warm-up),
    ``slo_met`` (requests meeting both targets), ``slo_attainment`` (fraction), ``ttft_target_s`` and
    ``tpot_target_s`` (s; NaN: no target). Rejected and never-admitted requests count as missed.
    """
    frame = after_warmup(requests, warmup_requests=warmup_requests, warmup_seconds=warmup_seconds)
    met = slo_met(frame, ttft_s=ttft_s, tpot_s=tpot_s)
    targets = {"ttft_target_s": math.nan if ttft_s is None else float(ttft_s),
               "tpot_target_s": math.nan if tpot_s is None else float(tpot_s)}

    def row(mask: np.ndarray) -> dict:
        n, k = int(mask.size), int(mask.sum())
        return {"slo_requests": n, "slo_met": k, "slo_attainment": k / n if n else 0.0, **targets}

    if by is None:
        return pd.DataFrame([row(met)])
    keys = _group_keys(frame, by)
    rows = []
    for name, idx in frame.groupby(keys, observed=True, sort=True).indices.items():
        labels = name if isinstance(name, tuple) else (name,)
        rows.append({**dict(zip(keys, labels, strict=True)), **row(met[idx])})
    return pd.DataFrame(rows)


__all__ = ["GROUPS", "LATENCY_STATS", "SLO_COLUMNS", "breakdown", "category_breakdown", "latency_stats",
           "slo_attainment", "slo_met", "tenant_breakdown", "turn_breakdown"]
