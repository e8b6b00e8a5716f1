"""Statistics over per-request results (docs/statistics.md): warm-up exclusion, confidence intervals that
respect cache state (batch means, session resampling, paired A − B), breakdowns and SLO attainment; over the
runs of an experiment (:mod:`kvlab.analysis.runs`)."""

from kvlab.analysis.breakdowns import (
    breakdown,
    category_breakdown,
    slo_attainment,
    slo_met,
    tenant_breakdown,
    turn_breakdown,
)
from kvlab.analysis.intervals import Interval, batch_means, lag1_autocorrelation, paired_batch_means, window_values
from kvlab.analysis.resample import (
    paired_session_resample,
    prefix_groups,
    resample_sessions,
    session_groups,
    session_resample,
)
from kvlab.analysis.runs import AnalysisSpec, paired, replicate_intervals, run_intervals
from kvlab.analysis.tdist import t_quantile
from kvlab.analysis.warmup import after_warmup, warmup_mask
from kvlab.metrics import LATENCY_STATS, latency_stats  # defined on the base floor: the drivers use it too

__all__ = [
    "LATENCY_STATS", "AnalysisSpec", "Interval", "after_warmup", "batch_means", "breakdown", "category_breakdown",
    "lag1_autocorrelation", "latency_stats", "paired", "paired_batch_means", "paired_session_resample",
    "prefix_groups", "replicate_intervals", "resample_sessions", "run_intervals", "session_groups",
    "session_resample", "slo_attainment", "slo_met", "t_quantile", "tenant_breakdown", "turn_breakdown",
    "warmup_mask", "window_values",
]
