"""Session resampling: draw whole sessions with replacement, re-replay, take percentile intervals.

The per-request outcomes of one replay cannot be resampled (a request's hits depend on every earlier request:
see :mod:`kvlab.analysis.intervals`). Resampling the *input* instead is valid: draw as many sessions as the
trace has, with replacement, keep each drawn session whole (all its requests, at their own arrival times),
merge them in arrival order into a new Workload, and run it through the driver again (``run``: any callable
``Workload -> result``, e.g. ``lambda w: replay(w, config)``; the result's ``requests`` frame is read). Over
``n_resamples`` replays, the percentile interval of the metric estimates how much it depends on which sessions
happened to arrive. It assumes sessions are independent of each other (they still share cached prefixes such
as system prompts, which the re-replay keeps) and that the trace's rate and mix are representative.

A session drawn twice would otherwise hit its own copy in the cache (an identical conversation replayed by a
second user), inflating hit rates; by default (``duplicates="isolate"``) each extra copy gets its own cache
salt (the workload's ``salt`` column: part of the first block key, so all its keys differ), so copies share
nothing, not even a system prompt. ``duplicates="share"`` keeps copies identical. Deterministic given ``seed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np
import pandas as pd

from kvlab.analysis.intervals import Interval, Metric, check_count, check_level, metric_function
from kvlab.analysis.warmup import after_warmup, check_warmup
from kvlab.errors import ConfigError
from kvlab.workload.workload import Workload

Duplicates = Literal["isolate", "share"]
#: the driver: a workload in, a result with a ``requests`` frame (or the frame itself) out
Runner = Callable[[Workload], object]


def session_groups(workload: Workload) -> np.ndarray:
    """One int64 group label per request: its ``session`` (requests with session -1, no session, are each a
    group of their own). ConfigError naming ``groups`` when the workload has no session column."""
    if workload.session is None:
        raise ConfigError("groups: the workload has no session column; pass groups= (one label per request), "
                          "e.g. kvlab.analysis.prefix_groups(workload)")
    s = workload.session
    labels = np.unique(s, return_inverse=True)[1].astype(np.int64)
    lone = s < 0
    labels[lone] = labels.max(initial=-1) + 1 + np.arange(int(lone.sum()))
    return labels


def prefix_groups(workload: Workload, depth: int = 2) -> np.ndarray:
    """Pseudo-sessions for traces without a session column: requests whose first ``depth`` prompt values (block
    ids of a block trace, token ids of a token trace) agree form one group (int64 labels, first-seen order).

    On Mooncake conversation the first block is one shared system prompt; ``depth=2`` gives 7,373 groups of
    1-43 requests (a conversation's turns extend the same prefix), which is the default.
    """
    depth = check_count("depth", depth, 1)
    off, values = workload.prompt_offsets, workload.prompt_values
    keys = [values[off[i]:min(off[i] + depth, off[i + 1])].tobytes() for i in range(len(workload))]
    codes, _ = pd.factorize(pd.Series(keys, dtype=object), sort=False)
    return codes.astype(np.int64)


def _check_groups(workload: Workload, groups: np.ndarray | None) -> np.ndarray:
    if groups is None:
        return session_groups(workload)
    g = np.asarray(groups)
    if g.shape != (len(workload),):
        raise ConfigError(f"groups must have one label per request ({len(workload)}), got shape {g.shape}")
    return pd.factorize(g, sort=False)[0].astype(np.int64)


def resample_sessions(workload: Workload, rng: np.random.Generator, groups: np.ndarray | None = None, *,
                      duplicates: Duplicates = "isolate") -> Workload:
    """One resample: as many groups as ``workload`` has, drawn with replacement by ``rng``; each drawn group's
    requests kept whole and in order, all merged by arrival (ties: draw order). ``parent`` links are dropped
    (a row may appear twice). See the module docstring for ``duplicates``."""
    if duplicates not in ("isolate", "share"):
        raise ConfigError(f"duplicates must be 'isolate' or 'share', got {duplicates!r}")
    labels = _check_groups(workload, groups)
    n_groups = int(labels.max(initial=-1)) + 1
    if n_groups == 0:
        raise ConfigError("workload: no requests to resample")
    order = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[order], np.arange(n_groups + 1))
    drawn = rng.integers(0, n_groups, size=n_groups)
    copy = np.zeros(n_groups, dtype=np.int64)
    rows, copies = [], []
    for g in drawn:
        members = order[starts[g]:starts[g + 1]]
        rows.append(members)
        copies.append(np.full(len(members), copy[g], dtype=np.int64))
        copy[g] += 1
    idx, cp = np.concatenate(rows), np.concatenate(copies)
    by_arrival = np.argsort(workload.arrival[idx], kind="stable")
    idx, cp = idx[by_arrival], cp[by_arrival]
    out = workload.select(idx)
    changes: dict[str, object] = {"parent": None, "name": f"{workload.name}/resampled"}
    if duplicates == "isolate" and (cp > 0).any():
        base = (np.asarray(workload.salt, dtype=object)[idx] if workload.salt is not None
                else np.full(len(idx), None, dtype=object))
        salt = [b if k == 0 else f"{'' if b is None or b != b else b}#copy{k}" for b, k in zip(base, cp, strict=True)]
        changes["salt"] = pd.Categorical(salt)
    return dataclasses.replace(out, **changes)


def _frame(result: object) -> pd.DataFrame:
    if isinstance(result, pd.DataFrame):
        return result
    frame = getattr(result, "requests", None)
    if not isinstance(frame, pd.DataFrame):
        raise ConfigError(f"run must return a result with a requests frame (or a DataFrame), got {type(result)}")
    return frame


def _replicates(workload: Workload, runs: list[Runner], metric: Metric, *, n_resamples: int, seed: int,
                groups: np.ndarray | None, duplicates: Duplicates, warmup: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(original, replicates)``: the metric of each runner on ``workload`` ([k]) and on each resample
    ([n_resamples, k]), every runner seeing the same resamples."""
    _, fn = metric_function(metric)
    labels = _check_groups(workload, groups)

    def values(w: Workload) -> list[float]:
        return [fn(after_warmup(_frame(run(w)), **warmup)) for run in runs]

    rng = np.random.default_rng(seed)
    reps = [values(resample_sessions(workload, rng, labels, duplicates=duplicates)) for _ in range(n_resamples)]
    return np.array(values(workload)), np.array(reps, dtype=np.float64)


def _percentile_interval(estimate: float, reps: np.ndarray, level: float, method: str, name: str) -> Interval:
    low, high = np.quantile(reps, [0.5 - level / 2.0, 0.5 + level / 2.0])
    return Interval(float(estimate), float(low), float(high), level, method, name, tuple(reps.tolist()))


def _check_common(n_resamples: int, seed: int, level: float, warmup_requests: int,
                  warmup_seconds: float) -> tuple[int, float, dict]:
    n = check_count("n_resamples", n_resamples, 2)
    check_count("seed", seed, 0)
    req, sec = check_warmup(warmup_requests, warmup_seconds)
    return n, check_level(level), {"warmup_requests": req, "warmup_seconds": sec}


def session_resample(workload: Workload, run: Runner, metric: Metric = "token_hit_rate", *, n_resamples: int = 20,
                     seed: int = 0, level: float = 0.95, groups: np.ndarray | None = None,
                     duplicates: Duplicates = "isolate", warmup_requests: int = 0,
                     warmup_seconds: float = 0.0) -> Interval:
    """Percentile interval of ``metric`` over ``n_resamples`` re-runs of session resamples (module docstring).

    ``run`` is called ``n_resamples + 1`` times (the original first: the ``estimate``). ``groups``: one label
    per request (default: the session column; :func:`prefix_groups` for traces without one). Warm-up applies
    to each run's frame. With a small ``n_resamples`` (20) the 95 % percentile interval rests on the extreme
    replicates: treat it as rough.
    """
    n, level, warmup = _check_common(n_resamples, seed, level, warmup_requests, warmup_seconds)
    name, _ = metric_function(metric)
    orig, reps = _replicates(workload, [run], metric, n_resamples=n, seed=seed, groups=groups,
                             duplicates=duplicates, warmup=warmup)
    return _percentile_interval(orig[0], reps[:, 0], level, "session_resample", name)


def paired_session_resample(workload: Workload, run_a: Runner, run_b: Runner, metric: Metric = "token_hit_rate",
                            *, n_resamples: int = 20, seed: int = 0, level: float = 0.95,
                            groups: np.ndarray | None = None, duplicates: Duplicates = "isolate",
                            warmup_requests: int = 0, warmup_seconds: float = 0.0) -> dict[str, Interval]:
    """A − B on the same resamples: ``{"a": ..., "b": ..., "a_minus_b": ...}`` intervals (percentile, as
    :func:`session_resample`). Each runner is called ``n_resamples + 1`` times; A against itself gives exactly 0.
    """
    n, level, warmup = _check_common(n_resamples, seed, level, warmup_requests, warmup_seconds)
    name, _ = metric_function(metric)
    orig, reps = _replicates(workload, [run_a, run_b], metric, n_resamples=n, seed=seed, groups=groups,
                             duplicates=duplicates, warmup=warmup)
    return {
        "a": _percentile_interval(orig[0], reps[:, 0], level, "session_resample", name),
        "b": _percentile_interval(orig[1], reps[:, 1], level, "session_resample", name),
        "a_minus_b": _percentile_interval(orig[0] - orig[1], reps[:, 0] - reps[:, 1], level,
                                          "paired_session_resample", name),
    }


__all__ = ["Duplicates", "Runner", "paired_session_resample", "prefix_groups", "resample_sessions",
           "session_groups", "session_resample"]
