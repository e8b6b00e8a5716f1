"""SGLang RadixAttention eviction: least recently used among the leaves of the prefix tree.

Source: L. Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(NeurIPS'24), §3 RadixAttention: "an LRU eviction policy that recursively evicts leaf nodes";
sglang/srt/mem_cache/radix_cache.py (``evict`` pops leaves from a heap on ``last_access_time``;
``match_prefix`` and ``insert`` refresh it; nodes with a lock (ref) count are skipped).

Choices:

* Candidates are evictable blocks without cached children (``cache.num_cached_children(key) == 0``);
  evicting a leaf can make its parent a candidate (see ``kvlab.policies._heap``). A radix node spans a
  run of tokens; here a node is one block.
* Recency is the last *access* (a hit or the insert), not the unpin as in vLLM's LRU: SGLang refreshes
  ``last_access_time`` on match and insert. Accesses are numbered per request by a logical clock (a
  new request = a new ``(ctx.seq, ctx.request_id)``; SGLang uses wall time), so runs are deterministic.
  Within one request the deeper block counts as older. One request's blocks lie on one path, of which
  only the deepest cached block can be a leaf, so among leaves this is exactly SGLang's order; it only
  spares the policy from skipping over the path's interior blocks.
* If no evictable block is a leaf (only when every evictable block has a pinned child, e.g. duplicates),
  the least recently accessed evictable block is evicted.
* State does not survive eviction.

A leaf-only priority policy (kvlab.policies._priority): O(log n) per event, amortised (Python: the lazy
heap of ``kvlab.policies._heap``, mostly its O(1) run since last accesses grow with time; a non-leaf
parked at most once per non-leaf period; the fallback scans the parked blocks). The compiled twin counts
the request clock by ``seq``; ``compiled_params()`` needs ``prepare(encoded)`` first: ``(offsets,
key_ids)`` (a block's parent key).
"""

from __future__ import annotations

import numba as nb

from kvlab.policies._priority import LeafPriorityPolicy, Priority, field
from kvlab.policies.base import register_policy

LAST = 0  # per-block field: last access (request clock << 31 | -position)
CLOCK, SEQ, RID = 0, 1, 2  # global int slots: request clock, (seq, request_id) of its request
_POS_LIMIT = (1 << 31) - 1


@nb.njit(cache=True)
def _touch(s, b, key, pos, r):
    g = s.globi
    if r.seq != g[SEQ] or r.request_id != g[RID]:  # a new request: the logical clock ticks
        g[SEQ] = r.seq
        g[RID] = r.request_id
        g[CLOCK] += 1
    # (request clock, -position) in one int; positions below 2**31
    s.blk[LAST][b] = (g[CLOCK] << 31) | (_POS_LIMIT - pos)


@nb.njit(cache=True)
def _priority(s, b, r):
    return s.blk[LAST][b]


@register_policy("sglang-leaf")
class SGLangLeaf(LeafPriorityPolicy):
    """Least recently accessed leaf first."""

    source = "SGLang RadixAttention (radix_cache.py): LRU over leaf nodes by last access"
    spec = Priority(_priority, _touch, _touch, block=(0,), glob=(0, -1, -1), layout=("offsets", "key_ids"))
    _last = field(LAST)
