"""One implementation for both cores: the Python core drives a policy's compiled hooks through an adapter.

:class:`CompiledAdapter` is an :class:`~kvlab.policies.base.EvictionPolicy` whose hooks call the policy's
:class:`~kvlab.cache.compiled.CompiledPolicy` (the numba functions the replay kernel calls) on the same
dense block ids: ``block.block_id`` is the block id, and keys (any hashable in the Python core) get
dense ids on first sight, the state growing when they outnumber its key columns. A policy written this
way exists once: its class holds parameters, ``compiled_params()`` and the documentation, its hooks are
the compiled ones in every driver (replay, simulator, engine).

The calls are cheap: each hook is called through its compiled entry point (no numba type dispatch per
call), a hook that is the shared no-op (``no_insert``, ``no_hit``, ``no_miss``) is not called at all, and
a key is mapped to its dense id only for a hook whose code reads its ``key`` argument. ``len()`` is
counted here (unpins minus pins, evictions and removals), as the core's invariant defines it.

What the Python core cannot tell the hooks: ``on_miss`` gets ``pos = -1`` (the core's ``on_miss(keys,
ctx)`` names keys, not positions); ``seq`` is ``ctx.seq`` and ``on_evict`` / ``on_remove`` have no ``seq``,
as in the kernel. Plain Python plugins do not use this module: any class with the hooks runs as before.
"""

from __future__ import annotations

import dis
from collections.abc import Hashable, Sequence
from typing import ClassVar

import numba as nb
import numpy as np

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy, no_hit, no_insert, no_miss
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies.base import EvictionPolicy

_ENTRY: dict[tuple, object] = {}  # (dispatcher, argument types) -> compiled entry point


def entry_point(hook: object, *args: object) -> object:
    """``hook`` (a numba dispatcher) compiled (or loaded from numba's disk cache) for these arguments'
    types; returns its entry point, which runs the machine code without numba's per-call type dispatch
    (its arguments must then have exactly these types). A plain function (NUMBA_DISABLE_JIT=1) is
    returned as it is."""
    if not hasattr(hook, "compile"):
        return hook
    sig = tuple(nb.typeof(a) for a in args)
    ep = _ENTRY.get((hook, sig))
    if ep is None:
        ep = _ENTRY[hook, sig] = hook.compile(sig)
    return ep


def reads_argument(hook: object, name: str) -> bool:
    """Whether the code of ``hook`` (a numba dispatcher) ever reads its argument ``name``."""
    func = getattr(hook, "py_func", hook)
    for ins in dis.get_instructions(func):
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)  # LOAD_FAST_LOAD_FAST: two
        if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")) and name in names:
            return True
    return False


def grow_state(fresh: object, old: object, old_keys: int, new_keys: int) -> object:
    """``old`` state for ``new_keys`` key ids, given ``fresh`` = ``init(capacity, new_keys, params)``: arrays
    of the same shape in both are kept (``old``), an array whose length along one axis is ``old_keys``
    (``new_keys`` in ``fresh``) is ``fresh`` with ``old`` copied into its first ``old_keys`` entries along that
    axis. Any other difference needs the policy's own ``grow`` hook (ConfigError)."""
    if isinstance(old, tuple):
        return tuple(grow_state(f, o, old_keys, new_keys) for f, o in zip(fresh, old, strict=True))
    if not isinstance(old, np.ndarray) or old.shape == fresh.shape:
        return old
    axes = [i for i, (a, b) in enumerate(zip(old.shape, fresh.shape, strict=True)) if a != b]
    if len(axes) != 1 or old.shape[axes[0]] != old_keys or fresh.shape[axes[0]] != new_keys:
        raise ConfigError(f"cannot grow an array of shape {old.shape} from {old_keys} to {new_keys} key ids: "
                          "the policy's CompiledPolicy needs a grow hook")
    index = [slice(None)] * old.ndim
    index[axes[0]] = slice(0, old_keys)
    fresh[tuple(index)] = old
    return fresh


class CompiledAdapter(EvictionPolicy):
    """Base class of a policy implemented only by its compiled hooks (``compiled``), for the Python core.

    A subclass sets ``compiled`` and, if it has parameters, ``compiled_params()``; ``attach`` creates the
    state (``capacity``: the cache's ``capacity_blocks``, in blocks) and the hooks: closures over the state
    and the count of evictable blocks, set on the instance (so the core calls them directly). A hook the
    subclass overrides stays a method (its ``super()`` call reaches the closure); so does a hook someone else
    set on the instance (a test's guard).
    """

    compiled: ClassVar[CompiledPolicy]
    #: key columns of a new state (at least; more when the cache holds more blocks; it grows on demand)
    initial_keys: ClassVar[int] = 1024
    _HOOKS = ("on_insert", "on_hit", "on_miss", "on_pin", "on_unpin", "victim", "on_evict", "on_remove")

    _hooks: dict | None = None

    def attach(self, cache: object) -> None:
        """A fresh state for ``cache``'s ``capacity_blocks`` blocks; the hooks bound to it."""
        mine = self._hooks or {}
        for name in self._HOOKS:  # a re-attach: the hooks bound before go
            if name in mine and self.__dict__.get(name) is mine[name]:
                del self.__dict__[name]
        self._hooks = mine = self._make_hooks(cache.blocks, cache.capacity_blocks)  # type: ignore[attr-defined]
        cls = type(self)
        for name in self._HOOKS:
            if name not in self.__dict__ and getattr(cls, name) is getattr(CompiledAdapter, name):
                self.__dict__[name] = mine[name]

    def _make_hooks(self, blocks: list[KVBlock], capacity: int) -> dict:
        """The hooks over a new state for ``capacity`` blocks, as closures sharing it (``state``), the number of
        key columns and the count of evictable blocks (``n``)."""
        c, params = self.compiled, self.compiled_params()
        num_keys = max(self.initial_keys, 2 * capacity)
        state = c.init(capacity, num_keys, params)
        state_type = nb.typeof(state)
        ids: dict[Hashable, int] = {}
        n = 0

        def key_id(key: Hashable) -> int:
            """The dense id of ``key``: a new one on first sight; the state grows when it has no column for it."""
            nonlocal state, num_keys
            k = ids.get(key)
            if k is None:
                k = ids[key] = len(ids)
                if k >= num_keys:
                    new_keys = 2 * k
                    if c.grow is not None:
                        new = c.grow(state, new_keys)
                    else:
                        new = grow_state(c.init(capacity, new_keys, params), state, num_keys, new_keys)
                    if nb.typeof(new) != state_type:
                        raise ConfigError(f"policy {self.name!r}: growing the state changed its type "
                                          f"({state_type} to {nb.typeof(new)})")
                    state, num_keys = new, new_keys
            return k

        def with_key(hook: object, nargs: int) -> tuple:
            """(entry point or None for the shared no-op, whether the hook reads its key)."""
            if hook is no_insert or hook is no_hit or hook is no_miss:
                return None, False
            return entry_point(hook, state, *[0] * nargs), reads_argument(hook, "key")

        ep_insert, insert_keyed = with_key(c.on_insert, 4)
        ep_hit, hit_keyed = with_key(c.on_hit, 4)
        ep_miss, miss_keyed = with_key(c.on_miss, 3)
        ep_pin, ep_unpin = entry_point(c.on_pin, state, 0, 0), entry_point(c.on_unpin, state, 0, 0)
        ep_victim, ep_evict = entry_point(c.victim, state), entry_point(c.on_evict, state, 0)
        ep_remove = entry_point(c.on_remove, state, 0) if c.on_remove is not None else ep_evict

        def block_key_hook(ep: object, keyed: bool) -> object:
            if ep is None:
                return _ignore
            if keyed:
                def hook(block: KVBlock, ctx: AccessContext) -> None:
                    k = key_id(block.key)  # first: it may replace the state
                    ep(state, block.block_id, k, ctx.seq, block.position)
            else:
                def hook(block: KVBlock, ctx: AccessContext) -> None:
                    ep(state, block.block_id, 0, ctx.seq, block.position)
            return hook

        def on_miss(keys: Sequence[Hashable], ctx: AccessContext) -> None:
            seq = ctx.seq
            for key in keys:
                k = key_id(key) if miss_keyed else 0
                ep_miss(state, k, seq, -1)  # the core names keys, not positions

        def on_pin(block: KVBlock, ctx: AccessContext) -> None:
            nonlocal n
            n -= 1
            ep_pin(state, block.block_id, ctx.seq)

        def on_unpin(block: KVBlock, ctx: AccessContext) -> None:
            nonlocal n
            n += 1
            ep_unpin(state, block.block_id, ctx.seq)

        def victim() -> KVBlock:
            return blocks[ep_victim(state)]

        def on_evict(block: KVBlock) -> None:
            nonlocal n
            n -= 1
            ep_evict(state, block.block_id)

        def on_remove(block: KVBlock) -> None:
            nonlocal n
            n -= 1
            ep_remove(state, block.block_id)

        return {"on_insert": block_key_hook(ep_insert, insert_keyed), "on_hit": block_key_hook(ep_hit, hit_keyed),
                "on_miss": on_miss if ep_miss is not None else _ignore, "on_pin": on_pin, "on_unpin": on_unpin,
                "victim": victim, "on_evict": on_evict, "on_remove": on_remove,
                "len": lambda: n, "state": lambda: state, "num_keys": lambda: num_keys}

    @property
    def state(self) -> object:
        """The compiled state (a tuple of arrays, as ``compiled.init`` made it and the hooks changed it)."""
        return self._bound()["state"]()

    def _bound(self) -> dict:
        if self._hooks is None:
            raise ConfigError(f"policy {self.name!r} must be attached to a PrefixCache before use")
        return self._hooks

    # the hooks as methods: what a subclass's override reaches through super() (before attach they refuse)
    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._bound()["on_insert"](block, ctx)

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._bound()["on_hit"](block, ctx)

    def on_miss(self, keys: Sequence[Hashable], ctx: AccessContext) -> None:
        self._bound()["on_miss"](keys, ctx)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._bound()["on_pin"](block, ctx)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        self._bound()["on_unpin"](block, ctx)

    def victim(self) -> KVBlock:
        return self._bound()["victim"]()

    def on_evict(self, block: KVBlock) -> None:
        self._bound()["on_evict"](block)

    def on_remove(self, block: KVBlock) -> None:
        self._bound()["on_remove"](block)

    def __len__(self) -> int:
        return self._hooks["len"]() if self._hooks is not None else 0


def _ignore(*args: object) -> None:
    """A hook that does nothing (the compiled one is the shared no-op)."""
