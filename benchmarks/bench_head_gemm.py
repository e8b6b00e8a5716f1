"""Time of the LM head (and one MLP projection) against the number of rows it multiplies: why a packed decode
step of 2-3 sequences costs more on this CPU than one of 4 (docs/simulator.md, "With continuous batching").

A decode step computes one logit row per sequence: ``rows × hidden`` times the ``vocab × hidden`` head. The
simulator's step equation reads the head's weights once per step and charges ``2 × vocab × hidden`` FLOPs per
row; a BLAS may instead stream the whole matrix once per row below some row count (a matrix-vector product
per row) and switch to a blocked GEMM above it. This script prints milliseconds per call and the ratio to one
row, for the ``--shape`` model's sizes, one torch thread (as the engine's fidelity runs), median of
``--repeats`` calls.

    python benchmarks/bench_head_gemm.py                 # cpu-bench: vocab 32,000 x hidden 512, fp32
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlab.engine.model import shape_config


def median_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` over ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="cpu-bench")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = shape_config(args.shape)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=dtype)
    up = torch.randn(cfg.intermediate_size, cfg.hidden_size, generator=gen, dtype=dtype)
    mb = head.numel() * head.element_size() / 2**20
    print(f"{args.shape}: head {cfg.vocab_size} x {cfg.hidden_size} ({mb:.0f} MiB {args.dtype}), "
          f"MLP up {cfg.intermediate_size} x {cfg.hidden_size}; {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'rows':>5} {'head ms':>9} {'x 1 row':>8} {'head GB/s':>10} {'MLP up ms':>10}")
    base = None
    for rows in args.rows:
        x = torch.randn(rows, cfg.hidden_size, generator=gen, dtype=dtype)
        t_head = median_ms(lambda x=x: torch.nn.functional.linear(x, head), args.repeats)
        t_up = median_ms(lambda x=x: torch.nn.functional.linear(x, up), args.repeats)
        base = base or t_head
        print(f"{rows:>5} {t_head:>9.2f} {t_head / base:>8.2f} {mb * 2**20 / 1e9 / (t_head / 1e3):>10.1f} "
              f"{t_up:>10.3f}")


if __name__ == "__main__":
    main()
