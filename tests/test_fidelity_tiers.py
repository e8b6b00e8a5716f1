"""The tiered fidelity study (benchmarks/fidelity_tiers.py, ``fidelity(tiers=...)``): pieces run end to end.

Deterministic: a tiered engine run and the simulator make the same tier decisions (hit tokens per source,
request by request) where the schedule does not depend on timing: every arrival at 0 with ``max_num_seqs=1``
and untimed simulated tiers (a timed simulated load makes the request wait while the next one runs, which the
engine's synchronous loads never do), and, with timed tiers, arrivals far enough apart that no simulated
request overtakes another. Timed
(loose bounds only: the real targets are the benchmark's): the quick benchmark with tiny-llama.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab.engine import Engine, build_random_model
from kvlab.results import read_results
from kvlab.sim import simulate
from kvlab.sim.engine_executor import run_engine_serving
from kvlab.sim.fidelity import fidelity, zero_arrivals
from kvlab.tiers.timing import preset_file
from kvlab.workload import synthetic_chat

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024  # tiny-llama
SOURCES = ["hit_tokens_device", "hit_tokens_dram", "hit_tokens_ssd"]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/fidelity_tiers.py as a module (it puts benchmarks/ on sys.path for its sibling fidelity.py)."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("kvlab_fidelity_tiers", ROOT / "benchmarks" / "fidelity_tiers.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
    return mod


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine(build_random_model("tiny-llama", seed=0), capacity_blocks=96, block_size=8, num_threads=1)


def chat(n: int, seed: int = 3):
    """A multi-turn chat trace in tiny-llama's vocabulary whose prefixes outlive a small device pool."""
    wl = synthetic_chat(n, seed=seed, n_tenants=2, system_tokens=(16, 48), n_docs=6, doc_tokens=(40, 120),
                        user_median=12, answer_median=10, vocab_size=VOCAB, vocab_offset=8)
    return dataclasses.replace(wl, output_length=np.minimum(wl.output_length, 2))


def presets(bench, engine, tmp_path):  # noqa: ANN001, ANN201
    measured = bench.measure_presets(tmp_path / "measure", engine.layout, chunks=(1, 2), ops=3)
    return bench.save_presets(measured["presets"], tmp_path / "run")


def test_measured_presets_load_as_simulator_presets(bench, engine, tmp_path):
    (tmp_path / "measure").mkdir()
    paths = presets(bench, engine, tmp_path)
    assert set(paths) == {"disk_warm", "disk_cold", "memcpy"}
    for name, path in paths.items():
        p = preset_file(path)
        assert p.name == name and p.calibrated and p.bandwidth > 0 and p.latency_s >= 0
        assert p.kind == ("link" if name == "memcpy" else "medium")
    assert not list((tmp_path / "measure").iterdir())  # measure_disk removed its files


def test_tier_hits_agree_when_the_schedule_does_not_depend_on_timing(bench, engine, tmp_path):
    (tmp_path / "measure").mkdir()
    paths = presets(bench, engine, tmp_path)
    kw = dict(capacity_blocks=20, max_num_seqs=1, max_num_batched_tokens=128)
    # every arrival at 0, one sequence per step: untimed simulated tiers make the engine's decisions
    wl = zero_arrivals(chat(24))
    eng = run_engine_serving(wl, engine, timer="wall", tiers=bench.make_tiers(12, 512), tier_dir=tmp_path / "t1",
                             **kw)
    sim = simulate(wl, model=eng.model, hardware="cpu-local", block_size=engine.block_size,
                   tiers=bench.make_tiers(12, 512), **kw)
    pd.testing.assert_frame_equal(eng.requests[["hit_blocks", *SOURCES]], sim.requests[["hit_blocks", *SOURCES]])
    assert (eng.requests[SOURCES[1:]].sum() > 0).all(), "the trace must hit in DRAM and on disk"
    assert not (tmp_path / "t1").exists()  # the run's tier directory is gone with its files
    # arrivals 0.2 s apart: no simulated request waits for a load while another runs, so timed tiers (the
    # measured presets) make them too (the engine's order is its arrivals' at max_num_seqs=1, queued or not)
    spaced = chat(10)
    spaced = dataclasses.replace(spaced, arrival=np.arange(len(spaced)) * 0.2, meta=dict(spaced.meta))
    timed = bench.make_tiers(12, 512, paths["disk_warm"], paths["memcpy"])
    eng = run_engine_serving(spaced, engine, timer="wall", tiers=timed, tier_dir=tmp_path / "t2", **kw)
    sim = simulate(spaced, model=eng.model, hardware="cpu-local", block_size=engine.block_size, tiers=timed,
                   kv_layout="block", **kw)
    first = sim.requests["first_token_s"].dropna().to_numpy()
    assert (np.diff(first) > 0).all()  # no simulated request overtook another (the engine's never do: one runs)
    pd.testing.assert_frame_equal(eng.requests[SOURCES], sim.requests[SOURCES])
    assert (sim.requests["load_est_s"] >= 0).all() and sim.summary["loaded_bytes"] > 0


def test_fidelity_passes_tiers_to_both_runs_and_keeps_the_untiered_study(engine, tmp_path):
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match="need tiers"):
        fidelity(chat(4), engine, "cpu-local", tier_dir=tmp_path / "t")


def test_quick_benchmark_runs_end_to_end(bench, tmp_path, capsys):
    out = tmp_path / "res" / "run"
    rc = bench.main(["--quick", "--shape", "tiny-llama", "--requests", "10", "--length-scale", "0.3",
                     "--block-size", "8", "--capacity-blocks", "24", "--dram-blocks", "6", "--engine-blocks", "200",
                     "--max-batched-tokens", "128", "--tier-root", str(tmp_path), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hit tokens per source" in text and "sensitivity" in text and "load average" in text
    run = read_results(out)
    frames, summary, manifest = run.tables, run.summary, run.manifest
    assert manifest["driver"] == "fidelity-tiers"
    table = frames["table"].set_index("load")
    assert list(table.index) == [0.5, 0.8] and (table["engine_repeats"] == 2).all()
    assert (table["tier_read_errors_engine"] == 0).all() and (table["tier_write_errors_engine"] == 0).all()
    assert (table["hit_tokens_dram_engine"] > 0).all() and (table["hit_tokens_ssd_engine"] > 0).all()
    assert (table["load_s_per_request_engine"] > 0).all() and (table["load_s_per_request_sim"] > 0).all()
    assert (table["outside_steps_s_per_request_engine"] >= 0).all() and (table["store_s_per_request_engine"] > 0).all()
    # loose: a simulator off by 3x or more fails (the real targets are the benchmark's)
    assert (table["median_ttft_error"] < np.maximum(2.0, 3 * table["engine_rerun_median_error"])).all(), \
        table.to_dict("records")
    req = frames["requests"]
    assert {f"{c}_engine" for c in SOURCES} <= set(req.columns) and "load_est_s_sim" in req.columns
    assert set(frames["sensitivity"]["variant"]) == {"disk_cold", "untimed_tiers"}
    for name in ("disk_warm", "disk_cold", "memcpy", "hardware"):
        assert (out.parent / f"run.{name}.json").is_file()
    assert json.loads((out.parent / "run.disk_warm.json").read_text())["kind"] == "medium"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvlab-fidelity-tiers-")] == []
    assert summary["presets"]["disk_warm"]["calibrated"]
