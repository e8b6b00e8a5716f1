"""One vocabulary: every name the drivers write (summary.json keys, requests.parquet and timeseries.parquet
columns) is defined once in kvlab.metrics (METRICS, COLUMNS, TIMESERIES), with the drivers that write it, and
docs/metrics.md shows exactly those tables.

Each driver runs once on a small token workload with every option that adds names (replay ``verify=True``,
and again with two lower tiers and a model; simulator ``instances=2``, and again with two timed lower tiers;
engine ``verify=True`` with adapters and decode; the engine and engine serving again with a DRAM and a disk
tier), so the names it writes must be exactly the table entries
that list it, minus :data:`NOT_RUN` (names only an option these CPU tests cannot take produces). A written
name belongs to a table entry by
:func:`kvlab.metrics.table_name` (``hit_tokens_dram`` to ``hit_tokens_<tier>``); the fields of summary.json's
``tiers`` entries are the ``summary.json tiers[]`` table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.engine import AdapterSet, Engine, build_random_model
from kvlab.metrics import (
    COLUMNS,
    DRIVERS,
    METRICS,
    TABLES,
    TIER_FIELDS,
    TIMESERIES,
    UNITS,
    metrics_markdown,
    table_name,
)
from kvlab.names import ALIASES, DRIVER_ALIASES
from kvlab.replay import replay
from kvlab.sim import simulate
from kvlab.sim.engine_executor import run_engine_serving
from kvlab.tiers import Tier
from kvlab.workload.workload import Workload, from_lists

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

#: (table, name) -> why no run here produces it
NOT_RUN = {
    ("summary.json", "peak_device_memory_bytes"): "engine on CUDA only",
}


def workload(n: int = 10, *, adapters: bool = False) -> Workload:
    """``n`` prompts (tokens < 64) sharing two stems, with every label column the drivers copy."""
    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 64, 24).tolist(), rng.integers(0, 64, 17).tolist()]
    prompts = [stems[i % 2] + rng.integers(0, 64, int(rng.integers(1, 9))).tolist() for i in range(n)]
    labels = dict(session=np.arange(n) // 3, turn=np.arange(n) % 3 + 1, tenant=["a", "b"] * (n // 2),
                  category=["chat"] * n)
    if adapters:
        labels["adapter"] = ["lora-a", "lora-b"] * (n // 2)
    return from_lists(prompts, arrival=np.arange(n) * 0.5, output_length=np.full(n, 3), **labels)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_model("tiny-llama", seed=0)


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """driver -> table file -> the names the driver wrote there."""
    rep = replay(workload(), capacity_blocks=8, block_size=8, backend="python", verify=True)
    tiered = replay(workload(), capacity_blocks=8, block_size=8, backend="python", model="llama-3-8b",
                    max_load_tokens=64, tiers=[Tier(name="dram", capacity_blocks=16, write="write_back"),
                                               Tier(name="ssd", capacity_blocks=64, write="write_through_selective")])
    sim = simulate(workload(), capacity_blocks=24, block_size=8, instances=2, router="round_robin")
    sim_tiered = simulate(workload(), capacity_blocks=8, block_size=8, max_load_tokens=64,
                          tiers=[Tier(name="dram", capacity_blocks=16, write="write_back", link="pcie5_x16"),
                                 Tier(name="ssd", capacity_blocks=64, medium="nvme_gen4", link="pcie5_x16")])
    adapters = AdapterSet(model, ("lora-a", "lora-b"), seed=0)
    try:
        eng = Engine(model, num_blocks=16, block_size=8, adapters=adapters, num_threads=1).run(
            workload(adapters=True), verify=True, verify_tokens=2, output_tokens="workload")
    finally:
        adapters.remove()
    srv = run_engine_serving(workload(), Engine(model, num_blocks=24, block_size=8, num_threads=1), timer="thread",
                             max_num_seqs=2, warmup=0, batched=True, verify=True)
    eng_tiers = [Tier(name="dram", capacity_blocks=8, write="write_back"), Tier(name="ssd", capacity_blocks=32)]
    eng_tiered = Engine(model, num_blocks=8, block_size=8, num_threads=1, tiers=eng_tiers,
                        tier_dir=tmp_path_factory.mktemp("tiers")).run(workload())
    srv_tiered = run_engine_serving(workload(), Engine(model, num_blocks=24, block_size=8, num_threads=1),
                                    capacity_blocks=10, timer="thread", max_num_seqs=2, warmup=0, tiers=eng_tiers,
                                    tier_dir=tmp_path_factory.mktemp("tiers"))
    out = {}
    for driver, res in zip(DRIVERS, (rep, sim, eng, srv), strict=True):
        files = {"summary.json": set(res.summary), "requests.parquet": set(res.requests.columns)}
        if hasattr(res, "timeseries"):
            files["timeseries.parquet"] = set(res.timeseries.columns)
        out[driver] = files
    out["replay"]["summary.json"] |= set(tiered.summary)
    out["replay"]["requests.parquet"] |= set(tiered.requests.columns)
    out["replay"]["summary.json tiers[]"] = {k for t in tiered.summary["tiers"] for k in t}
    for file, names in (("summary.json", sim_tiered.summary), ("requests.parquet", sim_tiered.requests.columns),
                        ("timeseries.parquet", sim_tiered.timeseries.columns)):
        out["simulator"][file] |= set(names)
    out["simulator"]["summary.json tiers[]"] = {k for t in sim_tiered.summary["tiers"] for k in t}
    for driver, res in (("engine", eng_tiered), ("engine-serving", srv_tiered)):  # the engine's real tiers
        out[driver]["summary.json"] |= set(res.summary)
        out[driver]["requests.parquet"] |= set(res.requests.columns)
        out[driver]["summary.json tiers[]"] = {k for t in res.summary["tiers"] for k in t}
    return {driver: {file: {table_name(n, TABLES[file]) or n for n in names} for file, names in files.items()}
            for driver, files in out.items()}


def test_tables_are_well_formed():
    for table in TABLES.values():
        for name, m in table.items():
            assert m.name == name and name.strip() == name and name
            assert m.unit in UNITS, (name, m.unit)
            assert m.drivers and set(m.drivers) <= set(DRIVERS) and len(set(m.drivers)) == len(m.drivers), name
            assert m.definition and "\n" not in m.definition and m.definition == m.definition.strip(), name
    assert {d for m in TIMESERIES.values() for d in m.drivers} == {"simulator", "engine-serving"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_name_a_driver_writes_is_in_the_tables_with_that_driver(outputs, driver):
    for file, table in TABLES.items():
        written = outputs[driver].get(file, set())
        unknown = written - set(table)
        assert not unknown, f"{driver} writes {sorted(unknown)} in {file}: add them to kvlab.metrics"
        listed = {name for name, m in table.items() if driver in m.drivers}
        assert written <= listed, f"{file}: {driver} missing from the drivers of {sorted(written - listed)}"
        missing = listed - written - {name for f, name in NOT_RUN if f == file}
        assert not missing, f"{file}: the table says {driver} writes {sorted(missing)}, it did not"


def test_no_name_is_unproduced(outputs):
    for file, table in TABLES.items():
        written = set().union(*(outputs[d].get(file, set()) for d in DRIVERS))
        assert set(table) == written | {name for f, name in NOT_RUN if f == file}, file
    assert all(name in TABLES[f] for f, name in NOT_RUN)


def test_tiered_replay_names(outputs):
    """A tiered replay writes a column per tier (by the pattern entry), the device's column, the summary's
    ``device_token_hit_rate`` and ``tiers``, and every field of each tiers[] entry, bytes included."""
    rep = replay(workload(), capacity_blocks=8, block_size=8, backend="python", model="llama-3-8b",
                 tiers=[Tier(name="dram", capacity_blocks=16), Tier(name="ssd2", capacity_blocks=64)])
    assert {"hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd2"} <= set(rep.requests.columns)
    assert table_name("hit_tokens_ssd2", COLUMNS) == "hit_tokens_<tier>"
    assert table_name("hit_tokens_device", COLUMNS) == "hit_tokens_device" and table_name("nope", COLUMNS) is None
    assert {"device_token_hit_rate", "tiers"} <= set(rep.summary) <= set(METRICS)
    for entry in rep.summary["tiers"]:
        assert list(entry) == [name for name, m in TIER_FIELDS.items() if "replay" in m.drivers]
        assert entry["bytes_written"] is not None
    shares = rep.summary["device_token_hit_rate"] + sum(t["hit_share"] for t in rep.summary["tiers"])
    assert shares == pytest.approx(rep.summary["token_hit_rate"])


def test_no_current_name_is_an_old_name(outputs):
    for table in TABLES.values():
        assert not set(table) & set(ALIASES), sorted(set(table) & set(ALIASES))
    for driver, files in outputs.items():
        for written in files.values():
            assert not written & set(ALIASES), (driver, sorted(written & set(ALIASES)))
    # every rename leads to a name of the vocabulary
    assert set(ALIASES.values()) <= set(METRICS) | set(COLUMNS) | set(TIMESERIES)
    for driver, renames in DRIVER_ALIASES.items():  # a driver's own renames: it writes no old name any more
        assert not set().union(*outputs[driver].values()) & set(renames), driver
        assert set(renames.values()) <= set(METRICS) | set(COLUMNS) | set(TIMESERIES)


def test_one_concept_one_name_across_drivers(outputs):
    """What every driver reports carries the same name everywhere (the engine's TTFT is ``ttft_p50_s``
    as in the simulator; hits, evictions and cache state are summarize's names in all of them)."""
    shared = {"requests", "prompt_tokens", "reused_tokens", "token_hit_rate", "block_hit_rate", "request_hit_rate",
              "mean_request_hit_rate", "evictions", "eviction_rate_per_request", "eviction_rate_per_s",
              "ideal_hit_rate", "ideal_mean_request_hit_rate", "rejected_requests", "orphan_evictions",
              "mean_orphan_blocks", "mean_occupancy", "final_cached_blocks", "capacity_blocks", "block_size", "policy"}
    timed = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "prefill_busy_s", "prefill_throughput",
             "effective_prefill_throughput", "kv_bytes_per_token", "kv_bytes_per_block"}
    for driver in DRIVERS:
        summary = outputs[driver]["summary.json"]
        assert shared <= summary, (driver, sorted(shared - summary))
        if driver != "replay":
            assert timed <= summary, (driver, sorted(timed - summary))
    columns = {"request_id", "arrival", "prompt_tokens", "output_tokens", "full_blocks", "hit_blocks", "hit_tokens",
               "new_blocks", "evictions", "orphan_evictions", "admitted", "cached_blocks", "orphan_blocks",
               "ideal_hit_tokens", "session", "turn", "tenant", "category"}
    for driver in DRIVERS:
        assert columns <= outputs[driver]["requests.parquet"], driver
        if driver != "replay":
            assert {"ttft_s", "tpot_s", "computed_prompt_tokens"} <= outputs[driver]["requests.parquet"], driver
    tiers_only = {name for name, m in TIMESERIES.items() if m.drivers == ("simulator",)}  # no tiers in the engine
    assert outputs["simulator"]["timeseries.parquet"] - {"instance"} - tiers_only <= outputs["engine-serving"][
        "timeseries.parquet"]


def test_docs_table_matches_the_vocabulary():
    text = DOC.read_text()
    begin, end = "<!-- metric names: begin -->\n", "<!-- metric names: end -->"
    assert begin in text and end in text
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table.strip() == metrics_markdown().strip(), (
        "docs/metrics.md is stale: paste the output of "
        "python -c 'from kvlab.metrics import metrics_markdown; print(metrics_markdown())'")
