"""Why ``lfu``, ``prefix-aware-lfu`` and ``sieve`` (and ``lru``, ``prefix-aware-lru``) can give the same hits,
request by request (docs/policies.md, "When policies coincide"; notebook 01 measures it on Mooncake).

* Structural, every trace without duplicate blocks: LFU and LRU never evict a block that has a cached child.
  A request that hits a child hits its parent too, and releases the child first (tail first), so a parent's
  frequency is at least its child's and its last unpin is no earlier: the child always comes first in the
  ``(frequency, unpin)`` and the unpin orders, and the leaf-only wrapper never intervenes. The exception: in
  vLLM counting, a prompt that is cached in full and ends on a block boundary recomputes its last block, a
  second copy of a cached key; LFU may evict that copy (it orphans nothing: the key stays cached) where the
  wrapper, which asks whether the *key* has cached children, takes another block. FIFO evicts by first
  unpin, so its wrapper does change the victims.
* Trace-dependent: when, at every eviction, at least two evictable blocks have never been hit since their
  insertion, LFU evicts the oldest of them (frequency 1; order of their only unpin), and so does SIEVE: its
  queue is in first-unpin order, its hand passes an unvisited block only by evicting it, so every never-hit
  block lies ahead of the hand and the sweep stops at the oldest one before it can wrap to the blocks whose
  bits it cleared. Counting gives a sufficient condition: at most ``F`` blocks ever get a first hit, and a
  request pins at most ``max_new - 1`` new blocks when it evicts, so ``capacity >= F + max_new + 1`` keeps
  two never-hit blocks evictable. Where hot blocks outnumber the capacity the never-hit blocks run out and
  SIEVE (which has cleared the visited bits of blocks it passed) evicts other blocks than LFU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _util import conversation_workload, random_token_workload

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.policies import EvictionPolicy, make_policy
from kvlab.policies import base as policy_base
from kvlab.replay import replay
from kvlab.workload.workload import from_lists


class NeverHitWatch(EvictionPolicy):
    """LFU, watched: per ``victim()`` the number of evictable blocks never hit since insertion (``slack``),
    and ``first_hits``, the blocks that got their first hit."""

    name = "lfu-watched"

    def __init__(self) -> None:
        self.inner = make_policy("lfu")
        self.hits: dict[int, int] = {}
        self.never_hit: set[int] = set()
        self.slack: list[int] = []
        self.first_hits = 0
        WATCHED.append(self)

    def attach(self, cache: object) -> None:
        self.inner.attach(cache)

    def on_insert(self, block: KVBlock, ctx: AccessContext) -> None:
        self.hits[block.block_id] = 0
        self.inner.on_insert(block, ctx)

    def on_hit(self, block: KVBlock, ctx: AccessContext) -> None:
        self.first_hits += self.hits[block.block_id] == 0
        self.hits[block.block_id] += 1
        self.never_hit.discard(block.block_id)
        self.inner.on_hit(block, ctx)

    def on_pin(self, block: KVBlock, ctx: AccessContext) -> None:
        self.never_hit.discard(block.block_id)
        self.inner.on_pin(block, ctx)

    def on_unpin(self, block: KVBlock, ctx: AccessContext) -> None:
        if self.hits[block.block_id] == 0:
            self.never_hit.add(block.block_id)
        self.inner.on_unpin(block, ctx)

    def on_evict(self, block: KVBlock) -> None:
        self.never_hit.discard(block.block_id)
        self.inner.on_evict(block)

    def on_remove(self, block: KVBlock) -> None:
        self.never_hit.discard(block.block_id)
        self.inner.on_remove(block)

    def victim(self) -> KVBlock:
        self.slack.append(len(self.never_hit))
        return self.inner.victim()

    def __len__(self) -> int:
        return len(self.inner)


WATCHED: list[NeverHitWatch] = []


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch):
    """Register ``lfu-watched`` for one test; returns a function replaying it that gives the watch."""
    monkeypatch.setitem(policy_base._REGISTRY, NeverHitWatch.name, NeverHitWatch)

    def run(workload, capacity: int) -> NeverHitWatch:
        replay(workload, capacity_blocks=capacity, block_size=1, policy=NeverHitWatch.name, backend="python")
        return WATCHED[-1]

    return run


def hits(workload, capacity: int, policy: str, mode: str = "vllm", **params: object) -> np.ndarray:
    """Hit tokens per request (block size 1: one token per block)."""
    r = replay(workload, capacity_blocks=capacity, block_size=1, policy=policy, mode=mode, policy_params=params)
    return r.requests["hit_tokens"].to_numpy()


def shared_root_workload(seed: int, n: int = 400, root: int = 4, shared: float = 0.05, follow_up: float = 0.02):
    """Mooncake conversation's shape: prompts of 3..15 blocks of their own, a share ``shared`` of them after one
    shared root of ``root`` blocks; with probability ``follow_up`` a prompt extends the previous one instead (a
    next turn right away). Few blocks ever get a hit, most are used once."""
    rng = np.random.default_rng(seed)
    fresh = iter(range(10_000, 10**9))
    root_prompt = [next(fresh) for _ in range(root)]
    prompts: list[list[int]] = []
    for _ in range(n):
        base = prompts[-1] if prompts and rng.random() < follow_up else root_prompt if rng.random() < shared else []
        prompts.append(base + [next(fresh) for _ in range(int(rng.integers(3, 16)))])
    return from_lists(prompts, arrival=np.arange(n, dtype=float))


@pytest.mark.parametrize("seed", range(4))
def test_lfu_and_lru_evict_leaves_only(seed):
    """The leaf-only wrapper never changes LFU's or LRU's victims where no key is cached twice: ideal counting on
    any trace, vLLM counting on traces whose prompts are never cached in full (conversations, shared root).
    It does change FIFO's (first unpin: a parent, released after its children by the request that computed
    them, can still be the oldest entry once its children are released again)."""
    cases = [(random_token_workload(seed), "ideal"), (conversation_workload(seed), "vllm"),
             (shared_root_workload(seed), "vllm")]
    differ = 0
    for w, mode in cases:
        for capacity in (12, 40, 120):
            lfu, lru = hits(w, capacity, "lfu", mode), hits(w, capacity, "lru", mode)
            np.testing.assert_array_equal(lfu, hits(w, capacity, "prefix-aware-lfu", mode))
            np.testing.assert_array_equal(lru, hits(w, capacity, "prefix-aware-lru", mode))
            fifo = hits(w, capacity, "fifo", mode)
            differ += not np.array_equal(fifo, hits(w, capacity, "prefix-aware", mode, inner="fifo"))
    assert differ > 0


def test_duplicate_blocks_can_separate_lfu_from_its_leaf_only_wrapper():
    """vLLM counting on short prompts from a 3-token vocabulary: fully cached block-aligned prompts recompute
    their last block (a duplicate of a key with cached children); LFU evicts such copies, the wrapper does not."""
    w = random_token_workload(0)
    assert not np.array_equal(hits(w, 40, "lfu"), hits(w, 40, "prefix-aware-lfu"))


@pytest.mark.parametrize("seed", range(4))
def test_lfu_equals_sieve_while_never_hit_blocks_remain(watched, seed):
    """Shared root + blocks used once: the counting bound holds, at least two never-hit blocks are evictable at
    every eviction, and LFU, prefix-aware LFU and SIEVE give equal hits request by request although LRU,
    which loses the root between its uses, differs."""
    w = shared_root_workload(seed)
    capacity = 150
    watch = watched(w, capacity)
    max_new = int(replay(w, capacity_blocks=capacity, block_size=1, policy="lfu").requests["new_blocks"].max())
    assert capacity >= watch.first_hits + max_new + 1  # the sufficient condition (counting)
    assert len(watch.slack) > 1000 and min(watch.slack) >= 2  # what it guarantees
    lfu = hits(w, capacity, "lfu")
    np.testing.assert_array_equal(lfu, hits(w, capacity, "sieve"))
    np.testing.assert_array_equal(lfu, hits(w, capacity, "prefix-aware-lfu"))
    assert not np.array_equal(lfu, hits(w, capacity, "lru"))


@pytest.mark.parametrize("seed", range(4))
def test_lfu_and_sieve_differ_once_never_hit_blocks_run_out(watched, seed):
    """Interleaved conversations whose every turn hits its history: hit blocks outnumber the capacity, LFU has
    to evict blocks that were hit (no never-hit block left), and SIEVE's hits differ from LFU's."""
    w = conversation_workload(seed)
    capacity = 40
    watch = watched(w, capacity)
    assert min(watch.slack) == 0
    assert not np.array_equal(hits(w, capacity, "lfu"), hits(w, capacity, "sieve"))


@pytest.mark.parametrize("seed", range(6))
def test_enough_never_hit_blocks_imply_equal_hits(watched, seed):
    """The implication itself on mixed traces (shared-root prompts interleaved with conversations) at several
    capacities: wherever at least two never-hit blocks were evictable at every eviction, SIEVE's hits are
    LFU's; both sides of the condition occur."""
    rng = np.random.default_rng(seed)
    a, b = shared_root_workload(seed, n=200), conversation_workload(seed, n=60)
    prompts = [w.prompt(i).tolist() for w in (a, b) for i in range(len(w))]
    order = rng.permutation(len(prompts))
    w = from_lists([prompts[i] for i in order], arrival=np.arange(len(prompts), dtype=float))
    sides = set()
    for capacity in (30, 60, 120, 240):
        holds = min(watched(w, capacity).slack, default=2) >= 2
        sides.add(holds)
        if holds:
            np.testing.assert_array_equal(hits(w, capacity, "lfu"), hits(w, capacity, "sieve"))
    assert sides == {True, False}
