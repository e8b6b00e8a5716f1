"""``kvlab simulate`` with tiers: ``--tier`` (the replay's spelling, medium=/link= included), ``--max-load-tokens``,
``--load-or-recompute``, ``--tier-overlap``, ``--tier-prefetch``, ``--prefetch-timeout-s``, ``--kv-layout``: each
flag is the SimConfig field of the same name (recorded in the manifest as such), the run equals the Python call,
and bad input ends in one ``kvlab: error:`` line naming the flag, before the trace is read."""

from __future__ import annotations

import json

import pytest
from _util import cli_error

from kvlab.cli import main
from kvlab.results import read_results
from kvlab.sim import simulate
from kvlab.tiers import Tier
from kvlab.workload import load_trace, save_jsonl

BASE = ["--capacity-blocks", "40", "--time-scale", "0.05", "--quiet"]
DRAM = "dram:blocks=200:write=write_back:link=pcie5_x16"
SSD = "ssd:gib=64:medium=nvme_gen4:link=pcie5_x16"


@pytest.fixture(scope="module")
def trace(shared_file, tmp_path_factory):
    """The first 120 requests of Mooncake conversation (512-token hash blocks), as a file."""
    w = load_trace(str(shared_file("mooncake/conversation_trace.jsonl")), format="mooncake").head(120)
    return w, save_jsonl(w, tmp_path_factory.mktemp("sim-tiers") / "conv.jsonl")


def test_simulate_with_timed_tiers_equals_the_python_call_and_records_the_fields(tmp_path, capsys, trace):
    w, path = trace
    out = tmp_path / "run"
    argv = ["simulate", str(path), *BASE, "--tier", DRAM, "--tier", SSD, "--max-load-tokens", "20000",
            "--load-or-recompute", "--tier-overlap", "--tier-prefetch", "timeout", "--prefetch-timeout-s", "0.5",
            "--kv-layout", "block", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for key in ("device_token_hit_rate", "dram_hit_share", "ssd_hit_share", "ttft_load_mean_s", "loaded_bytes"):
        assert key in printed, key
    run = read_results(out)
    config = run.manifest["config"]
    assert [t["name"] for t in config["tiers"]] == ["dram", "ssd"]
    assert config["tiers"][1]["medium"] == "nvme_gen4" and config["tiers"][0]["link"] == "pcie5_x16"
    assert (config["max_load_tokens"], config["load_or_recompute"], config["tier_overlap"], config["tier_prefetch"],
            config["prefetch_timeout_s"], config["kv_layout"]) == (20000, True, True, "timeout", 0.5, "block")
    direct = simulate(w.head(120), capacity_blocks=40, time_scale=0.05, max_load_tokens=20000, load_or_recompute=True,
                      tier_overlap=True, tier_prefetch="timeout", prefetch_timeout_s=0.5, kv_layout="block",
                      tiers=[Tier(name="dram", capacity_blocks=200, write="write_back", link="pcie5_x16"),
                             Tier(name="ssd", capacity_gib=64, medium="nvme_gen4", link="pcie5_x16")])
    cols = ["ttft_s", "queue_s", "ttft_load_s", "hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd",
            "load_decision"]
    assert run.requests[cols].reset_index(drop=True).equals(direct.requests[cols].reset_index(drop=True))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loaded_bytes"] == direct.summary["loaded_bytes"] and summary["tiers"][1]["name"] == "ssd"


def test_simulate_with_untimed_tiers_and_no_tiers(tmp_path, capsys, trace):
    _, path = trace
    assert main(["simulate", str(path), *BASE, "--tier", "dram:blocks=200"]) == 0
    printed = capsys.readouterr().out
    assert "dram_hit_share" in printed and "tier_stall_s" in printed
    assert main(["simulate", str(path), *BASE]) == 0
    assert "device_token_hit_rate" not in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "words"), [
    (["--tier-overlap"], ["--tier-overlap applies to the tiers below the device", "give --tier too"]),
    (["--load-or-recompute"], ["--load-or-recompute", "give --tier too"]),
    (["--max-load-tokens", "64"], ["--max-load-tokens", "give --tier too"]),
    (["--kv-layout", "block", "--tier", "dram:blocks=10"], ["--kv-layout needs timed tiers", "link="]),
    (["--tier-prefetch", "best_effort", "--tier", "dram:blocks=10:link=pcie5_x16"],
     ["--tier-prefetch", "needs a medium (medium=)"]),
    (["--tier-prefetch", "sometimes"], ["--tier-prefetch", "invalid choice", "'sometimes'"]),
    (["--kv-layout", "page"], ["--kv-layout", "invalid choice"]),
    (["--prefetch-timeout-s", "0", "--tier", DRAM, "--tier", SSD], ["--prefetch-timeout-s", "must be in (0"]),
    (["--prefetch-timeout-s", "soon"], ["--prefetch-timeout-s", "invalid float value"]),
    (["--max-load-tokens", "-1", "--tier", DRAM], ["--max-load-tokens", "must be in [0"]),
    (["--tier", "dram:blocks=10:link=pcie9"], ["--tier 'dram:blocks=10:link=pcie9'", "pcie5_x16"]),
    (["--tier", "dram:blocks=10:medium=pcie5_x16"], ["--tier", "medium", "nvme_gen4"]),
    (["--tier", "dram:blocks=10", "--tier", "ssd:blocks=20:link=pcie5_x16"], ["dram", "link (link=) is needed"]),
    (["--tier", "dram:blocks=10", "--tier", "dram:blocks=20"], ["--tier", "'dram' given twice"]),
    (["--tier", "dram:blocks=10,20"], ["--tier 'dram:blocks=10,20'", "blocks must be an integer"]),
    (["--tier", "dram:gib=0.001", "--block-size", "512"], ["--tier", "0 blocks of 67108864 bytes"]),
    (["--tier", DRAM, "--executor", "engine"], ["--tier medium=/link=", "--executor engine moves the real bytes"]),
    (["--tier", "dram:blocks=10", "--executor", "engine", "--tier-overlap"], ["--tier-overlap", "timed tiers"]),
    (["--tier", "dram:blocks=10", "--tier-dir", "somewhere"], ["--tier-dir", "needs --executor engine"]),
])
def test_bad_tier_flags_exit_2_with_one_line_naming_the_flag_before_the_trace_is_read(tmp_path, capsys, extra,
                                                                                      words):
    missing = tmp_path / "no-such-trace.jsonl"  # read only after every flag is checked
    line = cli_error(capsys, ["simulate", str(missing), *BASE, *extra, "--out", str(tmp_path / "run")])
    assert all(w in line for w in words), line
    assert "no-such-trace" not in line and not (tmp_path / "run").exists()


def test_engine_executor_serves_from_real_dram_and_disk_tiers(tmp_path, capsys):
    """``--executor engine --tier ... --tier-dir DIR``: the real engine under the scheduler loads reused blocks
    from a DRAM tier and a disk tier in DIR (the tiers' bytes are real; kvlab.engine.tiers), with the same tier
    columns as the simulator; timing flags are refused for the engine (its loads take the time they take)."""
    from kvlab.workload import synthetic_chat

    w = synthetic_chat(24, seed=3, n_tenants=2, system_tokens=(16, 48), n_docs=4, doc_tokens=(40, 120),
                       user_median=12, answer_median=10, vocab_size=1024, vocab_offset=8)
    path = save_jsonl(w, tmp_path / "chat.jsonl")
    out, disk = tmp_path / "run", tmp_path / "tiers"
    argv = ["simulate", str(path), "--executor", "engine", "--engine-model", "tiny-llama", "--block-size", "8",
            "--capacity-blocks", "24", "--max-num-seqs", "2", "--timer", "thread", "--quiet",
            "--tier", "dram:blocks=24", "--tier", "ssd:blocks=400", "--tier-dir", str(disk), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dram_hit_share" in printed and "ssd_hit_share" in printed
    run = read_results(out)
    engine = run.manifest["config"]["engine"]  # the tiers' identity: labels, stores, folder
    assert [t.split(":")[0] for t in engine["tiers"]] == ["dram", "ssd"] and engine["tier_stores"] == ["dram", "disk"]
    assert run.requests["hit_tokens_ssd"].sum() > 0 and run.requests["hit_tokens_dram"].sum() > 0
    ssd = [t for t in run.summary["tiers"] if t["name"] == "ssd"][0]
    assert ssd["store"] == "disk" and ssd["read_errors"] == ssd["write_errors"] == 0
    assert not disk.exists()  # the folder kvlab created for its block files is removed at the end of the run
    timing = ((["--tier-overlap"], "--tier-overlap"), (["--tier-prefetch", "best_effort"], "--tier-prefetch"))
    for extra, named in timing:
        assert named in cli_error(capsys, [*argv[:-2], "--out", str(tmp_path / "x"), *extra])
    no_engine = ["simulate", str(path), "--tier", "ssd:blocks=40", "--tier-dir", str(disk)]
    assert "--tier-dir" in cli_error(capsys, no_engine)
