"""Tiers on the command line and in sweeps: ``--tier SPEC`` (repeatable; comma-separated sizes sweep),
``--max-load-tokens``, ``--model``; bad input ends in one ``kvlab: error:`` line naming the flag and the bad
part, before the trace is read; the sweep table's flat per-tier columns; run ids of runs without tiers."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from _util import cli_error

from kvlab.cli import main
from kvlab.results import read_results
from kvlab.sweep import grid, plan, run_sweep
from kvlab.tiers import Tier
from kvlab.workload import save_jsonl, synthetic_chat

BASE = ["--block-size", "16", "--capacity-blocks", "48", "--backend", "python", "--quiet"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return save_jsonl(synthetic_chat(60, seed=3), tmp_path_factory.mktemp("tiers") / "chat.jsonl")


def test_replay_with_tiers_writes_columns_summary_and_prints_shares(tmp_path, capsys, trace):
    out = tmp_path / "run"
    argv = ["replay", str(trace), *BASE, "--tier", "dram:blocks=200:write=write_back", "--tier", "ssd:gib=1",
            "--model", "llama-3-8b", "--max-load-tokens", "4096", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "device_token_hit_rate" in printed and "dram_hit_share" in printed and "ssd_hit_share" in printed
    run = read_results(out)
    assert {"hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd"} <= set(run.requests.columns)
    cols = run.requests
    assert (cols["hit_tokens_device"] + cols["hit_tokens_dram"] + cols["hit_tokens_ssd"] == cols["hit_tokens"]).all()
    summary = json.loads((out / "summary.json").read_text())
    dram, ssd = summary["tiers"]
    assert (dram["name"], dram["write"], dram["capacity_blocks"]) == ("dram", "write_back", 200)
    assert ssd["capacity_blocks"] == (1 << 30) // (16 * 128 * 1024)  # llama-3-8b: 128 KiB of KV per token
    assert dram["bytes_written"] == dram["blocks_stored"] * 16 * 128 * 1024
    total = summary["device_token_hit_rate"] + dram["hit_share"] + ssd["hit_share"]
    assert total == pytest.approx(summary["token_hit_rate"])
    config = run.manifest["config"]
    assert [t["name"] for t in config["tiers"]] == ["dram", "ssd"] and config["max_load_tokens"] == 4096


@pytest.mark.parametrize(("spec", "words"), [
    ("dram:blocks=0", ["--tier 'dram:blocks=0'", "blocks must be in [1,"]),
    ("dram:blocks=ten", ["blocks must be an integer", "'ten'"]),
    ("dram", ["exactly one of blocks=N and gib=X"]),
    ("dram:blocks=10:write=sideways", ["write must be", "'sideways'"]),
    ("dram:blocks=10:inclusion=exclusive", ["inclusion=exclusive needs write=write_back"]),
    ("dram:blocks=10:policy=nope", ["unknown policy 'nope'"]),
    ("dram:blocks=10:chunk", ["expected key=value", "'chunk'"]),
    ("9dram:blocks=10", ["NAME must start with a letter"]),
    ("device:blocks=10", ["reserved"]),
    ("dram:blocks=10,0", ["--tier 'dram:blocks=0'", "blocks must be in [1,"]),
    ("dram:blocks=10:chunk=1,2", ["only blocks= and gib= take several", "'chunk=1,2'"]),
])
def test_bad_tier_specs_exit_2_with_one_line_before_the_trace_is_read(tmp_path, capsys, spec, words):
    missing = tmp_path / "no-such-trace.jsonl"  # read only after every flag is checked
    line = cli_error(capsys, ["replay", str(missing), *BASE, "--tier", spec, "--out", str(tmp_path / "run")])
    assert all(w in line for w in words), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("extra", "words"), [
    (["--tier", "dram:gib=64"], ["--tier 'dram:gib=64'", "gib= needs --model"]),
    (["--tier", "dram:blocks=1,2:gib=1"], ["exactly one of blocks=N and gib=X"]),
    (["--tier", "dram:blocks=10", "--tier", "dram:blocks=20"], ["--tier", "'dram' given twice"]),
    (["--max-load-tokens", "64"], ["--max-load-tokens", "give --tier"]),
    (["--tier", "dram:blocks=10", "--max-load-tokens", "-1"], ["--max-load-tokens", "must be in [0,"]),
    (["--tier", "dram:blocks=10", "--model", "no-such-model"], ["--model", "no-such-model"]),
    (["--tier", "dram:gib=0.000001", "--model", "llama-3-8b"], ["--tier", "gib=1e-06 is 0 blocks"]),
])
def test_bad_tier_options_exit_2_with_one_line(tmp_path, capsys, extra, words):
    for command in ("replay", "sweep"):
        line = cli_error(capsys, [command, str(tmp_path / "absent.jsonl"), *BASE, *extra, "--out", str(tmp_path / "o")])
        assert all(w in line for w in words), line
        assert not (tmp_path / "o").exists()


def test_sweep_over_two_dram_sizes_gives_two_runs_and_flat_columns(tmp_path, capsys, trace):
    out = tmp_path / "sw"
    argv = ["sweep", str(trace), *BASE, "--tier", "dram:blocks=64,512", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dram_capacity_blocks" in printed and "dram_hit_share" in printed
    table = pd.read_parquet(out / "sweep.parquet")
    assert len(table) == 2 and table["run_id"].nunique() == 2
    assert list(table["dram_capacity_blocks"]) == [64, 512]  # ordered by tier size
    assert {"device_token_hit_rate", "dram_hit_share", "tiers"} <= set(table.columns)
    assert table["dram_hit_share"].iloc[1] >= table["dram_hit_share"].iloc[0] > 0
    total = table["device_token_hit_rate"] + table["dram_hit_share"]
    assert total.to_numpy() == pytest.approx(table["token_hit_rate"].to_numpy())
    assert json.loads(table["tiers"].iloc[0])[0]["name"] == "dram"
    trace_folder = next(p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(list((trace_folder / "runs").iterdir())) == 2
    assert main(argv) == 0  # resumed: the same two runs, nothing new
    assert len(pd.read_parquet(out / "sweep.parquet")) == 2


def test_two_tier_flags_with_two_sizes_each_make_four_runs(tmp_path, capsys, trace):
    argv = ["replay", str(trace), *BASE, "--tier", "dram:blocks=32,64", "--tier", "ssd:blocks=128,256",
            "--out", str(tmp_path / "sw")]
    assert main(argv) == 0
    table = pd.read_parquet(tmp_path / "sw" / "sweep.parquet")
    pairs = set(zip(table["dram_capacity_blocks"], table["ssd_capacity_blocks"], strict=True))
    assert pairs == {(32, 128), (32, 256), (64, 128), (64, 256)}


def test_python_grid_takes_a_list_of_tier_lists_and_plain_runs_keep_their_ids(tmp_path):
    w = synthetic_chat(40, seed=4)
    plain = grid([48], block_size=16, backend="python")
    axis = grid([48], block_size=16, backend="python", model="llama-3-8b", max_load_tokens=256,
                tiers=[[], [Tier(name="dram", capacity_blocks=64)], [Tier(name="dram", capacity_blocks=512)]])
    assert len(axis) == 3 and [len(c.tiers) for c in axis] == [0, 1, 1]
    assert axis[0].model is None and axis[0].max_load_tokens is None  # no tiers: nothing they could change
    assert plan(w, plain)[0][2] == plan(w, axis[:1])[0][2]  # the same run id as without tiers
    assert len({rid for _, _, rid in plan(w, axis)}) == 3
    one = grid([48], block_size=16, backend="python", tiers=[Tier(name="dram", capacity_blocks=64)])
    assert len(one) == 1 and one[0].tiers[0].capacity_blocks == 64
    table = run_sweep(w, axis, tmp_path / "sw", progress=False)
    assert list(table["dram_capacity_blocks"].fillna(0)) == [0, 64, 512]
    assert table["dram_hit_share"].isna().iloc[0] and "tiers" in table
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match="not a mix"):
        grid([48], tiers=[Tier(name="dram", capacity_blocks=64), [Tier(name="ssd", capacity_blocks=64)]])


def test_help_names_the_tier_flags(capsys):
    for command in ("replay", "sweep"):
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "--tier SPEC" in text and "--max-load-tokens N" in text and "--model" in text
