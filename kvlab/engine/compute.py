"""The pool-compute primitive: a transformers causal LM whose K/V live in a paged pool.

A :class:`PagedModel` owns the model, a :class:`~kvlab.engine.kv_pool.KVPool` of ``capacity_blocks`` blocks of
``block_size`` token slots and the optional adapters. :meth:`PagedModel.forward_tokens` computes positions
``[start, start + T)`` of one sequence whose K/V are stored in given pool blocks and writes the new K/V
back: the only place a model runs on the pool. It knows nothing of keys, lookups or eviction: which
blocks a sequence holds is its caller's business — the sequential driver
(:class:`~kvlab.engine.driver.Engine`) or the scheduler's KV manager through
:class:`~kvlab.sim.engine_executor.EngineExecutor`.

Invariant: position ``p`` of a sequence stored in ``block_ids`` lives in slot ``p % block_size`` of pool
block ``block_ids[p // block_size]``. Units: tokens, blocks, bytes, seconds (``*_s``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvlab.engine.adapters import AdapterSet
from kvlab.engine.kv_pool import KVLayout, KVPool
from kvlab.engine.model import (  # sync_device: also this module's public name
    cache_from_kv,
    cache_length,
    forward_logits,
    kv_from_cache,
    masked_gqa,
    model_device,
    model_dtype,
    model_id,
    probe_kv,
    resolve_device,
    resolve_dtype,
    sync_device,
    vocab_size,
)
from kvlab.errors import ConfigError
from kvlab.names import renamed_attribute, renamed_keyword

if TYPE_CHECKING:
    from kvlab.engine.batched import BatchEntry



class PagedModel:
    """A causal LM and its paged KV pool (module docstring).

    Capacity: exactly one of ``capacity_blocks`` (pool blocks) or ``capacity_bytes`` (converted to whole
    blocks of ``layout.bytes_per_block`` bytes); the old keyword and attribute ``num_blocks`` still mean
    ``capacity_blocks`` (:data:`kvlab.names.KEYWORD_ALIASES`). ``dtype`` is the pool's (default: the model's
    K/V dtype; a narrower one makes reuse lossy). ``device`` defaults to the model's; a model elsewhere is
    moved there. ``adapters`` serves sequences that name an adapter. ``num_threads`` sets torch's CPU threads
    (None: leave as is; ignored on accelerators).
    """

    num_blocks = renamed_attribute("capacity_blocks")

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        block_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        adapters: AdapterSet | None = None,
        num_threads: int | None = 2,
        **old_names: int | None,
    ) -> None:
        capacity_blocks = renamed_keyword(type(self).__name__, "capacity_blocks", capacity_blocks, old_names)
        if (capacity_blocks is None) == (capacity_bytes is None):
            raise ConfigError("give exactly one of capacity_blocks and capacity_bytes")
        self.device = model_device(model) if device is None else resolve_device(device)
        if model_device(model) != self.device:
            model.to(self.device)
        if self.device.type == "cpu" and num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.model = model.eval()
        self.model_dtype = model_dtype(model)
        self.model_id = model_id(model)
        self.vocab_size = vocab_size(model)
        kv = probe_kv(model)
        self.layout = KVLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, int(block_size),
                               resolve_dtype(dtype, kv.dtype))
        self.kv_dtype = kv.dtype
        if capacity_bytes is not None:
            capacity_blocks = self.layout.blocks_for_bytes(int(capacity_bytes))
        self.block_size = int(block_size)
        self.pool = KVPool(self.layout, int(capacity_blocks), self.device)
        self.adapters = adapters
        self.num_threads = num_threads

    @property
    def capacity_blocks(self) -> int:
        """Blocks in the pool (the tensor's ``KVPool.num_blocks``)."""
        return self.pool.num_blocks

    @property
    def capacity_bytes(self) -> int:
        """Bytes of K/V the pool holds (``capacity_blocks x bytes_per_block``)."""
        return self.pool.nbytes

    def forward_tokens(
        self,
        tokens: np.ndarray | Sequence[int],
        block_ids: Sequence[int],
        start: int,
        *,
        working: object | None = None,
        adapter: str | None = None,
        times: dict | None = None,
    ) -> tuple[torch.Tensor, object]:
        """Compute the K/V of ``tokens`` at positions ``[start, start + T)`` of a sequence stored in the pool
        blocks ``block_ids`` (they must cover ``start + T`` positions), write them to the pool and return
        ``(last logits, working cache)``.

        ``working``: the sequence's working cache (transformers ``DynamicCache``) holding exactly positions
        ``[0, start)``; None gathers them from the pool (a fresh request after its prefix hits, or one
        recomputed after preemption). Chunked prefill: call once per chunk with the same working cache.
        ``times`` receives ``gather_s``, ``forward_s``, ``write_s`` (device-synchronised seconds).
        """
        if adapter is not None and self.adapters is None:
            raise ConfigError(f"adapter {adapter!r} requested but the engine has no AdapterSet")
        dev = self.device
        t0 = time.perf_counter()
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=dev).view(1, -1)
        ctx = self.adapters.use(adapter) if self.adapters is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            gathered = working is None
            if gathered:
                gather_ids = self._gather_ids(list(block_ids[: -(-start // self.block_size)]))
                working = cache_from_kv(self.pool.gather(gather_ids, start), self.layout.num_layers, self.kv_dtype)
            elif cache_length(working) != start:
                raise ConfigError(f"the working cache holds {cache_length(working)} positions, not start={start}")
            sync_device(dev)
            t1 = time.perf_counter()
            first = self._suffix_start(start) if gathered and start > 0 else start
            pos = torch.arange(first, first + ids.shape[1], device=dev).view(1, -1)
            with masked_gqa(dev.type == "cpu" and ids.shape[1] > 1 and start > 0):
                logits = forward_logits(self.model, ids, pos, working)
            sync_device(dev)
            t2 = time.perf_counter()
            self.pool.write(block_ids, start, kv_from_cache(working, start))
            sync_device(dev)
        if times is not None:
            times.update(gather_s=t1 - t0, forward_s=t2 - t1, write_s=time.perf_counter() - t2)
        return logits, working

    def forward_batch(
        self,
        entries: Sequence[BatchEntry],
        *,
        all_logits: bool = False,
        adapter: str | None = None,
        times: dict | None = None,
    ) -> list[torch.Tensor]:
        """One forward over many sequences (prefill chunks and decode tokens mixed, packed): each entry's
        tokens at positions ``[start, start + n)`` of the sequence in its ``block_ids``; attention reads the
        pool through the block tables, no working cache. Returns each entry's last logits ``[vocab]`` (or
        ``[n, vocab]`` with ``all_logits``). See :func:`kvlab.engine.batched.forward_batch`."""
        from kvlab.engine.batched import forward_batch

        return forward_batch(self, entries, all_logits=all_logits, adapter=adapter, times=times)

    # Seams for kvlab.engine.faults (identities here): where a gathered sequence's K/V come from, and the
    # position its suffix starts at after a gather.
    def _gather_ids(self, block_ids: list[int]) -> list[int]:
        return block_ids

    def _suffix_start(self, start: int) -> int:
        return start
