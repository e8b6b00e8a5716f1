"""Experiments (kvlab.experiment, ``kvlab run``): the schema and its errors, sweeps, capacity units, the
process pool against a serial run, resume, SIGKILL of a real ``kvlab run`` process, two runs on one folder,
and the tidy loader. Fast: a small Mooncake-format trace written here, the Python replay backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import kvlab.results
from kvlab.cli import main
from kvlab.errors import ConfigError
from kvlab.experiment import Experiment, expand, load_experiment, run_experiment
from kvlab.experiment.config import points
from kvlab.experiment.sections import capacity_blocks
from kvlab.results import is_complete
from kvlab.results.faults import ENV
from kvlab.results.paths import TEMP_RE
from kvlab.sweep import TIMING_COLUMNS

REPO = Path(__file__).resolve().parents[1]
POLICIES = ["lru", "arc"]
CAPACITIES = [4, 16, 64]


def write_trace(path: Path, n: int = 160, seed: int = 0) -> Path:
    """A Mooncake-format trace (hash ids of 512-token blocks): conversations that extend their prefix."""
    rng = np.random.default_rng(seed)
    sessions: list[list[int]] = []
    next_id = 1
    lines = []
    for i in range(n):
        if not sessions or rng.random() < 0.25:
            sessions.append([0])  # a shared system block
        s = sessions[int(rng.integers(len(sessions)))]
        grow = int(rng.integers(1, 4))
        s.extend(range(next_id, next_id + grow))
        next_id += grow
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(s) - 7,
                                 "output_length": int(rng.integers(1, 200)), "hash_ids": list(s)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "conv.jsonl")


def experiment_dict(trace: Path, name: str = "exp", **cache: object) -> dict:
    return {
        "name": name,
        "trace": {"path": str(trace)},
        "cache": {"capacity_blocks": 8, "backend": "python", **cache},
        "sweep": {"grid": {"cache.policy": POLICIES, "cache.capacity_blocks": CAPACITIES}},
    }


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def drop_timing(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=[c for c in TIMING_COLUMNS if c in frame])


# ----------------------------------------------------------------------------- schema
@pytest.mark.parametrize(("change", "expected"), [
    ({"cache": {"capacity_blocks": 0}}, "cache.capacity_blocks: must be in [1, 1099511627776], got 0"),
    ({"cache": {"capacity_blocks": 4, "policy": "nope"}}, "cache.policy: unknown policy 'nope'; available: 2q"),
    ({"cache": {}}, "cache: give exactly one of capacity_blocks, capacity_tokens, capacity_gib, got none"),
    ({"cache": {"capacity_blocks": 4, "capacity_tokens": 9}}, "give exactly one of"),
    ({"cache": {"capacity_gib": 1.0}}, "cache.capacity_gib: GiB of KV need a model"),
    ({"cache": {"capacity_blocks": 4, "policy": "s3fifo", "policy_params": {"zzz": 1}}},
     "cache.policy_params: policy 's3fifo': unknown parameter 'zzz' (accepted: small_ratio"),
    ({"driver": "nope"}, "driver: must be 'replay', 'simulate' or 'engine', got 'nope'"),
    ({"model": "no-such-model"}, "model: no model profile 'no-such-model'"),
    ({"sweep": {"grid": {"cache.nope": [1]}}}, "sweep.grid: unknown field 'cache.nope'; cache has block_size"),
    ({"sweep": {"grid": {"policy": ["lru"]}}}, "unknown field 'policy'; allowed: trace, hasher, cache"),
    ({"sweep": {"zip": {"seed": [0, 1], "cache.policy": ["lru"]}}}, "sweep.zip: every axis needs the same number"),
    ({"colour": "blue"}, "colour: is not a known parameter"),
])
def test_errors_name_the_field_and_the_allowed_values(tmp_path: Path, change: dict, expected: str) -> None:
    data = {"name": "bad", "trace": {"path": "x.jsonl"}, "cache": {"capacity_blocks": 4}, **change}
    file = write_yaml(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_experiment(file)
    assert str(info.value).startswith(f"{file}: ")
    assert expected in str(info.value)


def test_a_bad_sweep_value_names_its_point(tmp_path: Path) -> None:
    data = {"name": "bad", "trace": {"path": "x"}, "cache": {"capacity_blocks": 4},
            "sweep": {"grid": {"cache.policy": ["lru", "arc"], "cache.capacity_blocks": [4, -1]}}}
    with pytest.raises(ConfigError, match=r"sweep point 2 \(cache.policy='lru', cache.capacity_blocks=-1\): "
                                          r"cache.capacity_blocks: must be in \[1, "):
        expand(Experiment(**data), "bad.yaml")


def test_block_size_must_be_a_multiple_of_the_hash_trace(tmp_path: Path, trace: Path) -> None:
    data = experiment_dict(trace, block_size=100)
    with pytest.raises(ConfigError, match="cache.block_size: 100 is not a multiple of the block size of trace .*"
                                          r"\(512 tokens per hash id\); allowed: multiples of 512"):
        run_experiment(Experiment(**data), tmp_path / "results", progress=False)
    assert not (tmp_path / "results").exists()  # refused before anything is written


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"a.yaml: not valid YAML at line \d+"):
        load_experiment(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="b.yaml: an experiment file is a mapping"):
        load_experiment(tmp_path / "b.yaml")
    with pytest.raises(ConfigError, match="c.yaml: no such experiment file"):
        load_experiment(tmp_path / "c.yaml")


def test_grid_and_zip_points() -> None:
    e = Experiment(name="p", trace={"path": "x"}, cache={"capacity_blocks": 4},
                   sweep={"grid": {"cache.policy": ["lru", "arc"], "cache.capacity_tokens": [1024, 4096]},
                          "zip": {"seed": [0, 1, 2], "cache.policy_params.small_ratio": [0.1, 0.2, 0.3]}})
    pts = points(e.sweep)
    assert len(pts) == 2 * 2 * 3
    assert pts[0] == {"cache.policy": "lru", "cache.capacity_tokens": 1024, "seed": 0,
                      "cache.policy_params.small_ratio": 0.1}
    assert pts[-1]["cache.policy"] == "arc" and pts[-1]["seed"] == 2
    # a policy parameter only some policies take: zip it with the policy instead
    e2 = Experiment(name="p", trace={"path": "x"}, cache={"capacity_blocks": 4},
                    sweep={"zip": {"cache.policy": ["s3fifo", "s3fifo"],
                                   "cache.policy_params.small_ratio": [0.05, 0.2]}})
    runs = expand(e2)
    assert [r.cache.policy_params for _, r in runs] == [{"small_ratio": 0.05}, {"small_ratio": 0.2}]
    e3 = Experiment(name="p", trace={"path": "x"}, cache={"capacity_blocks": 4},
                    sweep={"grid": {"cache.capacity_tokens": [1024, 4096]}})
    runs = expand(e3)  # an axis in tokens replaces the capacity given in blocks
    assert [(r.cache.capacity_blocks, r.cache.capacity_tokens) for _, r in runs] == [(None, 1024), (None, 4096)]


def test_capacity_units() -> None:
    e = Experiment(name="c", trace={"path": "x"}, cache={"capacity_gib": 1.0}, model="llama-3-8b")
    # Llama-3-8B: 128 KiB of KV per token in bf16, so 1 GiB = 8192 tokens = 16 blocks of 512
    assert capacity_blocks(e.cache, 512, e.model) == 16
    assert capacity_blocks(e.cache, 16, e.model) == 512
    e = Experiment(name="c", trace={"path": "x"}, cache={"capacity_tokens": 5000})
    assert capacity_blocks(e.cache, 512, None) == 9
    with pytest.raises(ConfigError, match="less than one block"):
        capacity_blocks(Experiment(name="c", trace={"path": "x"}, cache={"capacity_tokens": 100}).cache, 512, None)


# ----------------------------------------------------------------------------- running
def test_pool_equals_serial_and_resume_skips(tmp_path: Path, trace: Path) -> None:
    data = experiment_dict(trace)
    seen: list[str] = []
    serial = run_experiment(Experiment(**data), tmp_path / "serial", progress=False,
                            on_run=lambda p, s: seen.append(s))
    assert seen == ["done"] * 6
    pooled = run_experiment(Experiment(**data), tmp_path / "pool", workers=2, progress=False)
    pd.testing.assert_frame_equal(drop_timing(serial), drop_timing(pooled))
    assert list(serial["cache.policy"]) == ["lru"] * 3 + ["arc"] * 3
    assert list(serial["cache.capacity_blocks"]) == CAPACITIES * 2
    assert serial["token_hit_rate"].iloc[2] > serial["token_hit_rate"].iloc[0] > 0
    for rid in serial["run_id"]:  # the same files, byte for byte (the manifest holds host and times)
        a, b = tmp_path / "serial/exp/runs" / rid, tmp_path / "pool/exp/runs" / rid
        assert (a / "requests.parquet").read_bytes() == (b / "requests.parquet").read_bytes()
        manifest = json.loads((a / "manifest.json").read_text())
        assert manifest["host"] and manifest["wall_seconds"] > 0 and manifest["git_revision"] is not None
        assert manifest["trace"]["content_sha256"] and manifest["versions"]["kvlab"]
        assert manifest["experiment"]["point"]["cache.policy"] in POLICIES
    seen.clear()
    again = run_experiment(Experiment(**data), tmp_path / "serial", progress=False,
                           on_run=lambda p, s: seen.append(s))
    assert seen == ["skipped"] * 6
    pd.testing.assert_frame_equal(serial, again)
    seen.clear()
    run_experiment(Experiment(**data), tmp_path / "serial", progress=False, resume=False,
                   on_run=lambda p, s: seen.append(s))
    assert seen == ["done"] * 6


def test_load_one_tidy_frame(tmp_path: Path, trace: Path) -> None:
    file = write_yaml(tmp_path / "exp.yaml", experiment_dict(trace, name="tidy"))
    table = run_experiment(file, tmp_path / "results", progress=False)
    for how in ("tidy", str(tmp_path / "results/tidy"), str(file)):
        loaded = kvlab.results.load(how, results=str(tmp_path / "results"))
        assert len(loaded) == 6 and loaded["run_id"].is_unique
        assert {"cache.policy", "cache.capacity_blocks", "seed", "trace.path", "token_hit_rate"} <= set(loaded)
        assert set(loaded["run_id"]) == set(table["run_id"])


def test_cli_run_prints_a_table(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    data = experiment_dict(trace, name="cli")
    data["sweep"] = {"grid": {"cache.policy": ["lru"], "cache.capacity_blocks": [4, 8]},
                     "zip": {"seed": [0]}}
    file = write_yaml(tmp_path / "e.yaml", data)
    assert main(["run", str(file), "--results", str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "token_hit_rate" in out and "seed" in out and "results written to" in out
    bad = write_yaml(tmp_path / "bad.yaml", {**data, "cache": {"capacity_blocks": 4, "policy": "nope"}})
    assert main(["run", str(bad), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlab: error: {bad}: cache.policy: unknown policy 'nope'; available:")


def test_cli_run_intervals_paired_and_figure(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    """``kvlab run`` prints each run's batch-means interval and ``--paired A,B`` per point (the numbers of
    kvlab.analysis.runs on the same windows), and writes the experiment's figure with its data and caption."""
    from kvlab.analysis.runs import AnalysisSpec, paired, run_intervals

    data = experiment_dict(trace, name="cli-ci")
    data["analysis"] = {"warmup_requests": 20, "windows": 5}
    file = write_yaml(tmp_path / "e.yaml", data)
    results = tmp_path / "r"
    assert main(["run", str(file), "--results", str(results), "--quiet", "--paired", "arc,lru"]) == 0
    out = capsys.readouterr().out
    table = kvlab.results.load(str(file), results=str(results))
    spec = AnalysisSpec(warmup_requests=20, windows=5)
    ci = run_intervals(table, spec, metrics=("token_hit_rate",), folder=results / "cli-ci")
    for lo, hi in zip(ci["token_hit_rate_ci_low"], ci["token_hit_rate_ci_high"], strict=True):
        assert f"[{lo:.4f}, {hi:.4f}]" in out
    diff = paired(table, "arc", "lru", spec=spec, folder=results / "cli-ci")
    assert len(diff) == len(CAPACITIES)
    for _, row in diff.iterrows():
        assert f"{row['estimate']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]" in out
    figure = results / "figures" / "cli-ci"
    assert {p.name for p in figure.iterdir() if not p.name.startswith(".")} == {  # .kvlab-outputs.*: its listing
        f"hit_rate_vs_capacity.{x}" for x in ("png", "pdf", "parquet", "json")}
    drawn = pd.read_parquet(figure / "hit_rate_vs_capacity.parquet")
    assert len(drawn) == len(POLICIES) * len(CAPACITIES) and drawn["low"].le(drawn["high"]).all()
    # a --paired that names no policy of the experiment: one line, before any run is written
    assert main(["run", str(file), "--results", str(tmp_path / "r2"), "--paired", "lru,fifo"]) == 2
    assert capsys.readouterr().err.startswith("kvlab: error: --paired: give two different policies")
    assert not (tmp_path / "r2").exists()


# ----------------------------------------------------------------------------- kills and concurrency
def _kvlab_run(file: Path, results: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvlab.cli", "run", str(file), "--results", str(results),
                             "--quiet", *extra], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_folder(folder: Path) -> list[str]:
    """Every run folder complete (hidden temporaries aside); returns the complete run ids."""
    runs = [p for p in (folder / "runs").iterdir() if not p.name.startswith(".")]
    for p in runs:
        assert is_complete(p, p.name), p
    for p in (folder / "runs").iterdir():
        assert not p.name.startswith(".") or TEMP_RE.match(p.name), p
    return sorted(p.name for p in runs)


@pytest.mark.parametrize("fault", ["run-file:2", "run-commit:3", "between-runs:2"])
def test_sigkill_then_resume(tmp_path: Path, trace: Path, fault: str) -> None:
    file = write_yaml(tmp_path / "e.yaml", experiment_dict(trace, name="kill"))
    clean = run_experiment(file, tmp_path / "clean", progress=False)
    proc = _kvlab_run(file, tmp_path / "r", env={ENV: fault})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    kept = _check_folder(tmp_path / "r/kill")
    assert 0 < len(kept) < 6 or fault.startswith("run-file")
    proc = _kvlab_run(file, tmp_path / "r")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert _check_folder(tmp_path / "r/kill") == sorted(clean["run_id"])
    assert not [p for p in (tmp_path / "r/kill/runs").iterdir() if p.name.startswith(".")]  # leftovers cleaned
    resumed = kvlab.results.load(str(tmp_path / "r/kill"))
    order = {rid: i for i, rid in enumerate(clean["run_id"])}
    resumed = resumed.sort_values("run_id", key=lambda s: s.map(order)).reset_index(drop=True)
    pd.testing.assert_frame_equal(drop_timing(clean), drop_timing(resumed))
    for rid in kept:  # kept runs were not recomputed
        assert rid in set(clean["run_id"])


def test_sigkill_of_a_pooled_run_from_outside(tmp_path: Path, trace: Path) -> None:
    data = experiment_dict(trace, name="outside")
    data["sweep"]["grid"]["cache.capacity_blocks"] = [4, 8, 16, 32, 64, 128]
    file = write_yaml(tmp_path / "e.yaml", data)
    proc = _kvlab_run(file, tmp_path / "r", "--workers", "2")
    runs = tmp_path / "r/outside/runs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (runs.is_dir() and any(not p.name.startswith(".")
                                                                     for p in runs.iterdir())):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    _check_folder(tmp_path / "r/outside")
    time.sleep(1.5)  # the workers notice their parent is gone and exit after their run
    _check_folder(tmp_path / "r/outside")
    table = run_experiment(file, tmp_path / "r", workers=2, progress=False)
    assert len(table) == 12 and _check_folder(tmp_path / "r/outside") == sorted(table["run_id"])


DRIVER = """
import sys
from kvlab.experiment import run_experiment
statuses = []
run_experiment(sys.argv[1], sys.argv[2], progress=False, on_run=lambda p, s: statuses.append(s))
print(",".join(statuses))
"""


def test_two_runs_on_one_folder(tmp_path: Path, trace: Path) -> None:
    file = write_yaml(tmp_path / "e.yaml", experiment_dict(trace, name="twice"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(file), str(tmp_path / "r")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    statuses = [s for out, _ in outs for s in out.strip().split(",")]
    assert statuses.count("done") == 6 and statuses.count("skipped") == 6  # each run computed once
    assert len(_check_folder(tmp_path / "r/twice")) == 6
    assert len(kvlab.results.load(str(tmp_path / "r/twice"))) == 6


def test_pool_tasks_group_runs_of_one_policy(trace: Path) -> None:
    from kvlab.experiment.runner import PlannedRun, groups

    runs = [PlannedRun(pt, run, str(i)) for i, (pt, run) in enumerate(expand(Experiment(**experiment_dict(trace))))]
    assert groups(runs, 1) == [[0, 1, 2], [3, 4, 5]]  # lru, arc
    split = groups(runs, 2)  # at least two tasks per worker: the groups halved
    assert len(split) == 4 and sorted(i for g in split for i in g) == list(range(6))
    assert all(len({runs[i].run.cache.policy for i in g}) == 1 for g in split)


def test_the_example_experiment_plans(shared_traces: Path) -> None:
    from kvlab.experiment import plan

    file = REPO / "examples/experiments/lru_vs_frequency.yaml"
    experiment = load_experiment(file)
    planned = plan(experiment, str(file))
    assert len(planned) == 24 and len({p.run_id for p in planned}) == 24
    assert {p.run.cache.policy for p in planned} == {"lru", "lfu", "arc", "s3fifo"}


def test_a_failing_run_stops_the_pool(tmp_path: Path, trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = experiment_dict(trace, name="fails")
    data["cache"]["backend"] = "compiled"  # mru has no compiled kernel: its runs fail in a worker
    data["sweep"] = {"grid": {"cache.policy": ["lru", "mru"], "cache.capacity_blocks": [4, 8]}}
    with pytest.raises(ConfigError, match="no compiled kernel for policy 'mru'"):
        run_experiment(Experiment(**data), tmp_path / "r", workers=2, progress=False)
    _check_folder(tmp_path / "r/fails")
