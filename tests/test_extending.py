"""docs/extending.md's recipes, done in-process: a policy, a workload family, a tier medium and a figure, each
registered the way the doc says and run through the drivers (tiny generated inputs; seconds in all)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import pandas as pd
import pytest

from kvlab.policies import EvictionPolicy, register_policy
from kvlab.policies.base import _REGISTRY
from kvlab.replay import replay
from kvlab.sim import simulate
from kvlab.tiers import Tier, timing
from kvlab.workload.families import FAMILIES, family_config, family_workload, generate
from kvlab.workload.families.base import FamilyConfig, GeneratedRequest, Message
from kvlab.workload.families.registry import SINGLE_FAMILIES
from kvlab.workload.render import Part
from kvlab.workload.tokenizer import load_tokenizer
from kvlab.workload.workload import Workload, from_lists


def shared_prefix_workload(n: int = 40) -> Workload:
    """``n`` prompts over four 48-token stems with short distinct tails, one request per 0.1 s."""
    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 1000, 48).tolist() for _ in range(4)]
    prompts = [stems[int(rng.integers(0, 4))] + rng.integers(0, 1000, int(rng.integers(1, 12))).tolist()
               for _ in range(n)]
    return from_lists(prompts, arrival=np.arange(n) * 0.1, output_length=np.full(n, 2))


# ----------------------------------------------------------------------------- a policy (one file)
class NewestUnpinnedLast(EvictionPolicy):
    """LRU written as a plugin: the evictable blocks in unpin order, the oldest evicted first."""

    source = "docs/extending.md, 'A policy'"

    def __init__(self) -> None:
        self.q: dict[int, object] = {}

    def on_pin(self, block, ctx) -> None:  # noqa: ANN001 - the policy hooks' protocol
        self.q.pop(block.block_id, None)

    def on_unpin(self, block, ctx) -> None:  # noqa: ANN001
        self.q[block.block_id] = block

    def victim(self):  # noqa: ANN201
        return next(iter(self.q.values()))

    def on_evict(self, block) -> None:  # noqa: ANN001
        del self.q[block.block_id]

    def __len__(self) -> int:
        return len(self.q)


@pytest.fixture
def plugin_policy():
    name = "test-extending-lru"
    register_policy(name)(NewestUnpinnedLast)
    try:
        yield name
    finally:
        _REGISTRY.pop(name, None)


def test_a_registered_policy_runs_in_the_replay_and_the_simulator(plugin_policy):
    wl = shared_prefix_workload()
    mine = replay(wl, capacity_blocks=12, block_size=16, policy=plugin_policy)
    lru = replay(wl, capacity_blocks=12, block_size=16, policy="lru", backend="python")
    assert mine.summary["policy"] == plugin_policy and mine.summary["evictions"] > 0
    assert mine.requests["hit_tokens"].tolist() == lru.requests["hit_tokens"].tolist()  # it is LRU
    sim = simulate(wl, capacity_blocks=24, block_size=16, policy=plugin_policy)
    assert sim.summary["token_hit_rate"] > 0


# ----------------------------------------------------------------------------- a workload family (two files)
class TinySharedConfig(FamilyConfig):
    """Every request: one of ``n_prompts`` fixed system texts, then its own question."""

    family: Literal["tiny_shared"] = "tiny_shared"
    n_requests: int = 30
    n_prompts: int = 3


def generate_tiny_shared(config: TinySharedConfig) -> list[GeneratedRequest]:
    rng = np.random.default_rng(config.seed)
    systems = [f"You are assistant {k}. " + "Answer briefly and cite sources. " * 6 for k in range(config.n_prompts)]
    out = []
    for i in range(config.n_requests):
        k = int(rng.integers(0, config.n_prompts))
        msgs = (Message("system", (Part("system", systems[k]),)), Message("user", (Part("user", f"Question {i}?"),)))
        out.append(GeneratedRequest(messages=msgs, arrival=0.5 * i, output_tokens=4, session=i, turn=1, tenant=k,
                                    category="tiny_shared", answer_source="none"))
    return out


def test_a_registered_family_generates_and_replays(monkeypatch):
    entry = (TinySharedConfig, generate_tiny_shared)
    monkeypatch.setitem(SINGLE_FAMILIES, "tiny_shared", entry)  # the one line in registry.py
    monkeypatch.setitem(FAMILIES, "tiny_shared", entry)  # (FAMILIES copies SINGLE_FAMILIES at import)
    config = family_config("tiny_shared", n_requests=30, tokenizer="byte")
    wl = family_workload(generate(config), load_tokenizer("byte"), name="tiny_shared")
    assert len(wl) == 30 and set(wl.category) == {"tiny_shared"}
    res = replay(wl, capacity_blocks=64, block_size=16)
    assert res.summary["token_hit_rate"] > 0.5  # the system texts are shared


# ----------------------------------------------------------------------------- a tier medium (one file)
def test_a_new_medium_by_name_times_like_the_numbers_it_holds(monkeypatch):
    """A preset added under a new name (an entry of kvlab/data/tiers/presets.json) with nvme_gen4's numbers
    gives nvme_gen4's results; a .json file of it works without touching the shipped file."""
    mine = dataclasses.replace(timing.presets()["nvme_gen4"], name="test_disk", description="test")
    monkeypatch.setitem(timing.presets(), "test_disk", mine)
    wl = shared_prefix_workload()

    def run(medium: str) -> pd.DataFrame:
        tiers = [Tier(name="ssd", capacity_blocks=256, medium=medium, link="pcie5_x16")]
        return simulate(wl, capacity_blocks=8, block_size=16, model="llama-3-8b", tiers=tiers).requests

    base = run("nvme_gen4")
    assert base["hit_tokens_ssd"].sum() > 0
    pd.testing.assert_series_equal(run("test_disk")["ttft_s"], base["ttft_s"])


# ----------------------------------------------------------------------------- a figure (one file + a cell)
def test_a_figure_draws_and_saves_with_its_data_and_caption(tmp_path):
    from kvlab.plots import style

    wl = shared_prefix_workload()
    frame = pd.DataFrame([{"capacity_blocks": c, "token_hit_rate": replay(wl, capacity_blocks=c, block_size=16)
                           .summary["token_hit_rate"]} for c in (6, 12, 24)])
    fig, ax = style.figure("column")
    ax.plot(frame["capacity_blocks"], frame["token_hit_rate"], **style.series_style(0))
    ax.set(xlabel="capacity (blocks)", ylabel="token hit rate")
    paths = style.save(fig, tmp_path / "figs", "hit_rate", data=frame, caption=style.caption("more is better"))
    assert sorted(p.name for p in paths) == sorted(style.save_names("hit_rate"))
    assert pd.read_parquet(tmp_path / "figs" / "hit_rate.parquet").equals(frame)
