"""Step-level records of engine serving runs and the cost model's error on them (kvlab.sim.steps).

The engine executor records every step it times; the totals must match the run's (busy seconds, computed
tokens, steps); the prediction of a recorded step is the cost model's step time of the same batch, the one
the simulator uses; the fidelity study reports the per-kind error table and busy-time ratios. Tiny model,
one torch thread, thread-CPU timer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from _util import tiny_chat

from kvlab.engine import Engine, build_random_model
from kvlab.profiles import load_hardware
from kvlab.sim import CostModel, simulate
from kvlab.sim.calibrate import QUICK_GRID
from kvlab.sim.engine_executor import run_engine_serving
from kvlab.sim.fidelity import fidelity, zero_arrivals
from kvlab.sim.simulator import CostModelExecutor
from kvlab.sim.steps import (
    ERROR_COLUMNS,
    NOISE_COLUMNS,
    STEP_COLUMNS,
    batch_entries,
    step_errors,
    step_frame,
    step_kind,
    step_noise,
)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine(build_random_model("tiny-llama", seed=0), capacity_blocks=96, block_size=8, num_threads=1)


def test_step_kinds_and_frame_columns():
    assert step_kind([(16, 0)]) == "prefill" and step_kind([(1, 0)]) == "prefill"  # a first token is a prefill
    assert step_kind([(1, 5), (1, 9)]) == "decode" and step_kind([(8, 4), (1, 9)]) == "mixed"
    frame = step_frame([(((8, 4), (1, 9)), 0.01), (((1, 3),), 0.002)])
    assert list(frame.columns) == STEP_COLUMNS and frame["step"].tolist() == [0, 1]
    first = frame.iloc[0]
    assert (first["entries"], first["new_tokens"], first["prefill_tokens"], first["decode_tokens"]) == (2, 9, 8, 1)
    assert (first["cached_tokens"], first["context_tokens"]) == (13, 22)
    assert first["attention_pairs"] == 8 * 4 + 36 + 10  # Σ_j (c + j)
    assert batch_entries(frame) == [[(8, 4), (1, 9)], [(1, 3)]]


@pytest.mark.parametrize(("max_num_seqs", "budget", "batched"), [(1, 64, False), (4, 48, False), (4, 48, True)])
def test_engine_steps_are_recorded_with_consistent_totals(engine, max_num_seqs, budget, batched):
    """Per-entry forwards and packed ones (continuous batching) record their steps alike."""
    wl = tiny_chat(24, max_output=6)
    res = run_engine_serving(wl, engine, rate=100.0, timer="thread", capacity_blocks=60, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=budget, batched=batched)
    steps = res.steps
    assert list(steps.columns) == STEP_COLUMNS and len(steps) == int(res.timeseries["num_steps"].sum())
    assert steps["seconds"].sum() == pytest.approx(res.summary["busy_s"], rel=1e-12)
    assert (steps["seconds"] > 0).all() and steps["step"].tolist() == list(range(len(steps)))
    assert steps["new_tokens"].sum() == res.requests["computed_tokens"].sum()
    assert (steps["prefill_tokens"] + steps["decode_tokens"] == steps["new_tokens"]).all()
    assert (steps["entries"].to_numpy() <= max_num_seqs).all()
    np.testing.assert_array_equal(steps["new_tokens"], res.timeseries["batch_tokens"])
    # the clock's step (timeseries) holds the executor's timed step plus the scheduler's own work
    assert (steps["seconds"].to_numpy() <= res.timeseries["duration_s"].to_numpy()).all()
    kinds = set(steps["kind"])
    assert {"prefill", "decode"} <= kinds and (max_num_seqs == 1) == ("mixed" not in kinds)


def test_prediction_is_the_cost_models_step_time(engine):
    """The prediction of a recorded step is CostModel.duration of its batch: the simulator's executor gives the
    same seconds, and a simulated run of the same batches (all arrivals at 0, one sequence per step: the
    schedule does not depend on timing) steps through exactly those durations."""
    wl = zero_arrivals(tiny_chat(16))
    kw = dict(capacity_blocks=60, max_num_seqs=1, max_num_batched_tokens=64)
    eng = run_engine_serving(wl, engine, timer="thread", **kw)
    hw = load_hardware("cpu-local").with_overrides(compute_efficiency=0.3, step_overhead_s=0.004,
                                                   prefill_overhead_s=0.001)
    cost = CostModel(eng.model, hw)
    pred = step_frame([(tuple(e), s) for e, s in zip(batch_entries(eng.steps), eng.steps["seconds"], strict=True)],
                      cost)
    executor = CostModelExecutor(cost)
    for row, entries in zip(pred.itertuples(), batch_entries(pred), strict=True):
        assert row.predicted_s == cost.duration(entries) == executor.execute([(None, n, c) for n, c in entries])
        assert row.signed_error == (row.predicted_s - row.seconds) / row.seconds
    sim = simulate(wl, model=eng.model, hardware=hw, block_size=engine.block_size, fast_forward=False, **kw)
    # the simulated clock's step durations (differences of accumulated times: equal to rounding)
    np.testing.assert_allclose(sim.timeseries["duration_s"], pred["predicted_s"], rtol=1e-12)
    assert sim.summary["busy_s"] == pytest.approx(pred["predicted_s"].sum(), rel=1e-12)


def test_step_errors_table():
    frame = pd.DataFrame({"load": [0.5] * 4 + [0.8] * 2, "kind": ["prefill", "decode", "decode", "mixed",
                                                                   "decode", "decode"],
                          "seconds": [1.0, 2.0, 2.0, 4.0, 1.0, 1.0], "predicted_s": [1.1, 1.8, 2.0, 4.0, 0.5, 1.0]})
    frame["signed_error"] = (frame["predicted_s"] - frame["seconds"]) / frame["seconds"]
    frame["abs_error"] = frame["signed_error"].abs()
    table = step_errors(frame, by=("load",))
    assert list(table.columns) == ["load", *ERROR_COLUMNS]
    assert table[["load", "kind"]].values.tolist() == [[0.5, "prefill"], [0.5, "decode"], [0.5, "mixed"],
                                                        [0.5, "all"], [0.8, "decode"], [0.8, "all"]]
    t = table.set_index(["load", "kind"])
    assert t.loc[(0.5, "decode"), "steps"] == 2 and t.loc[(0.5, "all"), "steps"] == 4
    assert t.loc[(0.5, "decode"), "median_abs_error"] == pytest.approx(0.05)
    assert t.loc[(0.8, "all"), "mean_signed_error"] == pytest.approx(-0.25)
    assert t.loc[(0.5, "all"), "measured_s"] == pytest.approx(9.0)
    assert list(step_errors(frame).columns) == ERROR_COLUMNS


def test_fidelity_reports_steps_and_busy_ratios(engine):
    wl = tiny_chat(16, seed=11)
    res = fidelity(wl, engine, None, grid=QUICK_GRID, loads=(0.5, 0.8), repeats=2, saturation_repeats=1,
                   timer="thread", capacity_blocks=64, max_num_batched_tokens=64)
    steps, table = res.steps, res.table.set_index("load")
    assert set(map(tuple, steps[["load", "repeat"]].drop_duplicates().values)) == {
        (0.5, 0), (0.5, 1), (0.8, 0), (0.8, 1)}
    cost = CostModel(res.calibration.model, res.hardware)
    np.testing.assert_array_equal(steps["predicted_s"], [cost.duration(e) for e in batch_entries(steps)])
    assert ((table["utilization_engine"] > 0) & (table["utilization_engine"] <= 1)).all()
    assert ((table["utilization_sim"] > 0) & (table["utilization_sim"] <= 1)).all()
    st = res.step_table
    assert list(st.columns) == ["load", *ERROR_COLUMNS, *NOISE_COLUMNS[1:]]
    assert set(st["kind"]) >= {"prefill", "decode", "all"}
    for load, part in steps.groupby("load"):
        sums = part.groupby("repeat")[["seconds", "predicted_s"]].sum()
        busy = sums["seconds"].to_numpy()  # each repeat's step seconds are its busy time
        assert table.loc[load, "busy_engine_min_s"] == pytest.approx(busy.min(), rel=1e-9)
        assert table.loc[load, "busy_engine_max_s"] == pytest.approx(busy.max(), rel=1e-9)
        ratio = table.loc[load, "busy_sim_s"] / busy
        assert table.loc[load, "busy_ratio_min"] == pytest.approx(ratio.min())
        assert table.loc[load, "busy_ratio_max"] == pytest.approx(ratio.max())
        step_ratio = (sums["predicted_s"] / sums["seconds"]).to_numpy()
        assert table.loc[load, "step_busy_ratio_median"] == pytest.approx(np.median(step_ratio))
        assert st.set_index(["load", "kind"]).loc[(load, "all"), "steps"] == len(part)


def test_step_noise_against_the_median_over_repeats():
    """Two batches run by three repeats (one repeat ran batch A twice: its own median counts), one batch by one
    repeat only (left out)."""
    a, b, c = "[[16, 0]]", "[[1, 16]]", "[[1, 40]]"
    frame = pd.DataFrame({
        "repeat": [0, 0, 0, 1, 1, 2, 2, 2],
        "batch": [a, a, b, a, b, a, b, c],
        "kind": ["prefill", "prefill", "decode", "prefill", "decode", "prefill", "decode", "decode"],
        "seconds": [1.0, 3.0, 1.0, 2.5, 1.2, 1.5, 0.8, 9.0],
        "predicted_s": [2.2, 2.2, 1.1, 2.2, 1.1, 2.2, 1.1, 9.0]})
    t = step_noise(frame).set_index("kind")
    assert list(step_noise(frame).columns) == NOISE_COLUMNS and t.loc["all", "common_batches"] == 2
    # batch A: repeat medians 2.0, 2.5, 1.5 -> median 2.0; batch B: 1.0, 1.2, 0.8 -> 1.0
    assert t.loc["prefill", "model_mean_signed_error"] == pytest.approx(0.1)
    assert t.loc["decode", "model_median_error"] == pytest.approx(0.1)
    np.testing.assert_allclose(t.loc["all", "engine_median_dev"], 0.2)  # deviations 0, .25, .25, 0, .2, .2
