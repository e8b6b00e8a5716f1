"""``kvlab run EXPERIMENT.yaml``: planning an experiment, computing and writing one run (the backends that run
the plan are kvlab.experiment.backends).

Layout (a kvlab sweep folder, docs/results.md, so the reliability machinery is reused as is)::

    RESULTS/<experiment>/manifest.json        kind "sweep"
    RESULTS/<experiment>/runs/<run_id>/       one complete run each (kvlab.results.write_results)
    RESULTS/<experiment>/sweep.parquet        one row per complete run, config fields as columns
    RESULTS/<experiment>/.locks/<run_id>.lock

A run's ``run_id`` is kvlab.results.identity's: the resolved driver config and the trace content (a replay
run has the same id as the same run made by ``kvlab sweep``). Every run is planned (and every config
checked) before the first one starts. A run is skipped when complete on disk; otherwise it is computed
under its lock by exactly one process and written atomically, so a kill at any instant loses at most the
runs in progress and leaves nothing half-written; rerunning resumes. Computing a run (:func:`compute_run`)
and writing it (:func:`write_run`) are separate, so a run computed elsewhere (a pool worker, a Ray task) is
written the same way; each run's numbers do not depend on which process computed it.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvlab.errors import ConfigError, ResultsError
from kvlab.experiment.config import MAX_POINTS, Experiment, expand
from kvlab.experiment.drivers import compute, identity_of, workload_of
from kvlab.results import checkpoint, locked, run_id, write_results
from kvlab.results.runs import LOCKS, RUNS, SCANNER, load_runs
from kvlab.results.runs import experiment_folder as folder_of
from kvlab.results.store import build_manifest
from kvlab.workload.workload import Workload


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


@dataclass
class RunOutput:
    """Everything run ``run_id`` writes (:func:`write_run`): its tables, summary and manifest (``host`` and
    ``wall_seconds``: where and how long it was computed). Computing it writes nothing, so it can be made
    in another process or on another machine and written by the driver."""

    run_id: str
    tables: dict[str, pd.DataFrame]
    summary: dict
    manifest: dict


def compute_run(run: Experiment, point: dict, run_dir: Path, workload: Workload) -> RunOutput:
    """Compute the run of ``run_dir`` (named by its planned run id) on ``workload`` (the run's trace, already
    loaded: nothing is read here); ResultsError if the id changed since planning. ``run_dir`` only names it."""
    rid = run_dir.name
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
    return RunOutput(rid, tables, summary, manifest)


def write_run(folder: Path, output: RunOutput, definition: str | None = None) -> None:
    """Write a computed run to ``folder/runs/<run_id>/`` atomically (the caller holds the run's lock);
    ``definition``: the experiment's definition hash (kvlab.experiment.definition), recorded in the manifest's
    ``experiment`` entry."""
    if definition is not None:
        output.manifest["experiment"] = {**output.manifest["experiment"], "definition": definition}
    write_results(folder / RUNS / output.run_id, output.tables, output.summary, output.manifest)
    checkpoint("between-runs")


def is_done(folder: Path, rid: str) -> bool:
    """Whether run ``rid`` is complete in ``folder`` (verified once per on-disk state)."""
    return SCANNER.row(folder / RUNS / rid) is not None


def run_lock(folder: Path, rid: str, *, blocking: bool = True):  # noqa: ANN201 - kvlab.results.locked's
    """The lock of run ``rid`` of ``folder`` (:func:`kvlab.results.locked`): held by the one process computing
    and writing it."""
    return locked(folder / LOCKS / f"{rid}.lock", blocking=blocking)


def execute(out: str, run_dict: dict, point: dict, rid: str, resume: bool, definition: str | None = None) -> str:
    """Make run ``rid`` of folder ``out`` complete: ``"skipped"`` if it already was, ``"done"`` after computing
    and writing it (under its lock: one process computes a run, others wait and then skip it); ``definition``:
    as :func:`write_run`'s."""
    folder = Path(out)
    run = Experiment(**run_dict)
    if resume and is_done(folder, rid):
        return "skipped"
    with run_lock(folder, rid):
        if resume and is_done(folder, rid):
            return "skipped"
        write_run(folder, compute_run(run, point, folder / RUNS / rid, workload_of(run)), definition)
    return "done"


# ----------------------------------------------------------------------------- planning
@dataclass
class PlannedRun:
    point: dict
    run: Experiment
    run_id: str


def plan(experiment: Experiment, source: str | None = None, *, max_points: int = MAX_POINTS) -> list[PlannedRun]:
    """Every point of the experiment with its run id; every config checked (traces loaded once). The points are
    counted before any is made (more than ``max_points``: ConfigError naming ``sweep.grid``)."""
    out = []
    for point, run in expand(experiment, source, max_points=max_points):
        try:
            rid = run_id(identity_of(run, workload_of(run)))
        except ConfigError as exc:
            where = ", ".join(f"{k}={v!r}" for k, v in point.items())
            raise ConfigError(f"{source + ': ' if source else ''}{'point ' + where + ': ' if where else ''}{exc}") \
                from None
        out.append(PlannedRun(point, run, rid))
    return out


def experiment_folder(experiment: Experiment, results: str | os.PathLike = "results") -> Path:
    """``results/<safe name of the experiment>``."""
    return folder_of(experiment.name, results)


# ----------------------------------------------------------------------------- tasks
def groups(runs: list[PlannedRun], workers: int) -> list[list[int]]:
    """Indices of ``runs`` in pool tasks: runs of one trace, driver and policy together (a worker compiles
    or loads a policy's kernels and hashes a trace once per task, not once per run), the largest groups
    halved until there are at least two tasks per worker; in run order, except that tasks of slow runs
    (:func:`slow`) come first, so that they do not end last on one worker while the others wait."""
    keyed: dict[tuple, list[int]] = {}
    for i, p in enumerate(runs):
        keyed.setdefault((p.run.trace.model_dump_json(), p.run.driver, p.run.cache.policy), []).append(i)
    out = list(keyed.values())
    while len(out) < 2 * workers and max(len(g) for g in out) > 1:
        big = max(range(len(out)), key=lambda k: len(out[k]))
        g = out.pop(big)
        out[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return sorted(out, key=lambda g: not slow(runs[g[0]].run))


def slow(run: Experiment) -> bool:
    """Whether ``run`` is one of the slow kind, several times a compiled replay's time: a simulator run or a
    replay on the Python core (a policy without compiled hooks, ``backend: python``). A scheduling hint only."""
    from kvlab.policies import make_policy
    from kvlab.replay.replay import uses_compiled

    if run.driver != "replay":
        return True
    return not uses_compiled(make_policy(run.cache.policy, **run.cache.policy_params), run.cache.backend,
                             run.cache.tiers)


def execute_group(jobs: list[tuple]) -> list[str]:
    """:func:`execute` of each job in turn (one pool task)."""
    return [execute(*job) for job in jobs]


# ----------------------------------------------------------------------------- the experiment table
def load(folder: str | os.PathLike, planned: list[PlannedRun] | None = None) -> pd.DataFrame:
    """The experiment table of ``folder``: one row per complete run (``planned``: these runs, in this order;
    ResultsError if one is not complete)."""
    return load_runs(folder, None if planned is None else [p.run_id for p in planned])


__all__ = ["PlannedRun", "RunOutput", "compute_run", "execute", "execute_group", "experiment_folder", "groups", "load",
           "plan", "write_run"]
