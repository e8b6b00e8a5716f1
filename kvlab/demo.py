"""The main job on the embedded default workload: no download, a summary table and one figure.

``kvlab demo`` generates the synthetic multi-tenant chat + RAG workload (kvlab.workload.generate),
replays it with LRU at a range of capacities in both counting modes, and writes under OUT:
``sweep.parquet`` + ``summary.csv`` (one row per run), ``runs/`` (per-request results and manifests)
and ``hit_rate_vs_capacity.png``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvlab.plots import plot_hit_rate_vs_capacity  # noqa: E402
from kvlab.results import atomic_write_file, check_output_location  # noqa: E402
from kvlab.sweep import grid, run_sweep  # noqa: E402
from kvlab.workload.generate import synthetic_chat  # noqa: E402

CAPACITIES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def run_demo(out: str | Path = "results/demo", *, quick: bool = False, progress: bool = True) -> Path:
    """Run the demo into ``out`` (a new, empty or earlier sweep folder; checked before any work); every
    file is written atomically."""
    out = check_output_location(out, "sweep")
    workload = synthetic_chat(400 if quick else 2000, seed=0)
    configs = grid(CAPACITIES[:5] if quick else CAPACITIES, policies=("lru",), modes=("vllm",), block_size=16)
    table = run_sweep(workload, configs, out, progress=progress)
    cols = ["policy", "capacity_blocks", "mode", "token_hit_rate", "block_hit_rate", "request_hit_rate",
            "mean_request_hit_rate", "ideal_hit_rate", "evictions", "mean_occupancy"]
    atomic_write_file(out / "summary.csv", lambda p: table[cols].to_csv(p, index=False))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    plot_hit_rate_vs_capacity(table, ax=ax, title=f"{workload.name}: {len(workload)} requests, 16-token blocks")
    fig.tight_layout()
    atomic_write_file(out / "hit_rate_vs_capacity.png", lambda p: fig.savefig(p, dpi=150, format="png"))
    plt.close(fig)
    return out
