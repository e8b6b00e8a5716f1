"""Every registered eviction policy on Mooncake conversation: replay speed and token hit rate.

For each policy in ``kvlab.policies.available_policies()`` (whatever is registered when this runs) and
each engine it supports (``compiled`` when the policy has a numba twin, ``python`` always), one replay of
the whole trace at ``--capacity`` blocks (default 10,000) in vLLM counting mode. Columns:

* ``M lookups/s`` = Σ full prompt blocks (``len(enc.key_ids)``, each block looked up or inserted once)
  / ``replay_seconds`` (the replay loop alone: no hashing, metrics or frames). The trace is encoded
  once. A compiled policy is first run on a one-request workload so that numba's compilation (or
  loading of its on-disk cache) is excluded; that time is shown as ``compile s``. Compiled rows are
  the best of ``--repeats`` runs, Python rows one run.
* ``token hit`` = token hit rate (Σ hit tokens / Σ prompt tokens).

A policy that cannot be built with its defaults, or fails, gets a row saying why.
Run: ``python benchmarks/bench_policies.py [--capacity N] [--trace NAME] [--engines compiled python]``.
"""

from __future__ import annotations

import argparse
import time

from kvlab.policies import available_policies, make_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.workload import from_lists, load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--capacity", type=int, default=10_000, help="cache capacity in blocks")
    ap.add_argument("--engines", nargs="+", default=["compiled", "python"], choices=["compiled", "python"])
    ap.add_argument("--repeats", type=int, default=3, help="compiled runs per policy (best is reported)")
    ap.add_argument("--policies", nargs="*", help="only these (default: every registered policy)")
    args = ap.parse_args()

    workload = load_trace(args.trace)
    cfg = ReplayConfig(capacity_blocks=args.capacity)
    t0 = time.perf_counter()
    enc = encode(workload, cfg)
    lookups = len(enc.key_ids)
    print(f"trace {workload.name}: {len(workload):,} requests, {lookups:,} block lookups, block size "
          f"{enc.block_size}, capacity {args.capacity:,} blocks; encoded once in {time.perf_counter() - t0:.2f} s")
    tiny = from_lists([[1, 2, 3, 4, 5]])
    print(f"{'policy':<16} {'engine':<9} {'M lookups/s':>11} {'token hit':>10} {'compile s':>10}")
    for name in args.policies or available_policies():
        try:
            compiled = make_policy(name).compiled is not None
        except Exception as exc:  # noqa: BLE001 - report and go on with the other policies
            print(f"{name:<16} {'-':<9} skipped: {type(exc).__name__}: {exc}")
            continue
        for engine in args.engines:
            if engine == "compiled" and not compiled:
                continue
            try:
                compile_s = ""
                if engine == "compiled":
                    t = time.perf_counter()
                    replay(tiny, capacity_blocks=4, block_size=2, policy=name, engine="compiled")
                    compile_s = f"{time.perf_counter() - t:.2f}"
                runs = args.repeats if engine == "compiled" else 1
                best = None
                for _ in range(runs):
                    result = replay(workload, cfg, encoded=enc, policy=name, engine=engine)
                    if best is None or result.summary["replay_seconds"] < best.summary["replay_seconds"]:
                        best = result
            except Exception as exc:  # noqa: BLE001
                print(f"{name:<16} {engine:<9} failed: {type(exc).__name__}: {exc}")
                continue
            rate = lookups / best.summary["replay_seconds"] / 1e6
            print(f"{name:<16} {engine:<9} {rate:>11.3f} {best.summary['token_hit_rate']:>10.4f} {compile_s:>10}")


if __name__ == "__main__":
    main()
