"""The compiled twin of a priority policy (:func:`compiled_twin`): templates of the seven hooks of
:class:`~kvlab.cache.compiled.CompiledPolicy`, specialised to a policy's :class:`Priority` (its functions and
constants bound as the templates' globals, inlined, and cached on disk by numba under a name that digests
every source they depend on), on numpy arrays over block ids and dense key ids. The framework's mechanics
(stamped heap, leaf-only parking, aging, expiries, per-key lists) mirror the Python core's
(kvlab.policies._heap, kvlab.policies._priority) operation for operation, so both give the same numbers;
the exactness tests check each policy request for request. Not a policy (the package skips ``_`` modules).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from types import FunctionType

import numba as nb
import numpy as np
from numba.core import types as nbtypes
from numba.core.dispatcher import Dispatcher
from numba.extending import overload

from kvlab.cache.compiled import CompiledPolicy
from kvlab.policies import _leaf, _priority_spec
from kvlab.policies._leaf import GNXT, GPRV, KEY, SCLOCK, STAMP, H, N, P
from kvlab.policies._priority_spec import (
    CState,
    Priority,
    Req,
    _never,
    _no_refresh,
    _nothing,
    _zero,
)
from kvlab.policies._queues import (
    float_key,
    heap_fix,
    heap_push,
    heap_push_stamped,
    heap_remove,
    list_append,
    list_unlink,
)


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


def t_on_remove(state, b):
    """A key dropped without eviction (a lower tier's exclusive move up, a reset): on_evict without aging, as
    the Python class's ``on_remove``."""
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


_TEMPLATES = (t_req, t_data, t_init, t_on_insert, t_on_hit, t_on_unpin, t_on_pin, t_victim, t_on_evict,
              t_on_remove)
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
    for module in (inspect.getmodule(cls), _leaf, _priority_spec, sys.modules[__name__],
                   sys.modules[heap_push.__module__]):
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
                          made["t_victim"], made["t_on_evict"], on_remove=made["t_on_remove"])
