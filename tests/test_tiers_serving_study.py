"""Issue 14's serving study (kvlab.studies.serving_tiers) on small slices: saturation measured with every arrival
at 0, every case at each load with equal device memory, the TTFT split adding up, traffic per tier and link, the
break-even points of docs/tiers.md, results read back by identity, and the figures drawn from the tables."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvlab.studies.serving_tiers import (
    ServingStudyConfig,
    break_even,
    break_even_points,
    cases,
    run_serving_study,
    serving_markdown,
    ttft_table,
)
from kvlab.studies.tiers import synthetic_workload
from kvlab.workload import load_trace

SMALL = dataclasses.replace(ServingStudyConfig.quick(), limit=150, synthetic_requests=150, break_even_tokens=1024)


@pytest.fixture(scope="module")
def study(shared_file, tmp_path_factory):
    conv = load_trace(str(shared_file("mooncake/conversation_trace.jsonl")), format="mooncake").head(SMALL.limit)
    workloads = [conv, synthetic_workload(SMALL.synthetic_requests)]
    out = tmp_path_factory.mktemp("serving") / "study"
    return run_serving_study(out, SMALL, workloads=workloads), out, workloads


def test_every_case_runs_at_each_load_of_the_measured_saturation(study):
    result, _, workloads = study
    runs, sat = result.runs, result.saturation
    assert list(sat["trace"]) == [w.name for w in workloads]
    assert (sat["saturation_rps"] == sat["requests"] / sat["makespan_s"]).all()
    assert len(runs) == len(workloads) * len(SMALL.loads) * len(cases())
    for (trace, load), g in runs.groupby(["trace", "load"]):
        s = sat.set_index("trace").loc[trace, "saturation_rps"]
        assert np.allclose(g["rate_rps"], load * s)
        assert (g["served"] == g["requests"]).all()
        assert g["configuration"].is_unique
    split = runs["queue_mean_s"] + runs["load_mean_s"] + runs["compute_mean_s"]
    assert np.allclose(split, runs["ttft_mean_s"])
    device = runs[runs["tiers"] == "device"]
    assert (device["load_mean_s"] == 0).all() and (device["loaded_bytes"] == 0).all()
    tiered = runs[runs["tiers"] != "device"]
    assert (tiered["token_hit_rate"] >= tiered["device_token_hit_rate"]).all()
    assert np.allclose(runs["token_hit_rate"], runs["device_token_hit_rate"] + runs["share_dram"] + runs["share_ssd"])
    assert (runs["ttft_p90_s"] >= runs["ttft_p50_s"]).all()


def test_traffic_per_tier_and_link_and_the_requests_table(study):
    result, _, _ = study
    tr = result.traffic
    assert set(tr["kind"]) == {"tier", "link", "medium"}
    assert not (tr["configuration"] == "device").any()
    link = tr[(tr["kind"] == "link") & (tr["name"] == SMALL.dram_link)]
    # DRAM stores and every load cross the shared PCIe link (an SSD write_back store copies from host memory)
    crossing = tr[(tr["kind"] == "tier") & ((tr["name"] == "dram") | (tr["direction"] == "read"))]
    tiers = crossing.groupby(["trace", "load", "configuration"])["bytes"].sum()
    moved = link.set_index(["trace", "load", "configuration"])["bytes"]
    assert (tiers > 0).all() and (moved.loc[tiers.index] >= tiers * 0.999).all()
    req = result.requests
    assert set(req["configuration"]) == {"device", "+DRAM", "+DRAM+SSD"}
    assert np.allclose(req["ttft_s"], req["queue_s"] + req["ttft_load_s"] + req["ttft_compute_s"])


def test_break_even_points_are_the_documented_ones():
    """docs/tiers.md: Llama-3-8B on the H100 profile, 16-token blocks: DRAM over PCIe 5 pays from 336 tokens with
    per-layer transfers, 272 per chunk; NVMe Gen5 staged through DRAM from 1,584 / 480."""
    points = break_even_points(break_even(dataclasses.replace(SMALL, break_even_tokens=4096))).set_index(
        ["path", "kv_layout"])["break_even_tokens"]
    assert points[("DRAM, PCIe 5", "layer")] == 336 and points[("DRAM, PCIe 5", "block")] == 272
    assert points[("NVMe Gen5 via DRAM, PCIe 5", "layer")] == 1584
    assert points[("NVMe Gen5 via DRAM, PCIe 5", "block")] == 480
    assert points[("NVMe Gen4 via DRAM, PCIe 5", "layer")] is None  # 13,328 tokens: beyond 4,096


def test_results_are_read_back_by_identity_and_repeat_exactly(study, tmp_path):
    result, out, workloads = study
    manifest = (out / "manifest.json").read_text()
    again = run_serving_study(out, SMALL, workloads=workloads)  # complete and matching: read, not rerun
    assert (out / "manifest.json").read_text() == manifest
    assert again.runs.equals(result.runs)
    fresh = run_serving_study(tmp_path / "fresh", SMALL, workloads=workloads[:1])
    cols = ["ttft_mean_s", "ttft_p90_s", "token_hit_rate", "loaded_bytes"]
    first = result.runs[result.runs["trace"] == workloads[0].name].reset_index(drop=True)
    assert fresh.runs[cols].equals(first[cols])
    table = ttft_table(result)
    assert len(table) == len(result.runs) and "TTFT p90 s" in table
    text = serving_markdown(result)
    assert all(f"**{w.name}**" in text for w in workloads)


def test_figures_draw_from_the_tables(study, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.plots.serving_tiers import plot_break_even, plot_traffic, plot_ttft, plot_ttft_split
    from kvlab.plots.tiers import save_figure

    result, _, workloads = study
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    trace = workloads[0].name
    plot_ttft(result.runs, trace, axes[0, 0])
    plot_ttft_split(result.runs, trace, axes[0, 1])
    plot_traffic(result.traffic, trace, SMALL.loads[-1], axes[0, 2])
    plot_break_even(result.break_even, "layer", axes[1, 0])
    plot_break_even(result.break_even, "block", axes[1, 1])
    for ax in [*axes[0], *axes[1, :2]]:
        assert ax.get_ylabel() and "(" in ax.get_ylabel()  # a unit on every y axis
    assert "tokens" in axes[1, 0].get_xlabel()
    paths = save_figure(fig, tmp_path, "serving")
    assert all(p.stat().st_size > 0 for p in paths)
    plt.close(fig)
