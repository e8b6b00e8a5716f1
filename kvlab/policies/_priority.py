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
* Compiled twin (:func:`compiled_twin`): the templates below specialised to the policy (its functions and
  constants bound as their globals, cached on disk by numba), on numpy arrays over block ids and dense key
  ids; ``r`` is a :class:`Req` read from what ``compiled_params()`` returns (``Priority.layout``);
  indexed heaps and lists from ``kvlab.policies._queues`` and ``kvlab.policies._leaf``.

The same operations give the same numbers in both (a Python float is an IEEE double); the exactness tests
check each policy's engines request for request.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import textwrap
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush
from math import inf
from types import FunctionType
from typing import Any, ClassVar, NamedTuple

import numba as nb
import numpy as np
from numba.core import types as nbtypes
from numba.core.dispatcher import Dispatcher
from numba.experimental import structref
from numba.extending import overload

from kvlab.cache.block import KVBlock
from kvlab.cache.compiled import CompiledPolicy
from kvlab.cache.context import AccessContext
from kvlab.errors import ConfigError
from kvlab.policies import _leaf
from kvlab.policies._heap import BucketHeapPolicy, HeapPolicy, LeafHeapPolicy
from kvlab.policies._leaf import GNXT, GPRV, KEY, SCLOCK, STAMP, H, N, P
from kvlab.policies._queues import (
    float_key,
    heap_fix,
    heap_push,
    heap_push_stamped,
    heap_remove,
    list_append,
    list_unlink,
)


class State:
    """What a priority policy's functions read and write: ``blk[F][b]`` / ``blkf[F][b]`` int / float field ``F``
    of block ``b``, ``key[F][k]`` / ``keyf[F][k]`` per-key fields (kept after evictions), ``glob[i]`` /
    ``globi[i]`` float / int global slots, ``par`` the instance's ``params()``, ``data`` its data
    (``Priority(data=...)``). Python: a list per block field (``blkf is blk``), a dict per key field (filled
    on first use), ``f_policy`` the policy object (for ``requeue_key``); few objects for the garbage
    collector, slots (which CPython reads fastest). Compiled: a :class:`CState`."""

    __slots__ = ("blk", "blkf", "key", "keyf", "glob", "globi", "par", "data", "f_policy")

    def __init__(self, *values: object) -> None:
        for name, value in zip(self.__slots__, values, strict=True):
            setattr(self, name, value)


@structref.register
class CStateType(nbtypes.StructRef):
    def preprocess_fields(self, fields: tuple) -> tuple:
        return tuple((name, nbtypes.unliteral(t)) for name, t in fields)


class CState(structref.StructRefProxy):
    """The compiled twin's whole state: the :class:`State` fields as arrays (``blkf`` a float64 view of
    ``blk``, ``globi`` an int64 view of ``glob``) and the framework's (``f_*``, below). One reference-counted
    object (a StructRef): a hook that takes an array from it, or hands it to the policy's functions, counts
    one reference, not one per array it holds (a tuple of arrays costs one atomic count per array)."""

    def __getattr__(self, name: str) -> object:  # (Python access to a field, for tests and debugging)
        if name.startswith("_"):
            raise AttributeError(name)
        return _cstate_field(self, name)


@nb.njit
def _cstate_field(s, name):
    return getattr(s, nb.literally(name))


_FRAMEWORK = ("f_bt", "f_bft", "f_b", "f_k", "f_m", "f_rows", "f_arrival", "f_prompt", "f_offsets", "f_key_ids",
              "f_code")
structref.define_proxy(CState, CStateType, [*State.__slots__[:-1], *_FRAMEWORK])


class Req(NamedTuple):
    """The request as the functions read it in the compiled twin (and, with a request code, in Python):
    the fields of :class:`~kvlab.cache.AccessContext` they use, and ``code`` (``request_code(ctx)``)."""

    time: float
    seq: int
    request_id: int
    prompt_tokens: int
    code: float = 0.0


class _Req:
    """:class:`Req` in the Python core (slots: read fastest)."""

    __slots__ = Req._fields

    def __init__(self, time: float, seq: int, request_id: int, prompt_tokens: int, code: float = 0.0) -> None:
        self.time, self.seq, self.request_id, self.prompt_tokens, self.code = time, seq, request_id, prompt_tokens, code


@nb.njit(cache=True, inline="always")
def _nothing(s, b, key, pos, r):
    pass


@nb.njit(cache=True, inline="always")
def _never(s, b, r):
    return np.inf


@nb.njit(cache=True, inline="always")
def _zero(s, b):
    return 0


@dataclass(frozen=True)
class Priority:
    """A priority policy's functions and state. ``block`` / ``key`` / ``glob``:
    initial values of the per-block fields, per-key fields and global slots (their number is the tuple's
    length; a float value makes a float field).

    ``expiry(s, b, r) -> float`` (called at unpin, after ``priority``; ``inf`` = none) and
    ``on_expire(s, b) -> priority``: when ``glob[now]`` reaches an evictable block's expiry (checked at
    each victim, expiries in order), the block takes the priority ``on_expire`` returns, as if unpinned
    then (TensorRT-LLM's expired retention priorities).

    ``by_key=True``: the framework keeps each key's evictable blocks in unpin order, and a function may
    call ``requeue_key(s, key, priority)`` to give them a new priority, in that order, as if unpinned now;
    ``refresh(s)`` is called at the start of each victim (Belady moves next uses there). ``data``: the
    names of ``layout`` parts the functions read as ``s.data`` (Python: ``data()``)."""

    priority: Any
    on_insert: Any = _nothing
    on_hit: Any = None
    block: tuple = ()
    key: tuple = ()
    glob: tuple = ()
    float_priority: bool = False
    aging: int | None = None
    layout: tuple[str, ...] | str = "par"
    expiry: Any = None
    on_expire: Any = None
    now: int = 0
    refresh: Any = None
    by_key: bool = False
    data: tuple[str, ...] = ()


@nb.njit(cache=True, inline="always")
def _no_refresh(s):
    pass


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


def inlined(fn: object, done: dict | None = None) -> object:
    """A copy of a numba dispatcher that numba inlines into its caller, as are the dispatchers it calls
    (helpers): the compiled twin's hooks then contain the policy's whole code (no call passing the state)."""
    done = {} if done is None else done
    if fn in done:
        return done[fn]
    py = fn.py_func  # type: ignore[attr-defined]
    glb = dict(py.__globals__)
    out = done[fn] = nb.njit(inline="always")(FunctionType(py.__code__, glb, py.__name__, py.__defaults__,
                                                           py.__closure__))
    for name in py.__code__.co_names:
        if isinstance(glb.get(name), Dispatcher):
            glb[name] = inlined(glb[name], done)
    return out


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
        n = cache.num_blocks  # type: ignore[attr-defined]
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


# ---------------------------------------------------------------------- compiled twin
# The compiled state is one CState: the policy's views and the framework's f_* arrays. f_bt (int64, capacity
# x (NF + NB + 1), stored field by field: f_b = f_bt.T, the framework's row view, is C-contiguous; f_bft its
# float64 view): per block NF framework fields first (the heap rows of kvlab/policies/_leaf.py; with
# expiries, the expiry heap's EH, EP, EKEY, ESTAMP and the expiry EXP; with key lists, BK, KNXT, KPRV), then
# the policy's NB (blk is the view f_b[NF:NF + NB]), then PRI = NF + NB, the priority at unpin (kept for
# aging and float keys). f_k: per dense key (transposed, each key's fields together), the framework's fields
# (leaf-only: CHILD, GHEAD; key lists: KHEAD, KTAIL) then the policy's. f_m = [heap size, parked heap size,
# stamp clock, expiry heap size]. f_arrival, f_prompt, f_offsets, f_key_ids, f_code: per request, the
# layout's parts (empty when absent).
CHILD, GHEAD = 0, 1  # per-key framework fields (leaf-only)
_NF = {False: 4, True: _leaf.LEAF_ROWS}  # framework fields per block before the policy's (heap; leaf-only)
NE = 3  # M slot: expiry heap size


@nb.njit(cache=True, inline="always")
def _get0(params):
    return params[0]


@nb.njit(cache=True, inline="always")
def _get1(params):
    return params[1]


@nb.njit(cache=True, inline="always")
def _get2(params):
    return params[2]


@nb.njit(cache=True, inline="always")
def _get3(params):
    return params[3]


@nb.njit(cache=True, inline="always")
def _whole(params):
    return params


@nb.njit(cache=True, inline="always")
def _no_floats(params):
    return np.zeros(0, np.float64)


@nb.njit(cache=True, inline="always")
def _no_ints(params):
    return np.zeros(0, np.int64)


@nb.njit(cache=True, inline="always")
def _key_float(Bt, Bft, b, pri, pr):
    Bft[b, pri] = pr
    return float_key(Bt[b, pri])


@nb.njit(cache=True, inline="always")
def _key_int(Bt, Bft, b, pri, pr):
    Bt[b, pri] = pr
    return Bt[b, pri]


@nb.njit(cache=True, inline="always")
def _key_int_unkept(Bt, Bft, b, pri, pr):  # (no aging: the priority need not be kept)
    return np.int64(pr)


def _keyof(Bt, Bft, b, pri, p):
    """The heap key of priority ``p`` (an int as it is, a float through ``float_key``), kept in field ``pri``."""


@overload(_keyof, jit_options={"cache": True})
def _keyof_impl(Bt, Bft, b, pri, p):
    if isinstance(p, nbtypes.Float):
        return lambda Bt, Bft, b, pri, p: _key_float(Bt, Bft, b, pri, p)
    return lambda Bt, Bft, b, pri, p: _key_int(Bt, Bft, b, pri, p)


@nb.njit(cache=True, inline="always")
def requeue_key(s, key, priority):
    """Give every evictable block of ``key`` the new ``priority`` (in their unpin order, each as if unpinned
    now: a new stamp). For a policy's functions, with ``Priority(by_key=True)``; in the Python core it is
    :meth:`PriorityPolicy._requeue_key`."""
    Bt, Bft, B, K, M, rows = s.f_bt, s.f_bft, s.f_b, s.f_k, s.f_m, s.f_rows
    nxt, head, pri = rows[0], rows[1], rows[2]
    b = K[head, key]
    while b >= 0:
        B[KEY, b] = _keyof(Bt, Bft, b, pri, priority)
        B[STAMP, b] = M[SCLOCK]
        M[SCLOCK] += 1
        heap_fix(B, M, H, P, KEY, STAMP, N, b)
        b = B[nxt, b]


@nb.njit(cache=True, inline="always")
def _age_none(state, b, pri, slot):
    pass


@nb.njit(cache=True, inline="always")
def _age_float(state, b, pri, slot):
    v = state.f_bft[b, pri]
    g = state.glob
    if v > g[slot]:
        g[slot] = v


@nb.njit(cache=True, inline="always")
def _age_int(state, b, pri, slot):
    v = state.f_bt[b, pri]
    g = state.globi
    if v > g[slot]:
        g[slot] = v


@nb.njit(cache=True, inline="always")
def _link_none(state, b, key, seq, pos):
    pass


@nb.njit(cache=True, inline="always")
def _link_leaf(state, b, key, seq, pos):
    parent = state.f_key_ids[state.f_offsets[seq] + pos - 1] if pos > 0 else -1
    _leaf.leaf_insert(state.f_b, state.f_k, b, key, parent, CHILD)


@nb.njit(cache=True, inline="always")
def _push_heap(state, b, k):
    heap_push_stamped(state.f_b, state.f_m, H, P, KEY, STAMP, N, SCLOCK, b, k)


@nb.njit(cache=True, inline="always")
def _push_leaf(state, b, k):
    _leaf.leaf_push(state.f_b, state.f_m, b, k)


@nb.njit(cache=True, inline="always")
def _pin_heap(state, b, seq):
    heap_remove(state.f_b, state.f_m, H, P, KEY, STAMP, N, b)


@nb.njit(cache=True, inline="always")
def _pin_leaf(state, b, seq):
    _leaf.leaf_drop(state.f_b, state.f_k, state.f_m, b, GHEAD)


@nb.njit(cache=True, inline="always")
def _victim_heap(state):
    return state.f_b[H, 0]


@nb.njit(cache=True, inline="always")
def _victim_leaf(state):
    return _leaf.leaf_victim(state.f_b, state.f_k, state.f_m, CHILD, GHEAD)


@nb.njit(cache=True, inline="always")
def _evict_heap(state, b):
    heap_remove(state.f_b, state.f_m, H, P, KEY, STAMP, N, b)


@nb.njit(cache=True, inline="always")
def _evict_leaf(state, b):
    _leaf.leaf_evict(state.f_b, state.f_k, state.f_m, b, CHILD, GHEAD)


# Templates: specialised per policy by :func:`compiled_twin`, their capitalised globals bound to the
# policy's functions and constants (placeholders here).
NF = NB = KF = NK = PRI = SLOT = NOW = EH = EP = EKEY = ESTAMP = EXP = BK = KNXT = KPRV = KHEAD = KTAIL = ND = 0
HAS_T = HAS_P = HAS_C = EXPIRES = BYKEY = False
FWINIT = BINIT = KFWINIT = KINIT = GINIT = ROWS = np.zeros(0, np.int64)
PAR = ARR = PROMPT = OFF = KEYS = CODE = INS = HIT = PRIO = REQ = KEYOF = LINK = PUSH = AGE = EVICT = _nothing
PIN = VICTIM = EXPIRY = EXPIRE = REFRESH = DATA = D0 = D1 = D2 = _nothing


def t_init(capacity, num_keys, params):
    Bt = np.zeros((NF + NB + 1, capacity), np.int64).T
    for j in range(NF):
        Bt[:, j] = FWINIT[j]
    for j in range(NB):
        Bt[:, NF + j] = BINIT[j]
    Kt = np.empty((num_keys, KF + NK), np.int64)
    for j in range(KF):
        Kt[:, j] = KFWINIT[j]
    for j in range(NK):
        Kt[:, KF + j] = KINIT[j]
    G = GINIT.copy()
    Bft = Bt.view(np.float64)
    Kft = Kt.view(np.float64)
    M = np.zeros(4, np.int64)
    return CState(Bt.T[NF:PRI], Bft.T[NF:PRI], Kt.T[KF:], Kft.T[KF:], G.view(np.float64), G, PAR(params),
                  DATA(params), Bt, Bft, Bt.T, Kt.T, M, ROWS, ARR(params), PROMPT(params), OFF(params), KEYS(params),
                  CODE(params))


def t_req(state, seq):
    t, p, c = 0.0, 0, 0.0
    if HAS_T:  # (a request field the policy does not read costs nothing)
        arrival = state.f_arrival
        if seq < len(arrival):
            t = arrival[seq]
    if HAS_P:
        prompt = state.f_prompt
        if seq < len(prompt):
            p = prompt[seq]
    if HAS_C:
        code = state.f_code
        if seq < len(code):
            c = code[seq]
    return Req(t, seq, -1, p, c)


def t_on_insert(state, b, key, seq, pos):
    INS(state, b, key, pos, REQ(state, seq))
    LINK(state, b, key, seq, pos)
    if BYKEY:
        state.f_bt[b, BK] = key


def t_on_hit(state, b, key, seq, pos):
    # an evictable block's heap key stays (as in Python): on_pin follows and takes it out
    HIT(state, b, key, pos, REQ(state, seq))


def t_on_unpin(state, b, seq):
    r = REQ(state, seq)
    PUSH(state, b, KEYOF(state.f_bt, state.f_bft, b, PRI, PRIO(state, b, r)))
    if EXPIRES:
        e = EXPIRY(state, b, r)
        if e < np.inf:  # the expiry heap, ties in unpin order
            Bt = state.f_bt
            state.f_bft[b, EXP] = e
            Bt[b, EKEY] = float_key(Bt[b, EXP])
            Bt[b, ESTAMP] = Bt[b, STAMP]
            heap_push(state.f_b, state.f_m, EH, EP, EKEY, ESTAMP, NE, b)
    if BYKEY:
        list_append(state.f_b, KNXT, KPRV, state.f_k, KHEAD, KTAIL, state.f_bt[b, BK], b)


def t_on_pin(state, b, seq):
    PIN(state, b, seq)
    if EXPIRES and state.f_b[EP, b] >= 0:
        heap_remove(state.f_b, state.f_m, EH, EP, EKEY, ESTAMP, NE, b)
    if BYKEY:
        list_unlink(state.f_b, KNXT, KPRV, state.f_k, KHEAD, KTAIL, state.f_bt[b, BK], b)


def t_victim(state):
    REFRESH(state)
    if EXPIRES:  # expired blocks (expiry <= now, in expiry order) take their new priority, as if unpinned now
        Bt, Bft, B, M = state.f_bt, state.f_bft, state.f_b, state.f_m
        now = state.glob[NOW]
        while M[NE] > 0:
            b = B[EH, 0]
            if not Bft[b, EXP] <= now:
                break
            heap_remove(B, M, EH, EP, EKEY, ESTAMP, NE, b)
            k = KEYOF(Bt, Bft, b, PRI, EXPIRE(state, b))
            heap_remove(B, M, H, P, KEY, STAMP, N, b)
            heap_push_stamped(B, M, H, P, KEY, STAMP, N, SCLOCK, b, k)
    return VICTIM(state)


def t_on_evict(state, b):
    AGE(state, b, PRI, SLOT)
    if EXPIRES and state.f_b[EP, b] >= 0:
        heap_remove(state.f_b, state.f_m, EH, EP, EKEY, ESTAMP, NE, b)
    if BYKEY:
        list_unlink(state.f_b, KNXT, KPRV, state.f_k, KHEAD, KTAIL, state.f_bt[b, BK], b)
    EVICT(state, b)


def t_data(params):
    if ND == 0:
        return ()
    if ND == 1:
        return (D0(params),)
    if ND == 2:
        return (D0(params), D1(params))
    return (D0(params), D1(params), D2(params))


_TEMPLATES = (t_req, t_data, t_init, t_on_insert, t_on_hit, t_on_unpin, t_on_pin, t_victim, t_on_evict)
_GETTERS = {0: _get0, 1: _get1, 2: _get2, 3: _get3}


def _raw(values: tuple) -> np.ndarray:
    """int64 raw values of initial fields: ints as they are, floats as their IEEE bits."""
    out = np.zeros(len(values), np.int64)
    for i, v in enumerate(values):
        out[i] = np.float64(v).view(np.int64) if isinstance(v, float) else int(v)
    return out


def _digest(cls: type, spec: Priority) -> str:
    """Names the policy's hooks in numba's on-disk cache: a digest of its module's source (or its functions'
    code), its spec and the framework's sources (numba checks only the templates' own file, not the files
    of what they inline or call: a change there must give new names, not reuse stale machine code)."""
    fields = (spec.block, spec.key, spec.glob, spec.float_priority, spec.aging, spec.layout, spec.now, spec.data,
              spec.by_key, spec.expiry is not None, spec.refresh is not None)
    h = hashlib.sha1(repr(fields).encode())
    for module in (inspect.getmodule(cls), _leaf, sys.modules[__name__], sys.modules[heap_push.__module__]):
        try:
            h.update(inspect.getsource(module).encode())  # type: ignore[arg-type]
        except (OSError, TypeError):  # (a policy defined interactively: its functions' code)
            for fn in (spec.priority, spec.on_insert, spec.on_hit or _nothing, spec.expiry or _never,
                       spec.on_expire or _zero, spec.refresh or _no_refresh):
                code = fn.py_func.__code__
                h.update(code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode())
    return h.hexdigest()[:12]


def compiled_twin(cls: type, spec: Priority, *, leaf: bool) -> CompiledPolicy:
    """The numba hooks of a priority policy: the templates above, specialised to ``spec`` (functions
    cached on disk under a name that changes with the policy's module)."""
    layout = (spec.layout,) if isinstance(spec.layout, str) else tuple(spec.layout)
    index = {name: i for i, name in enumerate(layout)}

    def getter(name: str, empty: object) -> object:
        if name not in index:
            return empty
        return _whole if isinstance(spec.layout, str) else _GETTERS[index[name]]

    expires = spec.expiry is not None
    e0 = _NF[leaf]
    k0 = e0 + 5 if expires else e0  # the by-key rows: the block's key, its key's list of evictable blocks
    nf = k0 + 3 if spec.by_key else k0
    fw = np.zeros(nf, np.int64)
    kfw = np.full(2 if leaf or spec.by_key else 0, -1, np.int64)
    if spec.by_key:
        fw[k0:] = -1
    if len(spec.data) > 3:
        raise TypeError(f"{cls.__name__}: at most 3 data parts")
    data = [getter(name, _no_floats) for name in spec.data] + [_no_floats] * (3 - len(spec.data))
    if leaf:
        fw[[_leaf.P, _leaf.P2, _leaf.BKEY, _leaf.BPAR, GNXT, GPRV]] = -1
        kfw[CHILD] = 0
    else:
        fw[P] = -1
    if expires:
        fw[e0 + 1] = -1  # EP
    floatp = spec.float_priority
    g = dict(globals())
    g.update(
        NF=nf, NB=len(spec.block), FWINIT=fw, BINIT=_raw(spec.block), KF=len(kfw), NK=len(spec.key),
        KFWINIT=kfw, KINIT=_raw(spec.key), GINIT=_raw(spec.glob), PRI=nf + len(spec.block),
        PAR=getter("par", _no_floats), ARR=getter("arrival", _no_floats), PROMPT=getter("prompt_tokens", _no_ints),
        OFF=getter("offsets", _no_ints), KEYS=getter("key_ids", _no_ints), CODE=getter("code", _no_floats),
        HAS_T="arrival" in index, HAS_P="prompt_tokens" in index, HAS_C="code" in index, EXPIRES=expires,
        EH=e0, EP=e0 + 1, EKEY=e0 + 2, ESTAMP=e0 + 3, EXP=e0 + 4, NOW=spec.now,
        EXPIRY=spec.expiry or _never, EXPIRE=spec.on_expire or _zero, REFRESH=spec.refresh or _no_refresh,
        BYKEY=spec.by_key, BK=k0, KNXT=k0 + 1, KPRV=k0 + 2, KHEAD=0, KTAIL=1,
        ROWS=np.array([k0 + 1, 0, nf + len(spec.block)]),
        ND=len(spec.data), D0=data[0], D1=data[1], D2=data[2],
        PIN=_pin_leaf if leaf else _pin_heap, VICTIM=_victim_leaf if leaf else _victim_heap,
        INS=spec.on_insert, HIT=spec.on_hit or _nothing, PRIO=spec.priority,
        KEYOF=_key_float if floatp else _key_int if spec.aging is not None else _key_int_unkept,
        LINK=_link_leaf if leaf else _link_none,
        PUSH=_push_leaf if leaf else _push_heap, EVICT=_evict_leaf if leaf else _evict_heap,
        AGE=_age_none if spec.aging is None else _age_float if floatp else _age_int,
        SLOT=-1 if spec.aging is None else spec.aging,
    )
    done: dict = {}
    for name in ("INS", "HIT", "PRIO", "EXPIRY", "EXPIRE", "REFRESH"):  # the policy's functions, inlined
        g[name] = inlined(g[name], done)
    label = f"{cls.__module__}.{cls.__qualname__}.{_digest(cls, spec)}"
    made = {}
    for tmpl in _TEMPLATES:
        f = FunctionType(tmpl.__code__, g, tmpl.__name__, tmpl.__defaults__, tmpl.__closure__)
        f.__qualname__ = f"{label}.{tmpl.__name__}"
        made[tmpl.__name__] = nb.njit(cache=True, inline="always" if tmpl in (t_req, t_data) else "never")(f)
    g["REQ"], g["DATA"] = made["t_req"], made["t_data"]
    return CompiledPolicy(made["t_init"], made["t_on_insert"], made["t_on_hit"], made["t_on_pin"], made["t_on_unpin"],
                          made["t_victim"], made["t_on_evict"])
