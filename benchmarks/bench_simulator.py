"""Simulator speed: the full Mooncake conversation trace (12,031 requests, one hour) served in simulated time.

Two operating points of the same trace, model and hardware (default: Llama-3-8B on H100 profiles):

* the *base load*: a load at which p50 TTFT stays under 2 s. One H100 cannot reach it at any rate:
  the trace's arrivals come in bursts (timestamps on a 3 s grid, ~10 requests with ~120 k prompt tokens
  each), so a single instance's p50 TTFT floors at ~2 s however far arrivals are stretched. The trace is
  therefore served by ``--instances`` (default 4) data-parallel instances at its native rate, requests
  routed by prefix affinity;
* *2× load*: the same instances with arrivals twice as dense (``time_scale / 2``).

What is timed, per point:
* ``simulate``: the whole :func:`kvlab.sim.simulate` call: hashing, routing, the scheduler loops, the
  unbounded-capacity bound, the result frames and the summary (the trace is loaded once, beforehand);
* ``loop``: the scheduler loops alone (``summary["sim_seconds"]``).

Run: ``taskset -c 0 python benchmarks/bench_simulator.py [--trace NAME_OR_PATH] [--instances N]
[--time-scale S] [--model M] [--hardware H]`` (``taskset -c 0``: one core).
"""

from __future__ import annotations

import argparse
import time

from kvlab.sim import simulate
from kvlab.workload import load_trace


def run(workload, label: str, **kw) -> dict:
    t0 = time.perf_counter()
    result = simulate(workload, **kw)
    wall = time.perf_counter() - t0
    s = result.summary
    print(f"{label:<10} {s['instances']:>3} {s['time_scale']:>6.2f} {s['rate']:>6.2f} {wall:>9.2f} "
          f"{s['sim_seconds']:>7.2f} {s['ttft_p50_s']:>9.3f} {s['ttft_p90_s']:>9.3f} {s['tpot_p50_s']:>8.4f} "
          f"{s['token_hit_rate']:>6.3f} {s['preemptions']:>6,} {s['steps']:>10,} {s['iterations']:>8,} "
          f"{s['makespan_s']:>9.0f}")
    return {"wall": wall, **s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--router", default="prefix", choices=["prefix", "round_robin"])
    ap.add_argument("--time-scale", type=float, default=1.0, help="base load: arrival times x this")
    args = ap.parse_args()

    t0 = time.perf_counter()
    workload = load_trace(args.trace)
    print(f"{workload!r}: loaded in {time.perf_counter() - t0:.2f} s; {args.model} on {args.hardware}, "
          f"policy {args.policy}, router {args.router}")
    print(f"{'load':<10} {'ins':>3} {'scale':>6} {'req/s':>6} {'simulate':>9} {'loop':>7} {'ttft p50':>9} "
          f"{'ttft p90':>9} {'tpot p50':>8} {'hit':>6} {'preem':>6} {'steps':>10} {'iters':>8} {'makespan':>9}")
    common = dict(model=args.model, hardware=args.hardware, policy=args.policy, instances=args.instances,
                  router=args.router)
    base = run(workload, "base", time_scale=args.time_scale, **common)
    double = run(workload, "2x load", time_scale=args.time_scale / 2, **common)
    print(f"p50 TTFT at base load {'<' if base['ttft_p50_s'] < 2 else '>='} 2 s; simulate() took "
          f"{base['wall']:.1f} s (base) and {double['wall']:.1f} s (2x load); target < 30 s each")


if __name__ == "__main__":
    main()
