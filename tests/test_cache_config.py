"""One cache config (kvlab.tiers.config): ReplayConfig, SimConfig and an experiment's cache: section derive from it, the
engine's run config holds one; field names, dump orders and messages stay those recorded before it existed."""

from __future__ import annotations

import pytest

from kvlab.errors import ConfigError
from kvlab.experiment import Experiment
from kvlab.experiment.sections import CacheSpec
from kvlab.replay import ReplayConfig
from kvlab.sim.simulator import SimConfig
from kvlab.tiers import parse_tier
from kvlab.tiers.config import CacheConfig, ReplayCacheConfig

#: each config's fields in the order of its dumps (run identities, manifests, experiment tables), as recorded
ORDERS = {
    ReplayConfig: ("capacity_blocks", "block_size", "policy", "policy_params", "hash", "root_seed", "model_id", "mode",
                   "backend", "verify", "seed", "tiers", "max_load_tokens", "model"),
    SimConfig: ("model", "hardware", "policy", "policy_params", "capacity_blocks", "gpu_memory_utilization",
                "max_num_seqs", "max_num_batched_tokens", "rate", "time_scale", "block_size", "tensor_parallel",
                "dtype", "kv_dtype", "cache_at", "hash", "root_seed", "fast_forward", "instances", "router", "seed",
                "tiers", "max_load_tokens", "load_or_recompute", "tier_overlap", "tier_prefetch",
                "prefetch_timeout_s", "kv_layout", "tier_sync_stores"),
    CacheSpec: ("block_size", "capacity_blocks", "capacity_tokens", "capacity_gib", "policy", "policy_params", "mode",
                "backend", "verify", "tiers", "max_load_tokens"),
}


def test_every_driver_config_derives_from_the_cache_config_in_its_recorded_field_order() -> None:
    assert issubclass(ReplayConfig, ReplayCacheConfig) and issubclass(CacheSpec, ReplayCacheConfig)
    assert issubclass(SimConfig, CacheConfig) and not issubclass(SimConfig, ReplayCacheConfig)
    for cls, order in ORDERS.items():
        assert tuple(cls.model_fields) == order, cls.__name__
        assert set(CacheConfig.model_fields) <= set(order)
    tiers = [parse_tier("dram:blocks=64")]
    assert tuple(ReplayConfig(capacity_blocks=8, tiers=tiers, model="llama-3-8b").model_dump()) == ORDERS[ReplayConfig]
    assert tuple(SimConfig(tiers=tiers, tier_overlap=False).model_dump()) == ORDERS[SimConfig]
    assert tuple(CacheSpec(capacity_blocks=8).model_dump()) == ORDERS[CacheSpec]
    assert tuple(ReplayConfig(capacity_blocks=8).to_dict()) == ORDERS[ReplayConfig][:-3]  # tiers.. left out unset


def test_the_shared_checks_name_the_field_as_each_config_spells_it() -> None:
    with pytest.raises(ConfigError, match=r"^ReplayConfig\.policy \(--policy\): unknown policy 'nope'"):
        ReplayConfig(capacity_blocks=8, policy="nope")
    with pytest.raises(ConfigError, match=r"^SimConfig\.policy_params \(--policy-param\): policy 's3fifo': unknown"):
        SimConfig(policy="s3fifo", policy_params={"zz": 1})
    with pytest.raises(ConfigError, match=r"^SimConfig: max_load_tokens limits .* give tiers too$"):
        SimConfig(max_load_tokens=4)
    with pytest.raises(ConfigError, match=r"^CacheConfig: tiers: tier name 'dram' given twice$"):
        CacheConfig(tiers=[parse_tier("dram:blocks=64"), parse_tier("dram:blocks=64")])
    base = {"name": "x", "trace": {"path": "t.jsonl"}}
    with pytest.raises(ConfigError, match=r"^cache\.capacity_blocks: must be in \[1, 1099511627776\], got 0$"):
        Experiment(**base, cache={"capacity_blocks": 0})
    with pytest.raises(ConfigError, match=r"^cache\.max_load_tokens limits .* give cache\.tiers too$"):
        Experiment(**base, cache={"capacity_blocks": 8, "max_load_tokens": 4})
    with pytest.raises(ConfigError, match=r"^cache: give exactly one of capacity_blocks, capacity_tokens"):
        Experiment(**base, cache={"capacity_blocks": 8, "capacity_tokens": 64})


def test_the_engine_run_config_holds_a_cache_config_and_dumps_its_fields_flat() -> None:
    pytest.importorskip("torch")
    from kvlab.experiment import drivers
    from kvlab.workload.workload import from_lists

    workload = from_lists([[1, 2, 3, 4, 5], [1, 2, 3, 6]], arrival=[0.0, 0.5], output_length=[2, 2])
    run = Experiment(name="x", trace={"path": "t.jsonl"}, driver="engine",
                     cache={"capacity_blocks": 4, "block_size": 2, "tiers": [{"name": "dram", "capacity_blocks": 8}]})
    config = drivers.driver_config(run, workload)
    assert isinstance(config.cache, CacheConfig) and config.cache.policy_params == {}
    out = config.to_dict()
    assert tuple(out) == ("engine", "model_config", "policy", "policy_params", "capacity_blocks", "block_size", "hash",
                          "root_seed", "seed", "tiers", "max_load_tokens")
    assert (out["capacity_blocks"], out["block_size"], out["max_load_tokens"]) == (4, 2, None)
    assert out["tiers"] == [{"name": "dram", "capacity_blocks": 8, "policy": "lru", "policy_params": {},
                             "write": "write_through", "selective_hits": 1, "inclusion": "none", "chunk_blocks": 1,
                             "touch": True}]  # unset options (capacity_gib, link, medium...) left out
