"""``kvlab layout-study [CONFIG]``: run the prompt-layout study and print its headline (registered by kvlab.cli)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``layout-study`` on kvlab's subcommands."""
    p = sub.add_parser("layout-study", parents=[common],
                       help="prompt-layout study: families x layout transforms -> hit rate, TTFT, first-miss segment")
    p.add_argument("config", nargs="?", type=Path, default=None,
                   help="study config, YAML or JSON (default: the built-in study; docs/layout.md, 'Study')")
    p.add_argument("--out", type=Path, default=Path("results/layout_study"), help="results folder")
    p.add_argument("--quick", action="store_true", help="the tests' small study (with CONFIG: its fields override)")
    p.add_argument("--no-resume", action="store_true", help="recompute even where matching results exist")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_layout_study)


def cmd_layout_study(args: argparse.Namespace) -> int:
    """Run the study into ``--out`` and print the per-family gap between the best and worst layout."""
    from kvlab.layout.config import LayoutStudyConfig
    from kvlab.layout.study import run_study

    if args.config is not None:
        config = LayoutStudyConfig.load(args.config)
        if args.quick:
            config = LayoutStudyConfig.quick(**config.model_dump(exclude_defaults=True))
    else:
        config = LayoutStudyConfig.quick() if args.quick else LayoutStudyConfig()
    result = run_study(args.out, config, resume=not args.no_resume, progress=not args.quiet)
    print(f"layout study: {len(result.runs)} runs ({result.runs['family'].nunique()} families) in {args.out}")
    for g in result.gaps.itertuples(index=False):
        print(f"{g.family:<14} cache {g.cache:<13} hit rate best {g.best_hit_rate:.3f} ({g.best_hit_layout}) "
              f"worst {g.worst_hit_rate:.3f} ({g.worst_hit_layout}); mean TTFT best {g.best_ttft_mean_s * 1e3:.1f} ms "
              f"({g.best_ttft_layout}) worst {g.worst_ttft_mean_s * 1e3:.1f} ms ({g.worst_ttft_layout})")
    rejected = result.runs.groupby(["family", "cache"], sort=False)["rejected_requests"].max()
    for (family, cache), n in rejected[rejected > 0].items():
        print(f"warning: {family}, cache {cache}: up to {n} requests rejected (a prompt needs more blocks than the "
              "cache holds; their TTFT is missing)")
    exact = bool((result.boundary["hit_tokens"] == result.boundary["kept_tokens"]).all())
    print(f"block boundary: {result.boundary['position'].nunique()} positions x "
          f"{result.boundary['block_size'].nunique()} block sizes; hits = floor(p / B) * B everywhere: {exact}")
    print(f"answers: {result.answers['status']} ({result.answers['reason']})")
    return 0
