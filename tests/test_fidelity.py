"""The real-engine executor, calibration and the engine-vs-simulator fidelity check (docs/simulator.md).

Deterministic: the calibration fit recovers known parameters from step times the cost model generated;
the engine-executed serving run makes the simulator's scheduling and cache decisions (hits, evictions,
preemptions) when they do not depend on timing, and its sampled tokens are the model's greedy ones;
calibrated profiles save, load and label results. Timed (loose bound, a shared machine is noisy): a
small fidelity run of a tiny model. Torch runs one thread.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from _util import tiny_chat

from kvlab.cli import main
from kvlab.engine import Engine, build_random_model
from kvlab.profiles import load_hardware, load_model
from kvlab.results import read_results
from kvlab.sim import CostModel, simulate
from kvlab.sim.calibrate import (
    DEFAULT_GRID,
    QUICK_GRID,
    Calibration,
    fit_cost_model,
    measure_steps,
    predict_seconds,
)
from kvlab.sim.clocks import ThreadClock
from kvlab.sim.engine_executor import engine_model_profile, run_engine_serving
from kvlab.sim.fidelity import fidelity, saturation_throughput, zero_arrivals
from kvlab.workload import from_lists, save_jsonl

VOCAB = 1024  # tiny-llama


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine(build_random_model("tiny-llama", seed=0), capacity_blocks=96, block_size=8, num_threads=1)


def samples_from(points, seconds) -> pd.DataFrame:
    return pd.DataFrame({"entries": [json.dumps([list(e) for e in p]) for p in points], "seconds": seconds})


# ---------------------------------------------------------------------- the fit
@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize(("shape", "grid"), [("cpu-bench", DEFAULT_GRID), ("tiny-llama", QUICK_GRID)])
def test_fit_recovers_known_parameters(shape, grid, execution):
    model = engine_model_profile(build_random_model(shape, device="meta"))
    true = load_hardware("cpu-local").with_overrides(compute_efficiency=0.23, attention_efficiency=0.08,
                                                      memory_efficiency=0.35, step_overhead_s=0.0037,
                                                      prefill_overhead_s=0.0021)
    sizes = sorted({len(p) for p in grid if len(p) > 1})
    if execution == "batched":  # a batch overhead per batch size shows only in packed steps (uneven: 3 > 4)
        true = true.with_overrides(batch_overhead_s=[(s, 0.004 if s == 3 else 0.0013 * s) for s in sizes])
    seconds = predict_seconds(CostModel(model, true), grid, execution)
    fit = fit_cost_model(samples_from(grid, seconds), model, "cpu-local", execution=execution)
    hw = fit.hardware
    assert hw.calibrated and hw.peak_flops == true.peak_flops and hw.memory_bandwidth == true.memory_bandwidth
    for name in ("compute_efficiency", "attention_efficiency", "memory_efficiency", "step_overhead_s",
                 "prefill_overhead_s"):
        assert getattr(hw, name) == pytest.approx(getattr(true, name), rel=0.01), name
    assert [s for s, _ in hw.batch_overhead_s] == ([s for s, _ in true.batch_overhead_s] if execution == "batched"
                                                   else [])
    for (_, fitted), (_, real) in zip(hw.batch_overhead_s, true.batch_overhead_s, strict=False):
        assert fitted == pytest.approx(real, rel=0.01)
    assert fit.stats["max_abs"] < 1e-6 and not fit.notes


def test_fit_raises_peaks_it_exceeds_and_frees_an_invisible_memory_term():
    model = load_model("llama-2-7b")
    base = load_hardware("cpu-local")
    # a machine 3x faster than the nominal peak, whose memory traffic never shows (u_mem = 0)
    fast = base.with_overrides(peak_flops=3 * base.peak_flops, compute_efficiency=0.5, attention_efficiency=0.25,
                               memory_bandwidth=1e15, step_overhead_s=0.002)
    grid = QUICK_GRID
    fit = fit_cost_model(samples_from(grid, predict_seconds(CostModel(model, fast), grid)), model, base)
    assert fit.hardware.peak_flops > base.peak_flops and fit.hardware.memory_bandwidth > base.memory_bandwidth
    assert any("peak_flops raised" in n for n in fit.notes)
    assert fit.stats["max_abs"] < 0.02  # the memory branch no longer binds anywhere


def test_noisy_fit_stays_close():
    model = engine_model_profile(build_random_model("cpu-bench", device="meta"))
    true = load_hardware("cpu-local").with_overrides(compute_efficiency=0.3, attention_efficiency=0.15,
                                                      memory_efficiency=0.5, step_overhead_s=0.01)
    clean = predict_seconds(CostModel(model, true), DEFAULT_GRID)
    noisy = clean * np.random.default_rng(0).lognormal(0.0, 0.03, len(clean))
    fit = fit_cost_model(samples_from(DEFAULT_GRID, noisy), model, "cpu-local")
    assert fit.hardware.compute_efficiency == pytest.approx(0.3, rel=0.1)
    assert fit.hardware.step_overhead_s == pytest.approx(0.01, rel=0.15)
    assert fit.stats["median_abs"] < 0.05


def test_calibrated_profile_saves_loads_and_labels_results(tmp_path):
    model = engine_model_profile(build_random_model("tiny-llama", device="meta"))
    true = load_hardware("cpu-local").with_overrides(compute_efficiency=0.2, step_overhead_s=0.004)
    fit = fit_cost_model(samples_from(QUICK_GRID, predict_seconds(CostModel(model, true), QUICK_GRID)), model,
                         "cpu-local", description="calibrated 2025-01-01 on test-cpu for tiny-llama")
    cal = Calibration(fit, model, {"device": "cpu", "device_name": "test-cpu", "date": "2025-01-01",
                                   "model": model.name})
    path = cal.save(tmp_path / "cal.json")
    hw = load_hardware(path)
    assert hw == fit.hardware and hw.calibrated and hw.name == "cpu-local-cal-tiny-llama"
    assert "test-cpu" in hw.description and "tiny-llama" in hw.description
    assert load_model(tmp_path / "cal.model.json") == model
    report = json.loads((tmp_path / "cal.fit.json").read_text())
    assert report["device_name"] == "test-cpu" and report["residuals"]["n"] == len(QUICK_GRID)
    assert len(report["samples"]) == len(QUICK_GRID) and "residual" in report["samples"][0]
    s = simulate(tiny_chat(20), model=tmp_path / "cal.model.json", hardware=path, capacity_blocks=200).summary
    assert s["calibration"] == "calibrated" and s["cost_model"] == "tiny-llama@cpu-local-cal-tiny-llama"


# ---------------------------------------------------------------------- the executor
@pytest.mark.parametrize(("max_num_seqs", "capacity", "budget"), [(1, 60, 64), (4, 40, 48)])
def test_engine_serving_makes_the_simulators_decisions(engine, max_num_seqs, capacity, budget):
    """All arrivals at t=0: scheduling does not depend on timing, so hits, evictions, preemptions, chunks agree."""
    wl = zero_arrivals(tiny_chat(40, max_output=6))
    kw = dict(capacity_blocks=capacity, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    eng = run_engine_serving(wl, engine, timer="thread", **kw)
    sim = simulate(wl, model=eng.model, hardware="cpu-local", block_size=engine.block_size, fast_forward=False, **kw)
    same = ["request_id", "prompt_tokens", "full_blocks", "hit_blocks", "hit_tokens", "new_blocks", "evictions",
            "orphan_evictions", "admitted", "cached_blocks", "orphan_blocks", "ideal_hit_tokens", "preemptions",
            "readmission_hit_blocks", "computed_prompt_tokens", "prefill_tokens", "computed_tokens", "rejected"]
    pd.testing.assert_frame_equal(eng.requests[same], sim.requests[same])
    assert list(eng.requests.columns) == list(sim.requests.columns)
    assert eng.summary["token_hit_rate"] > 0.2 and eng.summary["evictions"] > 0
    assert (eng.requests["ttft_s"] > 0).all() and (eng.requests["first_token_s"] <= eng.requests["finished_s"]).all()
    ts_cols = ["batch_seqs", "batch_tokens", "prefill_tokens", "decode_tokens", "evictions", "admissions"]
    pd.testing.assert_frame_equal(eng.timeseries[ts_cols], sim.timeseries[ts_cols])
    # teacher forcing: every request sampled its known answer tokens
    for r in range(len(wl)):
        assert eng.generated[r] == wl.output(r)[: wl.output_length[r]].tolist()
    if max_num_seqs > 1:
        assert eng.summary["preemptions"] > 0


def test_engine_serving_samples_the_models_greedy_tokens(engine):
    """Without known outputs the executor samples the argmax; chunked prefill, hits and preemption (recompute)
    must give the tokens of an uncached greedy generation."""
    rng = np.random.default_rng(5)
    doc = rng.integers(0, VOCAB, 40).tolist()
    prompts = [doc + rng.integers(0, VOCAB, k).tolist() for k in (3, 9, 14, 5)]
    wl = from_lists(prompts, output_length=[16, 16, 16, 16])
    res = run_engine_serving(wl, engine, capacity_blocks=12, max_num_seqs=4, max_num_batched_tokens=24)
    assert res.summary["preemptions"] > 0 and res.requests["hit_blocks"].tolist() == [0, 5, 5, 5]
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            gen = engine.model.generate(torch.as_tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert res.generated[r] == gen[0, len(prompt):].tolist(), r


def test_thread_clock_skips_idle_gaps():
    clock = ThreadClock()
    clock.wait_until(5.0)
    assert 5.0 <= clock.now() < 5.5 and not clock.simulated


def test_engine_serving_results_save(engine, tmp_path):
    wl = tiny_chat(12)
    res = run_engine_serving(wl, engine, rate=200.0, max_num_seqs=2, timer="thread")
    run = read_results(res.save(tmp_path / "eng"))
    assert run.manifest["driver"] == "engine-serving" and run.manifest["config"]["engine"]["model_id"]
    assert run.summary["executor"] == "engine" and run.summary["rate"] == pytest.approx(200.0)
    assert set(run.tables) == {"requests", "timeseries"} and len(run.requests) == 12


# ---------------------------------------------------------------------- measured: calibration and fidelity
def test_measure_steps_times_the_grid(engine):
    frame = measure_steps(engine, [((16, 0),), ((1, 32),) * 2], repeats=2, timer="thread")
    assert frame["point"].tolist() == ["16@0", "1@32 x2"] and (frame["seconds"] > 0).all()
    assert frame["batch"].tolist() == [1, 2] and (frame["repeats"] == 2).all()


def test_small_fidelity_run(engine):
    """Calibrate tiny-llama on this CPU, replay a held-out chat trace at 0.5 and 0.8 of saturation.

    Loose bound: timings on a shared two-core machine are noisy (benchmarks/fidelity.py holds the real target).
    """
    wl = tiny_chat(40, seed=11)
    res = fidelity(wl, engine, None, grid=QUICK_GRID, loads=(0.5, 0.8), repeats=2, saturation_repeats=1,
                   timer="thread", capacity_blocks=64, max_num_batched_tokens=128)
    cal = res.calibration  # measured in rounds: before the first run and after every run (1 + 1 + 2 x 2)
    assert cal.hardware.calibrated and cal.fit.stats["median_abs"] < 0.5 and res.config["calibration_rounds"] == 6
    assert res.saturation_rps > 0 and len(res.config["saturation_runs_rps"]) == 1 and len(res.requests) == 2 * len(wl)
    runs = np.stack(res.requests["ttft_engine_runs_s"].to_list())  # every run's TTFT, the median reported
    assert runs.shape == (2 * len(wl), 2)
    np.testing.assert_allclose(np.median(runs, axis=1), res.requests["ttft_engine_s"])
    table = res.table.set_index("load")
    assert table["hits_equal"].all()  # max_num_seqs=1: hits do not depend on timing
    # two repeats: the split halves are the two runs, so their error is the runs' error with each other
    np.testing.assert_allclose(table["engine_split_half_median_error"], table["engine_rerun_median_error"])
    # the simulator cannot agree with the engine better than the engine agrees with itself: when other jobs
    # (or the other pytest worker) make the engine's repeats disagree, the bound widens with them. Loose on
    # purpose (CI shares 2 cores); it still fails when the simulated TTFTs are off by 2x or more.
    bound = np.maximum(1.0, 3 * table["engine_rerun_median_error"])
    assert (table["median_ttft_error"] < bound).all(), res.table.to_dict("records")


def test_saturation_throughput_of_a_run(engine):
    res = run_engine_serving(zero_arrivals(tiny_chat(8)), engine, timer="thread", max_num_seqs=1)
    assert saturation_throughput(res) == pytest.approx(8 / res.requests["finished_s"].max())


# ---------------------------------------------------------------------- command line
def test_cli_calibrate_and_engine_executor(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--engine-model", "tiny-llama", "--quick", "--repeats", "1", "--capacity-blocks", "160",
                 "--out", str(out), "--quiet"]) == 0
    assert load_hardware(out).calibrated and "eta" not in capsys.readouterr().err
    trace = save_jsonl(tiny_chat(10), tmp_path / "chat.jsonl")
    assert main(["simulate", str(trace), "--format", "jsonl", "--executor", "engine", "--engine-model", "tiny-llama",
                 "--capacity-blocks", "100", "--max-num-seqs", "1", "--timer", "thread", "--out",
                 str(tmp_path / "eng"), "--quiet"]) == 0
    run = read_results(tmp_path / "eng")
    assert run.manifest["driver"] == "engine-serving" and len(run.requests) == 10
    assert main(["simulate", str(trace), "--format", "jsonl", "--model", str(tmp_path / "cal.model.json"),
                 "--hardware", str(out), "--capacity-blocks", "100", "--quiet"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("cost_model")][-1]
    assert line.split()[-1] == "tiny-llama@cpu-local-cal-tiny-llama"  # no "/uncalibrated"
