"""Helpers of every ``kvlab`` command (kvlab.cli, kvlab.cli_replay): the trace selection, loading, policy
parameters and flag-named errors."""

from __future__ import annotations

import argparse
import json

from kvlab.errors import ConfigError
from kvlab.schema import TRACE_FORMATS as FORMATS  # noqa: F401 - the CLI's --format choices


def selection(trace: str, args: argparse.Namespace):
    """The validated trace selection (path or name, format, --limit): checked before anything is read."""
    from kvlab.schema import TraceSelection

    return TraceSelection(trace=str(trace), format=args.format, limit=args.limit)


def load(args: argparse.Namespace, trace: str | None = None):
    """Load ``trace`` (default: ``args.trace``) and keep its first ``--limit`` requests."""
    from kvlab.workload import load_trace

    sel = selection(trace if trace is not None else args.trace, args)
    workload = load_trace(sel.trace, format=sel.format)
    return workload.head(sel.limit) if sel.limit is not None else workload


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
