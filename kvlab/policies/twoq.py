"""2Q: a FIFO for first accesses (A1in), a ghost FIFO of keys evicted from it (A1out), an LRU (Am).

Source: Johnson & Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
Algorithm", VLDB'94 (the "full" version), in libCacheSim's form (``TwoQ.c``; parameters and defaults
``ain_ratio=0.25``, ``aout_ratio=0.5``; sizes ``Kin = int(C * ain_ratio)``, ``Kout = int(C * aout_ratio)``):

* a new block goes to Am if its key is in A1out (the key leaves A1out), else to the tail of A1in;
* a hit in A1in changes nothing (correlated references); a hit in Am makes the block most recent;
* ``victim()``: A1in's oldest block if A1in holds more than ``Kin`` blocks, its key then entering
  A1out (oldest keys dropped beyond ``Kout``); otherwise Am's least recent block.

Documented choices for the prefix cache: a new block is placed when first unpinned (its request
released), so the victims of a request never depend on its own new blocks, and A1out is trimmed at
each unpin after that placement (on object sequences this equals libCacheSim, where the key leaves
A1out before the eviction pushes one); A1in keeps its entry order through pin/unpin, Am is ordered by
unpin time (vLLM's LRU order); ``|A1in|`` counts placed blocks, pinned or not; if the chosen queue has
no evictable block the other one is used; only A1out remembers a key after eviction.
On object sequences this is libCacheSim's TwoQ hit for hit. O(1) per event but for A1in blocks
pinned while at its head (O(log n)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._queues import FifoQueue
from kvlab.policies.base import EvictionPolicy, register_policy


@register_policy("2q")
class TwoQ(EvictionPolicy):
    """Invariants: ``_ain`` holds A1in's blocks in entry order (``members`` counts them, pinned or not),
    ``_am`` Am's evictable blocks in LRU order, ``_in_am`` all of Am's; ``_aout`` holds at most
    ``aout_size`` keys after an unpin."""

    source = "2Q (Johnson & Shasha, VLDB'94; libCacheSim TwoQ parameters)"

    def __init__(self, ain_ratio: float = 0.25, aout_ratio: float = 0.5) -> None:
        if not 0.0 <= ain_ratio < 1.0 or aout_ratio < 0.0:
            raise ConfigError("2q needs 0 <= ain_ratio < 1 and aout_ratio >= 0")
        self.ain_ratio = float(ain_ratio)
        self.aout_ratio = float(aout_ratio)
        self._ain = FifoQueue()
        self._am: OrderedDict[int, KVBlock] = OrderedDict()
        self._in_am: set[int] = set()
        self._aout: OrderedDict[Hashable, None] = OrderedDict()

    def attach(self, cache: object) -> None:
        """Size A1in and A1out for the cache's capacity ``C`` (in blocks)."""
        self.capacity = cache.num_blocks  # type: ignore[attr-defined]
        self.ain_size = int(self.capacity * self.ain_ratio)
        self.aout_size = int(self.capacity * self.aout_ratio)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        if bid in self._in_am:
            del self._am[bid]
        else:
            self._ain.pin(bid)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        aout = self._aout
        if bid in self._in_am:
            self._am[bid] = block
        elif bid in self._ain:
            self._ain.unpin(bid)
        elif block.key in aout:  # first unpin of a block whose key was in A1out: Am
            del aout[block.key]
            self._in_am.add(bid)
            self._am[bid] = block
        else:  # first unpin: tail of A1in
            self._ain.append(block)
        while len(aout) > self.aout_size:
            aout.popitem(last=False)

    def victim(self) -> KVBlock:
        if (self._ain.members > self.ain_size and self._ain) or not self._am:
            return self._ain.first()
        return next(iter(self._am.values()))

    def on_evict(self, block: KVBlock) -> None:
        bid = block.block_id
        if bid in self._in_am:
            self._in_am.discard(bid)
            self._am.pop(bid, None)
        elif bid in self._ain:
            self._ain.remove(bid)
            if self.aout_size > 0 and block.key not in self._aout:
                self._aout[block.key] = None

    def on_remove(self, block: KVBlock) -> None:
        bid = block.block_id
        if bid in self._in_am:
            self._in_am.discard(bid)
            self._am.pop(bid, None)
        elif bid in self._ain:
            self._ain.remove(bid)

    def __len__(self) -> int:
        return len(self._ain) + len(self._am)
