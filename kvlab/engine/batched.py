"""Batched forward over the paged pool: many sequences in one model call (varlen packing, issue 13).

:func:`forward_batch` runs one forward of a transformers causal LM over a batch of *entries*, each a
sequence's new tokens at positions ``[start, start + n)`` — prefill chunks from 0, prefill chunks that
continue a sequence whose earlier positions (or prefix hits) are already in the pool, single decode tokens —
mixed freely. The new tokens of all entries are packed into one row (``input_ids`` ``[1, T]``,
``T = sum n``) and ``position_ids`` ``[1, T]`` holds each token's position in *its own* sequence, so the
embeddings, norms, MLPs, projections and RoPE run once on the packed tokens.

Attention is a custom function registered with transformers' ``AttentionInterface`` under
:data:`ATTN_NAME` and selected for the duration of the call through ``config._attn_implementation``. The
batch metadata (:class:`BatchPlan`) reaches it as the keyword ``kvlab_batch``: transformers forwards a
model's extra keywords through every decoder layer to the attention function. transformers builds no mask
for an implementation it has no mask function for (``masking_utils._preprocess_mask_arguments``), so no
packed ``T x T`` (or ``T x context``) mask ever exists. Per layer (``module.layer_idx``) the function

1. writes the packed new K (after RoPE) and V of every entry into its pool slots — one indexed assignment;
2. gathers, for every entry, its blocks covering positions ``[0, start + n)`` — one ``index_select`` of
   whole blocks over the concatenated block tables, already in SDPA's ``[2, kv_heads, tokens, head_dim]``
   layout (the transient per-layer gather: ``O(sum_i ceil((start_i + n_i) / block_size) x block_size)``
   tokens of one layer, freed before the next layer);
3. runs ``scaled_dot_product_attention`` per entry on its ``n`` queries (query ``i`` sees positions
   ``<= start + i``: no mask for a decode token, ``is_causal`` for a chunk from 0, an ``n x (start + n)``
   boolean mask for a chunk after cached tokens), grouped-query heads through ``enable_gqa``;
4. concatenates the outputs in packed order.

There is no working cache (``use_cache=False``): the pool is the only K/V memory, and attention reads
every position — the new ones included — back from it, in the pool's dtype (as vLLM's paged kernels do).
With the pool in the model's dtype (the default) the logits equal :meth:`PagedModel.forward_tokens` run on
each entry in turn to float rounding (tests: 1e-5 in fp32).

Invariant (as :mod:`kvlab.engine.compute`): position ``p`` of a sequence with block table ``block_ids``
lives in slot ``p % block_size`` of pool block ``block_ids[p // block_size]``. Entries may share leading
blocks (prefix hits) that they only read, also a block another entry of the batch writes in this forward
(the scheduler's ``cache_at="schedule"``: a later request hits a block an earlier one completes in the same
step): each layer writes every entry's new K/V before any entry reads, so the reader sees it, as in vLLM's
step. Two entries must not write one block (checked). Units: tokens, blocks, seconds (``*_s``).

Why not FlexAttention: on the CPU it needs ``torch.compile`` (the eager path materialises the scores and
is slower than SDPA), and a block mask over the packed batch is the quadratic object this avoids. Why not
transformers' own continuous batching (``generation/continuous_batching``): it keeps its own
``PagedAttentionCache`` (per-layer tensors, not this pool's layout) and, for eager/SDPA, builds a packed
``[T, T + read]`` additive mask per step; its varlen path needs the CUDA flash-attention kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface

from kvlab.engine.model import _call_spec, sync_device
from kvlab.errors import ConfigError

ATTN_NAME = "kvlab_paged"
BATCH_KW = "kvlab_batch"


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's share of a batched forward: ``tokens`` at positions ``[start, start + len(tokens))``
    of the sequence stored in pool blocks ``block_ids`` (they must cover ``start + len(tokens)`` positions;
    positions ``[0, start)`` must already be in the pool)."""

    block_ids: Sequence[int]
    start: int
    tokens: Sequence[int] | np.ndarray


@dataclass
class _Seq:
    """Where one entry lives in the packed tensors (token offsets)."""

    q_off: int  # first packed query row
    n: int  # new tokens (queries)
    kv_off: int  # first gathered token slot of this entry (block-aligned)
    length: int  # visible positions of the last query: start + n
    mask: torch.Tensor | None  # [n, length] bool (True = attend) or None
    causal: bool  # use SDPA's is_causal (start == 0 and n > 1)


@dataclass
class BatchPlan:
    """Per-batch metadata built once per forward and read by every layer's attention call.

    ``write_blocks``/``write_slots`` ``[T]``: the pool (block, slot) of each packed token;
    ``read_blocks`` ``[B]``: the concatenated block tables (each entry's first ``ceil((start + n) / bs)``
    blocks); ``seqs``: per-entry offsets. ``calls`` counts attention calls (one per layer), ``gathered``
    the largest per-layer gather in token slots, ``attn_s`` the time spent in the attention function.
    """

    pool: torch.Tensor  # the pool's data [num_blocks, layers, 2, kv_heads, block_size, head_dim]
    write_blocks: torch.Tensor
    write_slots: torch.Tensor
    read_blocks: torch.Tensor
    seqs: list[_Seq]
    gqa: bool
    calls: int = 0
    gathered: int = 0
    attn_s: float = 0.0
    masks_seen: list = field(default_factory=list)  # attention_mask arguments seen (None expected)


def plan_batch(entries: Sequence[BatchEntry], pool: torch.Tensor, block_size: int, *,
               read_ids: Callable[[list[int]], list[int]] | None = None,
               suffix_start: Callable[[int], int] | None = None) -> tuple[BatchPlan, np.ndarray, np.ndarray]:
    """Validate ``entries`` and build the :class:`BatchPlan`; also return the packed token ids ``[T]`` and
    positions ``[T]`` (int64). Raises ConfigError on an empty entry, a block table too short, a block id
    outside the pool, or a block written by two entries (one entry may read a block another writes).

    ``read_ids`` / ``suffix_start``: the engine's fault seams (:mod:`kvlab.engine.faults`; identities in an honest
    engine, None skips them): the blocks read for an entry's full blocks before ``start``, and the position its
    new tokens start at when ``start > 0`` (slots and visibility keep the true ``start``)."""
    if not entries:
        raise ConfigError("forward_batch needs at least one entry")
    bs = int(block_size)
    num_blocks = int(pool.shape[0])
    toks, poss, wb, ws, reads, seqs = [], [], [], [], [], []
    q_off = kv_off = 0
    written: dict[int, int] = {}
    dev = pool.device
    for i, e in enumerate(entries):
        tokens = np.asarray(e.tokens, dtype=np.int64).reshape(-1)
        n, start = int(tokens.size), int(e.start)
        if n == 0:
            raise ConfigError(f"batch entry {i} has no tokens")
        if start < 0:
            raise ConfigError(f"batch entry {i}: start must be >= 0, got {start}")
        end = start + n
        need = -(-end // bs)
        table = [int(b) for b in e.block_ids]
        if len(table) < need:
            raise ConfigError(f"batch entry {i}: {len(table)} blocks of {bs} cannot hold positions [{start}, {end})")
        table = table[:need]
        if min(table) < 0 or max(table) >= num_blocks:
            raise ConfigError(f"batch entry {i}: block ids must be in [0, {num_blocks}), got {table}")
        pos = np.arange(start, end, dtype=np.int64)
        tbl = np.asarray(table, dtype=np.int64)
        blocks = tbl[pos // bs]
        if read_ids is not None and start >= bs:
            tbl = tbl.copy()
            tbl[:start // bs] = read_ids(table[:start // bs])
        for b in set(blocks.tolist()):
            if written.setdefault(b, i) != i:
                raise ConfigError(f"block {b} is written by batch entries {written[b]} and {i}")
        toks.append(tokens)
        first = suffix_start(start) if suffix_start is not None and start > 0 else start
        poss.append(pos if first == start else np.arange(first, first + n, dtype=np.int64))
        wb.append(blocks)
        ws.append(pos % bs)
        reads.append(tbl)
        if n == 1:
            mask, causal = None, False
        elif start == 0:
            mask, causal = None, True
        else:
            q = torch.arange(start, end, device=dev).view(-1, 1)
            mask, causal = torch.arange(end, device=dev).view(1, -1) <= q, False
        seqs.append(_Seq(q_off, n, kv_off, end, mask, causal))
        q_off += n
        kv_off += need * bs
    as_t = lambda parts: torch.as_tensor(np.concatenate(parts), dtype=torch.long, device=dev)  # noqa: E731
    plan = BatchPlan(pool, as_t(wb), as_t(ws), as_t(reads), seqs, gqa=True)
    return plan, np.concatenate(toks), np.concatenate(poss)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function :data:`ATTN_NAME` (module docstring, steps 1-4).

    ``query`` ``[1, q_heads, T, head_dim]``, ``key``/``value`` ``[1, kv_heads, T, head_dim]`` (the packed new
    tokens, keys after RoPE); returns ``([1, T, q_heads, head_dim], None)`` as transformers' SDPA does.
    """
    plan = kwargs.get(BATCH_KW)
    if not isinstance(plan, BatchPlan):
        raise ConfigError(f"attention {ATTN_NAME!r} needs the batch plan as keyword {BATCH_KW!r}")
    t0 = time.perf_counter()
    plan.calls += 1
    if attention_mask is not None:
        plan.masks_seen.append(tuple(attention_mask.shape))
    layer = int(module.layer_idx)
    data = plan.pool.select(1, layer)  # [N, 2, H, bs, D], a view of the pool
    # 1. write the new K/V: [T, 2, H, D] into (block, slot) pairs
    new = torch.stack((key[0], value[0])).permute(2, 0, 1, 3)
    data.permute(0, 3, 1, 2, 4)[plan.write_blocks, plan.write_slots] = new.to(data.dtype)
    # 2. gather every entry's blocks at once: [2, H, B * bs, D] (one copy, in sequence order per entry)
    picked = data.permute(1, 2, 0, 3, 4).index_select(2, plan.read_blocks)
    kv = picked.flatten(2, 3)
    if kv.dtype != query.dtype:
        kv = kv.to(query.dtype)
    plan.gathered = max(plan.gathered, int(kv.shape[2]))
    groups = query.shape[1] // key.shape[1]
    outs = []
    for s in plan.seqs:
        q = query[:, :, s.q_off:s.q_off + s.n]
        k = kv[0, :, s.kv_off:s.kv_off + s.length].unsqueeze(0)
        v = kv[1, :, s.kv_off:s.kv_off + s.length].unsqueeze(0)
        if groups > 1 and not plan.gqa:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=s.mask, is_causal=s.causal, scale=scaling, enable_gqa=groups > 1 and plan.gqa))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    plan.attn_s += time.perf_counter() - t0
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, paged_attention)


@contextlib.contextmanager
def paged_attention_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through :data:`ATTN_NAME` inside the context; restore its own afterwards."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def forward_batch(
    paged: object,
    entries: Sequence[BatchEntry],
    *,
    all_logits: bool = False,
    adapter: str | None = None,
    times: dict | None = None,
) -> list[torch.Tensor]:
    """One forward of ``paged.model`` (a :class:`~kvlab.engine.compute.PagedModel`) over ``entries``
    (module docstring); writes every entry's new K/V to the pool and returns per entry its last token's
    logits ``[vocab]`` or, with ``all_logits``, ``[n, vocab]``, in the model's dtype, in entry order.

    ``adapter``: one adapter for the whole batch (None: the base model). ``times`` receives ``plan_s``,
    ``forward_s`` (device-synchronised, attention included), ``attn_s`` (inside the attention function,
    host time), ``gather_tokens`` (largest per-layer gather, token slots), ``attn_calls`` and
    ``attn_masks`` (attention masks transformers passed in: 0, none is built).
    """

    if adapter is not None and paged.adapters is None:
        raise ConfigError(f"adapter {adapter!r} requested but the engine has no AdapterSet")
    dev = paged.device
    t0 = time.perf_counter()
    plan, tokens, positions = plan_batch(entries, paged.pool.data, paged.block_size, read_ids=paged._gather_ids,
                                         suffix_start=paged._suffix_start)
    plan.gqa = dev.type == "cpu" or all(s.mask is None for s in plan.seqs)
    ids = torch.as_tensor(tokens, device=dev).view(1, -1)
    pos = torch.as_tensor(positions, device=dev).view(1, -1)
    kwargs: dict = {"use_cache": False, "position_ids": pos, BATCH_KW: plan}
    last = torch.as_tensor(np.cumsum([s.n for s in plan.seqs]) - 1, dtype=torch.long, device=dev)
    keep = not all_logits and _call_spec(paged.model).logits_to_keep
    if keep:
        kwargs["logits_to_keep"] = last
    ctx = paged.adapters.use(adapter) if paged.adapters is not None else contextlib.nullcontext()
    t1 = time.perf_counter()
    with torch.no_grad(), ctx, paged_attention_mode(paged.model):
        logits = paged.model(input_ids=ids, **kwargs).logits[0]
    sync_device(dev)
    if plan.calls != paged.layout.num_layers:
        raise ConfigError(f"{type(paged.model).__name__} called the {ATTN_NAME!r} attention {plan.calls} times for "
                          f"{paged.layout.num_layers} layers; it does not route attention through AttentionInterface")
    if times is not None:
        times.update(plan_s=t1 - t0, forward_s=time.perf_counter() - t1, attn_s=plan.attn_s,
                     gather_tokens=plan.gathered, attn_calls=plan.calls,
                     attn_masks=len(plan.masks_seen))
    if all_logits:
        return list(torch.split(logits, [s.n for s in plan.seqs]))
    return list((logits if keep else logits.index_select(0, last)).unbind(0))
