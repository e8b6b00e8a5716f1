"""The main job on the embedded default workload: no download, a summary table and one figure.

``kvlab demo`` generates the synthetic multi-tenant chat + RAG workload (kvlab.workload.generate),
replays it with LRU (vLLM counting) at eight doubling capacities, the smallest holding the largest request
(so none is rejected), and writes under OUT:
``sweep.parquet`` + ``summary.csv`` (one row per run), ``runs/`` (per-request results and manifests)
and the figure ``figure/hit_rate_vs_capacity`` (paper preset, one column wide: ``.png``, ``.pdf``, its data
``.parquet`` and caption ``.json``, owned outputs of kvlab.plots.style.save). :func:`summary_lines` is the table
``kvlab demo`` prints: capacity, token hit rate, rejected requests per run.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvlab.plots import style  # noqa: E402
from kvlab.results import atomic_write_file, check_output_location  # noqa: E402
from kvlab.sweep import grid, run_sweep  # noqa: E402
from kvlab.workload.generate import synthetic_chat  # noqa: E402

BLOCK_SIZE = 16
#: capacities in blocks, doubling from the smallest power of two that holds the workload's largest
#: request (381 blocks for the 2,000-request demo), so no run rejects a request
STEPS = 8
#: the demo's figure: OUT/<FIGURES>/<FIGURE>.png, .pdf, .parquet, .json (a folder of its own: the figure files
#: are owned outputs with their listing, beside the sweep's files)
FIGURES = "figure"
FIGURE = "hit_rate_vs_capacity"
#: summary.csv's columns
COLUMNS = ["policy", "capacity_blocks", "mode", "token_hit_rate", "block_hit_rate", "request_hit_rate",
           "mean_request_hit_rate", "ideal_hit_rate", "evictions", "rejected_requests", "mean_occupancy"]


def capacities(workload, steps: int = STEPS, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    """``steps`` doubling capacities (blocks), the smallest holding the largest request of ``workload``."""
    largest = int(-(-workload.input_length.max() // block_size))
    first = 1 << max(0, (largest - 1).bit_length())
    return tuple(first << i for i in range(steps))


def run_demo(out: str | Path = "results/demo", *, quick: bool = False, progress: bool = True) -> Path:
    """Run the demo into ``out`` (a new, empty or earlier demo folder; checked, with the figure's four files,
    before any work); every file is written atomically."""
    from kvlab.results.owned import check_folder

    out = check_output_location(out, "sweep")
    check_folder(out / FIGURES, flag="--out", names=style.save_names(FIGURE))  # before any work; creates nothing
    workload = synthetic_chat(400 if quick else 2000, seed=0)
    caps = capacities(workload, steps=5 if quick else STEPS)
    configs = grid(caps, policies=("lru",), modes=("vllm",), block_size=BLOCK_SIZE)
    table = run_sweep(workload, configs, out, progress=progress)
    atomic_write_file(out / "summary.csv", lambda p: table[COLUMNS].to_csv(p, index=False))
    data = table[COLUMNS].sort_values("capacity_blocks").reset_index(drop=True)
    fig = draw(data, f"{workload.name}: {len(workload):,} requests")
    best = data.iloc[-1]
    first = data.iloc[0]
    finding = (f"LRU's token hit rate rises from {first['token_hit_rate']:.3f} at {first['capacity_blocks']:,}"
               f" blocks to {best['token_hit_rate']:.3f} at {best['capacity_blocks']:,} blocks of {BLOCK_SIZE} tokens "
               f"(infinite cache: {best['ideal_hit_rate']:.3f}); no request rejected"
               if not data["rejected_requests"].any() else
               f"LRU's token hit rate against capacity; {int(data['rejected_requests'].sum()):,} requests rejected")
    try:
        style.save(fig, out / FIGURES, FIGURE, data=data,
                   caption=style.caption(finding, config=configs[0].to_dict(), workload=workload,
                                         run_ids=sorted(table["run_id"]) if "run_id" in table else None))
    finally:
        plt.close(fig)
    return out


def draw(data: pd.DataFrame, title: str):  # noqa: ANN201 - a matplotlib Figure
    """The demo's figure: token hit rate against capacity (blocks, log 2), LRU in its fixed style, the
    infinite cache as the baseline; one column wide (style.figure)."""
    fig, ax = style.figure(width="column")
    x = data["capacity_blocks"]
    ax.plot(x, data["token_hit_rate"], label="lru", **style.policy_style("lru"))
    ax.axhline(data["ideal_hit_rate"].max(), label="infinite cache", **style.baseline_style("infinite cache"))
    ax.set_xscale("log", base=2)
    ticks = list(x)[::2] if len(x) > 5 else list(x)  # every other capacity: labels never touch in a column
    style.value_ticks(ax, ticks)
    ax.set_xlabel(f"capacity (blocks of {BLOCK_SIZE} tokens, log scale)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, min(1.0, 1.2 * float(data["ideal_hit_rate"].max())))
    ax.grid(alpha=0.3)
    style.legend(ax, loc="lower right")
    ax.set_title(title)
    return fig


def summary_lines(out: str | Path) -> list[str]:
    """The demo's table from ``out/summary.csv``: capacity (blocks), token hit rate, infinite-cache hit rate
    and rejected requests, one line per run."""
    table = pd.read_csv(Path(out) / "summary.csv").sort_values("capacity_blocks")
    lines = [f"{'capacity_blocks':>15}  {'token_hit_rate':>14}  {'ideal_hit_rate':>14}  {'rejected_requests':>17}"]
    for row in table.itertuples():
        lines.append(f"{row.capacity_blocks:>15,}  {row.token_hit_rate:>14.4f}  {row.ideal_hit_rate:>14.4f}  "
                     f"{row.rejected_requests:>17,}")
    return lines
