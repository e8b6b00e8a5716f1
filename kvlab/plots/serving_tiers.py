"""Figures of the tiered serving study (kvlab.tiers.serving_study): TTFT per configuration, its split, the
load-vs-recompute break-even, bytes moved per tier and link.

Every function draws from the study's tidy tables (``runs``, ``traffic``, ``break_even``) on given axes, with
units on every axis; :func:`kvlab.plots.tiers.save_figure` writes PNG and PDF.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

LOAD_STYLE = (("#4c72b0", "-"), ("#c44e52", "--"), ("#55a868", ":"))
STAT_MARKER = {"ttft_mean_s": ("o", "mean"), "ttft_p90_s": ("s", "p90")}
SPLIT = (("queue_mean_s", "queueing", "#8c8c8c"), ("load_mean_s", "load (waiting for KV)", "#dd8452"),
         ("compute_mean_s", "compute (prefill steps)", "#4c72b0"))
PATH_STYLE = ("#55a868", "#8fbc8f", "#dd8452", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#64b5cd")


def _configurations(runs: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(runs["configuration"]))


def plot_ttft(runs: pd.DataFrame, trace: str, ax: Axes) -> None:
    """Mean and p90 TTFT (s) per configuration of ``trace``, one line per load (colour and dash) and statistic
    (marker)."""
    part = runs[runs["trace"] == trace]
    configs = _configurations(part)
    x = np.arange(len(configs))
    for (load, g), (color, dash) in zip(part.groupby("load", sort=True), LOAD_STYLE, strict=False):
        g = g.set_index("configuration").loc[configs]
        for col, (marker, label) in STAT_MARKER.items():
            ax.plot(x, g[col], color=color, linestyle=dash, marker=marker, markersize=6,
                    markerfacecolor=color if col == "ttft_mean_s" else "white",
                    label=f"{label}, load {load:g} of saturation")
    ax.set_xticks(x, configs, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{trace}: TTFT per configuration")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def plot_ttft_split(runs: pd.DataFrame, trace: str, ax: Axes) -> None:
    """Mean TTFT (s) split into queueing, load and compute, stacked; two bars per configuration (the loads,
    left bar the lower load, hatched the higher)."""
    part = runs[runs["trace"] == trace]
    configs = _configurations(part)
    loads = sorted(part["load"].unique())
    width = 0.8 / len(loads)
    x = np.arange(len(configs))
    for i, load in enumerate(loads):
        g = part[part["load"] == load].set_index("configuration").loc[configs]
        bottom = np.zeros(len(configs))
        for col, label, color in SPLIT:
            ax.bar(x + (i - (len(loads) - 1) / 2) * width, g[col], width, bottom=bottom, color=color,
                   hatch="//" if i else None, edgecolor="white", label=label if i == 0 else None)
            bottom += g[col].to_numpy()
    ax.set_xticks(x, configs, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"{trace}: mean TTFT split (left: load {loads[0]:g}, hatched: load {loads[-1]:g})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def plot_break_even(frame: pd.DataFrame, layout: str, ax: Axes) -> None:
    """Load time of a prefix per tier path (coloured) against the compute it saves (black), seconds against
    prefix tokens, both log scale; a dot where loading starts to be faster."""
    part = frame[frame["kv_layout"] == layout]
    first = part[part["path"] == part["path"].iloc[0]]
    ax.plot(first["prefix_tokens"], first["recompute_s"], color="black", linewidth=2.5, label="recompute")
    for (path, g), color in zip(part.groupby("path", sort=False), PATH_STYLE, strict=False):
        calibrated = bool(g["calibrated"].iloc[0])
        ax.plot(g["prefix_tokens"], g["load_s"], color=color,
                label=f"load: {path}" + ("" if calibrated else " (uncalibrated)"))
        faster = g[g["load_s"] < g["recompute_s"]]
        if len(faster):
            ax.plot(faster["prefix_tokens"].iloc[0], faster["load_s"].iloc[0], "o", color=color, markersize=6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("prefix length (tokens, log scale)")
    ax.set_ylabel("time (s, log scale)")
    ax.set_title(f"load vs recompute, kv_layout={layout}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def plot_traffic(traffic: pd.DataFrame, trace: str, load: float, ax: Axes,
                 configurations: Sequence[str] | None = None) -> None:
    """Bytes (GB) per tier (written into it, read back) and per link and medium (moved both ways), grouped by
    configuration, at one load."""
    part = traffic[(traffic["trace"] == trace) & (traffic["load"] == load)]
    configs = list(configurations) if configurations is not None else _configurations(part)
    part = part[part["configuration"].isin(configs)]
    series = list(dict.fromkeys(zip(part["kind"], part["name"], part["direction"], strict=True)))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(configs))
    for i, (kind, name, direction) in enumerate(series):
        g = part[(part["kind"] == kind) & (part["name"] == name) & (part["direction"] == direction)]
        gb = g.set_index("configuration")["bytes"].reindex(configs).fillna(0.0) / 1e9
        ax.bar(x + (i - (len(series) - 1) / 2) * width, gb, width, color=PATH_STYLE[i % len(PATH_STYLE)],
               hatch="//" if kind != "tier" else None, label=f"{kind} {name}: {direction}")
    ax.set_xticks(x, configs, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("bytes (GB)")
    ax.set_title(f"{trace}: bytes per tier, link and medium (load {load:g})")
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * 1.45)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=2, loc="upper center")
