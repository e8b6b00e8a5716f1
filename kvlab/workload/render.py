"""Render segmented messages to one prompt: messages -> prompt text (chat template) -> token ids, once.

A message is a role and an ordered list of tagged :class:`Part` s (its content is their concatenation).
:func:`render_prompt` applies the tokenizer's chat template to the whole conversation, tokenises the
resulting text once (BPE is not compositional: ids of pieces do not concatenate to the ids of the whole)
and derives each part's token span from the tokenizer's character offsets:

1. each part's character span in the prompt text: the template is rendered a second time with a marker in
   place of every part, which gives the template text around each part exactly; a template that rewrites
   content (trims it, strips reasoning) falls back to searching for the part's text in order, and a part
   it removed entirely gets an empty span (listed in ``RenderedPrompt.dropped``);
2. each token belongs to the part holding its first character. With ``cover=True`` (default) a token of
   template text belongs to the next part (a message header goes with the message after it; the
   generation prompt goes with the last part), so spans tile the prompt; with ``cover=False`` template
   tokens belong to no segment. A token straddling two parts belongs to the one it starts in.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvlab.arguments import kind_of, require_instance, require_text
from kvlab.errors import ConfigError
from kvlab.workload._common import csr
from kvlab.workload.segments import Segment, Segments, kind_code
from kvlab.workload.tokenizer import TextTokenizer
from kvlab.workload.workload import Workload

_MARK = "\ue000{}\ue001"  # private-use characters: no whitespace, so trimming templates leave them intact
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


class Part(NamedTuple):
    """A tagged piece of a message: segment kind (:data:`~kvlab.workload.segments.SEGMENT_KINDS`) and text."""

    kind: str
    text: str


@dataclass(frozen=True)
class Message:
    """A chat message: ``role`` (system / user / assistant / tool) and its parts in order."""

    role: str
    parts: tuple[Part, ...]

    @classmethod
    def of(cls, role: str, kind: str, text: str) -> Message:
        """A message made of one part."""
        return cls(role, (Part(kind, text),))

    @property
    def content(self) -> str:
        return "".join(p.text for p in self.parts)


@dataclass(frozen=True)
class RenderedPrompt:
    """One rendered request: prompt text (characters), token ids, segments (token spans, with the parts' text)."""

    text: str
    ids: list[int]
    segments: list[Segment]
    char_spans: list[tuple[int, int]]  # per part, in the prompt text
    dropped: list[int] = field(default_factory=list)  # parts the template removed (empty spans)


def _parts(messages: Sequence[Message]) -> list[Part]:
    """Every part in order; ConfigError naming ``messages[k]`` for a wrong type, an unknown kind or text that is
    not valid Unicode (a lone surrogate: ``messages[k].content: holds a lone surrogate (U+D800) at character
    5; ...``, the character counted in the message's content)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ConfigError(f"messages: expected a list of Message, got {kind_of(messages)}")
    out = []
    for k, m in enumerate(messages):
        require_instance(m, Message, f"messages[{k}]")
        require_text(m.role, f"messages[{k}].role")
        if isinstance(m.parts, str | bytes) or not isinstance(m.parts, Sequence):
            raise ConfigError(f"messages[{k}].parts: expected a tuple of Part, got {kind_of(m.parts)}")
        for j, p in enumerate(m.parts):
            if not isinstance(p, tuple) or len(p) != 2:
                raise ConfigError(f"messages[{k}].parts[{j}]: expected a Part(kind, text), got {kind_of(p)}")
            kind_code(p.kind if isinstance(p, Part) else p[0], f"message {k} ({m.role})")
            if not isinstance(p[1], str):
                raise ConfigError(f"messages[{k}].parts[{j}].text: expected text (a str), got {kind_of(p[1])}")
            out.append(Part(*p))
        require_text(m.content, f"messages[{k}].content")
    return out


def _char_spans(
    tokenizer: TextTokenizer, messages: Sequence[Message], text: str, parts: list[Part], kw: dict[str, Any]
) -> tuple[list[tuple[int, int]], list[int]]:
    """Character span of every part in the rendered ``text`` (see the module docstring), and dropped parts."""
    marked_msgs, j = [], 0
    for m in messages:
        content = ""
        for _ in m.parts:
            content += _MARK.format(j)
            j += 1
        marked_msgs.append({"role": m.role, "content": content})
    marked = tokenizer.apply_chat_template(marked_msgs, **kw)
    found = [int(x) for x in _MARK_RE.findall(marked)]
    frags: list[str] | None = _MARK_RE.split(marked)[0::2] if found == list(range(len(parts))) else None
    spans: list[tuple[int, int]] = []
    dropped: list[int] = []
    cursor = 0
    for j, p in enumerate(parts):
        q = cursor + len(frags[j]) if frags is not None else cursor
        span = None
        for piece in (p.text, p.text.lstrip(), p.text.strip(), p.text.rstrip()):
            if frags is not None and text.startswith(piece, q):
                span = (q, q + len(piece))
                break
        if span is None and p.text.strip():
            for piece in (p.text, p.text.strip()):
                at = text.find(piece, min(q, len(text)))
                if at >= 0:
                    span = (at, at + len(piece))
                    break
        if span is None:  # removed by the template (or empty): an empty span where it would have been
            span = (min(q, len(text)), min(q, len(text)))
            if p.text:
                dropped.append(j)
        spans.append(span)
        cursor = span[1]
    return spans, dropped


def render_prompt(
    tokenizer: TextTokenizer,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    date_string: str | None = None,
    cover: bool = True,
    **template_kwargs: Any,
) -> RenderedPrompt:
    """Render, tokenise once and attribute tokens to segments (module docstring); ``date_string`` fixes the
    date a date-injecting template writes (default: the tokenizer's fixed date)."""
    require_instance(tokenizer, TextTokenizer, "tokenizer",
                     hint="load one with kvlab.workload.tokenizer.load_tokenizer(spec)")
    parts = _parts(messages)
    if not messages:
        raise ConfigError("render_prompt: no messages")
    kw = {"add_generation_prompt": add_generation_prompt, "date_string": date_string, **template_kwargs}
    text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], **kw)
    spans, dropped = _char_spans(tokenizer, messages, text, parts, kw)
    ids, offsets = tokenizer.encode_offsets(text, add_special_tokens=not tokenizer.special_tokens_in_template)
    starts = np.maximum.accumulate(np.array([o[0] for o in offsets] or [0], dtype=np.int64))[: len(ids)]
    ends = [e for _, e in spans]
    segs = []
    if cover:  # token t goes to the first part ending after its first character; the rest to the last part
        owner = np.searchsorted(np.array(ends, dtype=np.int64), starts, side="right")
        owner = np.minimum(owner, len(parts) - 1)
        # empty parts own nothing; a token owned by one goes on to the next non-empty part
        for j in range(len(parts) - 1, -1, -1):
            if spans[j][0] == spans[j][1]:
                nxt = next((k for k in range(j + 1, len(parts)) if spans[k][0] < spans[k][1]), None)
                if nxt is None:
                    nxt = next((k for k in range(j - 1, -1, -1) if spans[k][0] < spans[k][1]), j)
                owner[owner == j] = nxt
        bounds = np.searchsorted(owner, np.arange(len(parts) + 1), side="left")
        for j, p in enumerate(parts):
            segs.append(Segment(p.kind, int(bounds[j]), int(bounds[j + 1]), p.text))
    else:
        sl = starts.tolist()
        for (a, b), p in zip(spans, parts, strict=True):
            lo = bisect.bisect_left(sl, a)
            hi = bisect.bisect_left(sl, b)
            segs.append(Segment(p.kind, lo, max(lo, hi), p.text))
    return RenderedPrompt(text=text, ids=ids, segments=segs, char_spans=spans, dropped=dropped)


def rendered_workload(
    prompts: Sequence[RenderedPrompt],
    tokenizer: TextTokenizer,
    *,
    arrival: Sequence[float] | np.ndarray | None = None,
    output_length: int | Sequence[int] = 256,
    name: str = "rendered",
    meta: dict | None = None,
    **columns: object,
) -> Workload:
    """A token :class:`Workload` of rendered prompts, with their segments; the tokenizer's identity goes to
    ``meta["tokenizer"]``. ``arrival`` defaults to one request per second."""
    n = len(prompts)
    counts = np.array([len(p.ids) for p in prompts], dtype=np.int64)
    out = np.full(n, output_length, dtype=np.int64) if np.isscalar(output_length) else np.asarray(output_length)
    return Workload(
        arrival=np.arange(n, dtype=np.float64) if arrival is None else np.asarray(arrival, dtype=np.float64),
        input_length=counts,
        output_length=out,
        prompt_offsets=csr(counts),
        prompt_values=np.array([t for p in prompts for t in p.ids], dtype=np.int64),
        segments=Segments.from_lists([p.segments for p in prompts]),
        name=name,
        meta={**(meta or {}), "tokenizer": tokenizer.identity()},
        **columns,
    )
