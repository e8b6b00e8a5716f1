"""The columnar request stream every driver consumes.

A :class:`Workload` holds one row per request, in arrival order. Prompts are stored in CSR form
(``prompt_offsets`` into one flat ``prompt_values`` array) as either

* ``kind == "blocks"``: block ids of ``block_size`` tokens each (hash traces such as Mooncake or Alibaba),
  already *chained* (an id identifies the block and its whole prefix), ``ceil(input_length / block_size)``
  ids per request, the last block possibly partial; or
* ``kind == "tokens"``: token ids, ``input_length`` of them per request.

Units: ``arrival`` in seconds from trace start; lengths in tokens. Optional per-request columns use
``-1`` (ints) or ``None`` (categoricals) for "absent". A 10 M-request hash trace with ~24 blocks each takes
about 2 GB (int64 ids) plus ~60 bytes per request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvlab.arguments import require_instance
from kvlab.errors import ConfigError
from kvlab.workload.segments import Segment, Segments

PromptKind = str  # "blocks" | "tokens"
#: tokens per block of a token trace when none is given (vLLM's default); hash traces use their own
DEFAULT_BLOCK_SIZE = 16
CATEGORICAL_COLUMNS = ("tenant", "category", "adapter", "salt")
INT_COLUMNS = ("request_id", "session", "turn", "parent")


@dataclass(eq=False)
class Workload:
    """A request stream in arrival order (see module docstring for the invariants)."""

    arrival: np.ndarray  # float64 [n], seconds, non-decreasing
    input_length: np.ndarray  # int64 [n], prompt tokens
    output_length: np.ndarray  # int64 [n], output tokens
    prompt_offsets: np.ndarray  # int64 [n + 1], CSR offsets into prompt_values
    prompt_values: np.ndarray  # int64 [total], chained block ids or token ids
    kind: PromptKind = "tokens"
    block_size: int | None = None  # tokens per block id (kind == "blocks" only)
    request_id: np.ndarray | None = None  # int64 [n], original ids (default 0..n-1)
    session: np.ndarray | None = None  # int64 [n], -1 = no session
    turn: np.ndarray | None = None  # int64 [n], 1-based, -1 = unknown
    parent: np.ndarray | None = None  # int64 [n], row index of the previous turn, -1 = none
    tenant: pd.Categorical | None = None
    category: pd.Categorical | None = None  # request type (e.g. text/search/image/file)
    adapter: pd.Categorical | None = None  # LoRA/adapter id, part of every block key
    salt: pd.Categorical | None = None  # cache_salt, part of the first block key only
    output_offsets: np.ndarray | None = None  # int64 [n + 1], CSR of known output token ids (token traces)
    output_values: np.ndarray | None = None
    segments: Segments | None = None  # tagged token spans of each prompt (kvlab.workload.segments)
    name: str = "workload"
    source: str | None = None  # path or URL it was loaded from
    checksum: str | None = None  # sha256 of the source file(s)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.arrival)
        self.arrival = np.ascontiguousarray(self.arrival, dtype=np.float64)
        self.input_length = np.ascontiguousarray(self.input_length, dtype=np.int64)
        self.output_length = np.ascontiguousarray(self.output_length, dtype=np.int64)
        self.prompt_offsets = np.ascontiguousarray(self.prompt_offsets, dtype=np.int64)
        self.prompt_values = np.ascontiguousarray(self.prompt_values, dtype=np.int64)
        if self.request_id is None:
            self.request_id = np.arange(n, dtype=np.int64)
        for name in INT_COLUMNS:
            col = getattr(self, name)
            if col is not None:
                setattr(self, name, np.ascontiguousarray(col, dtype=np.int64))
        for name in CATEGORICAL_COLUMNS:
            col = getattr(self, name)
            if col is not None and not isinstance(col, pd.Categorical):
                setattr(self, name, pd.Categorical(col))
        if self.segments is not None and not isinstance(self.segments, Segments):
            self.segments = Segments.from_lists(self.segments)  # one list of (kind, start, end[, text]) per request
        self.validate()

    # ------------------------------------------------------------------ structure
    def __len__(self) -> int:
        return len(self.arrival)

    def validate(self) -> None:
        """Check the structural invariants; raise ConfigError naming the column that breaks one."""
        n = len(self)
        if self.kind not in ("blocks", "tokens"):
            raise ConfigError(f"Workload.kind must be 'blocks' or 'tokens', got {self.kind!r}")
        if self.kind == "blocks" and (self.block_size is None or self.block_size <= 0):
            raise ConfigError("Workload.block_size must be a positive int for kind='blocks'")
        for name in ("input_length", "output_length"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"Workload.{name} has {len(getattr(self, name))} rows, expected {n}")
        if len(self.prompt_offsets) != n + 1 or (n and self.prompt_offsets[0] != 0):
            raise ConfigError("Workload.prompt_offsets must have n+1 entries starting at 0")
        if self.prompt_offsets[-1] != len(self.prompt_values):
            raise ConfigError("Workload.prompt_offsets[-1] must equal len(prompt_values)")
        counts = np.diff(self.prompt_offsets)
        if np.any(counts < 0):
            raise ConfigError("Workload.prompt_offsets must be non-decreasing")
        if np.any(self.input_length < 0) or np.any(self.output_length < 0):
            raise ConfigError("Workload lengths must be >= 0")
        expected = self.expected_prompt_values(self.input_length)
        bad = np.flatnonzero(counts != expected)
        if len(bad):
            i = int(bad[0])
            raise ConfigError(
                f"Workload request row {i}: {counts[i]} prompt values, expected {expected[i]} for "
                f"input_length {self.input_length[i]} ({self.kind}, block_size {self.block_size})"
            )
        if not np.all(np.isfinite(self.arrival)):
            i = int(np.flatnonzero(~np.isfinite(self.arrival))[0])
            raise ConfigError(f"Workload.arrival row {i} is {self.arrival[i]} (arrival times must be finite seconds)")
        if n > 1 and np.any(np.diff(self.arrival) < 0):
            i = int(np.flatnonzero(np.diff(self.arrival) < 0)[0]) + 1
            raise ConfigError(f"Workload.arrival goes backwards at row {i}")
        for name in INT_COLUMNS + CATEGORICAL_COLUMNS:
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise ConfigError(f"Workload.{name} has {len(col)} rows, expected {n}")
        if self.segments is not None:
            self.segments.validate(self.input_length)

    def expected_prompt_values(self, input_length: np.ndarray) -> np.ndarray:
        """Prompt values per request implied by ``input_length``.

        Block ids: ``ceil(input_length / block_size)``; tokens: ``input_length``.
        """
        if self.kind == "blocks":
            return -(-input_length // self.block_size)
        return input_length

    def prompt(self, i: int) -> np.ndarray:
        """Prompt of request row ``i``: block ids or token ids (a view, do not modify)."""
        return self.prompt_values[self.prompt_offsets[i] : self.prompt_offsets[i + 1]]

    def segment_spans(self, i: int) -> list[Segment]:
        """Segments of row ``i`` (:class:`~kvlab.workload.segments.Segment`: kind, token span, text); [] if none."""
        return [] if self.segments is None else self.segments.of(i)

    def output(self, i: int) -> np.ndarray | None:
        """Known output token ids of row ``i`` (token traces with reference answers), else None."""
        if self.output_offsets is None:
            return None
        return self.output_values[self.output_offsets[i] : self.output_offsets[i + 1]]

    @property
    def default_block_size(self) -> int:
        """Tokens per block when none is given, for every driver: the trace's own ``block_size`` (hash traces),
        else :data:`DEFAULT_BLOCK_SIZE` (token traces)."""
        return self.block_size if self.kind == "blocks" else DEFAULT_BLOCK_SIZE

    @property
    def duration(self) -> float:
        """Seconds between the first and the last arrival."""
        return float(self.arrival[-1] - self.arrival[0]) if len(self) else 0.0

    # ------------------------------------------------------------------ views
    def select(self, rows: np.ndarray | slice) -> Workload:
        """A new Workload with the given rows (kept in their order; parents re-indexed or dropped). A row given more
        than once is copied: copy ``k`` of a row gets copy ``k`` of its parent row as parent (the latest earlier copy
        if there are fewer; -1 if none), so a session drawn twice stays two sessions."""
        idx = np.arange(len(self))[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
        starts, ends = self.prompt_offsets[idx], self.prompt_offsets[idx + 1]
        counts = ends - starts
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        values = _gather_ranges(self.prompt_values, starts, counts)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kw.update(
            arrival=self.arrival[idx],
            input_length=self.input_length[idx],
            output_length=self.output_length[idx],
            prompt_offsets=offsets,
            prompt_values=values,
            meta=dict(self.meta),
        )
        for name in ("request_id", "session", "turn"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)[idx]
        if self.parent is not None:
            p = self.parent[idx]
            if len(np.unique(idx)) == len(idx):
                remap = np.full(len(self), -1, dtype=np.int64)
                remap[idx] = np.arange(len(idx))
                kw["parent"] = np.where(p >= 0, remap[np.maximum(p, 0)], -1)
            else:  # repeated rows: copy k of a row follows copy k of its parent (a session drawn twice stays two)
                copies: dict[int, list[int]] = {}
                parent = np.full(len(idx), -1, dtype=np.int64)
                for j, (row, par) in enumerate(zip(idx.tolist(), p.tolist(), strict=True)):
                    mine = copies.setdefault(row, [])
                    theirs = copies.get(par, []) if par >= 0 else []
                    if theirs:
                        parent[j] = theirs[min(len(mine), len(theirs) - 1)]
                    mine.append(j)
                kw["parent"] = parent
        for name in CATEGORICAL_COLUMNS:
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)[idx]
        if self.output_offsets is not None:
            o_starts, o_counts = self.output_offsets[idx], np.diff(self.output_offsets)[idx]
            o_off = np.zeros(len(idx) + 1, dtype=np.int64)
            np.cumsum(o_counts, out=o_off[1:])
            kw["output_offsets"] = o_off
            kw["output_values"] = _gather_ranges(self.output_values, o_starts, o_counts)
        if self.segments is not None:
            kw["segments"] = self.segments.select(idx)
        return Workload(**kw)

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (``n >= 1``; ConfigError otherwise)."""
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ConfigError(f"limit must be a positive number of requests, got {n!r}")
        return self.select(slice(0, int(n)))

    @property
    def content_sha256(self) -> str:
        """sha256 over every column that can change a result (prompts, lengths, arrivals, ids, labels).

        Two workloads with equal content hashes give equal numbers under the same config, whatever
        their names or source files: a ``head(50)`` and a ``head(2000)`` of one file differ here.
        Computed once per object (the columns are not mutated after construction).
        """
        cached = self.__dict__.get("_content_sha256")
        if cached is not None:
            return cached
        h = hashlib.sha256()
        h.update(f"kind={self.kind};block_size={self.block_size};n={len(self)}".encode())
        for name in ("arrival", "input_length", "output_length", "prompt_offsets", "prompt_values",
                     *INT_COLUMNS, "output_offsets", "output_values"):
            col = getattr(self, name)
            h.update(f";{name}=".encode())
            if col is not None:
                h.update(np.ascontiguousarray(col).tobytes())
        for name in CATEGORICAL_COLUMNS:
            col = getattr(self, name)
            h.update(f";{name}=".encode())
            if col is not None:
                h.update("\x1f".join("" if pd.isna(x) else str(x) for x in col).encode())
        if self.segments is not None:  # absent: the hash is what it was before segments existed
            self.segments.update_hash(h)
        digest = h.hexdigest()
        self.__dict__["_content_sha256"] = digest
        return digest

    def identity(self) -> dict:
        """The trace part of a run's identity: what the numbers depend on, plus where it came from.

        ``content_sha256`` decides equality; ``file_sha256`` (the source file, before any selection),
        ``requests`` and ``name`` are recorded for people reading a manifest, and so is ``tokenizer`` (name,
        tokenizer and template hashes) for a workload rendered from text (``meta["tokenizer"]``).
        """
        ident = {
            "name": self.name,
            "content_sha256": self.content_sha256,
            "file_sha256": self.checksum,
            "requests": len(self),
            "kind": self.kind,
            "trace_block_size": self.block_size,
        }
        if "tokenizer" in self.meta:
            ident["tokenizer"] = self.meta["tokenizer"]
        return ident

    def to_frame(self) -> pd.DataFrame:
        """Per-request metadata (no prompts) as a tidy frame, one row per request in trace order."""
        cols: dict[str, object] = {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "input_length": self.input_length,
            "output_length": self.output_length,
        }
        for name in ("session", "turn", "parent"):
            if getattr(self, name) is not None:
                cols[name] = getattr(self, name)
        for name in CATEGORICAL_COLUMNS:
            if getattr(self, name) is not None:
                cols[name] = getattr(self, name)
        return pd.DataFrame(cols)

    def __repr__(self) -> str:
        bs = f", block_size={self.block_size}" if self.kind == "blocks" else ""
        return f"Workload({self.name!r}, {len(self)} requests, kind={self.kind!r}{bs})"


def require_workload(value: object, argument: str = "workload") -> Workload:
    """``value`` if it is a :class:`Workload`; one ConfigError naming ``argument`` otherwise (a path or trace name
    is told to go through :func:`kvlab.workload.load_trace` first). Every public entry point that takes a
    workload calls this before any work."""
    hint = ""
    if isinstance(value, str | os.PathLike):
        hint = "load it first with kvlab.workload.load_trace(path)"
    elif value is None:
        hint = "pass a Workload (kvlab.workload.load_trace(path), synthetic_chat(...), from_lists(...))"
    return require_instance(value, Workload, argument, hint=hint)


def _gather_ranges(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``values[starts[i] : starts[i] + counts[i]]`` for all i, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return values[:0].copy()
    offsets = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    idx = np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)
    return values[idx]


def from_lists(
    prompts: list[list[int]] | list[np.ndarray],
    *,
    kind: PromptKind = "tokens",
    block_size: int | None = None,
    input_length: list[int] | np.ndarray | None = None,
    arrival: list[float] | np.ndarray | None = None,
    output_length: list[int] | np.ndarray | None = None,
    **columns: object,
) -> Workload:
    """Build a Workload from Python lists (tests, notebooks, generators).

    For ``kind="tokens"`` ``input_length`` defaults to the prompt lengths; for ``kind="blocks"`` it
    defaults to ``len(ids) * block_size`` (all blocks full).
    """
    n = len(prompts)
    counts = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    values = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]) if n else np.zeros(0, np.int64)
    if input_length is None:
        input_length = counts if kind == "tokens" else counts * int(block_size or 0)
    return Workload(
        arrival=np.zeros(n) if arrival is None else np.asarray(arrival, dtype=np.float64),
        input_length=np.asarray(input_length, dtype=np.int64),
        output_length=np.zeros(n, np.int64) if output_length is None else np.asarray(output_length),
        prompt_offsets=offsets,
        prompt_values=values,
        kind=kind,
        block_size=block_size,
        **columns,
    )
