"""KV memory (issue 13): pool bytes and peak process memory of the copying engine vs packed forwards.

The same token workload (``synthetic_chat`` in the model's vocabulary, ``--requests`` requests, outputs capped
at ``--max-output`` tokens) is served by :func:`kvlab.sim.engine_executor.run_engine_serving` twice, each run in
a FRESH subprocess so that the peak RSS (``ru_maxrss``) belongs to that run alone:

* **copying** (``batched=False``): one forward per entry; each live request keeps a working cache
  (``DynamicCache``) with its K/V copied out of the paged pool, so K/V lives twice.
* **batched** (``batched=True``): one packed forward per step straight over the pool; no working caches.

Per run: pool bytes (``engine.capacity_bytes``), peak RSS and its increase over the RSS right before serving
(KiB on Linux), the peak of the summed working-cache K/V bytes across live requests (measured after every step
by wrapping ``EngineExecutor.execute``), TTFT p50, output tokens/s (timer clock, ``--timer thread`` = CPU time
by default, as in the tests) and wall seconds.

Model: ``--shape cpu-bench`` (default; Llama, 4 layers, hidden 512, 2 KV heads of 64 dims, vocabulary 32,000)
or ``tiny-llama``, random weights, fp32, block size 16.

``--arrivals zero`` puts every arrival at t=0 so ``--max-num-seqs`` requests are live at once (worst case for
the working caches); the default keeps the trace's arrival times.

Run: ``python benchmarks/bench_kv_memory.py [--shape cpu-bench] [--requests 60] [--arrivals trace|zero]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time


def _rss_kib() -> int:
    """Current resident set size in KiB (Linux /proc; falls back to the peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _cache_bytes(cache) -> int:
    """K/V tensor bytes of a working cache (DynamicCache of any recent transformers layout, or tensors)."""
    import torch

    if cache is None:
        return 0
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size()
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
    for name in ("key_cache", "value_cache"):
        for t in getattr(cache, name, []) or []:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    if total:
        return total
    if isinstance(cache, (list, tuple)):
        return sum(_cache_bytes(c) for c in cache)
    return 0


def child(args: argparse.Namespace) -> dict:
    """One serving run (in this fresh process); returns its measurements."""
    import numpy as np
    import torch

    from kvlab.engine import Engine, build_random_model
    from kvlab.sim import engine_executor as ee
    from kvlab.workload import synthetic_chat

    torch.set_num_threads(args.threads)
    engine = Engine(build_random_model(args.shape, seed=0), capacity_blocks=args.capacity_blocks,
                    block_size=args.block_size, num_threads=args.threads)
    vocab = engine.vocab_size
    wl = synthetic_chat(args.requests, seed=args.seed, n_tenants=2, system_tokens=(16, 48), n_docs=4,
                        doc_tokens=(40, 120), user_median=12, answer_median=10, vocab_size=vocab - 8, vocab_offset=8)
    wl = dataclasses.replace(wl, output_length=np.minimum(wl.output_length, args.max_output))
    if args.arrivals == "zero":  # every request arrives at t=0: max_num_seqs live at once (peak memory)
        from kvlab.sim.fidelity import zero_arrivals

        wl = zero_arrivals(wl)

    peak = {"working": 0, "live_max": 0}
    orig = ee.EngineExecutor.execute

    def execute(self, batch):
        seconds = orig(self, batch)
        seqs = list(self._seqs.values())
        peak["working"] = max(peak["working"], sum(_cache_bytes(s.working) for s in seqs))
        peak["live_max"] = max(peak["live_max"], sum(s.working is not None for s in seqs))
        return seconds

    ee.EngineExecutor.execute = execute
    rss_before = _rss_kib()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    res = ee.run_engine_serving(wl, engine, capacity_blocks=args.capacity_blocks, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, timer=args.timer,
                                batched=args.mode == "batched")
    wall = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = res.summary
    out_tokens = int(sum(len(v) for v in res.generated.values()))
    return {
        "mode": args.mode, "pool_bytes": int(engine.capacity_bytes), "rss_before_kib": rss_before,
        "maxrss_before_kib": maxrss_before, "peak_rss_kib": maxrss, "rss_increase_kib": maxrss - rss_before,
        "working_peak_bytes": peak["working"], "working_live_max": peak["live_max"],
        "ttft_p50_s": float(s["ttft_p50_s"]), "output_tok_s": float(s["output_throughput"]),
        "output_tokens": out_tokens, "wall_s": wall, "forward_calls": int(s["forward_calls"]),
        "token_hit_rate": float(s.get("token_hit_rate", float("nan"))),
        "prompt_tokens": int(sum(len(wl.prompt(r)) for r in range(len(wl)))),
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="cpu-bench")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--max-output", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--timer", default="thread", choices=["thread", "wall"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--arrivals", choices=["trace", "zero"], default="trace",
                   help="trace: the workload's arrival times; zero: all at t=0 (max concurrency)")
    p.add_argument("--mode", choices=["copying", "batched"], help=argparse.SUPPRESS)  # child process only
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(child(args)))
        return

    rows = []
    for mode in ("copying", "batched"):
        cmd = [sys.executable, __file__, "--mode", mode] + [a for a in (argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"shape={args.shape} requests={args.requests} outputs<={args.max_output} block_size={args.block_size} "
          f"capacity_blocks={args.capacity_blocks} max_num_seqs={args.max_num_seqs} "
          f"max_num_batched_tokens={args.max_num_batched_tokens} timer={args.timer} threads={args.threads} "
          f"arrivals={args.arrivals} prompt_tokens={rows[0]['prompt_tokens']}")
    hdr = (f"{'mode':<8} {'pool MiB':>9} {'RSS before MiB':>15} {'peak RSS MiB':>13} {'RSS incr MiB':>13} "
           f"{'working peak MiB':>17} {'live wc':>8} {'TTFT p50 ms':>12} {'out tok/s':>10} {'wall s':>7} "
           f"{'fwd calls':>9} {'hit rate':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['mode']:<8} {_mib(r['pool_bytes']):>9} {r['rss_before_kib'] / 1024:>15.1f} "
              f"{r['peak_rss_kib'] / 1024:>13.1f} {r['rss_increase_kib'] / 1024:>13.1f} "
              f"{_mib(r['working_peak_bytes']):>17} {r['working_live_max']:>8} {r['ttft_p50_s'] * 1e3:>12.1f} "
              f"{r['output_tok_s']:>10.1f} {r['wall_s']:>7.2f} {r['forward_calls']:>9} {r['token_hit_rate']:>8.3f}")
    c, b = rows

    def ratio(key: str) -> str:
        return f"{c[key] / b[key]:.2f}x" if b[key] else ("inf" if c[key] else "n/a")

    print(f"ratios copying/batched: peak RSS {ratio('peak_rss_kib')}, RSS increase {ratio('rss_increase_kib')}, "
          f"TTFT p50 {ratio('ttft_p50_s')}, wall {ratio('wall_s')}; batched/copying output tok/s "
          f"{b['output_tok_s'] / c['output_tok_s']:.2f}x")
    print(f"K/V bytes at peak: copying = pool {_mib(c['pool_bytes'])} MiB + working {_mib(c['working_peak_bytes'])} "
          f"MiB ({(c['pool_bytes'] + c['working_peak_bytes']) / c['pool_bytes']:.2f}x the pool); "
          f"batched = pool {_mib(b['pool_bytes'])} MiB + working {_mib(b['working_peak_bytes'])} MiB")


if __name__ == "__main__":
    main()
