"""Ordered queues shared by the classic policies (not a policy: the package skips ``_`` modules).

* ``heap_*`` (numba): an *indexed* binary min-heap over block ids ordered by two int64 keys; removal
  of any member is O(log n). Keyed by (key, push stamp) it gives the order of the Python core's
  ``kvlab.policies._heap`` queues, which keeps compiled hooks hit for hit equal to the Python core.
* ``fq_*`` (numba): FIFO queues whose pinned members keep their place, O(1) per event but for the
  rare parked block (O(log n)): fifo, s3fifo and 2q.
* ``dl_*`` (numba): doubly linked lists with sentinels.
* :func:`float_key` (numba): an int64 heap key ordered like a float64 priority (compiled twins of
  policies with float priorities, e.g. gdsf).
* :func:`grow_keys` (numpy): per-key state with list sentinels, for more key ids (``CompiledPolicy.grow``).
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def _sift_up(B, H, P, K1, K2, i):
    b = B[H, i]
    while i > 0:
        parent = (i - 1) >> 1
        pb = B[H, parent]
        if B[K1, b] > B[K1, pb] or (B[K1, b] == B[K1, pb] and B[K2, b] >= B[K2, pb]):
            break
        B[H, i] = pb
        B[P, pb] = i
        i = parent
    B[H, i] = b
    B[P, b] = i


@nb.njit(cache=True)
def _sift_down(B, H, P, K1, K2, size, i):
    b = B[H, i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size:
            left, right = B[H, c], B[H, c + 1]
            if B[K1, right] < B[K1, left] or (B[K1, right] == B[K1, left] and B[K2, right] < B[K2, left]):
                c += 1
        cb = B[H, c]
        if B[K1, cb] > B[K1, b] or (B[K1, cb] == B[K1, b] and B[K2, cb] >= B[K2, b]):
            break
        B[H, i] = cb
        B[P, cb] = i
        i = c
    B[H, i] = b
    B[P, b] = i


@nb.njit(cache=True)
def heap_push(B, M, H, P, K1, K2, N, b):
    """Add ``b`` (not a member) with its current keys."""
    i = M[N]
    M[N] = i + 1
    B[H, i] = b
    B[P, b] = i
    _sift_up(B, H, P, K1, K2, i)


@nb.njit(cache=True)
def heap_push_stamped(B, M, H, P, K1, K2, N, C, b, key):
    """Add ``b`` keyed by ``(key, next stamp)``; ``M[C]`` is the stamp clock, so equal keys leave in push
    order (the Python queues' tie-break: least recently unpinned first)."""
    B[K1, b] = key
    B[K2, b] = M[C]
    M[C] += 1
    heap_push(B, M, H, P, K1, K2, N, b)


@nb.njit(cache=True)
def heap_remove(B, M, H, P, K1, K2, N, b):
    """Remove member ``b``."""
    i = B[P, b]
    B[P, b] = -1
    last_i = M[N] - 1
    M[N] = last_i
    if i == last_i:
        return
    last = B[H, last_i]
    B[H, i] = last
    B[P, last] = i
    _sift_down(B, H, P, K1, K2, last_i, i)
    if B[P, last] == i:
        _sift_up(B, H, P, K1, K2, i)


@nb.njit(cache=True)
def heap_fix(B, M, H, P, K1, K2, N, b):
    """Restore the order after member ``b``'s keys changed."""
    _sift_up(B, H, P, K1, K2, B[P, b])
    _sift_down(B, H, P, K1, K2, M[N], B[P, b])


# FIFO queues whose pinned members keep their place. Rows ``NXT``/``PRV`` (links; the queue's sentinel is
# column ``s``), ``LOC`` (0 absent, 1 in the list, 2 in the front heap, 3 parked), ``PIN`` (pinned), and
# a front heap (rows ``H``, ``P``, ``K1`` = zeros, ``K2`` = stamps; size ``M[N]``). A pinned block that
# reaches the head is *parked* (unlinked); when unpinned it joins the front heap, whose members are all
# older than every list member (they were at the head), so the queue's order is "front heap by stamp,
# then the list": the stamp order of its unpinned members. Appended blocks must carry the largest stamp.


@nb.njit(cache=True)
def fq_append(B, NXT, PRV, LOC, s, b):
    """Link ``b`` at the tail of the queue with sentinel ``s``."""
    last = B[PRV, s]
    B[NXT, last] = b
    B[PRV, b] = last
    B[NXT, b] = s
    B[PRV, s] = b
    B[LOC, b] = 1


@nb.njit(cache=True)
def fq_first(B, M, NXT, PRV, LOC, PIN, H, P, K1, K2, N, s):
    """The oldest unpinned member of the queue with sentinel ``s`` (-1 if none); parks pinned heads."""
    while True:
        if M[N] > 0:
            b = B[H, 0]
            if B[PIN, b] == 0:
                return b
            heap_remove(B, M, H, P, K1, K2, N, b)
        else:
            b = B[NXT, s]
            if b == s:
                return -1
            if B[PIN, b] == 0:
                return b
            B[NXT, B[PRV, b]] = B[NXT, b]
            B[PRV, B[NXT, b]] = B[PRV, b]
        B[LOC, b] = 3


@nb.njit(cache=True)
def fq_remove(B, M, NXT, PRV, LOC, H, P, K1, K2, N, b):
    """Take ``b`` out of its queue, wherever it is."""
    where = B[LOC, b]
    if where == 1:
        B[NXT, B[PRV, b]] = B[NXT, b]
        B[PRV, B[NXT, b]] = B[PRV, b]
    elif where == 2:
        heap_remove(B, M, H, P, K1, K2, N, b)
    B[LOC, b] = 0


@nb.njit(cache=True)
def fq_unpin(B, M, LOC, PIN, H, P, K1, K2, N, b):
    """``b`` (a member) was unpinned: if parked, it rejoins its queue at its old place (the front heap)."""
    B[PIN, b] = 0
    if B[LOC, b] == 3:
        heap_push(B, M, H, P, K1, K2, N, b)
        B[LOC, b] = 2


@nb.njit(cache=True)
def dl_append(B, NXT, PRV, s, x):
    """Doubly linked list on rows ``NXT``/``PRV``: link ``x`` before sentinel ``s`` (at the MRU end)."""
    last = B[PRV, s]
    B[NXT, last] = x
    B[PRV, x] = last
    B[NXT, x] = s
    B[PRV, s] = x


@nb.njit(cache=True)
def dl_unlink(B, NXT, PRV, x):
    B[NXT, B[PRV, x]] = B[NXT, x]
    B[PRV, B[NXT, x]] = B[PRV, x]


@nb.njit(cache=True)
def list_append(B, NXT, PRV, L, HEAD, TAIL, k, b):
    """Lists without sentinels: members linked on rows ``NXT``/``PRV`` of ``B`` (-1 = none), list ``k``'s
    first and last member at ``L[HEAD, k]`` / ``L[TAIL, k]`` (-1 when empty). Append ``b`` to list ``k``."""
    t = L[TAIL, k]
    B[PRV, b] = t
    B[NXT, b] = -1
    if t >= 0:
        B[NXT, t] = b
    else:
        L[HEAD, k] = b
    L[TAIL, k] = b


@nb.njit(cache=True)
def list_unlink(B, NXT, PRV, L, HEAD, TAIL, k, b):
    """Take member ``b`` out of list ``k`` (as :func:`list_append`)."""
    prv, nxt = B[PRV, b], B[NXT, b]
    if prv >= 0:
        B[NXT, prv] = nxt
    else:
        L[HEAD, k] = nxt
    if nxt >= 0:
        B[PRV, nxt] = prv
    else:
        L[TAIL, k] = prv


_LOW63 = 0x7FFFFFFFFFFFFFFF


@nb.njit(cache=True, inline="always")
def float_key(bits):
    """An int64 ordered like the float64 whose IEEE bits are ``bits`` (read them through a float64 view
    of an int64 array): ``a < b`` for floats iff ``float_key(bits(a)) < float_key(bits(b))``, and the
    keys of ``-0.0`` and ``0.0`` are equal (both 0), as the floats are. Non-negative floats keep their
    bits; a negative one's magnitude bits are flipped (larger magnitude, smaller key) and shifted up by
    one. NaN is not ordered (its key is arbitrary)."""
    if bits < 0:
        return (bits ^ _LOW63) + 1
    return bits


def grow_keys(K, num_keys, sentinels, links):
    """Per-key state ``K`` (rows x (old keys + ``sentinels``), the sentinel columns last, as linked lists over
    key ids keep them) for ``num_keys`` keys: key columns kept, new key columns 0, the sentinel columns
    moved to the end and the links to them (rows ``links``) renumbered. For a ``CompiledPolicy.grow``."""
    old = K.shape[1] - sentinels
    out = np.zeros((K.shape[0], num_keys + sentinels), K.dtype)
    out[:, :old] = K[:, :old]
    out[:, num_keys:] = K[:, old:]
    for r in links:
        for part in (out[r, :old], out[r, num_keys:]):
            part[part >= old] += num_keys - old
    return out
