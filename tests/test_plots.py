"""kvlab.plots: what each figure draws (lines, bands, bars), units on every axis, one style (no two series
alike, legends outside the data when long), and style.save / figure_from_experiment writing PNG, PDF, the data
and a caption, byte for byte the same for the same data."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from kvlab.analysis.runs import AnalysisSpec  # noqa: E402
from kvlab.experiment import run_experiment  # noqa: E402
from kvlab.experiment.config import Experiment  # noqa: E402
from kvlab.plots import (  # noqa: E402
    figure_from_experiment,
    plot_hit_rate_vs_capacity,
    plot_memory_timeline,
    plot_tier_breakdown,
    plot_ttft_cdf,
    plot_ttft_vs_load,
    style,  # noqa: E402
)
from kvlab.sim import simulate  # noqa: E402
from kvlab.workload.workload import from_lists  # noqa: E402

CAPS = (1000, 2000, 5000)


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def sweep_table(policies: list[str], *, bands: bool) -> pd.DataFrame:
    rows = []
    for i, p in enumerate(policies):
        for j, c in enumerate(CAPS):
            rate = 0.1 + 0.01 * i + 0.1 * j
            rows.append({"policy": p, "capacity_blocks": c, "token_hit_rate": rate, "ideal_hit_rate": 0.5,
                         "rejected_requests": 0})
            if bands:
                rows[-1].update(token_hit_rate_warmed=rate, token_hit_rate_ci_low=rate - 0.01,
                                token_hit_rate_ci_high=rate + 0.01)
    return pd.DataFrame(rows)


def test_hit_rate_vs_capacity_lines_bands_and_units():
    ax = plot_hit_rate_vs_capacity(sweep_table(["lru", "arc", "lfu"], bands=True))
    assert len(ax.lines) == 3 + 1  # three policies and the infinite-cache baseline
    assert len(ax.collections) == 3  # one band per policy
    assert "(blocks" in ax.get_xlabel() and "(fraction)" in ax.get_ylabel()
    assert [tuple(line.get_xdata()) for line in ax.lines[:3]] == [CAPS] * 3
    ideal = ax.lines[3]
    assert ideal.get_color() == "black" and ideal.get_label() == "infinite cache"
    plain = plot_hit_rate_vs_capacity(sweep_table(["lru", "arc"], bands=False))
    assert len(plain.collections) == 0 and len(plain.lines) == 3


def test_fourteen_policies_draw_at_most_max_series_styled_and_the_legend_is_outside():
    """style.MAX_SERIES per panel: the 7 best of 14 policies styled (no two alike), the other 7 thin grey under
    one legend entry; the legend below the axes, not over the data."""
    from kvlab.plots import style
    from kvlab.plots.capacity import draw_series

    names = [f"p{i:02d}" for i in range(14)]
    ax = plot_hit_rate_vs_capacity(sweep_table(names, bands=True), ideal=False)
    styled = [line for line in ax.lines if line.get_color() != style.REST_COLOR]
    grey = [line for line in ax.lines if line.get_color() == style.REST_COLOR]
    assert len(styled) == style.MAX_SERIES - 1 and len(grey) == 7
    assert len({(line.get_color(), line.get_linestyle(), line.get_marker()) for line in styled}) == len(styled)
    assert "other 7" in [t.get_text() for t in ax.figure.legends[0].get_texts()]
    fig = ax.figure
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert legend.y1 <= ax.get_window_extent().y0  # below the axes, not over the data
    _, fresh = style.figure("column")
    assert draw_series(fresh, sweep_table(names, bands=True), "capacity_blocks", "token_hit_rate",
                       "policy")["policy"].nunique() == 14  # the data keeps every series


def test_ttft_cdf_and_ttft_vs_load():
    rng = np.random.default_rng(0)
    frames = {name: pd.DataFrame({"ttft_s": rng.exponential(scale, 200), "admitted": True})
              for name, scale in (("lru", 0.2), ("arc", 0.1))}
    frames["lru"].loc[:9, "admitted"] = False  # not admitted: left out
    ax, data = plot_ttft_cdf(frames, unit="ms")
    assert len(ax.lines) == 2 and "(ms" in ax.get_xlabel() and "(fraction)" in ax.get_ylabel()
    assert ax.lines[0].get_ydata()[-1] == 1.0 and len(ax.lines[0].get_xdata()) == 190
    assert (data.groupby("label")["ttft_ms"].apply(lambda v: v.is_monotonic_increasing)).all()
    table = pd.DataFrame([{"policy": p, "rate": r, "ttft_p50_s": r * k, "ttft_p90_s": 2 * r * k,
                           "ttft_p50_s_warmed": r * k, "ttft_p50_s_ci_low": r * k * 0.9,
                           "ttft_p50_s_ci_high": r * k * 1.1}
                          for p, k in (("lru", 1.0), ("arc", 0.8)) for r in (0.5, 1.0, 2.0)])
    ax, data = plot_ttft_vs_load(table)
    assert len(ax.lines) == 4 and len(ax.collections) == 2  # 2 policies × (p50, p90); bands only for p50
    assert "(requests/s)" in ax.get_xlabel() and "(s)" in ax.get_ylabel()
    assert sorted(t.get_text() for t in ax.figure.legends[0].get_texts()) == ["arc, p50", "arc, p90",
                                                                              "lru, p50", "lru, p90"]
    from kvlab.plots import style  # a policy keeps its look (colour and marker) from kvlab.plots.style

    assert ax.lines[0].get_color() == style.policy_style(ax.lines[0].get_label().split(",")[0])["color"]
    assert set(data["metric"]) == {"ttft_p50_s", "ttft_p90_s"}


def test_memory_timeline_from_a_simulation():
    rng = np.random.default_rng(1)
    prompts = [list(range(40)) + rng.integers(100, 200, 30).tolist() for _ in range(30)]
    w = from_lists(prompts, arrival=np.arange(30) * 0.05, output_length=np.full(30, 4))
    res = simulate(w, capacity_blocks=40, block_size=8)
    bytes_per_block = res.summary["kv_bytes_per_block"]
    ax, data = plot_memory_timeline(res.timeseries, kv_bytes_per_block=bytes_per_block, capacity_blocks=40)
    assert len(ax.collections) == 2 and len(ax.lines) == 1  # running, evictable stacked; the capacity line
    assert "(GiB)" in ax.get_ylabel() and "(s)" in ax.get_xlabel()
    assert data["running_gib"].max() * 2**30 / bytes_per_block == res.timeseries["kv_running_blocks"].max()
    ax, data = plot_memory_timeline(res.timeseries)
    assert "(blocks)" in ax.get_ylabel() and len(data) == len(res.timeseries)


def test_tier_breakdown_stacks_to_the_hit_rate():
    table = pd.DataFrame({"cache.policy": ["lru", "arc"], "cache.capacity_blocks": [100, 100],
                          "token_hit_rate": [0.5, 0.6], "device_token_hit_rate": [0.3, 0.35],
                          "dram_hit_share": [0.15, 0.2], "ssd_hit_share": [0.05, 0.05]})
    ax, data = plot_tier_breakdown(table)
    assert len(ax.patches) == 2 * 3
    assert data.groupby("run")["share"].sum().sort_index().tolist() == pytest.approx([0.6, 0.5])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lru", "arc"]
    assert "(fraction" in ax.get_ylabel()
    colors = {p.get_facecolor()[:3] for p in ax.patches}
    assert len(colors) == 3


def test_save_writes_four_files_byte_stable(tmp_path):
    data = pd.DataFrame({"x": [1, 2, 3], "y": [0.1, 0.2, 0.3]})
    outputs = []
    for folder in ("a", "b"):
        fig, ax = plt.subplots(figsize=style.SINGLE)
        ax.plot(data["x"], data["y"])
        paths = style.save(fig, tmp_path / folder, "f", data=data, caption={"shows": "y against x"})
        assert [p.suffix for p in paths] == [".png", ".pdf", ".parquet", ".json"]
        outputs.append([p.read_bytes() for p in paths])
    assert outputs[0] == outputs[1]
    assert json.loads((tmp_path / "a" / "f.json").read_text()) == {"shows": "y against x", "layout_problems": []}
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a" / "f.parquet"), data)


def test_figure_from_experiment(shared_file, tmp_path):
    """A real experiment (LRU, ARC at two capacities, 600 Mooncake requests): the figure, its data (the bands
    drawn) and its caption (run ids, config hashes, the trace checksum, the analysis settings)."""
    exp = Experiment(name="tiny", trace={"path": str(shared_file("mooncake/conversation_trace.jsonl")),
                                         "limit": 600},
                     cache={"capacity_blocks": 1000, "policy": "lru"},
                     sweep={"grid": {"cache.policy": ["lru", "arc"], "cache.capacity_blocks": [200, 800]}})
    table = run_experiment(exp, tmp_path, progress=False)
    spec = AnalysisSpec(warmup_requests=100, windows=5)
    paths = figure_from_experiment("tiny", results=tmp_path, spec=spec)
    assert [p.name for p in paths] == [f"hit_rate_vs_capacity.{s}" for s in ("png", "pdf", "parquet", "json")]
    assert paths[0].parent == tmp_path / "figures" / "tiny"
    data = pd.read_parquet(paths[2])
    assert len(data) == 4 and (data["low"] < data["estimate"]).all() and (data["estimate"] < data["high"]).all()
    cap = json.loads(paths[3].read_text())
    assert {r["run_id"] for r in cap["runs"]} == set(table["run_id"]) and all(r["config_hash"] for r in cap["runs"])
    assert [t["content_sha256"] for t in cap["traces"].values()] == [table["trace_sha256"].iloc[0]]
    assert cap["analysis"]["warmup_requests"] == 100 and cap["experiment"] == "tiny"
    again = figure_from_experiment("tiny", results=tmp_path, spec=spec, out=tmp_path / "again")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]
    with pytest.raises(ValueError, match="no timeseries"):
        figure_from_experiment("tiny", "memory_timeline", results=tmp_path)
