"""Priority policies written once (docs/policies.md, "Writing a priority policy"): a policy is a priority,
the framework owns the mechanics (SGLang's ``mem_cache/evict_policy.py`` is the model). Not a policy (the
package skips ``_`` modules).

A priority policy is a :class:`PriorityPolicy` (or :class:`LeafPriorityPolicy`) subclass whose ``spec`` (a
:class:`Priority`) names ``numba.njit`` functions: ``on_insert(s, b, key, pos, r)`` and ``on_hit(s, b, key,
pos, r)`` update the state ``s`` (a :class:`State`), ``priority(s, b, r)`` orders block ``b`` when it becomes
evictable: the lowest ``(priority, unpin stamp)`` is evicted. The framework supplies, for both engines, the
stamped heap of the evictable blocks, leaf-only eviction, aging, expiries and per-key re-queueing.

* Python core: the functions run as plain Python (:func:`pythonize`: numba's ``py_func``, helpers
  included) on lists, ``r`` the :class:`~kvlab.cache.AccessContext` (a :class:`Req` when the policy has a
  request code); the heap is :class:`~kvlab.policies._heap.HeapPolicy` / ``LeafHeapPolicy``.
* Compiled twin (kvlab.policies._priority_kernel ``compiled_twin``): templates specialised to the policy
  (its functions and constants bound as their globals, cached on disk by numba), on numpy arrays over block
  ids and dense key ids; ``r`` is a :class:`Req` read from what ``compiled_params()`` returns (``Priority.layout``);
  indexed heaps and lists from ``kvlab.policies._queues`` and ``kvlab.policies._leaf``.

The same operations give the same numbers in both (a Python float is an IEEE double); the exactness tests
check each policy's engines request for request.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import defaultdict
from collections.abc import Callable
from heapq import heappop, heappush
from math import inf
from types import FunctionType
from typing import ClassVar

import numpy as np
from numba.core.dispatcher import Dispatcher

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies import _leaf
from kvlab.policies._heap import BucketHeapPolicy, HeapPolicy, LeafHeapPolicy
from kvlab.policies._priority_kernel import compiled_twin, requeue_key
from kvlab.policies._priority_spec import (  # CStateType: numba's on-disk caches name it here (before the split)
    CState,
    CStateType,
    Priority,
    Req,
    State,
    _never,
    _no_refresh,
    _nothing,
    _Req,
    _zero,
)


def _requeue_key_py(s: State, key: object, priority: object) -> None:
    s.f_policy._requeue_key(key, priority)


def pythonize(fn: object, done: dict | None = None) -> FunctionType:
    """The plain Python function of a numba dispatcher, whose calls to other dispatchers (helpers) call
    their plain Python functions too (the Python core runs a policy's functions without numba); the
    framework's ``requeue_key`` becomes its Python version."""
    done = {} if done is None else done
    if fn is requeue_key:
        return _requeue_key_py  # type: ignore[return-value]
    py = fn.py_func  # type: ignore[attr-defined]
    if fn in done:
        return done[fn]
    glb = dict(py.__globals__)
    out = done[fn] = FunctionType(py.__code__, glb, py.__name__, py.__defaults__, py.__closure__)
    for name in py.__code__.co_names:
        if isinstance(glb.get(name), Dispatcher):
            glb[name] = pythonize(glb[name], done)
    return out


class _Returns(ast.NodeTransformer):
    """``return X`` -> ``_done(block_id, X); return`` (after ``_pk[block_id] = X`` with aging), not inside
    nested functions."""

    def __init__(self, aging: bool) -> None:
        self.aging = aging

    def visit_FunctionDef(self, node: ast.AST) -> ast.AST:
        return node

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef  # type: ignore[assignment]

    def visit_Return(self, node: ast.Return) -> list[ast.stmt]:
        value = ast.unparse(node.value) if node.value is not None else "None"
        keep = "_pk[_block.block_id] = " if self.aging else ""
        return ast.parse(f"_v = {value}\n{keep}_v\n_done(_block.block_id, _v)\nreturn").body


def fused(fn: object, kind: str, coded: bool, aging: bool = False) -> FunctionType | None:
    """The Python hook ``hook(block, ctx)`` of a policy function ``fn``: its body after a prologue that binds
    its parameters from the block and the context (``kind`` ``"block"``: ``on_insert`` / ``on_hit``;
    ``"priority"``: its returns hand the priority to ``_done(block_id, priority)``, the heap's push), so an
    event costs one call instead of two. The state and the rest are the defaults ``_S``, ``_done``, ``_req``,
    ``_pk`` (:meth:`PriorityPolicy._bind` sets them per instance); the globals are ``pythonize(fn)``'s. None
    when ``fn``'s source cannot be read (the hooks then call ``fn``)."""
    py = fn.py_func  # type: ignore[attr-defined]
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(py)))
    except (OSError, TypeError, SyntaxError):
        return None
    ast.increment_lineno(tree, py.__code__.co_firstlineno - 1)  # (tracebacks name the policy's lines)
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    ctx = "_req(_ctx)" if coded else "_ctx"
    values = ["_S", "_block.block_id", "_block.key", "_block.position", ctx] if kind == "block" else [
        "_S", "_block.block_id", ctx]
    names = [a.arg for a in node.args.args]
    if kind != "block":
        node = _Returns(aging).generic_visit(node)
    node.body = ast.parse("\n".join(f"{n} = {v}" for n, v in zip(names, values, strict=True))).body + node.body
    node.decorator_list = []
    node.name = f"_hook_{py.__name__}"
    node.args = ast.parse("def f(_block, _ctx, _S=None, _done=None, _req=None, _pk=None): pass").body[0].args
    namespace: dict = {}
    code = compile(ast.fix_missing_locations(ast.Module([node], [])), inspect.getsourcefile(py) or "<policy>", "exec")
    exec(code, pythonize(fn).__globals__, namespace)  # noqa: S102 - the policy's own code, rearranged
    return namespace[node.name]


class PriorityPolicy(HeapPolicy):
    """Base of the priority policies: set ``spec`` (a :class:`Priority`) and, for numeric parameters,
    ``params()`` (and for a request code, ``request_code()``). The compiled twin is built when the class
    is defined."""

    spec: ClassVar[Priority]
    block_size: int | None = None  # tokens per block: from attach (cache) or prepare (workload)

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        spec = cls.__dict__.get("spec")
        if spec is None:
            return
        layout = {spec.layout} if isinstance(spec.layout, str) else set(spec.layout)
        leaf = issubclass(cls, LeafHeapPolicy)
        if (spec.expiry is not None or spec.by_key) and leaf:
            raise TypeError(f"{cls.__name__}: a leaf-only priority policy cannot have expiries or key lists")
        cls._py = tuple(pythonize(f) for f in (spec.on_insert, spec.on_hit or _nothing, spec.priority,
                                                spec.expiry or _never, spec.on_expire or _zero,
                                                spec.refresh or _no_refresh))
        cls._coded = "code" in layout
        cls._fused = (fused(spec.on_insert, "block", cls._coded), fused(spec.on_hit, "block", cls._coded)
                      if spec.on_hit is not None else None,
                      fused(spec.priority, "priority", cls._coded, spec.aging is not None))
        if cls._coded:
            cls.on_insert, cls.on_hit = cls._insert_coded, cls._hit_coded  # type: ignore[method-assign]
        if spec.on_hit is None:
            cls.on_hit = HeapPolicy.on_hit  # type: ignore[method-assign]
        if spec.expiry is not None or cls._coded or spec.by_key:
            cls.on_unpin = cls._unpin_general  # type: ignore[method-assign]
        elif spec.aging is not None:
            cls.on_unpin = cls._unpin_aging  # type: ignore[method-assign]
        if spec.by_key:
            cls.on_evict = cls._evict_general  # type: ignore[method-assign]
        elif spec.aging is not None:
            cls.on_evict = cls._evict_aging  # type: ignore[method-assign]
        if spec.by_key:
            cls.on_pin = cls._pin_by_key  # type: ignore[method-assign]
        if spec.expiry is not None or spec.refresh is not None:
            cls.victim = cls._victim_general  # type: ignore[method-assign]
        if layout - {"par"} and cls.prepare is HeapPolicy.prepare:  # (a policy's own prepare stays)
            cls.prepare = PriorityPolicy._keep  # type: ignore[method-assign]
        cls.compiled = compiled_twin(cls, spec, leaf=leaf)

    def params(self) -> list[float]:
        """The instance's numeric parameters (``s.par``; float64 in the compiled twin)."""
        return []

    def data(self) -> tuple:
        """``s.data`` in the Python core (``Priority(data=...)``): lists, or what refuses to be read."""
        return ()

    def request_code(self, ctx: AccessContext) -> float:
        """A number the functions read as ``r.code`` (layout part ``"code"``: its value per request)."""
        return 0.0

    def _keep(self, encoded: object) -> None:
        """Keep the replay's EncodedWorkload: ``compiled_params()`` reads the request data it names."""
        self._encoded = encoded
        self.block_size = int(encoded.block_size)  # type: ignore[attr-defined]

    def compiled_params(self) -> np.ndarray | tuple:
        layout = self.spec.layout
        if isinstance(layout, str):
            return self._compiled_part(layout)
        if set(layout) - {"par"}:
            self.prepared()  # ConfigError before anything else when prepare was not called
        return tuple(self._compiled_part(name) for name in layout)

    def _compiled_part(self, name: str) -> np.ndarray:
        if name == "par":
            return np.array(self.params(), dtype=np.float64)
        enc = self.prepared()
        if name in ("offsets", "key_ids"):
            return _leaf.key_arrays(enc)[name == "key_ids"]
        if name == "prompt_tokens":
            return np.ascontiguousarray(enc.prompt_tokens, dtype=np.int64)  # type: ignore[attr-defined]
        if name == "arrival":
            if getattr(enc, "arrival", None) is None:
                raise ConfigError(f"{self.name}: compiled_params() needs prepare(encoded) with per-request arrival")
            return np.ascontiguousarray(enc.arrival, dtype=np.float64)  # type: ignore[attr-defined]
        if name == "code":
            return np.ascontiguousarray(self.request_codes(enc), dtype=np.float64)
        raise NotImplementedError(f"{self.name}: compiled_params() part {name!r} is the policy's own")

    def request_codes(self, encoded: object) -> np.ndarray:
        """``request_code`` of every request of a prepared workload (layout part ``"code"``)."""
        return np.zeros(len(encoded.prompt_tokens), np.float64)  # type: ignore[attr-defined]

    def attach(self, cache: object) -> None:
        super().attach(cache)
        n = cache.capacity_blocks  # type: ignore[attr-defined]
        self.block_size = cache.block_size  # type: ignore[attr-defined]
        spec = self.spec
        blk = [[v] * n for v in spec.block]  # one list per field: few objects for the garbage collector
        keys = [defaultdict(_constant(v)) for v in spec.key]
        glob = list(spec.glob)
        par = [float(x) for x in self.params()]
        self.state = State(blk, blk, keys, keys, glob, glob, par, self.data(), self)
        self._f_insert, self._f_hit, self._f_priority, self._f_expiry, self._f_expire, self._f_refresh = self._py
        self._pk = [0] * n if spec.aging is not None else None
        self._by_key: dict | None = {} if spec.by_key else None  # key -> its evictable block(s), unpin order
        self._expiries: list[tuple] = []  # (expiry, stamp, block_id) of evictable blocks
        self._expiring, self._refreshing = spec.expiry is not None, spec.refresh is not None
        self._ctx: AccessContext | None = None
        self._code = 0.0
        self._r = _Req(float("nan"), -1, -1, 0)
        self._bind()

    def _bind(self) -> None:
        """The hot hooks as functions of their own (:func:`fused`: the policy function's body, the state bound
        as a default; else a closure calling it), unless overridden."""
        cls, st, push, pk, req = type(self), self.state, self._push, self._pk, self._req
        ins, hit, prio = self._f_insert, self._f_hit, self._f_priority
        f_ins, f_hit, f_prio = self._fused

        def bound(f: FunctionType) -> FunctionType:
            return FunctionType(f.__code__, f.__globals__, f.__name__, (st, push, req, pk))

        if cls.on_insert in (PriorityPolicy.on_insert, PriorityPolicy._insert_coded):
            if f_ins is not None:
                self.on_insert = bound(f_ins)
            elif cls.on_insert is PriorityPolicy.on_insert:
                self.on_insert = lambda block, ctx: ins(st, block.block_id, block.key, block.position, ctx)
        if cls.on_hit in (PriorityPolicy.on_hit, PriorityPolicy._hit_coded):
            if f_hit is not None:
                self.on_hit = bound(f_hit)
            elif cls.on_hit is PriorityPolicy.on_hit:
                self.on_hit = lambda block, ctx: hit(st, block.block_id, block.key, block.position, ctx)
        if cls.on_unpin in (PriorityPolicy.on_unpin, PriorityPolicy._unpin_aging) and f_prio is not None:
            self.on_unpin = bound(f_prio)
        elif cls.on_unpin is PriorityPolicy.on_unpin:

            def on_unpin(block: KVBlock, ctx: AccessContext) -> None:
                bid = block.block_id
                push(bid, prio(st, bid, ctx))

            self.on_unpin = on_unpin
        if cls.on_evict is PriorityPolicy._evict_aging:
            glob, i, evict = st.glob, self.spec.aging, super().on_evict  # the heap's own

            def evict_aging(block: KVBlock) -> None:
                pr = pk[block.block_id]  # type: ignore[index]
                if pr > glob[i]:
                    glob[i] = pr
                evict(block)

            self.on_evict = evict_aging

    def _req(self, ctx: AccessContext) -> _Req:
        """``ctx`` as a :class:`Req` with its request code (one per request; a driver may change a request's
        time, never its labels)."""
        r = self._r
        if ctx is self._ctx and r.time == ctx.time:
            return r
        if ctx is not self._ctx:
            self._ctx, self._code = ctx, self.request_code(ctx)
        r = self._r = _Req(ctx.time, ctx.seq, ctx.request_id, ctx.prompt_tokens, self._code)
        return r

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self._f_insert(self.state, block.block_id, block.key, block.position, ctx)

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self._f_hit(self.state, block.block_id, block.key, block.position, ctx)

    def _insert_coded(self, block: KVBlock, ctx: AccessContext) -> None:
        self._f_insert(self.state, block.block_id, block.key, block.position, self._req(ctx))

    def _hit_coded(self, block: KVBlock, ctx: AccessContext) -> None:
        self._f_hit(self.state, block.block_id, block.key, block.position, self._req(ctx))

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        self._push(bid, self._f_priority(self.state, bid, ctx))

    def _unpin_aging(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        pr = self._pk[bid] = self._f_priority(self.state, bid, ctx)  # type: ignore[index]
        self._push(bid, pr)

    def _unpin_general(self, block: KVBlock, ctx: AccessContext) -> None:
        bid = block.block_id
        r = self._req(ctx) if self._coded else ctx
        pr = self._f_priority(self.state, bid, r)
        if self._pk is not None:
            self._pk[bid] = pr
        self._push(bid, pr)
        by_key = self._by_key
        if by_key is not None:
            k = block.key
            held = by_key.get(k)
            if held is None:
                by_key[k] = bid
            elif type(held) is int:
                by_key[k] = [held, bid]
            else:
                held.append(bid)
        e = self._f_expiry(self.state, bid, r) if self._expiring else inf
        if e < inf:
            expiries = self._expiries
            heappush(expiries, (e, self._stamp[bid], bid))
            if len(expiries) > 2 * self._n + 1024:
                stamp = self._stamp
                self._expiries = sorted(x for x in expiries if stamp[x[2]] == x[1])

    def _forget_key(self, block: KVBlock) -> None:
        k = block.key
        by_key = self._by_key
        held = by_key[k]  # type: ignore[index]
        if type(held) is int:
            del by_key[k]  # type: ignore[attr-defined]
        else:
            held.remove(block.block_id)
            if len(held) == 1:
                by_key[k] = held[0]  # type: ignore[index]

    def _requeue_key(self, key: object, priority: object) -> None:
        held = self._by_key.get(key)  # type: ignore[union-attr]
        if held is not None:
            for bid in [held] if type(held) is int else held:
                self._repush(bid, priority)

    def _pin_by_key(self, block: KVBlock, ctx: AccessContext) -> None:
        self._forget_key(block)
        super().on_pin(block, ctx)

    def _victim_general(self) -> KVBlock:
        if self._refreshing:
            self._f_refresh(self.state)
        expiries = self._expiries
        if expiries:
            stamp, now = self._stamp, self.state.glob[self.spec.now]
            while expiries and expiries[0][0] <= now:
                _, st, bid = heappop(expiries)
                if stamp[bid] == st:
                    self._repush(bid, self._f_expire(self.state, bid))
        return super().victim()

    def _evict_aging(self, block: KVBlock) -> None:
        glob, i = self.state.glob, self.spec.aging
        pr = self._pk[block.block_id]  # type: ignore[index]
        if pr > glob[i]:
            glob[i] = pr
        super().on_evict(block)

    def _evict_general(self, block: KVBlock) -> None:
        if self._pk is not None:
            glob, i = self.state.glob, self.spec.aging
            pr = self._pk[block.block_id]
            if pr > glob[i]:
                glob[i] = pr
        if self._by_key is not None:
            self._forget_key(block)
        super().on_evict(block)

    def on_remove(self, block: KVBlock) -> None:
        if self._by_key is not None:
            self._forget_key(block)
        super().on_evict(block)  # the heap's (leaf-only: parked groups too): no aging


def field(i: int) -> property:
    """Per-block field ``i`` of a priority policy's Python state (``policy.x[block_id]``)."""
    return property(lambda self: self.state.blk[i])


def _constant(v: object) -> Callable[[], object]:
    """The default factory of a per-key field with initial value ``v`` (C-level for 0 and 0.0)."""
    if v == 0 and type(v) in (int, float):
        return type(v)
    return lambda: v


class LeafPriorityPolicy(PriorityPolicy, LeafHeapPolicy):
    """A priority policy that evicts leaves only (blocks whose key has no cached children)."""


class BucketPriorityPolicy(PriorityPolicy, BucketHeapPolicy):
    """A priority policy whose priorities are integers with few distinct values (frequencies, levels): the
    same order, O(1) per event in the Python core (one bucket per priority; the compiled twin is the same)."""



__all__ = ["BucketPriorityPolicy", "CState", "CStateType", "LeafPriorityPolicy", "Priority", "PriorityPolicy", "Req",
           "State", "field", "requeue_key"]
