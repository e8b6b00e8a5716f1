"""Hit rate against cache capacity, one line per policy (or any other column)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes


def plot_hit_rate_vs_capacity(
    table: pd.DataFrame,
    *,
    metric: str = "token_hit_rate",
    hue: str = "policy",
    ax: Axes | None = None,
    ideal: bool = True,
    title: str | None = None,
) -> Axes:
    """Plot ``metric`` against ``capacity_blocks`` from a sweep table (``kvlab.sweep.run_sweep``).

    With ``ideal``, the unbounded-capacity hit rate is drawn as a dashed line. Runs that rejected
    requests (a prompt larger than the cache: never served, its tokens counted as misses) are circled in
    red and labelled with the number rejected, so a low point is never mistaken for a policy effect.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.6))
    rejected_label = "rejected requests (prompt > cache)"
    for name, group in table.sort_values("capacity_blocks").groupby(hue, sort=True):
        ax.plot(group["capacity_blocks"], group[metric], marker="o", label=str(name))
        if "rejected_requests" in group:
            bad = group[group["rejected_requests"] > 0]
            if len(bad):
                ax.scatter(bad["capacity_blocks"], bad[metric], s=110, facecolors="none", edgecolors="red",
                           linewidths=1.5, zorder=3, label=rejected_label)
                rejected_label = "_nolegend_"
                for x, y, k in zip(bad["capacity_blocks"], bad[metric], bad["rejected_requests"], strict=True):
                    ax.annotate(f"{int(k):,} rejected", (x, y), textcoords="offset points", xytext=(4, -12),
                                fontsize=7, color="red")
    if ideal and "ideal_hit_rate" in table:
        ax.axhline(table["ideal_hit_rate"].max(), ls="--", c="grey", lw=1, label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    label = metric.replace("_", " ")
    ax.set_ylabel(f"{label} (fraction)" if metric.endswith("rate") else label)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax
