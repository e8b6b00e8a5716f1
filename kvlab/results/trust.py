"""What ``kvlab.results.load`` checks before it returns an experiment table: that the table says what it holds.

Across the runs of one results folder (:class:`kvlab.results.runs.ScannedRun`, each already verified against
its own manifest) :func:`folder_problems` finds, each as one line naming the counts and the first run ids:

* damaged runs: a file truncated or changed (checksums), a run folder renamed or swapped with another (its
  manifest's run id is not its folder name), an unreadable manifest; they are not rows, so the table would
  silently hold fewer runs;
* several contents of one trace: runs of the same trace (an experiment's ``trace.path``, else the trace's
  name) made from different file contents (the trace edited in place between two ``kvlab run``), rows that
  no config column tells apart; the runs of the older contents are named;
* several experiment definitions: runs recorded under different experiment names or definition hashes
  (``experiment.definition`` in the run manifests and the folder's sweep manifest);
* runs without an experiment in an experiment's folder: written by ``kvlab replay`` / ``kvlab sweep``,
  their config columns empty.

:func:`report` warns (:class:`ResultsWarning`, one line per problem) or, ``strict``, raises ResultsError.
Reading only.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.errors import ResultsError, printable

if TYPE_CHECKING:
    from kvlab.results.runs import ScannedRun

#: how many run ids a message lists before "and N more"
SHOWN = 3


class ResultsWarning(UserWarning):
    """A results folder holds something its table does not say (damaged runs, several trace contents or
    experiment definitions, runs of another command); one line naming the folder, the counts and the runs."""


def _ids(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _short(text: object, n: int = 12) -> str:
    return str(text)[:n]


def experiment_of(manifest: dict | None) -> dict | None:
    """The ``experiment`` record of a run or sweep manifest (``kvlab run``: name, definition, ...), else None."""
    record = (manifest or {}).get("experiment")
    return record if isinstance(record, dict) else None


def trace_of(manifest: dict) -> tuple[str, str | None]:
    """``(which trace, its file content)`` of a run manifest: the experiment's ``trace.path`` (else the trace's
    source or name), and the file's sha256 (else the selected content's)."""
    trace = manifest.get("trace") if isinstance(manifest.get("trace"), dict) else {}
    run = (experiment_of(manifest) or {}).get("run")
    spec = run.get("trace") if isinstance(run, dict) else None
    which = (spec or {}).get("path") if isinstance(spec, dict) else None
    which = which or trace.get("source") or trace.get("name") or "?"
    content = trace.get("file_sha256") or trace.get("sha256") or (manifest.get("identity") or {}).get(
        "trace", {}).get("content_sha256")
    return str(which), content


def _json(file: Path) -> dict | None:
    if not file.is_file():  # stat only: a FIFO would block the reader
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _run_folders(folder: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(folder / "runs")
                      if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    except OSError:
        return []


def holds_runs(folder: Path) -> bool:
    """Whether sweep folder ``folder`` holds at least one run folder (``runs/<run_id>/``)."""
    return bool(_run_folders(folder))


def experiment_holder(folder: Path, probe: int = 3) -> str | None:
    """The name of the experiment whose results sweep folder ``folder`` holds (``kvlab run``): its sweep
    manifest's ``experiment`` record, else (folders written before it was recorded) that of one of its first
    ``probe`` runs; None for a sweep of ``kvlab replay`` / ``kvlab sweep`` or a new folder."""
    record = experiment_of(_json(folder / "manifest.json"))
    if record is None:
        for run in _run_folders(folder)[:probe]:
            record = experiment_of(_json(run / "manifest.json"))
            if record is not None:
                break
    return None if record is None else str(record.get("name"))


def damaged(folder: Path, scanned: Sequence[ScannedRun]) -> str | None:
    """One line naming the runs that are not complete (:class:`ScannedRun` ``problem``), None if none."""
    bad = [s for s in scanned if s.problem is not None]
    if not bad:
        return None
    reasons = "; ".join(f"{s.name} ({s.problem.replace(f'{folder}/runs/{s.name}/', '')})" for s in bad[:SHOWN])
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    total = sum(1 for s in scanned if s.problem is not None or s.row is not None)
    return (f"{folder}: {len(bad)} of {total} runs damaged and left out of the table: {reasons}{more} "
            "(a resumed kvlab run or sweep recomputes them)")


def trace_contents(folder: Path, scanned: Sequence[ScannedRun]) -> list[str]:
    """One line per trace whose runs were made from several file contents, naming the older contents' runs
    (older: whose newest run was created before the newest run of another content)."""
    by_trace: dict[str, dict[str | None, list[ScannedRun]]] = {}
    for s in scanned:
        if s.manifest is not None:
            which, content = trace_of(s.manifest)
            by_trace.setdefault(which, {}).setdefault(content, []).append(s)
    out = []
    for which, contents in sorted(by_trace.items()):
        if len(contents) < 2:
            continue
        newest = max(contents, key=lambda c: max(str(s.manifest.get("created") or "") for s in contents[c]))
        older = [s.name for c, runs in contents.items() if c != newest for s in runs]
        counts = ", ".join(f"{len(runs)} of sha256 {_short(c)}" for c, runs in contents.items())
        out.append(f"{folder}: runs of {len(contents)} contents of trace {printable(which)} share the folder "
                   f"({counts}): the {len(older)} runs of the older contents are {_ids(older)} (the trace "
                   "changed since they ran: move them away or rerun into a new results folder)")
    return out


def definitions(folder: Path, scanned: Sequence[ScannedRun], folder_manifest: dict | None) -> str | None:
    """One line when the runs (and the folder's sweep manifest) record more than one experiment (name and
    definition hash; a run without a definition, written before kvlab recorded it, counts by its name only)."""
    current = experiment_of(folder_manifest)
    groups: dict[tuple[str, str | None], list[str]] = {}
    for s in scanned:
        record = experiment_of(s.manifest)
        if record is not None:
            groups.setdefault((str(record.get("name")), record.get("definition")), []).append(s.name)
    if current is not None:
        groups.setdefault((str(current.get("name")), current.get("definition")), [])
    named = {name for name, definition in groups if definition is not None}
    keys = [k for k in groups if k[1] is not None or k[0] not in named]  # undefined: only if no defined twin
    if len(keys) < 2:
        return None
    head = (str(current.get("name")), current.get("definition")) if current is not None else max(
        keys, key=lambda k: len(groups[k]))

    def label(k: tuple[str, str | None]) -> str:
        return f"{printable(k[0])} definition {_short(k[1]) if k[1] else '(not recorded)'}"

    others = [rid for k in keys if k != head for rid in groups[k]]
    mark = " (the folder's current)" if current is not None else " (the most runs)"
    counts = "; ".join(f"{label(k)}: {len(groups[k])} runs{mark if k == head else ''}" for k in keys)
    return (f"{folder}: runs of {len(keys)} experiment definitions share the folder ({counts}): the {len(others)} "
            f"runs of the others are {_ids(others) or 'none'} (two experiment files under one name: rename one, or "
            "give another --results)")


def foreign_runs(folder: Path, scanned: Sequence[ScannedRun], folder_manifest: dict | None) -> str | None:
    """One line when an experiment's folder (its sweep manifest or one of its runs records an experiment)
    holds runs that record none (``kvlab replay`` / ``kvlab sweep`` wrote them)."""
    runs = [s for s in scanned if s.manifest is not None]
    without = [s.name for s in runs if experiment_of(s.manifest) is None]
    if not without or (experiment_of(folder_manifest) is None and len(without) == len(runs)):
        return None
    return (f"{folder}: {len(without)} of {len(runs)} runs record no experiment (written by kvlab replay or "
            f"kvlab sweep into an experiment's folder; their config columns are empty): {_ids(without)}")


def folder_problems(folder: Path, scanned: Sequence[ScannedRun], folder_manifest: dict | None) -> list[str]:
    """Every problem of the folder's runs (module docstring), one line each."""
    found = [damaged(folder, scanned), *trace_contents(folder, scanned),
             definitions(folder, scanned, folder_manifest), foreign_runs(folder, scanned, folder_manifest)]
    return [p for p in found if p is not None]


def report(problems: Sequence[str], *, strict: bool, stacklevel: int = 3) -> None:
    """Warn each problem (:class:`ResultsWarning`), or with ``strict`` raise ResultsError holding them all."""
    if not problems:
        return
    if strict:
        raise ResultsError(" | ".join(problems))
    for problem in problems:
        warnings.warn(problem, ResultsWarning, stacklevel=stacklevel)


__all__ = ["ResultsWarning", "damaged", "definitions", "experiment_holder", "experiment_of", "folder_problems",
           "foreign_runs", "holds_runs", "report", "trace_contents", "trace_of"]
