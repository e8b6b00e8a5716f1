"""Sweeps: many replays of one workload (policies x capacities x counting modes x tier lists), resumable and
safe to run concurrently on one folder.

Layout under OUT (docs/results.md)::

    OUT/manifest.json       kind "sweep": written first (marks the folder as a kvlab sweep), then with
                            each table: the run ids in the table and the table's checksum
    OUT/runs/<run_id>/      one complete replay each (the shared results layout, kvlab.results)
    OUT/sweep.parquet       one row per complete run under OUT/runs, in a fixed order
    OUT/.locks/<run_id>.lock

Invariants: a run is reused only when it is complete (every file matches its manifest's checksums) and
its ``run_id`` (kvlab.results.identity: resolved config, trace content, SEMANTICS_VERSION) matches; one
process computes a run while others wait for it (a lock per run); the table is rebuilt under a lock on
OUT from every complete run on disk, so it never shrinks, a second sweep's runs add to it, and an
interrupted sweep leaves the last complete table in place. ``kvlab sweep`` over several traces
(:func:`run_sweeps`) puts one such folder per trace under OUT and a combined table at the top.
"""

from __future__ import annotations

import itertools
import json
import numbers
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.arguments import kind_of, require_instance
from kvlab.errors import ConfigError, ResultsError
from kvlab.replay import ReplayConfig, ReplayResult, encode, replay, resolve_config
from kvlab.results import (
    atomic_write_file,
    build_manifest,
    check_output_location,
    checkpoint,
    folder_kind,
    locked,
    read_table,
    run_id,
    run_identity,
    safe_name,
    write_results,
)
from kvlab.results.identity import SEMANTICS_VERSION
from kvlab.results.paths import clean_stale, file_entry
from kvlab.results.runs import LOCKS, RUNS, SCANNER, TABLE, order_key, table_row, tier_row
from kvlab.results.store import (
    MANIFEST,
    MANIFEST_VERSION,
    _cached_git_revision,
    dumps,
    package_versions,
)
from kvlab.workload.workload import Workload, require_workload

HASH_FIELDS = ("hash", "root_seed", "model_id", "block_size", "verify")
CSV = "sweep.csv"
RESERVED_NAMES = frozenset((RUNS, LOCKS, TABLE, CSV, MANIFEST))
TIMING_COLUMNS = ("replay_seconds", "compile_seconds")


def grid(
    capacities: Iterable[int],
    policies: Sequence[str] = ("lru",),
    modes: Sequence[str] = ("vllm",),
    tiers: Sequence = (),
    **common: object,
) -> list[ReplayConfig]:
    """ReplayConfigs for every (policy, capacity, mode, tier list), sharing the ``common`` fields.

    ``tiers``: one list of :class:`~kvlab.tiers.Tier` (every run has them), or a list of such lists (a sweep
    axis: one run per list; ``[]`` in it is a run without tiers), e.g. ``[[Tier(name="dram",
    capacity_blocks=c)] for c in (1000, 10000)]``. A run without tiers drops ``model`` and
    ``max_load_tokens`` (they change nothing there), so it keeps the run id of a plain replay.

    Each capacity is validated by ReplayConfig as given (integers, numpy's too, as ``int``): a boolean is never
    a block count (``grid([True, 100])`` is refused naming ``capacity_blocks``, not run as 1 block)."""
    if isinstance(capacities, str | bytes) or not isinstance(capacities, Iterable):
        raise ConfigError(f"grid: capacities (capacity_blocks) must be a list of integers, got {kind_of(capacities)}")
    capacities = [int(c) if isinstance(c, numbers.Integral) and not isinstance(c, bool) else c for c in capacities]
    out = []
    for p, c, m, ts in itertools.product(policies, capacities, modes, tier_axis(tiers)):
        fields = dict(common) if ts else {k: v for k, v in common.items() if k not in ("model", "max_load_tokens")}
        out.append(ReplayConfig(capacity_blocks=c, policy=p, mode=m, tiers=ts, **fields))  # type: ignore[arg-type]
    return out


def tier_axis(tiers: Sequence) -> list[list]:
    """``grid``'s ``tiers`` as a list of tier lists: ``[[]]`` for none, ``[tiers]`` for one list."""
    if not tiers:
        return [[]]
    nested = [isinstance(t, list | tuple) for t in tiers]
    if all(nested):
        return [list(t) for t in tiers]
    if any(nested):
        raise ConfigError("grid(tiers=...): give one list of tiers or a list of tier lists, not a mix")
    return [list(tiers)]


# ----------------------------------------------------------------------------- identities and rows
def plan(workload: Workload, configs: Sequence[ReplayConfig]) -> list[tuple[ReplayConfig, dict, str]]:
    """``(resolved config, identity, run_id)`` per config, in order: the block size and the policy's
    default parameters filled in first, so a run resumes whether or not they were given."""
    trace = workload.identity()
    out = []
    for config in configs:
        resolved = resolve_config(workload, config)
        identity = run_identity(resolved.to_dict(), trace)
        out.append((resolved, identity, run_id(identity)))
    return out


def run_manifest(workload: Workload, config: ReplayConfig, identity: dict, result: ReplayResult) -> dict:
    """The manifest of a sweep run: the resolved config, the trace's identity and the run identity."""
    trace = {**result.trace, **workload.identity()}
    return build_manifest(config.to_dict(), trace=trace, seed=config.seed, driver="replay", identity=identity)


# ----------------------------------------------------------------------------- folders and tables
def _folder_manifest(kind: str, table: pd.DataFrame | None, files: dict, **extra: object) -> dict:
    runs = [] if table is None or "run_id" not in table else table["run_id"].tolist()
    traces = [] if table is None or "trace_sha256" not in table else (
        table[["trace", "trace_sha256"]].drop_duplicates().to_dict("records"))
    return {
        "manifest_version": MANIFEST_VERSION,
        "kind": kind,
        "driver": kind,
        "semantics_version": SEMANTICS_VERSION,
        "runs": runs,
        "traces": traces,
        "files": files,
        **extra,
        "versions": package_versions(),
        "git_revision": _cached_git_revision(),
        "command": list(sys.argv),
    }


def _write_json(path: Path, obj: object, phase: str | None = None) -> dict:
    return atomic_write_file(path, lambda p: p.write_text(dumps(obj) + "\n"), phase=phase)


def prepare_folder(out: str | os.PathLike, kind: str = "sweep", *, experiment: dict | None = None) -> Path:
    """Check ``out`` (:func:`~kvlab.results.check_output_location`), create it, and mark it as a kvlab
    ``kind`` folder (its manifest written first, under the folder lock) so that an interrupted sweep
    is recognised and resumed. ``experiment``: the ``{"name", "definition"}`` record of the ``kvlab run``
    experiment whose folder this is (kvlab.experiment.definition.record), written into the manifest when it
    differs from the recorded one and kept by every table rebuild; without it a folder holding an
    experiment's results is refused (a replay sweep's rows would mix into the experiment's table).
    Returns the absolute path."""
    out = check_output_location(out, kind, experiment=experiment is not None)
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        found = folder_kind(out)
        if found is None:
            check_output_location(out, kind, experiment=experiment is not None)  # still empty? (another writer)
            _write_json(out / MANIFEST, _folder_manifest(kind, None, {}, **_record(experiment)))
        elif found != kind:
            check_output_location(out, kind)  # raises, naming the kind found
        elif experiment is not None:
            manifest = _read_folder_manifest(out)
            if manifest.get("experiment") != experiment:
                _write_json(out / MANIFEST, {**manifest, **_record(experiment)})
    (out / LOCKS).mkdir(exist_ok=True)
    return out


def _record(experiment: dict | None) -> dict:
    return {} if experiment is None else {"experiment": experiment}


#: fields of a sweep folder's manifest that a table rebuild keeps (prepare_folder's ``experiment``)
KEPT_FIELDS = ("experiment",)


def _read_folder_manifest(out: Path) -> dict:
    """The sweep folder's manifest as recorded ({} when unreadable: the next table rewrites it)."""
    if not (out / MANIFEST).is_file():  # stat only: a FIFO would block the reader
        return {}
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _write_table(out: Path, rows: list[dict], kind: str, *, csv: bool, **extra: object) -> pd.DataFrame:
    """Under the caller's folder lock: ``sweep.parquet`` (and ``sweep.csv``), then the manifest (keeping its
    :data:`KEPT_FIELDS`)."""
    frame = pd.DataFrame(rows)
    files = {TABLE: atomic_write_file(out / TABLE, lambda p: frame.to_parquet(p, index=False),
                                      phase="table-commit")}
    if csv:
        files[CSV] = atomic_write_file(out / CSV, lambda p: frame.to_csv(p, index=False), phase="table-commit")
    old = _read_folder_manifest(out)
    kept = {k: old[k] for k in KEPT_FIELDS if k in old and k not in extra}
    _write_json(out / MANIFEST, _folder_manifest(kind, frame, files, **kept, **extra), phase="table-commit")
    return frame


def table_problem(out: str | os.PathLike) -> str | None:
    """Why ``OUT/sweep.parquet`` does not say what the folder holds, None when it does: the table missing,
    its size or sha256 not the ones the folder's manifest records (truncated, corrupt, replaced), or the
    manifest's run ids not the complete runs under ``OUT/runs`` (a run added, removed or damaged since)."""
    out = Path(out)
    manifest = _read_folder_manifest(out)
    entry = (manifest.get("files") or {}).get(TABLE) if isinstance(manifest.get("files"), dict) else None
    if not (out / TABLE).is_file():
        return f"{out / TABLE}: missing"
    if not isinstance(entry, dict):
        return f"{out / MANIFEST}: records no checksum of {TABLE}"
    if file_entry(out / TABLE) != {"sha256": entry.get("sha256"), "bytes": entry.get("bytes")}:
        return f"{out / TABLE}: size or sha256 differs from the one {MANIFEST} records (truncated or corrupt)"
    listed = manifest.get("runs")
    complete = [r["run_id"] for r in SCANNER.rows(out / RUNS)]
    if not isinstance(listed, list) or sorted(map(str, listed)) != sorted(complete):
        return f"{out / TABLE}: lists other runs than the {len(complete)} complete runs under {out / RUNS}"
    return None


def rebuild_table(out: str | os.PathLike, *, experiment: dict | None = None) -> pd.DataFrame:
    """Rewrite ``OUT/sweep.parquet`` and the sweep manifest from every complete run under ``OUT/runs``
    (under the folder lock; leftovers of dead writers removed first), whatever the table was (a truncated or
    corrupt one, :func:`table_problem`, is replaced). ``experiment``: the experiment record the manifest
    holds (:func:`prepare_folder`; None keeps the recorded one). Returns the table."""
    out = Path(out)
    with locked(out):
        clean_stale(out / RUNS)
        clean_stale(out)
        return _write_table(out, SCANNER.rows(out / RUNS), "sweep", csv=False, **_record(experiment))


def combine_tables(out: str | os.PathLike) -> pd.DataFrame:
    """Rewrite ``OUT/sweep.parquet`` and ``OUT/sweep.csv`` of a several-trace sweep from the complete runs
    of every sweep folder directly under ``OUT`` (one row per run_id). Returns the table."""
    out = Path(out)
    with locked(out):
        clean_stale(out)
        folders = sorted(e.name for e in os.scandir(out) if e.is_dir(follow_symlinks=False)
                         and not e.name.startswith(".") and folder_kind(Path(e.path)) == "sweep")
        rows: dict[str, dict] = {}
        for name in folders:
            for row in SCANNER.rows(out / name / RUNS):
                rows.setdefault(row["run_id"], row)
        return _write_table(out, sorted(rows.values(), key=order_key), "sweeps", csv=True, folders=folders)


def trace_folder_name(workload: Workload, taken: dict[str, str] | None = None) -> str:
    """The subfolder of a several-trace sweep for ``workload``: :func:`~kvlab.results.safe_name` of its
    name, with a content-hash suffix when that name is reserved or ``taken`` (name -> content sha256)
    already holds another trace under it."""
    taken = {} if taken is None else taken
    name = safe_name(workload.name)
    if name in RESERVED_NAMES or taken.get(name, workload.content_sha256) != workload.content_sha256:
        name = safe_name(f"{name}-{workload.content_sha256[:8]}")
    taken[name] = workload.content_sha256
    return name


# ----------------------------------------------------------------------------- running
def _compute(workload: Workload, config: ReplayConfig, encodings: dict[tuple, object]) -> ReplayResult:
    hkey = tuple(getattr(config, f) for f in HASH_FIELDS)
    if hkey not in encodings:
        encodings[hkey] = encode(workload, config)
    return replay(workload, config, encoded=encodings[hkey])


def run_sweep(
    workload: Workload,
    configs: Sequence[ReplayConfig],
    out: str | Path | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
) -> pd.DataFrame:
    """Replay ``workload`` under each config; return one row per config, in config order.

    With ``out`` (checked first: absent, empty or a kvlab sweep folder): each run is written to
    ``out/runs/<run_id>/`` and the folder's table rebuilt after it. With ``resume`` a complete run of the
    same run_id is read back instead of replayed; without, every run is replayed and replaced. Several
    processes may sweep one folder at once: each run is computed by one of them. Hashing is done once
    per distinct hash setting. A wrong argument type is one ConfigError naming the argument, before any work."""
    workload = require_workload(workload)
    if isinstance(configs, ReplayConfig) or not isinstance(configs, Iterable):
        raise ConfigError(f"configs: expected a list of ReplayConfigs, got {kind_of(configs)}")
    configs = [require_instance(c, ReplayConfig, f"configs[{k}]") for k, c in enumerate(configs)]
    planned = plan(workload, configs)
    encodings: dict[tuple, object] = {}
    desc = f"sweep {safe_name(workload.name)}"
    if out is None:
        rows = []
        for config, identity, _ in tqdm(planned, disable=not progress, desc=desc, unit="run"):
            result = _compute(workload, config, encodings)
            rows.append(table_row(run_manifest(workload, config, identity, result), result.summary))
        return pd.DataFrame(rows)

    out = prepare_folder(out, "sweep")
    runs = out / RUNS
    runs.mkdir(exist_ok=True)
    unique = {rid: (config, identity) for config, identity, rid in planned}
    pending = list(unique)
    bar = tqdm(total=len(pending), disable=not progress, desc=desc, unit="run")
    for blocking in (False, True):  # first pass skips runs another process holds; second waits for them
        deferred = []
        for rid in pending:
            config, identity = unique[rid]
            if resume and SCANNER.row(runs / rid) is not None:
                bar.update(1)
                continue
            with locked(out / LOCKS / f"{rid}.lock", blocking=blocking) as held:
                if not held:
                    deferred.append(rid)
                    continue
                computed = not (resume and SCANNER.row(runs / rid) is not None)
                if computed:
                    bar.set_postfix(policy=config.policy, capacity=config.capacity_blocks, mode=config.mode)
                    result = _compute(workload, config, encodings)
                    write_results(runs / rid, {"requests": result.requests}, result.summary,
                                  run_manifest(workload, config, identity, result))
            bar.update(1)
            if computed:
                rebuild_table(out)
                checkpoint("between-runs")
        pending = deferred
    bar.close()
    table = rebuild_table(out)
    where = {rid: i for i, rid in enumerate(table["run_id"])} if len(table) else {}
    missing = [rid for _, _, rid in planned if rid not in where]
    if missing:
        raise ResultsError(f"{runs / missing[0]}: run not complete after the sweep (modified while running?)")
    return table.iloc[[where[rid] for _, _, rid in planned]].reset_index(drop=True)


def run_sweeps(
    workloads: Iterable[Workload],
    configs: Sequence[ReplayConfig],
    out: str | Path,
    *,
    resume: bool = True,
    progress: bool = True,
) -> pd.DataFrame:
    """``kvlab sweep``: :func:`run_sweep` of each workload into ``out/<trace_folder_name>/``, the combined
    table (:func:`combine_tables`) rebuilt after each trace. ``out`` is checked before the first workload
    is taken from ``workloads`` (so they may be loaded lazily). Returns this call's rows, trace by trace."""
    if isinstance(workloads, Workload | str | os.PathLike):
        raise ConfigError(f"workloads: expected an iterable of Workloads, got {kind_of(workloads)}; "
                          "pass [workload] (load paths first with kvlab.workload.load_trace(path))")
    out = prepare_folder(out, "sweeps")
    taken: dict[str, str] = {}
    frames = []
    for k, workload in enumerate(workloads):
        sub = out / trace_folder_name(require_workload(workload, f"workloads[{k}]"), taken)
        frames.append(run_sweep(workload, configs, sub, resume=resume, progress=progress))
        combine_tables(out)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_sweep(out: str | Path) -> pd.DataFrame:
    """The ``sweep.parquet`` table of a sweep folder (ResultsError naming it when missing or damaged)."""
    return read_table(Path(out) / TABLE)


__all__ = [
    "TIMING_COLUMNS",
    "combine_tables",
    "grid",
    "plan",
    "prepare_folder",
    "read_sweep",
    "rebuild_table",
    "run_sweep",
    "run_sweeps",
    "table_problem",
    "table_row",
    "tier_axis",
    "tier_row",
    "trace_folder_name",
]
