"""LFU with exponentially decaying frequency (half-life).

Source: exponentially decayed access counts, the "decayed LFU" / LRFU family (Lee et al., "LRFU: A
Spectrum of Policies that Subsumes the LRU and LFU Policies", IEEE ToC 2001, with the weighting
function ``F(x) = 2**(-x / half_life)``). A block's count is 1 at insertion; at a hit at time ``t`` it
becomes ``count * 2**(-(t - t_last) / half_life) + 1``. ``victim()`` is the block with the smallest
count *now*. Since every count decays by the same factor, that order never changes between a block's
events: it is the order of ``log2(count) + t_last / half_life``, kept in a heap.

Parameters: ``half_life`` (default 600) in units of ``clock``: ``"time"`` (``ctx.time``, seconds of
trace time; the default) or ``"requests"`` (``ctx.seq``, requests admitted). Documented choices: ties go
to the least recently unpinned block; a hit counts even while the block is pinned; pinned blocks are
out of the order and rejoin it at unpin; the count does not survive eviction. O(log n) per event.
"""

from __future__ import annotations

import math

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._queues import KeyedQueue
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("lfu-halflife")
class LFUHalfLife(EvictionPolicy):
    """Smallest ``(log2(count) + t_last / half_life, unpin stamp)`` first.

    Invariant: ``_state[bid] = (count at t_last, t_last)`` for every cached block."""

    source = "decayed LFU (LRFU-style 2^(-age/half_life) weighting)"

    def __init__(self, half_life: float = 600.0, clock: str = "time") -> None:
        if not half_life > 0:
            raise ConfigError(f"half_life must be > 0, got {half_life}")
        if clock not in ("time", "requests"):
            raise ConfigError(f"clock must be 'time' or 'requests', got {clock!r}")
        self.half_life = float(half_life)
        self.clock = clock
        self._queue = KeyedQueue()
        self._state: dict[int, tuple[float, float]] = {}

    def _now(self, ctx: AccessContext) -> float:
        return float(ctx.time if self.clock == "time" else ctx.seq)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._state[block.block_id] = (1.0, self._now(ctx))

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        count, last = self._state[block.block_id]
        now = self._now(ctx)
        self._state[block.block_id] = (count * 2.0 ** (-(now - last) / self.half_life) + 1.0, now)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._queue.pin(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        count, last = self._state[block.block_id]
        self._queue.push(block, math.log2(count) + last / self.half_life)

    def victim(self) -> KVBlock:
        return self._queue.first()

    def on_evict(self, block: KVBlock) -> None:
        self._queue.remove(block.block_id)
        del self._state[block.block_id]

    def __len__(self) -> int:
        return len(self._queue)
