"""What a layout leaves on the table: the non-prefix reuse bound, and the block-boundary sweep of seed 004.

Non-prefix reuse. A prefix cache stops at a request's first miss; everything after it is recomputed even when
the same text sits in the cache under another prefix. :func:`nonprefix_bound` counts, per request, the prompt
tokens after its prefix hits whose block's *unchained* content (the block's token ids alone, not the chain of
blocks before it) already appeared in an earlier request (its prompt or known output): what position-independent
reuse such as CacheBlend could at most add, with an unbounded store and block-aligned chunks. It is an upper
bound: it ignores capacity, and position-independent reuse also recomputes some tokens to repair attention.

The block-boundary effect (../shared/seeds/README.md, seed 004): a one-token change at position ``p`` loses
every block from the one holding ``p`` on, so a request keeps ``floor(p / block_size) * block_size`` tokens.
:func:`boundary_sweep` measures it: requests identical but for a short volatile id inserted at token position
``p`` of a real-text system prompt, replayed (:func:`kvlab.replay.replay`) for each position and block size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvlab.workload.render import Message, Part, render_prompt, rendered_workload
from kvlab.workload.tokenizer import TextTokenizer
from kvlab.workload.workload import Workload


def _sequences(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Per request, (offsets, values) of its prompt followed by its known output ids (tokens)."""
    prompt = np.asarray(workload.input_length, dtype=np.int64)
    if workload.output_offsets is None:
        return workload.prompt_offsets, workload.prompt_values
    out = np.diff(workload.output_offsets)
    pieces = []
    for i in range(len(workload)):
        pieces += [workload.prompt(i), workload.output(i)]
    offsets = np.zeros(len(prompt) + 1, dtype=np.int64)
    np.cumsum(prompt + out, out=offsets[1:])
    return offsets, np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def block_content_ids(offsets: np.ndarray, values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
    """Every full block of every sequence: ``(content, request, index)``, where ``content`` numbers distinct
    token-id tuples (unchained: the block's ids alone), ``request`` the sequence and ``index`` the block's place in
    it; blocks in sequence order."""
    lengths = np.diff(offsets)
    full = lengths // block_size
    request = np.repeat(np.arange(len(full), dtype=np.int64), full)
    index = np.arange(int(full.sum()), dtype=np.int64) - np.repeat(np.cumsum(full) - full, full)
    if not len(request):
        return np.zeros(0, np.int64), request, index
    starts = offsets[request] + index * block_size
    rows = values[starts[:, None] + np.arange(block_size, dtype=np.int64)[None, :]].astype(np.int64)
    view = np.ascontiguousarray(rows).view(np.dtype((np.void, 8 * block_size))).ravel()
    _, content = np.unique(view, return_inverse=True)
    return content.astype(np.int64), request, index


def nonprefix_bound(workload: Workload, hit_blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Per request, the prompt tokens past its ``hit_blocks`` prefix hits (blocks) held by full prompt blocks whose
    unchained content appeared in an earlier request's prompt or known output (int64, tokens; module docstring)."""
    offsets, values = _sequences(workload)
    content, request, index = block_content_ids(offsets, values, block_size)
    first = np.full(int(content.max()) + 1 if len(content) else 0, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, content, request)
    earlier = first[content] < request
    prompt_full = np.asarray(workload.input_length, dtype=np.int64) // block_size
    hits = np.asarray(hit_blocks, dtype=np.int64)
    after = (index >= hits[request]) & (index < prompt_full[request])
    return np.bincount(request[earlier & after], minlength=len(workload)).astype(np.int64) * block_size


def break_tokens(workload: Workload) -> np.ndarray:
    """Per request, where its prompt departs from everything seen before (tokens): the longest prefix of its prompt
    that is also a prefix of an earlier request's prompt or of its prompt plus known output (token granular, an
    unbounded store; keys include the adapter). The segment holding this token is where the layout breaks the
    prefix, whatever the block size and the cache size (:func:`kvlab.workload.segments.Segments.first_miss` of it);
    a prompt seen whole gets its length."""
    from kvlab.hashing import BlockHasher
    from kvlab.sim.trace_requests import sequence_keys

    offsets, keys, prompt, num_keys = sequence_keys(workload, BlockHasher("xxh3_128"), 1)
    lengths = np.diff(offsets)
    request = np.repeat(np.arange(len(workload), dtype=np.int64), lengths)
    first = np.full(int(num_keys), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, keys, request)
    position = np.arange(len(keys), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    fresh = (first[keys] >= request) & (position < prompt[request])  # prompt tokens no earlier sequence had
    out = prompt.astype(np.int64).copy()
    rows = np.flatnonzero(fresh)
    if len(rows):
        req, at = request[rows], position[rows]
        firsts = np.unique(req, return_index=True)
        out[firsts[0]] = at[firsts[1]]
    return out


# ------------------------------------------------------------------------------------------ seed 004
VOLATILE_WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India", "Juliett",
                  "Kilo", "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo", "Sierra", "Tango")
"""Request ``k``'s volatile word: every one starts with another letter, so the requests differ from its first
token on (a word after a space is a pre-token of its own in byte-level BPE: the text before is unchanged)."""


def boundary_workload(tokenizer: TextTokenizer, stable_text: str, position: int, requests: int,
                      question: str) -> Workload:
    """``requests`` (at most 20) prompts: a system prompt of ``stable_text`` with a volatile word (request ``k``:
    :data:`VOLATILE_WORDS` ``[k]``) inserted before the text's token ``position``, then ``question``."""
    if not 1 <= requests <= len(VOLATILE_WORDS):
        raise ValueError(f"boundary_workload: requests must be in [1, {len(VOLATILE_WORDS)}], got {requests}")
    ids, spans = tokenizer.encode_offsets(stable_text, add_special_tokens=False)
    cut = spans[position][0] if position < len(ids) else len(stable_text)
    prompts = []
    for k in range(requests):
        system = (Part("system", stable_text[:cut]), Part("volatile", f" {VOLATILE_WORDS[k]}"),
                  Part("system", stable_text[cut:]))
        messages = (Message("system", tuple(p for p in system if p.text)), Message.of("user", "user", question))
        prompts.append(render_prompt(tokenizer, messages))
    return rendered_workload(prompts, tokenizer, output_length=1, name=f"boundary-p{position}")


def first_difference(workload: Workload) -> int:
    """The first token position where any request's prompt differs from request 0's (tokens)."""
    first = workload.prompt(0)
    out = len(first)
    for i in range(1, len(workload)):
        other = workload.prompt(i)
        n = min(len(first), len(other))
        diff = np.flatnonzero(first[:n] != other[:n])
        out = min(out, int(diff[0]) if len(diff) else n)
    return out


def boundary_sweep(tokenizer: TextTokenizer, stable_text: str, positions: Sequence[int], block_sizes: Sequence[int],
                   *, requests: int = 4, question: str = "What does the passage say?") -> pd.DataFrame:
    """Hit rate vs the position of a volatile token, per block size (module docstring).

    One row per (position, block size): ``position`` (the first token where the rendered prompts differ: the
    volatile word's first token, tokens), ``text_position`` (the token of ``stable_text`` it was inserted before),
    ``block_size`` (tokens),
    ``prompt_tokens`` (mean), ``hit_tokens`` (mean over the requests after the first, tokens), ``hit_rate``
    (their hit tokens / prompt tokens) and ``kept_tokens`` = ``floor(position / block_size) * block_size``.
    An unbounded cache (capacity = every block), LRU, vLLM counting."""
    from kvlab.replay import replay

    rows = []
    for p in positions:
        w = boundary_workload(tokenizer, stable_text, int(p), requests, question)
        start = first_difference(w)
        for bs in block_sizes:
            r = replay(w, capacity_blocks=int(w.input_length.sum()) // int(bs) + 1, block_size=int(bs))
            warm = r.requests.iloc[1:]
            rows.append({"position": start, "text_position": int(p), "block_size": int(bs),
                         "prompt_tokens": float(warm["prompt_tokens"].mean()),
                         "hit_tokens": float(warm["hit_tokens"].mean()),
                         "hit_rate": float(warm["hit_tokens"].sum() / warm["prompt_tokens"].sum()),
                         "kept_tokens": start // int(bs) * int(bs)})
    return pd.DataFrame(rows)
