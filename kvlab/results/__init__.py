"""Results: tidy frames on disk (parquet) with a summary and a manifest, written atomically.

See docs/results.md: the layout, run identity, completeness, replacement rules, locks and safe names.
"""

from kvlab.results.faults import checkpoint
from kvlab.results.identity import SEMANTICS_VERSION, run_id, run_identity
from kvlab.results.locking import locked
from kvlab.results.paths import atomic_write_file, safe_name
from kvlab.results.runs import load
from kvlab.results.store import (
    RunResult,
    build_manifest,
    check_output_location,
    config_hash,
    file_sha256,
    folder_kind,
    is_complete,
    read_manifest,
    read_results,
    read_table,
    verify_run,
    write_results,
)
from kvlab.results.trust import ResultsWarning

__all__ = [
    "SEMANTICS_VERSION",
    "ResultsWarning",
    "RunResult",
    "atomic_write_file",
    "build_manifest",
    "check_output_location",
    "checkpoint",
    "config_hash",
    "file_sha256",
    "folder_kind",
    "is_complete",
    "load",
    "locked",
    "read_manifest",
    "read_results",
    "read_table",
    "run_id",
    "run_identity",
    "safe_name",
    "verify_run",
    "write_results",
]

