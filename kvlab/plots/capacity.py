"""Hit rate against cache capacity, one line per policy (or any other column), with confidence bands.

:func:`estimate_columns` picks what a table offers for a metric: replicate intervals
(``<metric>_rep_mean``, ``_rep_low``, ``_rep_high``: :func:`kvlab.analysis.runs.replicate_intervals`), else
batch-means intervals (``<metric>_warmed``, ``_ci_low``, ``_ci_high``: :func:`kvlab.analysis.runs.run_intervals`),
else the plain column (no band). :func:`draw_series` draws one styled line per group with its band.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes

from kvlab.plots import style


def estimate_columns(table: pd.DataFrame, metric: str) -> tuple[str, str | None, str | None]:
    """``(estimate, low, high)`` column names for ``metric`` in ``table`` (``low``/``high`` None: no band)."""
    for est, low, high in ((f"{metric}_rep_mean", f"{metric}_rep_low", f"{metric}_rep_high"),
                           (f"{metric}_warmed", f"{metric}_ci_low", f"{metric}_ci_high")):
        if est in table and low in table and high in table:
            return est, low, high
    if metric not in table:
        raise KeyError(f"the table has no column {metric!r} (nor {metric}_warmed / {metric}_rep_mean)")
    return metric, None, None


def series_data(table: pd.DataFrame, x: str, metric: str, hue: str) -> pd.DataFrame:
    """The tidy data of :func:`draw_series`: ``hue``, ``x``, ``metric`` (its name), ``estimate``, ``low``,
    ``high`` (NaN without a band), sorted by ``hue`` then ``x``."""
    est, low, high = estimate_columns(table, metric)
    nan = float("nan")
    out = pd.DataFrame({hue: table[hue], x: table[x], "metric": metric, "estimate": table[est],
                        "low": table[low] if low else nan, "high": table[high] if high else nan})
    return out.sort_values([hue, x], kind="stable").reset_index(drop=True)


#: hue columns whose values are policies: drawn with :func:`style.policy_style` (the same look everywhere)
POLICY_HUES = ("policy", "cache.policy")


def hue_style(hue: str, name: object, i: int) -> dict:
    """The look of series ``name`` (the ``i``-th value of ``hue``): :func:`style.policy_style` for a policy
    column, else :func:`style.series_style`."""
    return style.policy_style(str(name)) if hue in POLICY_HUES else style.series_style(i)


def draw_series(ax: Axes, table: pd.DataFrame, x: str, metric: str, hue: str, *, bands: bool = True,
                start: int = 0, **line: object) -> pd.DataFrame:
    """One line of ``metric`` against ``x`` per value of ``hue`` (sorted; a policy's own style, else
    :func:`style.series_style` from ``start``, overridden by ``line``), with its confidence band when the table
    has one. At most :data:`style.MAX_SERIES` styled lines: with more values, the ``MAX_SERIES - 1`` with the
    highest mean estimate are drawn, the rest thin and grey under one legend entry (the data keeps every
    series). Returns :func:`series_data`."""
    data = series_data(table, x, metric, hue)
    groups = list(data.groupby(hue, sort=True))
    top = {name for name, _ in groups}
    if len(groups) > style.MAX_SERIES:
        means = sorted(((g["estimate"].mean(), str(n)) for n, g in groups), reverse=True)
        top = {n for _, n in means[:style.MAX_SERIES - 1]}
    rest = 0
    for i, (name, group) in enumerate(groups):
        if str(name) not in {str(t) for t in top}:
            ax.plot(group[x], group["estimate"], color=style.REST_COLOR, linewidth=0.8, zorder=1,
                    label=f"other {len(groups) - len(top)}" if not rest else "_nolegend_")
            rest += 1
            continue
        st = {**hue_style(hue, name, start + i), **line}
        ax.plot(group[x], group["estimate"], label=str(name), **st)
        if bands and group["low"].notna().any():
            style.band(ax, group[x], group["low"], group["high"], st["color"])
    return data


def legend_below(ax: Axes) -> object:
    """The axes' legend below the figure's panels (outside the data), in as many columns (3 at most) as fit the
    figure's width, so long labels never widen a column figure past its print width; None when nothing is
    labelled."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    if not isinstance(ax.figure.get_layout_engine(), ConstrainedLayoutEngine):  # "outside" needs it
        return style.legend(ax, outside=True)
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(3, len(handles)), 0, -1):  # the most columns whose row fits the figure's print width
        leg = fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False)
        if ncol == 1 or leg.get_window_extent(renderer).width <= fig.bbox.width:
            return leg
        leg.remove()
    return None  # not reached: one column is always kept


def plot_hit_rate_vs_capacity(
    table: pd.DataFrame,
    *,
    metric: str = "token_hit_rate",
    hue: str = "policy",
    ax: Axes | None = None,
    ideal: bool = True,
    title: str | None = None,
    x: str = "capacity_blocks",
    bands: bool = True,
    xlabel: str | None = None,
) -> Axes:
    """Plot ``metric`` (a fraction) against ``x`` (capacity in blocks, log scale) from a sweep or experiment
    table, one line per ``hue`` value, with a confidence band where the table has intervals
    (:func:`estimate_columns`; ``bands=False`` hides them).

    With ``ideal``, the unbounded-capacity hit rate is drawn as a baseline. Runs that rejected requests (a
    prompt larger than the cache: never served, its tokens counted as misses) are circled in red and labelled
    with the number rejected, so a low point is never mistaken for a policy effect. The y axis starts at 0 and
    ends a little above the highest value (at most 1); x ticks at the capacities drawn (up to 6); the legend
    below the axes, outside the curves. ``xlabel``: the x axis' label (default capacity in blocks; e.g. GiB
    of KV when ``x`` is a GiB column). Styles: :func:`draw_series` (a policy keeps its look everywhere).
    """
    if ax is None:
        _, ax = style.figure("column")
    est, _, _ = estimate_columns(table, metric)
    drawn = draw_series(ax, table, x, metric, hue, bands=bands)
    rejected_label = "rejected requests (prompt > cache)"
    if "rejected_requests" in table:
        bad = table[table["rejected_requests"] > 0]
        if len(bad):
            ax.scatter(bad[x], bad[est], s=110, facecolors="none", edgecolors=style.ALERT, linewidths=1.5,
                       zorder=3, label=rejected_label)
            for xv, group in bad.groupby(x, sort=True):  # one label per capacity (the most rejected there)
                ax.annotate(f"{int(group['rejected_requests'].max()):,} rejected", (xv, group[est].min()),
                            textcoords="offset points", xytext=(4, -12), fontsize=7, color=style.ALERT)
    if ideal and "ideal_hit_rate" in table:
        ax.axhline(table["ideal_hit_rate"].max(), label="infinite cache", **style.baseline_style("infinite cache"))
    ax.set_xscale("log")
    style.value_ticks(ax, table[x], most=6)
    ax.set_xlabel(xlabel or "capacity (blocks, log scale)")
    label = metric.replace("_", " ")
    ax.set_ylabel(f"{label} (fraction)" if metric.endswith("rate") else label)
    top = max(drawn["estimate"].max(), drawn["high"].max() if drawn["high"].notna().any() else 0.0,
              table["ideal_hit_rate"].max() if ideal and "ideal_hit_rate" in table else 0.0)
    ax.set_ylim(0, min(1.0, 1.15 * top) if top > 0 else 1.0)  # a fraction: from 0, headroom for the legend
    ax.grid(alpha=0.3)
    legend_below(ax)
    if title:
        style.set_title(ax, title)
    return ax
