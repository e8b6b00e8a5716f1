"""Statistics over the runs of an experiment (``kvlab run``): warm-up, batch-means intervals per run, intervals
across replicate runs and paired A − B comparisons, as columns of the experiment table (docs/statistics.md).

* :class:`AnalysisSpec`: warm-up (first requests and/or seconds of arrival time), batch-means windows and
  confidence level; the experiment's ``analysis:`` section.
* :func:`run_intervals`: the experiment table (``kvlab.results.load``) with, per headline metric, the
  post-warm-up value (``<metric>_warmed``) and its batch-means interval (``<metric>_ci_low`` / ``_ci_high``)
  over contiguous warmed windows of that run's ``requests.parquet`` (:func:`kvlab.analysis.intervals.batch_means`).
* :func:`replicate_intervals`: one row per point, a t interval over the replicate runs' ``<metric>_warmed``
  (rows that differ only in the replicate columns: ``seed``, ``trace.resample_seed``).
* :func:`paired`: A − B (e.g. ARC − LRU) per matching point on the same windows
  (:func:`kvlab.analysis.intervals.paired_batch_means`).
* :func:`paired_replicates`: A − B per point over replicates: one t interval over the per-replicate
  differences of the post-warm-up values (what ``kvlab run --paired`` prints when the experiment has replicates).

Column names: :data:`kvlab.metrics.INTERVAL_COLUMNS`. Headline metrics (:data:`HEADLINE`): ``token_hit_rate``
(every driver) and, where the requests carry ``ttft_s``, ``ttft_mean_s``, ``ttft_p50_s`` and ``ttft_p90_s``
(seconds). A window's p90 rests on its ~10 % slowest requests, so windows need a few hundred requests each;
p99 is left out (a window's p99 is biased low with few tail samples).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.analysis.intervals import batch_means, lag1_autocorrelation, metric_function, paired_batch_means, t_interval
from kvlab.analysis.spec import AnalysisSpec
from kvlab.analysis.warmup import after_warmup
from kvlab.errors import ConfigError, ResultsError
from kvlab.metrics import LATENCY_STATS
from kvlab.results.runs import config_columns, resolve_folder

#: metrics run_intervals computes by default (those a run's requests can give)
HEADLINE: tuple[str, ...] = ("token_hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s")
#: columns whose values mark replicates of one point (varied for the interval across runs)
REPLICATE: tuple[str, ...] = ("seed", "trace.resample_seed")


# ----------------------------------------------------------------------------- reading runs
def table_and_folder(source: pd.DataFrame | str | os.PathLike, results: str | os.PathLike = "results",
                     folder: str | os.PathLike | None = None) -> tuple[pd.DataFrame, Path]:
    """``(experiment table, its results folder)`` from a table (its ``experiment`` column names the folder
    under ``results`` unless ``folder`` is given) or from what :func:`kvlab.results.runs.resolve_folder` takes (an
    experiment name, a results folder or the experiment's YAML file)."""
    from kvlab.results import load

    if isinstance(source, pd.DataFrame):
        if "run_id" not in source:
            raise ConfigError("the table has no run_id column: give kvlab.results.load's table or a results folder")
        if folder is None:
            names = source["experiment"].unique() if "experiment" in source else []
            if len(names) != 1:
                raise ConfigError("give folder=: the table is not one experiment's (no single experiment column)")
            folder = resolve_folder(str(names[0]), results)
        return source.reset_index(drop=True), Path(folder)
    path = Path(folder) if folder is not None else resolve_folder(source, results)
    return load(str(path)), path


def run_requests(folder: Path, run_id: str, cache: dict | None = None) -> pd.DataFrame:
    """``requests.parquet`` of run ``run_id`` of the experiment in ``folder`` (checked against its manifest)."""
    from kvlab.results import read_results

    if cache is not None and run_id in cache:
        return cache[run_id]
    path = folder / "runs" / run_id
    if not path.is_dir():
        raise ResultsError(f"{path}: no such run (the table and the results folder disagree)")
    frame = read_results(path).requests
    if cache is not None:
        cache[run_id] = frame
    return frame


def spec_of(table: pd.DataFrame, spec: AnalysisSpec | None) -> AnalysisSpec:
    """``spec``, or the table's ``analysis.*`` config columns (the experiment's ``analysis:``), or defaults."""
    if spec is not None:
        return spec
    given = {c.split(".", 1)[1]: table[c].iloc[0] for c in table.columns if c.startswith("analysis.") and len(table)}
    for name in given:
        if table[f"analysis.{name}"].nunique(dropna=False) > 1:
            raise ConfigError(f"analysis.{name} differs between runs: give spec= explicitly")
    return AnalysisSpec(**{k: v.item() if hasattr(v, "item") else v for k, v in given.items()
                           if k in AnalysisSpec.model_fields})


# ----------------------------------------------------------------------------- intervals per run
def _available(requests: pd.DataFrame, metric: str) -> bool:
    """Whether ``requests`` can give ``metric`` (a latency statistic needs its column, e.g. ``ttft_s``)."""
    return metric not in LATENCY_STATS or LATENCY_STATS[metric][0] in requests


def fitted_windows(warmed: int, spec: AnalysisSpec) -> int:
    """The batch-means windows a run with ``warmed`` post-warm-up requests gets: ``spec.windows``, or one per
    request when it has fewer (a small workload's interval degrades to fewer, shorter windows instead of
    failing); 0 when fewer than 2 requests are left (no interval: NaN bounds)."""
    n = min(spec.windows, warmed)
    return n if n >= 2 else 0


def run_intervals(source: pd.DataFrame | str | os.PathLike, spec: AnalysisSpec | None = None, *,
                  metrics: Sequence[str] = HEADLINE, results: str | os.PathLike = "results",
                  folder: str | os.PathLike | None = None) -> pd.DataFrame:
    """The experiment table with, per metric, ``<metric>_warmed``, ``<metric>_ci_low``, ``<metric>_ci_high``
    and ``<metric>_lag1`` (NaN where a run's requests cannot give the metric, e.g. TTFT of a replay), and
    ``warmed_requests``, ``warmup_requests``, ``warmup_seconds``, ``ci_windows``, ``ci_level`` (a table that
    already has some of these columns gets them recomputed with ``spec``).

    ``ci_windows`` is the windows each run's interval used (:func:`fitted_windows`): ``spec.windows``, fewer
    when the run has fewer warmed requests than that (one request per window), 0 (NaN bounds, and a NaN
    ``<metric>_warmed`` with no warmed request) when fewer than 2 are left.

    ``source``: ``kvlab.results.load``'s table (its results folder: ``folder``, else ``results/<experiment>``)
    or an experiment name, folder or YAML file. ``spec``: default the table's ``analysis.*`` columns.
    """
    table, path = table_and_folder(source, results, folder)
    spec = spec_of(table, spec)
    for m in metrics:
        metric_function(m)  # ConfigError for an unknown name
    rows = []
    for rid in table["run_id"]:
        requests = run_requests(path, rid)
        warmed = after_warmup(requests, **spec.warmup())
        n_windows = fitted_windows(len(warmed), spec)
        row: dict = {"warmed_requests": len(warmed), "ci_windows": n_windows}
        for m in metrics:
            if not _available(requests, m):
                row.update({f"{m}_warmed": math.nan, f"{m}_ci_low": math.nan, f"{m}_ci_high": math.nan,
                            f"{m}_lag1": math.nan})
                continue
            value = metric_function(m)[1](warmed) if len(warmed) else math.nan
            if not n_windows:
                row.update({f"{m}_warmed": value, f"{m}_ci_low": math.nan, f"{m}_ci_high": math.nan,
                            f"{m}_lag1": math.nan})
                continue
            interval = batch_means(requests, m, n_batches=n_windows, level=spec.confidence, **spec.warmup())
            row.update({f"{m}_warmed": value, f"{m}_ci_low": interval.low, f"{m}_ci_high": interval.high,
                        f"{m}_lag1": lag1_autocorrelation(interval.replicates)})
        rows.append(row)
    added = pd.DataFrame(rows, index=table.index)
    out = pd.concat([table.drop(columns=[c for c in added if c in table]), added], axis=1)  # recomputed: replaced
    out["warmup_requests"] = spec.warmup_requests
    out["warmup_seconds"] = spec.warmup_seconds
    out["ci_level"] = spec.confidence
    return out


# ----------------------------------------------------------------------------- across replicates
def replicate_intervals(table: pd.DataFrame, metrics: Sequence[str] = ("token_hit_rate",), *,
                        replicate: Sequence[str] = REPLICATE, confidence: float | None = None,
                        carry: Sequence[str] = ()) -> pd.DataFrame:
    """One row per point (the config columns but ``replicate``), with ``replicates`` (runs), the first run's
    value of each ``carry`` column (e.g. ``capacity_blocks``, the same for every replicate) and, per metric,
    ``<metric>_rep_mean`` and the t interval ``<metric>_rep_low`` .. ``_rep_high`` over the runs'
    ``<metric>_warmed`` (or ``<metric>`` when :func:`run_intervals` was not applied); NaN bounds with one run.

    Replicates differ in a seed or a resampled trace, so their values are independent draws and the t interval
    covers run-to-run variation (batch means cover variation over time within one run).
    """
    keys = config_columns(table, exclude=list(replicate) + ["sweep_point"])
    level = confidence if confidence is not None else float(table["ci_level"].iloc[0]) if "ci_level" in table \
        else AnalysisSpec().confidence
    rows = []
    for key, group in table.groupby(keys, dropna=False, sort=False) if keys else [((), table)]:
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        row["replicates"] = len(group)
        for c in carry:
            if c in group:
                row[c] = group[c].iloc[0]
        for m in metrics:
            values = group[f"{m}_warmed" if f"{m}_warmed" in group else m].to_numpy(dtype=np.float64)
            values = values[np.isfinite(values)]
            if len(values) >= 2:
                mean, low, high = t_interval(values, level)
            else:
                mean, low, high = (float(values[0]) if len(values) else math.nan), math.nan, math.nan
            row.update({f"{m}_rep_mean": mean, f"{m}_rep_low": low, f"{m}_rep_high": high})
        rows.append(row)
    out = pd.DataFrame(rows)
    out["ci_level"] = level
    return out


# ----------------------------------------------------------------------------- paired comparisons
def paired(source: pd.DataFrame | str | os.PathLike, a: object, b: object, *, column: str = "cache.policy",
           by: Sequence[str] | None = None, metric: str = "token_hit_rate", spec: AnalysisSpec | None = None,
           results: str | os.PathLike = "results", folder: str | os.PathLike | None = None) -> pd.DataFrame:
    """A − B per matching point: the run whose ``column`` is ``a`` minus the run whose ``column`` is ``b``, on
    the same batch-means windows after warm-up (:func:`kvlab.analysis.intervals.paired_batch_means`).

    Runs match when they agree on ``by`` (default: every config column but ``column``, so replicates pair
    with the replicate of the same seed). One row per point: the ``by`` columns that vary in the table, ``a``,
    ``b``, ``metric``, ``estimate`` (mean of the window differences), ``low``, ``high``, ``level``, ``n``
    (windows: ``spec.windows``, fewer when the runs have fewer warmed requests, :func:`fitted_windows`; 0 and NaN
    bounds with fewer than 2), ``lag1`` (lag-1 autocorrelation of the differences), ``run_a``, ``run_b``.
    """
    table, path = table_and_folder(source, results, folder)
    spec = spec_of(table, spec)
    if column not in table:
        raise ConfigError(f"column {column!r} is not in the experiment table")
    keys = list(by) if by is not None else config_columns(table, exclude=[column, "sweep_point"])
    side: dict[str, dict[tuple, pd.Series]] = {}
    for name, value in (("a", a), ("b", b)):
        part = table[table[column] == value]
        if part.empty:
            raise ConfigError(f"{name}={value!r}: no run has {column} = {value!r}; values: "
                              f"{', '.join(map(str, table[column].unique()))}")
        side[name] = {}
        for _, row in part.iterrows():
            point = tuple(str(row[k]) for k in keys)  # str: None and NaN match themselves
            if point in side[name]:
                raise ConfigError(f"{name}={value!r}: several runs per point of {keys}: add the column that "
                                  "tells them apart to by=")
            side[name][point] = row
    common = [p for p in side["a"] if p in side["b"]]
    shown = [k for k in keys if table[k].astype(str).nunique() > 1]  # the point's coordinates
    if not common:
        raise ConfigError(f"no point has runs of both {a!r} and {b!r}")
    rows, cache = [], {}
    for point in common:
        ra, rb = side["a"][point], side["b"][point]
        frames = [run_requests(path, r["run_id"], cache) for r in (ra, rb)]
        n_windows = fitted_windows(min(len(after_warmup(f, **spec.warmup())) for f in frames), spec)
        if n_windows:
            interval = paired_batch_means(*frames, metric, n_batches=n_windows, level=spec.confidence,
                                          **spec.warmup())
            found = {**interval.as_row(), "lag1": lag1_autocorrelation(interval.replicates)}
        else:
            found = {"metric": metric_function(metric)[0], "method": "paired_batch_means", "estimate": math.nan,
                     "low": math.nan, "high": math.nan, "level": spec.confidence, "n": 0, "lag1": math.nan}
        rows.append({**{k: ra[k] for k in shown}, "a": a, "b": b, **found, "run_a": ra["run_id"],
                     "run_b": rb["run_id"]})
    return pd.DataFrame(rows)


def has_replicates(table: pd.DataFrame, replicate: Sequence[str] = REPLICATE) -> bool:
    """Whether some point of ``table`` has several runs that differ only in the ``replicate`` columns."""
    return bool(len(table)) and bool((replicate_intervals(table, (), replicate=replicate,
                                                          confidence=0.95)["replicates"] > 1).any())


def paired_replicates(table: pd.DataFrame, a: object, b: object, *, column: str = "cache.policy",
                      metric: str = "token_hit_rate", replicate: Sequence[str] = REPLICATE,
                      confidence: float | None = None) -> pd.DataFrame:
    """A − B per point over replicates: for each replicate (the same ``seed`` / ``trace.resample_seed``) the
    difference of the two runs' post-warm-up ``<metric>_warmed`` (:func:`run_intervals`), then one Student-t
    interval over those differences. One row per point: the point's varying config columns, ``a``, ``b``,
    ``metric``, ``method`` (``paired_replicates``), ``estimate`` (mean difference), ``low``, ``high``,
    ``level``, ``replicates`` (pairs; NaN bounds with fewer than 2)."""
    col = f"{metric}_warmed"
    if col not in table:
        raise ConfigError(f"the table has no {col} column: apply run_intervals first")
    level = confidence if confidence is not None else float(table["ci_level"].iloc[0]) if "ci_level" in table \
        else AnalysisSpec().confidence
    reps = [c for c in replicate if c in table]
    keys = config_columns(table, exclude=[column, "sweep_point", *reps])
    shown = [k for k in keys if table[k].astype(str).nunique() > 1]
    sides = {}
    for name, value in (("a", a), ("b", b)):
        part = table[table[column] == value]
        if part.empty:
            raise ConfigError(f"{name}={value!r}: no run has {column} = {value!r}")
        sides[name] = {tuple(str(r[k]) for k in keys + reps): r for _, r in part.iterrows()}
    rows: dict[tuple, dict] = {}
    for where, ra in sides["a"].items():
        rb = sides["b"].get(where)
        if rb is None:
            continue
        point = where[:len(keys)]
        row = rows.setdefault(point, {**{k: ra[k] for k in shown}, "diffs": []})
        row["diffs"].append(float(ra[col]) - float(rb[col]))
    if not rows:
        raise ConfigError(f"no point has runs of both {a!r} and {b!r}")
    out = []
    for row in rows.values():
        diffs = np.asarray([d for d in row.pop("diffs") if math.isfinite(d)], dtype=np.float64)
        if len(diffs) >= 2:
            mean, low, high = t_interval(diffs, level)
        else:
            mean, low, high = (float(diffs[0]) if len(diffs) else math.nan), math.nan, math.nan
        out.append({**row, "a": a, "b": b, "metric": metric, "method": "paired_replicates", "estimate": mean,
                    "low": low, "high": high, "level": level, "replicates": len(diffs)})
    return pd.DataFrame(out)


__all__ = ["HEADLINE", "REPLICATE", "AnalysisSpec", "config_columns", "fitted_windows", "has_replicates", "paired",
           "paired_replicates", "replicate_intervals", "run_intervals", "run_requests", "table_and_folder"]
