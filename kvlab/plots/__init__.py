"""Figures regenerated from results frames (never edited by hand)."""

from kvlab.plots.capacity import plot_hit_rate_vs_capacity

__all__ = ["plot_hit_rate_vs_capacity"]
