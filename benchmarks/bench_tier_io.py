"""The engine's real tiers: disk tier reads (cold, warm, O_DIRECT) and writes, DRAM tier copies; a disk profile.

Times kvlab's own stores (kvlab.engine.tiers.measure): one op is one slot file of ``chunk`` blocks in the pool's
block layout (default: Llama-3-8B, 16-token blocks of 2 MiB; chunks of 1 and 16 blocks, 2 MiB and 32 MiB).

* ``write``: checksums (xxh3-64 per block), write to a temporary name, fsync, rename; ``write_nofsync`` without
  the fsync;
* ``read_warm``: the store's read (checksums verified) with the file in the page cache;
* ``read_cold``: the same after ``posix_fadvise(DONTNEED)`` dropped the file's pages (from the device);
* ``read_direct``: an ``O_DIRECT`` read of the whole file (the device alone: no page cache, no checksum); not
  measured where the file system refuses O_DIRECT (said so in the output);
* ``dram copy``: a host memcpy of the same bytes (on a CPU-only machine, that is all a DRAM tier does);
  ``--device cuda``: ``dram h2d`` / ``dram d2h``, copies between page-locked host memory (a DramStore's on
  CUDA) and the GPU, synchronised: a DRAM tier's load and store;
* ``--engine SHAPE``: the engine's real TTFT (``prefill_s``) of a prompt whose prefix is computed (``miss``), hit
  on the device, or loaded from a DRAM or disk tier (warm, or cold after dropping the files' pages), per prefix
  length (``--prefix``), random-weight model ``SHAPE`` (e.g. ``cpu-bench``), one torch thread, verify on the last
  repeat (kvlab.engine.tiers.measure.measure_tier_ttft).

Prints MB/s (10^6 bytes/s) and median / p90 latency per op, the disk profiles fitted through the sizes
(``latency_s + bytes / bandwidth_Bps``) and, in the JSON written to ``--out``, ``medium_preset``: the fields of a
simulator medium preset (kvlab.tiers.timing) from the cold reads and the writes.

Run: ``python benchmarks/bench_tier_io.py [--dir DIR] [--chunks 1,4,16] [--ops 12] [--engine cpu-bench]
[--prefix 256,1024] [--out results/bench_tier_io.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from kvlab.engine.tiers.measure import (
    LLAMA3_8B,
    OPS,
    disk_profile,
    measure_disk,
    measure_dram,
    measure_tier_ttft,
    medium_preset,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: the temp dir)")
    ap.add_argument("--chunks", default="1,4,16", help="blocks per op, comma-separated")
    ap.add_argument("--ops", type=int, default=12, help="files per size")
    ap.add_argument("--device", default="cpu", help="the pool's device: cpu, or cuda (pinned host <-> device copies)")
    ap.add_argument("--engine", default=None, help="random-model shape for the TTFT-by-source table (cpu-bench)")
    ap.add_argument("--prefix", default="256,1024", help="prefix tokens for --engine, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="--engine repeats per cell")
    ap.add_argument("--out", default="results/bench_tier_io.json")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]

    disk = measure_disk(args.dir, chunks=chunks, ops=args.ops)
    dram = measure_dram(chunks=chunks, device=args.device)
    print(f"disk tier in {disk['directory']} ({platform.node()}), block {LLAMA3_8B.bytes_per_block / 2**20:g} MiB "
          f"(Llama-3-8B, 16 tokens); cold reads: {disk['cold_method']}; "
          f"{disk.get('read_direct', 'O_DIRECT reads measured')}")
    print(f"{'op':<15}{'blocks':>7}{'MiB/op':>8}{'MB/s':>10}{'median ms':>11}{'p90 ms':>9}")
    for size in disk["sizes"].values():
        for op in OPS:
            if op in size:
                s = size[op]
                print(f"{op:<15}{size['chunk_blocks']:>7}{s['bytes_per_op'] / 2**20:>8.0f}{s['MBps']:>10.0f}"
                      f"{s['median_s'] * 1e3:>11.2f}{s['p90_s'] * 1e3:>9.2f}")
        print(f"{'(xxh3 checksum':<15}{size['chunk_blocks']:>7}{size['bytes_per_op'] / 2**20:>8.0f}"
              f"{size['checksum_GBps'] * 1e3:>10.0f})")
    for size in dram["sizes"].values():
        for name in ("copy", "h2d", "d2h"):
            if name in size:
                s = size[name]
                print(f"{'dram ' + name:<15}{size['chunk_blocks']:>7}{s['bytes_per_op'] / 2**20:>8.0f}"
                      f"{s['MBps']:>10.0f}{s['median_s'] * 1e3:>11.2f}{s['p90_s'] * 1e3:>9.2f}")
    profiles = {op: disk_profile(disk, op) for op in ("read_cold", "read_warm", "read_direct", "write")
                if any(op in s for s in disk["sizes"].values())}
    for op, p in profiles.items():
        print(f"disk profile {op:<12} latency {p['latency_s'] * 1e3:7.3f} ms, bandwidth {p['bandwidth_Bps'] / 1e9:6.2f}"
              " GB/s")
    ttft = []
    if args.engine:
        import torch

        from kvlab.engine import build_random_model

        torch.set_num_threads(1)
        model = build_random_model(args.engine, seed=0, device=args.device)
        ttft = measure_tier_ttft(model, prefix_tokens=[int(p) for p in args.prefix.split(",")], repeats=args.repeats,
                                 directory=args.dir, num_threads=1)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        print(f"engine TTFT by prefix source ({args.engine}, {dtype}, {args.device}; best / median of {args.repeats}, "
              "ms)")
        print(f"{'prefix':>7} {'KV MiB':>7}" + "".join(f"{s:>18}" for s in dict.fromkeys(r["source"] for r in ttft)))
        for p in dict.fromkeys(r["prefix_tokens"] for r in ttft):
            cells = [r for r in ttft if r["prefix_tokens"] == p]
            print(f"{p:>7} {cells[0]['kv_bytes'] / 2**20:>7.1f}" + "".join(
                f"{r['ttft_min_s'] * 1e3:>10.1f} / {r['ttft_median_s'] * 1e3:<6.1f}" for r in cells))
        bad = [r for r in ttft if not r["verify_passed"]]
        print("verify: all passed" if not bad else f"verify FAILED: {bad}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    record = {"disk": disk, "dram": dram, "profiles": profiles, "medium_preset": medium_preset(disk),
              "engine_ttft": ttft, "host": platform.node()}
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
