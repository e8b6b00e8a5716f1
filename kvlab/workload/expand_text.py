"""Text-backed expansion of a hash trace: every block id becomes a fixed span of real text, as token ids.

A Mooncake or Alibaba trace names each block of a prompt by a hash id but has no text.
:func:`expand_with_text` gives every distinct id ``block_size`` token ids cut from real text, so the
result is a token workload with exactly the trace's structure whose blocks read as text (the decoded
spans; ``segments=True`` records them). The rule:

* the text pool (:func:`~kvlab.workload.families.base.corpus_pool`: every distinct MuSiQue passage and the
  MT-Bench reference answers) is tokenised **once**; blocks are cut from its token ids, never re-tokenised
  text, because BPE is not compositional: a span of ``block_size`` ids decodes to text that could re-encode
  to another count, while the ids themselves are exact. So each id yields exactly ``block_size`` tokens.
* a block is ``pieces`` pieces of ``ceil(block_size / pieces)`` tokens (the last one
  cut short), each a non-overlapping span of the pool (pieces with equal ids are merged first). ``pieces`` is
  the smallest number for which the pool offers at least ``4 x`` as many piece tuples as the trace has
  distinct ids (1 when the pool holds enough whole blocks: the block is then one contiguous span of text).
* id -> pieces by SplitMix64 of ``(seed, id, piece, attempt)`` (as :mod:`kvlab.workload.expand`); ids
  whose tuple is already taken (in ascending id order) draw again with the next attempt, so distinct ids
  get distinct blocks and the same id always the same block (within a seed, pool and id set).
* a partial last block takes the first tokens of its id's block.

Hence the expanded workload's chained token blocks at the trace's block size repeat exactly when the
trace's chained ids do: its block-level reuse *is* the trace's (:func:`expansion_stats` compares both;
tested). Coarser multiples of the block size stay exact; finer block sizes can find reuse the trace does
not show (the trace cannot show sharing inside its blocks, and two blocks may share a piece).

Alibaba traces: expand the raw per-block content ids (``load_alibaba(path, chain=False)``), so that a
content block that recurs after different prefixes gets the same text, as in the real data; the token
workload's chained blocks then reproduce the chained trace. Memory: 8 bytes per prompt token (the
Mooncake conversation trace: 144.8 M tokens, 1.16 GB); expand a ``head(n)`` to keep it small.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlab.arguments import NonNegativeInt, require_ints
from kvlab.errors import ConfigError
from kvlab.schema import PositiveInt, Seed
from kvlab.workload._common import csr
from kvlab.workload.alibaba import chain_block_ids
from kvlab.workload.expand import _block_keys, _mix64_
from kvlab.workload.families.base import TextPool, corpus_pool
from kvlab.workload.segments import Segment
from kvlab.workload.workload import Workload, require_workload

_TUPLES_PER_ID = 4  # at least this many piece tuples per distinct id: few redraws


def _pieces(pool_ids: np.ndarray, block_size: int, n_ids: int, pieces: int | None = None
            ) -> tuple[int, int, np.ndarray]:
    """``(pieces per block, piece length in tokens, start of every distinct pool piece)``: ``pieces``, else the
    fewest pieces for which the distinct pieces give at least ``_TUPLES_PER_ID`` tuples per id."""
    if pieces is not None and not 1 <= pieces <= block_size:
        raise ConfigError(f"expand_with_text: pieces must be in [1, {block_size}], got {pieces}")
    for k in range(pieces or 1, block_size + 1):
        length = math.ceil(block_size / k)
        spans = pool_ids[: (len(pool_ids) // length) * length].reshape(-1, length)
        if not len(spans):
            continue
        _, first = np.unique(_row_ids(spans), return_index=True)  # equal token contents merged
        if len(first) ** k >= _TUPLES_PER_ID * max(1, n_ids):
            return k, length, np.sort(first) * length
    raise ConfigError(f"expand_with_text: a {len(pool_ids)}-token text pool cannot give {n_ids} distinct blocks")


def _draw(keys: np.ndarray, k: int, n: int, attempt: int) -> np.ndarray:
    """``[len(keys), k]`` piece indices in ``[0, n)`` from SplitMix64 of ``key + (attempt * k + j + 1) * gamma``."""
    with np.errstate(over="ignore"):
        steps = (np.arange(k, dtype=np.uint64) + np.uint64(attempt * k + 1)) * np.uint64(0x9E3779B97F4A7C15)
        z = keys[:, None] + steps[None, :]
        _mix64_(z, np.empty_like(z))
    return (z % np.uint64(n)).astype(np.int64)


class BlockText:
    """The id -> token-block table of one expansion: ``tokens(ids)`` ``[len(ids), block_size]`` and ``text(id)``."""

    def __init__(self, ids: np.ndarray, block_size: int, pool: TextPool, seed: int = 0, pieces: int | None = None
                 ) -> None:
        self.block_size = block_size
        self.pool = pool
        self.seed = seed
        self.ids = np.unique(np.asarray(ids, dtype=np.int64))  # ascending distinct ids
        k, length, self.piece_start = _pieces(pool.ids, block_size, len(self.ids), pieces)
        self.pieces, self.piece_tokens = k, length
        n = len(self.piece_start)
        keys = _block_keys(self.ids, seed)
        choice = _draw(keys, k, n, 0)
        attempt = 0
        while True:  # ids (ascending) whose tuple an earlier id holds draw again
            _, first_of = np.unique(choice, axis=0, return_index=True)
            dup = np.ones(len(choice), dtype=bool)
            dup[first_of] = False
            if not dup.any():
                break
            attempt += 1
            choice[dup] = _draw(keys[dup], k, n, attempt)
        self.choice = choice  # [n_ids, k] piece indices
        self.attempts = attempt

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), block_size]`` token ids of the blocks of ``ids`` (every id must be in the table)."""
        ids = np.asarray(ids, dtype=np.int64)
        rank = np.searchsorted(self.ids, ids)
        if len(ids) and (rank.max() >= len(self.ids) or np.any(self.ids[rank] != ids)):
            raise ConfigError("BlockText.tokens: an id not in the expanded trace")
        starts = self.piece_start[self.choice[rank]]  # [m, k]
        pos = starts[:, :, None] + np.arange(self.piece_tokens)[None, None, :]
        return self.pool.ids[pos.reshape(len(ids), -1)[:, : self.block_size]]

    def text(self, block_id: int, n_tokens: int | None = None) -> str:
        """The text of block ``block_id`` (its first ``n_tokens`` tokens): the decoded token span."""
        row = self.tokens(np.array([block_id]))[0]
        return self.pool.tokenizer.decode(row[: self.block_size if n_tokens is None else n_tokens].tolist())


def expand_with_text(
    workload: Workload,
    *,
    tokenizer: str = "kvlab-bpe",
    seed: int = 0,
    text_dir: str | None = None,
    max_requests: int | None = None,
    segments: bool = False,
    pieces: int | None = None,
) -> Workload:
    """A ``kind="tokens"`` copy of a ``kind="blocks"`` workload whose blocks are spans of real text (module
    docstring). ``tokenizer`` is a :func:`~kvlab.workload.tokenizer.load_tokenizer` spec; its identity goes to
    ``meta["tokenizer"]`` and the expansion's parameters to ``meta["expanded_text"]``. ``segments=True`` adds
    one ``history`` segment per block with its text (the decoded span). Every per-request column is kept.

    ``pieces`` fixes the pieces per block (default: the fewest the trace's distinct ids need, so a block is one
    contiguous span of text when the pool allows). The id -> text map depends on the seed, the pool and the
    pieces (and, through rare redraws, on which ids collide); with ``pieces`` fixed, expanding ``head(n)``
    gives the first ``n`` requests of the whole expansion (unless a redraw differs: checked in the tests).
    """
    workload = require_workload(workload)
    require_ints("expand_with_text", seed=(Seed, seed), max_requests=(NonNegativeInt | None, max_requests),
                 pieces=(PositiveInt | None, pieces))
    if workload.kind != "blocks":
        raise ConfigError(f"expand_with_text needs a kind='blocks' workload, got kind={workload.kind!r}")
    w = workload.head(max_requests) if max_requests is not None else workload
    bs = int(w.block_size)
    pool = corpus_pool(tokenizer, text_dir)
    table = BlockText(w.prompt_values, bs, pool, seed, pieces)
    nblocks = np.diff(w.prompt_offsets)
    keep = np.full(len(w.prompt_values), bs, dtype=np.int64)  # tokens kept of each block
    has = nblocks > 0
    keep[w.prompt_offsets[1:][has] - 1] = w.input_length[has] - (nblocks[has] - 1) * bs
    out = np.empty(int(keep.sum()), dtype=np.int64)
    tok_off = csr(keep)
    step = max(1, (1 << 17) // bs)
    for b0 in range(0, len(keep), step):
        b1 = min(b0 + step, len(keep))
        m = table.tokens(w.prompt_values[b0:b1])
        cnt = keep[b0:b1]
        out[tok_off[b0] : tok_off[b1]] = m.ravel() if cnt.min() == bs else m[np.arange(bs)[None, :] < cnt[:, None]]
    segs = None
    if segments:
        segs = []
        for i in range(len(w)):
            a, b = int(w.prompt_offsets[i]), int(w.prompt_offsets[i + 1])
            starts = tok_off[a:b] - tok_off[a]
            segs.append([Segment("history", int(s), int(s + n), pool.tokenizer.decode(out[tok_off[a] + s :
                                 tok_off[a] + s + n].tolist())) for s, n in zip(starts, keep[a:b], strict=True)])
    meta = {**w.meta, "tokenizer": pool.tokenizer.identity(), "expanded_text": {
        "from_block_size": bs, "seed": seed, "pieces_per_block": table.pieces, "piece_tokens": table.piece_tokens,
        "pool_tokens": len(pool.ids), "distinct_ids": len(table.ids), "redraw_rounds": table.attempts,
        "chained_input": w.meta.get("chained", True)}}
    return Workload(
        arrival=w.arrival, input_length=w.input_length, output_length=w.output_length,
        prompt_offsets=csr(w.input_length), prompt_values=out, kind="tokens", request_id=w.request_id,
        session=w.session, turn=w.turn, parent=w.parent, tenant=w.tenant, category=w.category, adapter=w.adapter,
        salt=w.salt, segments=segs, name=f"{w.name}-text", source=w.source, checksum=w.checksum, meta=meta,
    )


def trace_requests(
    workload: Workload,
    *,
    tokenizer: str = "kvlab-bpe",
    seed: int = 0,
    text_dir: str | None = None,
    max_requests: int | None = None,
    pieces: int | None = None,
) -> list:
    """The expanded trace as :class:`~kvlab.workload.families.base.GeneratedRequest` s, for layout transforms
    (which edit messages, then render and tokenise each prompt once).

    Request ``i`` is one user message with one part per block, the block's text (the decoded span of
    :func:`expand_with_text`): ``history`` for a block whose chained id an earlier request already had (reused
    context), ``user`` for the others. Rendering re-tokenises the text, so block boundaries move by a few
    tokens, but equal prefixes of blocks stay equal prefixes of text: the reuse is the trace's up to the
    tokens around each prefix's end. ``session``/``turn``/``category`` come from the trace when it has them
    (else the row, 1, ``"trace"``); ``answer_source`` is ``"none"``.
    """
    from kvlab.workload.families.base import GeneratedRequest, Message
    from kvlab.workload.render import Part

    workload = require_workload(workload)
    require_ints("trace_requests", max_requests=(NonNegativeInt | None, max_requests))
    w = workload.head(max_requests) if max_requests is not None else workload
    e = expand_with_text(w, tokenizer=tokenizer, seed=seed, text_dir=text_dir, segments=True, pieces=pieces)
    chained = w.prompt_values if w.meta.get("chained", True) else chain_block_ids(w.prompt_offsets, w.prompt_values)
    seen: set[int] = set()
    out = []
    for i in range(len(w)):
        a, b = int(w.prompt_offsets[i]), int(w.prompt_offsets[i + 1])
        ids = chained[a:b].tolist()
        parts = tuple(Part("history" if h in seen else "user", s.text) for h, s in zip(ids, e.segment_spans(i),
                                                                                         strict=True))
        seen.update(ids)
        out.append(GeneratedRequest(
            messages=(Message("user", parts),), arrival=float(w.arrival[i]), output_tokens=int(w.output_length[i]),
            session=int(w.session[i]) if w.session is not None else i,
            turn=int(w.turn[i]) if w.turn is not None and w.turn[i] > 0 else 1, tenant=0,
            category=str(w.category[i]) if w.category is not None else "trace", answer_source="none",
            meta={"request_id": int(w.request_id[i])},
        ))
    return out


# ------------------------------------------------------------------------------------------ statistics
def _chained_full_blocks(w: Workload, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix-chained ids of every request's *full* blocks (CSR offsets, ids) at ``block_size`` tokens."""
    full = w.input_length // block_size
    if w.kind == "blocks":
        if w.block_size != block_size:
            raise ConfigError(f"expansion_stats: trace block size {w.block_size}, asked {block_size}")
        idx = np.concatenate([np.arange(w.prompt_offsets[i], w.prompt_offsets[i] + full[i]) for i in range(len(w))]
                             or [np.zeros(0, np.int64)]).astype(np.int64)
        raw = w.prompt_values[idx]
        chained = w.meta.get("chained", True)
    else:
        rows = [w.prompt(i)[: full[i] * block_size].reshape(-1, block_size) for i in range(len(w))]
        raw = _row_ids(np.concatenate(rows) if rows else np.zeros((0, block_size), np.int64))
        chained = False
    offsets = csr(full)
    return offsets, raw if chained else chain_block_ids(offsets, raw)


def _row_ids(mat: np.ndarray) -> np.ndarray:
    """Dense ids of the rows of ``mat`` (equal rows, equal ids): a 64-bit hash per row, checked exactly
    (rows with equal hashes are compared; on a collision, ``np.unique`` over the rows decides)."""
    if not len(mat):
        return np.zeros(0, dtype=np.int64)
    mult = np.random.Generator(np.random.PCG64(12345)).integers(1, 2**63, size=mat.shape[1], dtype=np.uint64) | 1
    with np.errstate(over="ignore"):
        h = np.ascontiguousarray(mat).view(np.uint64) @ mult
        h = _mix64_(h, np.empty_like(h))
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    step = max(1, (1 << 20) // max(1, mat.shape[1]))  # check in chunks: temporaries of ~8 MB
    for a in range(0, len(mat), step):
        if not np.array_equal(mat[a : a + step], mat[first[inv[a : a + step]]]):  # a collision: exact ids
            return np.unique(mat, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return inv.astype(np.int64)


def block_reuse(w: Workload, block_size: int | None = None) -> np.ndarray:
    """Per request, its leading full blocks (at ``block_size`` tokens, default the trace's) already seen in an
    earlier request: the hits of an infinite prefix cache that keeps full blocks."""
    bs = block_size or w.default_block_size
    offsets, ids = _chained_full_blocks(w, bs)
    row = np.repeat(np.arange(len(w)), np.diff(offsets))
    if not len(ids):
        return np.zeros(len(w), dtype=np.int64)
    _, first = np.unique(ids, return_index=True)
    first_row = np.empty(int(ids.max()) + 1, dtype=np.int64)
    first_row[ids[first]] = row[first]
    return np.bincount(row[first_row[ids] < row], minlength=len(w)).astype(np.int64)


def expansion_stats(original: Workload, expanded: Workload) -> pd.DataFrame:
    """The original hash trace and its text expansion side by side (one row per statistic), at the trace's
    block size: requests, prompt tokens, full blocks, distinct full blocks, reused blocks (infinite cache),
    block reuse ratio, token hit rate (reused block tokens / prompt tokens), mean output tokens, and for the
    expansion the distinct token ids and the characters of its text."""
    bs = int(original.block_size)
    cols = {}
    for name, w in (("original", original), ("expanded", expanded)):
        offsets, ids = _chained_full_blocks(w, bs)
        hits = block_reuse(w, bs)
        cols[name] = {
            "requests": len(w),
            "prompt_tokens": int(w.input_length.sum()),
            "mean_input_tokens": float(w.input_length.mean()) if len(w) else 0.0,
            "full_blocks": int(len(ids)),
            "distinct_full_blocks": int(len(np.unique(ids))),
            "reused_blocks": int(hits.sum()),
            "block_reuse_ratio": float(hits.sum() / max(1, len(ids))),
            "token_hit_rate": float(hits.sum() * bs / max(1, int(w.input_length.sum()))),
            "mean_output_tokens": float(w.output_length.mean()) if len(w) else 0.0,
            "distinct_token_ids": int(len(np.unique(w.prompt_values))) if w.kind == "tokens" else None,
        }
    frame = pd.DataFrame({k: pd.Series(v, dtype=object) for k, v in cols.items()})  # ints stay ints
    frame.index.name = f"statistic (block size {bs} tokens)"
    return frame
