"""Sweeps killed with SIGKILL at chosen and at random moments, resumed, and run concurrently on one folder,
all with real processes. After every kill: the table (if any) is readable, never shrinks and lists only
complete runs; every run folder is complete. After the resume: the table equals a clean sweep's.

The sweeps use the Python engine (no JIT compile per process) on a small synthetic workload."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvlab.results import is_complete
from kvlab.results.faults import ENV
from kvlab.results.paths import TEMP_RE
from kvlab.sweep import TIMING_COLUMNS, grid, read_sweep, run_sweep
from kvlab.workload.generate import synthetic_chat

CAPACITIES = tuple(range(8, 200, 8))  # x 2 modes = 48 runs
KILL_PHASES = ("run-file", "run-commit", "table-commit", "between-runs")
N_REQUESTS = 100

DRIVER = """
import os, sys, time
import kvlab.sweep as S
from kvlab.workload.generate import synthetic_chat

out, caps = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
log = os.environ.get("SWEEP_TEST_LOG")
if log:
    real = S.replay
    def counted(w, config, **kw):
        with open(log, "a") as f:
            f.write(f"{config.capacity_blocks},{config.mode}\\n")
        return real(w, config, **kw)
    S.replay = counted
w = synthetic_chat(int(sys.argv[3]), seed=0)
configs = S.grid(caps, policies=["lru"], modes=["vllm", "ideal"], block_size=16, engine="python")
print("start", flush=True)
go = os.environ.get("SWEEP_TEST_GO")
while go and not os.path.exists(go):
    time.sleep(0.005)
S.run_sweep(w, configs, out, progress=False)
print("done", flush=True)
"""


def _configs(caps=CAPACITIES):
    return grid(caps, policies=["lru"], modes=["vllm", "ideal"], block_size=16, engine="python")


def sweep_child(out: str, fault: str | None) -> None:
    """A sweep process (forked from a server that has kvlab imported, so it starts in milliseconds)."""
    if fault:
        os.environ[ENV] = fault
    run_sweep(synthetic_chat(N_REQUESTS, seed=0), _configs(), out, progress=False)


@pytest.fixture(scope="module")
def forkserver():
    """Processes forked from a server with kvlab imported: real processes, killed with real SIGKILL."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvlab.sweep", "kvlab.workload.generate"])
    return ctx


def _start(ctx, out: Path, fault: str | None = None):
    proc = ctx.Process(target=sweep_child, args=(str(out), fault))
    proc.start()
    return proc


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The table of a clean, uninterrupted sweep, without timing columns."""
    out = tmp_path_factory.mktemp("clean") / "S"
    run_sweep(synthetic_chat(N_REQUESTS, seed=0), _configs(), out, progress=False)
    return _numbers(read_sweep(out))


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("driver") / "sweep_driver.py"
    path.write_text(DRIVER)
    return path


def _numbers(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=[c for c in TIMING_COLUMNS if c in table]).reset_index(drop=True)


def _cmd(driver: Path, out: Path, caps=CAPACITIES) -> list[str]:
    return [sys.executable, str(driver), str(out), ",".join(map(str, caps)), str(N_REQUESTS)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    return {**env, **extra}


def _check_after_kill(out: Path, before: set[str]) -> set[str]:
    """The state a kill may leave: complete run folders only, a readable table of complete runs that
    holds every run the previous table held. Returns the table's run ids."""
    runs = out / "runs"
    visible = [p for p in runs.iterdir() if not p.name.startswith(".")] if runs.exists() else []
    assert all(is_complete(p, p.name) for p in visible), "a visible run folder is incomplete"
    if not (out / "sweep.parquet").exists():
        assert not before
        return set()
    ids = set(read_sweep(out)["run_id"])
    assert before <= ids, "the sweep table shrank"
    assert ids <= {p.name for p in visible}
    return ids


def _check_final(out: Path, clean_table: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(_numbers(read_sweep(out)), clean_table)
    assert not [p.name for p in (out / "runs").iterdir() if p.name.startswith(".")], "temporaries left in runs/"
    assert not [p.name for p in out.iterdir() if TEMP_RE.match(p.name)], "temporaries left in the sweep folder"
    assert len(list((out / "runs").iterdir())) == len(clean_table)


def test_kills_at_fault_points_in_every_phase_then_resume(tmp_path, forkserver, clean):
    rng = np.random.default_rng(20240611)
    out = tmp_path / "S"
    kills: Counter[str] = Counter()
    ids: set[str] = set()
    for _round in range(2):  # at most 4 runs finish per round: the sweep never completes early
        for phase in rng.permutation(KILL_PHASES):
            n = int(rng.integers(1, 4 if phase == "run-file" else 3))
            proc = _start(forkserver, out, f"{phase}:{n}")
            proc.join(120)
            assert proc.exitcode in (0, -signal.SIGKILL), proc.exitcode
            kills[phase] += proc.exitcode == -signal.SIGKILL
            ids = _check_after_kill(out, ids)
    assert all(kills[p] >= 2 for p in KILL_PHASES), kills
    assert 0 < len(ids) < len(clean)
    proc = _start(forkserver, out)
    proc.join(120)
    assert proc.exitcode == 0
    _check_final(out, clean)


def test_random_sigkills_then_resume(tmp_path, forkserver, clean):
    rng = np.random.default_rng(7)
    t0 = time.perf_counter()
    ref = _start(forkserver, tmp_path / "reference")
    ref.join(120)
    whole = time.perf_counter() - t0  # one uninterrupted sweep process, under the current load
    out = tmp_path / "S"
    ids: set[str] = set()
    mid_sweep = 0
    for _ in range(5):
        proc = _start(forkserver, out)
        time.sleep(float(rng.uniform(0.05, 0.2)) * whole)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        mid_sweep += proc.exitcode == -signal.SIGKILL
        ids = _check_after_kill(out, ids)
    assert mid_sweep >= 3, mid_sweep
    proc = _start(forkserver, out)
    proc.join(120)
    assert proc.exitcode == 0
    _check_final(out, clean)


def test_concurrent_sweeps_on_one_folder(tmp_path, driver, clean):
    out, go, log = tmp_path / "S", tmp_path / "go", tmp_path / "computed.log"
    env = _env(SWEEP_TEST_GO=str(go), SWEEP_TEST_LOG=str(log))
    parts = (CAPACITIES[:8], CAPACITIES[4:])  # overlapping: 8 runs wanted by both
    procs = [subprocess.Popen(_cmd(driver, out, caps), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for caps in parts]
    for p in procs:
        assert p.stdout.readline().strip() == "start"
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    computed = log.read_text().splitlines()
    assert len(computed) == len(set(computed)) == 2 * len(CAPACITIES), "a run was computed twice"
    _check_final(out, clean)


def replace_child(out: str, value: int, fault: str | None) -> None:
    """Write a one-row run with ``value`` to ``out`` (replacing the run there), optionally killed."""
    from kvlab.results import build_manifest, write_results

    if fault:
        os.environ[ENV] = fault
    write_results(out, {"requests": pd.DataFrame({"x": [value]})}, {"v": value}, build_manifest({}, driver="t"))


def test_killed_replacement_leaves_one_complete_run(tmp_path, forkserver):
    from kvlab.results import read_results

    out = tmp_path / "run"

    def write(value: int, fault: str | None = None) -> int:
        proc = forkserver.Process(target=replace_child, args=(str(out), value, fault))
        proc.start()
        proc.join(60)
        return proc.exitcode

    assert write(1) == 0
    # killed while writing the new run's files, or with it complete but not yet swapped in: the old run stays
    for value, fault in ((2, "run-file:1"), (3, "run-file:2"), (4, "run-commit:1")):
        assert write(value, fault) == -signal.SIGKILL
        assert read_results(out).summary == {"v": 1}
    # killed after the swap, before the old copy is deleted: the new run is in place
    assert write(5, "run-swapped:1") == -signal.SIGKILL
    assert read_results(out).summary == {"v": 5}
    assert len(list(tmp_path.iterdir())) > 1  # the dead writers' temporaries
    assert write(6) == 0  # the next write removes the dead writers' leftovers
    assert read_results(out).summary == {"v": 6}
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
