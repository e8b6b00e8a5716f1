"""The results layout every driver writes, atomically:

    OUT/requests.parquet   one row per request, trace order
    OUT/<table>.parquet    further tidy tables (time series, sweeps) when a driver has them
    OUT/summary.json       aggregate metrics (DESIGN.md names)
    OUT/manifest.json      config, trace checksum, package versions, git revision, seed, command

A run is written into a hidden temporary folder beside OUT and renamed into place, so a crash never
leaves a half-written OUT.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.workload._common import sha256_file as file_sha256  # noqa: F401  (re-exported)

MANIFEST_VERSION = 1
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


def _json_default(obj: object) -> object:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: object, *, sort_keys: bool = True) -> str:
    """JSON text with numpy scalars converted; keys sorted by default (stable for diffs and hashing)."""
    return json.dumps(obj, indent=2, sort_keys=sort_keys, default=_json_default)


def package_versions(names: tuple[str, ...] = TRACKED_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


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


def config_hash(config: dict) -> str:
    """A short stable id of a config (used to resume sweeps)."""
    return hashlib.sha256(dumps(config).encode()).hexdigest()[:16]


def build_manifest(config: dict, *, trace: dict | None = None, seed: int | None = None, driver: str) -> dict:
    """The provenance of a run: what was run on what, with which code."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "driver": driver,
        "config": config,
        "config_hash": config_hash(config),
        "trace": trace or {},
        "seed": seed,
        "versions": package_versions(),
        "git_revision": git_revision(),
        "command": sys.argv,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_results(out: str | Path, tables: dict[str, pd.DataFrame], summary: dict, manifest: dict) -> Path:
    """Write a run to ``out`` atomically (replacing an existing run there). Returns the path."""
    out = Path(out)
    if "requests" not in tables:
        raise ValueError("a run needs a 'requests' table")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, frame in tables.items():
            frame.to_parquet(tmp / f"{name}.parquet", index=False)
        (tmp / "summary.json").write_text(dumps(summary, sort_keys=False) + "\n")
        (tmp / "manifest.json").write_text(dumps(manifest) + "\n")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_results(path: str | Path) -> RunResult:
    """Read a run written by :func:`write_results`."""
    path = Path(path)
    if not (path / "manifest.json").exists():
        raise FileNotFoundError(f"{path}: not a kvlab results folder (no manifest.json)")
    tables = {p.stem: pd.read_parquet(p) for p in sorted(path.glob("*.parquet"))}
    return RunResult(
        path=path,
        tables=tables,
        summary=json.loads((path / "summary.json").read_text()),
        manifest=json.loads((path / "manifest.json").read_text()),
    )


def is_complete(path: str | Path, config: dict) -> bool:
    """True if ``path`` holds a finished run of exactly ``config`` (for resuming sweeps)."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        return manifest["config_hash"] == config_hash(config)
    return False
