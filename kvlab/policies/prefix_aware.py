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

Cost: the inner policy's per event, plus O(1) inner events per block and non-leaf period (parking and
release); the fallback takes the block parked first.

Compiled twins (numba, run by the replay driver's compiled engine; tested hit for hit, every replay
column, against these classes): ``prefix-aware-lru`` and ``prefix-aware-lfu`` only (the generic
``prefix-aware`` with another inner policy runs in Python). The twin makes exactly the wrapper's calls,
in the same order, on the inner policy's own compiled twin (``lru``, ``lfu``), which is hit for hit its
Python class: it counts cached children per key (the parent of position ``p`` being the request's key at
``p - 1``), keeps the parked blocks in linked lists per key and in parking order, marks the parent key
on eviction and releases its group, in parking order, at the next victim() if the key has no cached
child then (an eviction follows each victim(), so at most one key is marked), and falls back to the
block parked first. O(1) per event on top of the inner twin's (lru O(1), lfu O(log n)).
``compiled_params()`` needs ``prepare(encoded)`` first: ``(offsets, key_ids)``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Any

import numba as nb
import numpy as np
from pydantic import AfterValidator, Field

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import NO_CONTEXT, AccessContext
from kvlab.errors import ConfigError
from kvlab.policies._leaf import key_arrays
from kvlab.policies._queues import list_append, list_unlink
from kvlab.policies.base import (
    EvictionPolicy,
    available_policies,
    make_policy,
    register_policy,
    resolved_policy_params,
)
from kvlab.policies.lfu import LFU
from kvlab.policies.lru import LRU


def _registered(inner: object) -> object:
    if isinstance(inner, str) and inner not in available_policies():
        raise ValueError(f"unknown policy {inner!r}")
    return inner


Inner = Annotated[
    str | EvictionPolicy,
    AfterValidator(_registered),
    Field(description="a registered policy name (see `kvlab policies`) or an EvictionPolicy instance"),
]
InnerParams = Annotated[
    dict[str, Any] | None,
    Field(description="None or a mapping of the inner policy's parameters (checked by that policy)"),
]


@register_policy("prefix-aware")
class PrefixAware(EvictionPolicy):
    """Evict only blocks without cached children, in the inner policy's order."""

    source = "leaf-only eviction (SGLang / RAGCache / TensorRT-LLM radix trees) around any policy"

    def __init__(self, inner: Inner = "lru", inner_params: InnerParams = None) -> None:
        try:
            self.inner = make_policy(inner, **(inner_params or {}))
        except ConfigError as exc:
            raise ConfigError(f"policy {self.name!r}: inner {exc}") from None
        self._parked: dict[Hashable, dict[int, KVBlock]] = {}  # key -> parked blocks
        self._order: dict[int, KVBlock] = {}  # every parked block, in parking order
        self._dirty: list[Hashable] = []
        self._ctx: AccessContext = NO_CONTEXT
        self._children = None
        self._encoded: object | None = None
        i = self.inner
        if type(self) is PrefixAware and not inner_params:  # an inner policy with a wrapper twin: use it
            twin = _TWINS.get(type(i))
            if twin is not None:
                self.compiled = twin
        self._i_insert, self._i_hit, self._i_pin, self._i_unpin = i.on_insert, i.on_hit, i.on_pin, i.on_unpin
        self._i_evict, self._i_victim = i.on_evict, i.victim

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        """``inner_params`` resolved by the inner policy (its defaults filled in) when ``inner`` is a name."""
        inner = params.get("inner")
        if not isinstance(inner, str):
            return params
        try:
            inner_params = resolved_policy_params(inner, params.get("inner_params"))
        except ConfigError as exc:
            raise ConfigError(f"policy {cls.name!r}: inner {exc}") from None
        return {**params, "inner_params": inner_params}

    def attach(self, cache: object) -> None:
        self._children = cache.num_cached_children  # type: ignore[attr-defined]
        self.inner.attach(cache)

    def prepare(self, encoded: object) -> None:
        self._encoded = encoded  # for the compiled twins: a block's parent key
        self.inner.prepare(encoded)

    def compiled_params(self) -> tuple:
        """``(offsets, key_ids)`` of the prepared workload (the registered twins' inner policies take no
        parameters)."""
        return key_arrays(self.prepared())

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

    def __init__(self) -> None:
        super().__init__("lru")


@register_policy("prefix-aware-lfu")
class PrefixAwareLFU(PrefixAware):
    """``lfu`` restricted to leaf blocks."""

    source = "LFU restricted to leaf blocks (prefix-aware wrapper)"

    def __init__(self) -> None:
        super().__init__("lfu")


# ---------------------------------------------------------------------- compiled twins
# The wrapper's events, replayed on the inner policy's own compiled twin (lru, lfu): the inner twin
# sees exactly the hook calls the Python wrapper makes on the inner class, in the same order, so its
# order is the Python inner policy's.
# state: (inner state, B, K, M, offsets, key_ids).
# B (per block, int64, the transpose of a row-per-block array): BKEY, BPAR (the block's key and parent
# key, -1 = none); PARKED (1 while parked); GNXT, GPRV (the parked group of BKEY in parking order, a
# linked list); ONXT, OPRV (every parked block in parking order, a linked list: the wrapper's ``_order``).
# K (per dense key): CHILD (cached blocks whose parent is this key), GHEAD, GTAIL (its parked group).
# M = [blocks evictable in the inner policy (``len(inner)``), the dirty key (-1 none: one eviction
# follows each victim(), so the wrapper's ``_dirty`` never holds more than one key at a victim()),
# first and last parked block, seq of the latest event (the wrapper's ``_ctx``)].
_BKEY, _BPAR, _PARKED, _GNXT, _GPRV, _ONXT, _OPRV = range(7)
_CHILD, _GHEAD, _GTAIL = range(3)
_NIN, _DIRTY, _OHEAD, _OTAIL, _CTX = range(5)


def _compiled_twin(inner: CompiledPolicy) -> CompiledPolicy:
    """The wrapper's hooks around ``inner``'s compiled hooks (which must ignore their ``params``). Cached by numba,
    keyed by their closure's contents (the inner hooks): inner hooks whose code changes must change name
    (the priority policies' do, kvlab.policies._priority._digest), or a stale entry is reused. They must be
    cached: the replay kernel, cached on disk per policy, crashes when loaded beside another wrapper's kernel
    if the hooks it calls were compiled in memory."""
    i_init, i_insert, i_hit, i_pin = inner.init, inner.on_insert, inner.on_hit, inner.on_pin
    i_unpin, i_victim, i_evict = inner.on_unpin, inner.victim, inner.on_evict
    inner_label = "".join(c if c.isalnum() else "_" for c in f"{i_victim.py_func.__module__}_{i_victim.__name__}")

    def jit(fn: Any) -> Any:
        """njit, cached, under a name of its own per inner policy: numba names a function's machine code
        by qualified name and a per-process counter, so the wrappers of two inner policies compiled in two
        processes would export the same symbol, and a process loading both kernels from the disk cache
        would link one wrapper's calls to the other's functions (a crash)."""
        fn.__qualname__ = f"prefix_aware_{inner_label}.{fn.__name__}"
        return nb.njit(cache=True)(fn)

    @jit
    def init(capacity, num_keys, params):
        offsets, key_ids = params
        Bt = np.full((capacity, 7), -1, np.int64)
        B = Bt.T
        B[_PARKED] = 0
        K = np.full((num_keys, 3), -1, np.int64).T
        K[_CHILD] = 0
        M = np.full(5, -1, np.int64)
        M[_NIN] = 0
        M[_CTX] = 0
        return (i_init(capacity, num_keys, np.zeros(0, np.float64)), B, K, M, offsets, key_ids)

    @jit
    def on_insert(state, b, key, seq, pos):
        B, K, M = state[1], state[2], state[3]
        M[_CTX] = seq
        i_insert(state[0], b, key, seq, pos)
        B[_BKEY, b] = key
        if pos > 0:
            parent = state[5][state[4][seq] + pos - 1]
            B[_BPAR, b] = parent
            K[_CHILD, parent] += 1
        else:
            B[_BPAR, b] = -1

    @jit
    def on_hit(state, b, key, seq, pos):
        state[3][_CTX] = seq
        i_hit(state[0], b, key, seq, pos)

    @jit
    def unpark(B, K, M, b):
        """The wrapper's ``_unpark``: out of its key's group and of the parking order."""
        B[_PARKED, b] = 0
        list_unlink(B, _GNXT, _GPRV, K, _GHEAD, _GTAIL, B[_BKEY, b], b)
        list_unlink(B, _ONXT, _OPRV, M.reshape((M.shape[0], 1)), _OHEAD, _OTAIL, 0, b)  # M as one list's ends

    @jit
    def on_pin(state, b, seq):
        B, K, M = state[1], state[2], state[3]
        M[_CTX] = seq
        if B[_PARKED, b]:
            unpark(B, K, M, b)  # the inner policy already counts it as pinned
        else:
            i_pin(state[0], b, seq)
            M[_NIN] -= 1

    @jit
    def on_unpin(state, b, seq):
        M = state[3]
        M[_CTX] = seq
        i_unpin(state[0], b, seq)
        M[_NIN] += 1

    @jit
    def victim(state):
        inner_state, B, K, M = state[0], state[1], state[2], state[3]
        ctx = M[_CTX]
        k = M[_DIRTY]
        if k >= 0:  # _release_parked: the group, in parking order, back to the inner policy
            M[_DIRTY] = -1
            if K[_CHILD, k] == 0:
                x = K[_GHEAD, k]
                while x >= 0:
                    nxt = B[_GNXT, x]
                    unpark(B, K, M, x)
                    i_unpin(inner_state, x, ctx)
                    M[_NIN] += 1
                    x = nxt
        while M[_NIN] > 0:
            b = i_victim(inner_state)
            k = B[_BKEY, b]
            if K[_CHILD, k] == 0:
                return b
            # _park: hidden from the inner policy, appended to its key's group and to the parking order
            i_pin(inner_state, b, ctx)
            M[_NIN] -= 1
            B[_PARKED, b] = 1
            list_append(B, _GNXT, _GPRV, K, _GHEAD, _GTAIL, k, b)
            list_append(B, _ONXT, _OPRV, M.reshape((M.shape[0], 1)), _OHEAD, _OTAIL, 0, b)
        b = M[_OHEAD]  # only parked blocks are evictable: the one parked first
        unpark(B, K, M, b)
        i_unpin(inner_state, b, ctx)
        M[_NIN] += 1
        return b

    @jit
    def on_evict(state, b):
        B, K, M = state[1], state[2], state[3]
        if B[_PARKED, b]:
            unpark(B, K, M, b)
            i_unpin(state[0], b, M[_CTX])
            M[_NIN] += 1
        i_evict(state[0], b)
        M[_NIN] -= 1
        parent = B[_BPAR, b]
        B[_BKEY, b] = -1
        B[_BPAR, b] = -1
        if parent >= 0:
            left = K[_CHILD, parent] - 1
            K[_CHILD, parent] = left
            if left == 0 and K[_GHEAD, parent] >= 0:
                M[_DIRTY] = parent

    return CompiledPolicy(init, on_insert, on_hit, on_pin, on_unpin, victim, on_evict)


PrefixAwareLRU.compiled = _compiled_twin(LRU.compiled)
PrefixAwareLFU.compiled = _compiled_twin(LFU.compiled)
#: inner policy class -> the wrapper's twin (``prefix-aware`` with that inner, default parameters, uses it)
_TWINS: dict[type, CompiledPolicy] = {LRU: PrefixAwareLRU.compiled, LFU: PrefixAwareLFU.compiled}
