"""Serving simulator with timed tiers: wall time of the full Mooncake conversation trace, and a TTFT table.

Runs, on the same trace, model and hardware (default Llama-3-8B on the H100 profile, one instance at the
trace's rate times ``--time-scale``):

* ``device``: no tiers (the simulator as before);
* ``+dram``: a DRAM tier behind PCIe 5 (``--dram-gib``, write_back);
* ``+dram+ssd``: the same plus a local NVMe Gen4 tier (``--ssd-gib``, write_through), staged through DRAM;
* the two-tier run again with ``load_or_recompute``, ``tier_overlap`` and each prefetch policy.

Per run: wall seconds of the whole ``simulate`` call, the scheduler loop alone (``sim_seconds``), mean / p50 /
p90 TTFT, the TTFT split (mean queue, load), the token hit rate and each tier's hit share, bytes loaded.
The device pool is sized by the profiles (``gpu_memory_utilization``) unless ``--capacity`` is given: all runs
have equal device memory. Numbers are uncalibrated (hardware factors and link presets: docs/tiers.md).

Run: ``python benchmarks/bench_sim_tiers.py [--trace NAME_OR_PATH] [--limit N] [--time-scale S]``.
"""

from __future__ import annotations

import argparse
import time

from kvlab.sim import simulate
from kvlab.tiers import Tier
from kvlab.workload import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--capacity", type=int, default=None, help="device blocks (default: from the profiles)")
    ap.add_argument("--dram-gib", type=float, default=256.0)
    ap.add_argument("--ssd-gib", type=float, default=2048.0)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--quick", action="store_true", help="only device, +dram, +dram+ssd")
    args = ap.parse_args()

    w = load_trace(args.trace)
    if args.limit:
        w = w.head(args.limit)
    dram = Tier(name="dram", capacity_gib=args.dram_gib, write="write_back", link="pcie5_x16")
    ssd = Tier(name="ssd", capacity_gib=args.ssd_gib, write="write_through", medium="nvme_gen4", link="pcie5_x16")
    base = dict(model=args.model, hardware=args.hardware, time_scale=args.time_scale, capacity_blocks=args.capacity)
    runs = [("device", {}), ("+dram", {"tiers": [dram]}), ("+dram+ssd", {"tiers": [dram, ssd]})]
    if not args.quick:
        two = {"tiers": [dram, ssd]}
        runs += [("+load_or_recompute", {**two, "load_or_recompute": True}),
                 ("+overlap", {**two, "tier_overlap": True})]
        runs += [(f"+prefetch {p}", {**two, "tier_prefetch": p}) for p in ("best_effort", "wait_complete", "timeout")]
    print(f"trace {w.name}: {len(w):,} requests, block size {w.default_block_size}; {args.model} on "
          f"{args.hardware}, time_scale {args.time_scale}; DRAM {args.dram_gib:g} GiB (PCIe 5), SSD "
          f"{args.ssd_gib:g} GiB (NVMe Gen4)")
    print(f"{'run':<24} {'wall_s':>7} {'loop_s':>7} {'ttft_mean':>9} {'ttft_p50':>9} {'ttft_p90':>9} "
          f"{'queue':>8} {'load':>7} {'hit':>6} {'dram':>6} {'ssd':>6} {'GB_loaded':>9} {'stall_s':>8}")
    for label, kw in runs:
        t0 = time.perf_counter()
        r = simulate(w, **base, **kw)
        wall = time.perf_counter() - t0
        s, req = r.summary, r.requests
        done = req[req["admitted"]]
        shares = {t["name"]: t["hit_share"] for t in s.get("tiers", [])}
        print(f"{label:<24} {wall:>7.2f} {s['sim_seconds']:>7.2f} {s['ttft_mean_s']:>9.3f} {s['ttft_p50_s']:>9.3f} "
              f"{s['ttft_p90_s']:>9.3f} {done['queue_s'].mean():>8.3f} {s.get('ttft_load_mean_s', 0.0):>7.3f} "
              f"{s['token_hit_rate']:>6.3f} {shares.get('dram', 0.0):>6.3f} {shares.get('ssd', 0.0):>6.3f} "
              f"{s.get('loaded_bytes', 0.0) / 1e9:>9.1f} {s.get('tier_stall_s', 0.0):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
