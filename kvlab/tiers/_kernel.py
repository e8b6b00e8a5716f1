"""The tiered replay kernel's code: :class:`kvlab.tiers.TierStack` step for step, on dense ids.

These functions are a *template*, never called here: :mod:`kvlab.tiers.compiled` copies their source into a
module generated per set of policy hooks (one per tier count), next to the hooks bound as globals
(``h0_*``: the device policy's :class:`~kvlab.cache.compiled.CompiledPolicy` hooks; ``h1_*``, ``h2_*``, ...:
each lower tier's) and to ``t_*(S, lv, ...)``: the call of lower tier ``lv``'s hook on its state ``S[lv]``.
numba then caches that module's kernel on disk, specialised on the hooks (kvlab.cache.compiled.kernel_for's
trick). The stubs below only name what the generated module defines.

State: ``S`` = the policies' states (``S[0]`` the device's, ``S[lv]`` lower tier ``lv``'s; separate arguments
``s0 .. sL`` in the generated code) and the tier state ``C, SL, KS, P``: four int64 arrays (few arguments;
numba passes a tuple flattened). Level 0 is the device, levels ``1 .. L`` the lower tiers in order; every count
is in blocks of the device's block size unless it says chunks (a lower tier's *slot* holds one chunk). A tier's
slots have local ids ``0 .. cap - 1`` (what its hooks see) and global ids ``base + slot`` (columns of ``SL``).

* ``C [L+1, NCOLS]``: per tier, its configuration (CAP .. TOUCH), free / evictable slots (TOP, NEV) and its
  counters (LOOKED_UP ..: TierCounters' fields).
* ``SL [6, slots]``: per slot, the free stacks (tier ``lv``'s at ``base ..``, top = the free queue's front), ref
  count, key (the dense id of its chunk's last block, -1 = none), position (what its store named), the
  request that found it (touch skips it then) and whether it is unread (stored, not loaded since).
* ``KS [2L+2, num_keys]``: row 0 the device's index (the oldest block holding a key, -1 = none); row ``lv``
  tier ``lv``'s (a lower tier never holds a key twice: ``TierStack._store`` skips a key it holds); row
  ``L+1`` the selective hit counts (hits while resident on the device); row ``L+1+lv`` tier ``lv``'s
  inclusive pins.
* ``P [L+1, 5]``: a store's write_back cascade, one row per level (``lv, slot, key, pos, evicted key``).
"""

from __future__ import annotations

import numpy as np

Arr = np.ndarray
# per-tier configuration codes (column WRITE / INCL of C)
WRITE_THROUGH, SELECTIVE, WRITE_BACK = 0, 1, 2
NO_INCLUSION, INCLUSIVE, EXCLUSIVE = 0, 1, 2
# C [L+1, NCOLS]: per tier, its configuration, free and evictable slots, then its counters (TierCounters' fields)
CAP, BASE, CHUNK, WRITE, SEL, INCL, TOUCH, TOP, NEV = range(9)
LOOKED_UP, FOUND, LOADED, STORED, SKIPPED, EVICTIONS, EVICTED_UNREAD, REMOVED = range(9, 17)
NCOLS = 17
COUNTERS = ("looked_up_blocks", "found_blocks", "loaded_blocks", "stored_chunks", "stores_skipped", "evictions",
            "evicted_unread", "removed_exclusive")  # columns LOOKED_UP ..
# SL [6, slots]: per slot (global id)
FREE, REF, SKEY, SPOS, MARK, UNREAD = range(6)
CONSTANTS = ("WRITE_THROUGH", "SELECTIVE", "WRITE_BACK", "NO_INCLUSION", "INCLUSIVE", "EXCLUSIVE", "CAP", "BASE",
             "CHUNK", "WRITE", "SEL", "INCL", "TOUCH", "TOP", "NEV", "LOOKED_UP", "FOUND", "LOADED", "STORED",
             "SKIPPED", "EVICTIONS", "EVICTED_UNREAD", "REMOVED", "FREE", "REF", "SKEY", "SPOS", "MARK", "UNREAD")


def _generated(*args):  # noqa: ANN002, ANN202 - stands for the generated module's functions
    raise NotImplementedError("template code: run through kvlab.tiers.compiled")


init_states = t_on_insert = t_on_hit = t_on_pin = t_on_unpin = t_victim = t_on_evict = t_on_remove = _generated
h0_on_insert = h0_on_hit = h0_on_pin = h0_on_unpin = h0_victim = h0_on_evict = h0_on_miss = _generated
max_hit_blocks = _generated


# ---------------------------------------------------------------------- one slot (PrefixCache primitives)
def tier_touch_one(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, s: int, r: int) -> None:
    """PrefixCache.touch of one slot: on_hit, then pin (on_pin when it leaves the evictable set)."""
    g = C[lv, BASE] + s
    t_on_hit(S, lv, s, SL[SKEY, g], r, SL[SPOS, g])
    if SL[REF, g] == 0:
        t_on_pin(S, lv, s, r)
        C[lv, NEV] -= 1
    SL[REF, g] += 1


def tier_release(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, s: int, r: int) -> None:
    """PrefixCache.release of one slot: keyed -> evictable (on_unpin), unkeyed -> the free queue's front."""
    g = C[lv, BASE] + s
    SL[REF, g] -= 1
    if SL[REF, g] == 0:
        if SL[SKEY, g] >= 0:
            t_on_unpin(S, lv, s, r)
            C[lv, NEV] += 1
        else:
            SL[FREE, C[lv, BASE] + C[lv, TOP]] = s
            C[lv, TOP] += 1


def resident_above(KS: Arr, lv: int, k: int) -> bool:
    """TierStack._resident_above: the device (KS row 0) or a tier above ``lv`` holds key ``k``."""
    for u in range(lv):  # noqa: SIM110 - a loop numba compiles
        if KS[u, k] >= 0:
            return True
    return False


# ---------------------------------------------------------------------- TierStack mechanics
def unpin_above(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, level: int, k: int, r: int) -> None:
    """TierStack._unpin_above: ``k``'s last copy left tier ``level`` (0 = device)."""
    levels = C.shape[0] - 1
    for lv in range(level + 1, levels + 1):
        if C[lv, INCL] == INCLUSIVE and KS[levels + 1 + lv, k] and not resident_above(KS, lv, k):
            KS[levels + 1 + lv, k] = 0
            s = KS[lv, k]
            if s >= 0:
                tier_release(S, C, SL, KS, P, lv, s, r)


def pin_above(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, k: int, r: int) -> None:
    """TierStack._pin_above: an inclusive tier pins ``k`` (now resident above) once."""
    row = C.shape[0] + lv
    if KS[row, k]:
        return
    s = KS[lv, k]
    if s >= 0:
        tier_touch_one(S, C, SL, KS, P, lv, s, r)
        KS[row, k] = 1


def tier_remove(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, k: int) -> None:
    """TierStack._remove: exclusive tier ``lv`` drops ``k`` (on_remove, no listener); the slot goes to the
    front of the free queue."""
    s = KS[lv, k]
    if s < 0:
        return
    g = C[lv, BASE] + s
    if SL[REF, g] != 0:
        return
    t_on_remove(S, lv, s)
    C[lv, NEV] -= 1
    KS[lv, k] = -1
    SL[SKEY, g] = -1
    SL[UNREAD, g] = 0
    C[lv, REMOVED] += 1
    SL[FREE, C[lv, BASE] + C[lv, TOP]] = s
    C[lv, TOP] += 1


def store(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, k: int, pos: int, r: int) -> int:
    """TierStack._store of key ``k`` (position ``pos``) in tier ``lv``, with its write_back cascade.

    Python recurses: allocating a slot may evict a key, whose listener stores it in the tier below (if that
    tier is write_back), and so on; then it releases inclusive pins (_unpin_above) and the store keys its
    slot. Here the allocations run down the levels first (rows of ``P``), then each level finishes, deepest
    first: the same hook order. Returns the new slot of tier ``lv`` for the caller to release (it stays pinned
    till then: TierStack.keyed's ``held``), or -1 (not stored, or kept pinned by an inclusive tier)."""
    levels = C.shape[0] - 1
    n = 0
    while True:
        if KS[lv, k] >= 0:
            break
        if C[lv, INCL] == EXCLUSIVE and resident_above(KS, lv, k):
            break  # stored when it leaves the tiers above
        if C[lv, TOP] + C[lv, NEV] == 0:
            C[lv, SKIPPED] += 1
            break
        gone, gone_pos = -1, -1
        if C[lv, TOP] > 0:
            C[lv, TOP] -= 1
            s = SL[FREE, C[lv, BASE] + C[lv, TOP]]
        else:
            s = t_victim(S, lv)
            t_on_evict(S, lv, s)
            C[lv, NEV] -= 1
            g = C[lv, BASE] + s
            gone, gone_pos = SL[SKEY, g], SL[SPOS, g]
            KS[lv, gone] = -1
            SL[SKEY, g] = -1
            C[lv, EVICTIONS] += 1
            if SL[UNREAD, g]:
                SL[UNREAD, g] = 0
                C[lv, EVICTED_UNREAD] += 1
        P[n, 0], P[n, 1], P[n, 2], P[n, 3], P[n, 4] = lv, s, k, pos, gone
        n += 1
        if gone >= 0 and lv < levels and C[lv + 1, WRITE] == WRITE_BACK:
            lv, k, pos = lv + 1, gone, gone_pos
            continue
        break
    for i in range(n - 1, -1, -1):
        lv, s, k, pos, gone = P[i, 0], P[i, 1], P[i, 2], P[i, 3], P[i, 4]
        if gone >= 0:
            unpin_above(S, C, SL, KS, P, lv, gone, r)
        g = C[lv, BASE] + s
        SL[REF, g] = 1
        SL[SKEY, g] = k
        SL[SPOS, g] = pos
        KS[lv, k] = s
        t_on_insert(S, lv, s, k, r, pos)
        C[lv, STORED] += 1
        SL[UNREAD, g] = 1
        if C[lv, INCL] == INCLUSIVE and resident_above(KS, lv, k):
            KS[levels + 1 + lv, k] = 1  # stays pinned (ref count 1) while resident above
        elif i == 0:
            return s
        else:
            tier_release(S, C, SL, KS, P, lv, s, r)
    return -1


def device_dropped(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, k: int, pos: int, r: int) -> None:
    """TierStack._device_dropped: the device's last copy of ``k`` (position ``pos``) was evicted."""
    KS[C.shape[0], k] = 0  # selective hit count
    if C.shape[0] > 1 and C[1, WRITE] == WRITE_BACK:
        stored(S, C, SL, KS, P, np.int64(1), k, pos, r)  # np.int64: a literal would compile the callee again
    unpin_above(S, C, SL, KS, P, np.int64(0), k, r)


def stored(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, k: int, pos: int, r: int) -> None:
    """store, then release the new slot at once."""
    s = store(S, C, SL, KS, P, lv, k, pos, r)
    if s >= 0:
        tier_release(S, C, SL, KS, P, lv, s, r)


def tiers_keyed(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, key_ids: Arr, start: int, a: int, e: int,
                computed: int, r: int, held: Arr) -> None:
    """TierStack.keyed: the device keyed positions ``a .. e - 1``; ``computed`` = first computed position. A
    write_through tier holds the slots it stores pinned (``held``: scratch) until all are stored, then releases
    them tail first."""
    for lv in range(1, C.shape[0]):
        if C[lv, INCL] == EXCLUSIVE:
            for pos in range(a, e):
                tier_remove(S, C, SL, KS, P, lv, key_ids[start + pos])
        elif C[lv, INCL] == INCLUSIVE:
            for pos in range(a, e):
                pin_above(S, C, SL, KS, P, lv, key_ids[start + pos], r)
        if C[lv, WRITE] == WRITE_THROUGH:
            c = C[lv, CHUNK]
            nh = 0
            for j in range(computed // c, e // c):  # chunks whose last block was computed now
                s = store(S, C, SL, KS, P, lv, key_ids[start + (j + 1) * c - 1], j, r)
                if s >= 0:
                    held[nh] = s
                    nh += 1
            for q in range(nh - 1, -1, -1):
                tier_release(S, C, SL, KS, P, lv, held[q], r)


def tier_touch(S: tuple, C: Arr, SL: Arr, KS: Arr, P: Arr, lv: int, key_ids: Arr, start: int, nfull: int,
               r: int) -> None:
    """TierStack._touch: every other chunk of the request tier ``lv`` holds, tail first: on_hit, and an
    evictable one pinned and unpinned (slots found by this request are skipped)."""
    c = C[lv, CHUNK]
    for j in range(nfull // c - 1, -1, -1):
        k = key_ids[start + (j + 1) * c - 1]
        s = KS[lv, k]
        if s < 0:
            continue
        g = C[lv, BASE] + s
        if SL[MARK, g] == r:
            continue
        t_on_hit(S, lv, s, k, r, SL[SPOS, g])
        if SL[REF, g] == 0:
            t_on_pin(S, lv, s, r)
            t_on_unpin(S, lv, s, r)


# ---------------------------------------------------------------------- the replay
def kernel(offsets: Arr, key_ids: Arr, truth_ids: Arr, prompt_tokens: Arr, num_blocks: Arr, num_keys: int,
           capacity: int, block_size: int, ideal: bool, max_load: int, params: tuple, C: Arr, SL: Arr, KS: Arr,
           P: Arr) -> tuple:
    """kvlab.cache.compiled.replay_kernel with lower tiers: PrefixCache.admit's admission sequence with a
    TierStack, then the release. ``capacity``: the device's blocks; ``max_load``: max_load_blocks, -1 = none;
    ``params``: (device params, tier 1 params, ...); ``C, SL, KS, P``: the tier state (module docstring). Returns
    replay_kernel's columns and the loaded blocks per request and lower tier ([n, L])."""
    n = len(prompt_tokens)
    levels = C.shape[0] - 1
    verify = len(truth_ids) > 0
    selective = False
    for lv in range(1, levels + 1):
        if C[lv, WRITE] == SELECTIVE:
            selective = True
    hit_blocks = np.zeros(n, np.int64)
    new_blocks = np.zeros(n, np.int64)
    evictions = np.zeros(n, np.int64)
    orphan_evictions = np.zeros(n, np.int64)
    collisions = np.zeros(n, np.int64)
    admitted = np.zeros(n, np.bool_)
    cached_after = np.zeros(n, np.int64)
    orphans_after = np.zeros(n, np.int64)
    tier_hits = np.zeros((n, levels), np.int64)

    S = init_states(capacity, C[:, CAP].copy(), num_keys, params)
    D = S[0]
    free_stack = np.arange(capacity - 1, -1, -1).astype(np.int64)  # top = front of the free queue
    free_top = capacity
    n_evictable = 0
    ref = np.zeros(capacity, np.int64)
    bkey = np.full(capacity, -1, np.int64)
    bparent = np.full(capacity, -1, np.int64)
    bpos = np.full(capacity, -1, np.int64)
    btruth = np.full(capacity, -1, np.int64)
    key_head = KS[0]
    key_tail = np.full(num_keys, -1, np.int64)
    children = np.zeros(num_keys, np.int64)  # cached blocks whose parent is this key
    same_next = np.full(capacity, -1, np.int64)
    same_prev = np.full(capacity, -1, np.int64)
    n_cached = 0
    n_orphans = 0
    req_blocks = np.empty(0, np.int64)
    slots = np.empty(0, np.int64)  # lower-tier slots found, segment after segment
    held = np.empty(0, np.int64)  # a write_through tier's stores of one request
    seg_lv = np.zeros(levels + 1, np.int64)
    seg_start = np.zeros(levels + 1, np.int64)
    seg_end = np.zeros(levels + 1, np.int64)
    seg_first = np.zeros(levels + 2, np.int64)
    looked = np.zeros(levels + 1, np.int64)

    for r in range(n):
        start = offsets[r]
        nfull = offsets[r + 1] - start
        total = num_blocks[r]
        if total > req_blocks.shape[0]:
            req_blocks = np.empty(total, np.int64)
            slots = np.empty(total + levels, np.int64)
            held = np.empty(total, np.int64)
        max_hit = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        # 1. device lookup
        h = 0
        collided = 0
        while h < max_hit:
            b = key_head[key_ids[start + h]]
            if b < 0:
                break
            if verify and btruth[b] != truth_ids[start + h]:
                collided = 1  # counted if admitted (the Python core's; replay_kernel counts it always)
                break
            req_blocks[h] = b
            h += 1
        # 2. lower-tier lookup: each tier from the first miss above, whole chunks, up to the hit limit
        nseg = 0
        nsl = 0
        hh = h
        for lv in range(1, levels + 1):
            looked[lv] = 0
        if h < max_hit:
            for lv in range(1, levels + 1):
                if hh >= max_hit:
                    break
                looked[lv] = max_hit - hh
                c = C[lv, CHUNK]
                j = hh // c
                end = hh
                first = nsl
                while end < max_hit and (j + 1) * c <= nfull:
                    s = KS[lv, key_ids[start + (j + 1) * c - 1]]
                    if s < 0:
                        break
                    slots[nsl] = s
                    nsl += 1
                    end = (j + 1) * c
                    j += 1
                end = min(end, max_hit)
                if end > hh:
                    seg_lv[nseg], seg_start[nseg], seg_end[nseg], seg_first[nseg] = lv, hh, end, first
                    nseg += 1
                    seg_first[nseg] = nsl
                    hh = end
        loaded = hh - h if max_load < 0 else min(hh - h, max_load)
        # 3. fit
        need = total - h
        evictable_hits = 0
        for i in range(h):
            if ref[req_blocks[i]] == 0:
                evictable_hits += 1
        if need > free_top + n_evictable - evictable_hits:
            cached_after[r] = n_cached
            orphans_after[r] = n_orphans
            continue
        admitted[r] = True
        collisions[r] = collided
        hit_blocks[r] = h + loaded
        new_blocks[r] = need
        # 4. pin: device hits, then each segment's chunks
        for i in range(h):
            b = req_blocks[i]
            h0_on_hit(D, b, bkey[b], r, i)
            if ref[b] == 0:
                h0_on_pin(D, b, r)
                n_evictable -= 1
            ref[b] += 1
        for i in range(nseg):
            lv = seg_lv[i]
            for q in range(seg_first[i], seg_first[i + 1]):
                SL[MARK, C[lv, BASE] + slots[q]] = r
                tier_touch_one(S, C, SL, KS, P, lv, slots[q], r)
        # 5. on_miss; 6. allocate: free queue front first, then victims (a last copy goes to the tiers)
        for pos in range(h, nfull):
            h0_on_miss(D, key_ids[start + pos], r, pos)
        ev = 0
        for j in range(need):
            if free_top > 0:
                free_top -= 1
                b = free_stack[free_top]
            else:
                b = h0_victim(D)
                h0_on_evict(D, b)
                n_evictable -= 1
                k = bkey[b]
                p = bparent[b]
                if p >= 0:
                    children[p] -= 1
                    if key_head[p] < 0:
                        n_orphans -= 1
                        orphan_evictions[r] += 1
                prev_b, next_b = same_prev[b], same_next[b]
                if prev_b >= 0:
                    same_next[prev_b] = next_b
                else:
                    key_head[k] = next_b
                if next_b >= 0:
                    same_prev[next_b] = prev_b
                else:
                    key_tail[k] = prev_b
                if key_head[k] < 0:
                    n_orphans += children[k]
                    device_dropped(S, C, SL, KS, P, k, bpos[b], r)
                bkey[b] = -1
                bparent[b] = -1
                n_cached -= 1
                ev += 1
            ref[b] = 1
            req_blocks[h + j] = b
        evictions[r] = ev
        # 7. load: the loaded chunks are read, the pins released (tail first), the other chunks touched
        left = loaded
        for i in range(nseg):
            lv = seg_lv[i]
            c = C[lv, CHUNK]
            a, e = seg_start[i], seg_end[i]
            C[lv, FOUND] += e - a
            take = min(e - a, left)
            left -= take
            C[lv, LOADED] += take
            tier_hits[r, lv - 1] += take
            if take:
                for q in range(seg_first[i], seg_first[i] + (a + take - 1) // c - a // c + 1):
                    SL[UNREAD, C[lv, BASE] + slots[q]] = 0
            for q in range(seg_first[i + 1] - 1, seg_first[i] - 1, -1):
                tier_release(S, C, SL, KS, P, lv, slots[q], r)
        for lv in range(1, levels + 1):
            C[lv, LOOKED_UP] += looked[lv]
        for lv in range(1, levels + 1):
            if C[lv, TOUCH]:
                tier_touch(S, C, SL, KS, P, lv, key_ids, start, nfull, r)
        if selective:
            for i in range(h + loaded):
                k = key_ids[start + i]
                KS[levels + 1, k] += 1
                for lv in range(1, levels + 1):
                    if C[lv, WRITE] == SELECTIVE and KS[levels + 1, k] >= C[lv, SEL]:
                        stored(S, C, SL, KS, P, lv, k, i, r)
        # 8. key: the loaded blocks, then the computed ones; the tiers after each
        for part in range(2):
            a = h if part == 0 else h + loaded
            e = h + loaded if part == 0 else nfull
            for pos in range(a, e):
                b = req_blocks[pos]
                k = key_ids[start + pos]
                p = key_ids[start + pos - 1] if pos > 0 else -1
                if key_head[k] < 0:
                    n_orphans -= children[k]
                if p >= 0:
                    children[p] += 1
                    if key_head[p] < 0:
                        n_orphans += 1
                bkey[b] = k
                bparent[b] = p
                bpos[b] = pos
                if verify:
                    btruth[b] = truth_ids[start + pos]
                t = key_tail[k]
                same_prev[b] = t
                same_next[b] = -1
                if t >= 0:
                    same_next[t] = b
                else:
                    key_head[k] = b
                key_tail[k] = b
                n_cached += 1
                h0_on_insert(D, b, k, r, pos)
            if e > a:
                tiers_keyed(S, C, SL, KS, P, key_ids, start, a, e, h + loaded, r, held)
        # release tail first: keyed -> evictable (policy), unkeyed -> free queue front
        for i in range(total - 1, -1, -1):
            b = req_blocks[i]
            ref[b] -= 1
            if ref[b] == 0:
                if bkey[b] >= 0:
                    h0_on_unpin(D, b, r)
                    n_evictable += 1
                else:
                    free_stack[free_top] = b
                    free_top += 1
        cached_after[r] = n_cached
        orphans_after[r] = n_orphans
    return (hit_blocks, new_blocks, evictions, orphan_evictions, collisions, admitted, cached_after,
            orphans_after, tier_hits)
