"""The results layout every driver writes, atomically:

    OUT/requests.parquet   one row per request, trace order
    OUT/<table>.parquet    further tidy tables (time series, sweeps) when a driver has them
    OUT/summary.json       aggregate metrics (docs/semantics.md names)
    OUT/manifest.json      identity and run_id, config, trace, seed, versions, git revision, command, and
                           ``files``: the sha256 and size of every other file; written last

Rules (docs/results.md): kvlab never deletes or moves what it did not write. ``OUT`` may be absent, an
empty folder, or a kvlab run (then it is replaced); anything else is refused with
:class:`~kvlab.errors.ResultsLocationError` before any work. A run is written into a hidden temporary
folder beside ``OUT`` and swapped into place atomically, so at every instant ``OUT`` is the complete old
run or the complete new one. A run is complete when every file its manifest lists exists with the
recorded size and sha256.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from kvlab.arguments import kind_of
from kvlab.errors import ConfigError, ResultsError, ResultsLocationError
from kvlab.inputs import not_regular
from kvlab.names import canonical_columns, canonical_keys
from kvlab.results.columns import check_columns
from kvlab.results.faults import checkpoint
from kvlab.results.identity import SEMANTICS_VERSION, run_id, run_identity
from kvlab.results.jsonio import dumps, json_default  # noqa: F401  (dumps re-exported)
from kvlab.results.paths import (
    TEMP_RE,
    clean_stale,
    file_entry,
    is_run_file_name,
    make_temp_dir,
    release_temp,
    remove_kvlab_folder,
    replace_folder,
    safe_name,
)
from kvlab.results.trust import experiment_holder, holds_runs
from kvlab.workload._common import sha256_file as file_sha256  # noqa: F401  (re-exported)

MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
KINDS = ("run", "sweep", "sweeps")
TRACKED_PACKAGES = ("kvlab", "numpy", "pandas", "pyarrow", "numba", "xxhash", "torch", "transformers")


@dataclass
class RunResult:
    """A run read back from disk."""

    path: Path
    tables: dict[str, pd.DataFrame]
    summary: dict
    manifest: dict

    @property
    def requests(self) -> pd.DataFrame:
        return self.tables["requests"]


@functools.cache
def _package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def package_versions(names: tuple[str, ...] = TRACKED_PACKAGES) -> dict[str, str | None]:
    """Versions of Python and ``names`` (None where not installed), read once per process."""
    return dict(_package_versions(tuple(names)))


def git_revision(path: Path | None = None) -> str | None:
    """The commit of the kvlab checkout (with ``+dirty`` if it has changes), or None outside git."""
    here = path or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


_GIT_REVISION: list[str | None] = []


def _cached_git_revision() -> str | None:
    """:func:`git_revision`, asked once per process (a sweep writes many manifests)."""
    if not _GIT_REVISION:
        _GIT_REVISION.append(git_revision())
    return _GIT_REVISION[0]


def config_hash(config: dict) -> str:
    """A short stable id of a config alone (kept for old callers; runs are identified by ``run_id``)."""
    return hashlib.sha256(dumps(config).encode()).hexdigest()[:16]


def build_manifest(
    config: dict,
    *,
    trace: dict | None = None,
    seed: int | None = None,
    driver: str,
    identity: dict | None = None,
) -> dict:
    """The provenance of a run: what was run on what, with which code, and its identity.

    ``identity`` defaults to :func:`~kvlab.results.identity.run_identity` ``(config, trace)`` when
    ``trace`` carries ``content_sha256`` (pass ``Workload.identity()``), else it is recorded as None.
    ``files`` is filled in by :func:`write_results`."""
    trace = trace or {}
    if identity is None and "content_sha256" in trace:
        identity = run_identity(config, trace)
    return {
        "manifest_version": MANIFEST_VERSION,
        "kind": "run",
        "driver": driver,
        "semantics_version": SEMANTICS_VERSION,
        "identity": identity,
        "run_id": run_id(identity) if identity is not None else None,
        "config": config,
        "config_hash": config_hash(config),
        "trace": trace,
        "seed": seed,
        "versions": package_versions(),
        "git_revision": _cached_git_revision(),
        "command": sys.argv,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- where results may go
def manifest_kind(manifest: object) -> str | None:
    """``"run"``, ``"sweep"`` or ``"sweeps"`` for a kvlab manifest, None for anything else."""
    if not isinstance(manifest, dict) or "manifest_version" not in manifest:
        return None
    kind = manifest.get("kind")
    if kind in KINDS:
        return kind
    driver = manifest.get("driver")
    return driver if driver in ("sweep", "sweeps") else "run"


def folder_kind(path: Path) -> str | None:
    """The kind of kvlab result in folder ``path`` (from its manifest), None if it holds none."""
    try:
        return manifest_kind(json.loads(regular_result_file(path / MANIFEST).read_text()))
    except (OSError, ValueError, ResultsError):
        return None


def _refuse(path: Path, what: str, todo: str) -> ResultsLocationError:
    return ResultsLocationError(f"{path}: {what}; {todo}")


def _probe_writable(folder: Path, out: Path) -> None:
    """Create and remove a hidden temporary file in ``folder``; refuse ``out`` if that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvlab-probe.", dir=folder)
    except OSError as exc:
        raise _refuse(out, f"cannot write in {folder} ({exc.strerror or exc})",
                      "choose a writable location for --out") from None
    os.close(fd)
    os.unlink(name)


def check_output_location(out: str | os.PathLike, kind: str = "run", *, experiment: bool = False) -> Path:
    """Refuse an output location before any work is done; return it as an absolute path.

    Accepted: an absent path (its nearest existing ancestor a writable folder), an empty folder, or a
    folder holding a kvlab result of the same ``kind`` (a run folder must hold only kvlab file names,
    since replacing it deletes them). Refused with ResultsLocationError: a file or symbolic link, a
    non-empty folder that is not a kvlab result, a kvlab result of another kind (a sweep given as a
    run's out or vice versa), a location that cannot be written; a sweep folder holding an experiment's
    results (``kvlab run``: :func:`~kvlab.results.trust.experiment_holder`) unless ``experiment`` (the
    runner), and with ``experiment`` a sweep folder holding runs of ``kvlab replay`` / ``kvlab sweep``.
    Creates nothing that stays."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = Path(os.path.abspath(os.fspath(out)))
    if not out.name:
        raise _refuse(out, "is a file-system root", "give a folder below it")
    if out.is_symlink():
        raise _refuse(out, "is a symbolic link", "give the real folder path (kvlab replaces OUT as a whole)")
    if out.exists():
        if not out.is_dir():
            raise _refuse(out, "is a file, not a folder", "give a new or empty folder for the results")
        try:
            entries = sorted(os.listdir(out))
        except OSError as exc:
            raise _refuse(out, f"cannot be read ({exc.strerror})", "choose another folder") from None
        # kvlab's own transient names (another writer's temporary or probe) do not make a folder non-empty
        entries = [e for e in entries if not (TEMP_RE.match(e) or e.startswith(".kvlab-probe."))]
        if entries:
            found = folder_kind(out)
            if found is None and MANIFEST in entries:
                try:
                    json.loads(regular_result_file(out / MANIFEST).read_text())
                except (ValueError, OSError, ResultsError) as exc:
                    raise _refuse(out, f"holds an unreadable {MANIFEST} ({_one_line(exc)})",
                                  "repair or move it, or give another folder") from None
            if found is None:
                raise _refuse(out, "is not empty and holds no kvlab result",
                              "give a new or empty folder (kvlab never deletes files it did not write)")
            if found != kind:
                raise _refuse(out, f"holds a kvlab {found}, not a {kind}",
                              f"give another folder for this {kind}")
            if kind == "sweep":
                _check_sweep_owner(out, experiment)
            if kind == "run":
                foreign = [e for e in entries if not (is_run_file_name(e) and (out / e).is_file()
                                                      and not (out / e).is_symlink())]
                if foreign:
                    raise _refuse(out, f"holds files kvlab did not write ({', '.join(foreign[:3])})",
                                  "move them away or give another folder")
        if kind == "run":
            if not os.access(out, os.W_OK | os.X_OK):
                raise _refuse(out, "cannot be modified", "choose a writable location for --out")
            _probe_writable(out.parent, out)
        else:
            _probe_writable(out, out)
        return out
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _refuse(out, f"{ancestor} is a file, not a folder", "give a path below a folder")
    _probe_writable(ancestor, out)
    return out


def _check_sweep_owner(out: Path, experiment: bool) -> None:
    """Refuse a sweep folder of the other command: an experiment's (``kvlab run``) for a replay sweep, a
    replay sweep's for an experiment (their rows would mix in one table, config columns empty)."""
    holder = experiment_holder(out)
    if not experiment and holder is not None:
        raise _refuse(out, f"holds the results of experiment {holder!r} (kvlab run)",
                      "give another folder for this sweep (its rows would mix into the experiment's table)")
    if experiment and holder is None and holds_runs(out):
        raise _refuse(out, "holds a sweep of kvlab replay / kvlab sweep, not an experiment's results",
                      "give another --results folder (or rename the experiment)")


# ----------------------------------------------------------------------------- writing a run
def _check_table_name(name: str) -> None:
    if safe_name(name) != name:
        raise ValueError(f"table name {name!r} is not a safe file name ([A-Za-z0-9._-], no leading dot)")


def write_results(out: str | Path, tables: dict[str, pd.DataFrame], summary: dict, manifest: dict) -> Path:
    """Write a run to ``out`` atomically and return its absolute path.

    ``out`` is checked first (:func:`check_output_location`, kind ``"run"``). The tables, ``summary.json``
    and finally ``manifest.json`` (with ``files``: sha256 and bytes of each) go into a hidden temporary
    folder beside ``out``, which is then swapped in (:func:`~kvlab.results.paths.replace_folder`): no
    instant without a complete ``out``; the previous run's files are deleted after the swap."""
    if "requests" not in tables:
        raise ValueError("a run needs a 'requests' table")
    for name in tables:
        _check_table_name(name)
    out = check_output_location(out, "run")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent, [out.name])
    tmp = make_temp_dir(out.parent, out.name)
    try:
        files: dict[str, dict] = {}
        for name, frame in tables.items():
            path = tmp / f"{name}.parquet"
            frame.to_parquet(path, index=False)
            files[path.name] = file_entry(path)
            checkpoint("run-file")
        (tmp / SUMMARY).write_text(dumps(summary, sort_keys=False) + "\n")
        files[SUMMARY] = file_entry(tmp / SUMMARY)
        checkpoint("run-file")
        (tmp / MANIFEST).write_text(dumps({**manifest, "kind": "run", "files": files}) + "\n")
        checkpoint("run-commit")
        replace_folder(tmp, out)
    except BaseException:
        if tmp.exists():
            remove_kvlab_folder(tmp)
        raise
    finally:
        release_temp(tmp)
    return out


# ----------------------------------------------------------------------------- reading a run back
def regular_result_file(file: Path) -> Path:
    """``file`` if it is a regular file (``stat``, symbolic links followed, never opened); ResultsError naming it
    otherwise: ``missing``, or ``is a FIFO (named pipe), not a regular file`` (the run counts as damaged). Every
    file read from a results folder is checked so first (kvlab.inputs.regular_file is the rule for inputs)."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise ResultsError(f"{file}: missing") from None
    except OSError as exc:
        raise ResultsError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    kind = not_regular(mode)
    if kind is not None:
        raise ResultsError(f"{file}: is {kind}, not a regular file (damaged; kvlab never wrote it)")
    return file


def read_manifest(path: str | Path) -> dict:
    """The manifest of results folder ``path``; ResultsError naming the file when absent, not a regular file
    or not valid."""
    file = Path(path) / MANIFEST
    try:
        regular_result_file(file)
        text = file.read_text()
    except ResultsError:
        if not os.path.lexists(file):
            raise ResultsError(f"{path}: not a kvlab results folder (no {MANIFEST})") from None
        raise
    except FileNotFoundError:
        raise ResultsError(f"{path}: not a kvlab results folder (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{file}: cannot be read ({exc})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                           "the file is truncated or corrupt") from None
    if manifest_kind(manifest) is None:
        raise ResultsError(f"{file}: not a kvlab manifest (no manifest_version)")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Check every file the manifest lists: present, recorded size, recorded sha256 (ResultsError)."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ResultsError(f"{path / MANIFEST}: lists no files (written by an older kvlab, or incomplete)")
    for name, entry in sorted(files.items()):
        if not isinstance(name, str) or safe_name(name) != name or not isinstance(entry, dict):
            raise ResultsError(f"{path / MANIFEST}: bad file entry {name!r}")
        file = path / name
        try:
            size = regular_result_file(file).stat().st_size
        except (ResultsError, FileNotFoundError):
            if os.path.lexists(file):
                raise
            raise ResultsError(f"{file}: missing (listed in {MANIFEST})") from None
        if size != entry.get("bytes"):
            raise ResultsError(f"{file}: {size} bytes, but {MANIFEST} records {entry.get('bytes')} "
                               "(truncated or replaced)")
        if file_entry(file)["sha256"] != entry.get("sha256"):
            raise ResultsError(f"{file}: sha256 differs from the one {MANIFEST} records (corrupt or modified)")


def verify_run(path: str | Path, expected_run_id: str | None = None) -> dict:
    """The manifest of a complete run at ``path`` (of ``expected_run_id`` when given); ResultsError
    naming the file and the problem otherwise."""
    path = Path(path)
    manifest = read_manifest(path)
    if expected_run_id is not None and manifest.get("run_id") != expected_run_id:
        raise ResultsError(f"{path / MANIFEST}: run_id {manifest.get('run_id')!r}, expected {expected_run_id!r}")
    identity = manifest.get("identity")
    if identity is not None and manifest.get("run_id") != run_id(identity):
        raise ResultsError(f"{path / MANIFEST}: run_id does not match the recorded identity (modified)")
    verify_files(path, manifest)
    return manifest


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def read_table(file: Path) -> pd.DataFrame:
    """A parquet table under today's column names (kvlab.names); ResultsError naming the file when
    missing or unreadable (truncated, corrupt)."""
    regular_result_file(file)
    try:
        return canonical_columns(pd.read_parquet(file))
    except FileNotFoundError:
        raise ResultsError(f"{file}: missing") from None
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise ResultsError(f"{file}: not a readable parquet table, truncated or corrupt ({_one_line(exc)})") from None


def read_json(file: Path) -> object:
    """A JSON file; ResultsError naming the file when missing or not valid JSON."""
    regular_result_file(file)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{file}: missing") from None
    except (ValueError, OSError) as exc:
        raise ResultsError(f"{file}: not valid JSON, truncated or corrupt ({_one_line(exc)})") from None


def _read_at(dfd: int, name: str, where: Path) -> bytes:
    """The bytes of regular file ``name`` in the folder open as ``dfd`` (ResultsError naming ``where / name``;
    a FIFO or device is refused by ``stat`` before opening, and opened non-blocking then checked again, so a
    file swapped in between cannot block the reader either)."""
    try:
        kind = not_regular(os.stat(name, dir_fd=dfd).st_mode)
        if kind is None:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dfd)
            kind = not_regular(os.fstat(fd).st_mode)
            if kind is not None:
                os.close(fd)
    except FileNotFoundError:
        raise ResultsError(f"{where / name}: missing") from None
    except OSError as exc:
        raise ResultsError(f"{where / name}: cannot be read ({exc.strerror or exc})") from None
    if kind is not None:
        raise ResultsError(f"{where / name}: is {kind}, not a regular file (damaged; kvlab never wrote it)")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _read_snapshot(path: Path) -> RunResult:
    """One consistent reading of the run at ``path``: every file is read through one open handle on the
    folder, so a replacement of the run (a folder exchange) between two files cannot mix two runs."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing (no kvlab result there)") from None
    except OSError as exc:
        raise ResultsError(f"{path}: not a readable results folder ({exc.strerror or exc})") from None
    try:
        try:
            raw = _read_at(dfd, MANIFEST, path)
        except ResultsError:
            if not (path / MANIFEST).exists():
                raise ResultsError(f"{path}: not a kvlab results folder (no {MANIFEST})") from None
            raise
        try:
            manifest = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path / MANIFEST}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                               f"{exc.colno}); the file is truncated or corrupt") from None
        except ValueError as exc:  # not UTF-8
            raise ResultsError(f"{path / MANIFEST}: not valid JSON ({_one_line(exc)}); the file is truncated or "
                               "corrupt") from None
        if manifest_kind(manifest) is None:
            raise ResultsError(f"{path / MANIFEST}: not a kvlab manifest (no manifest_version)")
        files = manifest.get("files")
        if files is None:  # written before manifests listed their files: read without checks
            names = sorted(p.name for p in path.glob("*.parquet")) + [SUMMARY]
            data = {n: _read_at(dfd, n, path) for n in names}
        else:
            if not isinstance(files, dict):
                raise ResultsError(f"{path / MANIFEST}: bad file list")
            data = {}
            for name, entry in sorted(files.items()):
                if not isinstance(name, str) or safe_name(name) != name or not isinstance(entry, dict):
                    raise ResultsError(f"{path / MANIFEST}: bad file entry {name!r}")
                blob = _read_at(dfd, name, path)
                if len(blob) != entry.get("bytes"):
                    raise ResultsError(f"{path / name}: {len(blob)} bytes, but {MANIFEST} records "
                                       f"{entry.get('bytes')} (truncated or replaced)")
                if hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
                    raise ResultsError(f"{path / name}: sha256 differs from the one {MANIFEST} records "
                                       "(corrupt or modified)")
                data[name] = blob
            if SUMMARY not in data:
                data[SUMMARY] = _read_at(dfd, SUMMARY, path)
    finally:
        os.close(dfd)
    tables = {}
    for name in sorted(n for n in data if n.endswith(".parquet")):
        try:
            tables[name[: -len(".parquet")]] = pd.read_parquet(io.BytesIO(data[name]))
        except Exception as exc:  # pyarrow raises several types for damaged files
            raise ResultsError(f"{path / name}: not a readable parquet table, truncated or corrupt "
                               f"({_one_line(exc)})") from None
    try:
        summary = json.loads(data[SUMMARY])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path / SUMMARY}: not valid JSON, truncated or corrupt ({_one_line(exc)})") from None
    if not isinstance(summary, dict):
        raise ResultsError(f"{path / SUMMARY}: expected a JSON object")
    driver = manifest.get("driver")  # old names of this driver's results too (kvlab.names.DRIVER_ALIASES)
    tables = {name: canonical_columns(frame, driver) for name, frame in tables.items()}
    check_columns(path, driver, tables)
    return RunResult(path=path, tables=tables, summary=canonical_keys(summary, driver), manifest=manifest)


def read_results(path: str | Path) -> RunResult:
    """Read a run written by :func:`write_results`, checking every file against the manifest's sizes and
    checksums. Raises ResultsError naming the file and what is wrong (never a raw parser traceback).
    A run replaced while it is read is read again (the replacement is atomic, so a second reading sees
    one complete run). Runs from before manifests listed their files are read without the checks. A ``path``
    that is not a str or path (``read_results(None)``) is one ConfigError naming the argument."""
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"path: expected a run's results folder (a str or path), got {kind_of(path)}")
    path = Path(path)
    for attempt in range(5):
        inode = _inode(path)
        try:
            return _read_snapshot(path)
        except ResultsError:
            if attempt == 4 or inode is None or _inode(path) == inode:  # same folder: really damaged
                raise
    raise AssertionError("unreachable")


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def is_complete(path: str | Path, identity: dict | str | None = None) -> bool:
    """True if ``path`` holds a complete run (manifest readable, every listed file present with its
    recorded size and sha256) of ``identity`` (an identity dict or a run_id; None: any run)."""
    expected = run_id(identity) if isinstance(identity, dict) else identity
    try:
        verify_run(path, expected)
    except ResultsError:
        return False
    return True
