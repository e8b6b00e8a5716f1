"""The main job on the embedded default workload: no download, a summary table and one figure.

``kvlab demo`` generates the synthetic multi-tenant chat + RAG workload (kvlab.workload.generate),
replays it with LRU (vLLM counting) at eight doubling capacities, the smallest holding the largest request
(so none is rejected), and writes under OUT:
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

BLOCK_SIZE = 16
#: capacities in blocks, doubling from the smallest power of two that holds the workload's largest
#: request (381 blocks for the 2,000-request demo), so no run rejects a request
STEPS = 8


def capacities(workload, steps: int = STEPS, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    """``steps`` doubling capacities (blocks), the smallest holding the largest request of ``workload``."""
    largest = int(-(-workload.input_length.max() // block_size))
    first = 1 << max(0, (largest - 1).bit_length())
    return tuple(first << i for i in range(steps))


def run_demo(out: str | Path = "results/demo", *, quick: bool = False, progress: bool = True) -> Path:
    """Run the demo into ``out`` (a new, empty or earlier sweep folder; checked before any work); every
    file is written atomically."""
    out = check_output_location(out, "sweep")
    workload = synthetic_chat(400 if quick else 2000, seed=0)
    caps = capacities(workload, steps=5 if quick else STEPS)
    configs = grid(caps, policies=("lru",), modes=("vllm",), block_size=BLOCK_SIZE)
    table = run_sweep(workload, configs, out, progress=progress)
    cols = ["policy", "capacity_blocks", "mode", "token_hit_rate", "block_hit_rate", "request_hit_rate",
            "mean_request_hit_rate", "ideal_hit_rate", "evictions", "rejected_requests", "mean_occupancy"]
    atomic_write_file(out / "summary.csv", lambda p: table[cols].to_csv(p, index=False))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    plot_hit_rate_vs_capacity(table, ax=ax, title=f"{workload.name}: {len(workload)} requests, "
                              f"{BLOCK_SIZE}-token blocks")
    fig.tight_layout()
    atomic_write_file(out / "hit_rate_vs_capacity.png", lambda p: fig.savefig(p, dpi=150, format="png"))
    plt.close(fig)
    return out
