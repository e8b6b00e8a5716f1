"""Real DRAM and disk tiers below the engine's pool (kvlab.engine.tiers; docs/engine.md).

Hits from every tier are really loaded and pass the oracle (fp32), the per-request tier columns and tier
counters equal the replay's, and a corrupt, truncated or missing block file or a full disk is detected,
counted and recomputed, never served.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.engine import Engine, build_random_model
from kvlab.engine.kv_pool import KVLayout
from kvlab.engine.tiers.store import MARKER, DiskStore, TierDir, TierReadError
from kvlab.errors import ConfigError
from kvlab.replay.replay import replay
from kvlab.sim.engine_executor import run_engine_serving
from kvlab.tiers import Tier
from kvlab.workload.workload import from_lists

COLS = ["hit_tokens", "hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd"]
#: the tiers[] fields both drivers compute from the same counters (bytes differ: model profile vs pool layout)
SAME = ("hit_share", "local_hit_rate", "found_hit_tokens", "loaded_tokens", "blocks_stored", "stores_skipped",
        "stores_never_read", "evictions", "moved_up_blocks")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_model("tiny-llama", seed=0)


def workload(order=(0, 1, 0, 2, 3, 1, 4, 0, 2, 3, 4, 1, 0, 3, 2, 4), seed: int = 1, output: int = 1):
    """Prompts of five 33-token stems (4 full blocks of 8) in ``order``, each with a short random tail."""
    rng = np.random.default_rng(seed)
    stems = [np.random.default_rng(100 + s).integers(0, 64, 33).tolist() for s in range(5)]
    prompts = [stems[s] + rng.integers(0, 64, int(rng.integers(1, 6))).tolist() for s in order]
    n = len(prompts)
    return from_lists(prompts, arrival=np.arange(n) * 0.5, output_length=np.full(n, output))


def tiered(model, tmp_path: Path, tiers: list[Tier], **kw) -> Engine:
    return Engine(model, capacity_blocks=10, block_size=8, num_threads=1, tiers=tiers, tier_dir=tmp_path / "t", **kw)


TIER_SETS = {
    "back+through": [Tier(name="dram", capacity_blocks=6, write="write_back"), Tier(name="ssd", capacity_blocks=64)],
    "exclusive+chunk2": [Tier(name="dram", capacity_blocks=8, write="write_back", inclusion="exclusive"),
                         Tier(name="ssd", capacity_blocks=64, chunk_blocks=2)],
    "selective+back": [Tier(name="dram", capacity_blocks=6, write="write_through_selective"),
                       Tier(name="ssd", capacity_blocks=16, write="write_back", inclusion="inclusive")],
}


@pytest.mark.parametrize("name", TIER_SETS)
def test_hits_from_every_tier_are_loaded_verified_and_equal_the_replay(model, tmp_path, name):
    tiers = TIER_SETS[name]
    eng = tiered(model, tmp_path, tiers)
    res = eng.run(workload(), verify=True)
    rep = replay(workload(), capacity_blocks=10, block_size=8, backend="python", tiers=tiers, hash="xxh3_128")
    assert res.summary["verify_pass_rate"] == 1.0
    np.testing.assert_array_equal(res.requests[COLS].to_numpy(), rep.requests[COLS].to_numpy())
    for mine, theirs in zip(res.summary["tiers"], rep.summary["tiers"], strict=True):
        assert {k: mine[k] for k in SAME} == {k: theirs[k] for k in SAME}
        assert mine["read_errors"] == mine["write_errors"] == 0
    assert [t["store"] for t in res.summary["tiers"]] == ["dram", "disk"]
    sums = res.requests[COLS].sum()
    assert sums["hit_tokens_dram"] > 0 and (sums["hit_tokens_ssd"] > 0 or name == "selective+back")
    assert res.summary["tiers"][1]["bytes_read"] == sums["hit_tokens_ssd"] * eng.layout.bytes_per_token
    eng.tier_io.close()
    assert not (tmp_path / "t").exists()  # its files, marker and the directory it created are gone


def test_wrong_bytes_from_a_tier_fail_the_oracle(model, tmp_path):
    """The oracle has teeth: a DRAM tier that serves altered bytes (no checksum there) fails verify."""
    eng = Engine(model, capacity_blocks=10, block_size=8, num_threads=1,
                 tiers=[Tier(name="dram", capacity_blocks=64)])
    eng.run(workload(order=(0, 1, 2, 3)))
    for page in eng.tier_io.stores[0].pages.values():
        page.add_(0.5)
    res = eng.run(workload(order=(0, 1)), verify=True)
    assert res.requests["hit_tokens_dram"].sum() > 0
    assert res.summary["verify_failures"] > 0


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one byte of the last block
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


FAULTS = {"corrupt": _corrupt, "truncated": _truncate, "missing": Path.unlink}


@pytest.mark.parametrize("fault", FAULTS)
def test_bad_block_files_are_detected_counted_and_recomputed(model, tmp_path, fault):
    eng = tiered(model, tmp_path, [Tier(name="ssd", capacity_blocks=64)])
    first = eng.run(workload(order=(0, 1, 2, 3, 4)))
    assert first.requests["hit_tokens_ssd"].sum() == 0
    files = sorted((tmp_path / "t").glob("ssd-*.kvb"))
    assert len(files) == 20  # 5 stems x 4 full blocks, one file per block
    for f in files:
        FAULTS[fault](f)
    res = eng.run(workload(order=(0, 1, 0)), verify=True)  # stem 0 is off the device: found on disk, unreadable
    rows = res.requests
    assert rows["hit_tokens_ssd"].iloc[0] == 0 and rows["hit_tokens_ssd"].iloc[1] == 0
    assert res.summary["verify_pass_rate"] == 1.0
    assert res.summary["tiers"][0]["read_errors"] >= 1
    assert rows["computed_prompt_tokens"].iloc[0] == rows["prompt_tokens"].iloc[0]  # recomputed, not served
    # the bad slot was dropped and the recomputed blocks stored again: readable from disk once more
    again = eng.run(workload(order=(1, 2, 3, 4, 0)), verify=True)
    assert again.requests["hit_tokens_ssd"].iloc[-1] > 0 and again.summary["verify_pass_rate"] == 1.0


def test_full_disk_write_failures_are_counted_and_nothing_is_served(model, tmp_path):
    eng = tiered(model, tmp_path, [Tier(name="ssd", capacity_blocks=64)])
    disk = eng.tier_io.stores[0]
    disk.quota = 6 * disk.file_bytes  # the disk fills after 6 block files: later writes fail with ENOSPC
    eng.run(workload(order=(0, 1, 2, 3, 4)))
    res = eng.run(workload(order=(0, 1, 2, 3, 4)), verify=True)
    entry = res.summary["tiers"][0]
    assert entry["write_errors"] > 0 and entry["read_errors"] == 0
    assert len(list((tmp_path / "t").glob("*.kvb*"))) == 6  # no partial or temporary file left
    assert 0 < res.requests["hit_tokens_ssd"].sum() <= 6 * 8
    assert res.summary["verify_pass_rate"] == 1.0


def test_disk_store_file_format_and_atomic_writes(tmp_path):
    layout = KVLayout(2, 2, 4, 8, torch.float32)
    store = DiskStore(tmp_path, "ssd", layout, 2)
    data = torch.randn(2, *layout.pool_shape(1)[1:])
    store.store(7, data)
    assert sorted(os.listdir(tmp_path)) == ["ssd-00000007.kvb"]
    assert (tmp_path / "ssd-00000007.kvb").stat().st_size == 4096 + 2 * layout.bytes_per_block
    assert torch.equal(store.load(7), data)
    store.store(7, data + 1)  # overwritten by rename: the new content, no temporary file left
    assert torch.equal(store.load(7), data + 1) and len(os.listdir(tmp_path)) == 1
    full = DiskStore(tmp_path, "x", layout, 2, quota_bytes=100)
    with pytest.raises(OSError) as err:
        full.store(0, data)
    assert err.value.errno == errno.ENOSPC and not list(tmp_path.glob("x-*"))
    store.remove(7)
    assert not os.listdir(tmp_path)
    with pytest.raises(TierReadError):
        store.load(7)


def test_tier_dir_refuses_foreign_files_and_deletes_only_its_own(tmp_path):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="tier_dir .* not empty"):
        TierDir(foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    used = tmp_path / "used"
    d = TierDir(used)
    (used / "ssd-00000001.kvb").write_bytes(b"left by a crashed run")
    (used / "keep.txt").write_text("not kvlab's")
    d.close()
    assert sorted(os.listdir(used)) == [MARKER, "keep.txt", "ssd-00000001.kvb"]  # not empty: kept as is
    TierDir(used).close()  # a marked directory: kvlab's stale files go, the rest (and the marker) stays
    assert sorted(os.listdir(used)) == [MARKER, "keep.txt"]


def test_a_tier_dir_in_use_is_refused_until_closed(model, tmp_path):
    tiers = [Tier(name="ssd", capacity_blocks=8)]
    first = tiered(model, tmp_path, tiers)
    with pytest.raises(ConfigError, match="in use by another engine"):
        tiered(model, tmp_path, tiers)
    first.tier_io.close()
    tiered(model, tmp_path, tiers).tier_io.close()


def test_bad_arguments_name_the_field(model, tmp_path):
    with pytest.raises(ConfigError, match="tier_dir needs tiers"):
        Engine(model, capacity_blocks=8, block_size=8, tier_dir=tmp_path)
    with pytest.raises(ConfigError, match="tiers 'dram:blocks=0': blocks must be in"):
        Engine(model, capacity_blocks=8, block_size=8, tiers=["dram:blocks=0"])  # the --tier spelling works too
    with pytest.raises(ConfigError, match=r"max_load_tokens must be in \[0"):
        Engine(model, capacity_blocks=8, block_size=8, tiers=[Tier(name="dram", capacity_blocks=4)],
               max_load_tokens=-1)


def test_engine_serving_with_tiers_batched_passes_verify(model, tmp_path):
    """Under the scheduler (blocks keyed at schedule: write-through stores run after the step's forward),
    packed steps: loads from DRAM and disk, the oracle passes, the tier columns are there, files are gone."""
    tiers = [Tier(name="dram", capacity_blocks=6, write="write_back"), Tier(name="ssd", capacity_blocks=64)]
    res = run_engine_serving(workload(output=3), Engine(model, capacity_blocks=16, block_size=8, num_threads=1),
                             timer="thread", max_num_seqs=3, warmup=0, batched=True, verify=True, tiers=tiers,
                             tier_dir=tmp_path / "t")
    sums = res.requests[COLS].sum()
    assert sums["hit_tokens_dram"] > 0 and sums["hit_tokens_ssd"] > 0
    assert sums["hit_tokens"] == sums[COLS[1:]].sum()
    assert res.summary["verify_pass_rate"] == 1.0 and res.summary["verified_requests"] == len(res.requests)
    assert [t["store"] for t in res.summary["tiers"]] == ["dram", "disk"]
    assert not (tmp_path / "t").exists()


def test_disk_profile_fits_latency_and_bandwidth():
    """The fit through per-op medians at several sizes recovers latency_s + bytes / bandwidth_Bps."""
    from kvlab.engine.tiers.measure import disk_profile, medium_preset

    sizes = {str(c): {"bytes_per_op": c << 21, "read_cold": {"median_s": 1e-3 + (c << 21) / 2e9},
                      "write": {"median_s": 2e-3 + (c << 21) / 5e8}} for c in (1, 4, 16)}
    measured = {"directory": "/x", "sizes": sizes}
    prof = disk_profile(measured)
    assert prof["latency_s"] == pytest.approx(1e-3) and prof["bandwidth_Bps"] == pytest.approx(2e9)
    assert prof["source"].startswith("measured read_cold")
    preset = medium_preset(measured)
    assert preset["write_bandwidth"] == pytest.approx(5e8) and preset["kind"] == "medium"


def test_tier_ttft_measurement_runs_every_source(model, tmp_path):
    from kvlab.engine.tiers.measure import SOURCES, measure_tier_ttft

    rows = measure_tier_ttft(model, prefix_tokens=(32,), tail_tokens=8, block_size=8, repeats=1, directory=tmp_path,
                             num_threads=1)
    assert [r["source"] for r in rows] == list(SOURCES)
    assert [r["hit_tokens"] for r in rows] == [0, 32, 32, 32, 32] and all(r["verify_passed"] for r in rows)
    assert not os.listdir(tmp_path)
