"""CLOCK with an n-bit counter (second chance for ``bits=1``).

Source: Corbató's CLOCK (1968) in libCacheSim's form (``Clock.c``, FIFO-reinsertion): a hit raises the
block's counter by one up to ``2**bits - 1``; ``victim()`` looks at the oldest block, and while its
counter is positive decrements it and moves it to the newest end (the hand passes it), evicting the
first block found at zero. Parameters: ``bits`` (libCacheSim ``n-bit-counter``, default 1) and
``init_freq`` (counter of a new block, libCacheSim ``init-freq``, default 0). Documented choices:

* a new block joins the queue when first unpinned (its request released), so the victims a request
  causes never depend on its own new blocks; a request's blocks enter tail first (release order);
* a pinned block met by the hand is passed (moved to the newest end) *without* touching its counter;
* hits count even while the block is pinned; state does not survive eviction.

On object sequences this is libCacheSim's Clock hit for hit (same ``bits`` / ``init_freq``).
Amortised O(1) per event (an OrderedDict is the circular queue).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated

from pydantic import Field

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies.base import EvictionPolicy, param_error, register_policy


@register_policy("clock")
class Clock(EvictionPolicy):
    """Invariants: ``_queue`` = queued blocks, front = next under the hand; ``_freq`` covers every cached
    block and stays in ``[0, 2**bits - 1]``; ``_pinned`` = queued blocks now pinned."""

    source = "CLOCK with n-bit counters (libCacheSim Clock, FIFO-reinsertion form)"

    def __init__(
        self,
        bits: Annotated[int, Field(ge=1, le=32)] = 1,  # 32-bit counters exceed any hit count
        init_freq: Annotated[int, Field(ge=0, description="an integer in [0, 2**bits - 1]")] = 0,
    ) -> None:
        self.bits = int(bits)
        self.max_freq = (1 << self.bits) - 1
        if not init_freq <= self.max_freq:
            allowed = f"an integer in [0, 2**bits - 1] = [0, {self.max_freq}]"
            raise param_error(self.name, "init_freq", allowed, init_freq)
        self.init_freq = int(init_freq)
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._pinned: set[int] = set()

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._freq[block.block_id] = self.init_freq

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        if self._freq[bid] < self.max_freq:
            self._freq[bid] += 1

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._pinned.add(block.block_id)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        if bid in self._queue:
            self._pinned.discard(bid)
        else:
            self._queue[bid] = block

    def victim(self) -> KVBlock:
        queue, freq, pinned = self._queue, self._freq, self._pinned
        while True:
            bid = next(iter(queue))
            if bid in pinned:
                queue.move_to_end(bid)
                continue
            f = freq[bid]
            if f == 0:
                return queue[bid]
            freq[bid] = f - 1
            queue.move_to_end(bid)

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        del self._freq[bid]
        self._queue.pop(bid, None)
        self._pinned.discard(bid)

    def __len__(self) -> int:
        return len(self._queue) - len(self._pinned)
