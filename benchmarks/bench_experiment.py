"""``kvlab run`` end to end: every built-in policy x 6 capacities on Mooncake conversation, serially, with a
local process pool and on a local Ray instance.

The experiment: ``kvlab.policies.available_policies()`` (whatever is registered when this runs) x capacities
1k, 2k, 5k, 10k, 20k, 50k blocks of 512 tokens, replay driver, ``cache.backend: auto`` (the compiled kernel
where a policy has one). Each mode is one fresh ``kvlab run`` process into a fresh results folder under a
temporary directory, timed from start to exit (interpreter start, loading and planning the trace, every
run, every write and table rebuild; for Ray also starting and stopping the local instance):

* ``serial``: ``--workers 1``;
* ``pool``: ``--workers N`` (default 2);
* ``ray``: ``--backend ray --workers N`` (a local Ray instance of N CPUs, started by kvlab run).

Before the timed modes, a warm-up ``kvlab run`` of every policy on the first 200 requests fills numba's
on-disk kernel cache (its time is printed, not compared), so no mode pays compilation the others do not.
Printed: runs, wall seconds per mode, the ratio to serial of this invocation, the 1-minute load average
before and after each mode (the machine is shared: read the figures beside it), and whether every mode's
table equals the serial one (wall-clock columns aside).

Run: ``python benchmarks/bench_experiment.py [--workers 2] [--modes serial pool ray] [--trace NAME]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

from kvlab.metrics import METRICS
from kvlab.policies import available_policies

CAPACITIES = [1_000, 2_000, 5_000, 10_000, 20_000, 50_000]
ROOT = Path(__file__).resolve().parents[1]
WALL_TIMES = [n for n, m in METRICS.items() if m.definition.startswith("wall time")]


def experiment(name: str, trace: str, limit: int | None, capacities: list[int]) -> dict:
    return {"name": name, "trace": {"path": trace, **({"limit": limit} if limit else {})},
            "cache": {"capacity_blocks": capacities[0], "mode": "vllm", "backend": "auto"},
            "hasher": {"scheme": "xxh3_128"}, "driver": "replay",
            "sweep": {"grid": {"cache.policy": available_policies(), "cache.capacity_blocks": capacities}}}


def kvlab_run(file: Path, results: Path, *flags: str) -> float:
    """Wall seconds of one ``kvlab run`` process (raises with its stderr if it fails)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "run", str(file), "--results", str(results), "--quiet",
                           *flags], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"kvlab run {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake_conversation", help="trace path or known name")
    ap.add_argument("--workers", type=int, default=2, help="processes of the pool, CPUs of the Ray instance")
    ap.add_argument("--modes", nargs="+", default=["serial", "pool", "ray"], choices=["serial", "pool", "ray"])
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up (numba cache maybe cold)")
    args = ap.parse_args()
    flags = {"serial": ["--workers", "1"], "pool": ["--workers", str(args.workers)],
             "ray": ["--backend", "ray", "--workers", str(args.workers)]}
    with tempfile.TemporaryDirectory(prefix="bench-experiment.") as tmp:
        tmp_path = Path(tmp)
        if not args.no_warmup:
            warm = tmp_path / "warm.yaml"
            warm.write_text(yaml.safe_dump(experiment("warmup", args.trace, 200, CAPACITIES[:1])))
            print(f"warm-up (numba cache): {kvlab_run(warm, tmp_path / 'warm', *flags['pool']):.1f} s")
        file = tmp_path / "all_policies.yaml"
        file.write_text(yaml.safe_dump(experiment("all_policies", args.trace, None, CAPACITIES)))
        runs = len(available_policies()) * len(CAPACITIES)
        print(f"{len(available_policies())} policies x {len(CAPACITIES)} capacities = {runs} runs on {args.trace}; "
              f"{os.cpu_count()} cores")
        print(f"{'mode':<8} {'flags':<28} {'runs':>5} {'wall s':>8} {'vs serial':>10} {'load 1m before/after':>21}")
        walls: dict[str, float] = {}
        tables: dict[str, pd.DataFrame] = {}
        for mode in args.modes:
            before = os.getloadavg()[0]
            walls[mode] = kvlab_run(file, tmp_path / mode, *flags[mode])
            after = os.getloadavg()[0]
            table = pd.read_parquet(tmp_path / mode / "all_policies" / "sweep.parquet")
            tables[mode] = table.drop(columns=[c for c in WALL_TIMES if c in table]).sort_values("run_id") \
                .reset_index(drop=True)
            ratio = f"{walls[mode] / walls['serial']:.2f}x" if "serial" in walls else "-"
            print(f"{mode:<8} {' '.join(flags[mode]):<28} {len(table):>5} {walls[mode]:>8.1f} {ratio:>10} "
                  f"{before:>10.2f}/{after:<10.2f}")
        first = next(iter(tables.values()))
        same = all(t.equals(first) for t in tables.values())
        print(f"tables equal across modes (wall-clock columns aside): {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
