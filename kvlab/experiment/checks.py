"""What ``kvlab run`` checks once every run is planned and before anything is written (docs/experiments.md,
"Checked before the runs"): that the results folder holds this experiment (and this definition of it) or
nothing, and that the ``analysis:`` settings fit the workload. Reading only: this module writes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvlab.errors import ConfigError
from kvlab.experiment.config import Experiment
from kvlab.results.runs import RUNS
from kvlab.results.store import MANIFEST


def _json(path: Path) -> dict:
    if not path.is_file():  # stat only: a FIFO would block the reader
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _run_names(folder: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(folder / RUNS) if e.is_dir(follow_symlinks=False)
                      and not e.name.startswith("."))
    except OSError:
        return []


def check_definition(folder: Path, record: dict, *, allow_redefine: bool = False) -> None:
    """Refuse (ConfigError, one line) to run experiment ``record`` (``{"name", "definition"}``,
    kvlab.experiment.definition.record) into ``folder`` when the folder holds

    * another definition of the experiment (its manifest's ``experiment.definition``, or a run's), unless
      ``allow_redefine``;
    * runs written by ``kvlab replay`` / ``kvlab sweep`` (a sweep manifest without an ``experiment`` entry whose
      runs do not name this experiment).

    Folders of runs written by ``kvlab run`` before definitions were recorded (each run's manifest names the
    experiment) are accepted; the definition is recorded from then on."""
    manifest = _json(folder / MANIFEST)
    if not manifest:
        return
    name, new = record["name"], record["definition"]
    recorded = manifest.get("experiment")
    old = recorded.get("definition") if isinstance(recorded, dict) else None
    runs = _run_names(folder)
    if old is None:
        for run in runs:
            entry = _json(folder / RUNS / run / MANIFEST).get("experiment")
            if not isinstance(entry, dict) or entry.get("name") != name:
                raise ConfigError(f"{folder}: holds runs that are not experiment {name!r}'s (written by kvlab "
                                  f"replay or kvlab sweep: {RUNS}/{run}); an experiment writes only into its own "
                                  "folder: give the experiment another name: or another --results")
            old = old or entry.get("definition")
    if old is not None and old != new and not allow_redefine:
        raise ConfigError(f"{folder}: holds the runs of another definition of experiment {name!r} (definition "
                          f"{old[:12]}, this file's {new[:12]}: a field other than analysis: or description: "
                          "differs); give the experiment another name: or another --results, or --allow-redefine "
                          "(allow_redefine=True) to add this definition's runs to the same folder")


def check_analysis(experiment: Experiment, sizes: dict[str, int], source: str | None = None) -> None:
    """Refuse (ConfigError naming ``analysis.warmup_requests``) a warm-up that leaves no request of a run's
    workload to measure; ``sizes``: requests per run (run id -> count). A warm-up that leaves fewer requests than
    ``analysis.windows`` is not an error: the interval then uses one window per request, and none with fewer
    than 2 (kvlab.analysis.runs.fitted_windows), which kvlab run says in a note."""
    warmup = experiment.analysis.warmup_requests
    if not sizes or not warmup:
        return
    smallest = min(sizes.values())
    if warmup >= smallest:
        raise ConfigError(f"{source + ': ' if source else ''}analysis.warmup_requests: {warmup:,} leaves none of a "
                          f"run's {smallest:,} requests to measure; give fewer than {smallest:,} (or more requests: "
                          "trace.limit)")


__all__ = ["check_analysis", "check_definition"]
