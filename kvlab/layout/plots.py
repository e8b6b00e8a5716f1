"""Figures of the layout study (kvlab.layout.study), drawn from its tidy tables on a given axes, units on every axis.

:func:`kvlab.plots.style.save` writes them as PNG and PDF with their data; colours from its palette; new
figures at a print width (:func:`kvlab.plots.style.figure`), legends right of the axes, never over bars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from kvlab.plots import style
from kvlab.workload.segments import SEGMENT_KINDS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_DASHES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (1, 1))]
SERIES_STYLE = [(style.PALETTE[i], _DASHES[i], style.MARKERS[i]) for i in range(len(_DASHES))]
"""Colour (kvlab.plots.style's palette), line style and marker of the n-th series: distinguishable in colour and
in grey print."""
KIND_COLORS = {kind: style.PALETTE[i] for kind, i in (("system", 0), ("tools", 4), ("document", 2), ("history", 1),
                                                      ("user", 5), ("volatile", 3), ("output", 7))}
CACHE_HATCH = ["", "//", "xx", ".."]


def plot_boundary(boundary: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Hit rate of the warm requests vs the position of the one volatile token, one step line per block size.

    Every block from the one holding the volatile token on is lost, so the rate is ``floor(p / B) * B`` over the
    prompt: a staircase whose steps are one block wide (drawn through the measured positions); the token-granular
    cache (B = 1) is the diagonal."""
    if ax is None:
        _, ax = style.figure("double", height=3.0)
    for i, (bs, part) in enumerate(boundary.groupby("block_size", sort=True)):
        color, ls, marker = SERIES_STYLE[i % len(SERIES_STYLE)]
        part = part.sort_values("position")
        ax.plot(part["position"], part["hit_rate"], color=color, ls=ls, lw=1.3, marker=marker, ms=2.5,
                label=f"block size {bs} token{'s' if bs > 1 else ''}")
    ax.set_xlabel("position of the volatile token in the prompt (tokens)")
    ax.set_ylabel("token hit rate of warm requests (fraction of prompt tokens)")
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title("A one-token change at position p loses every later block")
    return ax


def _layout_order(runs: pd.DataFrame, family: str) -> list[str]:
    return list(dict.fromkeys(runs.loc[runs["family"] == family, "layout"]))


def _cache_bars(runs: pd.DataFrame, family: str, ax: Axes | None) -> tuple[Axes, list[str], list[tuple], float]:
    """Horizontal grouped bars of ``family``: one group per layout (rows, in study order), one bar per cache size.
    Returns the axes (new if ``ax`` is None, sized for the bars), the layouts, per cache ``(j, cache, that cache's
    rows indexed by layout in layout order, the bars' y positions)`` and the bar height."""
    rows = runs[runs["family"] == family]
    layouts = _layout_order(runs, family)
    caches = list(dict.fromkeys(rows["cache"]))
    if ax is None:
        _, ax = style.figure("double", height=0.13 * len(layouts) * len(caches) + 1.0)
    h = 0.8 / len(caches)
    y = np.arange(len(layouts))
    bars = [(j, cache, rows[rows["cache"] == cache].set_index("layout").reindex(layouts), y - 0.4 + h * (j + 0.5))
            for j, cache in enumerate(caches)]
    return ax, layouts, bars, h


def plot_hit_rates(runs: pd.DataFrame, family: str, ax: Axes | None = None) -> Axes:
    """Token hit rate per layout of ``family`` (horizontal bars, one per cache size), with the non-prefix reuse
    bound drawn as an outlined extension: what position-independent reuse could at most add."""
    ax, layouts, bars, h = _cache_bars(runs, family, ax)
    for j, cache, part, pos in bars:
        color = SERIES_STYLE[j % len(SERIES_STYLE)][0]
        ax.barh(pos, part["token_hit_rate"], h, color=color, hatch=CACHE_HATCH[j % len(CACHE_HATCH)],
                edgecolor="white", label=f"hit rate, cache {cache}")
        ax.barh(pos, part["nonprefix_bound_rate"], h, left=part["token_hit_rate"], fill=False,
                edgecolor=color, lw=0.8, label=f"+ non-prefix bound, cache {cache}")
    ax.set_yticks(np.arange(len(layouts)), layouts, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("token hit rate (fraction of prompt tokens)")
    ax.set_ylabel("layout")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(f"{family}: hit rate per layout")
    return ax


def plot_ttft(runs: pd.DataFrame, family: str, ax: Axes | None = None) -> Axes:
    """Mean TTFT (bars, ms of simulated time) and p90 (markers) per layout of ``family``, one series per cache."""
    ax, layouts, bars, h = _cache_bars(runs, family, ax)
    for j, cache, part, pos in bars:
        color, _, marker = SERIES_STYLE[j % len(SERIES_STYLE)]
        ax.barh(pos, part["ttft_mean_s"] * 1e3, h, color=color, hatch=CACHE_HATCH[j % len(CACHE_HATCH)],
                edgecolor="white", label=f"mean, cache {cache}")
        ax.plot(part["ttft_p90_s"] * 1e3, pos, ls="none", marker=marker, color="k", ms=4,
                mfc=color, label=f"p90, cache {cache}")
    ax.set_yticks(np.arange(len(layouts)), layouts, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time to first token (ms, simulated)")
    ax.set_ylabel("layout")
    ax.set_xlim(0, None)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(f"{family}: TTFT per layout")
    return ax


def plot_first_miss(first_miss: pd.DataFrame, family: str, cache: str, ax: Axes | None = None, *,
                    what: str = "first_miss") -> Axes:
    """Stacked share of requests by the segment kind holding their first miss (``what="first_miss"``: the first
    recomputed token) or their break (``what="break"``: the first token no earlier request had), per layout."""
    rows = first_miss[(first_miss["family"] == family) & (first_miss["cache"] == cache)
                      & (first_miss["what"] == what)]
    layouts = list(dict.fromkeys(rows["layout"]))
    table = rows.pivot_table(index="layout", columns="kind", values="share", aggfunc="sum", observed=False)
    table = table.reindex(index=layouts, columns=list(SEGMENT_KINDS)).fillna(0.0)
    if ax is None:
        _, ax = style.figure("double", height=0.16 * len(layouts) + 1.2)
    left = np.zeros(len(layouts))
    y = np.arange(len(layouts))
    for kind in SEGMENT_KINDS:
        share = table[kind].to_numpy()
        if share.any():
            ax.barh(y, share, 0.75, left=left, color=KIND_COLORS[kind], label=kind)
            left += share
    ax.set_yticks(y, layouts, fontsize=7)
    ax.invert_yaxis()
    where = "first missed token" if what == "first_miss" else "first new token"
    ax.set_xlabel(f"share of requests (fraction) by the segment of their {where}")
    ax.set_ylabel("layout")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(f"{family}: where the prompt breaks" if what == "break" else
                 f"{family}, cache {cache}: where the first miss falls")
    return ax


def plot_gaps(gaps: pd.DataFrame, cache: str, axes: tuple[Axes, Axes] | None = None) -> tuple[Axes, Axes]:
    """Per family, the best and worst layout's token hit rate (left) and mean TTFT (right, ms) at ``cache``."""
    rows = gaps[gaps["cache"] == cache]
    if axes is None:
        _, axes = style.figure("double", 1, 2, height=0.3 * len(rows) + 1.6)
    y = np.arange(len(rows))
    for ax, best, worst, scale, unit in ((axes[0], "best_hit_rate", "worst_hit_rate", 1.0,
                                          "token hit rate (fraction of prompt tokens)"),
                                         (axes[1], "best_ttft_mean_s", "worst_ttft_mean_s", 1e3,
                                          "mean time to first token (ms, simulated)")):
        b, w = rows[best].to_numpy() * scale, rows[worst].to_numpy() * scale
        ax.hlines(y, np.minimum(b, w), np.maximum(b, w), color="grey", lw=2)
        ax.plot(b, y, "o", color=SERIES_STYLE[2][0], ms=6, label="best layout")
        ax.plot(w, y, "X", color=SERIES_STYLE[3][0], ms=6, label="worst layout")
        ax.set_yticks(y, rows["family"])
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_xlim(0, None)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_ylabel("workload family")
    axes[0].set_title(f"best vs worst layout, cache {cache}")
    axes[0].figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=7)
    return axes


def workload_data(runs: pd.DataFrame, requests: pd.DataFrame, family: str) -> pd.DataFrame:
    """What :func:`plot_workload` draws, one row per layout at the study's first cache size: ``layout``, ``cache``,
    ``token_hit_rate`` (fraction), ``ttft_mean_s`` and ``ttft_p50_s`` (seconds, simulated), ``first_miss`` (the
    segment kind holding most requests' first miss; ``none`` when every prompt token was a hit) and its share."""
    rows = runs[runs["family"] == family]
    cache = rows["cache"].iloc[0]
    rows = rows[rows["cache"] == cache]
    req = requests[(requests["family"] == family) & (requests["cache"] == cache)]
    out = []
    for r in rows.itertuples(index=False):
        kinds = req.loc[req["layout"] == r.layout, "first_miss"].astype(object)
        counts = kinds.where(kinds.notna(), "none").value_counts()
        top = sorted(counts.items(), key=lambda kc: (-kc[1], str(kc[0])))[0] if len(counts) else ("none", 0)
        out.append({"layout": r.layout, "cache": cache, "token_hit_rate": r.token_hit_rate,
                    "ttft_mean_s": r.ttft_mean_s, "ttft_p50_s": r.ttft_p50_s, "first_miss": str(top[0]),
                    "first_miss_share": top[1] / max(len(kinds), 1)})
    return pd.DataFrame(out)


def plot_workload(data: pd.DataFrame, title: str) -> Figure:
    """A column-wide figure of one workload's layouts (:func:`workload_data`): token hit rate (top; each bar
    coloured by the segment kind holding most first misses) and TTFT (bottom: mean as bars, p50 as markers, ms of
    simulated time)."""
    n = len(data)
    fig, (top, bottom) = style.figure("column", 2, 1, height=0.36 * n * 2 + 1.5)
    y = np.arange(n)
    colors = [KIND_COLORS.get(k, style.REST_COLOR) for k in data["first_miss"]]
    top.barh(y, data["token_hit_rate"], 0.7, color=colors)
    top.set_xlim(0, 1)
    top.set_xlabel("token hit rate (fraction of prompt tokens)")
    top.set_title(title)
    bottom.barh(y, data["ttft_mean_s"] * 1e3, 0.7, color=style.PALETTE[6], label="mean")
    bottom.plot(data["ttft_p50_s"] * 1e3, y, ls="none", marker="o", color="k", ms=3.5, label="p50")
    bottom.set_xlim(0, None)
    bottom.set_xlabel("time to first token (ms, simulated)")
    for ax in (top, bottom):
        ax.set_yticks(y, data["layout"])
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    from matplotlib.patches import Patch

    kinds = list(dict.fromkeys(data["first_miss"]))
    handles = [Patch(color=KIND_COLORS.get(k, style.REST_COLOR), label=f"first miss: {k}") for k in kinds]
    handles += bottom.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=7)
    return fig
