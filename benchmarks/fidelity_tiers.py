"""Tiered fidelity: simulated against real TTFT with a DRAM and a disk tier below a small device pool.

The fidelity study of ``benchmarks/fidelity.py`` (:func:`kvlab.sim.fidelity.fidelity`) with lower tiers in both
runs (``fidelity(tiers=, tier_dir=, sim_options=)``):

1. **Engine**: a random-weight ``--shape`` model (default ``cpu-bench``, fp32, one torch thread) whose serving
   pool holds ``--capacity-blocks`` blocks (default 48 of 16 tokens: the longest request fits, little else), so
   that reuse comes mostly from the tiers: ``dram`` (``--dram-blocks``, ``write_back``: device evictions are
   copied there, host memory) and ``ssd`` (``--disk-blocks``, ``write_back``: DRAM's evictions are written
   there), kvlab's real :class:`~kvlab.engine.tiers.store.DiskStore` files under a fresh temporary directory
   (``--tier-root``, default the system's temp dir; a new ``tier`` directory inside it per run, created and
   removed by kvlab's TierDir rules).
2. **Measure the tiers** on this machine first: the disk with
   :func:`~kvlab.engine.tiers.measure.measure_disk` (the store's own code path in the same file system, the
   engine's block layout, chunks of 1 to 8 blocks) fitted by
   :func:`~kvlab.engine.tiers.measure.medium_preset` into a simulator medium preset (``read_warm``: the engine
   reads back files it wrote moments ago, from the page cache; a ``read_cold`` preset is saved too and
   simulated as a sensitivity row); the DRAM copy with :func:`~kvlab.engine.tiers.measure.measure_dram` (on a
   CPU a host memcpy) fitted the same way into a link preset, the link of both tiers (a disk read is staged in
   host memory, then copied into the pool). Both are saved as preset JSON files beside the results and the
   simulator's tiers name those files (``medium=`` / ``link=``).
3. **Calibrate, saturate, serve** as the fidelity study: compute calibrated on the engine in rounds interleaved
   with the runs (never on the trace), saturation with every arrival at 0, then the held-out ``synthetic_chat``
   trace (``benchmarks/fidelity.py``'s ``held_out_trace``) at 0.5 and 0.8 of saturation, ``--repeats`` engine
   runs per load (per-request median TTFT), against one simulated run with the calibrated profile, the same
   scheduler (``max_num_seqs=1``, chunked prefill at 512), pool, policy and tiers, ``kv_layout="block"`` (the
   engine moves one block-major chunk per operation).

**Timer ``wall``** (not the fidelity study's CPU-``thread`` timer on CPU): the engine loads tier blocks
synchronously while it schedules (the lookup reads and verifies disk files, the admission copies them into
the pool) and writes evicted blocks inside the allocation that evicts them: that time lies between model
steps, and disk I/O is not CPU time of the serving thread, so only the wall clock sees it. The calibration is
timed on the wall clock too.

**What the two runs model differently** (it shows in the figures): the simulator's loads are asynchronous, as
vLLM's: a request with tier hits waits in ``WAITING_FOR_KV_LOAD`` while the next queued request runs, whereas
kvlab's engine loads during scheduling and nothing runs meanwhile; under queueing the two orders differ, and
so may the hits. The simulator's stores other than tier 1's write-back are asynchronous (the disk write-back
only occupies the disk, delaying later disk reads); the engine writes (and fsyncs) them on the critical path.
The engine's DRAM load is an indexed copy into the pool plus Python work per chunk, not a bare memcpy.

Sensitivity rows (simulator only, same calibrated profile and engine medians): the ``read_cold`` disk preset,
and untimed tiers (loads and stores free: the hits then follow the engine's schedule exactly whenever it does
not depend on timing).

Report per load: median and p90 per-request TTFT error, bias, the engine's own rerun noise (run vs run, half
vs half), hit tokens per source engine vs sim, and load / store seconds per request (and the engine's time
outside its steps: scheduling plus synchronous tier I/O, which the simulator does not have). Controls:
``--tier-root /dev/shm`` (the same DiskStore on tmpfs: fsync free) and ``--no-tiers`` (the same study without
tiers, e.g. with ``--capacity-blocks 256``: the wall-clock baseline). Targets are the fidelity
study's (median < 10 %, p90 < 25 %); they are undecidable where the engine's own noise exceeds them.

Run: ``python benchmarks/fidelity_tiers.py [--repeats 5] [--quick]``. Results:
``results/fidelity_tiers/<shape>-<device>/`` (``requests.parquet``: per request and load, with the tier columns
of :func:`~kvlab.sim.fidelity.fidelity`; ``table.parquet``; ``sensitivity.parquet``; ``calibration.parquet``;
``steps.parquet``; ``step_errors.parquet``; ``summary.json``: tables, measurements, presets) and beside it the
calibrated ``<name>.hardware.json`` and the presets ``<name>.disk_warm.json``, ``<name>.disk_cold.json``,
``<name>.memcpy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import TARGET_MEDIAN, TARGET_P90, held_out_trace, print_step_level  # noqa: E402

from kvlab.engine import Engine, build_random_model  # noqa: E402
from kvlab.engine.tiers.measure import disk_profile, measure_disk, measure_dram, medium_preset  # noqa: E402
from kvlab.profiles import ModelProfile  # noqa: E402
from kvlab.results import build_manifest, write_results  # noqa: E402
from kvlab.sim import simulate  # noqa: E402
from kvlab.sim.calibrate import QUICK_GRID, grid_for_limits, serving_batch_sizes  # noqa: E402
from kvlab.sim.engine_executor import engine_model_profile  # noqa: E402
from kvlab.sim.fidelity import FidelityResult, fidelity, ttft_errors  # noqa: E402
from kvlab.tiers import Tier  # noqa: E402


def measure_presets(directory: str | os.PathLike, layout, *, chunks=(1, 2, 4, 8), ops: int = 24) -> dict:  # noqa: ANN001
    """The disk (DiskStore in ``directory``) and the host copy measured at ``chunks`` blocks of ``layout`` per
    operation: ``{"disk": measure_disk's result, "dram": measure_dram's, "presets": {"disk_warm", "disk_cold",
    "memcpy"}}`` (simulator preset fields; the memcpy is a link)."""
    disk = measure_disk(directory, layout=layout, chunks=chunks, ops=ops)
    dram = measure_dram(layout=layout, chunks=chunks, ops=max(ops, 20))
    copies = {"directory": "host memory", "sizes": {c: {"bytes_per_op": row["copy"]["bytes_per_op"],
                                                         "copy": row["copy"]} for c, row in dram["sizes"].items()}}
    fit = disk_profile(copies, "copy")
    memcpy = {"kind": "link", "bandwidth": fit["bandwidth_Bps"], "latency_s": fit["latency_s"], "queue_depth": 1,
              "calibrated": True, "description": "host memcpy (torch copy_) on this CPU: a DRAM tier's copy",
              "source": f"measured by kvlab.engine.tiers.measure.measure_dram ({dram['what']}; chunks of "
                        f"{', '.join(str(c) for c in chunks)} blocks of {layout.bytes_per_block} bytes; "
                        "latency + bytes / bandwidth fitted to the medians; fidelity_tiers.py)"}
    return {"disk": disk, "dram": dram, "presets": {
        "disk_warm": medium_preset(disk, "read_warm"), "disk_cold": medium_preset(disk, "read_cold"),
        "memcpy": memcpy}}


def save_presets(presets: dict, out: Path) -> dict[str, str]:
    """Each preset as ``<out>.<name>.json`` beside the results (its ``name`` field: the simulator's resource)."""
    paths = {}
    for name, fields in presets.items():
        path = out.parent / f"{out.name}.{name}.json"
        path.write_text(json.dumps({"name": name, **fields}, indent=1) + "\n")
        paths[name] = str(path)
    return paths


def make_tiers(dram_blocks: int, disk_blocks: int, disk: str | None = None, link: str | None = None) -> list[Tier]:
    """The study's two tiers; ``disk`` / ``link``: preset files (None: untimed, as the engine ignores them)."""
    return [Tier(name="dram", capacity_blocks=dram_blocks, write="write_back", link=link),
            Tier(name="ssd", capacity_blocks=disk_blocks, write="write_back", medium=disk, link=link)]


def sensitivity(res: FidelityResult, wl, engine: Engine, variants: dict[str, list[Tier]], *,  # noqa: ANN001
                model: ModelProfile, common: dict, sim_options: dict) -> pd.DataFrame:
    """Simulated runs with other tier timings against the same engine medians: one row per (load, variant)."""
    rows = []
    for load in res.config["loads"]:
        req = res.requests[res.requests["load"] == load]
        eng = pd.DataFrame({"request_id": req["request_id"].to_numpy(), "ttft_s": req["ttft_engine_s"].to_numpy(),
                            "hit_blocks": req["hit_blocks_engine"].to_numpy()})
        for name, tiers in variants.items():
            timed = any(t.link for t in tiers)
            sim = simulate(wl, rate=load * res.saturation_rps, model=model,
                           hardware=res.hardware, block_size=engine.block_size, tiers=tiers,
                           **(sim_options if timed else {}), **common)
            err = ttft_errors(eng, sim.requests)
            e = err["ttft_rel_error"].to_numpy()
            cols = ["hit_tokens_device", *(f"hit_tokens_{t.name}" for t in tiers)]
            same = (sim.requests[cols].to_numpy() == req[[f"{c}_engine" for c in cols]].to_numpy()).all(axis=1)
            rows.append({"load": load, "variant": name, "median_ttft_error": float(np.median(e)),
                         "p90_ttft_error": float(np.percentile(e, 90)),
                         "mean_signed_error": float(np.mean((err["ttft_sim_s"] - err["ttft_engine_s"])
                                                            / err["ttft_engine_s"])),
                         "ttft_p50_sim_s": float(np.median(err["ttft_sim_s"])),
                         "busy_sim_s": float(sim.summary["busy_s"]), "tier_hits_equal_share": float(same.mean()),
                         **{f"{c}_sim": int(sim.requests[c].sum()) for c in cols}})
    return pd.DataFrame(rows)


def print_tables(table: pd.DataFrame, sens: pd.DataFrame, sources: list[str]) -> bool:
    """Print the TTFT table, the hits and I/O table and the sensitivity rows; True if the targets are met."""
    print(f"\n{'load':>5} {'req/s':>6} {'median err':>10} {'p90 err':>8} {'bias':>7} {'p50 TTFT eng/sim':>17} "
          f"{'p90 TTFT eng/sim':>17} {'busy eng/sim':>13} {'rerun med/p90':>14} {'half med/p90':>13}  verdict")
    ok = True
    for r in table.itertuples():
        good = r.median_ttft_error < TARGET_MEDIAN and r.p90_ttft_error < TARGET_P90
        noisy = r.engine_split_half_median_error > TARGET_MEDIAN or r.engine_split_half_p90_error > TARGET_P90
        ok &= good
        verdict = "met" if good else ("undecidable (engine noise above target)" if noisy else "missed")
        print(f"{r.load:>5.2f} {r.rate_rps:>6.2f} {r.median_ttft_error:>10.1%} {r.p90_ttft_error:>8.1%} "
              f"{r.mean_signed_error:>+7.1%} {f'{r.ttft_p50_engine_s:.3f}/{r.ttft_p50_sim_s:.3f}':>17} "
              f"{f'{r.ttft_p90_engine_s:.3f}/{r.ttft_p90_sim_s:.3f}':>17} "
              f"{f'{r.busy_engine_s:.1f}/{r.busy_sim_s:.1f}':>13} "
              f"{f'{r.engine_rerun_median_error:.0%}/{r.engine_rerun_p90_error:.0%}':>14} "
              f"{f'{r.engine_split_half_median_error:.0%}/{r.engine_split_half_p90_error:.0%}':>13}  {verdict}")
    print(f"targets: median < {TARGET_MEDIAN:.0%}, p90 < {TARGET_P90:.0%}")
    if "tier_hits_equal_share" not in table:  # (--no-tiers)
        print("no tiers: " + "; ".join(f"load {r.load:.2f}: hits equal {r.hits_equal}, token hit rate "
                                       f"{r.token_hit_rate:.3f}" for r in table.itertuples()))
        return ok
    print("\nhit tokens per source, engine (median of the repeats [min, max]) / sim; requests whose hits agree per "
          "source; load / store seconds per request (engine: tiers' read_s / write_s; sim: admission to load end, "
          "the wait for loads before the first token, write-back stalls)")
    for r in table.itertuples():
        d = r._asdict()
        hits = "  ".join(f"{s} {d[f'hit_tokens_{s}_engine']:.0f} [{d[f'hit_tokens_{s}_engine_min']}, "
                         f"{d[f'hit_tokens_{s}_engine_max']}] / {d[f'hit_tokens_{s}_sim']}" for s in sources)
        print(f"{r.load:>5.2f}  {hits}  agree {r.tier_hits_equal_share:.0%}")
        print(f"       load ms/request engine {r.load_s_per_request_engine * 1e3:.3f}, "
              f"sim {r.load_s_per_request_sim * 1e3:.3f} (wait for loads before the first token "
              f"{r.ttft_load_s_per_request_sim * 1e3:.3f}); store ms/request "
              f"engine {r.store_s_per_request_engine * 1e3:.3f}, sim stall {r.stall_s_per_request_sim * 1e3:.3f}; "
              f"engine ms/request outside steps {r.outside_steps_s_per_request_engine * 1e3:.3f}; "
              f"read/write errors {r.tier_read_errors_engine}/{r.tier_write_errors_engine}")
    print("\nsensitivity (simulator only, against the same engine medians):")
    for r in sens.itertuples():
        print(f"{r.load:>5.2f} {r.variant:>14}  median {r.median_ttft_error:.1%}  p90 {r.p90_ttft_error:.1%}  "
              f"bias {r.mean_signed_error:+.1%}  p50 TTFT sim {r.ttft_p50_sim_s:.3f}  hits agree "
              f"{r.tier_hits_equal_share:.0%}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="cpu-bench", help="random-weight model shape (kvlab.engine.SHAPES)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=4, help="output tokens per request at most")
    ap.add_argument("--length-scale", type=float, default=1.0, help="multiply the trace's prompt lengths")
    ap.add_argument("--capacity-blocks", type=int, default=48, help="device pool of the serving runs (blocks)")
    ap.add_argument("--engine-blocks", type=int, default=160, help="the engine's pool (calibration batches)")
    ap.add_argument("--dram-blocks", type=int, default=64)
    ap.add_argument("--disk-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5, help="engine runs per load (per-request median TTFT)")
    ap.add_argument("--saturation-repeats", type=int, default=2)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--disk-read", default="read_warm", choices=["read_warm", "read_cold"],
                    help="the disk preset of the main comparison (the other is a sensitivity row)")
    ap.add_argument("--measure-ops", type=int, default=24, help="operations per size when measuring the disk")
    ap.add_argument("--tier-root", default=None, help="where the temporary disk-tier directory goes")
    ap.add_argument("--sync-stores", action="store_true",
                    help="simulate stores on the step's critical path (tier_sync_stores), as kvlab's engine does them")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=1, help="trace seed")
    ap.add_argument("--no-tiers", action="store_true",
                    help="baseline: the same study without tiers (the pool alone, e.g. --capacity-blocks 256)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 30 requests, 2 repeats, 1 saturation run, the quick grid")
    ap.add_argument("--out", type=Path, default=None, help="default: results/fidelity_tiers/<shape>-cpu")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats, args.saturation_repeats = min(args.requests, 30), min(args.repeats, 2), 1
        args.measure_ops = min(args.measure_ops, 6)
    torch.set_num_threads(args.threads)
    out = args.out or Path("results/fidelity_tiers") / f"{args.shape}-cpu"
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_avg = [os.getloadavg()]

    model = build_random_model(args.shape, seed=0)
    engine = Engine(model, capacity_blocks=max(args.engine_blocks, args.capacity_blocks), block_size=args.block_size,
                    num_threads=args.threads)
    print(f"engine: {engine.model_id}, {engine.layout.bytes_per_block} bytes per block, serving pool "
          f"{args.capacity_blocks} blocks of {args.block_size}; tiers dram {args.dram_blocks} blocks (write_back), "
          f"ssd {args.disk_blocks} blocks (write_back, DiskStore); timer wall, torch threads {torch.get_num_threads()}")
    root = Path(tempfile.mkdtemp(prefix="kvlab-fidelity-tiers-", dir=args.tier_root))
    try:
        t0 = time.perf_counter()
        measured = measure_presets(root, engine.layout, chunks=(1, 2, 4) if args.quick else (1, 2, 4, 8),
                                   ops=args.measure_ops)
        paths = save_presets(measured["presets"], out)
        for name, p in measured["presets"].items():
            one = p["latency_s"] + engine.layout.bytes_per_block / p["bandwidth"]
            w = (f", write {p['write_bandwidth'] / 1e9:.2f} GB/s" if "write_bandwidth" in p else "")
            print(f"preset {name}: latency {p['latency_s'] * 1e6:.1f} us, {p['bandwidth'] / 1e9:.2f} GB/s{w}; one "
                  f"block {one * 1e6:.1f} us -> {paths[name]}")
        for c, s in measured["disk"]["sizes"].items():
            print(f"  disk {c} block(s): " + ", ".join(f"{op} {s[op]['median_s'] * 1e3:.3f} ms" for op in
                                                        ("write", "write_nofsync", "read_warm", "read_cold",
                                                         "read_direct") if op in s))
        print(f"measured in {time.perf_counter() - t0:.1f} s")
        disk = paths["disk_warm" if args.disk_read == "read_warm" else "disk_cold"]
        tiers = make_tiers(args.dram_blocks, args.disk_blocks, disk, paths["memcpy"])
        sim_options = {"kv_layout": "block", **({"tier_sync_stores": True} if args.sync_stores else {})}
        tier_args = {} if args.no_tiers else dict(tiers=tiers, tier_dir=root / "tier", sim_options=sim_options)

        wl = held_out_trace(args.requests, engine.vocab_size, seed=args.seed, max_output=args.max_output,
                            scale=args.length_scale)
        print(f"held-out trace: {wl!r}, prompts {int(wl.input_length.min())}-{int(wl.input_length.max())} tokens")
        longest = int((wl.input_length + np.maximum(wl.output_length, 1)).max())
        if -(-(longest - 1) // args.block_size) > args.capacity_blocks:
            raise SystemExit(f"the longest request ({longest} tokens) does not fit --capacity-blocks "
                             f"{args.capacity_blocks} of {args.block_size} tokens")
        grid = QUICK_GRID if args.quick else grid_for_limits(
            min(args.max_batched_tokens, int(wl.input_length.max())), longest, serving_batch_sizes(1, False))
        t0 = time.perf_counter()
        res = fidelity(wl, engine, None, loads=args.loads, repeats=args.repeats,
                       saturation_repeats=args.saturation_repeats, timer="wall",
                       capacity_blocks=args.capacity_blocks, max_num_seqs=1,
                       max_num_batched_tokens=args.max_batched_tokens, grid=grid, **tier_args)
        load_avg.append(os.getloadavg())
        print(f"saturation {res.saturation_rps:.2f} requests/s (median of "
              f"{', '.join(f'{x:.2f}' for x in res.config['saturation_runs_rps'])}); runs took "
              f"{time.perf_counter() - t0:.0f} s")
    finally:
        for p in sorted(root.rglob("*"), reverse=True):  # (kvlab removed its files; anything left is reported)
            print(f"left in the tier root: {p}")
        if not any(root.iterdir()):
            root.rmdir()
    cal = res.calibration
    hw = res.hardware
    profile_path = cal.save(out.parent / f"{out.name}.hardware.json")
    fs = cal.fit.stats
    print(f"calibration ({fs['n']} batches, {res.config['calibration_rounds']} rounds, wall clock): "
          f"fit |residual| median {fs['median_abs']:.1%} p90 {fs['p90_abs']:.1%}, bias {fs['bias']:+.1%}; "
          f"{profile_path}")

    common = dict(policy="lru", capacity_blocks=args.capacity_blocks, max_num_seqs=1,
                  max_num_batched_tokens=args.max_batched_tokens, cache_at="schedule")
    other = paths["disk_cold" if args.disk_read == "read_warm" else "disk_warm"]
    sens = pd.DataFrame() if args.no_tiers else sensitivity(res, wl, engine, {
        ("disk_cold" if args.disk_read == "read_warm" else "disk_warm"): make_tiers(
            args.dram_blocks, args.disk_blocks, other, paths["memcpy"]),
        "untimed_tiers": make_tiers(args.dram_blocks, args.disk_blocks)}, model=engine_model_profile(engine),
        common=common, sim_options=sim_options)
    sources = ["device", *(t.name for t in tiers)]
    table = res.table
    ok = print_tables(table, sens, sources)
    print_step_level(res.step_table, table)
    print("bias: mean signed TTFT error (sim - engine) / engine; rerun: the same error between the engine's own "
          "repeats; half: between the medians of the odd and the even repeats")
    load_avg.append(os.getloadavg())
    print("load average (1/5/15 min) at start, after the runs, at the end: "
          + "; ".join(" ".join(f"{x:.2f}" for x in la) for la in load_avg))

    summary = {
        "passed": ok, "targets": {"median": TARGET_MEDIAN, "p90": TARGET_P90},
        "saturation_rps": res.saturation_rps, "table": table.to_dict("records"),
        "sensitivity": sens.to_dict("records"), "step_table": res.step_table.to_dict("records"),
        "presets": {name: {"path": paths[name], **p} for name, p in measured["presets"].items()},
        "measured": {"disk": measured["disk"], "dram": measured["dram"]},
        "calibration": {"hardware_profile": hw.to_dict(), "theta": cal.fit.theta, "residuals": fs,
                        "notes": cal.fit.notes, **cal.meta},
        "trace": {"name": wl.name, "requests": len(wl), "prompt_tokens_mean": float(wl.input_length.mean()),
                  "prompt_tokens_max": int(wl.input_length.max()), "max_output": args.max_output},
        "load_average": [list(x) for x in load_avg], "wall_seconds": time.perf_counter() - t_start,
    }
    config = {**vars(args), "out": str(out), "timer": "wall", "engine": engine.config(), **res.config}
    manifest = build_manifest(json.loads(json.dumps(config, default=str)), trace=summary["trace"], seed=args.seed,
                              driver="fidelity-tiers")
    write_results(out, {"requests": res.requests, "table": table, **({"sensitivity": sens} if len(sens) else {}),
                        "calibration": cal.fit.samples,
                        "steps": res.steps, "step_errors": res.step_table},
                  json.loads(json.dumps(summary, default=str)), manifest)
    print(f"results written to {out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    pd.set_option("display.width", 160)
    sys.exit(main())
