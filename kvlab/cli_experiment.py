"""``kvlab run EXPERIMENT.yaml``: the command line of :mod:`kvlab.experiment` (docs/experiments.md)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvlab.errors import ConfigError, KvlabError

#: what to shrink when ``kvlab run`` runs out of memory (the MemoryError handler of kvlab.cli prints it)
MEMORY_HINT = "fewer sweep points (sweep.grid / sweep.zip, --max-points) or a shorter trace (trace.limit) would fit"


def cmd_run(args: argparse.Namespace) -> int:
    """``kvlab run EXPERIMENT.yaml``: plan every run (all configs checked), run the missing ones, print the table
    with each run's confidence interval (the experiment's ``analysis:``), the ``--paired`` comparison, and write
    the experiment's figure (docs/experiments.md). Everything checkable is checked before the first run (the
    sweep's size, the results and figures folders, the analysis warm-up); a step after the runs that fails
    keeps them and ends in one line naming what to change."""
    from kvlab.experiment import experiment_folder, load_experiment, run_experiment
    from kvlab.experiment.config import MAX_POINTS

    args.memory_hint = MEMORY_HINT
    experiment = load_experiment(args.experiment)
    paired_policies = _paired_arg(args.paired, experiment)

    def check_figures(planned: list) -> None:
        if not args.no_figure:
            _check_figure_folder(experiment, planned, args.results)

    table = run_experiment(args.experiment, args.results, workers=args.workers, backend=args.runner,
                           address=args.address, resume=not args.no_resume, progress=not args.quiet,
                           max_points=MAX_POINTS if args.max_points is None else args.max_points,
                           allow_redefine=args.allow_redefine, before_runs=check_figures)
    folder = experiment_folder(experiment, args.results)
    kept = f"the {len(table)} runs are complete in {folder} (kept: rerunning reuses them)"
    with _after_runs(kept, f"change analysis: in {args.experiment}"):
        table = _with_intervals(table, experiment, folder)
    _print_table(table, experiment)
    print(f"results written to {folder}")
    if paired_policies is not None:
        with _after_runs(kept, "change --paired or analysis:"):
            _print_paired(table, folder, experiment, *paired_policies)
    if not args.no_figure:
        with _after_runs(kept, "move the file named away, or give --no-figure"):
            _experiment_figure(table, experiment, folder, args.results)
    return 0


@contextlib.contextmanager
def _after_runs(kept: str, todo: str) -> Iterator[None]:
    """A step after the runs: its failure (a kvlab error or a file error) becomes one line that says the runs are
    kept and what to change (``todo``)."""
    try:
        yield
    except (KvlabError, OSError) as exc:
        if isinstance(exc, OSError) and exc.filename is None:
            raise
        raise ConfigError(f"{kept}; then: {' '.join(str(exc).split())}; {todo}") from None
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # noqa: BLE001 - a kvlab bug after the runs: still one line, the runs kept
        raise ConfigError(f"{kept}; then kvlab failed ({type(exc).__name__}: {' '.join(str(exc).split())}), "
                          f"a bug to report; {todo}") from None


#: printed column -> the table's column: the post-warm-up values (what hit_rate_ci and the figure are about)
WARMED_COLUMNS = {"hit_rate_warmed": "token_hit_rate_warmed", "ideal_warmed": "ideal_hit_rate_warmed",
                  "ttft_p50_warmed": "ttft_p50_s_warmed", "ttft_p90_warmed": "ttft_p90_s_warmed"}
#: whole-run summary columns not printed (a point estimate without an interval beside the warmed ones)
WHOLE_RUN_HIDDEN = ("token_hit_rate", "ideal_hit_rate", "block_hit_rate", "request_hit_rate", "ttft_p50_s",
                    "ttft_p90_s")


def _print_table(table, experiment) -> None:  # noqa: ANN001 - a DataFrame, an Experiment
    """One line per run: the post-warm-up token hit rate beside its interval (``hit_rate_warmed``,
    ``hit_rate_ci``), the infinite cache over the same warmed requests (``ideal_warmed``: the figure's
    baseline), and the whole-run rate labelled ``hit_rate_all``; then, with replicates, one line per point (the
    figure's points and bands)."""
    from kvlab.cli_replay import print_summary

    axes = [k for k in {**experiment.sweep.grid, **experiment.sweep.zip} if k not in ("cache.policy",
                                                                                    "cache.capacity_blocks")]
    shown = ["policy", "capacity_blocks", "mode", "hit_rate_warmed", "hit_rate_ci", "ideal_warmed"]
    if experiment.driver != "replay":  # latencies of the serving simulator or the engine
        shown += ["ttft_p50_warmed", "ttft_p90_warmed", "ttft_p99_s", "tpot_p50_s", "output_throughput"]
    rows = []
    for row in table.to_dict("records"):
        row.update({k: row.get(v) for k, v in WARMED_COLUMNS.items()})
        row["hit_rate_all"] = row.get("token_hit_rate")
        rows.append({k: v for k, v in row.items() if k not in WHOLE_RUN_HIDDEN})
    print("hit_rate_warmed, ideal_warmed: token hit rate after the warm-up (the results' token_hit_rate_warmed, "
          "ideal_hit_rate_warmed; what hit_rate_ci, the figure and --paired are about); hit_rate_all: over every "
          "request (token_hit_rate)" + ("; ttft_*_warmed: after the warm-up, ttft_p99_s, tpot_p50_s: every "
                                        "request" if experiment.driver != "replay" else ""))
    print_summary(rows, extra=axes + shown + ["hit_rate_all"])
    _print_replicates(table)


def _print_replicates(table) -> None:  # noqa: ANN001 - a DataFrame
    """With replicates (``seed`` / ``trace.resample_seed`` sweeps): one line per point, the mean of its runs'
    ``hit_rate_warmed`` with the t interval over them and the mean ``ideal_warmed`` (what the figure draws)."""
    from kvlab.analysis.runs import REPLICATE, has_replicates, replicate_intervals
    from kvlab.results.runs import varying_columns

    if table.empty or not has_replicates(table):
        return
    ideal = "ideal_hit_rate_warmed" in table
    reps = replicate_intervals(table, ("token_hit_rate", "ideal_hit_rate") if ideal else ("token_hit_rate",))
    level = float(reps["ci_level"].iloc[0])
    which = ", ".join(c for c in REPLICATE if c in table and table[c].astype(str).nunique() > 1)
    print(f"\nover replicates ({which}): per point, the mean of the runs' hit_rate_warmed and its {level:.0%} "
          "t interval over the replicates (the figure's points and bands)")
    cols = [c for c in varying_columns(reps) if c not in ("replicates", "ci_level") and not c.endswith(
        ("_rep_mean", "_rep_low", "_rep_high"))]
    for _, r in reps.iterrows():
        where = ", ".join(f"{c}={r[c]}" for c in cols)
        low, high = r["token_hit_rate_rep_low"], r["token_hit_rate_rep_high"]
        ci = f"[{low:.4f}, {high:.4f}]" if low == low else "-"
        extra = f", ideal_warmed {r['ideal_hit_rate_rep_mean']:.4f}" if ideal else ""
        print(f"  {where}: hit_rate_warmed {r['token_hit_rate_rep_mean']:.4f} {ci}  "
              f"({int(r['replicates'])} replicates{extra})")


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
    """The table with each run's post-warm-up hit rate and its batch-means interval (``hit_rate_ci`` as text);
    a note when a run has fewer warmed requests than ``analysis.windows`` (its interval uses fewer windows)."""
    from kvlab.analysis.runs import run_intervals

    if table.empty:
        return table
    metrics = ["token_hit_rate"] + (["ideal_hit_rate"] if "ideal_hit_rate" in table else [])
    metrics += ["ttft_p50_s", "ttft_p90_s"] if experiment.driver != "replay" else []
    table = run_intervals(table, experiment.analysis, metrics=metrics, folder=folder)
    level = f"{experiment.analysis.confidence:.0%}"
    table["hit_rate_ci"] = [f"[{lo:.4f}, {hi:.4f}]" if lo == lo else "-" for lo, hi in
                            zip(table["token_hit_rate_ci_low"], table["token_hit_rate_ci_high"], strict=True)]
    a = experiment.analysis
    print(f"hit_rate_ci: {level} batch-means interval of the token hit rate over {a.windows} windows after a "
          f"warm-up of {a.warmup_requests} requests / {a.warmup_seconds:g} s (docs/statistics.md)")
    fewer = table[table["ci_windows"] < a.windows]
    if len(fewer):
        least = int(fewer["warmed_requests"].min())
        print(f"note: {len(fewer):,} of {len(table):,} runs have fewer requests after the warm-up than "
              f"analysis.windows ({a.windows}; fewest: {least}): their intervals use one window per request "
              f"({', '.join(map(str, sorted({int(n) for n in fewer['ci_windows']})))} windows; a run with fewer than "
              "2 has none: '-'); a longer trace (trace.limit) or fewer analysis.windows gives steadier intervals")
    return table


def _print_paired(table, folder: Path, experiment, a: str, b: str) -> None:  # noqa: ANN001
    """``--paired A,B``: with replicates one t interval per point over the per-replicate differences of the
    post-warm-up hit rates; else per run pair, paired batch means on the same warmed windows."""
    from kvlab.analysis.runs import has_replicates, paired, paired_replicates

    level = f"{experiment.analysis.confidence:.0%}"
    if has_replicates(table):
        diff = paired_replicates(table, a, b, confidence=experiment.analysis.confidence)
        print(f"\npaired {a} - {b}: post-warm-up token hit rate (hit_rate_warmed), {level} t interval over the "
              "per-replicate differences")
        keys = [c for c in diff.columns if c not in ("a", "b", "metric", "method", "estimate", "low", "high",
                                                      "level", "replicates")]
        for _, row in diff.iterrows():
            where = ", ".join(f"{k}={row[k]}" for k in keys) or "all runs"
            ci = f"[{row['low']:+.4f}, {row['high']:+.4f}]" if row["low"] == row["low"] else "-"
            print(f"  {where}: {row['estimate']:+.4f} {ci}  ({int(row['replicates'])} replicates)")
        return
    diff = paired(table, a, b, spec=experiment.analysis, folder=folder)
    print(f"\npaired {a} - {b}: token hit rate, the same warmed windows ({level} interval)")
    keys = [c for c in diff.columns if c not in ("a", "b", "metric", "estimate", "low", "high", "level", "n",
                                                  "lag1", "run_a", "run_b", "method")]
    for _, row in diff.iterrows():
        where = ", ".join(f"{k}={row[k]}" for k in keys) or "all runs"
        print(f"  {where}: {row['estimate']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]  (lag-1 {row['lag1']:+.2f})")


LOAD_AXES = ("simulate.rate", "simulate.time_scale")


def _figure_kinds(experiment, has_rate: bool | None) -> list[tuple[str, list[str]]]:  # noqa: ANN001
    """``(kind, x axes)`` of the experiment's figure: TTFT vs load (a simulator experiment with a load axis whose
    table has ``rate``), else hit rate vs capacity (a capacity axis), else none. ``has_rate`` None (before the
    runs): both candidates."""
    axes = {**experiment.sweep.grid, **experiment.sweep.zip}
    load = experiment.driver == "simulate" and any(k in axes for k in LOAD_AXES)
    out = []
    if load and has_rate is not False:
        out.append(("ttft_vs_load", [k for k in LOAD_AXES if k in axes]))
    if any(k.startswith("cache.capacity_") for k in axes) and not (load and has_rate):
        out.append(("hit_rate_vs_capacity", [k for k in axes if k.startswith("cache.capacity_")]))
    return out


def _figure_parts(experiment, table, kind: str, x: list[str]) -> list[tuple[str, str, object]]:  # noqa: ANN001
    """``(file name, subtitle, rows)`` per figure of ``kind``: one per value of every sweep axis but ``x``, the
    policy and the replicate axes, named ``<kind>`` or ``<kind>--<axis>-<value>...`` (a safe name)."""
    from kvlab.analysis.runs import REPLICATE
    from kvlab.results import safe_name

    axes = {**experiment.sweep.grid, **experiment.sweep.zip}
    facets = [k for k in axes if k not in (*x, "cache.policy", *REPLICATE)]
    groups = table.groupby([table[k].astype(str) for k in facets], sort=False) if facets else [((), table)]
    out = []
    for values, part in groups:
        values = values if isinstance(values, tuple) else (values,)
        shown = [(k, Path(v).stem if "/" in v else v) for k, v in zip(facets, values, strict=True)]
        out.append((safe_name(kind + "".join(f"--{k}-{v}" for k, v in shown)),
                    ", ".join(f"{k} = {v}" for k, v in shown), part))
    return out


def _check_figure_folder(experiment, planned: list, results: Path) -> None:  # noqa: ANN001
    """Before the runs: the figures folder ``RESULTS/figures/<name>/`` and every figure file kvlab run will
    write there (:func:`kvlab.results.owned.check_folder`): a file or a foreign folder on the way, or a file
    kvlab did not write under one of those names, is refused now (ResultsLocationError), not after the runs."""
    import pandas as pd

    from kvlab.errors import ResultsLocationError
    from kvlab.experiment.runner import flat_columns
    from kvlab.plots.figures import experiment_figure_folder, figure_files
    from kvlab.results.owned import check_folder

    frame = pd.DataFrame([flat_columns(p.point, p.run) for p in planned])
    names = [f for kind, x in _figure_kinds(experiment, None) for name, _, _ in
             _figure_parts(experiment, frame, kind, x) for f in figure_files(name)]
    if not names:
        return
    try:
        check_folder(experiment_figure_folder(results, experiment.name), names=names)
    except ResultsLocationError as exc:
        raise ResultsLocationError(f"the experiment's figures (--no-figure writes none): {exc}") from None


def _experiment_figure(table, experiment, folder: Path, results: Path) -> None:  # noqa: ANN001
    """The experiment's figures (:func:`_figure_kinds`, :func:`_figure_parts`): policies are the lines, replicate
    axes the bands."""
    from kvlab.plots.figures import figure_from_experiment

    for kind, x in _figure_kinds(experiment, "rate" in table):
        for name, subtitle, part in _figure_parts(experiment, table, kind, x):
            paths = figure_from_experiment(part, kind, folder=folder, results=results, spec=experiment.analysis,
                                           name=name, subtitle=subtitle)
            print(f"figure: {paths[0].with_suffix('.{png,pdf,parquet,json}')}")


__all__ = ["cmd_run"]
