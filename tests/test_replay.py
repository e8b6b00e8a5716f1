"""The replay driver: compiled and Python engines agree hit for hit; metrics and results on disk."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from _util import random_token_workload
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.errors import ConfigError
from kvlab.policies import EvictionPolicy, register_policy
from kvlab.replay import ReplayConfig, encode, replay
from kvlab.results import read_results
from kvlab.sweep import grid, read_sweep, run_sweep
from kvlab.workload.workload import from_lists

COLUMNS = ["hit_blocks", "new_blocks", "evictions", "admitted", "cached_blocks", "orphan_blocks", "orphan_evictions"]


@pytest.mark.parametrize("capacity", [1, 3, 8, 40, 1000])
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
def test_compiled_equals_python(capacity, mode):
    w = random_token_workload(capacity)
    cfg = ReplayConfig(capacity_blocks=capacity, block_size=4, mode=mode)
    enc = encode(w, cfg)
    fast = replay(w, cfg, encoded=enc, engine="compiled").requests
    slow = replay(w, cfg, encoded=enc, engine="python").requests
    pd.testing.assert_frame_equal(fast[COLUMNS], slow[COLUMNS])
    if capacity <= 8:
        assert fast["evictions"].sum() > 0
    if capacity == 1:
        assert not fast["admitted"].all()  # prompts of 2+ blocks cannot fit one block


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 30), bs=st.sampled_from([1, 2, 3, 8]))
def test_compiled_equals_python_property(seed, capacity, bs):
    w = random_token_workload(seed, n=80)
    cfg = ReplayConfig(capacity_blocks=capacity, block_size=bs)
    enc = encode(w, cfg)
    fast = replay(w, cfg, encoded=enc, engine="compiled").requests
    slow = replay(w, cfg, encoded=enc, engine="python").requests
    pd.testing.assert_frame_equal(fast[COLUMNS], slow[COLUMNS])
    # hit rate never exceeds the infinite cache's
    assert fast["hit_tokens"].sum() <= fast["ideal_hit_tokens"].sum()
    assert (fast["cached_blocks"] <= capacity).all()


def test_verify_mode_counts_collisions_in_both_engines():
    w = random_token_workload(5, n=200, vocab=50)
    cfg = ReplayConfig(capacity_blocks=2000, block_size=2, hash="xxh3_64", verify=True)
    # truncated keys collide; verify refuses those hits and counts them
    from kvlab.hashing import BlockHasher, encode_workload

    enc = encode_workload(w, BlockHasher("xxh3_64", truncate_bits=6), 2, verify=True)
    fast = replay(w, cfg, encoded=enc, engine="compiled")
    slow = replay(w, cfg, encoded=enc, engine="python")
    assert fast.summary["collisions"] > 0
    assert fast.summary["collisions"] == slow.summary["collisions"]
    pd.testing.assert_frame_equal(fast.requests[COLUMNS], slow.requests[COLUMNS])
    safe = replay(w, cfg)
    assert safe.summary["collisions"] == 0


def test_verify_mode_counts_collisions_of_admitted_requests_only_in_both_engines():
    """A request that does not fit changes nothing and counts nothing, collisions included (the compiled kernel
    counted a refused request's collision)."""
    from kvlab.hashing import BlockHasher, encode_workload

    w = random_token_workload(5, n=300, vocab=50, max_len=60)
    cfg = ReplayConfig(capacity_blocks=24, block_size=2, hash="xxh3_64", verify=True)
    enc = encode_workload(w, BlockHasher("xxh3_64", truncate_bits=6), 2, verify=True)
    fast = replay(w, cfg, encoded=enc, backend="compiled")
    slow = replay(w, cfg, encoded=enc, backend="python")
    assert (~fast.requests["admitted"]).sum() > 0 and fast.summary["collisions"] > 0
    pd.testing.assert_frame_equal(fast.requests[[*COLUMNS, "collisions"]], slow.requests[[*COLUMNS, "collisions"]])
    assert (fast.requests.loc[~fast.requests["admitted"], "collisions"] == 0).all()


def test_metrics_by_hand():
    # block size 2: request 0 computes [1 2][3 4][5]; request 1 = [1 2][3 4][6 7] hits 2 blocks
    w = from_lists([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9, 9]], arrival=[0.0, 1.0, 2.0])
    r = replay(w, capacity_blocks=100, block_size=2)
    req = r.requests
    assert req["hit_blocks"].tolist() == [0, 2, 0]
    assert req["hit_tokens"].tolist() == [0, 4, 0]
    assert req["full_blocks"].tolist() == [2, 3, 1]
    s = r.summary
    assert s["token_hit_rate"] == pytest.approx(4 / 13)
    assert s["block_hit_rate"] == pytest.approx(2 / 6)
    assert s["request_hit_rate"] == pytest.approx(1 / 3)
    assert s["mean_request_hit_rate"] == pytest.approx((0 + 4 / 6 + 0) / 3)
    assert s["ideal_hit_rate"] == pytest.approx(4 / 13)
    assert s["evictions"] == 0 and s["reused_tokens"] == 4


def test_ideal_mode_counts_the_last_token():
    w = from_lists([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert replay(w, capacity_blocks=10, block_size=2).requests["hit_tokens"].tolist() == [0, 2]
    assert replay(w, capacity_blocks=10, block_size=2, mode="ideal").requests["hit_tokens"].tolist() == [0, 4]


def test_salt_and_adapter_isolate_in_replay():
    prompts = [[1, 2, 3, 4, 5]] * 4
    w = from_lists(prompts, salt=["a", "a", "b", None], adapter=[None, None, None, "lora1"])
    hits = replay(w, capacity_blocks=50, block_size=2).requests["hit_blocks"].tolist()
    assert hits == [0, 2, 0, 0]


def test_block_trace_replay_and_partial_blocks():
    # two requests sharing chained ids 0,1; last block of each partial
    w = from_lists([[0, 1, 2], [0, 1, 3]], kind="blocks", block_size=4, input_length=[10, 11])
    r = replay(w, capacity_blocks=10)
    assert r.requests["full_blocks"].tolist() == [2, 2]
    assert r.requests["hit_blocks"].tolist() == [0, 2]
    assert r.requests["new_blocks"].tolist() == [3, 1]


def test_one_default_block_size_for_every_driver():
    """Workload.default_block_size: the trace's own (hash traces) or 16 (token traces), in replay, simulate
    and trace stats alike."""
    from kvlab.sim import simulate
    from kvlab.stats import trace_stats

    blocks = from_lists([[0, 1, 2], [0, 1, 3]], kind="blocks", block_size=4, input_length=[10, 11])
    tokens = from_lists([list(range(40)), list(range(30))])
    assert (blocks.default_block_size, tokens.default_block_size) == (4, 16)
    for w in (blocks, tokens):
        bs = w.default_block_size
        assert replay(w, capacity_blocks=10).summary["block_size"] == bs
        assert simulate(w, capacity_blocks=10).summary["block_size"] == bs
        assert trace_stats(w)["block_size"] == bs


def test_every_driver_starts_from_one_requests_frame():
    """kvlab.results.frame.requests_frame: the leading columns, a driver's own columns, then the labels."""
    from kvlab.results.frame import DRIVER_COLUMNS, requests_frame
    from kvlab.sim import simulate

    w = from_lists([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], tenant=["a", "b"])
    base = requests_frame(w, 2, {c: np.zeros(2, np.int64) for c in DRIVER_COLUMNS}, np.array([0, 2]),
                          extra={"mine": np.ones(2)})
    lead = list(base.columns)[:-2]
    assert list(base.columns)[-2:] == ["mine", "tenant"] and len(lead) == 14
    assert base["full_blocks"].tolist() == [2, 2] and base["ideal_hit_tokens"].tolist() == [0, 4]
    rep = replay(w, capacity_blocks=10, block_size=2, verify=True).requests
    sim = simulate(w, capacity_blocks=10, block_size=2).requests
    assert list(rep.columns) == [*lead, "collisions", "tenant"]
    assert list(sim.columns)[: len(lead)] == lead and list(sim.columns)[-1] == "tenant"
    pd.testing.assert_frame_equal(rep[lead[:3]], sim[lead[:3]])


def test_results_on_disk_and_deterministic(tmp_path):
    w = random_token_workload(1)
    a = replay(w, capacity_blocks=16, block_size=4)
    a.save(tmp_path / "run")
    back = read_results(tmp_path / "run")
    pd.testing.assert_frame_equal(back.requests, a.requests)
    assert {"prompt_tokens", "hit_tokens"} <= set(back.requests.columns)
    m = back.manifest
    assert m["config"]["capacity_blocks"] == 16 and m["seed"] == 0 and m["driver"] == "replay"
    assert m["versions"]["numpy"] and "git_revision" in m
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["token_hit_rate"] == a.summary["token_hit_rate"]
    b = replay(w, capacity_blocks=16, block_size=4)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary leftovers


def test_failed_write_leaves_previous_run_intact(tmp_path, monkeypatch):
    w = random_token_workload(2)
    r = replay(w, capacity_blocks=16, block_size=4)
    r.save(tmp_path / "run")
    original = (tmp_path / "run" / "summary.json").read_text()
    monkeypatch.setattr(pd.DataFrame, "to_parquet", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        replay(w, capacity_blocks=8, block_size=4).save(tmp_path / "run")
    assert (tmp_path / "run" / "summary.json").read_text() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_sweep_resumes(tmp_path, monkeypatch):
    w = random_token_workload(3)
    configs = grid([4, 16], policies=["lru"], block_size=4)
    first = run_sweep(w, configs, tmp_path / "sw", progress=False)
    assert len(first) == 2 and len(list((tmp_path / "sw" / "runs").iterdir())) == 2
    import kvlab.sweep as sweep_mod

    def boom(*a, **k):
        raise AssertionError("a finished run was replayed again")

    monkeypatch.setattr(sweep_mod, "replay", boom)
    again = run_sweep(w, configs, tmp_path / "sw", progress=False)
    pd.testing.assert_frame_equal(first, again)
    assert len(read_sweep(tmp_path / "sw")) == 2


def test_bad_config():
    w = random_token_workload(0, n=5)
    with pytest.raises(ConfigError, match="capacity"):
        replay(w, capacity_blocks=0)
    with pytest.raises(ConfigError, match="mode"):
        replay(w, capacity_blocks=4, mode="maybe")
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        replay(w, capacity_blocks=4, policy="nope")
    with pytest.raises(ConfigError, match="no compiled kernel"):
        replay(w, capacity_blocks=4, policy="test-mru", engine="compiled")


@register_policy("test-mru", replace=True)
class _MRU(EvictionPolicy):
    """A plugin written in a test: most recently unpinned first."""

    def __init__(self) -> None:
        self.q: dict = {}

    def on_pin(self, block, ctx):
        del self.q[block.block_id]

    def on_unpin(self, block, ctx):
        self.q[block.block_id] = block

    def victim(self):
        return next(reversed(self.q.values()))

    def on_evict(self, block):
        del self.q[block.block_id]

    def __len__(self):
        return len(self.q)


def test_plugin_policy_runs_in_replay_and_differs_from_lru():
    w = random_token_workload(11)
    mru = replay(w, capacity_blocks=12, block_size=2, policy="test-mru")
    lru = replay(w, capacity_blocks=12, block_size=2, policy="lru")
    assert mru.summary["engine"] == "python" and lru.summary["engine"] == "compiled"
    assert mru.summary["evictions"] > 0
    assert mru.requests["hit_blocks"].tolist() != lru.requests["hit_blocks"].tolist()
