"""One call from an experiment's results to a saved figure: :func:`figure_from_experiment`.

It loads the experiment table (``kvlab.results.load``), computes the intervals (:mod:`kvlab.analysis.runs`,
warm-up and windows from ``spec`` or the experiment's ``analysis:``), draws one of :data:`KINDS` and writes it
with :func:`kvlab.plots.style.save`: PNG, PDF, the data drawn (parquet) and a caption (JSON: the experiment,
what the figure shows with its units, the analysis settings, every run id with its config hash, the trace
checksums from the runs' manifests). docs/plots.md describes each kind.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from kvlab.analysis.runs import (
    AnalysisSpec,
    replicate_intervals,
    run_intervals,
    run_requests,
    spec_of,
    table_and_folder,
)
from kvlab.errors import KvlabError
from kvlab.plots import style
from kvlab.plots.capacity import plot_hit_rate_vs_capacity, series_data
from kvlab.plots.serving import plot_memory_timeline, plot_ttft_cdf, plot_ttft_vs_load
from kvlab.plots.tiers import plot_tier_breakdown
from kvlab.results.owned import check_folder
from kvlab.results.runs import varying_columns
from kvlab.units import GIB

#: kind -> what the figure shows (the caption's ``shows``)
KINDS = {
    "hit_rate_vs_capacity": "token hit rate (fraction of prompt tokens, after warm-up) against cache capacity "
                            "(GiB of KV where a model is known, else blocks; log scale), one line per policy; "
                            "bands: confidence intervals (batch means over warmed windows of each run, or a t "
                            "interval over replicate runs)",
    "ttft_cdf": "empirical CDF of TTFT (s, log scale) over admitted requests, one line per run",
    "ttft_vs_load": "TTFT p50 and p90 (s, after warm-up) against the mean arrival rate (requests/s), one colour "
                    "per policy; bands: batch-means confidence intervals",
    "memory_timeline": "KV memory of one run's first instance over simulated time (s): blocks (or GiB) held by "
                       "running requests and cached evictable blocks, stacked",
    "tier_breakdown": "token hit rate of each run split by the tier that served the hit (fraction of prompt "
                      "tokens), stacked bars",
}


def figure_files(name: str) -> list[str]:
    """The file names :func:`figure_from_experiment` writes for a figure named ``name`` (``name`` argument, default
    the kind): ``name.png``, ``.pdf``, ``.parquet`` (the data drawn) and ``.json`` (the caption). A command that
    draws figures after its runs checks them before the runs: :func:`kvlab.results.owned.check_folder`
    (``experiment_figure_folder(...)``, ``names=figure_files(name)``) refuses a file kvlab did not write."""
    return style.save_names(name, data=True, caption=True)


def experiment_figure_folder(results: str | os.PathLike, experiment: str) -> Path:
    """Where :func:`figure_from_experiment` writes the figures of experiment ``experiment`` (its name) by default:
    ``<results>/figures/<experiment>`` (an owned output folder, docs/plots.md)."""
    return Path(results) / "figures" / experiment


def run_labels(table: pd.DataFrame) -> list[str]:
    """A short label per row: ``field=value`` of every varying config column (the run id when none varies)."""
    cols = varying_columns(table)
    if not cols:
        return table["run_id"].astype(str).tolist()
    return [", ".join(f"{c.rsplit('.', 1)[-1]}={row[c]}" for c in cols) for _, row in table.iterrows()]


def caption(table: pd.DataFrame, folder: Path, kind: str, spec: AnalysisSpec) -> dict:
    """The figure's caption: experiment, what it shows, analysis settings, runs (id, config hash, label) and the
    trace checksums (manifests' ``trace.sha256`` and content checksum)."""
    from kvlab.results import read_manifest

    runs, traces = [], {}
    for rid, label in zip(table["run_id"], run_labels(table), strict=True):
        manifest = read_manifest(folder / "runs" / rid)
        trace = manifest.get("trace") or {}
        traces[trace.get("name") or trace.get("source")] = {"sha256": trace.get("sha256"),
                                                           "content_sha256": trace.get("content_sha256")}
        runs.append({"run_id": rid, "config_hash": manifest.get("config_hash"), "label": label})
    names = table["experiment"].unique().tolist() if "experiment" in table else [folder.name]
    return {"experiment": names[0] if len(names) == 1 else names, "figure": kind, "shows": KINDS[kind],
            "analysis": spec.model_dump(), "runs": runs, "traces": traces}


def figure_from_experiment(experiment: str | os.PathLike | pd.DataFrame, kind: str = "hit_rate_vs_capacity", *,
                           results: str | os.PathLike = "results", folder: str | os.PathLike | None = None,
                           out: str | os.PathLike | None = None, spec: AnalysisSpec | None = None,
                           hue: str = "cache.policy", run_id: str | None = None, name: str | None = None,
                           subtitle: str | None = None) -> list[Path]:
    """Draw figure ``kind`` (:data:`KINDS`) of ``experiment`` (a name under ``results``, a results folder, the
    YAML file or ``kvlab.results.load``'s table with ``folder``) and save it as ``out/<name>`` (default
    ``<results>/figures/<experiment>/<kind>``, :func:`experiment_figure_folder`) with :func:`style.save`; returns
    the paths written (:func:`figure_files`). The files are owned outputs: one kvlab did not write there (or
    wrote and somebody changed since) is refused with ResultsLocationError, before the figure is drawn.

    ``spec``: warm-up, windows, level (default: the experiment's ``analysis:``); ``hue``: the column one line
    per value; ``run_id``: the run of ``memory_timeline`` (default: the first); ``subtitle``: appended to the
    title (e.g. the fixed value of another sweep axis).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    table, path = table_and_folder(experiment, results, folder)
    if table.empty:
        raise ValueError(f"{path}: no complete runs to draw")
    spec = spec_of(table, spec)
    order = varying_columns(table)
    table = table.sort_values(order, kind="stable").reset_index(drop=True) if order else table
    exp_name = str(table["experiment"].iloc[0]) if "experiment" in table else path.name
    title = f"{exp_name}, {subtitle}" if subtitle else exp_name
    where = Path(out) if out is not None else experiment_figure_folder(results, exp_name)
    check_folder(where, names=figure_files(name or kind))  # a file kvlab did not write: refused before drawing
    fig, ax = style.figure("column", height=3.0)
    extra: dict = {}
    try:
        if kind == "hit_rate_vs_capacity":
            data, extra = _hit_rate(table, path, spec, hue, ax, title)
        elif kind == "ttft_vs_load":
            table = run_intervals(table, spec, metrics=("ttft_p50_s", "ttft_p90_s"), folder=path)
            _, data = plot_ttft_vs_load(table, hue=hue, ax=ax, title=title)
        elif kind == "ttft_cdf":
            frames = {label: run_requests(path, rid) for rid, label in zip(table["run_id"], run_labels(table),
                                                                              strict=True)}
            _, data = plot_ttft_cdf(frames, ax=ax, title=title)
        elif kind == "memory_timeline":
            data = _memory(table, path, run_id, ax, title)
        else:
            _, data = plot_tier_breakdown(table, ax=ax, title=title)
        return style.save(fig, where, name or kind, data=data, caption={**caption(table, path, kind, spec), **extra})
    finally:
        plt.close(fig)


def capacity_axis(table: pd.DataFrame) -> tuple[pd.DataFrame, str, str, dict]:
    """``(table, x column, x label, caption note)`` of a capacity figure: GiB of KV where the runs give the
    capacity in GiB (``cache.capacity_gib``) or a model is known (blocks converted with the model's KV bytes per
    block into a ``capacity_gib`` column), else blocks. The caption note maps each x value to its blocks."""
    from kvlab.profiles import kv_bytes_per_block

    blocks = "cache.capacity_blocks" if "cache.capacity_blocks" in table and \
        table["cache.capacity_blocks"].notna().all() else "capacity_blocks"
    models = table["model"].dropna().unique() if "model" in table else []
    if "cache.capacity_gib" in table and table["cache.capacity_gib"].notna().all():
        x = "cache.capacity_gib"
    elif len(models) == 1 and blocks in table and "cache.block_size" in table:
        try:
            per_block = kv_bytes_per_block(str(models[0]), int(table["cache.block_size"].iloc[0]))
        except (KvlabError, OSError, ValueError):  # not a model profile (e.g. the engine's shape): blocks
            return table, blocks, "capacity (blocks, log scale)", {}
        table = table.assign(capacity_gib=table[blocks] * per_block / GIB)
        x = "capacity_gib"
    else:
        return table, blocks, "capacity (blocks, log scale)", {}
    model = f" of {models[0]}" if len(models) == 1 else ""
    have = "capacity_blocks" if "capacity_blocks" in table else blocks if blocks in table else None
    pairs = {f"{g:g}": int(b) for g, b in zip(table[x], table[have], strict=True) if b == b} if have else {}
    return table, x, f"capacity (GiB of KV{model}, log scale)", {"capacity_gib_to_blocks": pairs}


def ideal_baseline(drawn: pd.DataFrame) -> float:
    """The figure's infinite-cache line: the mean post-warm-up ideal hit rate of the points drawn (per run
    ``ideal_hit_rate_warmed``, or over replicates ``ideal_hit_rate_rep_mean``), the value ``kvlab run`` prints
    as ``ideal_warmed`` (per run, or per point over replicates)."""
    col = "ideal_hit_rate_rep_mean" if "ideal_hit_rate_rep_mean" in drawn else "ideal_hit_rate_warmed"
    return float(drawn[col].mean())


def _hit_rate(table: pd.DataFrame, path: Path, spec: AnalysisSpec, hue: str, ax, title: str) -> tuple[pd.DataFrame, dict]:  # noqa: ANN001, E501
    """Hit rate vs capacity: batch-means bands per run, or replicate bands where points have several runs;
    returns the data drawn and the caption's extra fields (the baseline, the capacities in blocks)."""
    ideal = "ideal_hit_rate" in table
    metrics = ("token_hit_rate", "ideal_hit_rate") if ideal else ("token_hit_rate",)
    table = run_intervals(table, spec, metrics=metrics, folder=path)
    reps = replicate_intervals(table, metrics, carry=("capacity_blocks",))
    drawn = reps if (reps["replicates"] > 1).any() else table
    extra: dict = {}
    if ideal:  # the infinite cache over the same warmed requests: the table's ideal_warmed
        extra["ideal_hit_rate_warmed"] = ideal_baseline(drawn)
        drawn = drawn.assign(ideal_hit_rate=extra["ideal_hit_rate_warmed"])
    drawn, x, xlabel, note = capacity_axis(drawn)
    extra.update(note)
    what = "t interval over replicate runs" if drawn is not table and "replicates" in drawn and \
        (drawn["replicates"] > 1).any() else f"batch means, {spec.windows} windows"
    plot_hit_rate_vs_capacity(drawn, hue=hue, x=x, ax=ax, xlabel=xlabel,
                              title=f"{title}\n{_analysis_note(spec)}, {spec.confidence:.0%} CI: {what}")
    return series_data(drawn, x, "token_hit_rate", hue), extra


def _analysis_note(spec: AnalysisSpec) -> str:
    parts = [f"{spec.warmup_requests:,} requests"] if spec.warmup_requests else []
    parts += [f"{spec.warmup_seconds:g} s"] if spec.warmup_seconds else []
    return f"after warm-up ({' and '.join(parts)})" if parts else "no warm-up"


def _memory(table: pd.DataFrame, path: Path, run_id: str | None, ax, title: str) -> pd.DataFrame:  # noqa: ANN001
    from kvlab.results import read_results

    rid = run_id or str(table["run_id"].iloc[0])
    run = read_results(path / "runs" / rid)
    if "timeseries" not in run.tables:
        raise ValueError(f"run {rid} has no timeseries (memory_timeline needs a simulator run)")
    row = table[table["run_id"] == rid].iloc[0]
    _, data = plot_memory_timeline(run.tables["timeseries"], kv_bytes_per_block=row.get("kv_bytes_per_block"),
                                   capacity_blocks=row.get("capacity_blocks"), ax=ax,
                                   title=f"{title}: {run_labels(table)[int(row.name)]}")
    return data


__all__ = ["KINDS", "capacity_axis", "caption", "experiment_figure_folder", "figure_files", "figure_from_experiment",
           "ideal_baseline", "run_labels"]
