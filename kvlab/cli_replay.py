"""``kvlab replay`` and ``kvlab sweep``: their flags, the checks made before any work, and the printed table.

:mod:`kvlab.cli` builds the parser and dispatches; this module declares the run flags (:func:`add_run_args`)
and runs the two commands. Tiers (docs/tiers.md): ``--tier SPEC`` is repeatable, one lower tier each, in
order below the device; comma-separated values of ``blocks=`` or ``gib=`` make a sweep axis (one run per
combination of every flag's values). Units: capacities in blocks (``--capacity-gib`` and ``gib=`` in GiB of KV
for ``--model``, rounded down to whole blocks as an experiment file's ``capacity_gib``), ``--max-load-tokens`` in
tokens.
"""

from __future__ import annotations

import argparse
import itertools
from typing import TYPE_CHECKING

from kvlab.errors import ConfigError
from kvlab.tiers.spec import SPEC_HELP

if TYPE_CHECKING:
    from kvlab.tiers import Tier

#: ``--tier`` keys that take comma-separated values (a sweep axis)
AXIS_KEYS = ("blocks", "gib")


def add_run_args(sp: argparse.ArgumentParser) -> None:
    """The flags of one replay configuration (``kvlab replay``, ``kvlab sweep``)."""
    size = sp.add_mutually_exclusive_group(required=True)
    size.add_argument("--capacity-blocks", type=int, nargs="+", help="cache capacity in blocks (several: a sweep axis)")
    size.add_argument("--capacity-gib", type=float, nargs="+", metavar="GIB",
                      help="cache capacity in GiB of KV of --model, rounded down to whole blocks (as an experiment "
                           "file's cache.capacity_gib; the run is the same as its --capacity-blocks)")
    sp.add_argument("--policy", nargs="+", default=["lru"],
                    help="eviction policy name(s) (kvlab policies), or 'all'")
    sp.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="policy constructor argument (repeatable; JSON values)")
    sp.add_argument("--mode", nargs="+", default=["vllm"], choices=["vllm", "ideal"], help="hit counting mode")
    sp.add_argument("--backend", "--engine", dest="backend", default="auto", choices=["auto", "compiled", "python"],
                    help="replay backend: the numba kernel (compiled), the Python core, or auto (compiled when "
                         "the policy has a compiled form); --engine is the old name")
    sp.add_argument("--tier", action="append", default=[], metavar="SPEC",
                    help=f"a tier below the device, repeatable, in order (docs/tiers.md): {SPEC_HELP}, or gib=X "
                         "instead of blocks=N (needs --model); selective=K alone means "
                         "write=write_through_selective; blocks=1000,10000 sweeps the size")
    sp.add_argument("--max-load-tokens", type=int, default=None, metavar="N",
                    help="at most N tokens of a request are loaded from the lower tiers (the rest recomputed; "
                         "default: no limit); needs --tier")
    sp.add_argument("--model", default=None,
                    help="model profile (shipped name or config.json path, as kvlab simulate --model): the KV "
                         "bytes per block for --capacity-gib, --tier gib= sizes and the tiers' bytes written and "
                         "read (refused when nothing uses it)")
    sp.add_argument("--verify", action="store_true", help="verify tokens on hit: count and refuse collisions")
    sp.add_argument("--root-seed", type=int, default=0)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--no-resume", action="store_true", help="redo sweep runs already on disk")
    sp.add_argument("--quiet", action="store_true")


# ----------------------------------------------------------------------------- tiers
def _values(text: str, flag: str) -> list[str]:
    """``text`` with its comma-separated ``blocks=`` / ``gib=`` values expanded: one spec per value."""
    name, _, rest = text.partition(":")
    items = rest.split(":") if rest else []
    choices: list[list[str]] = []
    for item in items:
        key, sep, value = item.partition("=")
        if sep and "," in value:
            if key not in AXIS_KEYS:
                raise ConfigError(f"{flag} {text!r}: only blocks= and gib= take several comma-separated values, "
                                  f"got {item!r}")
            choices.append([f"{key}={v}" for v in value.split(",")])
        else:
            choices.append([item])
    return [":".join([name, *combo]) for combo in itertools.product(*choices)]


def tier_axes(specs: list[str], flag: str = "--tier", max_load_tokens: int | None = None) -> list[list[Tier]]:
    """The tier lists of a run grid from the ``--tier`` values: each flag's values (comma-separated sizes)
    times every other flag's. ``[[]]`` without ``--tier``. Every list obeys kvlab.tiers.check_tiers (with
    ``--max-load-tokens``), as every backend requires. ConfigError naming ``flag`` and the bad part."""
    from kvlab.schema import flag as flag_of
    from kvlab.tiers import check_tiers, parse_tier

    per_flag = [[parse_tier(spec, flag) for spec in _values(text, flag)] for text in specs]
    combos = [list(c) for c in itertools.product(*per_flag)] or [[]]
    for tiers in combos:
        check_tiers(tiers, max_load_tokens=max_load_tokens, field=flag_of)
    return combos


def _check_model(args: argparse.Namespace, axes: list[list[Tier]]) -> None:
    """``--model`` names a known profile and something uses it (``--capacity-gib`` or ``--tier``); a ``gib=``
    tier or ``--capacity-gib`` has one (``--max-load-tokens``: tier_axes)."""
    from kvlab.cli_common import check_capacity_gib, flagged
    from kvlab.profiles import load_model

    if args.model is not None:
        if not args.tier and args.capacity_gib is None:  # dropped from every run (kvlab.sweep.grid): refused
            raise ConfigError("--model gives the tiers' KV bytes per block (gib= sizes, bytes written and read) and "
                              "converts --capacity-gib; nothing uses it here: give --tier too, or --capacity-gib "
                              "instead of --capacity-blocks")
        flagged("--model", load_model, args.model)
    check_capacity_gib(args.command, args.capacity_gib, args.model)
    for text in args.tier:
        if args.model is None and any(v.partition("=")[0] == "gib" for v in text.split(":")[1:]):
            raise ConfigError(f"--tier {text!r}: gib= needs --model (the model profile gives the KV bytes per "
                              "block)")
    if args.model is not None and args.block_size is not None:  # gib= sizes in range, before the trace is read
        from kvlab.profiles import resolve_tiers

        for tiers in axes:
            flagged("--tier", resolve_tiers, tiers, args.model, args.block_size)


# ----------------------------------------------------------------------------- commands
def capacities(args: argparse.Namespace, block_size: int | None = None) -> list[int] | None:
    """The capacities in blocks: ``--capacity-blocks``, or ``--capacity-gib`` converted with ``--block-size``
    (else ``block_size``, the trace's); None while the block size is not known (the trace not read yet)."""
    from kvlab.cli_common import gib_blocks

    if args.capacity_gib is None:
        return args.capacity_blocks
    bs = args.block_size or block_size
    return None if bs is None else gib_blocks(args.capacity_gib, args.model, bs)


def replay_configs(args: argparse.Namespace, block_size: int | None = None) -> list:
    """The run grid of ``kvlab replay`` / ``kvlab sweep``: every flag checked, nothing read yet.
    ``block_size``: the trace's, for ``--capacity-gib`` without ``--block-size`` (before the trace is read,
    the grid is checked with 1-block capacities in their place)."""
    from kvlab.cli_common import policy_params
    from kvlab.policies import available_policies
    from kvlab.sweep import grid

    axes = tier_axes(args.tier, max_load_tokens=args.max_load_tokens)
    _check_model(args, axes)
    caps = capacities(args, block_size)
    return grid(
        caps if caps is not None else [1] * len(args.capacity_gib),
        policies=available_policies() if args.policy == ["all"] else args.policy,
        policy_params=policy_params(args.policy_param),
        modes=args.mode,
        tiers=axes,
        max_load_tokens=args.max_load_tokens,
        model=args.model,
        block_size=args.block_size,
        hash=args.hash,
        root_seed=args.root_seed,
        backend=args.backend,
        verify=args.verify,
        seed=args.seed,
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from kvlab.cli_common import load, selection
    from kvlab.replay import replay
    from kvlab.results import check_output_location
    from kvlab.sweep import run_sweep, tier_row

    selection(args.trace, args)
    configs = replay_configs(args)  # every parameter checked before the trace is read
    single = len(configs) == 1
    if args.out:
        check_output_location(args.out, kind="run" if single else "sweep")
    workload = load(args)
    if args.capacity_gib is not None:
        configs = _gib_configs(args, [workload])
    if single:
        result = replay(workload, configs[0], progress=not args.quiet)
        if args.out:
            result.save(args.out)
        print_summary([{"trace": workload.name, **result.summary, **tier_row(result.summary)}])
    else:
        table = run_sweep(workload, configs, args.out, resume=not args.no_resume, progress=not args.quiet)
        print_summary(table.to_dict("records"))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """Every trace x policy x capacity x mode x tier sizes; one folder per trace (a safe name) plus a
    combined table."""
    from kvlab.cli_common import load, refuse_unused_tokenizer, selection
    from kvlab.results import check_output_location
    from kvlab.sweep import run_sweeps

    for trace in args.traces:
        selection(trace, args)
    configs = replay_configs(args)
    check_output_location(args.out, kind="sweeps")
    workloads = [load(args, trace, refuse_unused=False) for trace in args.traces]  # all checked before any run
    if args.tokenizer is not None and not args.tokenizer_used:
        refuse_unused_tokenizer(args.tokenizer, args.traces)
    if args.capacity_gib is not None:
        configs = _gib_configs(args, workloads)
    table = run_sweeps(workloads, configs, args.out, resume=not args.no_resume, progress=not args.quiet)
    print_summary(table.to_dict("records"))
    print(f"results written to {args.out}")
    return 0


def _gib_configs(args: argparse.Namespace, workloads: list) -> list:
    """The run grid with ``--capacity-gib`` in blocks of the traces' block size (one for all of them: traces
    whose block sizes differ need ``--block-size``); prints what each value became."""
    from kvlab.cli_common import gib_note

    sizes = {args.block_size or w.default_block_size: w.name for w in workloads}
    if len(sizes) > 1:
        which = ", ".join(f"{name} ({bs} tokens)" for bs, name in sizes.items())
        raise ConfigError(f"--capacity-gib: the traces' block sizes differ ({which}): give --block-size")
    bs = next(iter(sizes))
    configs = replay_configs(args, bs)
    print(gib_note(args.capacity_gib, capacities(args, bs), args.model, bs))
    return configs


def _missing(v: object) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def print_summary(rows: list[dict], extra: list[str] | tuple[str, ...] = ()) -> None:
    """One line per run; with tiers, the device's hit rate and each tier's hit share and size (a share of
    all prompt tokens: device + tiers = token_hit_rate). Rejected requests (larger than the cache, never
    served) always shown. ``extra``: further columns shown after the trace (an experiment's sweep axes)."""
    cols = ["trace", "policy", "capacity_blocks", "mode", "token_hit_rate", "block_hit_rate", "request_hit_rate",
            "ideal_hit_rate", "evictions", "rejected_requests", "replay_seconds"]
    tiered = ["device_token_hit_rate"]
    for row in rows:
        for key in row:
            if key.endswith(("_hit_share", "_capacity_blocks")) and key != "capacity_blocks" and key not in tiered:
                tiered.append(key)
    cols = cols[:1] + list(extra) + [c for c in cols[1:] if c not in extra]  # e.g. an experiment's axes, in order
    cols = [c for c in cols + tiered if any(not _missing(row.get(c)) for row in rows)]
    widths = [max(15, len(c)) for c in cols]
    print("  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        cells = []
        for c, w in zip(cols, widths, strict=True):
            v = row.get(c)
            if isinstance(v, float) and c.endswith("_capacity_blocks") and v == v:
                v = int(v)  # a table column with gaps (runs without that tier) is float
            cells.append("-".rjust(w) if _missing(v) else f"{v:>{w}.4f}" if isinstance(v, float) else f"{v!s:>{w}}")
        print("  ".join(cells))
    notes = dict.fromkeys(  # one line per distinct note: the policies of one trace and capacity reject alike
        f"note: {row['rejected_requests']:,} of {row.get('requests', '?'):,} requests rejected at capacity "
        f"{row.get('capacity_blocks')} blocks (a prompt larger than the cache is never served; hit rates count their "
        "prompt tokens as misses)" for row in rows if row.get("rejected_requests"))
    for note in notes:
        print(note)
