"""Tiered replay speed: block lookups/s of the compiled kernels on Mooncake conversation, one tier and two.

Figures, all on the same encoded trace in one run (block lookups = Σ full prompt blocks):
* ``single tier``: the device alone (kvlab.cache.compiled, the kernel every run without tiers uses);
* ``two tiers``: the device plus a DRAM tier 10x its size, write_back, LRU on both (kvlab.tiers.compiled);
* ``two tiers, Python``: the same run in the Python core (kvlab.tiers.TierStack), the reference semantics.

``loop``: the kernel alone, best of ``--repeats`` (compiled before timing); ``replay()``: the summary's
``block_lookups / replay_seconds`` of a full ``replay`` call (the tiered one also allocates the tier state).
The two backends' results are checked equal (every requests column and every tier counter).

Run: ``python benchmarks/bench_tiers.py [--trace NAME] [--capacity BLOCKS] [--ratio 10]``.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd

from kvlab.cache.compiled import run_compiled
from kvlab.policies import make_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.tiers import Tier
from kvlab.tiers.compiled import TieredReplay
from kvlab.workload import load_trace


def best(fn, repeats: int) -> float:
    """Best-of-``repeats`` seconds of ``fn()``."""
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--capacity", type=int, default=2_000, help="device blocks")
    ap.add_argument("--ratio", type=int, default=10, help="DRAM blocks per device block")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    workload = load_trace(args.trace)
    tiers = [Tier(name="dram", capacity_blocks=args.ratio * args.capacity, policy="lru", write="write_back")]
    cfg = ReplayConfig(capacity_blocks=args.capacity, policy="lru")
    enc = encode(workload, cfg)
    lookups = len(enc.key_ids)
    print(f"trace {workload.name}: {len(workload):,} requests, {lookups:,} block lookups, block size "
          f"{enc.block_size}; device {args.capacity:,} blocks LRU; DRAM {tiers[0].capacity_blocks:,} blocks LRU "
          "write_back")

    pol = make_policy("lru")
    pol.prepare(enc)
    one = replay(workload, cfg, encoded=enc, backend="compiled")  # compiles (or loads) the single-tier kernel
    loop1 = best(lambda: run_compiled(pol.compiled, enc, args.capacity, False, pol.compiled_params()), args.repeats)
    two = replay(workload, cfg, encoded=enc, backend="compiled", tiers=tiers)  # compiles the tiered kernel
    tiered = TieredReplay(pol.compiled, pol.compiled_params(), tiers, enc, args.capacity, False, None)
    loop2 = best(tiered.run, args.repeats)
    two = replay(workload, cfg, encoded=enc, backend="compiled", tiers=tiers)
    slow = replay(workload, cfg, encoded=enc, backend="python", tiers=tiers)

    pd.testing.assert_frame_equal(two.requests, slow.requests)
    assert two.summary["tiers"] == slow.summary["tiers"]

    def row(label: str, loop: float | None, summary: dict) -> None:
        rate = lookups / summary["replay_seconds"] / 1e6
        loop_text = f"{lookups / loop / 1e6:>9.2f}" if loop else f"{'-':>9}"
        print(f"{label:<22} {loop_text} {rate:>11.2f} {summary['token_hit_rate']:>10.4f} "
              f"{summary.get('device_token_hit_rate', summary['token_hit_rate']):>11.4f}")

    print(f"{'M block lookups/s':<22} {'loop':>9} {'replay()':>11} {'token hit':>10} {'device hit':>11}")
    row("single tier, compiled", loop1, one.summary)
    row("two tiers, compiled", loop2, two.summary)
    row("two tiers, Python", None, slow.summary)
    dram = two.summary["tiers"][0]
    print(f"two tiers: compiled / Python = {slow.summary['replay_seconds'] / two.summary['replay_seconds']:.0f}x "
          f"(replay()); two tiers take {loop2 / loop1:.2f}x the single tier's time (loop); "
          f"DRAM hit share {dram['hit_share']:.4f}, DRAM evictions {dram['evictions']:,}")


if __name__ == "__main__":
    main()
