"""The one contract every engine tier store keeps (kvlab.engine.tiers.store.TierStore; docs/engine.md).

One suite, parametrised over every medium in ``STORES`` (a new medium is tested by registering it): store, then
contains, then load returns the very bytes stored (any dtype, every bit), overwrite, remove, a missing key's
``TierReadError(ENOENT)``, stats, close releasing memory and files. Then media are chosen by name: the engine
built with named stores gives the default's numbers, and a bad name is refused before any work.
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
from kvlab.engine.tiers import (
    STORES,
    StoreSpec,
    TierDir,
    TierReadError,
    TierStore,
    attach_tiers,
    default_stores,
    make_store,
)
from kvlab.errors import ConfigError
from kvlab.tiers import Tier
from kvlab.workload.workload import from_lists

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def spec(tmp_path: Path, medium: str, dtype: torch.dtype = torch.float32, chunk: int = 2) -> StoreSpec:
    """A tiny tier: 2 layers, 2 KV heads, head_dim 4, 4-token blocks; 8 slots of ``chunk`` blocks."""
    return StoreSpec("t", KVLayout(2, 2, 4, 4, dtype), chunk, 8,
                     directory=tmp_path if STORES[medium].needs_dir else None)


def chunk_of(store: TierStore, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A chunk of random bits (NaN and denormal patterns included): only a bytewise copy returns it."""
    n = int(np.prod(store.shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).view(store.shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@pytest.fixture(params=sorted(STORES))
def medium(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_contains_load_remove(tmp_path, medium, dtype):
    store = make_store(medium, spec(tmp_path, medium, DTYPES[dtype]))
    assert isinstance(store, TierStore) and store.kind == medium
    x, y = chunk_of(store, DTYPES[dtype], 1), chunk_of(store, DTYPES[dtype], 2)
    assert not store.contains(3)
    store.store(3, x)
    store.store(5, y)
    assert store.contains(3) and store.contains(5)
    got = store.load(3)
    assert same_bytes(got, x)
    store.release(got)
    store.store(3, y)  # overwritten: the new bytes
    got = store.load(3)
    assert same_bytes(got, y)
    store.release(got)
    assert store.remove(3) is True
    assert not store.contains(3) and store.contains(5)
    assert store.remove(3) is False
    got = store.load(5)  # the other key is untouched
    assert same_bytes(got, y)
    store.release(got)
    store.close()


def test_loaded_chunks_stay_valid_until_released(tmp_path, medium):
    """Two loads held at once (a staged chunk and a load): neither is overwritten by the other."""
    store = make_store(medium, spec(tmp_path, medium))
    x, y = chunk_of(store, torch.float32, 1), chunk_of(store, torch.float32, 2)
    store.store(0, x)
    store.store(1, y)
    a, b = store.load(0), store.load(1)
    assert same_bytes(a, x) and same_bytes(b, y)
    store.release(a)
    c = store.load(0)  # may reuse a's buffer, never b's
    assert same_bytes(b, y) and same_bytes(c, x)
    store.release(b)
    store.release(c)
    store.close()


def test_loading_a_missing_key_is_tier_read_error_enoent(tmp_path, medium):
    store = make_store(medium, spec(tmp_path, medium))
    with pytest.raises(TierReadError) as err:
        store.load(4)
    assert err.value.errno == errno.ENOENT
    store.store(4, chunk_of(store, torch.float32, 0))
    store.remove(4)
    with pytest.raises(TierReadError) as err:
        store.load(4)
    assert err.value.errno == errno.ENOENT
    store.close()


def test_stats_capacity_and_close_releases_everything(tmp_path, medium):
    store = make_store(medium, spec(tmp_path, medium, chunk=2))
    assert store.stats().slots == 0
    cap = store.capacity_blocks
    assert cap is None or (cap > 0 and cap % 2 == 0)
    for k in range(3):
        store.store(k, chunk_of(store, torch.float32, k))
    held = store.stats()
    assert held.slots == 3 and held.bytes >= 3 * 2 * KVLayout(2, 2, 4, 4, torch.float32).bytes_per_block
    store.close()
    assert store.stats().slots == 0 and store.stats().bytes == 0
    assert not any(store.contains(k) for k in range(3))
    assert not os.listdir(tmp_path)  # no file left (a medium without files wrote none)
    store.close()  # idempotent


def test_dram_capacity_is_the_tiers_slots(tmp_path):
    assert make_store("dram", spec(tmp_path, "dram", chunk=2)).capacity_blocks == 16


def test_unknown_medium_and_missing_directory_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="store 'tape' is not one of disk, dram"):
        make_store("tape", spec(tmp_path, "dram"))
    with pytest.raises(ConfigError, match="store 'disk' needs tier_dir"):
        make_store("disk", StoreSpec("t", KVLayout(2, 2, 4, 4, torch.float32), 1, 4))


# ---------------------------------------------------------------------- media chosen by name, in the engine
@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_model("tiny-llama", seed=0)


def workload():
    """Three 33-token stems (4 full blocks of 8) visited twice each, then once more."""
    stems = [np.random.default_rng(100 + s).integers(0, 64, 33).tolist() for s in range(3)]
    order = (0, 1, 2, 0, 1, 2, 0)
    return from_lists([stems[s] + [s] for s in order], arrival=np.arange(7) * 0.5, output_length=np.ones(7, int))


TIERS = [Tier(name="dram", capacity_blocks=4, write="write_back"), Tier(name="ssd", capacity_blocks=32)]
COLS = ["hit_tokens", "hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd"]


def run_with(model, tmp_path: Path, stores: list[str] | None, on_disk: bool = True):
    eng = Engine(model, capacity_blocks=6, block_size=8, num_threads=1)
    eng.tier_io = attach_tiers(eng.cache, eng.pool, TIERS, tier_dir=tmp_path / "t" if on_disk else None,
                               stores=stores)
    res = eng.run(workload(), verify=True)
    eng.tier_io.close()
    return res


def test_default_stores_are_dram_then_disk_with_a_tier_dir():
    assert default_stores(2, True) == ["dram", "disk"] and default_stores(2, False) == ["dram", "dram"]
    assert default_stores(1, True) == ["disk"] and default_stores(0, True) == []


def test_default_stores_follow_each_tiers_medium_by_name():
    from kvlab.tiers.spec import parse_tier

    nvme_first = [parse_tier("ssd:blocks=64:medium=nvme_gen4", "t"), parse_tier("dram:blocks=64:medium=dram_ddr5", "t")]
    assert default_stores(nvme_first, True) == ["disk", "dram"]  # the medium decides, not the position
    assert default_stores(nvme_first, False) == ["dram", "dram"]  # no tier_dir: no disk store
    plain = [parse_tier("dram:blocks=64", "t"), parse_tier("ssd:blocks=64", "t")]
    assert default_stores(plain, True) == ["dram", "disk"] == default_stores(2, True)


def test_media_named_give_the_same_numbers_whatever_the_medium(model, tmp_path):
    """Named media, the default's names and every other choice serve the same hits (the oracle passes)."""
    base = run_with(model, tmp_path, None)
    assert [t["store"] for t in base.summary["tiers"]] == ["dram", "disk"]
    sums = base.requests[COLS].sum()
    assert sums["hit_tokens_dram"] > 0 and sums["hit_tokens_ssd"] > 0 and base.summary["verify_pass_rate"] == 1.0
    for stores in (["dram", "disk"], ["disk", "disk"], ["disk", "dram"]):
        res = run_with(model, tmp_path, stores)
        assert [t["store"] for t in res.summary["tiers"]] == stores
        np.testing.assert_array_equal(res.requests[COLS].to_numpy(), base.requests[COLS].to_numpy())
        assert res.summary["verify_pass_rate"] == 1.0
        assert not (tmp_path / "t").exists()
    res = run_with(model, tmp_path, ["dram", "dram"], on_disk=False)
    np.testing.assert_array_equal(res.requests[COLS].to_numpy(), base.requests[COLS].to_numpy())


@pytest.mark.parametrize(("stores", "on_disk", "message"), [
    (["dram", "tape"], True, "tier 'ssd': store 'tape' is not one of disk, dram"),
    (["dram"], True, r"stores: 1 names \['dram'\] for 2 tiers"),
    (["dram", "disk"], False, "tier 'ssd': store 'disk' needs tier_dir"),
    (["dram", "dram"], True, "tier_dir holds the files of a store like 'disk'"),
])
def test_bad_store_names_are_refused_before_any_work(model, tmp_path, stores, on_disk, message):
    eng = Engine(model, capacity_blocks=6, block_size=8, num_threads=1)
    with pytest.raises(ConfigError, match=message):
        attach_tiers(eng.cache, eng.pool, TIERS, tier_dir=tmp_path / "t" if on_disk else None, stores=stores)
    assert not (tmp_path / "t").exists()  # no directory made
    TierDir(tmp_path / "t").close()  # and none left in use
