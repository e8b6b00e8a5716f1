"""``kvlab run EXPERIMENT.yaml``: the command line of :mod:`kvlab.experiment` (docs/experiments.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.errors import ConfigError


def cmd_run(args: argparse.Namespace) -> int:
    """``kvlab run EXPERIMENT.yaml``: plan every run (all configs checked), run the missing ones, print the table
    with each run's confidence interval (the experiment's ``analysis:``), the ``--paired`` comparison, and write
    the experiment's figure (docs/experiments.md)."""
    from kvlab.cli_replay import print_summary
    from kvlab.experiment import experiment_folder, load_experiment, run_experiment

    experiment = load_experiment(args.experiment)
    paired_policies = _paired_arg(args.paired, experiment)
    table = run_experiment(args.experiment, args.results, workers=args.workers, backend=args.backend,
                           address=args.address, resume=not args.no_resume, progress=not args.quiet)
    folder = experiment_folder(experiment, args.results)
    table = _with_intervals(table, experiment, folder)
    axes = [k for k in {**experiment.sweep.grid, **experiment.sweep.zip} if k not in ("cache.policy",
                                                                                    "cache.capacity_blocks")]
    if experiment.driver != "replay":  # latencies of the serving simulator or the engine
        axes += ["ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "output_throughput"]
    print_summary(table.to_dict("records"), extra=axes + ["hit_rate_ci"])
    print(f"results written to {folder}")
    if paired_policies is not None:
        _print_paired(table, folder, experiment, *paired_policies)
    if not args.no_figure:
        _experiment_figure(table, experiment, folder, args.results)
    return 0


def _paired_arg(text: str | None, experiment) -> tuple[str, str] | None:  # noqa: ANN001 - an Experiment
    """``--paired A,B``: two policies of the experiment (checked before any run)."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",")]
    policies = experiment.sweep.grid.get("cache.policy") or experiment.sweep.zip.get("cache.policy") or \
        [experiment.cache.policy]
    if len(names) != 2 or any(n not in policies for n in names) or names[0] == names[1]:
        raise ConfigError(f"--paired: give two different policies of the experiment as A,B "
                          f"(its policies: {', '.join(map(str, policies))}), got {text!r}")
    return names[0], names[1]


def _with_intervals(table, experiment, folder: Path):  # noqa: ANN001, ANN202 - DataFrames, an Experiment
    """The table with each run's post-warm-up hit rate and its batch-means interval (``hit_rate_ci`` as text)."""
    from kvlab.analysis.runs import run_intervals

    if table.empty:
        return table
    table = run_intervals(table, experiment.analysis, metrics=("token_hit_rate",), folder=folder)
    level = f"{experiment.analysis.confidence:.0%}"
    table["hit_rate_ci"] = [f"[{lo:.4f}, {hi:.4f}]" if lo == lo else "-" for lo, hi in
                            zip(table["token_hit_rate_ci_low"], table["token_hit_rate_ci_high"], strict=True)]
    a = experiment.analysis
    print(f"hit_rate_ci: {level} batch-means interval of the token hit rate over {a.windows} windows after a "
          f"warm-up of {a.warmup_requests} requests / {a.warmup_seconds:g} s (docs/statistics.md)")
    return table


def _print_paired(table, folder: Path, experiment, a: str, b: str) -> None:  # noqa: ANN001
    from kvlab.analysis.runs import paired

    diff = paired(table, a, b, spec=experiment.analysis, folder=folder)
    print(f"\npaired {a} - {b}: token hit rate, the same warmed windows ({experiment.analysis.confidence:.0%} "
          "interval)")
    keys = [c for c in diff.columns if c not in ("a", "b", "metric", "estimate", "low", "high", "level", "n",
                                                  "lag1", "run_a", "run_b", "method")]
    for _, row in diff.iterrows():
        where = ", ".join(f"{k}={row[k]}" for k in keys)
        print(f"  {where}: {row['estimate']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]  (lag-1 {row['lag1']:+.2f})")


LOAD_AXES = ("simulate.rate", "simulate.time_scale")


def _experiment_figure(table, experiment, folder: Path, results: Path) -> None:  # noqa: ANN001
    """The experiment's figures: TTFT vs load (a simulator experiment with a load axis), else hit rate vs
    capacity (a capacity axis); one figure per value of every other sweep axis (policies are the lines,
    replicate axes the bands), named ``<kind>`` or ``<kind>--<axis>-<value>...``."""
    from kvlab.analysis.runs import REPLICATE
    from kvlab.plots.figures import figure_from_experiment
    from kvlab.results import safe_name

    axes = {**experiment.sweep.grid, **experiment.sweep.zip}
    if experiment.driver == "simulate" and any(k in axes for k in LOAD_AXES) and "rate" in table:
        kind, x = "ttft_vs_load", [k for k in LOAD_AXES if k in axes]
    elif any(k.startswith("cache.capacity_") for k in axes):
        kind, x = "hit_rate_vs_capacity", [k for k in axes if k.startswith("cache.capacity_")]
    else:
        return
    facets = [k for k in axes if k not in (*x, "cache.policy", *REPLICATE)]
    groups = table.groupby([table[k].astype(str) for k in facets], sort=False) if facets else [((), table)]
    for values, part in groups:
        values = values if isinstance(values, tuple) else (values,)
        shown = [(k, Path(v).stem if "/" in v else v) for k, v in zip(facets, values, strict=True)]
        name = kind + "".join(f"--{k}-{v}" for k, v in shown)
        paths = figure_from_experiment(part, kind, folder=folder, results=results, spec=experiment.analysis,
                                       name=safe_name(name), subtitle=", ".join(f"{k} = {v}" for k, v in shown))
        print(f"figure: {paths[0].with_suffix('.{png,pdf,parquet,json}')}")


__all__ = ["cmd_run"]
