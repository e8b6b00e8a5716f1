"""The compiled tiered replay (kvlab.tiers.compiled) equals the Python TierStack: every per-request column and
every summary number (the ``tiers`` counters included) over a grid of tier configurations (1-2 lower tiers;
every write policy, inclusion, chunk 1 and 4, touch on / off, max_load_tokens none and small, both counting
modes), every policy the tiered kernel runs (discovered from the registry) on the lower tiers, and a slice of
Mooncake conversation.

Each distinct set of policies (device, tier 1, tier 2) is one compiled kernel (a few seconds the first time,
then numba's disk cache): the grid rotates a few policy sets over the configurations."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _util import conversation_workload, random_category_workload, random_token_workload

from kvlab.hashing import BlockHasher, encode_workload
from kvlab.policies import available_policies, make_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.tiers import Tier
from kvlab.tiers.compiled import tier_policy_compiled
from kvlab.tiers.results import compiled_tiers

TIMING = {"replay_seconds", "compile_seconds", "backend"}
GRID_POLICIES = ["lru", "fifo", "lfu", "arc", "s3fifo"]
#: every policy the tiered kernel runs on a lower tier, from the registry
TIER_POLICIES = sorted(p for p in available_policies() if not make_policy(p).offline  # (offline: device only)
                       and tier_policy_compiled(Tier(name="t", capacity_blocks=1, policy=p)))


def assert_backends_equal(w, cfg: ReplayConfig, enc=None) -> dict:
    """Replay ``w`` with ``cfg`` on both backends: frames equal column for column, summaries key for key (but
    the timings and the backend's name); returns the Python summary."""
    enc = encode(w, cfg) if enc is None else enc
    fast = replay(w, cfg, encoded=enc, backend="compiled")
    slow = replay(w, cfg, encoded=enc, backend="python")
    assert (fast.summary["backend"], slow.summary["backend"]) == ("compiled", "python")
    pd.testing.assert_frame_equal(fast.requests, slow.requests)
    assert {k: v for k, v in fast.summary.items() if k not in TIMING} == \
        {k: v for k, v in slow.summary.items() if k not in TIMING}
    return slow.summary


def tier(name: str, blocks: int, policy: str, write: str = "write_through", inclusion: str = "none",
         chunk: int = 1, touch: bool = True, selective: int = 1) -> Tier:
    return Tier(name=name, capacity_blocks=blocks, policy=policy, write=write, inclusion=inclusion,
                chunk_blocks=chunk, touch=touch, selective_hits=selective)


# (write, inclusion, chunk, selective hits) a first lower tier may have
SHAPES = [("write_through", "none", 1, 1), ("write_through", "inclusive", 1, 1), ("write_through", "none", 4, 1),
          ("write_through", "inclusive", 4, 1), ("write_through_selective", "none", 1, 1),
          ("write_through_selective", "inclusive", 1, 2), ("write_back", "none", 1, 1),
          ("write_back", "inclusive", 1, 1), ("write_back", "exclusive", 1, 1)]
# (device, tier) policies: with TWO_TIER_SETS each of GRID_POLICIES runs on the device and on a tier
ONE_TIER_SETS = [("lru", "lru"), ("fifo", "lfu"), ("arc", "s3fifo")]


def one_tier_cases() -> list:
    out = []
    for i, (shape, touch, max_load, mode) in enumerate(itertools.product(SHAPES, [True, False], [None, 4],
                                                                        ["vllm", "ideal"])):
        out.append((ONE_TIER_SETS[i % len(ONE_TIER_SETS)], shape, touch, max_load, mode))
    return out


@pytest.mark.parametrize(("workload", "capacity", "block_size", "blocks"), [("tokens", 6, 2, 14),
                                                                          ("conversation", 28, 4, 40)])
def test_one_lower_tier_grid(workload, capacity, block_size, blocks):
    """Every shape of one lower tier x touch x max_load_tokens x counting mode, policies rotating over the
    device and the tier; a small device and tier evict a lot."""
    w = random_token_workload(5, n=160) if workload == "tokens" else conversation_workload(3, n=120)
    totals = np.zeros(3)
    for (device, low), (write, inclusion, chunk, k), touch, max_load, mode in one_tier_cases():
        cfg = ReplayConfig(capacity_blocks=capacity, block_size=block_size, policy=device, mode=mode,
                           max_load_tokens=max_load and max_load * block_size // 2,
                           tiers=[tier("dram", blocks, low, write, inclusion, chunk, touch, k)])
        t = assert_backends_equal(w, cfg)["tiers"][0]
        totals += [t["found_hit_tokens"], t["evictions"], t["moved_up_blocks"]]
    assert (totals > 0).all(), totals  # hits, evictions and exclusive moves up were exercised


TWO_TIER_SETS = [("s3fifo", "arc", "lfu"), ("lfu", "fifo", "s3fifo")]
# second tiers: (write, inclusion, selective hits); write_back only below a 1-block-chunk tier
LOWER = [("write_through", "none", 1), ("write_through", "inclusive", 1), ("write_through_selective", "none", 2),
         ("write_back", "none", 1), ("write_back", "inclusive", 1), ("write_back", "exclusive", 1)]


def test_two_lower_tiers_grid():
    """Each first-tier shape above each second-tier shape (write_back below 4-block chunks is refused), with a
    write_back cascade from the device through both tiers, touch and max_load_tokens varying."""
    w = random_token_workload(8, n=150)
    n = 0
    for i, ((w1, i1, c1, k1), (w2, i2, k2)) in enumerate(itertools.product(SHAPES, LOWER)):
        if w2 == "write_back" and c1 != 1:
            continue
        device, p1, p2 = TWO_TIER_SETS[i % len(TWO_TIER_SETS)]
        tiers = [tier("dram", 10, p1, w1, i1, c1, i % 2 == 0, k1), tier("ssd", 22, p2, w2, i2, 1, i % 3 != 0, k2)]
        cfg = ReplayConfig(capacity_blocks=6, block_size=2, policy=device, mode=["vllm", "ideal"][i // 2 % 2],
                           max_load_tokens=[None, 6][i // 4 % 2], tiers=tiers)
        s = assert_backends_equal(w, cfg)
        n += s["tiers"][1]["found_hit_tokens"] > 0
    assert n > 10  # the second tier served hits in most configurations


#: the tier policies the grid does not run, three per kernel (lower tiers 1, 2 and 3)
OTHERS = [p for p in TIER_POLICIES if p not in GRID_POLICIES]
TRIPLES = [tuple(OTHERS[(3 * i + j) % len(OTHERS)] for j in range(3)) for i in range(-(-len(OTHERS) // 3))]


@pytest.mark.parametrize("policies", TRIPLES, ids="+".join)
def test_every_tier_policy(policies):
    """Each other policy the tiered kernel runs, on a lower tier of three: a write_back cascade through
    exclusive and inclusive tiers, write_through tiers with chunks, a selective tier; requests with
    categories and turns (for the policies that read them)."""
    p1, p2, p3 = policies
    w = random_category_workload(len(p1), n=200, turns=True)
    configs = [
        [tier("dram", 10, p1, "write_back", "exclusive"), tier("ssd", 16, p2, "write_back", "inclusive"),
         tier("disk", 24, p3, "write_back")],
        [tier("dram", 12, p1, "write_through", "inclusive", chunk=3), tier("ssd", 20, p2, touch=False),
         tier("disk", 30, p3, "write_through_selective", "inclusive", selective=2)],
        [tier("dram", 9, p1, "write_through_selective", selective=2), tier("ssd", 14, p2, "write_back"),
         tier("disk", 20, p3, "write_back", "exclusive")],
    ]
    totals = np.zeros(6)
    for i, tiers in enumerate(configs):
        cfg = ReplayConfig(capacity_blocks=7, block_size=2, mode=["vllm", "ideal"][i % 2], tiers=tiers,
                           max_load_tokens=[None, 8][i % 2])
        s = assert_backends_equal(w, cfg)
        totals += [s["tiers"][j][key] for j in (0, 1, 2) for key in ("evictions", "found_hit_tokens")]
    assert (totals > 0).all(), totals  # every tier's policy chose victims and served hits


def test_policy_parameters_block_size_and_removals_reach_a_tier():
    """gdsf on a lower tier (its kernel from TRIPLES): its cost grows with the position in tokens, so a chunked
    tier's policy must see chunks of ``chunk_blocks * block_size`` tokens, with its parameters; an exclusive
    tier's move up is ``on_remove``, which does not age the cache (the Python class's; the compiled twin's
    once aged it). Each case's victims change if either is wrong."""
    policies = next(t for t in TRIPLES if "gdsf" in t)
    gdsf = {"attention_ratio": 0.37}
    chunked = [tier(name, 20, p, chunk=4).replace(policy_params=gdsf) if p == "gdsf" else tier(name, 8, p)
               for name, p in zip(("dram", "ssd", "disk"), policies, strict=True)]
    exclusive = [tier(name, 20, p, "write_back", "exclusive").replace(policy_params=gdsf) if p == "gdsf" else
                 tier(name, 1, p, "write_back") for name, p in zip(("dram", "ssd", "disk"), policies, strict=True)]
    for seed, tiers in [(2, chunked), (1, exclusive)]:
        w = random_token_workload(seed, n=200, max_len=60)
        s = assert_backends_equal(w, ReplayConfig(capacity_blocks=10, block_size=2, tiers=tiers))
        assert s["tiers"][policies.index("gdsf")]["evictions"] > 0


def test_verify_mode_with_colliding_keys():
    """Truncated 6-bit keys collide (one key at several positions, other content): collisions stop the device
    walk and the lower tiers continue from there, in both backends."""
    w = random_token_workload(2, n=200)
    enc = encode_workload(w, BlockHasher("xxh3_64", truncate_bits=6), 2, verify=True)
    for write, inclusion in [("write_back", "exclusive"), ("write_through", "inclusive")]:
        cfg = ReplayConfig(capacity_blocks=6, block_size=2, verify=True,
                           policy="s3fifo", tiers=[tier("dram", 10, "arc", write, inclusion), tier("ssd", 16, "lfu")])
        s = assert_backends_equal(w, cfg, enc)
        assert s["collisions"] > 0


TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.mark.skipif(not (TRACES / "mooncake").exists(), reason="needs ../shared/traces (Mooncake)")
def test_a_slice_of_mooncake_conversation():
    """Device + DRAM (10x) + SSD on the first 1,500 Mooncake conversation requests (512-token blocks)."""
    from kvlab.workload import load_trace

    w = load_trace("mooncake_conversation").head(1500)
    enc = encode(w, ReplayConfig(capacity_blocks=300))
    for tiers, max_load in [
        ([tier("dram", 3000, "lru", "write_back")], None),
        ([tier("dram", 1500, "fifo", "write_back", "exclusive"), tier("ssd", 6000, "s3fifo", "write_back")], None),
        ([tier("dram", 2000, "arc", chunk=4), tier("ssd", 5000, "lfu", inclusion="inclusive")], 8192),
    ]:
        device = {1: "lru", 2: "lfu" if tiers[0].policy == "fifo" else "s3fifo"}[len(tiers)]
        cfg = ReplayConfig(capacity_blocks=300, policy=device, tiers=tiers, max_load_tokens=max_load)
        s = assert_backends_equal(w, cfg, enc)
        assert s["tiers"][0]["evictions"] > 0 and s["tiers"][0]["hit_share"] > 0


def test_which_tiers_run_compiled():
    """The tiered kernel runs any tier configuration of a supported policy; a policy whose twin reads the
    trace's blocks by (request, position), or without compiled hooks, runs in the Python core."""
    assert compiled_tiers([]) and compiled_tiers([tier("a", 4, "lru", "write_back", "exclusive"),
                                                  tier("b", 8, "arc", chunk=1, inclusion="inclusive")])
    assert {"lru", "fifo", "lfu", "arc", "s3fifo"} <= set(TIER_POLICIES)
    for name in ("sglang-leaf", "prefix-aware", "mru"):
        assert not compiled_tiers([tier("a", 4, name)])
    w = random_token_workload(1, n=30)
    auto = replay(w, capacity_blocks=6, block_size=2, tiers=[tier("a", 8, "sglang-leaf")])
    assert auto.summary["backend"] == "python"
    auto = replay(w, capacity_blocks=6, block_size=2, tiers=[tier("a", 8, "lru")])
    assert auto.summary["backend"] == "compiled"
