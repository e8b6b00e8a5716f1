"""The parameter schema (kvlab.schema): every bad value refused at construction with one line naming the
field, its flag and the allowed range; large capacities cost the workload's size, not the capacity's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab.cli import main
from kvlab.errors import ConfigError
from kvlab.policies import available_policies
from kvlab.replay import ReplayConfig, encode, replay, resolve_config
from kvlab.sim import simulate
from kvlab.sim.simulator import SimConfig, serving_demand_blocks
from kvlab.workload.generate import synthetic_chat

BAD_FLOATS = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize(
    ("field", "value", "flag", "expect"),
    [
        ("capacity_blocks", 0, "--capacity-blocks", "[1, "),
        ("capacity_blocks", -3, "--capacity-blocks", "[1, "),
        ("capacity_blocks", 10**15, "--capacity-blocks", "[1, "),
        ("capacity_blocks", 2.5, "--capacity-blocks", "integer"),
        ("block_size", 0, "--block-size", "[1, 65536]"),
        ("block_size", -16, "--block-size", "[1, 65536]"),
        ("mode", "exact", "--mode", "'vllm' or 'ideal'"),
        ("hash", "md5", "--hash", "sha256"),
        ("backend", "gpu", "--backend", "'auto'"),
        ("root_seed", -1, "--root-seed", "[0, "),
        ("seed", 2**64, "--seed", "[0, "),
        ("policy", "lruu", "--policy", "available: "),
        ("policy_params", {"nope": 1}, "--policy-param", "nope"),
        ("colour", "red", "--colour", "not a known parameter"),
    ],
)
def test_replay_config_refuses_with_field_flag_and_range(field, value, flag, expect):
    kwargs = {"capacity_blocks": 10, field: value}
    with pytest.raises(ConfigError) as err:
        ReplayConfig(**kwargs)
    text = str(err.value)
    assert "\n" not in text
    assert f"ReplayConfig.{field} ({flag})" in text and expect in text


@pytest.mark.parametrize("field", ["rate", "time_scale", "gpu_memory_utilization"])
@pytest.mark.parametrize("value", BAD_FLOATS + [0.0, -1.0])
def test_sim_config_refuses_nan_inf_and_non_positive_floats(field, value):
    with pytest.raises(ConfigError) as err:
        SimConfig(**{field: value})
    assert f"SimConfig.{field}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "instances", "tensor_parallel",
                                   "capacity_blocks", "block_size"])
@pytest.mark.parametrize("value", [0, -5])
def test_sim_config_refuses_non_positive_ints(field, value):
    with pytest.raises(ConfigError, match=rf"SimConfig\.{field} \(--{field.replace('_', '-')}\): must be in \[1, "):
        SimConfig(**{field: value})


def test_sim_config_rate_and_time_scale_exclusive():
    with pytest.raises(ConfigError, match="not both"):
        SimConfig(rate=2.0, time_scale=3.0)


def test_resolved_config_fills_block_size_and_policy_defaults():
    w = synthetic_chat(20, seed=0)
    r = resolve_config(w, ReplayConfig(capacity_blocks=10, policy="s3fifo"))
    assert r.block_size == 16
    assert r.policy_params == {"small_ratio": 0.1, "ghost_ratio": 0.9, "move_to_main_threshold": 2}
    assert resolve_config(w, ReplayConfig(capacity_blocks=10, block_size=16, policy="s3fifo")) == r


def _columns(result) -> dict:
    cols = ["hit_blocks", "new_blocks", "evictions", "cached_blocks", "orphan_blocks", "admitted"]
    return {c: result.requests[c].to_numpy() for c in cols}


def test_huge_capacity_allocates_the_workload_and_keeps_every_number():
    """Every policy (Python core; compiled for a few): capacity 10**12 gives exactly the numbers of the
    workload's demand bound and of 3x the bound, records 10**12, and allocates no more than the bound."""
    w = synthetic_chat(80, seed=3)
    enc = encode(w, ReplayConfig(capacity_blocks=1, block_size=16))
    bound = int(enc.num_blocks.sum()) + 1
    for policy in available_policies():
        engines = ("python", "compiled") if policy in ("lru", "arc", "s3fifo") else ("python",)
        for engine in engines:
            runs = [replay(w, capacity_blocks=c, policy=policy, block_size=16, engine=engine, encoded=enc)
                    for c in (bound, 3 * bound, 10**12)]
            base = _columns(runs[0])
            for run in runs[1:]:
                for name, col in _columns(run).items():
                    np.testing.assert_array_equal(col, base[name], err_msg=f"{policy}/{engine}/{name}")
            assert runs[2].summary["capacity_blocks"] == 10**12


def test_simulator_huge_capacity_same_numbers():
    w = synthetic_chat(60, seed=4)
    bound = serving_demand_blocks(w, 16)
    a = simulate(w, capacity_blocks=bound, block_size=16)
    b = simulate(w, capacity_blocks=10**12, block_size=16)
    for col in ("hit_blocks", "ttft_s", "evictions", "admitted", "preemptions"):
        np.testing.assert_array_equal(a.requests[col].to_numpy(), b.requests[col].to_numpy())
    assert b.summary["capacity_blocks"] == 10**12


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvlab: error:") and "Traceback" not in err
    return err


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [f'{{"timestamp": {i}, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, {i + 3}]}}'
            for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--block-size", "0"], "--block-size"),
        (["--limit", "0"], "--limit"),
        (["--limit", "-5"], "--limit"),
        (["--capacity-blocks", "0"], "--capacity-blocks"),
        (["--capacity-blocks", "x"], "--capacity-blocks"),
        (["--policy", "nope"], "--policy"),
        (["--policy-param", "x"], "--policy-param"),
        (["--hash", "md5"], "--hash"),
    ],
)
def test_cli_replay_refuses_before_work(capsys, tmp_path, trace, argv, flag):
    base = ["replay", str(trace), "--format", "mooncake", "--capacity-blocks", "10", "--out", str(tmp_path / "o")]
    err = _cli_error(capsys, base + argv)
    assert flag in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
@pytest.mark.parametrize("flag", ["--rate", "--time-scale", "--gpu-memory-utilization"])
def test_cli_simulate_refuses_bad_floats(capsys, trace, flag, value):
    err = _cli_error(capsys, ["simulate", str(trace), "--format", "mooncake", flag, value])
    assert flag in err


def test_cli_debug_shows_the_traceback(trace):
    with pytest.raises(ConfigError):
        main(["replay", str(trace), "--format", "mooncake", "--capacity-blocks", "0", "--debug"])
    with pytest.raises(ConfigError):
        main(["--debug", "replay", str(trace), "--format", "mooncake", "--capacity-blocks", "0"])


def test_cli_huge_capacity_runs_and_records_it(capsys, tmp_path, trace):
    out = tmp_path / "big"
    assert main(["replay", str(trace), "--format", "mooncake", "--capacity-blocks", str(10**12), "--out", str(out),
                 "--quiet"]) == 0
    import json

    assert json.loads((out / "summary.json").read_text())["capacity_blocks"] == 10**12


def test_old_names_read_under_new_ones(tmp_path):
    """kvlab.names: ReplayConfig(engine=...) is backend; an engine summary's p50_ttft_s is ttft_p50_s;
    results written under old names read back under new ones."""
    import json

    from kvlab.names import canonical_keys

    assert ReplayConfig(capacity_blocks=5, engine="python").backend == "python"
    w = synthetic_chat(20, seed=0)
    result = replay(w, capacity_blocks=100, engine="python")
    assert result.summary["backend"] == "python" and result.summary["engine"] == "python"
    assert canonical_keys({"p50_ttft_s": 1.0, "bytes_per_block": 2}) == {"ttft_p50_s": 1.0, "kv_bytes_per_block": 2}
    out = result.save(tmp_path / "run")
    summary = json.loads((out / "summary.json").read_text())
    assert "backend" in summary and "engine" not in summary
