"""``kvlab layout-study [CONFIG] [--workload FILE --layouts A,B,...]``: run the prompt-layout study and print its
headline (registered by kvlab.cli).

With ``--workload`` the study runs on a researcher's own requests only (a messages file,
:mod:`kvlab.workload.messages`: the family ``messages``), each of ``--layouts`` applied, no boundary sweep; it prints
one line per layout (token hit rate, mean and p50 TTFT, first-miss segment) and writes the results and one figure
(:data:`FIGURE`: PNG, PDF, its data and caption; column width) into ``--out``. Without it, nothing changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from kvlab.layout.config import LayoutStudyConfig

DEFAULT_OUT = Path("results/layout_study")
WORKLOAD_FAMILY = "messages"
"""The family name (and results folder under ``--out``) of ``--workload``'s requests."""
DEFAULT_WORKLOAD_LAYOUTS = ("as_generated", "volatile_top", "volatile_after_system", "volatile_end")
"""``--workload``'s layouts when ``--layouts`` is not given."""
FIGURE = "layouts"
"""The figure ``--workload`` writes: ``OUT/layouts.png``, ``.pdf``, ``.parquet`` (its data), ``.json`` (caption)."""


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``layout-study`` on kvlab's subcommands."""
    p = sub.add_parser("layout-study", parents=[common],
                       help="prompt-layout study: families x layout transforms -> hit rate, TTFT, first-miss segment")
    p.add_argument("config", nargs="?", type=Path, default=None,
                   help="study config, YAML or JSON (default: the built-in study; docs/layout.md, 'Study')")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default: {DEFAULT_OUT}; with --workload, {DEFAULT_OUT}_<file stem>)")
    p.add_argument("--quick", action="store_true", help="the tests' small study (with CONFIG: its fields override)")
    p.add_argument("--workload", type=Path, default=None, metavar="FILE",
                   help="study your own requests only: a messages file (JSONL, OpenAI chat shape; docs/layout.md, "
                        "'Messages file'); CONFIG, if given, sets the cache sizes, model and hardware")
    p.add_argument("--layouts", default=None, metavar="A,B,...",
                   help="with --workload: the layouts, comma-separated (a transform name, 'a+b' composes; default: "
                        f"{','.join(DEFAULT_WORKLOAD_LAYOUTS)})")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="tokenizer that renders the prompts (a load_tokenizer spec: kvlab-bpe, tekken, a folder...; "
                        "default: the config's tokenizer, kvlab-bpe)")
    p.add_argument("--no-resume", action="store_true", help="recompute even where matching results exist")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_layout_study)


def parse_layouts(text: str) -> list[str]:
    """``--layouts``: comma-separated layout names, each a transform name or ``as_generated`` (``a+b`` composes);
    ConfigError, one line naming the flag and listing the known names, for an unknown, empty or repeated one."""
    from kvlab.errors import ConfigError
    from kvlab.layout.registry import TRANSFORMS

    known = ["as_generated", *sorted(TRANSFORMS)]
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if not n:
            raise ConfigError(f"--layouts: an empty layout name in {text!r} (known: {', '.join(known)})")
        steps = [s.strip() for s in n.split("+")]
        bad = next((s for s in steps if s not in known), None)
        if bad is not None:
            raise ConfigError(f"--layouts: unknown layout {bad!r} (known: {', '.join(known)})")
        if len(steps) > 1 and "as_generated" in steps:
            raise ConfigError(f"--layouts: {n!r}: as_generated is no transform to compose ('a+b' joins transforms)")
    twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
    if twice is not None:
        raise ConfigError(f"--layouts: {twice!r} is named twice")
    return names


def workload_config(args: argparse.Namespace) -> LayoutStudyConfig:
    """The study of ``--workload``: its requests only (family :data:`WORKLOAD_FAMILY`), ``--layouts``, no boundary
    sweep; cache sizes, model, hardware, policy and seed from CONFIG if given, else the defaults with one cache size,
    the device's pool as vLLM sizes it."""
    from kvlab.errors import ConfigError
    from kvlab.layout.config import LayoutStudyConfig

    if args.quick:
        raise ConfigError("--quick: not with --workload (it shrinks the built-in families; --workload studies your "
                          "requests as they are)")
    layouts = parse_layouts(args.layouts) if args.layouts is not None else list(DEFAULT_WORKLOAD_LAYOUTS)
    base = LayoutStudyConfig.load(args.config).model_dump() if args.config is not None else {"cache_blocks": [None]}
    fields = {**base, "common_layouts": layouts, "boundary": None, "answers": {},
              "families": {WORKLOAD_FAMILY: {"family": "messages", "config": {"path": str(args.workload)}}}}
    if args.tokenizer is not None:
        fields["tokenizer"] = args.tokenizer
    return LayoutStudyConfig.parse(fields, str(args.config) if args.config is not None else "--workload")


def cmd_layout_study(args: argparse.Namespace) -> int:
    """Run the study into ``--out`` and print the per-family gap between the best and worst layout (with
    ``--workload``: one line per layout, and the figure)."""
    from kvlab.errors import ConfigError
    from kvlab.layout.config import LayoutStudyConfig
    from kvlab.layout.study import run_study

    if args.workload is not None:
        return _workload_study(args)
    if args.layouts is not None:
        raise ConfigError("--layouts: only with --workload (a study config sets its layouts: common_layouts, "
                          "families.<name>.layouts)")
    if args.config is not None:
        config = LayoutStudyConfig.load(args.config)
        if args.quick:
            config = LayoutStudyConfig.quick(**config.model_dump(exclude_defaults=True))
    else:
        config = LayoutStudyConfig.quick() if args.quick else LayoutStudyConfig()
    if args.tokenizer is not None:
        config = LayoutStudyConfig.parse({**config.model_dump(exclude_defaults=True), "tokenizer": args.tokenizer},
                                         "--tokenizer")
    out = args.out if args.out is not None else DEFAULT_OUT
    result = run_study(out, config, resume=not args.no_resume, progress=not args.quiet)
    print(f"layout study: {len(result.runs)} runs ({result.runs['family'].nunique()} families) in {out}")
    for g in result.gaps.itertuples(index=False):
        print(f"{g.family:<14} cache {g.cache:<13} hit rate best {g.best_hit_rate:.3f} ({g.best_hit_layout}) "
              f"worst {g.worst_hit_rate:.3f} ({g.worst_hit_layout}); mean TTFT best {g.best_ttft_mean_s * 1e3:.1f} ms "
              f"({g.best_ttft_layout}) worst {g.worst_ttft_mean_s * 1e3:.1f} ms ({g.worst_ttft_layout})")
    _warn_rejected(result.runs)
    if config.boundary is not None:
        exact = bool((result.boundary["hit_tokens"] == result.boundary["kept_tokens"]).all())
        print(f"block boundary: {result.boundary['position'].nunique()} positions x "
              f"{result.boundary['block_size'].nunique()} block sizes; hits = floor(p / B) * B everywhere: {exact}")
    print(f"answers: {result.answers['status']} ({result.answers['reason']})")
    return 0


def _warn_rejected(runs: pd.DataFrame) -> None:
    rejected = runs.groupby(["family", "cache"], sort=False)["rejected_requests"].max()
    for (family, cache), n in rejected[rejected > 0].items():
        print(f"warning: {family}, cache {cache}: up to {n} requests rejected (a prompt needs more blocks than the "
              "cache holds; their TTFT is missing)")


def _workload_study(args: argparse.Namespace) -> int:
    """``--workload``: check everything (config, layouts, tokenizer, the file's every line, the folder and the
    figure's names) before any work, run the study, print one line per layout, save the figure."""
    from kvlab.layout.plots import plot_workload, workload_data
    from kvlab.layout.report import layout_finding, layout_lines
    from kvlab.layout.study import check_out, run_study
    from kvlab.plots import style
    from kvlab.results.owned import check_folder
    from kvlab.workload.messages import file_sha256

    config = workload_config(args)
    out = args.out if args.out is not None else Path(f"{DEFAULT_OUT}_{args.workload.stem}")
    check_out(out, config)
    check_folder(out, flag="--out", names=style.save_names(FIGURE))
    result = run_study(out, config, resume=not args.no_resume, progress=not args.quiet)
    n = int(result.runs["requests"].iloc[0])
    tok = result.summaries[WORKLOAD_FAMILY]["tokenizer"]
    caches = ", ".join(f"{c} ({b:,} blocks)" if c == "device pool" else c
                       for c, b in dict(zip(result.runs["cache"], result.runs["cache_blocks"], strict=True)).items())
    print(f"layout study of {args.workload}: {n} requests, tokenizer {tok['tokenizer']}, {config.model} on "
          f"{config.hardware}, cache {caches} of {config.block_size} tokens each, results in {out}")
    for line in layout_lines(result, WORKLOAD_FAMILY):
        print(line)
    _warn_rejected(result.runs)
    data = workload_data(result.runs, result.requests, WORKLOAD_FAMILY)
    fig = plot_workload(data, f"{args.workload.name}: {n} requests per layout")
    cap = style.caption(layout_finding(result, WORKLOAD_FAMILY), config=config.to_dict(),
                        messages_file={"path": str(args.workload), "sha256": file_sha256(args.workload),
                                       "requests": n},
                        tokenizer=tok)
    paths = style.save(fig, out, FIGURE, data=data, caption=cap)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"figure: {paths[0]} (+ .pdf, .parquet data, .json caption)")
    return 0
