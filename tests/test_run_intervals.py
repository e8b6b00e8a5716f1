"""kvlab.analysis.runs: warm-up, batch-means intervals per run of an experiment, intervals over replicate runs
and paired A − B comparisons, on constructed runs (exact values) and on a real replay experiment (the first
2,000 requests of Mooncake conversation, LRU and ARC at two capacities)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from kvlab.analysis import batch_means, t_quantile
from kvlab.analysis.runs import AnalysisSpec, paired, replicate_intervals, run_intervals
from kvlab.errors import ConfigError
from kvlab.experiment import run_experiment
from kvlab.experiment.config import Experiment
from kvlab.metrics import INTERVAL_COLUMNS, table_name
from kvlab.results import build_manifest, write_results

CAPACITIES = (300, 1200)


@pytest.fixture(scope="module")
def experiment(shared_file, tmp_path_factory):
    """``(table, results root)``: LRU and ARC at two capacities on 2,000 Mooncake conversation requests."""
    root = tmp_path_factory.mktemp("results")
    exp = Experiment(name="mini", trace={"path": str(shared_file("mooncake/conversation_trace.jsonl")),
                                         "limit": 2000},
                     cache={"capacity_blocks": 1000, "policy": "lru"},
                     sweep={"grid": {"cache.policy": ["lru", "arc"], "cache.capacity_blocks": list(CAPACITIES)}})
    return run_experiment(exp, root, progress=False), root


def constructed_run(folder, rid: str, hit: np.ndarray, prompt: int = 100) -> None:
    """A run whose request i has ``prompt`` prompt tokens and ``hit[i]`` hit tokens (one block per token)."""
    n = len(hit)
    requests = pd.DataFrame({"request_id": np.arange(n), "arrival": np.arange(n, dtype=float),
                             "prompt_tokens": np.full(n, prompt), "hit_tokens": hit, "full_blocks": np.full(n, prompt),
                             "hit_blocks": hit, "evictions": np.zeros(n, int)})
    write_results(folder / "runs" / rid, {"requests": requests}, {}, build_manifest({}, driver="replay"))


def test_warmup_changes_the_point_estimate_as_constructed(tmp_path):
    """The first 100 requests hit nothing, the rest hit half their prompt: warm-up 100 requests gives exactly
    0.5, no warm-up 900 / 2000 · ... = 0.45, and warm-up by seconds (arrival = row) the same as by requests."""
    hit = np.r_[np.zeros(100, int), np.full(900, 50)]
    constructed_run(tmp_path, "r0", hit)
    table = pd.DataFrame({"run_id": ["r0"], "experiment": ["c"], "cache.policy": ["lru"]})
    cold = run_intervals(table, AnalysisSpec(windows=10), folder=tmp_path)
    assert cold["token_hit_rate_warmed"].iloc[0] == pytest.approx(0.45)
    assert cold["warmed_requests"].iloc[0] == 1000
    for spec in (AnalysisSpec(warmup_requests=100, windows=10), AnalysisSpec(warmup_seconds=100.0, windows=10)):
        warm = run_intervals(table, spec, folder=tmp_path).iloc[0]
        assert warm["token_hit_rate_warmed"] == 0.5 and warm["warmed_requests"] == 900
        assert warm["token_hit_rate_ci_low"] == warm["token_hit_rate_ci_high"] == pytest.approx(0.5)  # constant
        assert warm["warmup_requests"] == spec.warmup_requests and warm["ci_windows"] == 10
    assert math.isnan(cold["ttft_p50_s_warmed"].iloc[0])  # a replay has no TTFT
    assert cold["token_hit_rate_ci_low"].iloc[0] < 0.45 < cold["token_hit_rate_ci_high"].iloc[0]


def test_spec_validation_and_defaults():
    spec = AnalysisSpec()
    assert (spec.warmup_requests, spec.warmup_seconds, spec.windows, spec.confidence) == (0, 0.0, 20, 0.95)
    for bad in ({"warmup_requests": -1}, {"warmup_seconds": -0.5}, {"windows": 1}, {"confidence": 1.0},
                {"confidence": float("nan")}, {"warmup": 3}):
        with pytest.raises(ValidationError):
            AnalysisSpec(**bad)


def test_interval_column_names_are_registered():
    for name in ("token_hit_rate_warmed", "ttft_p90_s_ci_low", "token_hit_rate_ci_high", "token_hit_rate_lag1",
                 "token_hit_rate_rep_mean", "token_hit_rate_rep_low", "token_hit_rate_rep_high", "replicates",
                 "warmed_requests", "ci_level", "ci_windows", "warmup_requests", "warmup_seconds"):
        assert table_name(name, INTERVAL_COLUMNS) is not None, name


def test_batch_means_on_a_real_replay_contain_the_run(experiment):
    """Without warm-up the warmed value is the summary's; each run's interval is the batch-means interval of
    its requests and contains the run's value; the analysis columns of the experiment (analysis.*) are read."""
    table, root = experiment
    assert len(table) == 4
    out = run_intervals("mini", AnalysisSpec(), results=root, metrics=("token_hit_rate",))
    assert (out["token_hit_rate_warmed"] == out["token_hit_rate"]).all()
    assert ((out["token_hit_rate_ci_low"] < out["token_hit_rate"])
            & (out["token_hit_rate"] < out["token_hit_rate_ci_high"])).all()
    warm = run_intervals(table.assign(**{"analysis.warmup_requests": 500, "analysis.windows": 10}),
                         results=root, metrics=("token_hit_rate",))
    assert (warm["ci_windows"] == 10).all() and (warm["warmed_requests"] == 1500).all()
    from kvlab.results import read_results

    requests = read_results(root / "mini" / "runs" / table["run_id"].iloc[0]).requests
    direct = batch_means(requests, n_batches=10, warmup_requests=500)
    assert (warm["token_hit_rate_ci_low"].iloc[0], warm["token_hit_rate_ci_high"].iloc[0]) == (direct.low, direct.high)
    assert ((warm["token_hit_rate_ci_low"] < warm["token_hit_rate_warmed"])
            & (warm["token_hit_rate_warmed"] < warm["token_hit_rate_ci_high"])).all()


def test_paired_sign_and_self_comparison(experiment):
    """LRU has the stack property: at 1,200 blocks every window hits at least as much as at 300, so the
    paired interval (larger − smaller capacity) lies above 0; a policy against itself gives exactly [0, 0]."""
    table, root = experiment
    spec = AnalysisSpec(warmup_requests=200, windows=10)
    bigger = paired(table[table["cache.policy"] == "lru"], CAPACITIES[1], CAPACITIES[0],
                    column="cache.capacity_blocks", spec=spec, results=root)
    assert len(bigger) == 1 and bigger["low"].iloc[0] > 0 and bigger["n"].iloc[0] == 10
    assert bigger["estimate"].iloc[0] > 0.002
    same = paired(table, "lru", "lru", spec=spec, results=root)
    assert list(same["cache.capacity_blocks"]) == list(CAPACITIES)
    assert (same["estimate"] == 0).all() and (same["low"] == 0).all() and (same["high"] == 0).all()
    arc = paired(table, "arc", "lru", spec=spec, results=root)
    assert set(arc["run_a"]) == set(table.loc[table["cache.policy"] == "arc", "run_id"])
    with pytest.raises(ConfigError, match="no run has cache.policy = 'fifo'"):
        paired(table, "fifo", "lru", results=root)


def test_replicate_intervals_on_constructed_data():
    """Three points: one with 5 seeds (t interval over their values), one with 2 (resampled traces), one
    single run (no interval)."""
    values = [0.20, 0.22, 0.19, 0.25, 0.24]
    table = pd.DataFrame({
        "experiment": "r", "cache.policy": ["lru"] * 5 + ["arc"] * 2 + ["lfu"],
        "cache.capacity_blocks": 1000, "seed": [0, 1, 2, 3, 4, 0, 0, 0],
        "trace.resample_seed": [None] * 5 + [1, 2] + [None],
        "run_id": list("abcdefgh"), "token_hit_rate_warmed": values + [0.3, 0.4] + [0.5],
        "token_hit_rate": 0.0, "ci_level": 0.9})
    out = replicate_intervals(table).set_index("cache.policy")
    assert list(out["replicates"]) == [5, 2, 1] and "seed" not in out and "run_id" not in out
    half = t_quantile(0.95, 4) * np.std(values, ddof=1) / math.sqrt(5)
    assert out.loc["lru", "token_hit_rate_rep_mean"] == pytest.approx(np.mean(values))
    assert out.loc["lru", "token_hit_rate_rep_low"] == pytest.approx(np.mean(values) - half)
    assert out.loc["lru", "token_hit_rate_rep_high"] == pytest.approx(np.mean(values) + half)
    assert out.loc["arc", "token_hit_rate_rep_low"] < 0.3 and out.loc["arc", "token_hit_rate_rep_high"] > 0.4
    assert out.loc["lfu", "token_hit_rate_rep_mean"] == 0.5 and math.isnan(out.loc["lfu", "token_hit_rate_rep_low"])
    assert (out["ci_level"] == 0.9).all()
