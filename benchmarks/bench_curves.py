"""One-pass LRU curve (kvlab.replay.curves.lru_curve) vs the exact LRU sweep, printed (docs/curves.md).

    nice -n 19 .venv/bin/python benchmarks/bench_curves.py [--trace conversation] [--capacities 20]

Prints, per Mooncake trace: (1) the curve (default: exact below the largest request too) and the single pass
(``one_pass=True``) beside the exact replay at each capacity (token hit rate, hit blocks, rejected requests,
whether equal block for block); (2) wall seconds of both and of the exact sweep over the same capacities
(compilation excluded: each is run once untimed first; best of 3) and the ratios; (3)
SHARDS-style sampling: mean / max absolute error in token hit rate against the exact replay at the
capacities of at least the largest request, per sample rate and estimator over 10 seeds, with the sampled
curve's wall seconds; (4) mini-simulations (kvlab.replay.minisim) of several policies: the same errors at
1,000 / 3,000 / 10,000 / 30,000 blocks, 5 seeds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kvlab.replay import ReplayConfig, encode, replay
from kvlab.replay.curves import lru_curve
from kvlab.replay.minisim import mini_curve
from kvlab.workload.load import load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"
RATES = (0.5, 0.2, 0.1, 0.05, 0.01)
SEEDS = tuple(range(10))
MINI_POLICIES = ("lru", "fifo", "arc", "s3fifo", "lfu", "sieve")
MINI_RATES = (0.5, 0.2, 0.1)
MINI_SEEDS = tuple(range(5))
MINI_CAPACITIES = (1_000, 3_000, 10_000, 30_000)


def best_of(fn, repeat: int = 3) -> tuple[float, object]:
    """Fastest wall seconds of ``repeat`` calls (a shared machine) and the last call's value."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--capacities", type=int, default=20, help="log-spaced capacities, 50 .. 50,000 blocks")
    args = ap.parse_args()
    caps = np.unique(np.geomspace(50, 50_000, args.capacities).round().astype(np.int64))
    for name in args.trace:
        path = TRACES / f"{name}_trace.jsonl"
        if not path.exists():
            print(f"{path}: absent, skipped")
            continue
        bench_trace(name, load_trace(path), caps)


def bench_trace(name: str, w, caps: np.ndarray) -> None:
    """The three tables for one trace (capacities ``caps`` in blocks)."""
    cfg = ReplayConfig(capacity_blocks=int(caps[0]), policy="lru")
    enc = encode(w, cfg)
    replay(w, cfg, encoded=enc)  # compile (or load) the LRU kernel
    lru_curve(w, capacities=caps, encoded=enc)  # compile (or load) the stack kernel
    sweep_s, exact = best_of(lambda: [replay(w, cfg, encoded=enc, capacity_blocks=int(c)) for c in caps])
    curve_s, curve = best_of(lambda: lru_curve(w, capacities=caps, encoded=enc))
    one_s, one = best_of(lambda: lru_curve(w, capacities=caps, encoded=enc, one_pass=True))
    largest = curve.attrs["largest_request_blocks"]
    passes = len(np.unique(np.minimum(caps, largest)))
    print(f"\n## Mooncake {name}: {len(w)} requests, {len(enc.key_ids)} full blocks, block size "
          f"{enc.block_size} tokens, largest request {largest} blocks, diverge_from "
          f"{curve.attrs['diverge_from_blocks']}")
    print("| capacity (blocks) | rejected | exact token_hit_rate | curve | equal | one pass | abs error "
          "| hit blocks exact / one pass |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|")
    exact_rate = np.array([r.summary["token_hit_rate"] for r in exact])
    for c, r, row, o in zip(caps, exact, curve.itertuples(), one.itertuples(), strict=True):
        hb = int(r.requests["hit_blocks"].sum())
        print(f"| {c:,} | {r.summary['rejected_requests']} | {r.summary['token_hit_rate']:.4f} | "
              f"{row.token_hit_rate:.4f} | {'yes' if hb == row.hit_blocks else 'NO'} | {o.token_hit_rate:.4f} | "
              f"{abs(o.token_hit_rate - r.summary['token_hit_rate']):.4f} | {hb:,} / {o.hit_blocks:,} |")
    print(f"\nspeed ({len(caps)} capacities): exact sweep {sweep_s:.3f} s; curve {curve_s:.3f} s ({passes} passes, "
          f"{sweep_s / curve_s:.0f}x); one pass {one_s:.3f} s ({sweep_s / one_s:.0f}x)")
    full_one_s, full = best_of(lambda: lru_curve(w, encoded=enc, one_pass=True))
    full_s, _ = best_of(lambda: lru_curve(w, encoded=enc), repeat=1)
    per_run = sweep_s / len(caps)
    print(f"full curve (every capacity 1..{int(full['capacity_blocks'].max()):,}): one pass {full_one_s:.3f} s, "
          f"exact below the largest request too {full_s:.3f} s ({len(np.unique(enc.num_blocks))} distinct "
          f"request sizes); the exact sweep at {per_run:.4f} s a run would take about "
          f"{per_run * len(full):,.0f} s")
    above = caps >= largest
    print(f"\nsampling (error vs the exact replay at the {int(above.sum())} capacities >= {largest} blocks)")
    print("| sample rate | sampled blocks | estimator | mean abs error (mean over seeds) | max abs error "
          "(max over seeds) | wall s (mean) |")
    print("|---:|---:|---|---:|---:|---:|")
    for rate in RATES:
        for adjust in (True, False):
            means, maxes, walls = [], [], []
            for seed in SEEDS:
                t0 = time.perf_counter()
                s = lru_curve(w, capacities=caps[above], encoded=enc, sample_rate=rate, seed=seed, adjust=adjust)
                walls.append(time.perf_counter() - t0)
                err = np.abs(s["token_hit_rate"].to_numpy() - exact_rate[above])
                means.append(err.mean())
                maxes.append(err.max())
            print(f"| {rate} | ~{int(rate * len(enc.key_ids)):,} | {'SHARDS-adj' if adjust else 'ratio'} | "
                  f"{np.mean(means):.4f} | {np.max(maxes):.4f} | {np.mean(walls):.3f} |")
    print(f"\nmini-simulations (error vs the exact replay of each policy at {MINI_CAPACITIES} blocks, "
          f"{len(MINI_SEEDS)} seeds)")
    print("| policy | exact token_hit_rate | " + " | ".join(f"R={r} mean / max abs error" for r in MINI_RATES)
          + " | wall s per curve (R=" + "/".join(map(str, MINI_RATES)) + ") |")
    print("|---|---|" + "---:|" * (len(MINI_RATES) + 1))
    for policy in MINI_POLICIES:
        cfg = ReplayConfig(capacity_blocks=1, policy=policy)
        truth = np.array([replay(w, cfg, encoded=enc, capacity_blocks=c).summary["token_hit_rate"]
                          for c in MINI_CAPACITIES])
        cells, walls = [], []
        for rate in MINI_RATES:
            errs, wall = [], []
            for seed in MINI_SEEDS:
                t0 = time.perf_counter()
                m = mini_curve(w, policy, MINI_CAPACITIES, sample_rate=rate, seed=seed, encoded=enc)
                wall.append(time.perf_counter() - t0)
                errs.append(np.abs(m["token_hit_rate"].to_numpy() - truth))
            cells.append(f"{np.mean(errs):.4f} / {np.max(errs):.4f}")
            walls.append(f"{np.median(wall):.2f}")
        print(f"| {policy} | {' / '.join(f'{x:.3f}' for x in truth)} | {' | '.join(cells)} | {' / '.join(walls)} |")

if __name__ == "__main__":
    main()
