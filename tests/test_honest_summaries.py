"""Rejected requests (a prompt larger than the whole cache) are shown wherever results are: summaries,
the command line's table, the capacity figure; the demo never rejects one."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402

from kvlab.cli import main  # noqa: E402
from kvlab.demo import capacities  # noqa: E402
from kvlab.plots import plot_hit_rate_vs_capacity  # noqa: E402
from kvlab.sweep import grid, run_sweep  # noqa: E402
from kvlab.workload.generate import synthetic_chat  # noqa: E402


def test_demo_smallest_capacity_holds_the_largest_request(tmp_path):
    for n in (400, 2000):
        w = synthetic_chat(n, seed=0)
        largest = int(-(-w.input_length.max() // 16))
        caps = capacities(w)
        assert caps[0] >= largest and caps[0] < 2 * largest and len(caps) == 8
    assert main(["demo", "--quick", "--out", str(tmp_path / "d"), "--quiet"]) == 0
    table = pd.read_csv(tmp_path / "d" / "summary.csv")
    assert "rejected_requests" in table and (table["rejected_requests"] == 0).all()


def test_rejections_in_the_printout_and_the_figure(tmp_path, capsys):
    w = synthetic_chat(60, seed=1)
    largest = int(-(-w.input_length.max() // 16))
    table = run_sweep(w, grid([largest // 2, 4 * largest], block_size=16, engine="python"), progress=False)
    small = table[table["capacity_blocks"] == largest // 2].iloc[0]
    assert small["rejected_requests"] > 0
    assert (table[table["capacity_blocks"] == 4 * largest]["rejected_requests"] == 0).all()

    ax = plot_hit_rate_vs_capacity(table)
    legend = ax.get_legend() or ax.figure.legends[0]  # the paper preset puts a column figure's legend below it
    labels = [t.get_text() for t in legend.get_texts()]
    assert "rejected requests (prompt > cache)" in labels
    notes = [t.get_text() for t in ax.texts]
    assert notes == [f"{int(small['rejected_requests']):,} rejected"]

    path = tmp_path / "t.jsonl"
    from kvlab.workload.native import save_jsonl

    save_jsonl(w, path)
    assert main(["replay", str(path), "--format", "jsonl", "--block-size", "16", "--capacity-blocks",
                 str(largest // 2), "--engine", "python", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "rejected_requests" in out.splitlines()[0]
    assert f"{int(small['rejected_requests']):,} of 60 requests rejected" in out
