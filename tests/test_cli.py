"""The command line: trace stats reproduce FAST'25 Table 2, replays at 1k/10k/50k, demo, bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab.cli import build_parser, main
from kvlab.results import read_results
from kvlab.sweep import read_sweep
from kvlab.workload import load_trace


def stats_lines(capsys) -> dict[str, str]:
    out = capsys.readouterr().out
    return dict(line.split(None, 1) for line in out.strip().splitlines())


@pytest.mark.shared
@pytest.mark.parametrize(
    ("rel", "requests", "mean_in", "mean_out", "cache_ratio"),
    [
        ("mooncake/conversation_trace.jsonl", "12,031", 12035.06, 342.62, 0.40),
        ("mooncake/synthetic_trace.jsonl", "3,993", 15325.48, 149.12, 0.66),
    ],
)
def test_trace_stats_reproduces_fast25_table2(shared_file, capsys, rel, requests, mean_in, mean_out, cache_ratio):
    assert main(["trace", "stats", str(shared_file(rel))]) == 0
    s = stats_lines(capsys)
    assert s["requests"] == requests
    assert float(s["mean_input_tokens"].replace(",", "")) == pytest.approx(mean_in, abs=0.01)
    assert float(s["mean_output_tokens"].replace(",", "")) == pytest.approx(mean_out, abs=0.01)
    # the paper's "cache ratio" is within 2 points of either the aggregate or the per-request ideal hit rate
    agg, mean = float(s["ideal_hit_rate"]), float(s["ideal_mean_request_hit_rate"])
    assert min(abs(agg - cache_ratio), abs(mean - cache_ratio)) < 0.02
    assert int(s["unique_blocks"].replace(",", "")) > 0


@pytest.mark.shared
@pytest.mark.parametrize("rel", ["mooncake/conversation_trace.jsonl", "mooncake/synthetic_trace.jsonl"])
def test_replay_at_1k_10k_50k(shared_file, tmp_path, capsys, rel):
    out = tmp_path / "sweep"
    argv = ["replay", str(shared_file(rel)), "--format", "mooncake", "--block-size", "512",
            "--capacity-blocks", "1000", "10000", "50000", "--policy", "lru", "--hash", "xxh3_128",
            "--out", str(out), "--quiet"]
    assert main(argv) == 0
    table = read_sweep(out).sort_values("capacity_blocks")
    rates = table["token_hit_rate"].to_numpy()
    assert list(table["capacity_blocks"]) == [1000, 10000, 50000]
    assert (rates[1:] >= rates[:-1]).all() and rates[0] > 0
    assert (rates <= table["ideal_hit_rate"].to_numpy() + 1e-12).all()
    assert table["evictions"].iloc[0] > table["evictions"].iloc[-1]
    run = read_results(next((out / "runs").iterdir()))
    assert len(run.requests) == len(load_trace(str(shared_file(rel))))
    assert run.manifest["trace"]["sha256"] and run.manifest["config"]["hash"] == "xxh3_128"


@pytest.mark.shared
def test_alibaba_sample_replays_along_prefixes(shared_file):
    from kvlab.replay import replay

    w = load_trace(str(shared_file("alibaba/sample_traceA_multiturn_20.jsonl")), format="alibaba")
    r = replay(w, capacity_blocks=100_000).requests
    # ids were chained on load: every hit is a prefix of an earlier request, so hits <= the infinite cache's
    assert (r["hit_tokens"] <= r["ideal_hit_tokens"]).all()
    assert r["hit_tokens"].sum() > 0
    # a child turn reuses exactly its parent's full blocks: the parent's partial last block differs
    children = [i for i in range(len(w)) if w.parent[i] >= 0]
    assert len(children) >= 5
    for i in children:
        assert r["hit_blocks"][i] == w.input_length[w.parent[i]] // 16


def test_single_replay_writes_results(tmp_path, capsys):
    from kvlab.workload import save_jsonl, synthetic_chat

    trace = save_jsonl(synthetic_chat(200, seed=1), tmp_path / "chat.jsonl")
    assert main(["replay", str(trace), "--format", "jsonl", "--block-size", "16", "--capacity-blocks", "256",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    run = read_results(tmp_path / "run")
    assert {"prompt_tokens", "hit_tokens"} <= set(run.requests.columns)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["capacity_blocks"] == 256
    assert "token_hit_rate" in capsys.readouterr().out


def test_bad_trace_gives_file_line_field_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": [0]}\n')
    code = main(["replay", str(bad), "--format", "mooncake", "--capacity-blocks", "10", "--out",
                 str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.jsonl:2" in err and "input_length" in err
    assert not (tmp_path / "run").exists()


def test_demo_quick_prints_its_table_and_saves_a_clean_column_figure(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    summary = pd.read_csv(tmp_path / "demo" / "summary.csv")
    assert len(summary) == 5 and (summary["token_hit_rate"].diff().dropna() >= 0).all()
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["capacity_blocks", "token_hit_rate", "ideal_hit_rate", "rejected_requests"]
    rows = [line.split() for line in out[1:6]]
    assert [int(r[0].replace(",", "")) for r in rows] == summary["capacity_blocks"].tolist()
    assert [float(r[1]) for r in rows] == summary["token_hit_rate"].round(4).tolist()
    assert [int(r[3]) for r in rows] == summary["rejected_requests"].tolist()
    fig = tmp_path / "demo" / "figure"
    for suffix in ("png", "pdf", "parquet", "json"):
        assert (fig / f"hit_rate_vs_capacity.{suffix}").is_file()
    caption = json.loads((fig / "hit_rate_vs_capacity.json").read_text())
    assert caption["layout_problems"] == [] and "LRU" in caption["finding"]
    from PIL import Image

    with Image.open(fig / "hit_rate_vs_capacity.png") as png:  # 300 dpi: one column (3.3-3.5 in) wide
        assert 3.3 <= png.size[0] / 300 <= 3.5
    assert (tmp_path / "demo" / "manifest.json").exists()
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--quiet"]) == 0  # a rerun replaces its own


def test_policies_and_download_list(capsys):
    assert main(["policies"]) == 0
    assert "lru" in capsys.readouterr().out
    assert main(["download", "--list"]) == 0
    assert "mooncake_conversation" in capsys.readouterr().out


def test_calibrate_capacity_flag_and_its_hidden_old_name(capsys):
    """``calibrate --capacity-blocks``; the old ``--num-blocks`` still parses, hidden from --help."""
    parser = build_parser()
    assert parser.parse_args(["calibrate"]).capacity_blocks == 512
    assert parser.parse_args(["calibrate", "--capacity-blocks", "9"]).capacity_blocks == 9
    assert parser.parse_args(["calibrate", "--num-blocks", "7"]).capacity_blocks == 7
    assert main(["calibrate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--capacity-blocks" in text and "--num-blocks" not in text
    assert main(["calibrate", "--num-blocks", "0", "--quiet"]) == 2
    assert "--capacity-blocks" in capsys.readouterr().err


def test_sweep_over_traces_and_all_policies(tmp_path):
    from kvlab.policies import available_policies
    from kvlab.workload import save_jsonl, synthetic_chat

    a = save_jsonl(synthetic_chat(120, seed=1), tmp_path / "a.jsonl")
    b = save_jsonl(synthetic_chat(120, seed=2), tmp_path / "b.jsonl")
    # the Python core: every policy without 24 numba compilations (compiled = Python is tested elsewhere)
    argv = ["sweep", str(a), str(b), "--block-size", "16", "--capacity-blocks", "64", "256", "--policy", "all",
            "--engine", "python", "--out", str(tmp_path / "sw"), "--quiet"]
    assert main(argv) == 0
    table = pd.read_parquet(tmp_path / "sw" / "sweep.parquet")
    assert len(table) == 2 * 2 * len(available_policies())
    assert table["trace"].nunique() == 2
    assert set(table["policy"]) == set(available_policies())
    assert (table["token_hit_rate"] <= table["ideal_hit_rate"] + 1e-12).all()
    assert main(argv) == 0  # resumed: the same table, nothing recomputed
    again = pd.read_parquet(tmp_path / "sw" / "sweep.parquet")
    pd.testing.assert_frame_equal(again, table)


def _help_paths(parser, path=()):
    """Every command path of the parser tree (``()``, ``("replay",)``, ``("trace", "stats")``...)."""
    import argparse

    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _help_paths(sub, (*path, name))


def test_every_help_text_is_plain_text(capsys):
    paths = list(_help_paths(build_parser()))
    assert ("replay",) in paths and ("trace", "stats") in paths and ("figures",) in paths
    for path in paths:
        assert main([*path, "--help"]) == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: kvlab"), path
        assert "`" not in text and ":mod:" not in text and ":func:" not in text, (path, text)
