"""One entry point for every trace: ``load_trace(name_or_path, format=None, **kw)``."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from kvlab.errors import ConfigError
from kvlab.workload.alibaba import load_alibaba
from kvlab.workload.messages import load_messages_trace
from kvlab.workload.mooncake import load_mooncake
from kvlab.workload.native_jsonl import load_jsonl
from kvlab.workload.native_parquet import load_parquet
from kvlab.workload.registry import TRACES, resolve_trace
from kvlab.workload.request_log import load_request_log
from kvlab.workload.workload import Workload

LOADERS: dict[str, Callable[..., Workload]] = {
    "mooncake": load_mooncake,
    "alibaba": load_alibaba,
    "jsonl": load_jsonl,
    "parquet": load_parquet,
    "request-log": load_request_log,
    "messages": load_messages_trace,
}


def load_trace(name_or_path: str | os.PathLike, format: str | None = None, **kw: object) -> Workload:
    """Load a registry trace by name (downloading it if no local copy exists) or a file by path.

    ``format`` is one of ``mooncake``, ``alibaba``, ``jsonl`` (kvlab native), ``parquet``, ``request-log``
    (a serving log with token ids, :mod:`kvlab.workload.request_log`), ``messages`` (a researcher's requests in
    the OpenAI chat shape, rendered with ``tokenizer=``: :mod:`kvlab.workload.messages`); by default it
    is the registry's format for a name, else detected from the file name, Parquet magic bytes or the
    first line's keys. ``kw`` goes to the loader (``name``, ``block_size``, ``sort``, ``tokenizer``...).
    A registry trace is named after its registry key unless ``name`` is given.

    Every user mistake raises a :class:`~kvlab.errors.KvlabError` before any work: an unknown format or
    loader option (:class:`ConfigError`), an unknown trace name (with the closest match), a path that is
    a directory or unreadable (:class:`TraceFileError`), a malformed file (:class:`TraceFormatError`
    naming file, line and field) or a registry copy whose checksum differs (:class:`ChecksumError`).
    """
    path, fmt = resolve_trace(name_or_path, format=format)
    loader = LOADERS[fmt]
    accepted = [n for n, prm in inspect.signature(loader).parameters.items() if prm.kind is prm.KEYWORD_ONLY]
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise ConfigError(
            f"the {fmt} loader takes no option {unknown[0]!r} (its options: {', '.join(accepted)})"
        )
    key = os.fsdecode(name_or_path)
    if key in TRACES and "name" not in kw:
        kw["name"] = key
    return loader(path, **kw)
