"""Expand a block-id (hash) trace into a token trace, so a real engine or a token-level hasher can run it.

Every block id gets a fixed pseudo-random block of ``block_size`` token ids, computed in counter mode from
``(seed, id, position)`` with SplitMix64: the same id always yields the same tokens (within one seed), and
different ids yield different blocks with overwhelming probability (two 16-token blocks over a 31,000-id
vocabulary collide with probability ~1e-72). A request's partial last block gets the first
``input_length - (nblocks - 1) * block_size`` tokens of its id's block.

Caveat (docs/semantics.md): expansion cannot reveal sharing *inside* an original block. Two requests whose
Mooncake blocks differ share no tokens in that block at all, so re-blocking the expanded trace at a
smaller block size (say 16 instead of 512) finds only the sharing the coarse ids already showed, at the
coarse granularity. Use expansion to run the engine; do not use it to study the effect of block size
(coarser sizes, i.e. multiples of the original, remain faithful).

Memory: the result stores one int64 per prompt token. The Mooncake conversation trace has 144.8 M prompt
tokens, so its expansion takes ~1.16 GB (temporaries are a few MB: the work runs in chunks of ~128 k
tokens) and 2-4 s. Expand a prefix with ``expand_to_tokens(workload.head(n))`` to keep it small.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import ConfigError
from kvlab.workload._common import csr
from kvlab.workload.workload import Workload

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_CHUNK_TOKENS = 1 << 17  # moderate chunks keep the temporaries near cache (~1.5x faster than 2M tokens)


def _mix64_(z: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (a bijection on uint64), in place on ``z`` (``tmp``: scratch of z's shape)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        np.right_shift(z, np.uint64(shift), out=tmp)
        z ^= tmp
        if mult is not None:
            z *= mult
    return z


def _block_keys(ids: np.ndarray, seed: int) -> np.ndarray:
    """Per-id stream key: a bijection of the id for a fixed seed (distinct ids → distinct keys)."""
    with np.errstate(over="ignore"):
        seed_key = np.array([seed], dtype=np.int64).view(np.uint64) + _GAMMA
        seed_key = _mix64_(seed_key, np.empty_like(seed_key))[0]
        z = np.asarray(ids, dtype=np.int64).view(np.uint64) * _GAMMA + seed_key
        return _mix64_(z, np.empty_like(z))


def _block_matrix(keys: np.ndarray, steps: np.ndarray, vocab_offset: int, vocab_size: int) -> np.ndarray:
    """``[len(keys), len(steps)]`` tokens: SplitMix64 of ``key + (pos + 1) * gamma`` (counter mode),
    mapped to ``[vocab_offset, vocab_size)`` by the multiply-high reduction of the top 32 bits."""
    with np.errstate(over="ignore"):
        z = keys[:, None] + steps[None, :]
        _mix64_(z, np.empty_like(z))
        z >>= np.uint64(32)
        z *= np.uint64(vocab_size - vocab_offset)
        z >>= np.uint64(32)
    out = z.view(np.int64)
    out += vocab_offset
    return out


def _steps(block_size: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (np.arange(block_size, dtype=np.uint64) + np.uint64(1)) * _GAMMA


def _steps_idx(block_size: int) -> np.ndarray:
    """``arange(block_size)[None, :]`` (row mask helper)."""
    return np.arange(block_size, dtype=np.int64)[None, :]


def _check_vocab(vocab_size: int, vocab_offset: int) -> None:
    if not 0 <= vocab_offset < vocab_size <= 2**32:
        raise ConfigError(
            f"need 0 <= vocab_offset < vocab_size <= 2**32, got vocab_offset {vocab_offset}, vocab_size {vocab_size}"
        )


def block_tokens(
    ids: np.ndarray | list[int],
    block_size: int,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    vocab_offset: int = 1000,
) -> np.ndarray:
    """The ``[len(ids), block_size]`` int64 token matrix that :func:`expand_to_tokens` uses for ``ids``."""
    _check_vocab(vocab_size, vocab_offset)
    keys = _block_keys(np.asarray(ids, dtype=np.int64), seed)
    return _block_matrix(keys, _steps(block_size), vocab_offset, vocab_size)


def expand_to_tokens(
    workload: Workload,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    vocab_offset: int = 1000,
    max_requests: int | None = None,
) -> Workload:
    """A ``kind="tokens"`` copy of a ``kind="blocks"`` workload (module docstring: rule, caveat, memory).

    Token ids lie in ``[vocab_offset, vocab_size)`` (the default offset keeps clear of the special and
    byte-fallback ids at the bottom of common vocabularies). Every per-request column is kept;
    ``meta["expanded"]`` records the parameters. Deterministic: same workload and seed → same tokens,
    and a request's tokens do not depend on the other requests, so ``max_requests=n`` (the same as
    expanding ``workload.head(n)``) gives exactly the first n requests of the full expansion.
    """
    if workload.kind != "blocks":
        raise ConfigError(f"expand_to_tokens needs a kind='blocks' workload, got kind={workload.kind!r}")
    if max_requests is not None:
        workload = workload.head(max_requests)
    _check_vocab(vocab_size, vocab_offset)
    w = workload
    bs = int(w.block_size)
    nblocks = np.diff(w.prompt_offsets)
    per_block = np.full(len(w.prompt_values), bs, dtype=np.int64)
    has = nblocks > 0
    per_block[w.prompt_offsets[1:][has] - 1] = w.input_length[has] - (nblocks[has] - 1) * bs
    tok_off = csr(per_block)
    out = np.empty(int(tok_off[-1]), dtype=np.int64)
    steps = _steps(bs)
    step = max(1, _CHUNK_TOKENS // bs)
    for b0 in range(0, len(per_block), step):
        b1 = min(b0 + step, len(per_block))
        m = _block_matrix(_block_keys(w.prompt_values[b0:b1], seed), steps, vocab_offset, vocab_size)
        cnt = per_block[b0:b1]
        # Row-major boolean selection keeps each block's first cnt tokens, blocks in order.
        out[tok_off[b0] : tok_off[b1]] = m.ravel() if cnt.min() == bs else m[_steps_idx(bs) < cnt[:, None]]
    meta = dict(w.meta)
    meta["expanded"] = {
        "from_block_size": bs,
        "seed": seed,
        "vocab_size": vocab_size,
        "vocab_offset": vocab_offset,
    }
    return Workload(
        arrival=w.arrival,
        input_length=w.input_length,
        output_length=w.output_length,
        prompt_offsets=csr(w.input_length),
        prompt_values=out,
        kind="tokens",
        block_size=None,
        request_id=w.request_id,
        session=w.session,
        turn=w.turn,
        parent=w.parent,
        tenant=w.tenant,
        category=w.category,
        adapter=w.adapter,
        salt=w.salt,
        output_offsets=w.output_offsets,
        output_values=w.output_values,
        name=w.name,
        source=w.source,
        checksum=w.checksum,
        meta=meta,
    )
