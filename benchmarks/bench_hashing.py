"""Throughput of kvlab.hashing.encode_workload (hashing + dense-id mapping), one process, one thread.

What is timed: one call of ``encode_workload(workload, hasher, block_size)`` on an already built
Workload (generation and trace parsing are not timed); best of ``--repeat`` runs.

* Token trace: ``--requests`` generated prompts of about ``--tokens`` tokens each (a shared system prompt,
  a shared document, a private tail; lengths vary so the last block is usually partial), block size 16.
  Reported: prompt tokens per second (all prompt tokens, including the unkeyed partial blocks).
* Block-id trace: the Mooncake FAST'25 conversation trace (12,031 requests, 512-token chained ids), at
  its own block size. Reported: trace ids (blocks, full and partial) per second, and seconds per encode.

Run: ``.venv/bin/python benchmarks/bench_hashing.py``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvlab.hashing import SCHEMES, BlockHasher, encode_workload
from kvlab.workload import Workload, from_lists

MOONCAKE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"


def token_workload(n: int, tokens: int, seed: int = 0) -> Workload:
    """``n`` prompts of ~``tokens`` tokens: 1/4 system prompt (20 kinds), 1/2 document (100), 1/4 private."""
    rng = np.random.default_rng(seed)
    q = tokens // 4
    systems = rng.integers(0, 128_000, size=(20, q))
    docs = rng.integers(0, 128_000, size=(100, 2 * q))
    prompts = []
    for _ in range(n):
        tail = rng.integers(0, 128_000, size=q + int(rng.integers(-8, 24)))
        prompts.append(np.concatenate([systems[rng.integers(20)], docs[rng.integers(100)], tail]))
    return from_lists(prompts, kind="tokens")


def mooncake_workload(path: Path) -> Workload:
    ids, lengths, arrival = [], [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            ids.append(rec["hash_ids"])
            lengths.append(rec["input_length"])
            arrival.append(rec["timestamp"] / 1000.0)
    return from_lists(ids, kind="blocks", block_size=512, input_length=lengths, arrival=arrival)


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    wl = token_workload(args.requests, args.tokens)
    total = int(wl.input_length.sum())
    print(f"token trace: {len(wl)} requests, {total:,} prompt tokens, block size {args.block_size}")
    variants = [BlockHasher(s) for s in SCHEMES] + [
        BlockHasher("xxh3_64", truncate_bits=32),
        BlockHasher("xxh3_64", chained=False),
    ]
    for h in variants:
        enc = encode_workload(wl, h, args.block_size)
        dt = best_time(lambda h=h: encode_workload(wl, h, args.block_size), args.repeat)
        print(
            f"  {h.label:32s} {total / dt / 1e6:7.2f} M tokens/s  ({dt * 1e3:7.1f} ms, "
            f"{len(enc.key_ids):,} full blocks, {enc.num_keys:,} distinct keys)"
        )
    h = BlockHasher("xxh3_64")
    dt = best_time(lambda: encode_workload(wl, h, args.block_size, verify=True), args.repeat)
    print(f"  {h.label + ' verify=True':32s} {total / dt / 1e6:7.2f} M tokens/s  (adds the sha256 truth ids)")

    if not MOONCAKE.exists():
        print(f"Mooncake trace not found at {MOONCAKE}; skipped")
        return
    mc = mooncake_workload(MOONCAKE)
    ids = len(mc.prompt_values)
    print(f"Mooncake conversation: {len(mc)} requests, {ids:,} block ids (512 tokens), block size 512")
    for scheme in ("xxh3_128", "xxh3_64", "sha256"):
        h = BlockHasher(scheme)
        enc = encode_workload(mc, h)
        dt = best_time(lambda h=h: encode_workload(mc, h), args.repeat)
        print(
            f"  {h.label:32s} {ids / dt / 1e6:7.2f} M blocks/s  ({dt * 1e3:7.1f} ms per encode, "
            f"{len(enc.key_ids):,} full blocks, {enc.num_keys:,} distinct keys)"
        )


if __name__ == "__main__":
    main()
