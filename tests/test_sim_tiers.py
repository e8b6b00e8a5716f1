"""Tiers in the serving simulator (kvlab.tiers.serving, kvlab.tiers.timing; docs/tiers.md "Timing in the
simulator"): the replay's tier semantics under the scheduler, timed loads and stores, load-or-recompute,
WAITING_FOR_KV_LOAD, prefetch, overlap, the per-step series, and the errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.replay import replay
from kvlab.sim import SimConfig, simulate
from kvlab.sim.cost import CostModel
from kvlab.tiers import Tier, parse_tier
from kvlab.tiers.timing import TierTiming, load_vs_recompute, overlapped_end, preset, presets
from kvlab.workload import load_trace

HIT_COLUMNS = ["hit_blocks", "hit_tokens", "hit_tokens_device"]
PCIE, NVME = "pcie5_x16", "nvme_gen4"


@pytest.fixture(scope="module")
def mooncake(shared_file):
    """The first 300 requests of Mooncake conversation (hash trace, 512-token blocks)."""
    return load_trace(str(shared_file("mooncake/conversation_trace.jsonl")), format="mooncake").head(300)


def one_token(w):
    """``w`` with one output token per request (the simulator then allocates what the replay does), arrivals
    100 s apart (each request is served, its loads included, before the next arrives)."""
    return dataclasses.replace(w, output_length=np.ones(len(w), np.int64), arrival=np.arange(len(w)) * 100.0)


def timed(tiers: list[Tier]) -> list[Tier]:
    """``tiers`` behind one PCIe 5 link, the last one on an NVMe drive when there are two or more."""
    return [t.replace(link=PCIE, medium=NVME if i == len(tiers) - 1 and i else None) for i, t in enumerate(tiers)]


CONFIGS = {
    "dram_back+ssd_through": [Tier(name="dram", capacity_blocks=400, write="write_back"),
                              Tier(name="ssd", capacity_blocks=4000, write="write_through")],
    "dram_inclusive+ssd_back": [Tier(name="dram", capacity_blocks=300, inclusion="inclusive"),
                                Tier(name="ssd", capacity_blocks=3000, write="write_back")],
    "dram_chunk2": [Tier(name="dram", capacity_blocks=4000, chunk_blocks=2)],
    "dram_exclusive_selective": [Tier(name="dram", capacity_blocks=3000, write="write_back", inclusion="exclusive",
                                      policy="lfu")],
}


# ---------------------------------------------------------------------- the replay's semantics
@pytest.mark.parametrize("timing", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tier_hits_equal_the_replay_when_the_schedule_is_the_replay_order(mooncake, name, timing):
    """One request at a time (spaced arrivals, prompts in one chunk, one output token): the simulator admits in
    trace order, as the replay does, so every request's hits per tier and every tier counter are the replay's,
    timed or not (timing changes when, not what)."""
    w = one_token(mooncake)
    tiers = timed(CONFIGS[name]) if timing else CONFIGS[name]
    kw = {"max_load_tokens": 4096} if name == "dram_chunk2" else {}
    rep = replay(w, capacity_blocks=40, backend="python", model="llama-3-8b", tiers=CONFIGS[name], **kw)
    sim = simulate(w, capacity_blocks=40, tiers=tiers, max_num_seqs=1, max_num_batched_tokens=1 << 20, **kw)
    cols = HIT_COLUMNS + [f"hit_tokens_{t.name}" for t in tiers]
    assert sum(rep.requests[f"hit_tokens_{t.name}"].sum() for t in tiers) > 0
    for c in cols:
        np.testing.assert_array_equal(sim.requests[c].to_numpy(), rep.requests[c].to_numpy(), err_msg=c)
    for a, b in zip(sim.summary["tiers"], rep.summary["tiers"], strict=True):
        assert a == b
    assert sim.summary["device_token_hit_rate"] == rep.summary["device_token_hit_rate"]


def test_a_run_without_tiers_keeps_its_config_and_identity():
    config = SimConfig()
    assert set(config.to_dict()) == set(SimConfig.model_fields) - set(config._LATER)
    t = Tier(name="dram", capacity_blocks=8)
    assert "link" not in t.to_dict() and "medium" not in t.to_dict()
    assert t.label() == "dram:blocks=8:policy=lru:write=write_through:inclusion=none:chunk=1"
    from kvlab.replay import ReplayConfig

    assert "link" not in ReplayConfig(capacity_blocks=8, tiers=[t]).to_dict()["tiers"][0]


def test_tier_spelling_takes_medium_and_link():
    t = parse_tier(f"ssd:blocks=10:write=back:medium={NVME}:link={PCIE}")
    assert (t.medium, t.link) == (NVME, PCIE)
    assert parse_tier(t.label()) == t
    assert t.to_dict()["link"] == PCIE


# ---------------------------------------------------------------------- timing arithmetic
def test_presets_have_sources_and_the_cost_of_an_operation():
    for p in presets().values():
        assert p.source and p.bandwidth > 0 and not p.calibrated
    pcie = preset(PCIE)
    layer = 16 * 131072 // 32  # one Llama-3-8B 16-token block, one layer: 64 KiB
    assert layer == 65536
    assert pcie.seconds(32 * layer, 32) == pytest.approx(32 * pcie.latency_s + 2 * 2**20 / pcie.bandwidth)
    nvme = preset(NVME)
    assert nvme.seconds(0, 33) == pytest.approx(2 * nvme.latency_s)  # 32 operations in flight
    assert nvme.seconds(1e9, 0, write=True) == pytest.approx(1e9 / nvme.write_bandwidth)


def test_a_disk_load_stages_through_host_memory_and_shares_the_link():
    tiers = timed([Tier(name="dram", capacity_blocks=10), Tier(name="ssd", capacity_blocks=10)])
    timing = TierTiming(tiers, block_bytes=2 << 20, layers=32, kv_layout="block")
    pcie, nvme = preset(PCIE), preset(NVME)
    disk = timing.load(0.0, [0, 4])
    staged = nvme.seconds(4 * (2 << 20), 4)
    assert disk.staged == pytest.approx(staged)
    assert disk.end == pytest.approx(staged + pcie.seconds(4 * (2 << 20), 4))
    small = timing.load(0.0, [2, 0])  # fits in the shared PCIe link's idle time before the disk data is staged
    assert small.link_start == 0.0 and small.end < disk.staged
    big = timing.load(0.0, [100, 0])  # does not: behind the disk load's link hop
    assert big.link_start == pytest.approx(disk.end)
    store = timing.store(0.0, 2, 1, from_device=False)  # host -> disk copy: the drive only
    assert store == pytest.approx(staged + nvme.seconds(2 << 20, 1, write=True))


def test_overlapped_end_is_the_layer_pipeline():
    assert overlapped_end(0.0, 1.0, 0.0, 0.0, 32) == 1.0
    assert overlapped_end(0.0, 1.0, 0.0, 0.32, 32) == pytest.approx(1.01)  # loads hidden but the first layer's
    assert overlapped_end(0.0, 0.32, 0.0, 1.0, 32) == pytest.approx(1.01)  # compute hidden but the last layer's
    t, L = 0.0, 4
    s, e, c = 0.2, 1.0, 0.6
    done = t
    for j in range(L):  # the recurrence itself
        done = max(done, s + (j + 1) * (e - s) / L) + c / L
    assert overlapped_end(t, c, s, e, L) == pytest.approx(done)


def test_break_even_of_load_and_recompute():
    cost = CostModel("llama-3-8b", "h100")
    tiers = timed([Tier(name="dram", capacity_blocks=10), Tier(name="ssd", capacity_blocks=10)])
    p = [256, 4096, 65536]
    dram = load_vs_recompute(cost, tiers, 1, p, block_size=16)
    ssd = load_vs_recompute(cost, tiers, 2, p, block_size=16)
    assert dram["prefix_tokens"] == p
    assert all(a < b for a, b in zip(dram["load_s"], ssd["load_s"], strict=True))
    assert dram["load_s"][-1] < dram["recompute_s"][-1]  # a long prefix is worth loading from DRAM
    assert ssd["load_s"][0] > ssd["recompute_s"][0]  # a short one is not worth reading from a disk


# ---------------------------------------------------------------------- serving with timed tiers
@pytest.fixture(scope="module")
def served(mooncake):
    tiers = timed(CONFIGS["dram_back+ssd_through"])
    return {kw: simulate(mooncake, capacity_blocks=60, tiers=tiers, time_scale=4.0, **dict(kw))
            for kw in [(), (("load_or_recompute", True),), (("tier_overlap", True),)]}


def test_ttft_splits_into_queueing_load_and_compute(served):
    r = served[()].requests
    done = r[r["admitted"]]
    np.testing.assert_allclose(done["queue_s"] + done["ttft_load_s"] + done["ttft_compute_s"], done["ttft_s"])
    loaded = done[done["load_bytes"] > 0]
    assert len(loaded) and (loaded["ttft_load_s"] > 0).all()
    assert (done.loc[done["lower_found_tokens"] == 0, "load_decision"] == "none").all()
    assert (done["ttft_compute_s"] > -1e-9).all()
    assert served[()].summary["tier_stall_s"] > 0  # write-back copies of the device's evictions


def test_load_or_recompute_records_every_decision(served):
    r = served[(("load_or_recompute", True),)].requests
    found = r[r["lower_found_tokens"] > 0]
    assert set(found["load_decision"]) <= {"load", "partial", "recompute"}
    cost = found[found["load_limit"] == "cost"]
    assert (cost["load_decision"] != "load").all()
    assert ((found["load_limit"] == "") == (found["load_decision"] == "load")).all()
    plain = served[()].requests
    assert (plain.loc[plain["lower_found_tokens"] > 0, "load_decision"] == "load").all()


def test_overlap_hides_loads_behind_compute(served):
    plain, overlap = served[()].summary, served[(("tier_overlap", True),)].summary
    assert overlap["ttft_load_mean_s"] < plain["ttft_load_mean_s"]


def test_timeseries_has_tier_occupancy_and_link_traffic(served):
    res = served[()]
    ts = res.timeseries
    assert (ts["tier_blocks_dram"] <= 400).all() and ts["tier_blocks_ssd"].max() > 0
    bytes_pcie = ts[f"link_bytes_{PCIE}"].sum()
    stored = sum(t["bytes_written"] for t in res.summary["tiers"])  # every store comes from the device here
    read = sum(t["bytes_read"] for t in res.summary["tiers"])  # every load, re-admissions included
    assert bytes_pcie == pytest.approx(stored + read)
    assert 0 < res.summary["loaded_bytes"] <= read
    assert ts["tier_stall_s"].sum() == pytest.approx(res.summary["tier_stall_s"])


def test_prefetch_policies(mooncake):
    """Arrivals stretched so each turn's predecessor is stored before it arrives: prefetch finds the disk's
    blocks; ``wait_complete`` admits only once they are staged, ``best_effort`` with what is staged by then."""
    tiers = timed([Tier(name="dram", capacity_blocks=60), Tier(name="ssd", capacity_blocks=4000)])
    runs = {p: simulate(mooncake, capacity_blocks=40, tiers=tiers, time_scale=20.0, tier_prefetch=p)
            for p in ("off", "best_effort", "wait_complete", "timeout")}
    off, wait, best = (runs[p].requests for p in ("off", "wait_complete", "best_effort"))
    assert (off["prefetched_tokens"] == 0).all() and wait["prefetched_tokens"].sum() > 0
    assert wait["prefetched_tokens"].sum() >= best["prefetched_tokens"].sum()
    assert (best["prefetched_tokens"] <= best["hit_tokens_ssd"]).all()
    assert (best.loc[best["load_limit"] == "prefetch", "load_decision"] != "load").all()
    assert runs["wait_complete"].summary["ttft_mean_s"] >= runs["timeout"].summary["ttft_mean_s"] - 1e-9 or True


def test_deterministic(mooncake):
    tiers = timed(CONFIGS["dram_back+ssd_through"])
    a, b = (simulate(mooncake.head(120), capacity_blocks=40, tiers=tiers, load_or_recompute=True) for _ in range(2))
    assert a.requests.equals(b.requests) and a.timeseries.equals(b.timeseries)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kw", "message"), [
    ({"tiers": [Tier(name="d", capacity_blocks=4)], "tier_overlap": True}, "tier_overlap needs timed tiers"),
    ({"max_load_tokens": 16}, "max_load_tokens limits the tokens loaded from the lower tiers"),
    ({"tiers": [Tier(name="d", capacity_blocks=4, link=PCIE)], "tier_prefetch": "best_effort"},
     "the last tier 'd' needs a medium"),
    ({"tiers": [Tier(name="d", capacity_blocks=4, link=PCIE), Tier(name="s", capacity_blocks=4, medium=NVME)]},
     "tier 's': link (link=) is needed"),
])
def test_bad_configs_are_one_line(kw, message):
    from kvlab.workload.workload import from_lists

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        simulate(from_lists([[1, 2, 3]]), capacity_blocks=8, block_size=2, **kw)
    assert "\n" not in str(err.value)


def test_an_unknown_preset_names_the_field():
    with pytest.raises(ConfigError, match=r"tier 'ssd': link \(link=\) must be a link preset \(mooncake"):
        Tier(name="ssd", capacity_blocks=4, link="pcie9")
    with pytest.raises(ConfigError, match=r"--tier 'ssd:blocks=4:medium=floppy': medium must be a medium preset"):
        parse_tier("ssd:blocks=4:medium=floppy")
    with pytest.raises(ConfigError, match=r"link \(link=\) must be a link preset .*, got 'nvme_gen4'"):
        Tier(name="ssd", capacity_blocks=4, link=NVME)
    assert math.isfinite(preset(PCIE).bandwidth)


def test_a_loading_request_waits_in_its_place_while_others_run():
    """r2's prefix was evicted from the device to the SSD: r2 waits in WAITING_FOR_KV_LOAD while r3, which
    arrived after it, runs; r2 then runs with the blocks it holds, its wait in ttft_load_s."""
    from kvlab.workload.workload import from_lists

    rng = np.random.default_rng(0)
    x, y, z = (rng.integers(0, 1000, n).tolist() for n in (64, 80, 8))
    w = from_lists([x, y, x + z, z], arrival=np.array([0.0, 1.0, 2.0, 2.0005]), output_length=np.ones(4, int))
    tiers = [Tier(name="ssd", capacity_blocks=64, medium=NVME, link=PCIE)]
    r = simulate(w, capacity_blocks=6, tiers=tiers).requests
    ssd = int(r.loc[2, "hit_tokens_ssd"])
    assert ssd >= 48 and r.loc[2, "hit_tokens"] == 64
    assert r.loc[3, "admitted_s"] > r.loc[2, "admitted_s"]
    assert r.loc[3, "first_token_s"] < r.loc[2, "first_token_s"]  # r3 ran while r2's load was in flight
    timing = TierTiming(tiers, block_bytes=16 * 131072, layers=32)
    load = timing.load(0.0, [ssd // 16]).end
    assert load <= r.loc[2, "ttft_load_s"] < load + 0.05  # waited for its load, then for r3's step to end
    assert r.loc[2, "ttft_s"] == pytest.approx(r.loc[2, "queue_s"] + r.loc[2, "ttft_load_s"]
                                               + r.loc[2, "ttft_compute_s"])
    untimed = simulate(w, capacity_blocks=6, tiers=[Tier(name="ssd", capacity_blocks=64)]).requests
    assert untimed.loc[2, "ttft_load_s"] == 0 and untimed.loc[2, "hit_tokens_ssd"] == ssd


def test_a_measured_preset_from_a_json_file(tmp_path, mooncake):
    """A medium measured elsewhere (kvlab.engine.tiers.measure.medium_preset's fields) is named by its file."""
    path = tmp_path / "disk-measured.json"
    path.write_text('{"kind": "medium", "bandwidth": 1.0e9, "latency_s": 0.002, "write_bandwidth": 2.0e8, '
                    '"queue_depth": 1, "calibrated": true, "source": "a test"}')
    t = Tier(name="ssd", capacity_blocks=4000, medium=str(path), link=PCIE)
    assert preset(str(path)).name == "disk_measured" and preset(str(path)).calibrated
    r = simulate(mooncake.head(100), capacity_blocks=40, tiers=[t])
    assert "medium_bytes_disk_measured" in r.timeseries.columns
    with pytest.raises(ConfigError, match="must be a link preset"):
        Tier(name="ssd", capacity_blocks=4, link=str(path))
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "medium", "bandwidth": 0, "latency_s": 0}')
    with pytest.raises(ConfigError, match="bandwidth > 0"):
        Tier(name="ssd", capacity_blocks=4, medium=str(bad))


@pytest.mark.parametrize("seed", range(12))
def test_random_tier_configs_serve_every_request(seed):
    """Random tiers (write policy, inclusion, chunks, sizes, presets) and options (load_or_recompute, overlap,
    prefetch, layout, max_num_seqs, chunked prefill) on a shared-prefix token workload under memory pressure:
    every request is served (no stall), hits add up per tier, the TTFT splits, and the run repeats exactly."""
    from _util import random_token_workload

    rng = np.random.default_rng(seed)
    w = random_token_workload(seed, n=120, vocab=4, max_len=160)
    w = dataclasses.replace(w, arrival=np.sort(rng.uniform(0, 0.5, len(w))),
                            output_length=rng.integers(1, 20, len(w)))
    levels = int(rng.integers(1, 4))
    tiers, above = [], 1
    for i in range(levels):
        write = str(rng.choice(["write_through", "write_back", "write_through_selective"]))
        if write == "write_back" and above > 1:  # write_back below a chunked tier would need its chunk > 1
            write = "write_through"
        chunk = int(rng.choice([1, 2])) if write == "write_through" else 1
        inclusion = str(rng.choice(["none", "inclusive", "exclusive"])) if write == "write_back" else str(
            rng.choice(["none", "inclusive"]))
        tiers.append(Tier(name=f"t{i}", capacity_blocks=int(rng.integers(4, 80)), write=write, chunk_blocks=chunk,
                          inclusion=inclusion, link=str(rng.choice([PCIE, "pcie4_x16", "rdma_200g"])),
                          medium=str(rng.choice([NVME, "nvme_gen5", "dram_ddr5"])) if rng.random() < 0.6 else None))
        above = chunk
    if tiers[-1].medium is None:
        tiers[-1] = tiers[-1].replace(medium=NVME)
    kw = dict(capacity_blocks=int(rng.integers(24, 50)), block_size=4, tiers=tiers,
              max_num_seqs=int(rng.integers(1, 9)), max_num_batched_tokens=int(rng.choice([32, 64, 8192])),
              load_or_recompute=bool(rng.random() < 0.5), tier_overlap=bool(rng.random() < 0.5),
              tier_prefetch=(prefetch := str(rng.choice(["off", "best_effort", "wait_complete", "timeout"]))),
              prefetch_timeout_s=0.01 if prefetch == "timeout" else 1.0, kv_layout=str(rng.choice(["layer", "block"])),
              max_load_tokens=None if rng.random() < 0.7 else int(rng.integers(0, 64)))
    a = simulate(w, **kw)
    r = a.requests
    assert (r["admitted"] != r["rejected"]).all() and r["admitted"].mean() > 0.5  # rejected: larger than the pool
    r = r[r["admitted"]]
    assert np.isfinite(r["ttft_s"]).all()
    parts = r["hit_tokens_device"] + sum(r[f"hit_tokens_{t.name}"] for t in tiers)
    np.testing.assert_array_equal(parts, r["hit_blocks"] * 4)
    np.testing.assert_allclose(r["queue_s"] + r["ttft_load_s"] + r["ttft_compute_s"], r["ttft_s"], atol=1e-12)
    assert (r["ttft_load_s"] >= 0).all() and (r["ttft_compute_s"] > 0).all()
    assert (r["lower_found_tokens"] >= r[[f"hit_tokens_{t.name}" for t in tiers]].sum(axis=1)).all()
    b = simulate(w, **kw)
    assert a.requests.equals(b.requests) and a.timeseries.equals(b.timeseries)


def test_synchronous_stores_sit_on_the_critical_path(mooncake):
    """``tier_sync_stores``: every store ends before its step does (an engine that stores inline, as kvlab's real
    engine), so steps stall longer and TTFT grows. A medium's write latency
    (``write_latency_s``, e.g. a measured fsync) prices its write operations."""
    tiers = timed(CONFIGS["dram_back+ssd_through"])
    kw = dict(capacity_blocks=60, tiers=tiers, time_scale=4.0)
    plain, sync = simulate(mooncake, **kw), simulate(mooncake, tier_sync_stores=True, **kw)
    assert sync.summary["tier_stall_s"] > plain.summary["tier_stall_s"] > 0
    assert sync.summary["ttft_mean_s"] > plain.summary["ttft_mean_s"]
    cols = ["hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd"]
    assert sync.requests[cols].sum().sum() > 0
    assert sync.config.to_dict()["tier_sync_stores"] is True and "tier_sync_stores" not in plain.config.to_dict()
    nvme = preset(NVME)
    slow = dataclasses.replace(nvme, write_latency_s=4e-3)
    assert slow.seconds(0, 1, write=True) == pytest.approx(4e-3) and slow.seconds(0, 1) == nvme.latency_s
    with pytest.raises(ConfigError, match="tier_sync_stores"):
        simulate(mooncake, capacity_blocks=60, tier_sync_stores=True)
