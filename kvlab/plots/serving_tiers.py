"""Figures of the tiered serving study (kvlab.studies.serving_tiers): TTFT per configuration, its split, the
load-vs-recompute break-even, bytes moved per tier and link.

Every function draws from the study's tidy tables (``runs``, ``traffic``, ``break_even``) on given axes, with
units on every axis; colours from :mod:`kvlab.plots.style`'s one palette; bytes in binary units (GiB or TiB,
one unit per axes: :func:`byte_unit`); :func:`kvlab.plots.style.save` writes PNG and PDF.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

from kvlab.plots import style
from kvlab.units import GIB, TIB

LOAD_STYLE = ((style.PALETTE[0], "-"), (style.PALETTE[3], "--"), (style.PALETTE[2], ":"))
STAT_MARKER = {"ttft_mean_s": ("o", "mean"), "ttft_p90_s": ("s", "p90")}
SPLIT = (("queue_mean_s", "queueing", style.PALETTE[6]), ("load_mean_s", "load (waiting for KV)", style.PALETTE[1]),
         ("compute_mean_s", "compute (prefill steps)", style.PALETTE[0]))
PATH_STYLE = style.PALETTE[:7]


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit for an axis whose largest value is ``largest`` bytes: ``("TiB", 2**40)`` from 1 TiB up,
    else ``("GiB", 2**30)``; one unit per axes (and per figure where the caller passes the figure's largest)."""
    return ("TiB", TIB) if largest >= TIB else ("GiB", GIB)


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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_break_even(frame: pd.DataFrame, layout: str, ax: Axes) -> None:
    """Load time of a prefix per tier path (coloured) against the compute it saves (black), seconds against
    prefix tokens, both log scale; a dot where loading starts to be faster."""
    part = frame[frame["kv_layout"] == layout]
    first = part[part["path"] == part["path"].iloc[0]]
    ax.plot(first["prefix_tokens"], first["recompute_s"], color="black", linewidth=2.5, label="recompute")
    for i, (path, g) in enumerate(part.groupby("path", sort=False)):
        calibrated = bool(g["calibrated"].iloc[0])
        color = PATH_STYLE[i % len(PATH_STYLE)]
        ax.plot(g["prefix_tokens"], g["load_s"], color=color, linestyle=style.LINESTYLES[1 + i % 3],
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_traffic(traffic: pd.DataFrame, trace: str, load: float, ax: Axes,
                 configurations: Sequence[str] | None = None, unit: tuple[str, float] | None = None) -> None:
    """Bytes per tier (written into it, read back) and per link and medium (moved both ways), grouped by
    configuration, at one load; in ``unit`` (name, bytes: default :func:`byte_unit` of the largest bar)."""
    part = traffic[(traffic["trace"] == trace) & (traffic["load"] == load)]
    configs = list(configurations) if configurations is not None else _configurations(part)
    part = part[part["configuration"].isin(configs)]
    series = list(dict.fromkeys(zip(part["kind"], part["name"], part["direction"], strict=True)))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(configs))
    unit_name, scale = unit if unit is not None else byte_unit(float(part["bytes"].max()) if len(part) else 0.0)
    for i, (kind, name, direction) in enumerate(series):
        g = part[(part["kind"] == kind) & (part["name"] == name) & (part["direction"] == direction)]
        amount = g.set_index("configuration")["bytes"].reindex(configs).fillna(0.0) / scale
        ax.bar(x + (i - (len(series) - 1) / 2) * width, amount, width, color=PATH_STYLE[i % len(PATH_STYLE)],
               hatch="//" if kind != "tier" else None, label=f"{kind} {name}: {direction}")
    ax.set_xticks(x, configs, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel(f"bytes ({unit_name})")
    ax.set_title(f"{trace}: bytes per tier, link and medium (load {load:g})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
