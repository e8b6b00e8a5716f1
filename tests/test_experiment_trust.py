"""Issue 23 on ``kvlab run``: experiment files, sweep sizes, reserved names, the figures folder, analysis settings
against small workloads, definition hashes and the resume of a damaged table. Every case ends in one clear line
before any work, or in the correct result. Small generated traces and the Python replay core: seconds each."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_experiment import experiment_dict, write_trace, write_yaml

import kvlab.results
from kvlab.cli import main
from kvlab.errors import ConfigError, ResultsLocationError
from kvlab.experiment import Experiment, load_experiment, run_experiment
from kvlab.experiment.config import MAX_POINTS, count_points
from kvlab.experiment.definition import definition_hash


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "conv.jsonl", n=60)


def small(trace: Path, name: str = "y", **extra: object) -> dict:
    """One policy at two capacities (a hit-rate-vs-capacity figure)."""
    data = experiment_dict(trace, name=name)
    data["sweep"] = {"grid": {"cache.capacity_blocks": [4, 16]}}
    data.update(extra)
    return data


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(["run", *argv, "--quiet"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------- reading the file
def test_a_fifo_experiment_file_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)  # no writer: opening it would block forever
    rc, _, err = run_cli(capsys, str(fifo), "--results", str(tmp_path / "res"))
    assert rc == 2 and "FIFO" in one_error_line(err) and str(fifo) in err
    with pytest.raises(ConfigError, match="FIFO"):
        load_experiment(fifo)


def test_a_duplicate_top_level_key_is_refused(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "exp.yaml"
    file.write_text(f"name: dup\ntrace: {{path: {trace}}}\ncache: {{capacity_blocks: 100, policy: lru}}\n"
                    "cache: {capacity_blocks: 5000, policy: fifo}\n")
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    line = one_error_line(err)
    assert rc == 2 and "line 4" in line and "'cache'" in line and "twice" in line
    assert not (tmp_path / "res").exists()


# ----------------------------------------------------------------------------- sweep size
@pytest.mark.parametrize(("axes", "count"), [
    ({f"cache.policy_params.p{i}": list(range(100)) for i in range(6)}, 10**12),  # 6 axes x 100 values
    ({"cache.capacity_blocks": list(range(1, 1001)), "seed": list(range(1000))}, 10**6),
])
def test_a_huge_grid_is_counted_and_refused_before_planning(tmp_path: Path, trace: Path, axes: dict, count: int,
                                                            capsys: pytest.CaptureFixture) -> None:
    data = experiment_dict(trace, name="big")
    data["sweep"] = {"grid": axes}
    file = write_yaml(tmp_path / "exp.yaml", data)
    assert count_points(load_experiment(file).sweep) == count
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    line = one_error_line(err)
    assert rc == 2 and "sweep.grid" in line and f"{count:,} points" in line and f"{MAX_POINTS:,}" in line
    assert "--max-points" in line and "--limit" not in line
    assert not (tmp_path / "res").exists()


def test_max_points_raises_the_limit(tmp_path: Path, trace: Path) -> None:
    exp = Experiment(**small(trace, name="mp"))
    with pytest.raises(ConfigError, match=r"sweep.grid: cache.capacity_blocks \(2\) make 2 points, more than the "
                                          r"limit of 1; .*--max-points 2"):
        run_experiment(exp, tmp_path, progress=False, max_points=1)
    assert not (tmp_path / "mp").exists()
    assert len(run_experiment(exp, tmp_path, progress=False, max_points=2)) == 2


def test_out_of_memory_in_kvlab_run_names_the_sweep_not_limit(tmp_path: Path, trace: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    import kvlab.experiment

    def explode(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(kvlab.experiment, "run_experiment", explode)
    file = write_yaml(tmp_path / "exp.yaml", small(trace))
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"))
    line = one_error_line(err)
    assert rc == 2 and "out of memory" in line and "sweep.grid" in line and "trace.limit" in line
    assert "--limit" not in line


# ----------------------------------------------------------------------------- names and folders
@pytest.mark.parametrize("name", ["figures", "runs", "Figures", "quick"])
def test_reserved_names_are_refused(tmp_path: Path, trace: Path, name: str, capsys: pytest.CaptureFixture) -> None:
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name=name))
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"))
    line = one_error_line(err)
    assert rc == 2 and f"name: {name!r} is reserved" in line and str(file) in line
    assert not (tmp_path / "res").exists()
    with pytest.raises(ConfigError, match="is reserved"):
        Experiment(**small(trace, name=name))


def test_a_users_figure_file_is_refused_before_the_runs(tmp_path: Path, trace: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "res"
    mine = res / "figures" / "y34" / "hit_rate_vs_capacity.png"
    mine.parent.mkdir(parents=True)
    mine.write_text("MY OWN FIGURE")
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="y34"))
    rc, _, err = run_cli(capsys, str(file), "--results", str(res))
    line = one_error_line(err)
    assert rc == 2 and "hit_rate_vs_capacity.png" in line and "not written by kvlab" in line and "--no-figure" in line
    assert mine.read_text() == "MY OWN FIGURE"
    assert not (res / "y34").exists()  # refused before any run
    rc, out, _ = run_cli(capsys, str(file), "--results", str(res), "--no-figure")
    assert rc == 0 and "results written" in out and mine.read_text() == "MY OWN FIGURE"


def test_a_figures_file_is_refused_before_the_runs(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "res"
    res.mkdir()
    (res / "figures").write_text("user file")
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="y35"))
    rc, _, err = run_cli(capsys, str(file), "--results", str(res))
    line = one_error_line(err)
    assert rc == 2 and "is not a folder" in line and "figures" in line and "Errno" not in line
    assert not (res / "y35").exists() and (res / "figures").read_text() == "user file"


def test_kvlab_run_rewrites_its_own_figures(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="again"))
    for _ in range(2):  # the second run replaces the figure files kvlab wrote (listed, unchanged)
        rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"))
        assert rc == 0, err
        assert "figure:" in out
    assert (tmp_path / "res/figures/again/hit_rate_vs_capacity.png").is_file()


# ----------------------------------------------------------------------------- analysis vs the workload
def test_a_warmup_larger_than_the_trace_is_refused_before_the_runs(tmp_path: Path, trace: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    file = write_yaml(tmp_path / "exp.yaml", small(trace, analysis={"warmup_requests": 100000}))
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    line = one_error_line(err)
    assert rc == 2 and "analysis.warmup_requests: 100,000 leaves none of a run's 60 requests" in line
    assert "give fewer than 60" in line and str(file) in line and "n_batches" not in line
    assert not (tmp_path / "res").exists()


def test_trace_limit_10_uses_fewer_windows_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """trace.limit 10 < the default 20 windows: 10 windows of one request each, said in a note; the table printed
    and the figure written."""
    mc = write_trace(tmp_path / "mc300.jsonl", n=300, seed=1)
    data = {"name": "y10", "trace": {"path": str(mc), "limit": 10}, "cache": {"capacity_blocks": 300}}
    file = write_yaml(tmp_path / "exp.yaml", data)
    rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    assert rc == 0, err
    assert "note: 1 of 1 runs have fewer requests after the warm-up than analysis.windows (20; fewest: 10)" in out
    assert "10 windows" in out and "results written" in out
    table = kvlab.results.load("y10", results=str(tmp_path / "res"))
    from kvlab.analysis.runs import run_intervals

    ci = run_intervals(table, metrics=("token_hit_rate",), folder=tmp_path / "res/y10")
    assert ci["ci_windows"].tolist() == [10] and ci["warmed_requests"].tolist() == [10]
    lo, hi = ci["token_hit_rate_ci_low"].iloc[0], ci["token_hit_rate_ci_high"].iloc[0]
    assert lo <= ci["token_hit_rate_warmed"].iloc[0] <= hi and f"[{lo:.4f}, {hi:.4f}]" in out


def test_a_warmup_in_seconds_past_the_trace_gives_no_interval(tmp_path: Path, trace: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """A warm-up in seconds is on the driver's clock (not checkable before the runs): no interval ('-') and a
    note, never a late failure."""
    file = write_yaml(tmp_path / "exp.yaml", small(trace, analysis={"warmup_seconds": 1e9}))
    rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"))
    assert rc == 0, err
    assert "note: 2 of 2 runs" in out and "0 windows" in out and "results written" in out


def test_engine_experiment_on_a_6_request_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A 6-request request log on the engine driver (tiny-llama): 6 windows of one request, a note, rc 0."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rng = random.Random(0)
    system = [rng.randrange(8, 1000) for _ in range(20)]
    records = []
    for i in range(6):
        prompt = system + [rng.randrange(8, 1000) for _ in range(8 + 2 * i)]
        records.append({"request_id": f"r{i}", "arrival_time": 1.7e9 + i, "prompt_token_ids": prompt,
                        "output_token_ids": [rng.randrange(8, 1000) for _ in range(2)], "session_id": f"s{i % 2}"})
    log = tmp_path / "reqlog.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {"name": "r16", "trace": {"path": str(log), "format": "request-log", "limit": 6},
            "cache": {"block_size": 16, "capacity_blocks": 24}, "driver": "engine",
            "engine": {"time_scale": 0.01, "max_num_seqs": 1, "warmup": 0}}
    file = write_yaml(tmp_path / "r16.yaml", data)
    rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    assert rc == 0, err
    assert "fewest: 6" in out and "6 windows" in out and "results written" in out


def test_a_failure_after_the_runs_keeps_them_and_names_what_to_change(tmp_path: Path, trace: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture) -> None:
    import kvlab.cli_experiment

    def refuse(*args: object, **kwargs: object) -> None:
        raise ResultsLocationError("res/figures/x/hit_rate_vs_capacity.png: exists and was not written by kvlab")

    monkeypatch.setattr(kvlab.cli_experiment, "_experiment_figure", refuse)
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="late"))
    rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"))
    line = one_error_line(err)
    assert rc == 2 and "the 2 runs are complete in" in line and "--no-figure" in line and "kept" in line
    assert "results written" in out
    assert len(kvlab.results.load("late", results=str(tmp_path / "res"))) == 2


# ----------------------------------------------------------------------------- definitions
def test_definition_hash_ignores_comments_order_analysis_and_defaults(tmp_path: Path, trace: Path) -> None:
    data = small(trace, name="d")
    a = tmp_path / "a.yaml"
    a.write_text("# a comment\n" + yaml.safe_dump(data, sort_keys=True))
    b = tmp_path / "b.yaml"
    reordered = {"sweep": data["sweep"], "cache": {**data["cache"], "policy": "lru"}, "trace": data["trace"],
                 "name": "d", "analysis": {"windows": 7}, "description": "same runs"}
    b.write_text(yaml.safe_dump(reordered, sort_keys=False) + "# another comment\n")
    assert definition_hash(load_experiment(a)) == definition_hash(load_experiment(b))
    changed = Experiment(**{**data, "cache": {**data["cache"], "policy": "fifo"}})
    assert definition_hash(changed) != definition_hash(load_experiment(a))


def test_another_definition_under_the_same_name_is_refused(tmp_path: Path, trace: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "res"
    first = write_yaml(tmp_path / "exp.yaml", small(trace, name="same"))
    second = write_yaml(tmp_path / "expB.yaml", small(trace, name="same", cache={"capacity_blocks": 8,
                                                                                  "backend": "python",
                                                                                  "policy": "fifo"}))
    assert run_cli(capsys, str(first), "--results", str(res), "--no-figure")[0] == 0
    folder = res / "same"
    recorded = json.loads((folder / "manifest.json").read_text())["experiment"]
    assert recorded == {"name": "same", "definition": definition_hash(load_experiment(first))}
    for run in (folder / "runs").iterdir():
        assert json.loads((run / "manifest.json").read_text())["experiment"]["definition"] == recorded["definition"]
    before = sorted(p.name for p in (folder / "runs").iterdir())
    rc, _, err = run_cli(capsys, str(second), "--results", str(res), "--no-figure")
    line = one_error_line(err)
    assert rc == 2 and "another definition of experiment 'same'" in line and "--allow-redefine" in line
    assert sorted(p.name for p in (folder / "runs").iterdir()) == before
    with pytest.raises(ConfigError, match="another definition"):
        run_experiment(second, res, progress=False)
    rc, _, err = run_cli(capsys, str(second), "--results", str(res), "--no-figure", "--allow-redefine")
    assert rc == 0, err
    new = definition_hash(load_experiment(second))
    assert json.loads((folder / "manifest.json").read_text())["experiment"]["definition"] == new
    # the first file again: the folder now records the second definition
    assert run_cli(capsys, str(first), "--results", str(res), "--no-figure")[0] == 2


def test_a_replay_sweep_folder_is_not_an_experiment_folder(tmp_path: Path, trace: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(trace), "--capacity-blocks", "4", "8", "--out", str(tmp_path / "res/e0"),
                 "--quiet"]) == 0
    capsys.readouterr()
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="e0"))
    rc, _, err = run_cli(capsys, str(file), "--results", str(tmp_path / "res"), "--no-figure")
    line = one_error_line(err)
    assert rc == 2 and "kvlab replay" in line


# ----------------------------------------------------------------------------- resume
def test_a_resume_rebuilds_a_truncated_table(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    file = write_yaml(tmp_path / "exp.yaml", small(trace, name="kexp"))
    assert run_cli(capsys, str(file), "--results", str(tmp_path / "c4"), "--no-figure")[0] == 0
    table = tmp_path / "c4/kexp/sweep.parquet"
    good = pd.read_parquet(table)
    with open(table, "r+b") as f:
        f.truncate(100)
    rc, out, err = run_cli(capsys, str(file), "--results", str(tmp_path / "c4"), "--no-figure")
    assert rc == 0, err
    assert "results written" in out
    again = pd.read_parquet(table)
    assert sorted(again["run_id"]) == sorted(good["run_id"])
