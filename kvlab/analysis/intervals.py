"""Confidence intervals that respect cache state: batch means over warmed contiguous windows.

Why not the usual bootstrap: a request's hits depend on every earlier request (what they stored, what they
evicted), so the per-request outcomes of one replay are neither independent nor identically distributed.
Resampling those outcomes (drawing rows of one requests frame with replacement) treats them as if they were,
and gives intervals that are far too narrow and centred on the wrong question. Two valid alternatives:

* **batch means** (here): cut the warmed run into ``n_batches`` contiguous windows of consecutive requests,
  compute the metric on each window (a ratio metric such as ``token_hit_rate`` as Σ hit / Σ prompt tokens of
  the window, by :func:`kvlab.metrics.summarize`) and take a Student-t interval over the window values. It
  assumes the run is stationary after warm-up and that windows are long enough for their values to be
  nearly independent (check :func:`lag1_autocorrelation` of the window values; near 0 is good). It measures
  the variability of the metric over time within this trace, with the cache state carried across windows.
* **session resampling** (:mod:`kvlab.analysis.resample`): draw whole sessions with replacement, replay the
  new workload, repeat. It measures the variability over which sessions arrived.

A paired comparison (policy A − policy B) uses the same windows (or the same resamples) for both, so the
trace's own ups and downs cancel: :func:`paired_batch_means`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.analysis.tdist import t_quantile
from kvlab.analysis.warmup import after_warmup
from kvlab.errors import ConfigError
from kvlab.metrics import LATENCY_STATS, METRICS, latency_stats, summarize

#: a metric: a name of :data:`kvlab.metrics.METRICS` that :func:`kvlab.metrics.summarize` (or, for TTFT and
#: TPOT, :func:`kvlab.metrics.latency_stats`) computes from a requests frame, or a callable
#: ``frame -> float``
Metric = str | Callable[[pd.DataFrame], float]


@dataclass(frozen=True)
class Interval:
    """A confidence interval: ``estimate`` with ``low`` .. ``high`` at confidence ``level`` (a fraction).

    ``method``: ``batch_means`` (``estimate``: the mean of the window values, a t-interval), ``session_resample``
    (``estimate``: the metric on the original workload, a percentile interval over the replays), or either
    prefixed by ``paired_`` for A − B. ``replicates``: the window values or the resampled values (in the
    metric's unit); ``metric``: its name (or ``"custom"``).
    """

    estimate: float
    low: float
    high: float
    level: float
    method: str
    metric: str
    replicates: tuple[float, ...]

    @property
    def half_width(self) -> float:
        """(high − low) / 2, in the metric's unit."""
        return (self.high - self.low) / 2.0

    def as_row(self) -> dict:
        """A flat dict (one row of a tidy frame; plots draw ``low`` .. ``high`` as a band)."""
        return {"metric": self.metric, "method": self.method, "estimate": self.estimate, "low": self.low,
                "high": self.high, "level": self.level, "n": len(self.replicates)}

    def __str__(self) -> str:
        return (f"{self.metric} {self.estimate:.4f} [{self.low:.4f}, {self.high:.4f}] "
                f"({self.level:.0%} {self.method}, n={len(self.replicates)})")


def check_level(level: float) -> float:
    """``level`` as a float in (0, 1); ConfigError naming ``level`` otherwise."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0.0 < level < 1.0:
        raise ConfigError(f"level must be a confidence level in (0, 1), e.g. 0.95, got {level!r}")
    return float(level)


def check_count(name: str, value: int, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def metric_function(metric: Metric) -> tuple[str, Callable[[pd.DataFrame], float]]:
    """``(name, frame -> float)`` for ``metric`` (see :data:`Metric`); ConfigError naming ``metric``."""
    if callable(metric):
        return getattr(metric, "__name__", "custom"), metric
    if not isinstance(metric, str) or metric not in METRICS:
        raise ConfigError(f"metric must be a kvlab.metrics.METRICS name or a callable, got {metric!r}")
    if metric in LATENCY_STATS:
        return metric, lambda frame: float(latency_stats(frame)[metric])

    def value(frame: pd.DataFrame) -> float:
        out = summarize(frame)
        if metric not in out:
            raise ConfigError(f"metric {metric!r} is not computed from a requests frame by kvlab.metrics.summarize")
        return float(out[metric])

    return metric, value


def t_interval(values: np.ndarray, level: float) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Student-t interval for the mean of ``values`` (>= 2 finite values)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    sd = float(values.std(ddof=1))
    half = t_quantile(0.5 + level / 2.0, len(values) - 1) * sd / math.sqrt(len(values))
    return mean, mean - half, mean + half


def lag1_autocorrelation(values: np.ndarray | tuple[float, ...]) -> float:
    """Lag-1 autocorrelation of a series (e.g. batch means); NaN when constant or shorter than 3."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 3:
        return math.nan
    d = x - x.mean()
    den = float((d * d).sum())
    return float((d[:-1] * d[1:]).sum() / den) if den > 0 else math.nan


def windows(n: int, n_batches: int) -> list[np.ndarray]:
    """``n_batches`` contiguous row ranges covering ``0 .. n − 1`` (sizes differ by at most one)."""
    if n < n_batches:
        raise ConfigError(f"n_batches ({n_batches}) exceeds the requests left after warm-up ({n})")
    return np.array_split(np.arange(n), n_batches)


def window_values(requests: pd.DataFrame, metric: Metric = "token_hit_rate", *, n_batches: int = 20,
                  warmup_requests: int = 0, warmup_seconds: float = 0.0) -> np.ndarray:
    """The metric on each of ``n_batches`` contiguous windows of the warmed ``requests`` (in trace order)."""
    check_count("n_batches", n_batches, 2)
    _, fn = metric_function(metric)
    warmed = after_warmup(requests, warmup_requests=warmup_requests, warmup_seconds=warmup_seconds)
    return np.array([fn(warmed.iloc[rows]) for rows in windows(len(warmed), n_batches)], dtype=np.float64)


def batch_means(requests: pd.DataFrame, metric: Metric = "token_hit_rate", *, n_batches: int = 20,
                level: float = 0.95, warmup_requests: int = 0, warmup_seconds: float = 0.0) -> Interval:
    """Batch-means t-interval of ``metric`` over one run's requests frame (module docstring).

    ``n_batches``: windows (10-30 is usual; fewer, longer windows are more independent but give a wider t);
    warm-up as in :func:`kvlab.analysis.warmup.warmup_mask`. ``estimate`` is the mean of the window values
    (for a ratio metric it differs slightly from the ratio over all warmed requests when windows differ in
    size).
    """
    level = check_level(level)
    name, _ = metric_function(metric)
    values = window_values(requests, metric, n_batches=n_batches, warmup_requests=warmup_requests,
                           warmup_seconds=warmup_seconds)
    mean, low, high = t_interval(values, level)
    return Interval(mean, low, high, level, "batch_means", name, tuple(values.tolist()))


def paired_batch_means(requests_a: pd.DataFrame, requests_b: pd.DataFrame, metric: Metric = "token_hit_rate", *,
                       n_batches: int = 20, level: float = 0.95, warmup_requests: int = 0,
                       warmup_seconds: float = 0.0) -> Interval:
    """Batch-means t-interval of A − B: the metric of run A minus run B on the same windows.

    Both frames must come from the same workload (same rows in the same order: checked on ``request_id`` and
    ``arrival`` when present). Against itself the interval is exactly [0, 0].
    """
    level = check_level(level)
    if len(requests_a) != len(requests_b):
        raise ConfigError(f"requests_b has {len(requests_b)} rows, requests_a {len(requests_a)}: "
                          "a paired comparison needs runs of the same workload")
    for col in ("request_id", "arrival"):
        if col in requests_a and col in requests_b and not np.array_equal(requests_a[col].to_numpy(),
                                                                          requests_b[col].to_numpy()):
            raise ConfigError(f"requests_b's {col} column differs from requests_a's: not the same workload")
    name, _ = metric_function(metric)
    kw = dict(n_batches=n_batches, warmup_requests=warmup_requests, warmup_seconds=warmup_seconds)
    diff = window_values(requests_a, metric, **kw) - window_values(requests_b, metric, **kw)
    mean, low, high = t_interval(diff, level)
    return Interval(mean, low, high, level, "paired_batch_means", name, tuple(diff.tolist()))


__all__ = ["Interval", "Metric", "batch_means", "check_level", "lag1_autocorrelation", "metric_function",
           "paired_batch_means", "t_interval", "window_values", "windows"]
