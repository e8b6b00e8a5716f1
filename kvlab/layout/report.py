"""The layout study's numbers as text: the headline per family and the tables the notebook and the issue quote.

Every sentence is generated from the result tables, so what a notebook prints agrees with its figures.
"""

from __future__ import annotations

import pandas as pd

from kvlab.layout.study import LayoutStudyResult
from kvlab.studies.tiers import markdown_table
from kvlab.workload.segments import SEGMENT_KINDS


def headline_markdown(result: LayoutStudyResult) -> str:
    """One bullet per family and cache size: best and worst layout by token hit rate and by mean TTFT."""
    lines = []
    for g in result.gaps.itertuples(index=False):
        lines.append(
            f"* **{g.family}**, cache {g.cache}: token hit rate **{g.best_hit_rate:.3f}** ({g.best_hit_layout}) vs "
            f"**{g.worst_hit_rate:.3f}** ({g.worst_hit_layout}), a gap of **{g.hit_gap:.3f}**; mean TTFT "
            f"**{g.best_ttft_mean_s * 1e3:.1f} ms** ({g.best_ttft_layout}) vs **{g.worst_ttft_mean_s * 1e3:.1f} ms** "
            f"({g.worst_ttft_layout}), {g.ttft_ratio:.2f}x.")
    return "\n".join(lines)


def layout_table(result: LayoutStudyResult, cache: str) -> pd.DataFrame:
    """Per family and layout at ``cache``: hit rate, reused tokens, non-prefix bound, TTFT mean / p90 (ms)."""
    r = result.runs[result.runs["cache"] == cache]
    return pd.DataFrame({
        "family": r["family"], "layout": r["layout"], "hit rate": r["token_hit_rate"],
        "reused tokens": r["reused_tokens"], "prompt tokens": r["prompt_tokens"],
        "non-prefix bound": r["nonprefix_bound_rate"], "TTFT mean ms": r["ttft_mean_s"] * 1e3,
        "TTFT p90 ms": r["ttft_p90_s"] * 1e3}).reset_index(drop=True)


def first_miss_table(result: LayoutStudyResult, cache: str, what: str = "first_miss") -> pd.DataFrame:
    """Per family and layout at ``cache``: the share of requests whose first miss (``what="first_miss"``) or break
    (``what="break"``) falls in each segment kind (columns: kinds that occur)."""
    f = result.first_miss[(result.first_miss["cache"] == cache) & (result.first_miss["what"] == what)]
    order = list(dict.fromkeys(zip(f["family"], f["layout"], strict=True)))
    table = f.pivot_table(index=["family", "layout"], columns="kind", values="share", aggfunc="sum", observed=True)
    table = table.reindex(index=order, columns=[k for k in SEGMENT_KINDS if k in table.columns])
    table = table.loc[:, (table.fillna(0) > 0).any()]
    return table.fillna(0.0).reset_index()


def nonprefix_markdown(result: LayoutStudyResult, cache: str) -> str:
    """Per family at ``cache``: the largest non-prefix reuse bound among its layouts and its layout."""
    r = result.runs[result.runs["cache"] == cache]
    lines = []
    for family, part in r.groupby("family", sort=False):
        top = part.loc[part["nonprefix_bound_rate"].idxmax()]
        base = part[part["layout"] == "as_generated"]
        base_txt = (f"; as generated {float(base['nonprefix_bound_rate'].iloc[0]):.3f} on top of its hit rate "
                    f"{float(base['token_hit_rate'].iloc[0]):.3f}") if len(base) else ""
        lines.append(f"* **{family}**: at most **{top['nonprefix_bound_rate']:.3f}** of the prompt tokens "
                     f"({top['layout']}, hit rate {top['token_hit_rate']:.3f}){base_txt}.")
    return "\n".join(lines)


def boundary_markdown(boundary: pd.DataFrame) -> str:
    """What the boundary sweep shows, in numbers: exactness and the mean hit rate per block size."""
    exact = bool((boundary["hit_tokens"] == boundary["kept_tokens"]).all())
    means = boundary.groupby("block_size")["hit_rate"].mean()
    prompt = boundary["prompt_tokens"].mean()
    parts = ", ".join(f"B = {int(b)}: {v:.3f}" for b, v in means.items())
    return (f"{boundary['position'].nunique()} positions x {len(means)} block sizes on a {prompt:,.0f}-token prompt; "
            f"hit tokens = floor(p / B) x B at every point: **{exact}**. Mean hit rate over the positions: {parts} "
            f"(a cache loses on average about B / 2 tokens per request to block granularity).")


def first_miss_counts(requests: pd.DataFrame, limit: int = 3) -> str:
    """The segment kinds holding requests' first miss, most requests first (at most ``limit`` kinds, then ``other``),
    as ``"volatile 29/30, user 1/30"``; requests with no miss count as ``none``."""
    kinds = requests["first_miss"].astype(object).where(requests["first_miss"].notna(), "none")
    counts = kinds.value_counts(sort=False)
    counts = counts.iloc[sorted(range(len(counts)), key=lambda i: (-counts.iloc[i], str(counts.index[i])))]
    n = len(requests)
    shown = [f"{k} {c}/{n}" for k, c in counts.iloc[:limit].items()]
    if len(counts) > limit:
        shown.append(f"other {int(counts.iloc[limit:].sum())}/{n}")
    return ", ".join(shown)


def layout_lines(result: LayoutStudyResult, family: str) -> list[str]:
    """One line per layout (and cache size, named when the study has more than one) of ``family``: token hit
    rate, mean and p50 TTFT (ms of simulated time) and the segment kinds holding the first misses."""
    runs = result.runs[result.runs["family"] == family]
    req = result.requests[result.requests["family"] == family]
    several = runs["cache"].nunique() > 1
    width = max(len(str(v)) for v in runs["layout"])
    lines = []
    for r in runs.itertuples(index=False):
        part = req[(req["layout"] == r.layout) & (req["cache"] == r.cache)]
        cache = f" cache {r.cache}" if several else ""
        lines.append(f"{r.layout:<{width}}{cache}  hit rate {r.token_hit_rate:.3f}  TTFT mean "
                     f"{r.ttft_mean_s * 1e3:.1f} ms  p50 {r.ttft_p50_s * 1e3:.1f} ms  first miss: "
                     f"{first_miss_counts(part)}")
    return lines


def layout_finding(result: LayoutStudyResult, family: str) -> str:
    """The figure's one-line caption finding for ``family`` (numbers from the runs table): the best and worst
    layout by hit rate, with their mean TTFT, at the first cache size."""
    runs = result.runs[result.runs["family"] == family]
    runs = runs[runs["cache"] == runs["cache"].iloc[0]]
    best, worst = runs.loc[runs["token_hit_rate"].idxmax()], runs.loc[runs["token_hit_rate"].idxmin()]
    n = int(runs["requests"].iloc[0])
    if best["layout"] == worst["layout"] or best["token_hit_rate"] == worst["token_hit_rate"]:
        return (f"{n} requests: every layout reuses the same share of prompt tokens "
                f"({best['token_hit_rate']:.3f}); mean TTFT {best['ttft_mean_s'] * 1e3:.1f} ms (simulated).")
    return (f"{n} requests: {best['layout']} reuses {best['token_hit_rate']:.3f} of the prompt tokens, "
            f"{worst['layout']} {worst['token_hit_rate']:.3f}; mean TTFT {best['ttft_mean_s'] * 1e3:.1f} ms vs "
            f"{worst['ttft_mean_s'] * 1e3:.1f} ms (simulated, {result.config.model} on {result.config.hardware}, "
            f"cache {runs['cache'].iloc[0]}).")


__all__ = ["boundary_markdown", "first_miss_counts", "first_miss_table", "headline_markdown", "layout_finding",
           "layout_lines", "layout_table", "markdown_table", "nonprefix_markdown"]
