"""Helpers of every ``kvlab`` command (kvlab.cli, kvlab.cli_replay): the trace selection, loading, policy
parameters and flag-named errors."""

from __future__ import annotations

import argparse
import json
import re

from kvlab.errors import ConfigError
from kvlab.schema import TRACE_FORMATS as FORMATS  # noqa: F401 - the CLI's --format choices


def selection(trace: str, args: argparse.Namespace):
    """The validated trace selection (path or name, format, --limit): checked before anything is read."""
    from kvlab.schema import TraceSelection

    return TraceSelection(trace=str(trace), format=args.format, limit=args.limit)


def load(args: argparse.Namespace, trace: str | None = None, *, refuse_unused: bool = True):
    """Load ``trace`` (default: ``args.trace``), its text tokenised with ``--tokenizer`` (default kvlab-bpe,
    loaded only for text: kvlab.workload.trace_tokenizer), and keep its first ``--limit`` requests.

    ``args.tokenizer_used`` becomes True once a load tokenised text. An explicit ``--tokenizer`` that this
    load did not use is refused (one line: nothing uses it) unless ``refuse_unused`` is False (``kvlab sweep``
    checks that some trace used it)."""
    from kvlab.workload.trace_tokenizer import load_trace_with

    sel = selection(trace if trace is not None else args.trace, args)
    spec = getattr(args, "tokenizer", None)
    workload, used = load_trace_with(sel.trace, format=sel.format, tokenizer=spec)
    args.tokenizer_used = used or bool(getattr(args, "tokenizer_used", False))
    if spec is not None and refuse_unused and not used:
        refuse_unused_tokenizer(spec, [sel.trace])
    return workload.head(sel.limit) if sel.limit is not None else workload


def refuse_unused_tokenizer(spec: str, traces: list[str]) -> None:
    """``--tokenizer`` given but no trace held text: one ConfigError line (as ``--model`` with nothing using it)."""
    which = ", ".join(str(t) for t in traces)
    raise ConfigError(f"--tokenizer {spec}: {which} holds no text (its prompts are token ids or block hashes); "
                      "nothing uses the tokenizer: leave --tokenizer out")


def policy_params(items: list[str]) -> dict:
    """``key=value`` pairs; values parsed as JSON where possible (numbers, lists), else kept as text."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--policy-param expects KEY=VALUE, got {item!r}")
        if key in params:
            raise ConfigError(f"--policy-param: {key!r} given twice")
        try:
            params[key] = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            params[key] = value
    return params


def flagged(flag: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its ConfigError prefixed with the flag whose value it checks."""
    try:
        return fn(*args, **kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def check_capacity_gib(command: str, values: list[float] | None, model: str | None) -> None:
    """``--capacity-gib``: each value in (0, 2**30] GiB and finite (the type of an experiment file's
    ``cache.capacity_gib``), and a model to convert with; checked before anything is read."""
    if values is None:
        return
    from kvlab.experiment.sections import CacheSpec
    from kvlab.schema import validate_fields

    gib = CacheSpec.model_fields["capacity_gib"].annotation
    for value in values:
        validate_fields(command, capacity_gib=(gib, value))
    if model is None:
        raise ConfigError("--capacity-gib: GiB of KV need a model to convert to blocks: give --model (a shipped "
                          "name such as llama-3-8b, or a config.json)")


def gib_blocks(values: list[float], model: str, block_size: int) -> list[int]:
    """``--capacity-gib`` values as whole blocks of ``block_size`` tokens of ``model``'s KV: the conversion of an
    experiment file's ``cache.capacity_gib`` (kvlab.experiment.sections.capacity_blocks: 2**30 bytes per GiB,
    rounded down); less than one block is a ConfigError naming the flag."""
    from kvlab.experiment.sections import CacheSpec, capacity_blocks

    out = []
    for value in values:
        try:
            out.append(capacity_blocks(CacheSpec(capacity_gib=value), block_size, model))
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("cache.capacity_gib", "--capacity-gib", 1)) from None
    return out


def gib_note(values: list[float], blocks: list[int], model: str, block_size: int) -> str:
    """The line saying what ``--capacity-gib`` became: ``--capacity-gib 0.5 = 256 blocks ...``."""
    pairs = ", ".join(f"{v:g} GiB = {b:,} blocks" for v, b in zip(values, blocks, strict=True))
    return f"--capacity-gib: {pairs} ({block_size}-token blocks of {model} KV, rounded down)"


def plain(text: str | None) -> str | None:
    """``text`` (a docstring) as plain text for ``--help``: Sphinx roles (``:mod:`x```) and double or single
    backticks dropped, their contents kept."""
    if text is None:
        return None
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``?([^`]+?)``?", r"\1", text)


def plain_help(parser: argparse.ArgumentParser) -> None:
    """Every description, epilog and help text of ``parser`` and its subcommands as :func:`plain` text."""
    parser.description, parser.epilog = plain(parser.description), plain(parser.epilog)
    for action in parser._actions:
        if isinstance(action.help, str) and action.help != argparse.SUPPRESS:
            action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help)
            for sub in {id(p): p for p in action.choices.values()}.values():
                plain_help(sub)
