"""Figures regenerated from results frames (never edited by hand); one style (:mod:`kvlab.plots.style`),
docs/plots.md."""

from kvlab.plots.capacity import plot_hit_rate_vs_capacity
from kvlab.plots.figures import figure_from_experiment
from kvlab.plots.serving import plot_memory_timeline, plot_ttft_cdf, plot_ttft_vs_load
from kvlab.plots.tiers import plot_tier_breakdown

__all__ = ["figure_from_experiment", "plot_hit_rate_vs_capacity", "plot_memory_timeline", "plot_tier_breakdown",
           "plot_ttft_cdf", "plot_ttft_vs_load"]
