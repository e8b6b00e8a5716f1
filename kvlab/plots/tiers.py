"""Figures of the tiered-storage study (kvlab.studies.tiers): per-tier hit shares, capacity sweeps, write traffic.

Every function draws from the study's tidy tables (``runs``: one row per replay; ``tiers``: one row per replay
and tier) on a given axes, with units on both axes; :func:`save_figure` (an alias of :func:`kvlab.plots.style.save`)
writes PNG and PDF. :func:`plot_tier_breakdown` draws any experiment table with tiers (``<tier>_hit_share``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from kvlab.plots import style
from kvlab.units import TIB

LEVEL_COLORS = style.TIER_COLORS
LEVEL_LABELS = {"device": "device (HBM)", "dram": "host DRAM", "ssd": "NVMe SSD", "pool": "shared pool"}
WRITE_STYLE = {"write_through": (style.PALETTE[3], "o"), "write_back": (style.PALETTE[0], "s")}


def save_figure(fig: Figure, folder: str | Path, name: str, dpi: int = style.DPI) -> list[Path]:
    """Write ``fig`` as ``folder/name.png`` (``dpi``) and ``folder/name.pdf``, atomically; returns the paths
    (:func:`kvlab.plots.style.save` without data or caption)."""
    return style.save(fig, folder, name, dpi=dpi)


def _gib_axis(ax: Axes, what: str) -> None:
    """A log2 capacity x axis whose ticks read in GiB / TiB (2**30 / 2**40 bytes of KV)."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g} TiB" if v >= 1024 else f"{v:g} GiB"))
    ax.set_xlabel(f"{what} capacity (bytes of KV, log scale)")


def _group_label(row: pd.Series) -> str:
    return "1 node" if row["nodes"] == 1 else f"{row['nodes']} nodes, {str(row['router']).replace('_', ' ')} routing"


def plot_tier_shares(runs: pd.DataFrame, trace: str, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Stacked bars of the token hit rate of each ``scenarios`` replay of ``trace``, split by the tier that
    served the hit; bars grouped by cluster (1 node; N nodes per router). Dashed: the ideal hit rate (one
    unbounded cache); dotted per group: unbounded caches private to each node (the most private tiers give)."""
    if ax is None:
        _, ax = style.figure("double")
    sc = runs[(runs["section"] == "scenarios") & (runs["trace"] == trace)].reset_index(drop=True)
    groups = sc.apply(_group_label, axis=1)
    x, pos, centers = 0.0, [], {}
    for i, g in enumerate(groups):
        if i and g != groups[i - 1]:
            x += 0.8
        pos.append(x)
        centers.setdefault(g, []).append(x)
        x += 1
    bottom = np.zeros(len(sc))
    for level, color in LEVEL_COLORS.items():
        share = sc[f"share_{level}"].to_numpy()
        ax.bar(pos, share, 0.8, bottom=bottom, color=color, label=LEVEL_LABELS[level])
        bottom += share
    for p, total in zip(pos, bottom, strict=True):
        ax.text(p, total + 0.01, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(sc["ideal_hit_rate"].max(), ls="--", c="grey", lw=1, label="ideal (one unbounded cache)")
    first = True
    for g, xs in centers.items():
        private = sc.loc[groups == g, "node_ideal_hit_rate"].iloc[0]
        ax.hlines(private, xs[0] - 0.45, xs[-1] + 0.45, colors="k", linestyles=":", lw=1.2,
                  label="unbounded private caches per node" if first else "_nolegend_")
        first = False
        ax.text(np.mean(xs), 1.01, g, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(pos, sc["scenario"], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("token hit rate (fraction of prompt tokens)")
    ax.set_ylim(0, max(bottom.max(), sc["ideal_hit_rate"].max()) * 1.15)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(title or trace, pad=12)
    return ax


def plot_capacity_sweep(runs: pd.DataFrame, tiers: pd.DataFrame, trace: str, *, section: str = "dram_sweep",
                        tier: str = "dram", target: float | None = 0.95, footprint_gib: float | None = None,
                        ax: Axes | None = None, title: str | None = None) -> Axes:
    """Token hit rate against the capacity of ``tier`` (GiB of KV, log scale), one line per write policy.
    Filled markers: the tier filled up (it evicted: its size binds); hollow: it never filled (any larger size
    gives the same numbers). Dashed: the ideal hit rate; dotted: ``target`` × ideal; grey vertical: the
    workload's distinct KV (``footprint_gib``)."""
    if ax is None:
        _, ax = style.figure("column")
    col = f"{tier}_gib"
    rows = runs[(runs["section"] == section) & (runs["trace"] == trace)]
    full = tiers[(tiers["section"] == section) & (tiers["trace"] == trace) & (tiers["tier"] == tier)]
    for write, part in rows.groupby("write", sort=False):
        part = part.sort_values(col)
        color, marker = WRITE_STYLE.get(write, ("k", "o"))
        ax.plot(part[col], part["token_hit_rate"], color=color, marker=marker, ms=0, label=write.replace("_", "-"))
        filled = full[full["write"] == write].set_index(col)["ever_full"].reindex(part[col]).fillna(False)
        for cap, rate, is_full in zip(part[col], part["token_hit_rate"], filled.to_numpy(), strict=True):
            ax.plot(cap, rate, marker=marker, color=color, mfc=color if is_full else "white", ms=6)
    ideal = float(rows["ideal_hit_rate"].max())
    ax.axhline(ideal, ls="--", c="grey", lw=1, label=f"ideal {ideal:.3f}")
    if target is not None:
        ax.axhline(target * ideal, ls=":", c="k", lw=1, label=f"{target:.0%} of ideal")
    if footprint_gib:
        ax.axvline(footprint_gib, c="grey", lw=4, alpha=0.3, label=f"distinct KV {footprint_gib:,.0f} GiB")
    _gib_axis(ax, f"{tier.upper()} tier")
    ax.set_ylabel("token hit rate (fraction of prompt tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(title or trace)
    return ax


def plot_tier_metric_sweep(tiers: pd.DataFrame, trace: str, *, metric: str = "bytes_written",
                           section: str = "dram_sweep", tier: str = "dram", ylabel: str | None = None,
                           scale: float = TIB, ax: Axes | None = None, title: str | None = None) -> Axes:
    """``metric`` / ``scale`` of ``tier`` against its capacity (GiB of KV, log scale), one line per write
    policy (default: bytes written, in TiB)."""
    if ax is None:
        _, ax = style.figure("column")
    col = f"{tier}_gib"
    rows = tiers[(tiers["section"] == section) & (tiers["trace"] == trace) & (tiers["tier"] == tier)]
    for write, part in rows.groupby("write", sort=False):
        part = part.sort_values(col)
        color, marker = WRITE_STYLE.get(write, ("k", "o"))
        ax.plot(part[col], part[metric].astype(float) / scale, color=color, marker=marker,
                label=write.replace("_", "-"))
    _gib_axis(ax, f"{tier.upper()} tier")
    ax.set_ylabel(ylabel or (f"{tier.upper()} bytes written (TiB)" if metric == "bytes_written" else metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title(title or trace)
    return ax


def plot_write_policies(tiers: pd.DataFrame, trace: str, axes: Sequence[Axes]) -> Sequence[Axes]:
    """The ``write_policy`` replays of ``trace`` on three axes, bars per tier and write policy: TiB written,
    write amplification (bytes written / bytes read) and the share of stored blocks never loaded."""
    rows = tiers[(tiers["section"] == "write_policy") & (tiers["trace"] == trace)]
    metrics = [("bytes_written", 1 / TIB, "bytes written (TiB)"),
               ("write_amplification", 1.0, "write amplification\n(written / read)"),
               ("never_loaded_share", 1.0, "stored blocks never\nloaded (fraction)")]
    names = list(dict.fromkeys(rows["tier"]))
    writes = list(dict.fromkeys(rows["write"]))
    width = 0.8 / max(len(writes), 1)
    for ax, (metric, factor, label) in zip(axes, metrics, strict=True):
        for j, write in enumerate(writes):
            part = rows[rows["write"] == write].set_index("tier").reindex(names)
            values = part[metric].astype(float).to_numpy() * factor
            xs = np.arange(len(names)) + (j - (len(writes) - 1) / 2) * width
            ax.bar(xs, np.nan_to_num(values), width, color=WRITE_STYLE.get(write, ("k", "o"))[0],
                   label=write.replace("_", "-"))
            for xv, v in zip(xs, values, strict=True):
                ax.text(xv, 0 if np.isnan(v) else v, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(names)), [LEVEL_LABELS.get(n, n).replace(" ", "\n", 1) for n in names])
        ax.set_ylabel(label, fontsize=7)
        ax.set_xlabel("tier")
        ax.grid(alpha=0.3, axis="y")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes[0].set_title(trace, fontsize=8, loc="left")
    return axes


def plot_tier_breakdown(table: pd.DataFrame, *, label: str | Sequence[str] | None = None, ax: Axes | None = None,
                        title: str | None = None) -> tuple[Axes, pd.DataFrame]:
    """Stacked bars, one per run (row of an experiment or sweep table): the share of prompt tokens served from
    the device (``device_token_hit_rate``; ``token_hit_rate`` without tiers) and from each lower tier
    (``<tier>_hit_share``, in the table's tier order); a bar's height is the run's token hit rate (fraction).
    ``label``: the column(s) naming a bar (default: the config columns that differ between rows). Returns the
    axes and the data drawn (``run``, ``tier``, ``share``)."""
    from kvlab.results.runs import varying_columns

    if ax is None:
        _, ax = style.figure("column")
    rows = table.reset_index(drop=True)
    tiers = [c[: -len("_hit_share")] for c in rows.columns if c.endswith("_hit_share")]
    device = "device_token_hit_rate" if "device_token_hit_rate" in rows else "token_hit_rate"
    if label is None:
        label = varying_columns(rows)
    cols = [label] if isinstance(label, str) else list(label)
    names = (rows[cols].astype(str).agg(", ".join, axis=1) if cols else rows.index.astype(str)).tolist()
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    frames = []
    for i, (tier, col) in enumerate([("device", device)] + [(t, f"{t}_hit_share") for t in tiers]):
        share = rows[col].astype(float).fillna(0.0).to_numpy()
        ax.bar(x, share, 0.8, bottom=bottom, color=style.tier_color(tier, i), label=LEVEL_LABELS.get(tier, tier))
        frames.append(pd.DataFrame({"run": names, "tier": tier, "share": share}))
        bottom += share
    for xv, total in zip(x, bottom, strict=True):
        ax.text(xv, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, names, rotation=30 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center",
                  fontsize=7)
    ax.set_ylabel("token hit rate by tier (fraction of prompt tokens)")
    ax.set_ylim(0, max(float(bottom.max()) * 1.3, 1e-9))
    ax.grid(alpha=0.3, axis="y")
    style.legend(ax, loc="upper left", ncol=max(1, len(tiers) + 1))
    if title:
        style.set_title(ax, title)
    return ax, pd.concat(frames, ignore_index=True)
