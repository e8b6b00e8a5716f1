"""The Ray backend of ``kvlab run`` (kvlab.experiment.ray_backend) on a small local Ray instance: the same
results as the local backend file for file (but host and times), workers that read no trace file, resume and
locks held by the driver, task errors as one line, the CLI. Ray is a test dependency: without it these tests
skip, except under ``CI=true`` where they fail."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from test_experiment import drop_timing, experiment_dict, write_trace, write_yaml

from kvlab.cli import main
from kvlab.errors import ConfigError
from kvlab.experiment import Experiment, plan, run_experiment
from kvlab.experiment.ray_backend import RAY_MISSING
from kvlab.experiment.runner import compute_run, run_lock, workload_of, write_run
from kvlab.metrics import METRICS

# Summary keys that are wall-clock measurements (kvlab.metrics: replay_seconds, compile_seconds, sim_seconds...):
# they differ between any two computations of a run. Nothing else in a summary may differ.
WALL_TIMES = frozenset(n for n, m in METRICS.items() if m.definition.startswith("wall time"))
# Manifest fields that differ between two computations of one run, wherever they ran: the host that computed
# it (the same here: a local instance), its wall time, the creation time (whole seconds), and summary.json's
# checksum and size (its timings differ). Nothing else may differ.
MANIFEST_VOLATILE = {("host",), ("wall_seconds",), ("created",), ("files", "summary.json", "sha256"),
                     ("files", "summary.json", "bytes")}


@pytest.fixture(scope="module")
def ray_session() -> Iterator[object]:
    """One small local Ray instance for the module (Ray starts slowly); run_experiment uses it as is."""
    try:
        import ray
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("ray is not installed (CI=true: the Ray backend must be tested; pip install 'kvlab[ray]')")
        pytest.skip("needs ray (pip install 'kvlab[ray]')")
    for attempt in (1, 2):  # Ray waits 30 s (fixed) for its raylet: on an overloaded machine, try once more
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "conv.jsonl")


def replay_and_simulate(trace: Path, name: str) -> dict:
    """2 policies x 2 capacities x 2 drivers: replay runs (requests.parquet) and simulator runs (also
    timeseries.parquet)."""
    data = experiment_dict(trace, name=name)
    data["sweep"] = {"grid": {"driver": ["replay", "simulate"], "cache.policy": ["lru", "arc"],
                              "cache.capacity_blocks": [8, 64]}}
    return data


def differences(a: object, b: object, path: tuple = ()) -> set[tuple]:
    """The paths at which two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {d for k in set(a) | set(b) for d in differences(a.get(k), b.get(k), (*path, k))}
    return set() if a == b else {path}


def test_ray_results_equal_local_file_for_file(ray_session: object, trace: Path, tmp_path: Path) -> None:
    experiment = Experiment(**replay_and_simulate(trace, "same"))
    plan(experiment)  # this process loads the trace (and keeps it) ...
    hidden = trace.with_name("hidden.jsonl")
    trace.rename(hidden)  # ... so a worker reading the trace file would fail
    try:
        statuses: list[str] = []
        on_ray = run_experiment(experiment, tmp_path / "ray", backend="ray", progress=False,
                                on_run=lambda p, s: statuses.append(s))
    finally:
        hidden.rename(trace)
    assert statuses == ["done"] * 8
    local = run_experiment(experiment, tmp_path / "local", workers=1, progress=False)
    assert {"replay_seconds", "sim_seconds"} <= WALL_TIMES and len(local) == 8
    pd.testing.assert_frame_equal(local.drop(columns=list(WALL_TIMES & set(local))),
                                  on_ray.drop(columns=list(WALL_TIMES & set(on_ray))))
    for where in ("local", "ray"):  # the table, rebuilt at most every few seconds, holds every run at the end
        table = pd.read_parquet(tmp_path / where / "same/sweep.parquet")
        assert sorted(table["run_id"]) == sorted(local["run_id"])
    a, b = tmp_path / "local/same/runs", tmp_path / "ray/same/runs"
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == sorted(local["run_id"])
    timeseries = 0
    for rid in os.listdir(a):
        files = sorted(os.listdir(a / rid))
        assert files == sorted(os.listdir(b / rid))
        for name in files:
            if name.endswith(".parquet"):
                timeseries += name == "timeseries.parquet"
                assert (a / rid / name).read_bytes() == (b / rid / name).read_bytes(), (rid, name)
        ma, mb = (json.loads((d / rid / "manifest.json").read_text()) for d in (a, b))
        assert differences(ma, mb) <= MANIFEST_VOLATILE, (rid, differences(ma, mb) - MANIFEST_VOLATILE)
        assert ma["host"] == mb["host"] and mb["wall_seconds"] > 0
        assert mb["command"] == sys.argv  # the driver's command, not the Ray worker's
        sa, sb = (json.loads((d / rid / "summary.json").read_text()) for d in (a, b))
        assert differences(sa, sb) <= {(k,) for k in WALL_TIMES}, (rid, differences(sa, sb))
        assert list(sa) == list(sb)  # same keys in the same order
    assert timeseries == 4  # the simulator's runs


def test_resume_and_locks_are_the_drivers(ray_session: object, trace: Path, tmp_path: Path) -> None:
    experiment = Experiment(**experiment_dict(trace, name="resume"))  # 2 policies x 3 capacities
    first = run_experiment(experiment, tmp_path, backend="ray", progress=False)
    folder = tmp_path / "resume"
    shutil.rmtree(folder / "runs" / first["run_id"][0])
    busy = next(p for p in plan(experiment) if p.run_id == first["run_id"][1])
    shutil.rmtree(folder / "runs" / busy.run_id)
    lock = run_lock(folder, busy.run_id)
    lock.__enter__()  # another writer holds this run: the driver defers it, waits, then finds it complete

    def other_writer() -> None:
        time.sleep(1.0)
        write_run(folder, compute_run(busy.run, busy.point, folder / "runs" / busy.run_id, workload_of(busy.run)))
        lock.__exit__(None, None, None)

    writer = threading.Thread(target=other_writer)
    writer.start()
    seen: dict[str, str] = {}
    again = run_experiment(experiment, tmp_path, backend="ray", progress=False,
                           on_run=lambda p, s: seen.setdefault(p.run_id, s))
    writer.join()
    assert seen[first["run_id"][0]] == "done" and seen[busy.run_id] == "skipped"
    assert sorted(seen.values()) == ["done"] + ["skipped"] * 5
    pd.testing.assert_frame_equal(drop_timing(first), drop_timing(again))


def test_a_failing_task_is_one_line(ray_session: object, trace: Path, tmp_path: Path) -> None:
    data = experiment_dict(trace, name="fails", backend="compiled")  # mru has no compiled kernel
    data["sweep"] = {"grid": {"cache.policy": ["mru"], "cache.capacity_blocks": [4, 8]}}
    with pytest.raises(ConfigError, match="no compiled kernel for policy 'mru'"):
        run_experiment(Experiment(**data), tmp_path, backend="ray", progress=False)
    assert not [p for p in (tmp_path / "fails/runs").iterdir()]


def test_cli_backend_ray(ray_session: object, trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = experiment_dict(trace, name="cli")
    data["sweep"] = {"grid": {"cache.policy": ["lru"], "cache.capacity_blocks": [4, 8]}}
    file = write_yaml(tmp_path / "e.yaml", data)
    assert main(["run", str(file), "--runner", "ray", "--results", str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "token_hit_rate" in out and "results written to" in out
    assert len(os.listdir(tmp_path / "r/cli/runs")) == 2


def test_user_errors_without_ray(trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    experiment = Experiment(**experiment_dict(trace, name="noray"))
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when it is not installed
    with pytest.raises(ConfigError) as info:
        run_experiment(experiment, tmp_path / "r", backend="ray", progress=False)
    assert str(info.value) == RAY_MISSING == "--runner ray needs ray: pip install 'kvlab[ray]'"
    with pytest.raises(ConfigError, match=r"address \(--address\): only with backend ray"):
        run_experiment(experiment, tmp_path / "r", address="auto", progress=False)
    with pytest.raises(ConfigError, match=r"backend \(--runner\): must be one of local, ray, got 'dask'"):
        run_experiment(experiment, tmp_path / "r", backend="dask", progress=False)
    assert not (tmp_path / "r").exists()  # refused before anything is written
    file = write_yaml(tmp_path / "e.yaml", experiment_dict(trace, name="noray"))
    for flag in ("--runner", "--backend"):  # --backend: the old spelling of --runner
        assert main(["run", str(file), flag, "ray", "--results", str(tmp_path / "r")]) == 2
        assert capsys.readouterr().err == f"kvlab: error: {RAY_MISSING}\n"


def test_ray_is_an_extra_of_its_own_and_a_test_dependency() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("ray") for d in project["dependencies"])  # a replay-only install needs no Ray
    assert any(d.startswith("ray>=") for d in project["optional-dependencies"]["ray"])
    assert "kvlab[ray]" in project["optional-dependencies"]["dev"]


def test_slow_tasks_are_dispatched_first(trace: Path) -> None:
    from kvlab.experiment import expand
    from kvlab.experiment.runner import PlannedRun, groups

    data = experiment_dict(trace, backend="auto")  # lru: compiled kernel; mru: none, the Python core
    data["sweep"] = {"grid": {"cache.policy": ["lru", "mru"], "cache.capacity_blocks": [4, 16, 64]}}
    runs = [PlannedRun(pt, run, str(i)) for i, (pt, run) in enumerate(expand(Experiment(**data)))]
    assert groups(runs, 1) == [[3, 4, 5], [0, 1, 2]]  # mru's task first, both in run order
    data["sweep"] = {"grid": {"driver": ["replay", "simulate"]}}
    runs = [PlannedRun(pt, run, str(i)) for i, (pt, run) in enumerate(expand(Experiment(**data)))]
    assert groups(runs, 1) == [[1], [0]]  # the simulator's run first


def test_an_address_where_nothing_answers_is_one_line(ray_session: object, trace: Path, tmp_path: Path) -> None:
    import socket

    from kvlab.experiment.ray_backend import check_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--address 127.0.0.1:{port}: cannot join the Ray cluster \(nothing "
                                          r"answers there: .*\); give 'auto' or the head node's HOST:PORT"):
        run_experiment(Experiment(**experiment_dict(trace, name="far")), tmp_path / "r", backend="ray",
                       address=f"127.0.0.1:{port}", progress=False)
    assert not (tmp_path / "r").exists()  # refused before anything is written (Ray would retry for minutes)
    with socket.socket() as s:  # something listening: left to Ray
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_address(f"127.0.0.1:{s.getsockname()[1]}")
    check_address("auto")
