"""A trace loaded with a tokenizer spec: ``--tokenizer`` on the CLI, ``trace.tokenizer`` in experiment files.

A text trace (kvlab native JSONL or Parquet records with ``text``, a ``messages`` file) is tokenised while it
loads; a token or hash trace needs no tokenizer. :func:`load_trace_with` loads any trace:

* an explicit spec is loaded (:func:`~kvlab.workload.tokenizer.load_tokenizer`) before the trace is read,
  so a bad spec is one line naming the flag or field before any work;
* no spec means ``kvlab-bpe`` for text, loaded only when the trace holds some (a hash trace costs nothing
  and loads exactly as it always did).

When the tokenizer tokenised text, its identity (name, vocabulary and template sha256) goes to the
workload's ``meta["tokenizer"]`` (so every manifest's trace records it). The run id follows the token ids the
tokenizer produced (``content_sha256``): another tokenizer is another run; a trace without text keeps its
run ids whatever the spec.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from kvlab.errors import ConfigError
from kvlab.workload.tokenizer import TextTokenizer, load_tokenizer, tokenizer_cache_dir
from kvlab.workload.workload import Workload

#: formats whose loaders call only ``tokenizer.encode(text)`` (they get :class:`OnFirstText`)
ENCODE_ONLY_FORMATS = ("jsonl", "parquet")


@functools.lru_cache(maxsize=4)
def _cached(spec: str | None, folder: str) -> TextTokenizer:
    return load_tokenizer(spec, cache_dir=folder)


def trace_tokenizer(spec: str | None, field: str = "--tokenizer") -> TextTokenizer:
    """The tokenizer of ``spec`` (None: kvlab-bpe), loaded once per process and tokenizer folder; its
    ConfigError prefixed with ``field`` (the flag or experiment field that named it)."""
    if spec is not None and (not isinstance(spec, str) or not spec):
        raise ConfigError(f"{field}: expected a tokenizer spec (a name or a path), got {spec!r}")
    try:
        return _cached(spec, str(tokenizer_cache_dir()))
    except ConfigError as exc:
        raise ConfigError(f"{field}: {exc}") from None


class OnFirstText:
    """The tokenizer a native loader gets: ``encode`` loads the spec's tokenizer at the first text it meets
    (:func:`trace_tokenizer`) and records that it did (``used``)."""

    def __init__(self, spec: str | None, field: str, tokenizer: TextTokenizer | None = None) -> None:
        self.spec, self.field, self._tokenizer = spec, field, tokenizer
        self.used = False

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = trace_tokenizer(self.spec, self.field)
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the tokenizer's special tokens added as its ``encode`` does)."""
        tok = self.tokenizer
        self.used = True
        return tok.encode(text, add_special_tokens=add_special_tokens)


def load_trace_with(
    trace: str | os.PathLike,
    *,
    format: str | None = None,
    tokenizer: str | None = None,
    field: str = "--tokenizer",
) -> tuple[Workload, bool]:
    """``(workload, used)``: ``trace`` loaded as :func:`~kvlab.workload.load_trace` does, its text tokenised
    with ``tokenizer`` (a spec; None: kvlab-bpe when there is text); ``used``: whether any text was.

    A format whose loader takes no tokenizer (Mooncake, Alibaba, request logs) is loaded as before; an
    explicit spec is still loaded first (checked) and then unused. Errors about the spec name ``field``."""
    from kvlab.workload.load import LOADERS, load_trace
    from kvlab.workload.registry import TRACES, resolve_trace

    explicit = trace_tokenizer(tokenizer, field) if tokenizer is not None else None
    key = os.fsdecode(trace) if isinstance(trace, str | os.PathLike) else trace
    if format is None and isinstance(key, str) and key in TRACES and not os.path.isfile(key):
        fmt = TRACES[key]["format"]  # a registry trace: its format without fetching or hashing it twice
    else:
        fmt = resolve_trace(trace, format=format)[1]
    loader = LOADERS.get(fmt)
    if loader is None or "tokenizer" not in _keyword_options(loader):
        return load_trace(trace, format=format), False
    if fmt in ENCODE_ONLY_FORMATS:
        lazy = OnFirstText(tokenizer, field, explicit)
        workload = load_trace(trace, format=format, tokenizer=lazy)
        if lazy.used:  # the tokenizer that made these ids (a header's claim is replaced)
            workload.meta = {**workload.meta, "tokenizer": lazy.tokenizer.identity()}
        return workload, lazy.used
    # a loader that renders text itself (messages): the tokenizer, or None for its own default (kvlab-bpe,
    # loaded after it checked the file); it records the identity itself
    workload = load_trace(trace, format=format, tokenizer=explicit)
    if explicit is not None and "tokenizer" not in workload.meta:
        workload.meta = {**workload.meta, "tokenizer": explicit.identity()}
    return workload, True


def _keyword_options(loader: Any) -> set[str]:
    import inspect

    return {n for n, p in inspect.signature(loader).parameters.items() if p.kind is p.KEYWORD_ONLY}


__all__ = ["OnFirstText", "load_trace_with", "trace_tokenizer"]
