"""Figures of serving runs (simulator, engine serving): TTFT distribution, TTFT against load, KV memory over time.

Inputs are the drivers' tables: ``requests`` frames (``ttft_s`` in seconds, ``admitted``), an experiment table
(``kvlab.results.load``, optionally with :func:`kvlab.analysis.runs.run_intervals`'s columns) and the
simulator's ``timeseries`` (``time_s``, ``kv_running_blocks``, ``kv_evictable_blocks``, ``instance``). Every
function returns the data it drew as a tidy frame (for :func:`kvlab.plots.style.save`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from kvlab.metrics import admitted_values
from kvlab.plots import style
from kvlab.plots.capacity import draw_series, legend_below
from kvlab.units import GIB, MS_PER_S

#: TTFT axis units: name -> factor from seconds
TIME_UNITS = {"s": 1.0, "ms": MS_PER_S}


def ttft_values(requests: pd.DataFrame) -> np.ndarray:
    """Sorted finite ``ttft_s`` (s) of the admitted requests (as :func:`kvlab.analysis.latency_stats` counts)."""
    return np.sort(admitted_values(requests, "ttft_s"))


def plot_ttft_cdf(requests_by_label: Mapping[str, pd.DataFrame], *, unit: str = "s", ax: Axes | None = None,
                  title: str | None = None) -> tuple[Axes, pd.DataFrame]:
    """Empirical CDF of TTFT, one step line per label: x TTFT (``unit``: s or ms, log scale), y the fraction
    of admitted requests with a TTFT at most x. Returns the axes and the data (``label``, ``ttft_<unit>``,
    ``fraction``)."""
    if unit not in TIME_UNITS:
        raise ValueError(f"unit must be one of {', '.join(TIME_UNITS)}, got {unit!r}")
    if ax is None:
        _, ax = style.figure("column")
    frames = []
    for i, (label, requests) in enumerate(requests_by_label.items()):
        values = ttft_values(requests) * TIME_UNITS[unit]
        fraction = np.arange(1, len(values) + 1) / max(len(values), 1)
        st = style.policy_style(str(label)) if str(label).lower() in style.POLICY_STYLES else style.series_style(i)
        ax.step(values, fraction, where="post", label=str(label), markevery=0.1, **st)  # marker: greyscale
        frames.append(pd.DataFrame({"label": str(label), f"ttft_{unit}": values, "fraction": fraction}))
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT ({unit}, log scale)")
    ax.set_ylabel("admitted requests with TTFT ≤ x (fraction)")
    ax.set_ylim(0, 1.02)
    legend_below(ax)
    if title:
        style.set_title(ax, title)
    return ax, pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def plot_ttft_vs_load(table: pd.DataFrame, *, stats: Sequence[str] = ("p50", "p90"), hue: str = "policy",
                      x: str = "rate", ax: Axes | None = None, title: str | None = None) -> tuple[Axes, pd.DataFrame]:
    """TTFT statistics (s) against load (``x``: the mean arrival rate, requests/s, the summary's ``rate``), one
    colour and marker per ``hue`` value, one line style per statistic (``p50`` solid, then dashed...), with
    confidence bands where the table has intervals (``ttft_<stat>_s_ci_low``...). Returns the axes and the
    data drawn."""
    if ax is None:
        _, ax = style.figure("column")
    frames = []
    for j, stat in enumerate(stats):
        metric = f"ttft_{stat}_s"
        drawn = draw_series(ax, table, x, metric, hue, linestyle=style.LINESTYLES[j % len(style.LINESTYLES)])
        frames.append(drawn)
    handles, labels = ax.get_legend_handles_labels()
    n = len(labels) // max(len(stats), 1)
    for j, stat in enumerate(stats):  # every line's label: "<hue value>, <statistic>"
        for k in range(n):
            handles[j * n + k].set_label(f"{labels[j * n + k]}, {stat}")
    ax.set_xlabel("load: mean arrival rate (requests/s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    legend_below(ax)
    if title:
        style.set_title(ax, title)
    return ax, pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def plot_memory_timeline(timeseries: pd.DataFrame, *, kv_bytes_per_block: float | None = None,
                         capacity_blocks: int | None = None, instance: int | None = None, ax: Axes | None = None,
                         title: str | None = None) -> tuple[Axes, pd.DataFrame]:
    """KV memory of one serving instance over simulated time (s): blocks held by running requests, and on top
    the cached blocks no running request holds (evictable), stacked; in GiB when ``kv_bytes_per_block`` is
    given, else in blocks. ``capacity_blocks``: the pool's size as a baseline. ``instance``: which one (default
    the first; instances' steps are not aligned in time). Returns the axes and the data drawn."""
    if ax is None:
        _, ax = style.figure("column")
    ts = timeseries
    if "instance" in ts:
        which = int(ts["instance"].min()) if instance is None else instance
        ts = ts[ts["instance"] == which]
    ts = ts.sort_values("time_s")
    scale, unit = (kv_bytes_per_block / GIB, "GiB") if kv_bytes_per_block else (1.0, "blocks")
    t = ts["time_s"].to_numpy(dtype=np.float64)
    running = ts["kv_running_blocks"].to_numpy(dtype=np.float64) * scale
    evictable = ts["kv_evictable_blocks"].to_numpy(dtype=np.float64) * scale
    ax.fill_between(t, 0, running, step="post", color=style.PALETTE[0], alpha=0.8, linewidth=0,
                    label="held by running requests")
    ax.fill_between(t, running, running + evictable, step="post", color=style.PALETTE[1], alpha=0.6, linewidth=0,
                    label="cached, evictable")
    if capacity_blocks:
        ax.axhline(capacity_blocks * scale, label="capacity", **style.baseline_style("capacity"))
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(f"KV memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_xlim(t[0] if len(t) else 0, t[-1] if len(t) else 1)
    legend_below(ax)  # the areas fill the axes
    if title:
        style.set_title(ax, title)
    data = pd.DataFrame({"time_s": t, f"running_{unit.lower()}": running, f"evictable_{unit.lower()}": evictable})
    return ax, data


__all__ = ["plot_memory_timeline", "plot_ttft_cdf", "plot_ttft_vs_load", "ttft_values"]
