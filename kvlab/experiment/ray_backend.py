"""``kvlab run --runner ray``: the runs of an experiment as Ray tasks, their results written by the driver.

What travels: each distinct trace (a :class:`~kvlab.workload.workload.Workload`, loaded and checked once by
the driver while planning) goes into the object store once (``ray.put``); a task gets that reference, the
configs of a group of runs (:func:`~kvlab.experiment.runner.groups`: one trace, driver and policy, so a
worker compiles a policy's kernels and hashes the trace once per task) and returns one
:class:`~kvlab.experiment.runner.RunOutput` per run (tables as DataFrames, summary, manifest). Workers read
no trace file and write nothing: no shared file system is assumed. The driver writes every run with the
local backend's atomic path (:func:`~kvlab.experiment.runner.write_run`), so the results folder is the same
file for file but for the run's ``host``, ``wall_seconds``, ``created`` and the timings in its summary.

Locks and resume hold for the driver: a run complete on disk is skipped before anything is dispatched; a
run is dispatched only while the driver holds its lock (until it is written), so a second ``kvlab run`` on
the folder (either backend) waits for it and then skips it; runs whose lock another process holds are
dispatched after it released them, and only if still incomplete.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType

from kvlab.errors import ConfigError
from kvlab.experiment.config import Experiment
from kvlab.experiment.runner import (
    PlannedRun,
    RunOutput,
    compute_run,
    groups,
    is_done,
    run_lock,
    workload_of,
    write_run,
)
from kvlab.results.runs import RUNS
from kvlab.workload.workload import Workload

RAY_MISSING = "--runner ray needs ray: pip install 'kvlab[ray]'"


def import_ray() -> ModuleType:
    """The ``ray`` module; ConfigError (one line) when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


def check_address(address: str) -> None:
    """ConfigError (one line) when ``address`` is ``host:port`` and nothing accepts a connection there within
    5 s (Ray itself would retry for minutes); other forms (``auto``, ``ray://...``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"--address {address}: cannot join the Ray cluster (nothing answers there: "
                          f"{exc.strerror or exc}); give 'auto' or the head node's HOST:PORT") from None


@contextmanager
def connected(address: str | None, workers: int | None) -> Iterator[ModuleType]:
    """Ray, initialised for the block: a session this process already has is used as is; else ``address``
    None starts a local instance of ``workers`` CPUs (default every core; no dashboard; its logs and
    temporary files in Ray's own temporary folder), shut down after the block; ``"auto"`` or ``host:port``
    joins a running cluster (disconnected after the block, the cluster left running)."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    common = {"include_dashboard": False, "logging_level": logging.WARNING, "configure_logging": True}
    if address is not None:
        check_address(address)
    try:
        if address is None:
            ray.init(address="local", num_cpus=workers or os.cpu_count() or 1, **common)
        else:
            ray.init(address=address, **common)
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exceptions (a raylet that did not start in time)
        ray.shutdown()
        why = str(exc).splitlines()[0] if str(exc) else repr(exc)
        where = "--runner ray: cannot start a local Ray instance" if address is None else \
            f"--address {address}: cannot join the Ray cluster"
        raise ConfigError(f"{where} ({why})") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def compute_group(workload: Workload, jobs: list[tuple[dict, dict, str]], command: list[str]) -> list[RunOutput]:
    """One Ray task: :func:`~kvlab.experiment.runner.compute_run` of each ``(run config, sweep point, run
    folder)`` on ``workload`` (resolved from the object store); the manifests record the driver's
    ``command``. Writes nothing."""
    outputs = []
    for run_dict, point, run_dir in jobs:
        output = compute_run(Experiment(**run_dict), point, Path(run_dir), workload)
        output.manifest["command"] = command
        outputs.append(output)
    return outputs


def run_on_ray(folder: Path, unique: list[PlannedRun], *, workers: int | None, address: str | None, resume: bool,
               finished: Callable[[PlannedRun, str], None], definition: str | None = None) -> None:
    """Make every run of ``unique`` (distinct run ids, planned by this process) complete in ``folder``;
    ``finished(run, "skipped" | "done")`` after each, in this process. ``workers``: CPUs of a local instance,
    and the parallelism the runs are grouped for (default: the cluster's CPUs); ``definition``: the experiment's
    definition hash, recorded in each run's manifest (:func:`~kvlab.experiment.runner.write_run`)."""
    with connected(address, workers) as ray, ExitStack() as held:
        slots = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        task = ray.remote(num_cpus=1)(compute_group)
        traces: dict[str, object] = {}  # trace spec (JSON) -> ObjectRef of its Workload, put once
        pending = unique
        for blocking in (False, True):  # first pass: runs no one else holds; then wait for the others
            claimed, deferred = [], []
            for p in pending:
                if resume and is_done(folder, p.run_id):
                    finished(p, "skipped")
                    continue
                lock = held.enter_context(ExitStack())
                if not lock.enter_context(run_lock(folder, p.run_id, blocking=blocking)):
                    lock.close()
                    deferred.append(p)
                elif resume and is_done(folder, p.run_id):  # written by another process meanwhile
                    lock.close()
                    finished(p, "skipped")
                else:
                    claimed.append((p, lock))
            _compute_and_write(ray, task, folder, claimed, slots, traces, finished, definition)
            pending = deferred


def _compute_and_write(ray: ModuleType, task: object, folder: Path, claimed: list[tuple[PlannedRun, ExitStack]],
                       slots: int, traces: dict[str, object], finished: Callable[[PlannedRun, str], None],
                       definition: str | None = None) -> None:
    """Dispatch the claimed runs (their locks held) in groups, write each group's outputs as it returns and
    release the runs' locks. On an error or Ctrl-C the outstanding tasks are cancelled (they write nothing)."""
    if not claimed:
        return
    runs = [p for p, _ in claimed]
    futures = {}
    for group in groups(runs, slots):
        trace = runs[group[0]].run.trace.model_dump_json()  # a group holds runs of one trace
        if trace not in traces:
            traces[trace] = ray.put(workload_of(runs[group[0]].run))  # the driver's copy, loaded while planning
        jobs = [(runs[i].run.model_dump(mode="python"), runs[i].point, str(folder / RUNS / runs[i].run_id))
                for i in group]
        futures[task.remote(traces[trace], jobs, list(sys.argv))] = [claimed[i] for i in group]
    pending = list(futures)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                for (p, lock), output in zip(futures[ref], _result(ray, ref), strict=True):
                    write_run(folder, output, definition)
                    lock.close()
                    finished(p, "done")
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise


def _result(ray: ModuleType, ref: object) -> list[RunOutput]:
    """A task's outputs; a task's error is raised as itself (a ConfigError stays one line)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from exc
        raise


__all__ = ["RAY_MISSING", "check_address", "compute_group", "connected", "import_ray", "run_on_ray"]
