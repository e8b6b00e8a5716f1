"""Results: tidy frames on disk (parquet) with a summary and a manifest, written atomically.

See docs/results.md: the layout, run identity, completeness, replacement rules, locks and safe names.
"""

from kvlab.results.faults import checkpoint
from kvlab.results.identity import SEMANTICS_VERSION, run_id, run_identity
from kvlab.results.locking import locked
from kvlab.results.paths import atomic_write_file, safe_name
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

__all__ = [
    "SEMANTICS_VERSION",
    "RunResult",
    "atomic_write_file",
    "build_manifest",
    "check_output_location",
    "checkpoint",
    "config_hash",
    "file_sha256",
    "folder_kind",
    "is_complete",
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


def load(experiment: str, results: str = "results"):  # noqa: ANN201 - a pandas DataFrame
    """One tidy DataFrame of an experiment's complete runs: one row per run, its config fields as dotted
    columns (``cache.policy``, ``cache.capacity_blocks``, ``seed``...), then the run's summary.

    ``experiment``: an experiment name (read from ``results/<name>/``), a results folder, or the experiment's
    YAML file. See docs/experiments.md."""
    from pathlib import Path

    from kvlab.experiment.runner import load as load_folder

    given = Path(experiment)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        from kvlab.experiment import experiment_folder, load_experiment

        return load_folder(experiment_folder(load_experiment(given), results))
    if given.is_dir() and (given / "runs").is_dir():
        return load_folder(given)
    return load_folder(Path(results) / safe_name(experiment))


__all__.append("load")
