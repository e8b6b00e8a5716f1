"""``--capacity-gib`` and ``--model`` on ``kvlab replay``, ``sweep`` and ``simulate``: GiB of KV become whole
blocks by the conversion experiment files use (kvlab.experiment.sections.capacity_blocks), the same run as the
block capacity; every mistake is one ``kvlab: error:`` line before any work."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from _util import cli_error

from kvlab.cli import main
from kvlab.experiment.sections import CacheSpec, capacity_blocks
from kvlab.workload import save_jsonl, synthetic_chat

MODEL = "llama-3-8b"
GIB = 0.1  # 51 blocks of 16 tokens of llama-3-8b KV (2 MiB per block, rounded down)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return save_jsonl(synthetic_chat(12, seed=2), tmp_path_factory.mktemp("units") / "chat.jsonl")


def blocks_of(gib: float, block_size: int = 16) -> int:
    return capacity_blocks(CacheSpec(capacity_gib=gib), block_size, MODEL)


def run_id(folder) -> str:
    return json.loads((folder / "manifest.json").read_text())["run_id"]


def test_replay_capacity_gib_is_the_run_of_its_blocks(tmp_path, trace, capsys):
    blocks = blocks_of(GIB)
    assert blocks == 51
    assert main(["replay", str(trace), "--capacity-gib", str(GIB), "--model", MODEL, "--out",
                 str(tmp_path / "gib"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{GIB:g} GiB = {blocks} blocks" in out
    assert main(["replay", str(trace), "--capacity-blocks", str(blocks), "--out", str(tmp_path / "blocks"),
                 "--quiet"]) == 0
    assert run_id(tmp_path / "gib") == run_id(tmp_path / "blocks")
    gib = json.loads((tmp_path / "gib" / "summary.json").read_text())
    assert gib["capacity_blocks"] == blocks


def test_sweep_capacity_gib_sweeps_the_same_runs_as_blocks(tmp_path, trace):
    values = [0.1, 0.2]
    assert main(["sweep", str(trace), "--capacity-gib", *map(str, values), "--model", MODEL, "--out",
                 str(tmp_path / "gib"), "--quiet"]) == 0
    assert main(["sweep", str(trace), "--capacity-blocks", *(str(blocks_of(v)) for v in values), "--out",
                 str(tmp_path / "blocks"), "--quiet"]) == 0
    gib, blocks = (pd.read_parquet(tmp_path / name / "sweep.parquet") for name in ("gib", "blocks"))
    assert sorted(gib["run_id"]) == sorted(blocks["run_id"])
    assert sorted(gib["capacity_blocks"]) == [blocks_of(v) for v in values]


def test_simulate_capacity_gib_is_the_simulation_of_its_blocks(trace, capsys):
    def summary(args: list[str]) -> dict[str, str]:
        assert main(["simulate", str(trace), "--quiet", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        return dict(line.split(None, 1) for line in lines
                    if not line.startswith(("--capacity-gib", "sim_seconds")))  # sim_seconds: wall time

    gib = summary(["--capacity-gib", str(GIB)])  # simulate's --model defaults to llama-3-8b
    assert gib == summary(["--capacity-blocks", str(blocks_of(GIB))])
    assert gib["capacity_blocks"] == str(blocks_of(GIB))


BAD = [
    (["--capacity-gib", "1", "--capacity-blocks", "8", "--model", MODEL], "not allowed with argument"),
    ([], "one of the arguments --capacity-blocks --capacity-gib is required"),
    (["--capacity-gib", "1"], "--capacity-gib: GiB of KV need a model"),
    (["--capacity-gib", "nan", "--model", MODEL], "(--capacity-gib): must be a finite number, got nan"),
    (["--capacity-gib", "inf", "--model", MODEL], "(--capacity-gib): must be a finite number, got inf"),
    (["--capacity-gib", "-inf", "--model", MODEL], "(--capacity-gib): must be a finite number, got -inf"),
    (["--capacity-gib", "0", "--model", MODEL], "(--capacity-gib): must be in (0, 1073741824], got 0.0"),
    (["--capacity-gib", "-2", "--model", MODEL], "(--capacity-gib): must be in (0, 1073741824], got -2.0"),
    (["--capacity-gib", "1e-9", "--model", MODEL, "--block-size", "16"],
     "--capacity-gib 1e-09 (2,097,152 bytes per block of llama-3-8b) is less than one block of 16 tokens"),
    (["--capacity-gib", "1", "--model", "no-such-model"], "--model: no model profile 'no-such-model'"),
    (["--capacity-blocks", "8", "--model", MODEL], "nothing uses it here: give --tier too, or --capacity-gib"),
]


@pytest.mark.parametrize("command", ["replay", "sweep"])
@pytest.mark.parametrize(("extra", "message"), BAD)
def test_replay_and_sweep_refuse_bad_capacities_before_reading_the_trace(tmp_path, capsys, command, extra,
                                                                          message):
    missing = tmp_path / "not-read.jsonl"  # the flags are checked before the trace is looked at
    out = ["--out", str(tmp_path / "out")] if command == "sweep" else []
    line = cli_error(capsys, [command, str(missing), *extra, *out])
    assert message in line, line
    assert not (tmp_path / "out").exists()


def test_model_is_accepted_when_a_tier_or_capacity_gib_uses_it(tmp_path, trace, capsys):
    assert main(["replay", str(trace), "--capacity-blocks", "48", "--tier", "dram:blocks=64", "--model", MODEL,
                 "--quiet"]) == 0
    assert main(["replay", str(trace), "--capacity-gib", "0.1", "--model", MODEL, "--quiet"]) == 0


SIM_BAD = [
    (["--capacity-gib", "1", "--capacity-blocks", "8"], "not allowed with argument"),
    (["--capacity-gib", "nan"], "(--capacity-gib): must be a finite number, got nan"),
    (["--capacity-gib", "0"], "(--capacity-gib): must be in (0, 1073741824], got 0.0"),
    (["--capacity-gib", "1e-9", "--block-size", "16"], "is less than one block of 16 tokens"),
    (["--capacity-gib", "1", "--kv-dtype", "fp8"], "not --kv-dtype fp8: give --capacity-blocks"),
    (["--capacity-gib", "1", "--executor", "engine"], "the engine executor's pool is sized in blocks"),
]


@pytest.mark.parametrize(("extra", "message"), SIM_BAD)
def test_simulate_refuses_bad_capacities_before_reading_the_trace(tmp_path, capsys, extra, message):
    line = cli_error(capsys, ["simulate", str(tmp_path / "not-read.jsonl"), *extra])
    assert message in line, line
