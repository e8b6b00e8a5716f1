"""Sweeps: many replays of one workload (policies x capacities x counting modes), resumable.

Layout under OUT: ``runs/<config_hash>/`` holds each finished replay (the shared results layout) and
``sweep.parquet`` one row per run (config columns + summary metrics), rewritten atomically after every
run. A sweep interrupted at any point restarts where it stopped: finished runs are read back, not redone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.replay import ReplayConfig, encode, replay
from kvlab.results import build_manifest, config_hash, is_complete, read_results
from kvlab.results.store import dumps
from kvlab.workload.workload import Workload

HASH_FIELDS = ("hash", "root_seed", "model_id", "block_size", "verify")


def grid(
    capacities: Iterable[int],
    policies: Sequence[str] = ("lru",),
    modes: Sequence[str] = ("vllm",),
    **common: object,
) -> list[ReplayConfig]:
    """ReplayConfigs for every (policy, capacity, mode), sharing the ``common`` fields."""
    return [
        ReplayConfig(capacity_blocks=int(c), policy=p, mode=m, **common)  # type: ignore[arg-type]
        for p, c, m in itertools.product(policies, capacities, modes)
    ]


def run_sweep(
    workload: Workload,
    configs: Sequence[ReplayConfig],
    out: str | Path | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
) -> pd.DataFrame:
    """Replay ``workload`` under each config; return (and with ``out``, write) one row per run.

    Hashing is done once per distinct hash setting. With ``out`` and ``resume``, runs already on disk
    with the same config are read back instead of replayed.
    """
    out_path = Path(out) if out is not None else None
    rows: list[dict] = []
    encodings: dict[tuple, object] = {}
    bar = tqdm(configs, disable=not progress, desc=f"sweep {workload.name}", unit="run")
    for config in bar:
        run_dir = out_path / "runs" / config_hash(config.to_dict()) if out_path else None
        if run_dir is not None and resume and is_complete(run_dir, config.to_dict()):
            summary = read_results(run_dir).summary
        else:
            hkey = tuple(getattr(config, f) for f in HASH_FIELDS)
            if hkey not in encodings:
                encodings[hkey] = encode(workload, config)
            result = replay(workload, config, encoded=encodings[hkey])
            summary = result.summary
            if run_dir is not None:
                result.save(run_dir)
        bar.set_postfix(policy=config.policy, capacity=config.capacity_blocks)
        rows.append({"trace": workload.name, "config_hash": config_hash(config.to_dict()), **summary})
        if out_path is not None:
            _write_table(out_path, pd.DataFrame(rows), workload, configs)
    return pd.DataFrame(rows)


def _write_table(out: Path, table: pd.DataFrame, workload: Workload, configs: Sequence[ReplayConfig]) -> None:
    """Rewrite ``sweep.parquet`` + manifest atomically (the ``runs/`` folder is left in place)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".sweep.parquet.tmp"
    table.to_parquet(tmp, index=False)
    tmp.replace(out / "sweep.parquet")
    manifest = build_manifest(
        {"configs": [c.to_dict() for c in configs]},
        trace={"name": workload.name, "source": workload.source, "sha256": workload.checksum,
               "requests": len(workload)},
        seed=configs[0].seed if configs else None,
        driver="sweep",
    )
    tmp_m = out / ".manifest.json.tmp"
    tmp_m.write_text(dumps(manifest) + "\n")
    tmp_m.replace(out / "manifest.json")


def read_sweep(out: str | Path) -> pd.DataFrame:
    """The ``sweep.parquet`` table of a sweep folder."""
    return pd.read_parquet(Path(out) / "sweep.parquet")


__all__ = ["grid", "read_sweep", "run_sweep"]
