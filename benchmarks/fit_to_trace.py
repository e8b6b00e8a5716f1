"""Fit-to-trace table of the workload families' output lengths (issue 15): each fitted distribution of
kvlab.workload.families (``LengthDist(kind="fitted")``, an empirical quantile table, and its lognormal reference)
sampled beside the trace it was fitted to, in tokens.

    python benchmarks/fit_to_trace.py                  # needs ../shared/traces (Mooncake, the Alibaba sample)

Columns: mean, p50, p90, p99 (tokens) of the trace and of ``--samples`` draws (seed ``--seed``), and the
Kolmogorov-Smirnov distance between the trace's values and the draws (max |CDF difference|, 0..1).
"""

from __future__ import annotations

import argparse

import numpy as np

from kvlab.workload import load_trace
from kvlab.workload.families.base import FITTED_OUTPUT_LENGTHS, LengthDist
from kvlab.workload.sources import shared_text_dir

TRACES = {  # fit name -> (file under ../shared/traces, loader format)
    "mooncake_conversation": ("mooncake/conversation_trace.jsonl", "mooncake"),
    "mooncake_synthetic": ("mooncake/synthetic_trace.jsonl", "mooncake"),
    "alibaba_traceA_sample": ("alibaba/sample_traceA_multiturn_20.jsonl", "alibaba"),
}


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs of ``a`` and ``b``."""
    grid = np.union1d(a, b)
    ca = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.max(np.abs(ca - cb)))


def row(name: str, values: np.ndarray, ref: np.ndarray | None) -> str:
    q = np.percentile(values, [50, 90, 99])
    ks = f"{ks_distance(values, ref):.3f}" if ref is not None else "-"
    return f"{name:<34} {len(values):>8} {values.mean():>8.1f} {q[0]:>7.0f} {q[1]:>7.0f} {q[2]:>7.0f} {ks:>6}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = shared_text_dir().parent
    print(f"{'output tokens':<34} {'n':>8} {'mean':>8} {'p50':>7} {'p90':>7} {'p99':>7} {'KS':>6}")
    for fit, (rel, fmt) in TRACES.items():
        path = root / rel
        if not path.exists():
            print(f"{fit}: {path} absent (needs ../shared/traces)")
            continue
        trace = load_trace(str(path), format=fmt).output_length.astype(np.float64)
        rng = np.random.default_rng(args.seed)
        fitted = LengthDist(kind="fitted", fit=fit, min=1).sample(rng, args.samples).astype(np.float64)
        mu, sigma = FITTED_OUTPUT_LENGTHS[fit]["lognormal"]
        logn = LengthDist(kind="lognormal", mu=mu, sigma=sigma, min=1).sample(rng, args.samples).astype(np.float64)
        print(row(f"{fit} (trace)", trace, None))
        print(row("  kvlab fitted (quantile table)", fitted, trace))
        print(row(f"  lognormal ({mu:.2f}, {sigma:.2f}) reference", logn, trace))


if __name__ == "__main__":
    main()
