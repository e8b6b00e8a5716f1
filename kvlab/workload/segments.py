"""Tagged segments of a request's prompt: which part of the prompt a token (a hit, a miss) belongs to.

A segmented request is an ordered list of segments, each a *kind* (:data:`SEGMENT_KINDS`), a token span
``[start, end)`` in the request's prompt (token positions, not characters) and optionally its text.
Spans are ordered and do not overlap; they need not cover the prompt (template tokens between two
segments may belong to none; :func:`kvlab.workload.render.render_prompt` covers the prompt by default).
The token ids of a segment are ``workload.prompt(i)[start:end]``.

Kinds: ``system`` (system prompt), ``tools`` (tool definitions), ``document`` (a retrieved passage),
``history`` (earlier user/tool turns repeated in this prompt), ``user`` (this turn's query),
``volatile`` (content that changes per request: a timestamp, a request or user id), ``output`` (text a
model produced: earlier answers or reasoning kept in the prompt).

:class:`Segments` stores all requests' segments column-wise (CSR like the prompts); a
:class:`~kvlab.workload.workload.Workload` without segments has ``segments = None`` and behaves as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from kvlab.arguments import require_text
from kvlab.errors import ConfigError

SEGMENT_KINDS: tuple[str, ...] = ("system", "tools", "document", "history", "user", "volatile", "output")
KIND_CODE: dict[str, int] = {k: i for i, k in enumerate(SEGMENT_KINDS)}


class Segment(NamedTuple):
    """One segment of one request: kind, token span ``[start, end)`` in the prompt, text (or None)."""

    kind: str
    start: int
    end: int
    text: str | None = None


def kind_code(kind: str, where: str = "segment kind") -> int:
    """The int8 code of a segment kind; ConfigError naming ``where`` for an unknown kind."""
    code = KIND_CODE.get(kind) if isinstance(kind, str) else None
    if code is None:
        raise ConfigError(f"{where}: {kind!r} is not a segment kind (one of {', '.join(SEGMENT_KINDS)})")
    return code


@dataclass(eq=False)
class Segments:
    """Segments of every request, column-wise: request ``i`` owns rows ``offsets[i]:offsets[i + 1]``.

    ``start``/``end`` are token positions in that request's prompt; ``text`` is one string per segment
    row, or None when the texts are unknown (e.g. segments of a hash trace).
    """

    offsets: np.ndarray  # int64 [n + 1]
    kind: np.ndarray  # int8 [m], codes into SEGMENT_KINDS
    start: np.ndarray  # int64 [m], first token (inclusive)
    end: np.ndarray  # int64 [m], end token (exclusive)
    text: list[str] | None = None  # [m] characters of each segment

    def __post_init__(self) -> None:
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        self.kind = np.ascontiguousarray(self.kind, dtype=np.int8)
        self.start = np.ascontiguousarray(self.start, dtype=np.int64)
        self.end = np.ascontiguousarray(self.end, dtype=np.int64)
        if self.text is not None:
            self.text = list(self.text)

    @classmethod
    def from_lists(cls, per_request: Sequence[Sequence[Segment | tuple]]) -> Segments:
        """Build from one list of :class:`Segment` (or ``(kind, start, end[, text])`` tuples) per request.

        Texts are kept when every segment has one, dropped (None) when none has; a mix is an error.
        """
        counts = [len(r) for r in per_request]
        flat = [Segment(*s) for r in per_request for s in r]
        texts = [s.text for s in flat]
        has = [t is not None for t in texts]
        if any(has) and not all(has):
            raise ConfigError("Segments: give a text for every segment or for none")
        if any(has):  # texts are hashed and shown: valid Unicode only (a lone surrogate named by its segment)
            k = 0
            for i, r in enumerate(per_request):
                for j in range(len(r)):
                    require_text(texts[k], f"segments[{i}][{j}].text")
                    k += 1
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(
            offsets=offsets,
            kind=np.array([kind_code(s.kind) for s in flat], dtype=np.int8),
            start=np.array([s.start for s in flat], dtype=np.int64),
            end=np.array([s.end for s in flat], dtype=np.int64),
            text=texts if flat and all(has) else None,
        )

    def __len__(self) -> int:
        """Number of requests (not segments)."""
        return len(self.offsets) - 1

    def validate(self, input_length: np.ndarray) -> None:
        """Check the invariants against the prompts' lengths (tokens); ConfigError names the request row."""
        n = len(input_length)
        m = len(self.kind)
        if len(self.offsets) != n + 1 or self.offsets[0] != 0 or self.offsets[-1] != m:
            raise ConfigError(f"Workload.segments: offsets must have {n + 1} entries from 0 to {m}")
        if np.any(np.diff(self.offsets) < 0):
            raise ConfigError("Workload.segments: offsets must be non-decreasing")
        if len(self.start) != m or len(self.end) != m or (self.text is not None and len(self.text) != m):
            raise ConfigError(f"Workload.segments: kind, start, end (and text) must have {m} rows")
        if m and (self.kind.min() < 0 or self.kind.max() >= len(SEGMENT_KINDS)):
            raise ConfigError("Workload.segments: kind codes must index SEGMENT_KINDS")
        row = self.rows()
        bad = (self.start < 0) | (self.end < self.start) | (self.end > input_length[row])
        if m > 1:  # within a request, a segment starts at or after the previous one's end
            bad[1:] |= (row[1:] == row[:-1]) & (self.start[1:] < self.end[:-1])
        if np.any(bad):
            j = int(np.flatnonzero(bad)[0])
            i = int(row[j])
            raise ConfigError(
                f"Workload request row {i}: segment {j - int(self.offsets[i])} spans tokens "
                f"[{self.start[j]}, {self.end[j]}), outside [0, {input_length[i]}) or before the previous segment"
            )

    def of(self, i: int) -> list[Segment]:
        """The segments of request row ``i``, in prompt order."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return [
            Segment(SEGMENT_KINDS[k], s, e, None if self.text is None else self.text[j])
            for j, k, s, e in zip(range(a, b), self.kind[a:b].tolist(), self.start[a:b].tolist(),
                                  self.end[a:b].tolist(), strict=True)
        ]

    def select(self, idx: np.ndarray) -> Segments:
        """The segments of request rows ``idx`` (in that order)."""
        starts, counts = self.offsets[idx], np.diff(self.offsets)[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        rows = np.repeat(starts - offsets[:-1], counts) + np.arange(int(offsets[-1]), dtype=np.int64)
        text = None if self.text is None else [self.text[j] for j in rows.tolist()]
        return Segments(offsets=offsets, kind=self.kind[rows], start=self.start[rows], end=self.end[rows], text=text)

    def clip(self, input_length: np.ndarray) -> Segments:
        """Spans cut to prompts shortened to ``input_length`` tokens (segments past the cut become empty)."""
        cap = np.asarray(input_length, dtype=np.int64)[self.rows()]
        return Segments(self.offsets, self.kind, np.minimum(self.start, cap), np.minimum(self.end, cap), self.text)

    def update_hash(self, h: hashlib._Hash) -> None:
        """Feed every column (texts included) into the hash ``h`` (the workload's content hash)."""
        for name in ("offsets", "kind", "start", "end"):
            h.update(f";segments.{name}=".encode())
            h.update(getattr(self, name).tobytes())
        h.update(b";segments.text=")
        if self.text is not None:
            h.update("\x1f".join(self.text).encode("utf-8", "surrogatepass"))

    def rows(self) -> np.ndarray:
        """The request row of every segment row (int64 [m])."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.offsets))

    def hit_tokens(self, hit_tokens: np.ndarray) -> np.ndarray:
        """Hit tokens per segment row (int64 [m]): overlap of ``[0, hit_tokens[i])`` with the row's span."""
        h = np.asarray(hit_tokens, dtype=np.int64)[self.rows()]
        return np.clip(np.minimum(h, self.end) - self.start, 0, None)

    def first_miss(self, hit_tokens: np.ndarray) -> pd.Categorical:
        """Per request, the kind of the segment holding its first miss (:func:`first_miss_segment`, vectorised);
        missing where no segment ends after ``hit_tokens[i]``."""
        h = np.asarray(hit_tokens, dtype=np.int64)
        after = np.flatnonzero(self.end > h[self.rows()])  # segment rows ending after their request's hits
        pos = np.searchsorted(after, self.offsets[:-1])
        j = after[np.minimum(pos, max(len(after) - 1, 0))] if len(after) else np.zeros(len(self), np.int64)
        found = (pos < len(after)) & (j < self.offsets[1:])
        codes = np.where(found, self.kind[j] if len(after) else -1, -1)
        return pd.Categorical.from_codes(codes, categories=list(SEGMENT_KINDS))

    def frame(self, hit_tokens: np.ndarray | None = None) -> pd.DataFrame:
        """One row per segment: ``row`` (request), ``index`` (in its request), ``kind``, ``start``, ``end``,
        ``tokens`` and, given per-request hit tokens, ``hit_tokens`` (tokens throughout)."""
        rows = self.rows()
        cols: dict[str, object] = {
            "row": rows,
            "index": np.arange(len(rows), dtype=np.int64) - self.offsets[rows],
            "kind": pd.Categorical.from_codes(self.kind.astype(np.int64), categories=list(SEGMENT_KINDS)),
            "start": self.start,
            "end": self.end,
            "tokens": self.end - self.start,
        }
        if hit_tokens is not None:
            cols["hit_tokens"] = self.hit_tokens(hit_tokens)
        return pd.DataFrame(cols)


def hit_tokens_by_segment(spans: Sequence[Segment | tuple], hit_tokens: int) -> dict[str, int]:
    """Hit tokens per segment kind of one request: the overlap of ``[0, hit_tokens)`` with each span.

    A block that straddles two segments is thereby split by overlap. Kinds appear in prompt order;
    several segments of one kind add up; tokens in no span (gaps) are not counted.
    """
    out: dict[str, int] = {}
    for s in spans:
        kind, start, end = s[0], int(s[1]), int(s[2])
        out[kind] = out.get(kind, 0) + max(0, min(hit_tokens, end) - start)
    return out


def first_miss_segment(spans: Sequence[Segment | tuple], hit_tokens: int) -> str | None:
    """Kind of the segment holding the first missed token (position ``hit_tokens``), or None.

    A miss in a gap between segments is attributed to the next segment (a template header belongs to the
    message after it); None when no segment ends after ``hit_tokens`` (everything up to there was a hit).
    """
    for s in spans:
        if int(s[2]) > hit_tokens:
            return s[0]
    return None
