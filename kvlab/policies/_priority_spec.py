"""What a priority policy is written in (docs/policies.md, "Writing a priority policy"): the :class:`Priority`
spec naming its numba functions, the :class:`State` they read and write in the Python core and its compiled
form :class:`CState`, the request :class:`Req` they see, and the default (no-op) functions. Shared by the
Python core (kvlab.policies._priority) and the compiled twin (kvlab.policies._priority_kernel). Not a
policy (the package skips ``_`` modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba.core import types as nbtypes
from numba.experimental import structref


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
