"""``kvlab run`` backends: where an experiment's runs are computed. Planning, one run and the layout are
kvlab.experiment.runner's; this module runs the plan.

* ``local``: in this process (``workers`` 1) or a ``forkserver`` pool of processes, each run computed and
  written by :func:`~kvlab.experiment.runner.execute` under its lock; pool workers exit when this process
  is killed (after their run in progress, whose write is atomic).
* ``ray``: Ray tasks compute groups of runs and this process writes them (kvlab.experiment.ray_backend).

Either way every run is planned and checked first, complete runs are skipped (resume), each run is written
atomically by exactly one process, and the results are the same files (but host and times).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.arguments import kind_of
from kvlab.errors import ConfigError
from kvlab.experiment.config import MAX_POINTS, Experiment, check_size, load_experiment
from kvlab.experiment.drivers import workload_of
from kvlab.experiment.runner import PlannedRun, execute, execute_group, experiment_folder, groups, load, plan
from kvlab.results import check_output_location
from kvlab.results.runs import RUNS

# ----------------------------------------------------------------------------- the experiment
BACKENDS = ("local", "ray")
#: seconds between rebuilds of ``sweep.parquet`` while runs complete (each rebuild reads every run and rewrites
#: the table: after every run that is quadratic in the runs); it is always rebuilt once the runs are done
TABLE_INTERVAL_S = 2.0


def check_arguments(experiment: object, results: object) -> None:
    """ConfigError naming the argument unless ``experiment`` is an :class:`Experiment` or a path (str or
    ``os.PathLike``) and ``results`` a path. A dict is refused, not guessed at: ``Experiment(**data)`` makes one
    (validated, errors naming the field)."""
    if not isinstance(experiment, Experiment | str | os.PathLike):
        hint = "; build one with Experiment(**data)" if isinstance(experiment, dict) else ""
        raise ConfigError(f"experiment: expected an Experiment or the path of an experiment YAML file, got "
                          f"{kind_of(experiment)}{hint}")
    if not isinstance(results, str | os.PathLike):
        raise ConfigError(f"results: expected the results root folder (a str or path), got {kind_of(results)}")


def run_experiment(
    experiment: Experiment | str | os.PathLike,
    results: str | os.PathLike = "results",
    *,
    workers: int | None = None,
    backend: str = "local",
    address: str | None = None,
    resume: bool = True,
    progress: bool = True,
    on_run: Callable[[PlannedRun, str], None] | None = None,
    max_points: int = MAX_POINTS,
    allow_redefine: bool = False,
    before_runs: Callable[[list[PlannedRun]], None] | None = None,
) -> pd.DataFrame:
    """Run every point of ``experiment`` (an :class:`Experiment` or a YAML path) into
    ``results/<name>/`` and return one row per point, in sweep order (config fields as dotted columns, then
    the run's summary). ``resume``: complete runs on disk are kept (not recomputed); without it every run is
    recomputed and replaced.

    ``backend="local"``: ``workers`` (default 1) > 1 is a process pool of that size. ``backend="ray"``
    (:mod:`kvlab.experiment.ray_backend`): runs are Ray tasks and this process writes their results;
    ``address`` None starts a local Ray instance of ``workers`` CPUs (default: every core), ``"auto"`` or
    ``host:port`` joins a cluster. The results are the same files either way (but host and times).

    Checked before anything is written (ConfigError / ResultsLocationError, one line): the sweep's size
    (``max_points``, default :data:`~kvlab.experiment.config.MAX_POINTS`, counted before the points are made),
    the results folder (this experiment's, and this definition's unless ``allow_redefine``:
    :func:`~kvlab.experiment.checks.check_definition`), every run's config, the ``analysis:`` warm-up against
    each run's requests (:func:`~kvlab.experiment.checks.check_analysis`), then ``before_runs(plan)`` (a
    caller's own checks, e.g. kvlab run's figures folder). The experiment's definition hash is recorded in the
    folder's manifest and in each run's. ``sweep.parquet`` is rebuilt at the end even when every run was
    already complete (a damaged table is replaced from the runs)."""
    from kvlab.experiment.checks import check_analysis, check_definition
    from kvlab.experiment.definition import record
    from kvlab.sweep import prepare_folder, rebuild_table

    check_arguments(experiment, results)
    if backend not in BACKENDS:
        raise ConfigError(f"backend (--runner): must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if address is not None and backend != "ray":
        raise ConfigError(f"address (--address): only with backend ray (--runner ray), got backend {backend!r}")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers (--workers): must be at least 1, got {workers}")
    if backend == "ray":
        from kvlab.experiment.ray_backend import check_address, import_ray

        import_ray()  # ray missing, or nothing at --address: one line before any work
        if address is not None:
            check_address(address)
    source = None
    if not isinstance(experiment, Experiment):
        source = str(experiment)
        experiment = load_experiment(experiment)
    check_size(experiment.sweep, max_points, source)  # counted before anything is read or expanded
    folder = experiment_folder(experiment, results)
    check_output_location(folder, "sweep", experiment=True)  # before any trace is read; no replay sweep's folder
    entry = record(experiment)
    check_definition(folder, entry, allow_redefine=allow_redefine)
    planned = plan(experiment, source, max_points=max_points)
    check_analysis(experiment, {p.run_id: len(workload_of(p.run)) for p in planned}, source)
    if before_runs is not None:
        before_runs(planned)
    folder = prepare_folder(folder, "sweep", experiment=entry)
    (folder / RUNS).mkdir(exist_ok=True)
    unique = list({p.run_id: p for p in planned}.values())
    bar = tqdm(total=len(unique), disable=not progress, desc=f"run {experiment.name}", unit="run")

    table = {"at": time.monotonic()}  # when the table was last rebuilt

    def finished(p: PlannedRun, status: str) -> None:
        if status == "done" and time.monotonic() - table["at"] >= TABLE_INTERVAL_S:
            rebuild_table(folder, experiment=entry)
            table["at"] = time.monotonic()
        bar.set_postfix_str(f"{p.run.cache.policy} {status}", refresh=False)
        bar.update(1)
        if on_run is not None:
            on_run(p, status)

    definition = entry["definition"]
    try:
        if backend == "ray":
            from kvlab.experiment.ray_backend import run_on_ray

            run_on_ray(folder, unique, workers=workers, address=address, resume=resume, finished=finished,
                       definition=definition)
        else:
            run_locally(folder, unique, workers=workers or 1, resume=resume, finished=finished, definition=definition)
    finally:
        bar.close()
        # always (also after an error or Ctrl-C, and when every run was already complete): the table holds every
        # run written, and a table damaged since it was written (truncated, corrupt) is replaced
        rebuild_table(folder, experiment=entry)
    return load(folder, planned)


def run_locally(folder: Path, unique: list[PlannedRun], *, workers: int, resume: bool,
                finished: Callable[[PlannedRun, str], None], definition: str | None = None) -> None:
    """The local backend: :func:`execute` of each run, in this process (``workers`` 1) or in a pool of
    ``workers`` processes (tasks: :func:`groups`); ``finished(run, status)`` after each, in this process;
    ``definition``: the experiment's definition hash, recorded in each run's manifest."""
    jobs = [(str(folder), p.run.model_dump(mode="python"), p.point, p.run_id, resume, definition) for p in unique]
    if workers == 1 or len(unique) <= 1:
        for p, job in zip(unique, jobs, strict=True):
            finished(p, execute(*job))
        return
    pool = _pool(min(workers, len(unique)))
    try:
        futures = {pool.submit(execute_group, [jobs[i] for i in group]): [unique[i] for i in group]
                   for group in groups(unique, workers)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                for p, status in zip(futures[f], f.result(), strict=True):
                    finished(p, status)
    except BaseException:  # an error or Ctrl-C: start no further run (those running end atomically)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


# ----------------------------------------------------------------------------- the local pool
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
    ctx.set_forkserver_preload(["kvlab.experiment.backends", "kvlab.replay", "kvlab.sweep"])
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),))


__all__ = ["BACKENDS", "run_experiment", "run_locally"]
