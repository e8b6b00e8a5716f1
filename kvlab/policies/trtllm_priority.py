"""TensorRT-LLM KV cache reuse priorities: retention priority 0-100 per block range, optional expiry.

Source: TensorRT-LLM docs "KV cache system" and "How to change block priorities"
(``KvCacheRetentionConfig`` with ``TokenRangeRetentionConfig(token_start, token_end, priority,
duration_ms)``, default priority 35), and cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp
(``LRUEvictionPolicy``): one free queue per priority level, the lowest non-empty level evicted first,
LRU (front of the queue) within a level; a block released with a non-default priority and a duration
gets ``expiration = release time + duration``; ``refresh()`` moves expired blocks to the *back* of the
default level. A claim (allocation or reuse) sets the block's priority when the request gives one for
it and always replaces its duration.

kvlab's version:

* Ranges are in *blocks* of the request (``KVBlock.position``): ``priorities=[(0, 4, 90)]`` gives the
  first four blocks (a system prompt) priority 90; a tuple may carry its own duration,
  ``(start, end, priority, duration_s)``, else ``duration_s`` applies; ``end=None`` means to the end.
  ``by_category={"api": [...]}`` replaces the ranges for requests of that category. The first range
  that contains a block wins.
* On insert, a block covered by no range gets ``default`` and no expiry; on a hit, an uncovered block
  keeps its priority and loses its duration (TRT-LLM's claim without a priority). A covered block gets
  the range's priority and duration on every access.
* The expiry clock is ``ctx.time`` (seconds): ``release time`` = time of the ``on_unpin`` that makes the
  block evictable; "now" for ``victim()`` is the latest ``ctx.time`` seen (``victim()`` has no context).
* TRT-LLM's free queues hold only leaf blocks of its radix tree; this policy orders every evictable
  block. For TRT-LLM's leaf restriction too, use ``make_policy("prefix-aware", inner="trtllm-priority",
  inner_params={...})``.
* Decode-block priorities (``decode_retention_priority``) are not modelled: output blocks are keyed by
  position like any other block. No state survives eviction.

A priority policy (kvlab.policies._priority): the priority is the retention priority at unpin, so the
order is lowest priority first, least recently unpinned within it; a block's expiry is the framework's
(an expiry heap keyed by (time + duration, unpin stamp); an expired block is re-queued at the back of
the default level). Python: one bucket per level, O(1) per event but for expiries (O(log n)); compiled:
O(log n) per event. The compiled twin supports every parameter: the
ranges are flattened into ``params()``, each request's range set is ``r.code`` (``request_code`` /
``request_codes``), its time the workload's ``arrival`` (``prepare``). "now" is updated by the same
hooks (insert, hit, unpin) with the same float comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import numba as nb
import numpy as np
from pydantic import AfterValidator, Field

from kvlab.cache.context import AccessContext
from kvlab.policies._priority import BucketPriorityPolicy, Priority, field
from kvlab.policies.base import register_policy

MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 100, 35

Range = tuple[int, int | None, int, float | None]

# the declared parameters; block positions are below 2**31 everywhere in kvlab
_POS = Annotated[int, Field(ge=0, le=2**31)]
_LEVEL = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
_DURATION = Annotated[float, Field(ge=0)] | None


def _start_before_end(r: tuple) -> tuple:
    if r[1] is not None and r[1] <= r[0]:
        raise ValueError("end <= start")
    return r


_RANGE = Annotated[
    tuple[_POS, _POS | None, _LEVEL] | tuple[_POS, _POS | None, _LEVEL, _DURATION], AfterValidator(_start_before_end)
]
RANGES = (f"a list of (start, end, priority[, duration_s]) block ranges with 0 <= start < end <= 2**31 (end None: "
          f"to the end), priority an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], duration_s a finite number >= 0 "
          "or None")
Ranges = Annotated[list[_RANGE], Field(description=RANGES)]
ByCategory = Annotated[
    dict[Annotated[str, Field(coerce_numbers_to_str=True)], list[_RANGE]] | None,
    Field(description="None or a mapping from category (a string) to " + RANGES),
]


def _ranges(spec: Sequence[Sequence], duration_s: float | None) -> list[Range]:
    """Ranges (checked by the declaration) with their durations filled in."""
    out: list[Range] = []
    for r in spec:
        start, end, prio = int(r[0]), None if r[1] is None else int(r[1]), int(r[2])
        dur = (None if r[3] is None else float(r[3])) if len(r) == 4 else duration_s
        out.append((start, end, prio, dur))
    return out


LEVEL, HASDUR, DUR = 0, 1, 2  # per-block fields: retention priority, has a duration, duration (float)
NOW = 0  # global float slot: the latest ctx.time seen
DEFAULT, RANGED, NSETS, SETS = 0, 1, 2, 3  # params(): default, ranged, range sets, their offsets, ranges


@nb.njit(cache=True)
def _assign(s, b, pos, r, insert):
    """``on_insert`` (``insert``) / ``on_hit``: now, then the priority and duration of the covering range
    (a block covered by none: ``default`` at insert; a hit keeps its priority and drops its duration)."""
    g = s.glob
    if r.time > g[NOW]:
        g[NOW] = r.time
    par, level, hasdur = s.par, s.blk[LEVEL], s.blk[HASDUR]
    if par[RANGED] != 0.0:
        code = int(r.code)
        first = SETS + int(par[NSETS]) + 1
        for j in range(int(par[SETS + code]), int(par[SETS + code + 1])):
            i = first + 5 * j  # start, end (-1: none), priority, has a duration, duration
            if par[i] <= pos and (par[i + 1] < 0.0 or pos < par[i + 1]):
                level[b] = int(par[i + 2])
                hasdur[b] = int(par[i + 3])
                s.blkf[DUR][b] = par[i + 4]
                return
    if insert:
        level[b] = int(par[DEFAULT])
    hasdur[b] = 0


@nb.njit(cache=True)
def _insert(s, b, key, pos, r):
    _assign(s, b, pos, r, True)


@nb.njit(cache=True)
def _hit(s, b, key, pos, r):
    _assign(s, b, pos, r, False)


@nb.njit(cache=True)
def _priority(s, b, r):
    g = s.glob
    if r.time > g[NOW]:
        g[NOW] = r.time
    return s.blk[LEVEL][b]


@nb.njit(cache=True)
def _expiry(s, b, r):
    """A non-default priority with a duration expires at release time + duration."""
    if s.blk[HASDUR][b] != 0 and s.blk[LEVEL][b] != int(s.par[DEFAULT]):
        return r.time + s.blkf[DUR][b]
    return np.inf


@nb.njit(cache=True)
def _expire(s, b):
    d = int(s.par[DEFAULT])
    s.blk[LEVEL][b] = d
    return d


@register_policy("trtllm-priority")
class TRTLLMPriority(BucketPriorityPolicy):
    """Lowest retention priority first, LRU within a priority; expired priorities fall to ``default``."""

    source = "TensorRT-LLM KvCacheRetentionConfig + LRUEvictionPolicy (evictionPolicy.cpp)"
    spec = Priority(_priority, _insert, _hit, block=(0, 0, 0.0), glob=(float("-inf"),), expiry=_expiry,
                    on_expire=_expire, now=NOW, layout=("par", "arrival", "code"))
    _prio = field(LEVEL)

    def __init__(
        self,
        priorities: Ranges = (),
        default: _LEVEL = DEFAULT_PRIORITY,
        duration_s: _DURATION = None,
        by_category: ByCategory = None,
    ) -> None:
        super().__init__()
        self.default = int(default)
        self.ranges = _ranges(priorities, duration_s)
        self.by_category = {str(k): _ranges(v, duration_s) for k, v in (by_category or {}).items()}
        self._ranged = bool(self.ranges or self.by_category)
        self._set_of = {name: 1 + i for i, name in enumerate(self.by_category)}  # range set 0: ``priorities``

    @property
    def now(self) -> float:
        return self.state.glob[NOW]

    def params(self) -> list[float]:
        """``[default, ranged, sets, set offsets (sets + 1), then per range: start, end or -1, priority, has a
        duration, duration]``; set 0 is ``priorities``, set 1 + i the i-th ``by_category`` entry."""
        sets = [self.ranges, *self.by_category.values()]
        out = [float(self.default), 1.0 if self._ranged else 0.0, float(len(sets)), 0.0]
        for rs in sets:
            out.append(out[-1] + len(rs))
        for rs in sets:
            for start, end, prio, dur in rs:
                out += [start, -1.0 if end is None else end, prio, 0.0 if dur is None else 1.0, dur or 0.0]
        return [float(x) for x in out]

    def request_code(self, ctx: AccessContext) -> int:
        """The range set a request uses: its category's if ``by_category`` names it, else ``priorities``."""
        return self._set_of.get(ctx.category, 0) if self._set_of else 0

    def request_codes(self, encoded: object) -> np.ndarray:
        """``request_code`` of each request of a workload (its category codes and labels)."""
        codes = getattr(encoded, "category_codes", None)
        n = len(encoded.prompt_tokens)  # type: ignore[attr-defined]
        if codes is None or not self._set_of:
            return np.zeros(n, np.float64)
        labels = tuple(getattr(encoded, "categories", ()))
        code_set = np.array([self._set_of.get(str(label), 0) for label in labels] + [0], np.float64)
        return code_set[np.asarray(codes, dtype=np.int64)]  # code -1 (no category) -> the appended 0
