"""One paired comparison with its confidence interval: ARC − LRU token hit rate on Mooncake conversation.

Both policies replay the whole trace at ``--capacity`` blocks (default 10,000) in vLLM counting mode. Printed:

* **batch means**: the warmed run (the first ``--warmup`` requests dropped; they still fill the cache) cut
  into ``--batches`` contiguous windows; each policy's t-interval over its window token hit rates (Σ hit /
  Σ prompt tokens per window), and the paired t-interval of the per-window difference ARC − LRU;
* **session resampling**: ``--resamples`` resampled workloads (whole pseudo-sessions drawn with replacement:
  the trace has no session column, so requests sharing their first two block ids form one group,
  :func:`kvlab.analysis.prefix_groups`), each replayed with both policies; percentile intervals of each
  policy and of ARC − LRU on the same resamples; the same warm-up.

Deterministic for a given ``--seed``; the wall times are printed. See docs/statistics.md.
Run: ``python benchmarks/paired_ci.py [--capacity 10000] [--batches 20] [--warmup 1000] [--resamples 20]``.
"""

from __future__ import annotations

import argparse
import time

from kvlab.analysis import (
    batch_means,
    lag1_autocorrelation,
    paired_batch_means,
    paired_session_resample,
    prefix_groups,
)
from kvlab.replay import ReplayConfig, replay
from kvlab.workload import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--capacity", type=int, default=10_000, help="cache capacity (blocks)")
    ap.add_argument("--a", default="arc", help="policy A")
    ap.add_argument("--b", default="lru", help="policy B")
    ap.add_argument("--batches", type=int, default=20, help="batch-means windows")
    ap.add_argument("--warmup", type=int, default=1000, help="warm-up requests excluded from every metric")
    ap.add_argument("--resamples", type=int, default=20, help="session resamples (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--level", type=float, default=0.95)
    args = ap.parse_args()

    w = load_trace(args.trace)
    configs = {p: ReplayConfig(capacity_blocks=args.capacity, policy=p) for p in (args.a, args.b)}
    t0 = time.perf_counter()
    frames = {p: replay(w, c).requests for p, c in configs.items()}
    t_replay = time.perf_counter() - t0
    print(f"{w.name}: {len(w):,} requests, capacity {args.capacity:,} blocks, warm-up {args.warmup:,} requests, "
          f"level {args.level:.0%}")
    print(f"\nbatch means ({args.batches} windows of ~{(len(w) - args.warmup) // args.batches} requests), "
          "token hit rate (fraction):")
    kw = dict(n_batches=args.batches, level=args.level, warmup_requests=args.warmup)
    t0 = time.perf_counter()
    for p, frame in frames.items():
        iv = batch_means(frame, "token_hit_rate", **kw)
        print(f"  {p:>4}        {iv}  lag-1 autocorrelation {lag1_autocorrelation(iv.replicates):+.2f}")
    diff = paired_batch_means(frames[args.a], frames[args.b], "token_hit_rate", **kw)
    print(f"  {args.a} − {args.b}  {diff}  lag-1 autocorrelation {lag1_autocorrelation(diff.replicates):+.2f}")
    print(f"  two replays {t_replay:.2f} s, intervals {time.perf_counter() - t0:.2f} s")

    if args.resamples:
        groups = prefix_groups(w)
        t0 = time.perf_counter()
        out = paired_session_resample(
            w, lambda x: replay(x, configs[args.a]), lambda x: replay(x, configs[args.b]), "token_hit_rate",
            n_resamples=args.resamples, seed=args.seed, level=args.level, groups=groups,
            warmup_requests=args.warmup)
        elapsed = time.perf_counter() - t0
        print(f"\nsession resampling ({args.resamples} resamples of {groups.max() + 1:,} prefix groups, "
              f"seed {args.seed}, copies isolated), token hit rate (fraction):")
        print(f"  {args.a:>4}        {out['a']}")
        print(f"  {args.b:>4}        {out['b']}")
        print(f"  {args.a} − {args.b}  {out['a_minus_b']}")
        print(f"  {2 * (args.resamples + 1)} replays in {elapsed:.1f} s wall")


if __name__ == "__main__":
    main()
