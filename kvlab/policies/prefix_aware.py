"""Prefix-aware wrapper: any policy, restricted to leaf blocks of the prefix tree.

A block whose key has cached children (``cache.num_cached_children(key) > 0``) is not evicted while a
leaf is evictable: evicting it would orphan its cached descendants (unreachable, since lookup stops at
the first miss), as SGLang's radix tree, RAGCache's knowledge tree and TensorRT-LLM's free queues avoid.
``prefix_aware(inner)`` or ``make_policy("prefix-aware", inner="lfu", inner_params={...})`` wraps any
registered policy; ``prefix-aware-lru`` and ``prefix-aware-lfu`` are registered shortcuts.

How it walks the inner order efficiently (the inner policy is a black box with the hooks of
``EvictionPolicy``): ``victim()`` asks the inner policy for its victim; a leaf is returned as is. A
non-leaf is *parked*: hidden from the inner policy with ``on_pin`` (as if a request held it) and kept
aside, grouped by key, and the inner policy is asked again. When a block is evicted or removed, its
parent key is marked; at the next ``victim()`` the parked blocks of each marked key that has no cached
children left are given back to the inner policy with ``on_unpin``. So the order among leaves is the
inner policy's own order, except that a block parked once re-enters as if unpinned when it becomes a
leaf (for LRU: at the most recent end). A block is parked at most once per non-leaf period, so the
cost is O(1) inner events per block and period on top of the inner policy's own. If every evictable
block is parked (each has a pinned child, e.g. duplicates of a running prefix), the block parked first
is evicted. Hooks other than pin/unpin/evict are forwarded unchanged (a parked block's hits reach the
inner policy as hits on a pinned block); hidden blocks are unpinned with the latest context seen.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvlab.cache.block import KVBlock
from kvlab.cache.context import NO_CONTEXT, AccessContext
from kvlab.policies.base import EvictionPolicy, make_policy, register_policy


@register_policy("prefix-aware")
class PrefixAware(EvictionPolicy):
    """Evict only blocks without cached children, in the inner policy's order."""

    source = "leaf-only eviction (SGLang / RAGCache / TensorRT-LLM radix trees) around any policy"

    def __init__(self, inner: str | EvictionPolicy = "lru", inner_params: dict | None = None) -> None:
        self.inner = make_policy(inner, **(inner_params or {}))
        self._parked: dict[Hashable, dict[int, KVBlock]] = {}  # key -> parked blocks
        self._order: dict[int, KVBlock] = {}  # every parked block, in parking order
        self._dirty: list[Hashable] = []
        self._ctx: AccessContext = NO_CONTEXT
        self._children = None
        i = self.inner
        self._i_insert, self._i_hit, self._i_pin, self._i_unpin = i.on_insert, i.on_hit, i.on_pin, i.on_unpin
        self._i_evict, self._i_victim = i.on_evict, i.victim

    def attach(self, cache: object) -> None:
        self._children = cache.num_cached_children  # type: ignore[attr-defined]
        self.inner.attach(cache)

    def prepare(self, encoded: object) -> None:
        self.inner.prepare(encoded)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ctx = ctx
        self._i_insert(block, ctx)

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ctx = ctx
        self._i_hit(block, ctx)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ctx = ctx
        if block.block_id in self._order:
            self._unpark(block)  # the inner policy already counts it as pinned
        else:
            self._i_pin(block, ctx)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._ctx = ctx
        self._i_unpin(block, ctx)

    def on_evict(self, block: KVBlock) -> None:
        if block.block_id in self._order:
            self._unpark(block)
            self._i_unpin(block, self._ctx)
        self._i_evict(block)
        parent = block.parent
        # <= 1: the count may or may not include this block yet; either way 0 children is caught
        if parent is not None and parent in self._parked and self._children(parent) <= 1:  # type: ignore[misc]
            self._dirty.append(parent)

    def on_remove(self, block: KVBlock) -> None:
        if block.block_id in self._order:
            self._unpark(block)
            self._i_unpin(block, self._ctx)
        self.inner.on_remove(block)
        parent = block.parent
        # <= 1: the count may or may not include this block yet; either way 0 children is caught
        if parent is not None and parent in self._parked and self._children(parent) <= 1:  # type: ignore[misc]
            self._dirty.append(parent)

    def _park(self, block: KVBlock) -> None:
        self._i_pin(block, self._ctx)
        self._order[block.block_id] = block
        group = self._parked.get(block.key)
        if group is None:
            self._parked[block.key] = {block.block_id: block}
        else:
            group[block.block_id] = block

    def _unpark(self, block: KVBlock) -> None:
        del self._order[block.block_id]
        group = self._parked[block.key]
        del group[block.block_id]
        if not group:
            del self._parked[block.key]

    def _release_parked(self) -> None:
        parked, children, order, ctx = self._parked, self._children, self._order, self._ctx
        for key in self._dirty:
            group = parked.get(key)
            if group is not None and children(key) == 0:  # type: ignore[misc]
                del parked[key]
                for bid, block in group.items():
                    del order[bid]
                    self._i_unpin(block, ctx)
        self._dirty.clear()

    def victim(self) -> KVBlock:
        if self._dirty:
            self._release_parked()
        inner, children = self.inner, self._children
        while len(inner):
            block = self._i_victim()
            if children(block.key) == 0:  # type: ignore[misc]
                return block
            self._park(block)
        if not self._order:
            raise IndexError("victim() called with no evictable block")
        block = next(iter(self._order.values()))
        self._unpark(block)
        self._i_unpin(block, self._ctx)
        return block

    def __len__(self) -> int:
        return len(self.inner) + len(self._order)


def prefix_aware(inner: str | EvictionPolicy, **inner_params: object) -> PrefixAware:
    """Wrap ``inner`` (a registered name or an instance) so that only leaf blocks are evicted."""
    return PrefixAware(inner, inner_params)


@register_policy("prefix-aware-lru")
class PrefixAwareLRU(PrefixAware):
    """``lru`` (vLLM order) restricted to leaf blocks."""

    source = "vLLM LRU restricted to leaf blocks (prefix-aware wrapper)"

    def __init__(self, **inner_params: object) -> None:
        super().__init__("lru", inner_params)


@register_policy("prefix-aware-lfu")
class PrefixAwareLFU(PrefixAware):
    """``lfu`` restricted to leaf blocks."""

    source = "LFU restricted to leaf blocks (prefix-aware wrapper)"

    def __init__(self, **inner_params: object) -> None:
        super().__init__("lfu", inner_params)
