"""The fidelity study: one trace through the real engine and through the simulator, TTFT compared per request.

:func:`fidelity` measures the engine's saturation throughput (every arrival at t = 0, :func:`zero_arrivals`,
:func:`saturation_throughput`), serves the trace at fractions of it on the engine
(:func:`~kvlab.sim.engine_executor.run_engine_serving`) and on the simulator with a profile calibrated on
the same machine in the same states (:mod:`kvlab.sim.calibrate`), and compares the two runs row by row
(:func:`ttft_errors`). It sits on top of both; neither imports it.

The engine executor (torch) is imported on the first call, so that ``import kvlab.sim`` stays torch-free.
Units: seconds, requests/s, tokens, blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile, ModelProfile, load_hardware
from kvlab.sim.calibrate import (
    Calibration,
    calibrate,
    combine_rounds,
    grid_for_limits,
    measure_steps,
    serving_batch_sizes,
)
from kvlab.sim.cost import CostModel
from kvlab.sim.simulator import SimResult, simulate
from kvlab.sim.steps import predict_steps, step_errors, step_noise
from kvlab.workload.workload import Workload

if TYPE_CHECKING:  # torch-backed: imported by fidelity() on first use
    from kvlab.engine.driver import Engine
    from kvlab.sim.engine_executor import EngineServingResult
    from kvlab.tiers import Tier


def zero_arrivals(workload: Workload) -> Workload:
    """The workload with every arrival at t = 0 (a saturation run: the queue holds the whole trace)."""
    return dataclasses.replace(workload, arrival=np.zeros(len(workload)), meta=dict(workload.meta))


def saturation_throughput(result: SimResult) -> float:
    """Requests per second a run with every arrival at 0 sustained: admitted requests / makespan."""
    frame = result.requests
    done = frame[frame["admitted"]]
    span = float(done["finished_s"].max()) if len(done) else math.nan
    return len(done) / span if span > 0 else math.nan


def ttft_errors(engine_requests: pd.DataFrame, sim_requests: pd.DataFrame) -> pd.DataFrame:
    """Per-request TTFT of both runs and the relative error ``|sim - engine| / engine`` (row by row)."""
    if len(engine_requests) != len(sim_requests) or not (
        engine_requests["request_id"].to_numpy() == sim_requests["request_id"].to_numpy()
    ).all():
        raise ConfigError("the two runs must hold the same requests in the same order")
    eng = engine_requests["ttft_s"].to_numpy(np.float64)
    sim = sim_requests["ttft_s"].to_numpy(np.float64)
    return pd.DataFrame({
        "request_id": engine_requests["request_id"].to_numpy(),
        "ttft_engine_s": eng,
        "ttft_sim_s": sim,
        "ttft_rel_error": np.abs(sim - eng) / eng,
        "hit_blocks_engine": engine_requests["hit_blocks"].to_numpy(),
        "hit_blocks_sim": sim_requests["hit_blocks"].to_numpy(),
    })


# ---------------------------------------------------------------------- fidelity: engine vs simulator
@dataclass
class FidelityResult:
    """Engine vs simulator on one trace: one ``table`` row per load, per-request ``requests`` rows
    (``load``, TTFTs, relative error, hits of both), the measured saturation throughput (requests/s), the
    profile the simulator used and, when the study calibrated it, the :class:`Calibration`.

    Step level: ``steps`` holds every step of every engine run at a load (:func:`kvlab.sim.steps.step_frame`
    with ``load``, ``repeat`` and the calibrated cost model's ``predicted_s``); ``step_table`` the cost
    model's error on them per load and step kind (:func:`kvlab.sim.steps.step_errors`), with the engine's
    step-level noise across repeats and the model against each batch's median over them
    (:func:`kvlab.sim.steps.step_noise`)."""

    table: pd.DataFrame
    requests: pd.DataFrame
    saturation_rps: float
    hardware: HardwareProfile
    config: dict
    calibration: Calibration | None = None
    steps: pd.DataFrame | None = None
    step_table: pd.DataFrame | None = None


def fidelity(
    workload: Workload,
    engine: Engine,
    hardware: HardwareProfile | str | Path | None = None,
    *,
    loads: Sequence[float] = (0.5, 0.8),
    repeats: int = 1,
    saturation_repeats: int | None = None,
    timer: str = "wall",
    model: ModelProfile | None = None,
    policy: str = "lru",
    capacity_blocks: int | None = None,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 512,
    cache_at: str = "schedule",
    saturation_rps: float | None = None,
    grid: Sequence | None = None,
    base_hardware: HardwareProfile | str | None = None,
    progress: bool = False,
    batched: bool = False,
    tiers: Sequence[Tier] | None = None,
    tier_dir: str | Path | None = None,
    max_load_tokens: int | None = None,
    sim_options: dict | None = None,
) -> FidelityResult:
    """Replay ``workload`` through the real engine and through the simulator at each load, a fraction of the
    engine's saturation throughput; compare TTFT request by request.

    ``hardware``: a calibrated profile of this device; None calibrates within the study
    (:mod:`kvlab.sim.calibrate`, nominal peaks from ``base_hardware``) over ``grid``, by default
    :func:`~kvlab.sim.calibrate.grid_for_limits` of the configuration (chunks up to the token budget,
    contexts up to the longest sequence: the deployment's ``max_model_len``, not the trace's mix):
    one round of the grid (each batch timed once, shuffled) is measured before the first engine run and
    after every engine run, and the fit uses each batch's median over all rounds — so the calibration sees
    the machine in the same states as the engine runs (other jobs on a shared CPU come and go). The trace
    itself is never used for the fit.

    Saturation (requests/s, unless given) is measured first: the engine serves the trace with every
    arrival at t = 0 (``saturation_repeats`` times, default ``repeats``, the median kept: it sets the load of
    every later run). At load
    ``x`` the arrivals are scaled to the rate ``x × saturation`` for both runs (same scheduler settings,
    pool, policy). The engine run is repeated ``repeats`` times (the loads alternate) and each request's
    engine TTFT is its median over the repeats. Per-request error: ``|TTFT_sim − TTFT_engine| /
    TTFT_engine``; for reference, ``engine_rerun_*_error`` compare the engine's repeats with one another
    (every ordered pair of runs, same formula): the noise floor of one run on this machine, and
    ``engine_split_half_*_error`` compare the median of the odd-numbered repeats with that of the even-numbered
    ones: the noise of a median of ``repeats / 2`` runs, an upper bound for that of the reported median.
    Each request's TTFT in every engine run is kept (``ttft_engine_runs_s``).
    ``max_num_seqs=1`` (default): every step holds one sequence, the setting in which the engine's
    one-sequence-per-forward execution is what the cost model describes; scheduling then does not depend
    on timing, so hits agree exactly (``hits_equal``).

    Step level (free of queueing): every step of the engine runs at the loads is kept with the seconds the
    calibrated cost model gives the same batch (``FidelityResult.steps``, ``step_table``); per load the table
    has ``busy_ratio_*`` (simulated busy seconds / the engine's, per repeat: median, min, max) and
    ``step_busy_ratio_*`` (Σ predicted / Σ measured over each repeat's own steps), and the load the runs
    actually had: ``utilization_engine`` (busy / makespan, median over the repeats) and ``utilization_sim``
    (a nominal load is a fraction of the measured saturation, which drifts with the machine's state).

    ``batched``: the engine runs each step as one packed forward (continuous batching,
    ``run_engine_serving(batched=True)``) and the calibration times packed batches and fits the batched step
    equation (``execution="batched"``): the setting for ``max_num_seqs`` > 1.

    ``tiers`` (:class:`~kvlab.tiers.Tier`): lower tiers below the pool in both runs: the engine's are real
    (``run_engine_serving(tiers=, tier_dir=, max_load_tokens=)``: DRAM, with ``tier_dir`` the last one on disk
    there, fresh for each run), the simulator's timed by each tier's ``medium`` / ``link`` presets (measured
    ones: JSON files). ``sim_options``: further :func:`~kvlab.sim.simulate` fields of the simulated runs
    (``kv_layout``, ``tier_overlap``, ...). With tiers, each ``requests`` row adds the hit tokens per source of
    both runs (``hit_tokens_<device|tier>_engine`` from the first repeat, ``_sim``) and the simulator's
    ``load_est_s_sim`` (admission to load end, queues included) and ``ttft_load_s_sim`` (waiting for loads
    before the first token); each ``table`` row adds per source the hit tokens (engine: median over the
    repeats, with min and max; sim), ``tier_hits_equal`` (every request, every repeat) and
    ``tier_hits_equal_share`` (median over the repeats of the share of requests whose hits agree per source),
    and the load and store seconds per request: engine ``Σ read_s`` / ``Σ write_s`` of its tiers and its time
    outside steps before each step (its scheduling and synchronous tier I/O; waits for arrivals excluded), each
    the median over the repeats; sim ``load_est_s`` and ``ttft_load_s`` means and ``tier_stall_s`` (write-back
    stalls).
    """
    from kvlab.sim.engine_executor import engine_model_profile, run_engine_serving

    saturation_repeats = repeats if saturation_repeats is None else saturation_repeats
    if repeats < 1 or saturation_repeats < 1 or not loads or min(loads) <= 0:
        raise ConfigError("fidelity needs repeats >= 1, saturation_repeats >= 1 and loads > 0")
    model_p = model if model is not None else engine_model_profile(engine)
    execution = "batched" if batched else "sequential"
    rounds: list[pd.DataFrame] = []
    if grid is None:  # the configuration's limits: chunks up to the token budget, contexts up to max_model_len
        longest = int((workload.input_length + np.maximum(workload.output_length, 1)).max())
        grid = grid_for_limits(min(max_num_batched_tokens, int(workload.input_length.max())), longest,
                               serving_batch_sizes(max_num_seqs, batched))
    points = list(grid)

    def measure_round() -> None:
        if hardware is None:
            rounds.append(measure_steps(engine, points, repeats=1, timer=timer, seed=len(rounds),
                                        warmup=0 if rounds else 2, execution=execution))

    common = dict(policy=policy, capacity_blocks=capacity_blocks or engine.capacity_blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, cache_at=cache_at)
    serve = dict(common, timer=timer, model=model_p, progress=progress, batched=batched)
    sim_tiers: dict = {}
    if tiers:  # (no tier arguments otherwise: the untiered study's calls stay as they were)
        serve.update(tiers=list(tiers), tier_dir=tier_dir, max_load_tokens=max_load_tokens)
        sim_tiers = dict(sim_options or {}, tiers=list(tiers), max_load_tokens=max_load_tokens)
    elif tier_dir is not None or max_load_tokens is not None or sim_options:
        raise ConfigError("tier_dir, max_load_tokens and sim_options need tiers=[Tier(...)]")
    measure_round()
    saturation_runs: list[float] = []
    if saturation_rps is None:
        for _ in range(saturation_repeats):
            saturation_runs.append(saturation_throughput(run_engine_serving(zero_arrivals(workload), engine,
                                                                            **serve)))
            measure_round()
        saturation_rps = float(np.median(saturation_runs))
    engine_runs: dict[float, list[EngineServingResult]] = {float(load): [] for load in loads}
    for _ in range(repeats):  # loads alternate, so that each sees the machine in the same states
        for load in engine_runs:
            engine_runs[load].append(run_engine_serving(workload, engine, rate=load * saturation_rps, **serve))
            measure_round()
    cal = None
    if hardware is None:
        cal = calibrate(engine, base_hardware=base_hardware, timer=timer, model=model_p,
                        samples=combine_rounds(rounds), execution=execution)
        hw = cal.hardware
    else:
        hw = load_hardware(hardware)
    cost = CostModel(model_p, hw)
    steps = pd.concat([  # loads and repeats are never empty
        _labelled(predict_steps(r.steps, cost), load, i) for load, runs in engine_runs.items()
        for i, r in enumerate(runs)], ignore_index=True)
    rows, per_request = [], []
    for load, runs in engine_runs.items():
        rate = float(load) * saturation_rps
        sim = simulate(workload, rate=rate, model=model_p, hardware=hw, block_size=engine.block_size, **common,
                       **sim_tiers)
        eng_req = runs[0].requests.copy()
        ttfts = np.stack([r.requests["ttft_s"].to_numpy(np.float64) for r in runs])
        eng_req["ttft_s"] = np.median(ttfts, axis=0)
        err = ttft_errors(eng_req, sim.requests)
        err.insert(0, "load", float(load))
        err["arrival_s"] = sim.requests["arrival"].to_numpy()
        err["prompt_tokens"] = sim.requests["prompt_tokens"].to_numpy()
        err["ttft_engine_spread"] = (ttfts.max(axis=0) - ttfts.min(axis=0)) / err["ttft_engine_s"]
        err["ttft_engine_runs_s"] = list(ttfts.T)
        per_request.append(err)
        e = err["ttft_rel_error"].to_numpy()
        busy = [r.summary["busy_s"] for r in runs]
        rerun = [np.abs(ttfts[i] - ttfts[j]) / ttfts[j] for i in range(repeats) for j in range(repeats) if i != j]
        rerun_e = np.concatenate(rerun) if rerun else np.array([np.nan])
        if repeats >= 2:
            odd, even = np.median(ttfts[1::2], axis=0), np.median(ttfts[0::2], axis=0)
            split_e = np.concatenate([np.abs(odd - even) / even, np.abs(even - odd) / odd])
        else:
            split_e = np.array([np.nan])
        rows.append({
            "load": float(load), "rate_rps": rate, "requests": len(err),
            "median_ttft_error": float(np.median(e)), "p90_ttft_error": float(np.percentile(e, 90)),
            "mean_signed_error": float(np.mean((err["ttft_sim_s"] - err["ttft_engine_s"]) / err["ttft_engine_s"])),
            "ttft_p50_engine_s": float(np.median(err["ttft_engine_s"])),
            "ttft_p50_sim_s": float(np.median(err["ttft_sim_s"])),
            "ttft_p90_engine_s": float(np.percentile(err["ttft_engine_s"], 90)),
            "ttft_p90_sim_s": float(np.percentile(err["ttft_sim_s"], 90)),
            "engine_rerun_median_error": float(np.median(rerun_e)),
            "engine_rerun_p90_error": float(np.percentile(rerun_e, 90)),
            "engine_split_half_median_error": float(np.median(split_e)),
            "engine_split_half_p90_error": float(np.percentile(split_e, 90)),
            "busy_engine_s": float(np.median(busy)), "busy_engine_min_s": float(np.min(busy)),
            "busy_engine_max_s": float(np.max(busy)), "busy_sim_s": float(sim.summary["busy_s"]),
            "makespan_engine_s": float(np.median([r.summary["makespan_s"] for r in runs])),
            "makespan_sim_s": float(sim.summary["makespan_s"]),
            "hits_equal": bool((err["hit_blocks_engine"] == err["hit_blocks_sim"]).all()),
            "token_hit_rate": float(sim.summary["token_hit_rate"]),
            "engine_repeats": repeats,
            "utilization_engine": float(np.median([r.summary["utilization"] for r in runs])),
            "utilization_sim": float(sim.summary["utilization"]),
            **_busy_ratios(float(sim.summary["busy_s"]), busy, steps[steps["load"] == float(load)]),
        })
        if tiers:
            rows[-1].update(_tier_comparison(err, runs, sim, [t.name for t in tiers]))
    config = {"loads": [float(x) for x in loads], "repeats": repeats, "saturation_repeats": saturation_repeats,
              "saturation_runs_rps": saturation_runs,
              **({"tiers": [t.label() for t in tiers], "tier_dir": None if tier_dir is None else str(tier_dir),
                  "max_load_tokens": max_load_tokens, "sim_options": dict(sim_options or {})} if tiers else {}),
              "timer": timer, "hardware": hw.name,
              "model": model_p.name, "block_size": engine.block_size, "calibration_rounds": len(rounds), **common}
    return FidelityResult(pd.DataFrame(rows), pd.concat(per_request, ignore_index=True), float(saturation_rps), hw,
                          config, cal, steps, step_errors(steps, by=("load",)).merge(
                              step_noise(steps, by=("load",)), on=["load", "kind"], how="left"))


def _tier_comparison(err: pd.DataFrame, runs: Sequence[EngineServingResult], sim: SimResult,
                     names: Sequence[str]) -> dict:
    """The tiered study's columns (:func:`fidelity`, ``tiers``): adds the per-request ones to ``err`` in place,
    returns the table row's."""
    sources = ["device", *names]
    cols = [f"hit_tokens_{s}" for s in sources]
    eng = [r.requests[cols].to_numpy(np.int64) for r in runs]
    sim_hits = sim.requests[cols].to_numpy(np.int64)
    for j, src in enumerate(sources):
        err[f"hit_tokens_{src}_engine"] = eng[0][:, j]
        err[f"hit_tokens_{src}_sim"] = sim_hits[:, j]
    err["load_est_s_sim"] = sim.requests["load_est_s"].to_numpy(np.float64)
    err["ttft_load_s_sim"] = sim.requests["ttft_load_s"].to_numpy(np.float64)
    n = len(err)
    agree = [(e == sim_hits).all(axis=1) for e in eng]
    row: dict = {"tier_hits_equal": bool(all(a.all() for a in agree)),
                 "tier_hits_equal_share": float(np.median([a.mean() for a in agree]))}
    for j, src in enumerate(sources):
        totals = [int(e[:, j].sum()) for e in eng]
        row |= {f"hit_tokens_{src}_engine": float(np.median(totals)), f"hit_tokens_{src}_engine_min": min(totals),
                f"hit_tokens_{src}_engine_max": max(totals), f"hit_tokens_{src}_sim": int(sim_hits[:, j].sum())}
    read = [sum(t["read_s"] for t in r.summary["tiers"]) for r in runs]
    between = [_outside_steps(r.timeseries, r.requests["arrival"].to_numpy(np.float64)) for r in runs]
    write = [sum(t["write_s"] for t in r.summary["tiers"]) for r in runs]
    row |= {
        "load_s_per_request_engine": float(np.median(read)) / n,
        "store_s_per_request_engine": float(np.median(write)) / n,
        "outside_steps_s_per_request_engine": float(np.median(between)) / n,
        "tier_read_errors_engine": int(sum(t["read_errors"] for r in runs for t in r.summary["tiers"])),
        "tier_write_errors_engine": int(sum(t["write_errors"] for r in runs for t in r.summary["tiers"])),
        "load_s_per_request_sim": float(err["load_est_s_sim"].mean()),
        "ttft_load_s_per_request_sim": float(err["ttft_load_s_sim"].mean()),
        "stall_s_per_request_sim": float(sim.summary["tier_stall_s"]) / n,
    }
    return row


def _outside_steps(timeseries: pd.DataFrame, arrivals: np.ndarray) -> float:
    """Seconds a real run spent before its steps outside them: before each step, from the later of the previous
    step's end and the last arrival before the step, to the step's start (its scheduling and, with tiers, the
    synchronous loads and write-backs of the admissions; waits for arrivals excluded)."""
    start = timeseries["time_s"].to_numpy(np.float64)
    end = start + timeseries["duration_s"].to_numpy(np.float64)
    arrived = np.sort(arrivals[np.isfinite(arrivals)])
    last = arrived[np.maximum(np.searchsorted(arrived, start, side="right") - 1, 0)]
    ready = np.maximum(np.concatenate(([-np.inf], end[:-1])), last)
    return float(np.clip(start - ready, 0.0, None).sum())


def _labelled(frame: pd.DataFrame, load: float, repeat: int) -> pd.DataFrame:
    """``frame`` with ``load`` and ``repeat`` as its first columns."""
    out = frame.copy()
    out.insert(0, "repeat", repeat)
    out.insert(0, "load", float(load))
    return out


def _busy_ratios(busy_sim: float, busy_engine: Sequence[float], steps: pd.DataFrame) -> dict:
    """Simulated busy seconds / each engine repeat's, and Σ predicted / Σ measured over each repeat's steps:
    median, min and max over the repeats."""
    ratio = busy_sim / np.asarray(busy_engine, dtype=np.float64)
    sums = steps.groupby("repeat")[["predicted_s", "seconds"]].sum()
    step_ratio = (sums["predicted_s"] / sums["seconds"]).to_numpy()
    out = {}
    for name, x in (("busy_ratio", ratio), ("step_busy_ratio", step_ratio)):
        out |= {f"{name}_median": float(np.median(x)), f"{name}_min": float(np.min(x)),
                f"{name}_max": float(np.max(x))}
    return out
