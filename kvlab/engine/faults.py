"""Fault injection for the oracle's mutation tests: an engine that breaks one step on purpose.

:class:`FaultyEngine` is an :class:`~kvlab.engine.driver.Engine` with ``faults`` switched on; each fault
overrides one seam of the engine (the honest engine's seams are identities), so nothing of this runs in
an ordinary ``Engine``. It exists to show that the oracle (:mod:`kvlab.engine.verify`) catches each bug
(tests/test_engine.py, "mutations"). Never use it for measurements.

Faults (name, value type: the seam it overrides — what breaks):

* ``position_offset``, int: ``_suffix_start`` — the suffix after a hit starts at ``hit_tokens + offset``;
* ``wrong_block``, bool: ``_gather_ids`` — the gather reads block ``(b + 1) % capacity_blocks`` for hit block ``b``;
* ``stale_block``, bool: ``_compute_prefill`` — a prefill's K/V writes into blocks taken by eviction are lost;
* ``reuse_evicted``, bool: ``_lookup`` and ``_cached`` — a never-invalidated key -> block memo extends
  lookups past a miss with blocks that were evicted and reallocated to another prefix.

The batched forward (:func:`kvlab.engine.batched.forward_batch`, continuous batching under the scheduler) goes
through the same compute seams: ``wrong_block`` remaps the full blocks an entry reads before its ``start``,
``position_offset`` shifts the positions of an entry that continues a sequence (``start > 0``); ``stale_block``
(:meth:`FaultyEngine.forward_batch`) loses a prefill chunk's writes into a block that held K/V of an earlier
forward (a block reused after eviction or release: the executor does not see which). ``reuse_evicted`` is a
fault of this driver's own lookup; under the scheduler the lookups are the KV cache manager's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.cache import KVBlock
from kvlab.cache.manager import KVRequest
from kvlab.engine.batched import BatchEntry
from kvlab.engine.driver import Engine
from kvlab.engine.request import Request
from kvlab.errors import ConfigError

FAULTS: dict[str, type] = {
    "position_offset": int,  # the suffix after a hit starts at position hit_tokens + offset (an off-by-one)
    "wrong_block": bool,  # the gather reads block (b + 1) % capacity_blocks instead of hit block b
    "stale_block": bool,  # at prefill, the K/V write into a block taken by eviction is lost: it keeps the old K/V
    "reuse_evicted": bool,  # an engine-side key -> block memo, never invalidated, extends lookups past a
    # miss with blocks that were evicted and reallocated to another prefix
}


def check_faults(faults: dict | None) -> dict:
    """``faults`` checked against :data:`FAULTS` (names and value types); the ones switched off dropped."""
    out = dict(faults or {})
    for name, value in out.items():
        kind = FAULTS.get(name)
        if kind is None:
            raise ConfigError(f"unknown fault {name!r}; faults: {', '.join(FAULTS)}")
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"fault {name!r} takes an int, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"fault {name!r} takes a bool, got {value!r}")
    return {k: v for k, v in out.items() if v}


class FaultyEngine(Engine):
    """An :class:`Engine` (same arguments) that injects ``faults`` (module docstring; the config records them)."""

    def __init__(self, model: torch.nn.Module, *, faults: dict | None = None, **kwargs: object) -> None:
        super().__init__(model, **kwargs)
        self.faults = check_faults(faults)
        self._memo: dict[int, KVBlock] = {}  # reuse_evicted: dense key -> the block last keyed with it
        self._written: set[int] = set()  # stale_block, batched: pool blocks some forward_batch wrote
        self.lost_writes = 0  # stale_block, batched: blocks whose writes were lost

    # ------------------------------------------------------------------ compute seams (PagedModel)
    def _gather_ids(self, block_ids: list[int]) -> list[int]:
        if self.faults.get("wrong_block"):
            return [(b + 1) % self.capacity_blocks for b in block_ids]
        return block_ids

    def _suffix_start(self, start: int) -> int:
        return start + self.faults.get("position_offset", 0)

    def forward_batch(self, entries: Sequence[BatchEntry], **kwargs: object) -> list[torch.Tensor]:
        """``stale_block``: a prefill chunk's (``n > 1``) writes into blocks it starts (slot 0) that an earlier
        batched forward wrote are lost (the pool keeps the old K/V; this forward's own logits are unaffected)."""
        if not self.faults.get("stale_block"):
            return super().forward_batch(entries, **kwargs)
        bs = self.block_size
        victims, written = [], []
        for e in entries:
            n, start = len(e.tokens), int(e.start)
            blocks = [int(b) for b in e.block_ids[start // bs: -(-(start + n) // bs)]]
            written += blocks
            if n > 1:
                first = -(-start // bs)  # blocks the chunk fills from slot 0
                victims += [b for b in e.block_ids[first: -(-(start + n) // bs)] if int(b) in self._written]
        kept = self.pool.data[victims].clone() if victims else None
        out = super().forward_batch(entries, **kwargs)
        if kept is not None:
            self.pool.data[victims] = kept
            self.lost_writes += len(victims)
        self._written.update(written)
        return out

    # ------------------------------------------------------------------ driver seams (Engine)
    def _compute_prefill(self, request: Request, blocks: list[KVBlock], taken: list[KVBlock], start: int,
                         times: dict) -> tuple[torch.Tensor, object]:
        victims = [b.block_id for b in taken] if self.faults.get("stale_block") else []
        kept = self.pool.data[victims].clone() if victims else None
        out = super()._compute_prefill(request, blocks, taken, start, times)
        if kept is not None:  # the writes into blocks taken by eviction are lost
            self.pool.data[victims] = kept
        return out

    def _cached(self, keys: Sequence[int], blocks: Sequence[KVBlock], start: int) -> None:
        if self.faults.get("reuse_evicted"):
            self._memo.update(zip(keys[start:start + len(blocks)], blocks, strict=True))

    def _lookup(self, kv: KVRequest) -> list[KVBlock]:
        hits = super()._lookup(kv)
        if self.faults.get("reuse_evicted"):
            hits = self._stale_hits(hits, kv.keys, self.cache.max_hit_blocks(kv.num_tokens, len(kv.keys), "vllm"))
        return hits

    def _stale_hits(self, hits: list[KVBlock], keys: list[int], max_hit: int) -> list[KVBlock]:
        """Extend ``hits`` through the memo without checking that a block still holds its key."""
        out = list(hits)
        for i in range(len(out), max_hit):
            block = self._memo.get(keys[i])
            if block is None or block in out or block.ref_cnt != 0 or block.key is None:
                break
            out.append(block)
        return out
