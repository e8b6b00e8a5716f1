"""Every registered eviction policy on Mooncake conversation: replay speed and token hit rate.

For each policy in ``kvlab.policies.available_policies()`` (whatever is registered when this runs) and
each engine it supports (``compiled`` when the policy has a numba twin, ``python`` always), one replay of
the whole trace at ``--capacity`` blocks (default 10,000) in vLLM counting mode. Columns:

* ``M lookups/s`` = Σ full prompt blocks (``len(enc.key_ids)``, each block looked up or inserted once)
  / ``replay_seconds`` (the replay loop alone: no hashing, metrics or frames). The trace is encoded
  once. Each engine first replays a one-request workload, so that numba's compilation (or loading of
  its on-disk cache: the kernel, or the hooks the Python core calls) is excluded; that time is shown as
  ``compile s``. Compiled rows are the best of ``--repeats`` runs, Python rows of ``--python-repeats``.
* ``token hit`` = token hit rate (Σ hit tokens / Σ prompt tokens).

A policy that cannot be built with its defaults, or fails, gets a row saying why.
Run: ``python benchmarks/bench_policies.py [--capacity N] [--trace NAME] [--engines compiled python]``.

``--compile-times``: instead, per policy with a compiled form, two fresh processes on one new, empty
numba cache folder (NUMBA_CACHE_DIR): *cold* (nothing cached: every hook and the kernel compiled) and
*warm* (all loaded from disk), each timing the first replay of a one-request workload on the compiled
engine (the kernel) and, in two more processes, on the Python core (the hooks it calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    ap.add_argument("--python-repeats", type=int, default=1, help="Python-core runs per policy (best is reported)")
    ap.add_argument("--policies", nargs="*", help="only these (default: every registered policy)")
    ap.add_argument("--compile-times", action="store_true", help="cold and warm compile times, fresh processes")
    args = ap.parse_args()
    if args.compile_times:
        compile_times(args.policies or available_policies())
        return

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
                t = time.perf_counter()
                replay(tiny, capacity_blocks=4, block_size=2, policy=name, engine=engine)
                compile_s = f"{time.perf_counter() - t:.2f}"
                runs = args.repeats if engine == "compiled" else args.python_repeats
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


FIRST_RUN = """
import json, sys, time
from kvlab.replay import replay
from kvlab.workload import from_lists
tiny = from_lists([[1, 2, 3, 4, 5]])
replay(tiny, capacity_blocks=4, block_size=2, policy="mru", engine="python")  # hashing etc.: not timed
t = time.perf_counter()
replay(tiny, capacity_blocks=4, block_size=2, policy=sys.argv[1], engine=sys.argv[2])
print(json.dumps(time.perf_counter() - t))
"""


def compile_times(names: list[str]) -> None:
    """Per policy with a compiled form and per engine: the first replay of a one-request workload in a fresh
    process with an empty numba cache folder (cold), then in another one with that folder (warm)."""
    print(f"{'policy':<16} {'kernel cold s':>13} {'kernel warm s':>13} {'python cold s':>13} {'python warm s':>13}")
    for name in names:
        try:
            if make_policy(name).compiled is None:
                continue
        except Exception:  # noqa: BLE001 - not buildable with defaults: nothing to time
            continue
        row = []
        for engine in ("compiled", "python"):
            with tempfile.TemporaryDirectory() as cache:
                for _ in ("cold", "warm"):
                    done = subprocess.run([sys.executable, "-c", FIRST_RUN, name, engine], capture_output=True,
                                          text=True, env={**os.environ, "NUMBA_CACHE_DIR": cache})
                    row.append(json.loads(done.stdout) if done.returncode == 0 else float("nan"))
        print(f"{name:<16} " + " ".join(f"{x:>13.2f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
