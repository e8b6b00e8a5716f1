"""A cluster of nodes above one shared pool (kvlab.replay.cluster) and the tiered-storage study's helpers
(kvlab.studies.tiers): one node with the pool as its last tier is the ordinary replay, hit tokens split exactly,
the pool's hits cross nodes and nothing else does, a shared tier must be inclusion=none and last."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from _util import conversation_workload, random_token_workload

from kvlab.errors import ConfigError
from kvlab.policies import make_cache
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.replay.cluster import replay_cluster
from kvlab.studies.tiers import Node, StudyConfig, capacity_at, run_study, study_markdown
from kvlab.tiers import LowerTier, Tier, TierStack
from kvlab.workload.workload import from_lists

COLUMNS = ["hit_blocks", "hit_tokens", "new_blocks", "evictions", "orphan_evictions", "admitted", "cached_blocks",
           "orphan_blocks", "ideal_hit_tokens"]


def tier(name: str, blocks: int, **kw) -> Tier:
    return Tier(name=name, capacity_blocks=blocks, **kw)


def hit_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame if c.startswith("hit_tokens_")]


# ---------------------------------------------------------------------- one node = the ordinary replay
@pytest.mark.parametrize("pool_write", ["write_through", "write_back"])
@pytest.mark.parametrize("private", [[], [("dram", 12, "write_back")], [("dram", 12, "write_through")]])
def test_one_node_with_the_pool_last_is_the_replay_with_that_tier(private, pool_write):
    w = conversation_workload(5, n=250)
    lower = [tier(name, blocks, write=write) for name, blocks, write in private]
    pool = tier("pool", 30, write=pool_write)
    cfg = ReplayConfig(capacity_blocks=10, block_size=4, tiers=lower)
    enc = encode(w, cfg)
    want = replay(w, cfg.replace(tiers=[*lower, pool]), encoded=enc)
    got = replay_cluster(w, cfg, nodes=1, pool=pool, encoded=enc)
    cols = COLUMNS + hit_columns(want.requests)
    assert hit_columns(got.requests) == hit_columns(want.requests)
    pd.testing.assert_frame_equal(got.requests[cols], want.requests[cols])
    assert (got.requests["node"] == 0).all()
    assert want.summary["tiers"][-1]["hit_share"] > 0  # the pool is used
    for a, b in zip(want.summary["tiers"], got.summary["tiers"], strict=True):
        assert {k: b[k] for k in a} == a
    for key in ("token_hit_rate", "device_token_hit_rate", "ideal_hit_rate", "evictions"):
        assert got.summary[key] == want.summary[key]
    assert got.summary["node_ideal_hit_rate"] == pytest.approx(want.summary["ideal_hit_rate"])


def test_one_node_without_tiers_is_the_plain_replay():
    w = random_token_workload(2, n=200)
    cfg = ReplayConfig(capacity_blocks=8, block_size=4)
    want = replay(w, cfg)
    got = replay_cluster(w, cfg, nodes=1)
    pd.testing.assert_frame_equal(got.requests[COLUMNS], want.requests[COLUMNS])
    assert "tiers" not in got.summary


# ---------------------------------------------------------------------- N nodes
@pytest.mark.parametrize("router", ["prefix", "round_robin"])
def test_hit_tokens_per_tier_sum_to_the_total(router):
    w = conversation_workload(7, n=300)
    cfg = ReplayConfig(capacity_blocks=6, block_size=4, tiers=[tier("dram", 8, write="write_back"),
                                                               tier("ssd", 16, write="write_through")])
    got = replay_cluster(w, cfg, nodes=3, pool=tier("pool", 40), router=router)
    frame = got.requests
    parts = frame[["hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd", "hit_tokens_pool"]]
    assert (parts.sum(axis=1) == frame["hit_tokens"]).all()
    assert (parts >= 0).all().all()
    s = got.summary
    prompt = frame["prompt_tokens"].sum()
    assert s["device_token_hit_rate"] + sum(t["hit_share"] for t in s["tiers"]) == pytest.approx(s["token_hit_rate"])
    assert [t["shared"] for t in s["tiers"]] == [False, False, True]
    assert sum(n["prompt_tokens"] for n in s["per_node"]) == prompt
    assert sum(n["requests"] for n in s["per_node"]) == len(frame) and sorted(frame["node"].unique()) == [0, 1, 2]
    assert s["node_ideal_hit_rate"] <= s["ideal_hit_rate"] + 1e-12
    # private tiers: per node capacity, counters summed over nodes
    assert s["tiers"][0]["capacity_blocks"] == 8 and s["tiers"][0]["blocks_stored"] > 8


def two_nodes_one_prompt() -> tuple:
    """Request 0 and request 1 have the same 4-block prompt (plus a token); round robin puts them on nodes 0
    and 1. A third request on node 0 is unrelated."""
    prompt = list(range(17))
    return from_lists([prompt, prompt, [99] * 9], arrival=[0.0, 1.0, 2.0]), ReplayConfig(capacity_blocks=8,
                                                                                       block_size=4)


def test_a_prefix_computed_on_one_node_is_a_hit_on_another_only_through_the_pool():
    w, cfg = two_nodes_one_prompt()
    private = [tier("dram", 16, write="write_through")]
    alone = replay_cluster(w, cfg.replace(tiers=private), nodes=2, router="round_robin")
    assert alone.requests["node"].tolist() == [0, 1, 0]
    assert alone.requests["hit_tokens"].tolist() == [0, 0, 0]  # node 1 cannot see node 0's device or DRAM
    for write in ("write_through", "write_back"):
        pooled = replay_cluster(w, cfg.replace(tiers=private), nodes=2, router="round_robin",
                                pool=tier("pool", 16, write=write))
        r = pooled.requests
        if write == "write_through":  # published when computed on node 0
            assert r["hit_tokens"].tolist() == [0, 16, 0]
            assert r.loc[1, "hit_tokens_pool"] == 16 and r.loc[1, "hit_tokens_device"] == 0
            assert r.loc[1, "hit_tokens_dram"] == 0
            pool_row = pooled.summary["tiers"][-1]
            assert pool_row["blocks_stored"] == 4 + 2 and pool_row["loaded_tokens"] == 16  # 2: request 2's blocks
        else:  # write_back: stored only when node 0's DRAM drops it, which it never does here
            assert r["hit_tokens"].tolist() == [0, 0, 0]


def test_write_back_pool_gets_what_a_node_evicts():
    prompt = list(range(17))
    other = [[100 + i] * 17 for i in range(3)]  # push request 0's blocks out of node 0's device
    w = from_lists([prompt, *other, prompt], arrival=np.arange(5.0))
    cfg = ReplayConfig(capacity_blocks=5, block_size=4)
    route = [0, 0, 0, 0]
    got = replay_cluster(w, cfg, nodes=1, pool=tier("pool", 64, write="write_back"))
    assert got.requests["node"].tolist() == route + [0]
    assert got.requests.loc[4, "hit_tokens_pool"] == 16


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("inclusion", ["inclusive", "exclusive"])
def test_a_shared_pool_needs_inclusion_none(inclusion):
    w, cfg = two_nodes_one_prompt()
    pool = tier("pool", 16, write="write_back", inclusion=inclusion)
    with pytest.raises(ConfigError, match="inclusion=none") as err:
        replay_cluster(w, cfg, nodes=2, pool=pool)
    assert "\n" not in str(err.value)
    shared = LowerTier(pool, 1, 4)
    with pytest.raises(ConfigError, match="inclusion=none"):
        TierStack(make_cache(8, "lru", block_size=4), [shared])


def test_a_shared_tier_must_be_last_and_match_the_block_size():
    shared = LowerTier(tier("pool", 16), 1, 4)
    with pytest.raises(ConfigError, match="must be the last tier"):
        TierStack(make_cache(8, "lru", block_size=4), [shared, tier("ssd", 8)])
    with pytest.raises(ConfigError, match="4-token blocks"):
        TierStack(make_cache(8, "lru", block_size=8), [shared])
    with pytest.raises(ConfigError, match="given twice"):
        replay_cluster(*two_nodes_one_prompt(), nodes=2, pool=tier("pool", 8), tiers=[tier("pool", 8)])
    with pytest.raises(ConfigError, match="router"):
        replay_cluster(*two_nodes_one_prompt(), nodes=2, router="random")


def test_gib_tiers_resolve_with_a_model():
    w = random_token_workload(1, n=50)
    got = replay(w, capacity_blocks=8, block_size=4, model="llama-3-8b",
                 tiers=[Tier(name="dram", capacity_gib=0.03125, write="write_back")])  # 32 MiB = 64 blocks of 512 KiB
    assert got.config.tiers[0].capacity_blocks == 64 and got.config.tiers[0].capacity_gib is None


# ---------------------------------------------------------------------- the study
def test_capacity_at_interpolates_in_log_capacity():
    caps, rates = np.array([1.0, 4.0, 16.0]), np.array([0.1, 0.5, 0.9])
    assert capacity_at(caps, rates, 0.05) == 1.0
    assert capacity_at(caps, rates, 0.7) == pytest.approx(8.0)
    assert capacity_at(caps, rates, 0.95) is None


def test_study_runs_writes_tidy_tables_and_resumes(tmp_path):
    from kvlab.workload.generate import zipf_blocks

    w = zipf_blocks(300, seed=1, n_prefixes=40, prefix_blocks=(4, 40), block_size=512)
    node = Node(hardware="rtx-4090", dram_gib=2.0, ssd_gib=4.0)  # 4 GB of KV: a few dozen 64 MiB blocks
    cfg = StudyConfig(node=node, nodes=2, pool_gib=8.0, dram_sweep_gib=(0.5, 1.0, 2.0, 4.0), ssd_sweep_gib=(2.0,))
    got = run_study(tmp_path / "study", cfg, workloads=[w])
    runs = got.runs
    assert set(runs["section"]) == {"scenarios", "write_policy", "dram_sweep", "ssd_sweep"}
    assert 0 < node.device_blocks() < 100
    shares = runs[["share_device", "share_dram", "share_ssd", "share_pool"]].sum(axis=1)
    np.testing.assert_allclose(shares, runs["token_hit_rate"])
    assert (runs["token_hit_rate"] <= runs["ideal_hit_rate"] + 1e-12).all()
    assert set(got.targets["write"]) == {"write_through", "write_back"}
    assert got.summaries[w.name]["footprint_gib"] > 0
    assert "| trace |" in study_markdown(got)
    again = run_study(tmp_path / "study", cfg, workloads=[w])  # read back, not recomputed
    pd.testing.assert_frame_equal(again.runs, runs)
