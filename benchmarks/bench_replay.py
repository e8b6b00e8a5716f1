"""Replay speed: block lookups/s on Mooncake conversation (hash ids) and prompt tokens/s on token traces.

What is timed, per figure:
* ``load``: parsing the JSONL trace into a Workload (first call).
* ``encode``: chained hashing of every full block + mapping keys to dense ids.
* ``compile``: the first call of the numba kernel (JIT or loading numba's on-disk cache), measured on a
  one-request workload.
* ``replay loop``: the kernel alone over the whole trace; ``block lookups`` = Σ full prompt blocks
  (each block is looked up or inserted once). Best of 3 runs.
* ``end to end``: load + encode + compile + replay + metrics + writing results, in one fresh process
  state (the numbers printed above summed with the frame building and the parquet write).
* token traces: ``encode + replay`` over a Mooncake slice expanded to token ids at block size 16 with
  xxh3_64 keys (expansion itself is not timed): prompt tokens / (hash + dense map + replay loop) seconds.

Run: ``python benchmarks/bench_replay.py [--trace PATH] [--token-requests N]``. Pin one core with
``taskset -c 0`` for the one-core figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvlab.cache.compiled import run_compiled
from kvlab.policies import make_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.workload import from_lists, load_trace
from kvlab.workload.expand import expand_to_tokens


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def kernel_seconds(enc, capacity: int, policy: str = "lru", repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds of the compiled replay loop alone (no hashing, no frames)."""
    pol = make_policy(policy)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_compiled(pol.compiled, enc, capacity, False, pol.compiled_params())
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--capacities", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    ap.add_argument("--token-requests", type=int, default=1_000, help="Mooncake requests expanded to tokens")
    args = ap.parse_args()

    t_start = time.perf_counter()
    workload, t_load = timed(load_trace, args.trace)
    cfg = ReplayConfig(capacity_blocks=args.capacities[0])
    enc, t_enc = timed(encode, workload, cfg)
    tiny = from_lists([[1, 2, 3]], kind="tokens")
    _, t_compile = timed(replay, tiny, capacity_blocks=4, block_size=2)
    lookups = len(enc.key_ids)
    print(f"trace {workload.name}: {len(workload):,} requests, {lookups:,} full-block lookups, "
          f"block size {enc.block_size}")
    print(f"load {t_load:.3f} s | encode (xxh3_128) {t_enc:.3f} s | "
          f"first kernel call (compile/cache) {t_compile:.3f} s")
    print(f"{'capacity':>9} {'loop s':>8} {'M lookups/s':>12} {'token hit':>10} {'end-to-end s':>13}")
    for cap in args.capacities:
        loop = kernel_seconds(enc, cap)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = replay(workload, cfg, encoded=enc, capacity_blocks=cap)
            result.save(Path(tmp) / "run")
            t_rest = time.perf_counter() - t0
        e2e = t_load + t_enc + t_compile + t_rest
        print(f"{cap:>9,} {loop:>8.4f} {lookups / loop / 1e6:>12.2f} {result.summary['token_hit_rate']:>10.4f} "
              f"{e2e:>13.3f}")

    tokens = expand_to_tokens(workload.head(args.token_requests))
    tcfg = ReplayConfig(capacity_blocks=10_000, block_size=16, hash="xxh3_64")
    n_tokens = int(tokens.input_length.sum())
    enc16, t_hash = timed(encode, tokens, tcfg)
    loop16 = kernel_seconds(enc16, tcfg.capacity_blocks, repeats=1)
    print(f"token trace: {args.token_requests:,} Mooncake requests expanded, {n_tokens:,} prompt tokens, "
          f"block size 16, xxh3_64")
    print(f"  hash + dense ids {t_hash:.3f} s ({n_tokens / t_hash / 1e6:.2f} M tokens/s), replay loop {loop16:.3f} s; "
          f"together {n_tokens / (t_hash + loop16) / 1e6:.2f} M prompt tokens/s")
    print(f"total benchmark wall time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
