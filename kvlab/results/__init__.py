"""Results: tidy frames on disk (parquet) with a summary and a manifest, written atomically."""

from kvlab.results.store import (
    RunResult,
    build_manifest,
    config_hash,
    file_sha256,
    is_complete,
    read_results,
    write_results,
)

__all__ = [
    "RunResult",
    "build_manifest",
    "config_hash",
    "file_sha256",
    "is_complete",
    "read_results",
    "write_results",
]
