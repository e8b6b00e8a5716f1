"""kvlab.analysis: warm-up, batch means, session resampling, paired intervals, breakdowns, SLO attainment."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvlab.analysis import (
    after_warmup,
    batch_means,
    breakdown,
    lag1_autocorrelation,
    latency_stats,
    paired_batch_means,
    paired_session_resample,
    prefix_groups,
    resample_sessions,
    session_groups,
    session_resample,
    slo_attainment,
    slo_met,
    t_quantile,
    tenant_breakdown,
    turn_breakdown,
    warmup_mask,
)
from kvlab.errors import ConfigError
from kvlab.metrics import summarize
from kvlab.replay import ReplayConfig, replay
from kvlab.workload import load_mooncake, synthetic_chat


@pytest.fixture(scope="module")
def chat():
    """A small synthetic multi-turn workload: sessions, tenants, categories, turns (~250k prompt tokens)."""
    return synthetic_chat(400, seed=1, doc_tokens=(200, 600), system_tokens=(50, 150))


@pytest.fixture(scope="module")
def conversation(shared_file):
    """The first 3,000 requests of Mooncake conversation (a block trace without sessions)."""
    return load_mooncake(shared_file("mooncake/conversation_trace.jsonl")).head(3000)


def _frame(hit: np.ndarray, prompt: np.ndarray, arrival: np.ndarray | None = None) -> pd.DataFrame:
    """A hand-made requests frame with the columns kvlab.metrics.summarize reads (block size 1)."""
    n = len(hit)
    return pd.DataFrame({"request_id": np.arange(n), "arrival": np.arange(n, dtype=float) if arrival is None
                         else arrival, "prompt_tokens": prompt, "hit_tokens": hit, "full_blocks": prompt,
                         "hit_blocks": hit, "evictions": np.zeros(n, np.int64)})


# ----------------------------------------------------------------------------- t quantiles
@pytest.mark.parametrize(("p", "df", "table"), [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 3, 3.1824),
                                                 (0.975, 9, 2.2622), (0.975, 19, 2.0930), (0.95, 9, 1.8331),
                                                 (0.995, 29, 2.7564), (0.025, 9, -2.2622)])
def test_t_quantile_matches_tables(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, rel=1.5e-3)


# ----------------------------------------------------------------------------- warm-up
def test_warmup_counts():
    f = _frame(np.ones(10, np.int64), np.full(10, 2), arrival=np.array([5.0, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    assert warmup_mask(f).all()
    assert int(warmup_mask(f, warmup_requests=3).sum()) == 7
    assert int(warmup_mask(f, warmup_seconds=2.0).sum()) == 7  # arrivals < 5 + 2 s dropped: rows 0, 1, 2
    assert int(warmup_mask(f, warmup_seconds=2.5).sum()) == 6  # and row 3 (7.0 < 7.5 s)
    assert int(warmup_mask(f, warmup_requests=5, warmup_seconds=2.0).sum()) == 5
    assert len(after_warmup(f, warmup_requests=100)) == 0
    kept = after_warmup(f, warmup_requests=4)
    assert kept["request_id"].tolist() == list(range(4, 10)) and kept.index.tolist() == list(range(6))
    assert summarize(kept)["requests"] == 6


@pytest.mark.parametrize(("kw", "name"), [({"warmup_requests": -1}, "warmup_requests"),
                                           ({"warmup_requests": 1.5}, "warmup_requests"),
                                           ({"warmup_seconds": math.nan}, "warmup_seconds"),
                                           ({"warmup_seconds": -2.0}, "warmup_seconds")])
def test_warmup_bad_input(kw, name):
    with pytest.raises(ConfigError, match=name):
        warmup_mask(_frame(np.ones(3), np.ones(3)), **kw)


# ----------------------------------------------------------------------------- batch means
def test_batch_means_covers_the_true_mean_at_the_nominal_rate():
    """A stationary AR(1) series of per-request hit shares (true token hit rate 0.3, lag-1 correlation 0.5):
    over 200 fixed seeds the 95 % interval from 20 windows of 100 requests covers 0.3 about 95 % of the time."""
    covered, n, phi = 0, 2000, 0.5
    for seed in range(200):
        rng = np.random.default_rng(seed)
        noise = rng.normal(0.0, 0.05, n)
        x = np.empty(n)
        x[0] = noise[0] / math.sqrt(1 - phi**2)
        for i in range(1, n):
            x[i] = phi * x[i - 1] + noise[i]
        prompt = np.full(n, 100.0)
        iv = batch_means(_frame(prompt * (0.3 + x), prompt), n_batches=20)
        covered += iv.low <= 0.3 <= iv.high
    assert 0.91 <= covered / 200 <= 0.99, covered


def test_batch_means_windows_and_warmup():
    hit = np.r_[np.zeros(100), np.full(400, 50.0)]
    f = _frame(hit, np.full(500, 100.0))
    iv = batch_means(f, n_batches=10, warmup_requests=100)
    assert iv.estimate == iv.low == iv.high == 0.5 and len(iv.replicates) == 10 and iv.method == "batch_means"
    assert batch_means(f, n_batches=10).low < 0.5
    assert math.isnan(lag1_autocorrelation(iv.replicates))
    with pytest.raises(ConfigError, match="n_batches"):
        batch_means(f, n_batches=1)
    with pytest.raises(ConfigError, match="n_batches"):
        batch_means(f, n_batches=450, warmup_requests=100)
    with pytest.raises(ConfigError, match="level"):
        batch_means(f, level=95)
    with pytest.raises(ConfigError, match="metric"):
        batch_means(f, metric="hit_rate")
    assert batch_means(f, metric=lambda fr: float(fr["hit_tokens"].mean()), n_batches=5).estimate == 40.0


def test_paired_batch_means_against_itself_is_exactly_zero(chat):
    a = replay(chat, ReplayConfig(capacity_blocks=300)).requests
    iv = paired_batch_means(a, a.copy(), n_batches=10, warmup_requests=50)
    assert (iv.estimate, iv.low, iv.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="requests_b"):
        paired_batch_means(a, a.iloc[1:], n_batches=10)


def test_paired_batch_means_sign_capacity_2x_beats_1x(chat, conversation):
    for w, cap in ((chat, 300), (conversation, 2000)):
        big = replay(w, ReplayConfig(capacity_blocks=2 * cap)).requests
        small = replay(w, ReplayConfig(capacity_blocks=cap)).requests
        iv = paired_batch_means(big, small, n_batches=20, warmup_requests=len(w) // 10)
        assert iv.low > 0, iv
        assert paired_batch_means(small, big, n_batches=20, warmup_requests=len(w) // 10).high < 0


# ----------------------------------------------------------------------------- session resampling
def test_resampling_keeps_sessions_whole(chat):
    out = resample_sessions(chat, np.random.default_rng(3), duplicates="isolate")
    assert np.all(np.diff(out.arrival) >= 0) and out.parent is None
    original = pd.DataFrame({"session": chat.session, "rid": chat.request_id})
    whole = {s: sorted(g["rid"]) for s, g in original.groupby("session")}
    salt = pd.Series(out.salt).astype(object).where(pd.notna(pd.Series(out.salt)), "").to_numpy()
    got = pd.DataFrame({"session": out.session, "rid": out.request_id, "copy": salt})
    assert got.groupby(["session", "copy"]).size().gt(0).all()
    for (session, _), g in got.groupby(["session", "copy"]):
        assert sorted(g["rid"]) == whole[session]  # every copy holds its whole session, each request once
    assert len(np.unique(out.session)) < len(whole)  # with replacement: some sessions drawn twice, some never
    again = resample_sessions(chat, np.random.default_rng(3))
    assert again.content_sha256 == out.content_sha256  # deterministic given the generator's seed


def test_isolated_copies_share_nothing(chat):
    """A session drawn twice hits its own copy unless the copies are salted apart."""
    cfg = ReplayConfig(capacity_blocks=100_000)
    labels = session_groups(chat)
    rng_seed = 5
    iso = replay(resample_sessions(chat, np.random.default_rng(rng_seed), labels), cfg).summary
    shared = replay(resample_sessions(chat, np.random.default_rng(rng_seed), labels, duplicates="share"), cfg).summary
    assert shared["token_hit_rate"] > iso["token_hit_rate"]


def test_session_resample_interval_and_pairs(chat):
    def run(cap):
        return lambda w: replay(w, ReplayConfig(capacity_blocks=cap))

    iv = session_resample(chat, run(300), n_resamples=8, seed=1, warmup_requests=40)
    assert iv.method == "session_resample" and len(iv.replicates) == 8 and iv.low <= iv.high
    assert iv == session_resample(chat, run(300), n_resamples=8, seed=1, warmup_requests=40)  # deterministic
    same = paired_session_resample(chat, run(300), run(300), n_resamples=4, seed=2)["a_minus_b"]
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    better = paired_session_resample(chat, run(600), run(300), n_resamples=6, seed=2)
    assert better["a_minus_b"].low > 0
    assert better["a"].estimate - better["b"].estimate == pytest.approx(better["a_minus_b"].estimate)
    with pytest.raises(ConfigError, match="n_resamples"):
        session_resample(chat, run(300), n_resamples=1)
    with pytest.raises(ConfigError, match="groups"):
        session_resample(chat, run(300), groups=np.zeros(3))
    with pytest.raises(ConfigError, match="duplicates"):
        resample_sessions(chat, np.random.default_rng(0), duplicates="keep")


def test_session_resample_on_mooncake_prefix_groups(conversation):
    with pytest.raises(ConfigError, match="groups"):
        session_groups(conversation)  # no session column
    groups = prefix_groups(conversation)
    assert groups.shape == (3000,) and 1 < groups.max() + 1 < 3000
    out = paired_session_resample(conversation, lambda w: replay(w, ReplayConfig(capacity_blocks=4000)),
                                  lambda w: replay(w, ReplayConfig(capacity_blocks=2000)), n_resamples=5,
                                  seed=0, groups=groups, warmup_requests=300)
    assert out["a_minus_b"].low > 0 and out["a"].low <= out["a"].high


# ----------------------------------------------------------------------------- breakdowns
def test_breakdown_sums_equal_totals(chat):
    frame = replay(chat, ReplayConfig(capacity_blocks=300)).requests
    total = summarize(after_warmup(frame, warmup_requests=30))
    for by in ("tenant", "category", "turn", ["tenant", "category"]):
        table = breakdown(frame, by, warmup_requests=30)
        keys = [by] if isinstance(by, str) else by
        assert list(table.columns[: len(keys)]) == keys
        for col in ("requests", "prompt_tokens", "reused_tokens", "evictions"):
            assert table[col].sum() == total[col], (by, col)
        rate = table["reused_tokens"] / table["prompt_tokens"]
        assert np.allclose(rate, table["token_hit_rate"])
    capped = turn_breakdown(frame, max_turn=3)
    assert capped["turn"].max() == 3 and capped["requests"].sum() == len(frame)
    assert tenant_breakdown(frame)["requests"].sum() == len(frame)
    with pytest.raises(ConfigError, match="by"):
        breakdown(frame, "user")


def test_breakdown_with_ttft_from_the_simulator(chat):
    from kvlab.sim import simulate

    frame = simulate(chat.head(120), capacity_blocks=400).requests
    table = breakdown(frame, "category")
    assert {"ttft_p50_s", "ttft_p90_s", "tpot_p50_s"} <= set(table.columns)
    assert table["requests"].sum() == 120 and (table["ttft_p50_s"] > 0).all()
    met = slo_attainment(frame, ttft_s=float(np.nanmedian(frame["ttft_s"])), tpot_s=None)
    assert 0.4 <= met["slo_attainment"].iloc[0] <= 0.6


# ----------------------------------------------------------------------------- SLO attainment
def test_slo_attainment_on_hand_made_frames():
    f = pd.DataFrame({
        "ttft_s": [0.1, 0.5, 0.2, np.nan, 0.05, 0.3],
        "tpot_s": [0.01, 0.01, 0.05, np.nan, np.nan, 0.02],
        "admitted": [True, True, True, False, True, True],
        "tenant": ["a", "a", "b", "b", "b", "a"],
    })
    # TTFT <= 0.3 s and TPOT <= 0.02 s: rows 0 (yes), 1 (TTFT), 2 (TPOT), 3 (never served), 4 (yes, no decode), 5
    assert slo_met(f, ttft_s=0.3, tpot_s=0.02).tolist() == [True, False, False, False, True, True]
    one = slo_attainment(f, ttft_s=0.3, tpot_s=0.02)
    assert one.iloc[0][["slo_requests", "slo_met"]].tolist() == [6, 3] and one["slo_attainment"].iloc[0] == 0.5
    per = slo_attainment(f, ttft_s=0.3, tpot_s=0.02, by="tenant").set_index("tenant")
    assert per.loc["a", "slo_met"] == 2 and per.loc["b", "slo_met"] == 1 and per["slo_requests"].sum() == 6
    assert slo_attainment(f, ttft_s=None, tpot_s=0.02)["slo_met"].iloc[0] == 4  # the unserved one still misses
    assert slo_attainment(f, ttft_s=0.3, tpot_s=0.02, warmup_requests=2)["slo_requests"].iloc[0] == 4
    assert latency_stats(f)["ttft_p50_s"] == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="ttft_s"):
        slo_met(f, ttft_s=-1.0, tpot_s=None)
    with pytest.raises(ConfigError, match="ttft_s, tpot_s"):
        slo_met(f, ttft_s=None, tpot_s=None)
    with pytest.raises(ConfigError, match="tpot_s"):
        slo_met(f.drop(columns="tpot_s"), ttft_s=None, tpot_s=0.1)
