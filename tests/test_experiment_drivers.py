"""Experiment drivers and transforms (kvlab.experiment.drivers): ``driver: engine`` on a tiny random-weight model,
session resamples (``trace.resample_seed``), the seed axis, the ``analysis:`` section (never part of a run), and
every file of examples/experiments/ planned. Existing run ids are pinned: these features must not move them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from _util import tiny_chat
from test_experiment import experiment_dict, write_trace

from kvlab.errors import ConfigError
from kvlab.experiment import Experiment, drivers, load_experiment, plan, run_experiment
from kvlab.workload.native_jsonl import save_jsonl

REPO = Path(__file__).resolve().parents[1]
#: run ids of test_experiment's experiment (lru, arc x 4, 16, 64 blocks) and of one simulator point, planned by
#: the code before the engine driver, resampling and analysis existed (commit 695289a)
BASE_IDS = ["133d1aa36c21c4a792fb", "9f413064f4bca16dca58", "018ac9e534c889468081", "fef5fdb665475593e4ee",
            "b2df9497bca4a884835a", "6fd435654e7b20556a35"]
SIM_ID = "f473a876390b7693f085"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "conv.jsonl")


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 short chat requests in tiny-llama's vocabulary (a token trace with sessions)."""
    return save_jsonl(tiny_chat(20), tmp_path_factory.mktemp("chat") / "chat.jsonl")


def sim_dict(trace: Path) -> dict:
    return {"name": "s", "trace": {"path": str(trace)}, "cache": {"capacity_blocks": 64, "policy": "arc"},
            "driver": "simulate", "model": "llama-3-8b", "simulate": {"instances": 2, "time_scale": 2.0}}


def engine_dict(chat: Path, **engine: object) -> dict:
    return {"name": "eng", "trace": {"path": str(chat)}, "cache": {"block_size": 16, "capacity_blocks": 24},
            "driver": "engine", "engine": {"time_scale": 0.01, "max_num_seqs": 1, **engine}}


def ids(data: dict) -> list[str]:
    return [p.run_id for p in plan(Experiment(**data))]


# ----------------------------------------------------------------------------- run ids, analysis
def test_existing_run_ids_are_unchanged(trace: Path) -> None:
    assert ids(experiment_dict(trace)) == BASE_IDS
    assert ids(sim_dict(trace)) == [SIM_ID]
    explicit = experiment_dict(trace)
    explicit["trace"] = {**explicit["trace"], "resample_seed": None, "resample_by": "auto"}
    assert ids(explicit) == BASE_IDS
    dumped = Experiment(**explicit).model_dump(mode="json")  # what manifests and table columns record
    assert set(dumped["trace"]) == {"path", "format", "limit"} and "engine" not in dumped and "analysis" not in dumped
    assert Experiment(**explicit).to_dict()["trace"] == dumped["trace"]


def test_analysis_is_recorded_but_not_part_of_a_run(tmp_path: Path, trace: Path) -> None:
    from kvlab.analysis import run_intervals

    analysis = {"warmup_requests": 20, "warmup_seconds": 0.0, "windows": 4, "confidence": 0.9}
    data = {**experiment_dict(trace, name="an"), "analysis": analysis}
    assert Experiment(**data).analysis.warmup_requests == 20
    assert ids(data) == BASE_IDS
    data["sweep"] = {"grid": {"cache.capacity_blocks": [4, 16]}}
    table = run_experiment(Experiment(**data), tmp_path, progress=False)
    assert list(table["analysis.warmup_requests"]) == [20, 20]  # the columns kvlab.analysis.runs reads
    warm = run_intervals(table, folder=tmp_path / "an")
    assert set(warm["warmup_requests"]) == {20} and set(warm["ci_windows"]) == {4}
    with pytest.raises(ConfigError, match=r"analysis.confidence: must be in \(0, 1\), got 1.5"):
        Experiment(**{**data, "analysis": {"confidence": 1.5}})
    with pytest.raises(ConfigError, match="unknown field 'analysis.windows'"):
        Experiment(**{**data, "sweep": {"grid": {"analysis.windows": [5, 10]}}})


# ----------------------------------------------------------------------------- session resamples
def test_resample_seed_gives_deterministic_distinct_replicates(tmp_path: Path, trace: Path) -> None:
    from kvlab.analysis import prefix_groups, resample_sessions

    data = experiment_dict(trace, name="rs")
    data["sweep"] = {"grid": {"trace.resample_seed": [0, 1, 2], "cache.capacity_blocks": [16]}}
    first = ids(data)
    assert len(set(first)) == 3 and not set(first) & set(BASE_IDS)
    drivers._resampled.cache_clear()
    assert ids(data) == first  # drawn again, the same requests
    run = Experiment(**{**data, "trace": {"path": str(trace), "resample_seed": 1}, "sweep": {}})
    base = drivers._workload(str(trace), None, None)
    expected = resample_sessions(base, np.random.default_rng(1), prefix_groups(base))  # no session column: prefixes
    assert drivers.workload_of(run).content_sha256 == expected.content_sha256 != base.content_sha256
    table = run_experiment(Experiment(**data), tmp_path, progress=False)
    assert table["token_hit_rate"].nunique() == 3
    assert list(table["trace.resample_seed"]) == [0, 1, 2]


def test_resample_errors(trace: Path) -> None:
    bad = {**experiment_dict(trace), "trace": {"path": str(trace), "resample_by": "prefix"}}
    with pytest.raises(ConfigError, match="trace.resample_by: 'prefix' applies to a session resample: give "
                                          "trace.resample_seed too"):
        Experiment(**bad)
    bad["trace"]["resample_seed"] = 0
    bad["trace"]["resample_by"] = "session"
    with pytest.raises(ConfigError, match="trace.resample_by: trace .* has no session column; allowed here"):
        plan(Experiment(**bad))


def test_seed_axis_reaches_no_registered_policy(tmp_path: Path, trace: Path) -> None:
    """No registered policy draws random numbers: a seed axis gives new run ids and the same numbers, so
    replicates come from trace.resample_seed."""
    data = experiment_dict(trace, name="seeds")
    data["sweep"] = {"grid": {"cache.policy": ["lru", "arc", "s3fifo"], "seed": [0, 1]}}
    table = run_experiment(Experiment(**data), tmp_path, progress=False)
    assert table["run_id"].is_unique
    for _, group in table.groupby("cache.policy"):
        assert group["token_hit_rate"].nunique() == 1 and group["evictions"].nunique() == 1


# ----------------------------------------------------------------------------- the engine driver
def test_engine_run_matches_the_simulator_and_is_verified(tmp_path: Path, chat: Path) -> None:
    data = engine_dict(chat, verify=True)
    table = run_experiment(Experiment(**data), tmp_path, progress=False)
    assert len(table) == 1 and table["driver"].iloc[0] == "engine" and table["requests"].iloc[0] == 20
    assert table["verify_pass_rate"].iloc[0] == 1.0 and table["verified_requests"].iloc[0] == 20
    run_dir = tmp_path / "eng/runs" / table["run_id"].iloc[0]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["driver"] == "engine-serving" and "not reproducible" in manifest["config"]["reproducible"]
    assert manifest["identity"]["config"]["engine"]["model"] == "tiny-llama"
    # one request at a time: the same scheduler and cache core as the simulator, so the same hits and evictions
    sim = run_experiment(Experiment(**{**data, "name": "sim", "driver": "simulate", "engine": None,
                                       "simulate": {"max_num_seqs": 1, "time_scale": 0.01}}), tmp_path, progress=False)
    import pandas as pd

    eng_rows = pd.read_parquet(run_dir / "requests.parquet")
    sim_rows = pd.read_parquet(tmp_path / "sim/runs" / sim["run_id"].iloc[0] / "requests.parquet")
    assert list(eng_rows["hit_tokens"]) == list(sim_rows["hit_tokens"])
    assert table["evictions"].iloc[0] == sim["evictions"].iloc[0] > 0
    seen: list[str] = []
    run_experiment(Experiment(**data), tmp_path, progress=False, on_run=lambda p, s: seen.append(s))
    assert seen == ["skipped"]


def test_engine_identity_covers_the_engine_section(chat: Path, tmp_path: Path) -> None:
    base = ids(engine_dict(chat))
    changed = [ids(engine_dict(chat, **change))[0] for change in (
        {"verify": True}, {"model_seed": 1}, {"threads": 2}, {"batched": True}, {"dtype": "bfloat16"})]
    assert len({*base, *changed}) == 6
    assert ids({**engine_dict(chat), "analysis": {"warmup_requests": 5}}) == base
    config = {**tiny_chat(1).meta, "model_type": "llama", "vocab_size": 1024, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    custom = ids(engine_dict(chat, model=str(tmp_path / "config.json")))
    assert custom != base
    file = tmp_path / "e.yaml"  # a relative engine.model is read beside the file
    file.write_text(yaml.safe_dump(engine_dict(chat, model="config.json")))
    assert [p.run_id for p in plan(load_experiment(file))] == custom
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ConfigError, match=r"trace: token id \d+ of .* is not below engine.model .*\(100 ids\)"):
        ids(engine_dict(chat, model=str(tmp_path / "config.json")))


@pytest.mark.parametrize(("change", "expected"), [
    ({"driver": "replay"}, "engine: engine fields need driver: engine (driver is 'replay')"),
    ({"model": "llama-3-8b"}, "model: the engine driver's model is engine.model"),
    ({"cache": {"capacity_gib": 1.0}}, "cache.capacity_gib: the engine driver's pool is sized in blocks"),
    ({"cache": {"capacity_blocks": 8, "mode": "ideal"}}, "cache.mode: the engine computes at least one token"),
    ({"engine": {"model": "nope"}}, "engine.model: 'nope' is not a named shape (tiny-llama"),
    ({"engine": {"rate": 2.0, "time_scale": 0.5}}, "engine: give either rate or time_scale, not both"),
    ({"engine": {"threads": 0}}, "engine.threads: must be in [1, 1024], got 0"),
    ({"engine": {"dtype": "int8"}}, "engine.dtype: must be 'float32', 'bfloat16' or 'float16'"),
    ({"sweep": {"grid": {"engine.nope": [1]}}}, "sweep.grid: unknown field 'engine.nope'; engine has model"),
])
def test_engine_errors_name_the_field(tmp_path: Path, chat: Path, change: dict, expected: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump({**engine_dict(chat), **change}))
    with pytest.raises(ConfigError) as info:
        load_experiment(file)
    assert str(info.value).startswith(f"{file}: ") and expected in str(info.value), str(info.value)


def test_engine_needs_a_token_trace(trace: Path) -> None:
    with pytest.raises(ConfigError, match="trace: the engine driver serves token traces; .* holds block hash ids"):
        plan(Experiment(**{**engine_dict(trace), "cache": {"capacity_blocks": 8}}))


# ----------------------------------------------------------------------------- examples
def test_every_example_experiment_plans(shared_file) -> None:  # noqa: ANN001 - the conftest fixture
    shared_file("mooncake/conversation_trace.jsonl")
    shared_file("mooncake/synthetic_trace.jsonl")
    files = sorted((REPO / "examples/experiments").glob("*.yaml"))
    assert {f.name for f in files} >= {"lru_vs_frequency.yaml", "lru_vs_frequency_resampled.yaml", "quickstart.yaml",
                                       "all_policies.yaml", "ttft_vs_load.yaml", "engine_smoke.yaml"}
    for file in files:
        planned = plan(load_experiment(file), str(file))
        assert len({p.run_id for p in planned}) == len(planned), file.name
        stated = re.search(r"= (\d+) (?:replays|simulations|engine runs)", file.read_text())
        assert stated and int(stated.group(1)) == len(planned), f"{file.name}: header run count"
        assert file.read_text().startswith("# ") and f"kvlab run examples/experiments/{file.name}" in file.read_text()
