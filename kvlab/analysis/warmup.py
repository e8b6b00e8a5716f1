"""Warm-up exclusion: drop the first requests of a run, while the cache is still filling.

A cache starts empty, so the first requests of any replay or simulation miss more than the steady state
would. Every per-request metric can be computed after warm-up: filter the requests frame with
:func:`after_warmup` (or :func:`warmup_mask`) and hand the rest to :func:`kvlab.metrics.summarize`,
:func:`kvlab.metrics.breakdown` or anything in :mod:`kvlab.analysis`. The warmed requests still ran and
still filled the cache; they are only left out of the counts.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError


def check_warmup(requests: int = 0, seconds: float = 0.0) -> tuple[int, float]:
    """``(requests, seconds)`` validated: a non-negative int and a finite non-negative number (seconds).

    Raises ConfigError naming ``warmup_requests`` or ``warmup_seconds``.
    """
    if isinstance(requests, bool) or not isinstance(requests, int | np.integer) or requests < 0:
        raise ConfigError(f"warmup_requests must be a non-negative int (requests), got {requests!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float | np.integer | np.floating) or not (
            math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"warmup_seconds must be a finite number >= 0 (s), got {seconds!r}")
    return int(requests), float(seconds)


def warmup_mask(requests: pd.DataFrame, *, warmup_requests: int = 0, warmup_seconds: float = 0.0) -> np.ndarray:
    """Boolean mask over ``requests`` (a per-request frame in trace order): True for the rows kept.

    A row is dropped if it is among the first ``warmup_requests`` rows, or if its ``arrival`` (s) is less
    than ``warmup_seconds`` after the first row's arrival; with both, a row must pass both to be kept.
    Serving frames carry scaled arrivals (after ``time_scale``), so ``warmup_seconds`` is on that clock.
    """
    n_req, secs = check_warmup(warmup_requests, warmup_seconds)
    n = len(requests)
    keep = np.arange(n) >= n_req
    if secs > 0 and n:
        if "arrival" not in requests:
            raise ConfigError("warmup_seconds needs an 'arrival' column (s) in the requests frame")
        arrival = requests["arrival"].to_numpy(dtype=np.float64)
        keep &= arrival >= arrival[0] + secs
    return keep


def after_warmup(requests: pd.DataFrame, *, warmup_requests: int = 0, warmup_seconds: float = 0.0) -> pd.DataFrame:
    """The rows of ``requests`` left after warm-up (:func:`warmup_mask`), index reset, order kept."""
    keep = warmup_mask(requests, warmup_requests=warmup_requests, warmup_seconds=warmup_seconds)
    return requests.loc[keep].reset_index(drop=True)


__all__ = ["after_warmup", "check_warmup", "warmup_mask"]
