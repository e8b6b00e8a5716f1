"""``kvlab run EXPERIMENT.yaml``: every run of an experiment, resumable, serially or in a process pool.

Layout (a kvlab sweep folder, docs/results.md, so the reliability machinery is reused as is)::

    RESULTS/<experiment>/manifest.json        kind "sweep"
    RESULTS/<experiment>/runs/<run_id>/       one complete run each (kvlab.results.write_results)
    RESULTS/<experiment>/sweep.parquet        one row per complete run, config fields as columns
    RESULTS/<experiment>/.locks/<run_id>.lock

A run's ``run_id`` is kvlab.results.identity's: the resolved driver config and the trace content (a replay
run has the same id as the same run made by ``kvlab sweep``). Every run is planned (and every config
checked) before the first one starts. A run is skipped when complete on disk; otherwise it is computed
under its lock by exactly one process and written atomically, so a kill at any instant loses at most the
runs in progress and leaves nothing half-written; rerunning resumes. Workers (``workers > 1``) are
processes of a pool; each run's numbers do not depend on which process computed it.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.errors import ConfigError, ResultsError
from kvlab.experiment.config import Experiment, expand, load_experiment
from kvlab.experiment.drivers import compute, identity_of, workload_of
from kvlab.results import check_output_location, checkpoint, locked, run_id, safe_name, write_results
from kvlab.results.store import build_manifest

RUNS, LOCKS = "runs", ".locks"


# ----------------------------------------------------------------------------- one run
def flat_columns(point: dict, run: Experiment) -> dict:
    """The run's config as table columns: every field by its dotted path (lists and empty maps as text)."""
    import json

    out: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list | dict):
            out[prefix] = json.dumps(value, sort_keys=True, default=str)
        else:
            out[prefix] = value

    walk("", run.model_dump(mode="json", exclude={"sweep", "description"}))
    out["experiment"] = out.pop("name")
    out["sweep_point"] = json.dumps(point, sort_keys=True, default=str)
    return out


def execute(out: str, run_dict: dict, point: dict, rid: str, resume: bool) -> str:
    """Make run ``rid`` of folder ``out`` complete: ``"skipped"`` if it already was, ``"done"`` after computing
    and writing it (under its lock: one process computes a run, others wait and then skip it)."""
    from kvlab.sweep import _SCANNER

    folder = Path(out)
    run = Experiment(**run_dict)
    run_dir = folder / RUNS / rid
    if resume and _SCANNER.row(run_dir) is not None:
        return "skipped"
    with locked(folder / LOCKS / f"{rid}.lock"):
        if resume and _SCANNER.row(run_dir) is not None:
            return "skipped"
        workload = workload_of(run)
        identity = identity_of(run, workload)
        if run_id(identity) != rid:
            raise ResultsError(f"{run_dir}: run id changed while planning (the trace file was modified?)")
        t0 = time.perf_counter()
        tables, summary, config, driver = compute(run, workload)
        wall = time.perf_counter() - t0
        manifest = build_manifest(config, trace={"source": workload.source, "sha256": workload.checksum,
                                                 **workload.identity()},
                                  seed=run.seed, driver=driver, identity=identity)
        manifest.update(host=socket.gethostname(), wall_seconds=wall,
                        experiment={"name": run.name, "point": point, "run": run.model_dump(mode="json"),
                                    "columns": flat_columns(point, run)})
        write_results(run_dir, tables, summary, manifest)
        checkpoint("between-runs")
    return "done"


# ----------------------------------------------------------------------------- planning
@dataclass
class PlannedRun:
    point: dict
    run: Experiment
    run_id: str


def plan(experiment: Experiment, source: str | None = None) -> list[PlannedRun]:
    """Every point of the experiment with its run id; every config checked (traces loaded once)."""
    out = []
    for point, run in expand(experiment, source):
        try:
            rid = run_id(identity_of(run, workload_of(run)))
        except ConfigError as exc:
            where = ", ".join(f"{k}={v!r}" for k, v in point.items())
            raise ConfigError(f"{source + ': ' if source else ''}{'point ' + where + ': ' if where else ''}{exc}") \
                from None
        out.append(PlannedRun(point, run, rid))
    return out


def experiment_folder(experiment: Experiment, results: str | os.PathLike = "results") -> Path:
    return Path(results) / safe_name(experiment.name)


# ----------------------------------------------------------------------------- the pool
def groups(runs: list[PlannedRun], workers: int) -> list[list[int]]:
    """Indices of ``runs`` in pool tasks: runs of one trace, driver and policy together (a worker compiles
    or loads a policy's kernels and hashes a trace once per task, not once per run), the largest groups
    halved until there are at least two tasks per worker; in run order."""
    keyed: dict[tuple, list[int]] = {}
    for i, p in enumerate(runs):
        keyed.setdefault((p.run.trace.model_dump_json(), p.run.driver, p.run.cache.policy), []).append(i)
    out = list(keyed.values())
    while len(out) < 2 * workers and max(len(g) for g in out) > 1:
        big = max(range(len(out)), key=lambda k: len(out[k]))
        g = out.pop(big)
        out[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return out


def execute_group(jobs: list[tuple]) -> list[str]:
    """:func:`execute` of each job in turn (one pool task)."""
    return [execute(*job) for job in jobs]


def _watch_parent(parent: int) -> None:
    """In a pool worker: exit when the process that started the pool is gone (killed with SIGKILL), after
    the run in progress (its write is atomic either way)."""
    while True:
        time.sleep(0.5)
        if not _alive(parent):
            os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _init_worker(parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _pool(workers: int) -> ProcessPoolExecutor:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvlab.experiment.runner", "kvlab.replay", "kvlab.sweep"])
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),))


# ----------------------------------------------------------------------------- the experiment
def run_experiment(
    experiment: Experiment | str | os.PathLike,
    results: str | os.PathLike = "results",
    *,
    workers: int = 1,
    resume: bool = True,
    progress: bool = True,
    on_run: Callable[[PlannedRun, str], None] | None = None,
) -> pd.DataFrame:
    """Run every point of ``experiment`` (an :class:`Experiment` or a YAML path) into
    ``results/<name>/`` and return one row per point, in sweep order (config fields as dotted columns, then
    the run's summary). ``workers`` > 1: a process pool of that size. ``resume``: complete runs on disk are
    kept (not recomputed); without it every run is recomputed and replaced."""
    from kvlab.sweep import prepare_folder, rebuild_table

    source = None
    if not isinstance(experiment, Experiment):
        source = str(experiment)
        experiment = load_experiment(experiment)
    if workers < 1:
        raise ConfigError(f"workers (--workers): must be at least 1, got {workers}")
    folder = experiment_folder(experiment, results)
    check_output_location(folder, "sweep")  # before any trace is read
    planned = plan(experiment, source)
    folder = prepare_folder(folder, "sweep")
    (folder / RUNS).mkdir(exist_ok=True)
    unique = list({p.run_id: p for p in planned}.values())
    bar = tqdm(total=len(unique), disable=not progress, desc=f"run {experiment.name}", unit="run")
    jobs = [(str(folder), p.run.model_dump(mode="python"), p.point, p.run_id, resume) for p in unique]
    try:
        if workers == 1 or len(unique) <= 1:
            for p, job in zip(unique, jobs, strict=True):
                status = execute(*job)
                _finished(bar, folder, p, status, on_run, rebuild_table)
        else:
            pool = _pool(min(workers, len(unique)))
            try:
                futures = {pool.submit(execute_group, [jobs[i] for i in group]): [unique[i] for i in group]
                           for group in groups(unique, workers)}
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        for p, status in zip(futures[f], f.result(), strict=True):
                            _finished(bar, folder, p, status, on_run, rebuild_table)
            except BaseException:  # an error or Ctrl-C: start no further run (those running end atomically)
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown()
    finally:
        bar.close()
    return load(folder, planned)


def _finished(bar, folder: Path, p: PlannedRun, status: str, on_run, rebuild_table) -> None:  # noqa: ANN001
    if status == "done":
        rebuild_table(folder)
    bar.set_postfix_str(f"{p.run.cache.policy} {status}", refresh=False)
    bar.update(1)
    if on_run is not None:
        on_run(p, status)


def load(folder: str | os.PathLike, planned: list[PlannedRun] | None = None) -> pd.DataFrame:
    """The experiment table of ``folder``: one row per complete run (``planned``: these runs, in this order;
    ResultsError if one is not complete)."""
    from kvlab.sweep import _SCANNER, TABLE

    folder = Path(folder)
    if not (folder / RUNS).is_dir():
        raise ResultsError(f"{folder}: not an experiment results folder (no {RUNS}/); run kvlab run first")
    rows = _SCANNER.rows(folder / RUNS)
    if planned is None:
        if not rows and not (folder / TABLE).exists():
            return pd.DataFrame()
        return _tidy(pd.DataFrame(rows))
    where = {r["run_id"]: r for r in rows}
    missing = [p.run_id for p in planned if p.run_id not in where]
    if missing:
        raise ResultsError(f"{folder / RUNS / missing[0]}: run not complete after the experiment")
    return _tidy(pd.DataFrame([where[p.run_id] for p in planned]))


def _tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """Config columns (dotted paths) first, then the rest, index reset."""
    config = [c for c in frame.columns if "." in c or c in ("experiment", "driver", "seed", "model", "hardware")]
    rest = [c for c in frame.columns if c not in config]
    return frame[config + rest].reset_index(drop=True)


__all__ = ["PlannedRun", "execute", "experiment_folder", "load", "plan", "run_experiment"]
