"""The runs folder of a sweep or an experiment, read: complete runs as table rows, and the tidy experiment
table (``kvlab.results.load``).

A folder ``OUT`` (docs/results.md) holds ``OUT/runs/<run_id>/`` (one complete run each, kvlab.results layout),
``OUT/sweep.parquet`` (the table rebuilt from them) and ``OUT/.locks/``. A run is a row only when it is
complete (every file matches its manifest's checksums) and its folder is named by its ``run_id``. Reading
only: this module writes nothing and imports neither the drivers nor kvlab.experiment (an experiment file's
name is read here, :func:`experiment_file_name`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvlab.arguments import kind_of
from kvlab.errors import ConfigError, ResultsError
from kvlab.inputs import parse_yaml, read_text
from kvlab.names import canonical_keys
from kvlab.results.paths import safe_name
from kvlab.results.store import MANIFEST, SUMMARY, read_json, verify_run
from kvlab.results.trust import folder_problems, report
from kvlab.schema import ExperimentName, validate_fields

RUNS = "runs"
LOCKS = ".locks"
TABLE = "sweep.parquet"
ROW_ORDER = ("trace", "trace_sha256", "policy", "policy_params", "block_size", "hash", "mode", "capacity_blocks",
             "run_id")


# ----------------------------------------------------------------------------- rows
def table_row(manifest: dict, summary: dict) -> dict:
    """A sweep table row: trace name and content checksum, run id, policy parameters (JSON), summary; with
    tiers, the summary's ``tiers`` list as JSON and flat per-tier columns (:func:`tier_row`)."""
    identity = manifest["identity"]
    params = identity["config"].get("policy_params") or {}
    summary = canonical_keys(summary, manifest.get("driver"))  # runs written before a rename: today's names
    tiers = summary.pop("tiers", None)
    experiment = manifest.get("experiment")  # kvlab run: the run's config fields by dotted path, first
    row = {
        **(experiment.get("columns") or {} if isinstance(experiment, dict) else {}),
        "trace": (manifest.get("trace") or {}).get("name"),
        "trace_sha256": identity["trace"]["content_sha256"],
        "run_id": manifest["run_id"],
        "policy_params": json.dumps(params, sort_keys=True),
        **summary,
    }
    if tiers:
        row["tiers"] = json.dumps(tiers)
        row.update(tier_row({"tiers": tiers}))
    return row


def tier_row(summary: dict) -> dict:
    """Flat per-tier columns of a tiered run's summary, tier by tier: ``<tier>_capacity_blocks`` (blocks)
    and ``<tier>_hit_share`` (fraction of all prompt tokens). ``{}`` without tiers."""
    out: dict = {}
    for t in summary.get("tiers") or []:
        out[f"{t['name']}_capacity_blocks"] = t["capacity_blocks"]
        out[f"{t['name']}_hit_share"] = t["hit_share"]
    return out


def order_key(row: dict) -> tuple:
    """A table row's place in ``sweep.parquet`` (:data:`ROW_ORDER`; numbers before text before missing values)."""
    key = []
    for col in ROW_ORDER:
        if col == "run_id":  # runs that differ in their tiers: by tier sizes, then run id
            key.append(tuple(sorted((k, v) for k, v in row.items() if k.endswith("_capacity_blocks")
                                    and k != "capacity_blocks" and isinstance(v, int | float) and v == v)))
        v = row.get(col)
        if isinstance(v, bool) or v is None or (isinstance(v, float) and v != v):
            key.append((2, str(v)))
        elif isinstance(v, int | float):
            key.append((0, v))
        else:
            key.append((1, str(v)))
    return tuple(key)



def _signature(run_dir: Path) -> tuple | None:
    """What identifies a run folder's on-disk state: the folder's and every file's inode, size, mtime."""
    try:
        st = os.stat(run_dir)
        files = tuple(sorted((e.name, s.st_ino, s.st_size, s.st_mtime_ns)
                             for e in os.scandir(run_dir) for s in [e.stat(follow_symlinks=False)]))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, files)


@dataclass(frozen=True)
class ScannedRun:
    """One folder under ``runs/``, verified: its table ``row`` and verified ``manifest`` when it is a complete
    run named by its run_id, else ``problem`` (one line: why it is not a row). Both None: the folder vanished
    while it was read (a writer replaced it)."""

    name: str
    row: dict | None = None
    manifest: dict | None = None
    problem: str | None = None


def scan_run(run_dir: Path) -> ScannedRun:
    """:class:`ScannedRun` of ``run_dir``, read once (no cache): checksums against its manifest, run id against
    the folder name (a run folder renamed or swapped with another is not that run), a run identity."""
    try:
        manifest = verify_run(run_dir, run_dir.name)
        summary = read_json(run_dir / SUMMARY)
        if not isinstance(manifest.get("identity"), dict):
            return ScannedRun(run_dir.name, problem=f"{run_dir / MANIFEST}: records no run identity")
        if not isinstance(summary, dict):
            return ScannedRun(run_dir.name, problem=f"{run_dir / SUMMARY}: not a JSON object")
        return ScannedRun(run_dir.name, row=table_row(manifest, summary), manifest=manifest)
    except ResultsError as exc:
        return ScannedRun(run_dir.name, problem=str(exc))
    except (KeyError, TypeError, AttributeError) as exc:
        return ScannedRun(run_dir.name, problem=f"{run_dir / MANIFEST}: lacks a field of a run ({exc!r})")


class RunScanner:
    """Table rows of complete runs, each verified once per on-disk state (checksums are not re-read while
    nothing in a run folder changed)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple, ScannedRun]] = {}

    def scan(self, run_dir: Path) -> ScannedRun:
        """:func:`scan_run` of ``run_dir``, cached while its on-disk state (:func:`_signature`) is unchanged."""
        for _ in range(3):  # a run being replaced concurrently may change under the reader: look again
            sig = _signature(run_dir)
            if sig is None:
                return ScannedRun(run_dir.name)
            cached = self._seen.get(str(run_dir))
            if cached is not None and cached[0] == sig:
                return cached[1]
            scanned = scan_run(run_dir)
            if _signature(run_dir) == sig:
                self._seen[str(run_dir)] = (sig, scanned)
                return scanned
        return ScannedRun(run_dir.name, problem=f"{run_dir}: changed while it was read (a writer replacing it)")

    def row(self, run_dir: Path) -> dict | None:
        """The row of the complete run in ``run_dir`` (named by its run_id), None if it is not complete."""
        return self.scan(run_dir).row

    def scan_all(self, runs_dir: Path) -> list[ScannedRun]:
        """:meth:`scan` of every folder in ``runs_dir`` (hidden temporaries skipped), by name."""
        try:
            names = sorted(e.name for e in os.scandir(runs_dir) if e.is_dir(follow_symlinks=False)
                           and not e.name.startswith("."))
        except FileNotFoundError:
            return []
        return [self.scan(runs_dir / n) for n in names]

    def rows(self, runs_dir: Path) -> list[dict]:
        """Rows of every complete run in ``runs_dir`` (hidden temporaries skipped), in table order."""
        rows = [s.row for s in self.scan_all(runs_dir) if s.row is not None]
        return sorted(rows, key=order_key)


SCANNER = RunScanner()  # one per process: the sweep, the experiment runner and the loader share its cache


# ----------------------------------------------------------------------------- the experiment table
def load_runs(folder: str | os.PathLike, run_ids: list[str] | None = None, *, strict: bool = False) -> pd.DataFrame:
    """The experiment table of ``folder``: one row per complete run (``run_ids``: these runs, in this order;
    ResultsError if one is not complete). Without ``run_ids`` the folder's runs are checked together first
    (:mod:`kvlab.results.trust`: damaged runs, several trace contents or experiment definitions, runs of
    another command): each problem is a :class:`~kvlab.results.trust.ResultsWarning`, or with ``strict`` a
    ResultsError."""
    folder = Path(folder)
    if not (folder / RUNS).is_dir():
        raise ResultsError(f"{folder}: not an experiment results folder (no {RUNS}/); run kvlab run first")
    scanned = SCANNER.scan_all(folder / RUNS)
    rows = sorted((s.row for s in scanned if s.row is not None), key=order_key)
    if run_ids is None:
        report(folder_problems(folder, scanned, folder_manifest(folder)), strict=strict, stacklevel=4)
        if not rows and not (folder / TABLE).exists():
            return pd.DataFrame()
        return tidy(pd.DataFrame(rows))
    where = {r["run_id"]: r for r in rows}
    missing = [rid for rid in run_ids if rid not in where]
    if missing:
        raise ResultsError(f"{folder / RUNS / missing[0]}: run not complete after the experiment")
    return tidy(pd.DataFrame([where[rid] for rid in run_ids]))


def folder_manifest(folder: Path) -> dict | None:
    """The sweep manifest of results folder ``folder`` (``manifest.json``), None when absent or unreadable."""
    try:
        manifest = read_json(folder / MANIFEST)
    except ResultsError:
        return None
    return manifest if isinstance(manifest, dict) else None


#: the config columns of an experiment table that are not dotted paths (kvlab.experiment.runner.flat_columns;
#: ``simulate`` is one when the section is empty, else its fields are ``simulate.<name>``)
CONFIG_TOP_LEVEL = ("experiment", "driver", "model", "hardware", "seed", "simulate")


def config_columns(frame: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """The config columns of an experiment table (dotted paths and :data:`CONFIG_TOP_LEVEL`), minus ``exclude``."""
    return [c for c in frame.columns if ("." in c or c in CONFIG_TOP_LEVEL) and c not in exclude]


def varying_columns(frame: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """The config columns (but ``sweep_point`` and ``exclude``) whose values differ between the rows (compared
    as text, so None and NaN count as values)."""
    return [c for c in config_columns(frame, exclude=["sweep_point", *exclude]) if frame[c].astype(str).nunique() > 1]


def tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """Config columns (:func:`config_columns`) first, then the rest, index reset."""
    config = config_columns(frame)
    rest = [c for c in frame.columns if c not in config]
    return frame[config + rest].reset_index(drop=True)


def experiment_folder(name: str, results: str | os.PathLike = "results") -> Path:
    """``results/<safe name>``: where the experiment called ``name`` writes its runs."""
    return Path(results) / safe_name(name)


def experiment_file_name(path: Path) -> str:
    """The ``name:`` of the experiment YAML file ``path``, checked as the experiment schema checks it
    (:data:`kvlab.schema.ExperimentName`); ConfigError starting with the file's path otherwise. Only the name is
    read: the results sit below kvlab.experiment, which checks the whole file when it runs it."""
    data = parse_yaml(read_text(path, "experiment file"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment file is a mapping (name:, trace:, cache:, ...), got "
                          f"{type(data).__name__}")
    try:
        validate_fields("experiment", name=(ExperimentName, data.get("name")))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return data["name"]


def resolve_folder(experiment: str | os.PathLike, results: str | os.PathLike = "results") -> Path:
    """The results folder of ``experiment``: a folder with ``runs/`` as is, an experiment YAML file's
    ``results/<its name>``, else ``results/<experiment>`` (a name)."""
    given = Path(experiment)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        return experiment_folder(experiment_file_name(given), results)
    if given.is_dir() and (given / RUNS).is_dir():
        return given
    return experiment_folder(str(experiment), results)


def load(experiment: str | os.PathLike, results: str | os.PathLike = "results", *,
         strict: bool = False) -> pd.DataFrame:
    """One tidy DataFrame of an experiment's complete runs: one row per run, its config fields as dotted
    columns (``cache.policy``, ``cache.capacity_blocks``, ``seed``...), then the run's summary.

    ``experiment``: an experiment name (read from ``results/<name>/``), a results folder, or the experiment's
    YAML file (:func:`resolve_folder`). A run that is damaged, runs of several contents of one trace or of
    several experiment definitions, and runs another command wrote into the folder are each warned
    (:class:`~kvlab.results.trust.ResultsWarning`, one line naming the runs) or, with ``strict``, refused
    (ResultsError). See docs/experiments.md and docs/results.md ("What load() checks"). A wrong argument type
    (``load(None)``) is one ConfigError naming the argument."""
    if not isinstance(experiment, str | os.PathLike):
        raise ConfigError(f"experiment: expected an experiment name, its results folder or its YAML file (a str "
                          f"or path), got {kind_of(experiment)}")
    if not isinstance(results, str | os.PathLike):
        raise ConfigError(f"results: expected the results root folder (a str or path), got {kind_of(results)}")
    return load_runs(resolve_folder(experiment, results), strict=strict)


__all__ = ["CONFIG_TOP_LEVEL", "LOCKS", "RUNS", "SCANNER", "TABLE", "RunScanner", "ScannedRun", "config_columns",
           "experiment_folder", "folder_manifest", "load", "load_runs", "order_key", "resolve_folder", "scan_run",
           "table_row", "tidy", "tier_row", "varying_columns"]
