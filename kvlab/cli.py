"""The ``kvlab`` command line: trace statistics, replays, sweeps, downloads and the embedded demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.errors import KvlabError

FORMATS = ("mooncake", "alibaba", "jsonl", "parquet")


def _load(args: argparse.Namespace):
    from kvlab.workload import load_trace

    workload = load_trace(args.trace, format=args.format)
    if getattr(args, "limit", None):
        workload = workload.head(args.limit)
    return workload


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from kvlab.stats import trace_stats

    workload = _load(args)
    stats = trace_stats(workload, block_size=args.block_size, hash_scheme=args.hash)
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        text = f"{value:,.4f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        print(f"{key:<{width}}  {text}")
    return 0


def _policies(names: list[str]) -> list[str]:
    from kvlab.policies import available_policies

    return available_policies() if names == ["all"] else names


def _policy_params(items: list[str]) -> dict:
    """``key=value`` pairs; values parsed as JSON where possible (numbers, lists), else kept as text."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise KvlabError(f"--policy-param expects key=value, got {item!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _replay_configs(args: argparse.Namespace):
    from kvlab.sweep import grid

    return grid(
        args.capacity_blocks,
        policies=_policies(args.policy),
        policy_params=_policy_params(args.policy_param),
        modes=args.mode,
        block_size=args.block_size,
        hash=args.hash,
        root_seed=args.root_seed,
        engine=args.engine,
        verify=args.verify,
        seed=args.seed,
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from kvlab.replay import replay
    from kvlab.sweep import run_sweep

    workload = _load(args)
    configs = _replay_configs(args)
    if len(configs) == 1:
        result = replay(workload, configs[0], progress=not args.quiet)
        if args.out:
            result.save(args.out)
        _print_summary([{"trace": workload.name, **result.summary}])
    else:
        table = run_sweep(workload, configs, args.out, resume=not args.no_resume, progress=not args.quiet)
        _print_summary(table.to_dict("records"))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def _print_summary(rows: list[dict]) -> None:
    cols = ["trace", "policy", "capacity_blocks", "mode", "token_hit_rate", "block_hit_rate", "request_hit_rate",
            "ideal_hit_rate", "evictions", "replay_seconds"]
    cols = [c for c in cols if any(c in row for row in rows)]
    print("  ".join(f"{c:>15}" for c in cols))
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:>15.4f}" if isinstance(v, float) else f"{v!s:>15}")
        print("  ".join(cells))


def cmd_sweep(args: argparse.Namespace) -> int:
    """Every trace x policy x capacity x mode; one folder per trace plus a combined table."""
    import pandas as pd

    from kvlab.sweep import run_sweep
    from kvlab.workload import load_trace

    tables = []
    for trace in args.traces:
        workload = load_trace(trace, format=args.format)
        if args.limit:
            workload = workload.head(args.limit)
        out = args.out / workload.name
        tables.append(run_sweep(workload, _replay_configs(args), out, resume=not args.no_resume,
                                progress=not args.quiet))
    table = pd.concat(tables, ignore_index=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / ".sweep.parquet.tmp"
    table.to_parquet(tmp, index=False)
    tmp.replace(args.out / "sweep.parquet")
    table.to_csv(args.out / "sweep.csv", index=False)
    _print_summary(table.to_dict("records"))
    print(f"results written to {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlab.demo import run_demo

    out = run_demo(args.out, quick=args.quick, progress=not args.quiet)
    print(f"demo results written to {out}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from kvlab.workload.registry import KNOWN_TRACES, download

    if args.list or not args.name:
        for name, info in KNOWN_TRACES.items():
            print(f"{name:<24} {info.get('description', '')}")
        return 0
    path = download(args.name, cache_dir=args.cache_dir)
    print(path)
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from kvlab.policies import available_policies, make_policy

    for name in available_policies():
        print(f"{name:<16} {type(make_policy(name)).source}")
    return 0


def _serve_on_engine(args: argparse.Namespace, workload):
    """``simulate --executor engine``: the same scheduler driving the real engine (random-weight model)."""
    from kvlab.engine import Engine, build_random_model
    from kvlab.sim.engine_executor import run_engine_serving

    model = build_random_model(args.engine_model, seed=args.seed, device=args.engine_device)
    engine = Engine(model, num_blocks=args.capacity_blocks or 1024, block_size=args.block_size or 16,
                    num_threads=args.engine_threads if model.device.type == "cpu" else None)
    return run_engine_serving(
        workload, engine, policy=args.policy, policy_params=_policy_params(args.policy_param),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, rate=args.rate,
        time_scale=args.time_scale, cache_at=args.cache_at, hash=args.hash, root_seed=args.root_seed,
        timer=args.timer, seed=args.seed, progress=not args.quiet,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    """Serving simulation: scheduler + cost model in simulated time (or the real engine); one results folder."""
    from kvlab.sim import simulate

    workload = _load(args)
    result = _serve_on_engine(args, workload) if args.executor == "engine" else simulate(
        workload, model=args.model, hardware=args.hardware, policy=args.policy,
        policy_params=_policy_params(args.policy_param), capacity_blocks=args.capacity_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, rate=args.rate, time_scale=args.time_scale,
        block_size=args.block_size, tensor_parallel=args.tensor_parallel, dtype=args.dtype, kv_dtype=args.kv_dtype,
        cache_at=args.cache_at, hash=args.hash, root_seed=args.root_seed, fast_forward=not args.no_fast_forward,
        instances=args.instances, router=args.router, seed=args.seed, progress=not args.quiet,
    )
    s = result.summary
    for key in ("requests", "cost_model", "instances", "capacity_blocks", "block_size", "policy", "time_scale",
                "token_hit_rate", "ideal_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
                "prefill_throughput", "effective_prefill_throughput", "output_throughput", "evictions",
                "preemptions", "readmission_hit_tokens", "makespan_s", "sim_seconds"):
        value = s.get(key)
        text = f"{value:,.4f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        print(f"{key:<30} {text}")
    if args.out:
        result.save(args.out)
        print(f"results written to {args.out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time the real engine over a grid of steps, fit the cost model, save a calibrated hardware profile."""
    import torch

    from kvlab.engine import Engine, build_random_model
    from kvlab.sim.calibrate import DEFAULT_GRID, QUICK_GRID, calibrate, grid_for_limits

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_random_model(args.engine_model, seed=0, device=device, dtype=args.dtype)
    engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                    num_threads=args.threads if device.type == "cpu" else None)
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    if args.max_new_tokens and args.max_context:
        grid = grid_for_limits(args.max_new_tokens, args.max_context)
    cal = calibrate(engine, base_hardware=args.base_hardware, grid=grid,
                    repeats=args.repeats, timer=args.timer or ("thread" if device.type == "cpu" else "wall"),
                    name=args.name, progress=not args.quiet)
    out = cal.save(args.out or Path("results/calibration") / f"{args.engine_model}-{device.type}.json")
    hw, s = cal.hardware, cal.fit.stats
    print(f"{hw.name}: {hw.description}")
    for key in ("peak_flops", "memory_bandwidth", "compute_efficiency", "attention_efficiency", "memory_efficiency",
                "step_overhead_s", "prefill_overhead_s"):
        print(f"{key:<22} {getattr(hw, key):.6g}")
    print(f"fit |relative residual|: median {s['median_abs']:.1%}, p90 {s['p90_abs']:.1%}, max {s['max_abs']:.1%} "
          f"over {s['n']} batches")
    for note in cal.fit.notes:
        print(f"note: {note}")
    print(f"profile written to {out} (use: kvlab simulate ... --hardware {out} --model "
          f"{out.with_name(out.stem + '.model.json')})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def trace_args(sp: argparse.ArgumentParser, many: bool = False) -> None:
        helptext = "path to a trace file, or a known public trace name (kvlab download --list)"
        sp.add_argument("traces" if many else "trace", nargs="+" if many else None, help=helptext)
        sp.add_argument("--format", choices=FORMATS, default=None, help="trace format (default: detect)")
        sp.add_argument("--limit", type=int, default=None, help="use only the first N requests")
        sp.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the trace's, or 16)")
        sp.add_argument("--hash", default="xxh3_128", help="block-hash scheme (sha256, xxh3_128, xxh3_64, builtin)")

    trace = sub.add_parser("trace", help="trace tools").add_subparsers(dest="trace_command", required=True)
    stats = trace.add_parser("stats", help="requests, mean lengths, unique blocks, ideal hit rates")
    trace_args(stats)
    stats.set_defaults(func=cmd_trace_stats)

    def run_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--capacity-blocks", type=int, nargs="+", required=True, help="cache capacity in blocks")
        sp.add_argument("--policy", nargs="+", default=["lru"],
                        help="eviction policy name(s) (kvlab policies), or 'all'")
        sp.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                        help="policy constructor argument (repeatable; JSON values)")
        sp.add_argument("--mode", nargs="+", default=["vllm"], choices=["vllm", "ideal"], help="hit counting mode")
        sp.add_argument("--engine", default="auto", choices=["auto", "compiled", "python"])
        sp.add_argument("--verify", action="store_true", help="verify tokens on hit: count and refuse collisions")
        sp.add_argument("--root-seed", type=int, default=0)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--no-resume", action="store_true", help="redo sweep runs already on disk")
        sp.add_argument("--quiet", action="store_true")

    rp = sub.add_parser("replay", help="sequential cache-only replay (one run, or a sweep of several)")
    trace_args(rp)
    run_args(rp)
    rp.add_argument("--out", type=Path, default=None, help="results folder (written atomically)")
    rp.set_defaults(func=cmd_replay)

    sw = sub.add_parser("sweep", help="replay several traces x policies x capacities into one table")
    trace_args(sw, many=True)
    run_args(sw)
    sw.add_argument("--out", type=Path, required=True, help="results folder: OUT/<trace>/ + OUT/sweep.parquet")
    sw.set_defaults(func=cmd_sweep)

    demo = sub.add_parser("demo", help="the main job on the embedded default workload (no download)")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    demo.add_argument("--quick", action="store_true", help="a smaller workload (tests, CI)")
    demo.add_argument("--quiet", action="store_true")
    demo.set_defaults(func=cmd_demo)

    dl = sub.add_parser("download", help="fetch a public trace into the cache folder")
    dl.add_argument("name", nargs="?")
    dl.add_argument("--list", action="store_true")
    dl.add_argument("--cache-dir", type=Path, default=None)
    dl.set_defaults(func=cmd_download)

    pol = sub.add_parser("policies", help="list registered eviction policies")
    pol.set_defaults(func=cmd_policies)

    sim = sub.add_parser("simulate", help="serving simulation: vLLM-like scheduler + roofline cost model")
    trace_args(sim)
    sim.add_argument("--model", default="llama-3-8b", help="shipped model name or config.json path/folder")
    sim.add_argument("--hardware", default="h100", help="shipped hardware name (h100, h200, a100-80gb, l40s, "
                     "rtx-4090, cpu-local) or profile JSON path")
    sim.add_argument("--policy", default="lru", help="eviction policy name (kvlab policies)")
    sim.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                     help="policy constructor argument (repeatable; JSON values)")
    sim.add_argument("--capacity-blocks", type=int, default=None,
                     help="KV pool per instance in blocks (default: from model, hardware and utilization)")
    sim.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192)
    sim.add_argument("--rate", type=float, default=None, help="scale arrivals to this many requests/s")
    sim.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (2 = half the load)")
    sim.add_argument("--instances", type=int, default=1, help="independent serving instances (data parallel)")
    sim.add_argument("--router", default="prefix", choices=["prefix", "round_robin"],
                     help="how requests are assigned to instances")
    sim.add_argument("--tensor-parallel", type=int, default=1, help="devices per instance")
    sim.add_argument("--dtype", default=None, help="weight dtype override (e.g. float32 on CPU)")
    sim.add_argument("--kv-dtype", default=None, help="KV cache dtype override (e.g. fp8)")
    sim.add_argument("--cache-at", default="schedule", choices=["schedule", "compute"],
                     help="when a computed block becomes findable (schedule = vLLM v1)")
    sim.add_argument("--no-fast-forward", action="store_true", help="step decode runs one by one (same results)")
    sim.add_argument("--root-seed", type=int, default=0)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", type=Path, default=None, help="results folder (written atomically)")
    sim.add_argument("--quiet", action="store_true")
    sim.add_argument("--executor", default="cost-model", choices=["cost-model", "engine"],
                     help="engine: serve the token trace on the real engine in measured time (same scheduler)")
    sim.add_argument("--engine-model", default="cpu-bench", help="random-weight model shape for --executor engine")
    sim.add_argument("--engine-device", default="cpu")
    sim.add_argument("--engine-threads", type=int, default=1, help="torch CPU threads for --executor engine")
    sim.add_argument("--timer", default="wall", choices=["wall", "thread"],
                     help="engine clock: wall time, or the serving thread's CPU time (shared CPUs)")
    sim.set_defaults(func=cmd_simulate)

    cal = sub.add_parser("calibrate", help="fit a hardware profile's efficiencies to the real engine's step times")
    cal.add_argument("--engine-model", default="cpu-bench", help="random-weight model shape")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--dtype", default=None, help="model dtype (default: the shape's)")
    cal.add_argument("--block-size", type=int, default=16)
    cal.add_argument("--num-blocks", type=int, default=512, help="KV pool blocks used for the measurements")
    cal.add_argument("--base-hardware", default=None, help="profile with the nominal peaks (default: by device)")
    cal.add_argument("--repeats", type=int, default=5, help="timings per grid point (the median is kept)")
    cal.add_argument("--timer", default=None, choices=["wall", "thread"], help="default: thread on CPU, else wall")
    cal.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    cal.add_argument("--quick", action="store_true", help="the small grid")
    cal.add_argument("--max-new-tokens", type=int, default=None,
                     help="with --max-context: a grid spanning these limits (chunk size, max_model_len)")
    cal.add_argument("--max-context", type=int, default=None)
    cal.add_argument("--name", default=None, help="profile name (default: <base>-cal-<model>)")
    cal.add_argument("--out", type=Path, default=None,
                     help="profile JSON (default: results/calibration/<model>-<device>.json)")
    cal.add_argument("--quiet", action="store_true")
    cal.set_defaults(func=cmd_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvlabError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
