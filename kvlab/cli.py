"""The ``kvlab`` command line: trace statistics, replays, sweeps, downloads, tokenizers and the embedded demo.

``kvlab replay`` and ``kvlab sweep`` live in :mod:`kvlab.cli_replay` (their flags, checks and table).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field

from kvlab.cli_common import FORMATS
from kvlab.cli_common import check_capacity_gib as _check_capacity_gib
from kvlab.cli_common import flagged as _flagged
from kvlab.cli_common import gib_blocks as _gib_blocks
from kvlab.cli_common import gib_note as _gib_note
from kvlab.cli_common import load as _load
from kvlab.cli_common import plain_help as _plain_help
from kvlab.cli_common import policy_params as _policy_params
from kvlab.cli_common import selection as _selection
from kvlab.cli_experiment import cmd_run
from kvlab.cli_replay import add_run_args, cmd_replay, cmd_sweep
from kvlab.errors import ConfigError, KvlabError
from kvlab.tiers.spec import SPEC_HELP


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from kvlab.schema import BlockSize, HashScheme, validate_fields
    from kvlab.stats import trace_stats

    validate_fields("trace stats", block_size=(BlockSize | None, args.block_size), hash=(HashScheme, args.hash))
    _selection(args.trace, args)
    workload = _load(args)
    stats = trace_stats(workload, block_size=args.block_size, hash_scheme=args.hash)
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        text = f"{value:,.4f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        print(f"{key:<{width}}  {text}")
    return 0


def _check_new_file(path: Path) -> None:
    """``calibrate --out``: the profile and its two companions may be written (before any measurement).

    Each must be absent or a JSON file kvlab wrote (a profile or fit report: replaced atomically); the
    folder must be creatable and writable."""
    import tempfile

    for target in (path, path.with_name(f"{path.stem}.model.json"), path.with_name(f"{path.stem}.fit.json")):
        if target.is_dir():
            raise ConfigError(f"{target}: is a folder; give a file name for --out (e.g. {target / 'profile.json'})")
        if target.exists():
            try:
                data = json.loads(target.read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                data = None
            if not (isinstance(data, dict) and ("kind" in data or "fit" in data or "hardware" in data)):
                raise ConfigError(f"{target}: exists and is not a profile kvlab wrote; give another --out "
                                  "(kvlab never overwrites files it did not write)")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{path}: {folder} is a file, not a folder; give another --out")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write in {folder} ({exc.strerror or exc}); give another --out") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlab.demo import run_demo
    from kvlab.results import check_output_location

    check_output_location(args.out, kind="sweep")

    out = run_demo(args.out, quick=args.quick, progress=not args.quiet)
    from kvlab.demo import FIGURE, FIGURES, summary_lines

    print("\n".join(summary_lines(out)))
    print(f"demo results written to {out} (table: summary.csv, sweep.parquet; figure: {FIGURES}/{FIGURE}.png, .pdf)")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from kvlab.policies import available_policies, make_policy

    for name in available_policies():
        print(f"{name:<16} {type(make_policy(name)).source}")
    return 0


def _serve_on_engine(args: argparse.Namespace, workload, config):
    """``simulate --executor engine``: the same scheduler driving the real engine (random-weight model)."""
    from kvlab.engine import build_random_model
    from kvlab.sim.engine_executor import run_engine_serving, serving_engine

    model = build_random_model(args.engine_model, seed=args.seed, device=args.engine_device)
    block_size = args.block_size or workload.default_block_size
    engine = serving_engine(model, workload, args.capacity_blocks or 1024, block_size,
                            num_threads=args.engine_threads)
    return run_engine_serving(
        workload, engine, capacity_blocks=args.capacity_blocks, policy=args.policy,
        policy_params=_policy_params(args.policy_param),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, rate=args.rate,
        time_scale=args.time_scale, cache_at=args.cache_at, hash=args.hash, root_seed=args.root_seed,
        timer=args.timer, seed=args.seed, progress=not args.quiet,
        tiers=list(config.tiers) or None, tier_dir=args.tier_dir, max_load_tokens=config.max_load_tokens,
    )


#: simulate's tier flags: each is the SimConfig field of the same name (``--tier``: ``tiers``)
SIM_TIER_FIELDS = ("max_load_tokens", "load_or_recompute", "tier_overlap", "tier_prefetch", "prefetch_timeout_s",
                   "kv_layout", "tier_sync_stores")


def _flag_words(message: str) -> str:
    """A SimConfig check's sentence with the tier fields it names spelled as their flags (``tier_overlap`` ->
    ``--tier-overlap``, ``give tiers`` -> ``give --tier``); names already followed by their flag are kept."""
    from kvlab.schema import flag

    for name in (*SIM_TIER_FIELDS, "tensor_parallel"):
        message = re.sub(rf"(?<![\w.-]){name}\b(?! \(--)", flag(name), message)
    return message.replace("give tiers too", "give --tier too")


def _sim_config(args: argparse.Namespace, capacity_blocks: int | None = None):
    """The simulation's validated configuration (every flag checked before any work); ``capacity_blocks``:
    ``--capacity-gib`` converted (default ``--capacity-blocks``)."""
    from kvlab.schema import flag
    from kvlab.sim.simulator import SimConfig
    from kvlab.tiers import check_tiers, parse_tier

    tiers = check_tiers([parse_tier(spec, "--tier") for spec in args.tier], field=flag)  # SimConfig: the rest
    try:
        return SimConfig(
            model=args.model, hardware=args.hardware, policy=args.policy,
            policy_params=_policy_params(args.policy_param),
            capacity_blocks=args.capacity_blocks if capacity_blocks is None else capacity_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, rate=args.rate, time_scale=args.time_scale,
            block_size=args.block_size, tensor_parallel=args.tensor_parallel, dtype=args.dtype,
            kv_dtype=args.kv_dtype, cache_at=args.cache_at, hash=args.hash, root_seed=args.root_seed,
            fast_forward=not args.no_fast_forward, instances=args.instances, router=args.router, seed=args.seed,
            tiers=tiers, **{name: getattr(args, name) for name in SIM_TIER_FIELDS},
        )
    except ConfigError as exc:
        raise ConfigError(_flag_words(str(exc))) from None


def _check_sim_gib(args: argparse.Namespace, gib: list[float]) -> None:
    """``simulate --capacity-gib``: a value in range, converted at the model profile's own KV dtype (the
    conversion of experiment files), on the cost model."""
    _check_capacity_gib("simulate", gib, args.model)
    if args.executor == "engine":
        raise ConfigError("--capacity-gib: the engine executor's pool is sized in blocks (its model is "
                          "--engine-model, not --model): give --capacity-blocks")
    for name, value in (("--dtype", args.dtype), ("--kv-dtype", args.kv_dtype)):
        if value is not None:
            raise ConfigError(f"--capacity-gib: GiB convert at {args.model}'s own KV dtype (as an experiment "
                              f"file's cache.capacity_gib), not {name} {value}: give --capacity-blocks")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Serving simulation: scheduler + cost model in simulated time (or the real engine); one results folder."""
    from kvlab.profiles import load_hardware, load_model
    from kvlab.results import check_output_location
    from kvlab.sim import simulate

    _selection(args.trace, args)
    config = _sim_config(args)
    gib = None if args.capacity_gib is None else [args.capacity_gib]
    if gib is not None:
        _check_sim_gib(args, gib)
    if args.tier_dir is not None and (args.executor != "engine" or not config.tiers):
        raise ConfigError("--tier-dir: a real disk tier needs --executor engine and --tier")
    if args.executor == "engine":
        timed = [flag for flag, on in (("--load-or-recompute", args.load_or_recompute),
                                       ("--tier-overlap", args.tier_overlap),
                                       ("--tier-sync-stores", args.tier_sync_stores),
                                       ("--tier-prefetch", args.tier_prefetch != "off"),
                                       ("--tier medium=/link=", any(t.medium or t.link for t in config.tiers)))
                 if on]
        if timed:
            raise ConfigError(f"{timed[0]}: tier timing is the cost model's; --executor engine moves the real bytes "
                              "(its loads take the time they take: docs/engine.md 'Real tiers in the engine')")
        from kvlab.schema import validate_fields

        validate_fields("simulate", engine_threads=(Annotated[int, Field(ge=1, le=1024)], args.engine_threads))
        from kvlab.engine.model import shape_config

        _flagged("--engine-model", shape_config, args.engine_model)
    else:
        _flagged("--model", load_model, config.model)  # unknown names fail here, early, naming the flag
        _flagged("--dtype", load_model, config.model, dtype=config.dtype)
        _flagged("--kv-dtype", load_model, config.model, dtype=config.dtype, kv_dtype=config.kv_dtype)
        _flagged("--hardware", load_hardware, config.hardware)
        if gib is not None and config.block_size is not None:  # less than one block: refused before the trace
            _gib_blocks(gib, config.model, config.block_size)
        if config.tiers and config.block_size is not None:  # gib= sizes in range, before the trace is read
            kv = load_model(config.model, dtype=config.dtype, kv_dtype=config.kv_dtype).kv_bytes_per_token
            _flagged("--tier", lambda: [t.resolve(kv * config.block_size) for t in config.tiers])
    if args.out:
        check_output_location(args.out, kind="run")
    workload = _load(args)
    if gib is not None:
        bs = config.block_size or workload.default_block_size
        blocks = _gib_blocks(gib, config.model, bs)
        config = _sim_config(args, blocks[0])
        print(_gib_note(gib, blocks, config.model, bs))
    result = _serve_on_engine(args, workload, config) if args.executor == "engine" else simulate(
        workload, config, progress=not args.quiet)
    from kvlab.sweep import tier_row

    s = {**result.summary, **tier_row(result.summary)}  # with tiers: <tier>_capacity_blocks, <tier>_hit_share
    tiered = ("device_token_hit_rate", *tier_row(result.summary), "ttft_load_mean_s", "tier_stall_s",
              "loaded_bytes") if config.tiers else ()
    for key in ("requests", "rejected_requests", "cost_model", "instances", "capacity_blocks", "block_size",
                "policy", "time_scale", "token_hit_rate", "ideal_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "tpot_p50_s",
                "prefill_throughput", "effective_prefill_throughput", "output_throughput", "evictions",
                "preemptions", "readmission_hit_tokens", "makespan_s", "sim_seconds", *tiered):
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
    from kvlab.schema import BlockSize, validate_fields
    from kvlab.sim.calibrate import DEFAULT_GRID, QUICK_GRID, calibrate, grid_for_limits

    positive = Annotated[int, Field(ge=1, le=1 << 20)]
    validate_fields(
        "calibrate", block_size=(BlockSize, args.block_size), capacity_blocks=(positive, args.capacity_blocks),
        repeats=(Annotated[int, Field(ge=1, le=1000)], args.repeats), threads=(Annotated[int, Field(ge=1, le=1024)],
                                                                              args.threads),
        max_new_tokens=(positive | None, args.max_new_tokens), max_context=(positive | None, args.max_context),
    )
    if (args.max_new_tokens is None) != (args.max_context is None):
        raise ConfigError("calibrate: give --max-new-tokens and --max-context together")
    from kvlab.engine.model import shape_config
    from kvlab.profiles import load_hardware

    _flagged("--engine-model", shape_config, args.engine_model)
    if args.base_hardware is not None:
        _flagged("--base-hardware", load_hardware, args.base_hardware)
    if args.out:
        _check_new_file(args.out)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise ConfigError(f"--device: {exc}") from None
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_random_model(args.engine_model, seed=0, device=device, dtype=args.dtype)
    engine = Engine(model, capacity_blocks=args.capacity_blocks, block_size=args.block_size,
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
    if hw.batch_overhead_s:
        print(f"{'batch_overhead_s':<22} " + ", ".join(f"{s} entries {t * 1e3:.2f} ms" for s, t in hw.batch_overhead_s))
    print(f"fit |relative residual|: median {s['median_abs']:.1%}, p90 {s['p90_abs']:.1%}, max {s['max_abs']:.1%} "
          f"over {s['n']} batches")
    for note in cal.fit.notes:
        print(f"note: {note}")
    print(f"profile written to {out} (use: kvlab simulate ... --hardware {out} --model "
          f"{out.with_name(out.stem + '.model.json')})")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with kvlab's error format: one ``kvlab: error: ...`` line naming the flag, exit code 2.

    A value that starts with ``-`` and reads as a number (``--rate -inf``, ``-1e3``, ``-nan``) is a value, not
    a flag (argparse alone takes only ``-1`` and ``-1.5`` so): the flag's own check then names what is wrong
    with it (kvlab has no flag that looks like a number)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf(inity)?$|nan$)", re.IGNORECASE)

    def error(self, message: str) -> None:  # type: ignore[override]
        command = self.prog.removeprefix("kvlab").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"kvlab: error: {where}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvlab", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the Python traceback of an error")

    def trace_args(sp: argparse.ArgumentParser, many: bool = False) -> None:
        helptext = "path to a trace file, or a known public trace name (kvlab download --list)"
        sp.add_argument("traces" if many else "trace", nargs="+" if many else None, help=helptext)
        sp.add_argument("--format", choices=FORMATS, default=None, help="trace format (default: detect)")
        sp.add_argument("--limit", type=int, default=None, help="use only the first N requests")
        sp.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the trace's, or 16)")
        sp.add_argument("--hash", default="xxh3_128", help="block-hash scheme (sha256, xxh3_128, xxh3_64, builtin)")
        sp.add_argument("--tokenizer", default=None, metavar="SPEC",
                        help="tokenizer of a text trace (native JSONL/Parquet 'text' records, messages files): "
                             "kvlab-bpe (the default), byte, tekken (kvlab tokenizer fetch tekken), a name trained "
                             "with kvlab tokenizer train, a rank file, or a Hugging Face folder or cached name "
                             "(docs/cli.md)")

    trace = sub.add_parser("trace", parents=[common], help="trace tools").add_subparsers(
        dest="trace_command", required=True, parser_class=_Parser)
    stats = trace.add_parser("stats", parents=[common], help="requests, mean lengths, unique blocks, ideal hit rates")
    trace_args(stats)
    stats.set_defaults(func=cmd_trace_stats)

    rp = sub.add_parser("replay", parents=[common],
                        help="sequential cache-only replay (one run, or a sweep of several)")
    trace_args(rp)
    add_run_args(rp)
    rp.add_argument("--out", type=Path, default=None, help="results folder (written atomically)")
    rp.set_defaults(func=cmd_replay)

    sw = sub.add_parser("sweep", parents=[common], help="replay several traces x policies x capacities into one table")
    trace_args(sw, many=True)
    add_run_args(sw)
    sw.add_argument("--out", type=Path, required=True, help="results folder: OUT/<trace>/ + OUT/sweep.parquet")
    sw.set_defaults(func=cmd_sweep)

    run = sub.add_parser("run", parents=[common], help="every run of an experiment file (docs/experiments.md)")
    run.add_argument("experiment", type=Path, help="experiment YAML file")
    run.add_argument("--workers", type=int, default=None,
                     help="runs at once: local processes (default 1); ray: CPUs of the local instance (default all "
                          "cores), on a cluster the parallelism runs are grouped for (default its CPUs)")
    run.add_argument("--runner", "--backend", dest="runner", choices=("local", "ray"), default="local",
                     help="where the runs execute: local: this process or a process pool; ray: Ray tasks, results "
                          "written here (needs kvlab[ray]; docs/experiments.md). --backend is the old spelling")
    run.add_argument("--address", default=None,
                     help="ray only: 'auto' or HOST:PORT joins a running Ray cluster (default: start a local one)")
    run.add_argument("--results", type=Path, default=Path("results"),
                     help="results root: runs go to RESULTS/<experiment name>/ (default results)")
    run.add_argument("--no-resume", action="store_true", help="recompute and replace runs already complete")
    run.add_argument("--max-points", type=int, default=None, metavar="N",
                     help="the most sweep points the experiment may have (default 100,000; counted before planning)")
    run.add_argument("--allow-redefine", action="store_true",
                     help="run a changed experiment into the folder of the earlier definition of the same name")
    run.add_argument("--paired", metavar="A,B", default=None,
                     help="print policy A - policy B per point with its interval (the same warmed windows)")
    run.add_argument("--no-figure", action="store_true",
                     help="do not write the experiment's figure (RESULTS/figures/<experiment>/)")
    run.add_argument("--quiet", action="store_true")
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", parents=[common], help="the main job on the embedded default workload (no download)")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    demo.add_argument("--quick", action="store_true", help="a smaller workload (tests, CI)")
    demo.add_argument("--quiet", action="store_true")
    demo.set_defaults(func=cmd_demo)

    from kvlab.cli_download import add_parser as add_download

    add_download(sub, common)

    from kvlab.cli_tokenizer import add_parser as add_tokenizer

    add_tokenizer(sub, common)

    pol = sub.add_parser("policies", parents=[common], help="list registered eviction policies")
    pol.set_defaults(func=cmd_policies)

    sim = sub.add_parser("simulate", parents=[common],
                         help="serving simulation: vLLM-like scheduler + roofline cost model")
    trace_args(sim)
    sim.add_argument("--model", default="llama-3-8b", help="shipped model name or config.json path/folder")
    sim.add_argument("--hardware", default="h100", help="shipped hardware name (h100, h200, a100-80gb, l40s, "
                     "rtx-4090, cpu-local) or profile JSON path")
    sim.add_argument("--policy", default="lru", help="eviction policy name (kvlab policies)")
    sim.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                     help="policy constructor argument (repeatable; JSON values)")
    size = sim.add_mutually_exclusive_group()
    size.add_argument("--capacity-blocks", type=int, default=None,
                      help="KV pool per instance in blocks (default: from model, hardware and utilization)")
    size.add_argument("--capacity-gib", type=float, default=None, metavar="GIB",
                      help="KV pool per instance in GiB of --model's KV, rounded down to whole blocks (as an "
                           "experiment file's cache.capacity_gib)")
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
    sim.add_argument("--tier", action="append", default=[], metavar="SPEC",
                     help="a tier below the device, repeatable, in order (as kvlab replay --tier, one size each; "
                          f"docs/tiers.md): {SPEC_HELP}[:medium=M][:link=L], or gib=X instead of blocks=N; "
                          "medium=/link= (timing presets or a preset .json) time the tiers")
    sim.add_argument("--max-load-tokens", type=int, default=None, metavar="N",
                     help="at most N tokens of a request are loaded from the lower tiers (needs --tier)")
    sim.add_argument("--load-or-recompute", action="store_true",
                     help="load a lower-tier hit only where that beats recomputing it (timed tiers)")
    sim.add_argument("--tier-overlap", action="store_true",
                     help="loads run layer by layer beside the step's compute (timed tiers)")
    sim.add_argument("--tier-prefetch", default="off", choices=["off", "best_effort", "wait_complete", "timeout"],
                     help="prefetch the slowest tier into host memory while a request waits (timed tiers)")
    sim.add_argument("--prefetch-timeout-s", type=float, default=1.0,
                     help="--tier-prefetch timeout: the longest wait for a prefetch, seconds")
    sim.add_argument("--kv-layout", default="layer", choices=["layer", "block"],
                     help="transfer operations per layer (vLLM) or per chunk (layer-contiguous pages)")
    sim.add_argument("--tier-sync-stores", action="store_true",
                     help="every tier store on its step's critical path, as an engine that stores inline (timed tiers)")
    sim.add_argument("--tier-dir", type=Path, default=None, metavar="DIR",
                     help="--executor engine: the last --tier is a real disk tier in DIR (kvlab's own folder: created "
                          "if absent, refused if it holds files kvlab did not write); the others are DRAM")
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

    cal = sub.add_parser("calibrate", parents=[common],
                         help="fit a hardware profile's efficiencies to the real engine's step times")
    cal.add_argument("--engine-model", default="cpu-bench", help="random-weight model shape")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--dtype", default=None, help="model dtype (default: the shape's)")
    cal.add_argument("--block-size", type=int, default=16)
    cal.add_argument("--capacity-blocks", type=int, default=512, help="KV pool blocks used for the measurements")
    cal.add_argument("--num-blocks", dest="capacity_blocks", type=int, help=argparse.SUPPRESS)  # the old name
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

    from kvlab.layout.cli import add_parser as add_layout_study

    add_layout_study(sub, common)

    from kvlab.figures import add_parser as add_figures

    add_figures(sub, common)
    _plain_help(p)  # the help texts come from docstrings: no Sphinx markup on the terminal
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake ends in one ``kvlab: error: ...`` line and exit code 2 (``--debug``
    shows the traceback); an interruption in exit code 130; anything else is a kvlab bug and keeps its
    traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a flag argparse refused (2, message already printed)
        return int(exc.code or 0)
    debug = getattr(args, "debug", False)
    try:
        return args.func(args)
    except KvlabError as exc:
        if debug:
            raise
        print(f"kvlab: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder the user named: missing, unreadable, full disk
        if debug or exc.filename is None and exc.errno is None:
            raise
        print(f"kvlab: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError:
        if debug:
            raise
        hint = getattr(args, "memory_hint", None) or ("a smaller --limit, capacity or trace would fit"
                                                      if hasattr(args, "limit") else "a smaller input would fit")
        print(f"kvlab: error: out of memory ({hint})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("kvlab: interrupted (finished runs are kept; rerun the same command to resume)", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    from kvlab.errors import printable

    text = " ".join(printable(str(exc)).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
