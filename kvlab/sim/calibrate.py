"""Calibration: fit the cost model's efficiencies and step overhead to step times measured on the real engine.

Procedure (docs/simulator.md, "Calibration"):

1. :func:`measure_steps` times the engine's executor path (:meth:`EngineExecutor.run_entry`) over a grid
   of batches of entries ``(n new tokens, c cached context)`` — prefill chunks after ``c`` hit tokens
   (gathered from the pool), decode steps over a working cache of ``c`` tokens, batches of ``B`` entries —
   each ``repeats`` times in a shuffled order per repeat (drift from other jobs spreads over the grid), and
   keeps the median.
2. :func:`fit_cost_model` fits ``u_lin = 1/(P η_lin)``, ``u_attn = 1/(P η_attn)``, ``u_mem = 1/(M η_mem)``,
   ``t_0``, ``t_prefill`` and (batched execution only) ``b_S``, the batch overhead of a step of ``S >= 2``
   entries at each batch size the grid measures, of the cost model's step equation by least squares on
   relative residuals (each step weighs ``1/t``), all non-negative. A group of work (a step of a batched
   engine, or one forward of the engine's sequential execution, ``execution="sequential"``) costs ::

       max(u_lin (F_lin T + F_head S) + u_attn F_pair A,  u_mem (B_weights + B_kv K)) + t_0 + t_prefill P + b_S

   The maximum makes the problem piecewise linear: each group is assigned to its larger branch, the
   linear problem is solved, groups are re-assigned, until the assignment is stable (several starts, the
   best objective wins).
3. The fitted rates become a :class:`HardwareProfile` (``calibrated=True``): ``η = attained rate / peak``;
   where an attained rate exceeds the base profile's nominal peak (or bandwidth) the peak is raised to it
   (η = 1 there) and the report says so; a rate the data cannot see (fitted ``u = 0``) gets η = 1.

With ``execution="sequential"`` the engine runs one sequence per forward call, so a batch of ``B`` entries
costs the sum of ``B`` one-sequence steps: the calibrated profile describes one-sequence steps (no batch
overhead), and the simulator reproduces the engine where steps hold one sequence
(``max_num_seqs=1``); the report gives the error of the batched equation on the multi-entry samples too. With
``execution="batched"`` each batch is one packed forward and the fit is the batched equation itself.

Units: seconds, FLOPs, bytes, tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile, ModelProfile, load_hardware
from kvlab.sim.cost import CostModel
from kvlab.sim.fit import Point, _features, batch_knots, fit_rates, rates_to_profile

if TYPE_CHECKING:  # torch-backed: the engine modules are imported on first use
    from kvlab.engine.compute import PagedModel

EXECUTIONS = ("sequential", "batched")


# ---------------------------------------------------------------------- grids
def make_grid(
    prefill_tokens: Sequence[int] = (8, 16, 32, 64, 128, 256, 512),
    prefill_contexts: Sequence[int] = (0, 128, 512, 1024),
    decode_contexts: Sequence[int] = (16, 128, 512, 1024, 2048),
    batch_sizes: Sequence[int] = (1, 2, 4),
    mixed: bool = True,
) -> list[Point]:
    """Calibration batches: every prefill (n, c) alone; every decode context at each batch size; with
    ``mixed``, a few batches mixing a prefill chunk with decodes and two prefills (additivity checks)."""
    points: list[Point] = [((n, c),) for n in prefill_tokens for c in prefill_contexts]
    points += [((1, c),) * b for c in decode_contexts for b in batch_sizes]
    if mixed and prefill_tokens and decode_contexts:
        n_mid = sorted(prefill_tokens)[len(prefill_tokens) // 2]
        c_mid = sorted(decode_contexts)[len(decode_contexts) // 2]
        points += [((n_mid, 0), (1, c_mid), (1, c_mid)), ((n_mid, 0), (n_mid, c_mid))]
    return points


def grid_for_limits(max_new_tokens: int, max_context: int, batch_sizes: Sequence[int] = (1, 2, 4)) -> list[Point]:
    """A :func:`make_grid` spanning a serving configuration's step shapes: prefill chunks of 8 tokens up to
    ``max_new_tokens`` (the scheduler's ``max_num_batched_tokens``, or the longest prompt if shorter) in
    powers of two, after 0, 1/8, 1/2 and all of ``max_context`` cached tokens (the longest sequence, the
    deployment's ``max_model_len``); decodes over 16 up to ``max_context`` cached tokens."""
    if max_new_tokens < 1 or max_context < 1:
        raise ConfigError("grid_for_limits needs max_new_tokens and max_context >= 1")
    new = sorted({min(8 * 2**k, max_new_tokens) for k in range(16) if 8 * 2 ** (k - 1) < max_new_tokens})
    contexts = sorted({0, max_context // 8, max_context // 2, max_context})
    decode = sorted({min(16, max_context), max(1, max_context // 8), max(1, max_context // 4),
                     max(1, max_context // 2), max_context})
    return make_grid(new, contexts, decode, batch_sizes)


def serving_batch_sizes(max_num_seqs: int, batched: bool) -> tuple[int, ...]:
    """Batch sizes a calibration grid spans for a serving configuration: with ``batched`` (one packed forward per
    step) 1, 2, 3, 4, 8, 16 up to ``max_num_seqs`` (decode steps of 1-4 sequences are the common ones at
    moderate load, and a CPU BLAS prices 2-4 logit rows unevenly: docs/simulator.md); else 1, 2, 4 (a batch of
    the sequential engine is a sum of one-sequence forwards)."""
    if not batched:
        return (1, 2, 4)
    return tuple(b for b in (1, 2, 3, 4, 8, 16) if b <= max(1, max_num_seqs))


DEFAULT_GRID: list[Point] = make_grid((8, 16, 32, 64, 128, 256, 512), (0, 128, 512, 1024))
QUICK_GRID: list[Point] = make_grid((16, 64, 256), (0, 512), (64, 1024), (1, 3))


def describe_point(point: Point) -> str:
    """``"128@0 + 1@512 x2"``-style label of a batch."""
    parts, i = [], 0
    while i < len(point):
        j = i
        while j < len(point) and point[j] == point[i]:
            j += 1
        n, c = point[i]
        parts.append(f"{n}@{c}" + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return " + ".join(parts)


# ---------------------------------------------------------------------- measurement
def measure_steps(
    engine: PagedModel,
    points: Iterable[Point] = DEFAULT_GRID,
    *,
    repeats: int = 5,
    timer: str = "wall",
    seed: int = 0,
    warmup: int = 2,
    progress: bool = False,
    execution: str = "sequential",
) -> pd.DataFrame:
    """Time each batch ``repeats`` times through the executor's per-entry path (``execution="batched"``: its
    packed path, one forward per batch, as ``EngineExecutor(batched=True)`` serves); one row per batch.

    An entry ``(n, c)`` with ``n == 1`` and ``c > 0`` is a decode step over the working cache a prefill of
    ``c`` tokens left (that prefill untimed, so the cache is built as in serving); any other runs as a
    prefill chunk after ``c`` hit tokens gathered from the
    pool (timed, as in serving). Columns: ``point`` (label), ``entries`` (JSON list), ``batch``,
    ``new_tokens`` / ``context`` (of the first entry), ``seconds`` (median), ``min_s``, ``p90_s``,
    ``spread`` ((p90 − p10) / median), ``repeats``, ``times`` (JSON list of every timing, seconds).
    """
    import torch  # (torch-backed: loaded on the first measurement, so that ``import kvlab.sim`` stays torch-free)
    from tqdm.auto import tqdm

    from kvlab.engine.compute import sync_device
    from kvlab.sim.clocks import gc_paused, timer_function
    from kvlab.sim.engine_executor import EngineExecutor, EngineSequence, warm_up

    points = [tuple((int(n), int(c)) for n, c in p) for p in points]
    if not points or repeats < 1:
        raise ConfigError("measure_steps needs at least one batch and repeats >= 1")
    for p in points:
        if not p or any(n < 1 or c < 0 for n, c in p):
            raise ConfigError(f"bad calibration batch {p}: entries need n >= 1 new tokens and c >= 0")
    if execution not in EXECUTIONS:
        raise ConfigError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
    executor = EngineExecutor(engine, timer=timer, batched=execution == "batched")
    clock = timer_function(timer)
    rng = np.random.default_rng(seed)
    bs, nb, vocab = engine.block_size, engine.capacity_blocks, engine.vocab_size
    if warmup:
        warm_up(engine, warmup)
    times: list[list[float]] = [[] for _ in points]
    bar = tqdm(total=repeats * len(points), disable=not progress, desc="calibrate", unit="step")
    with torch.no_grad(), gc_paused():
        for _ in range(repeats):
            for i in rng.permutation(len(points)).tolist():
                prepared = []
                offset = int(rng.integers(nb))
                for n, c in points[i]:
                    k = -(-(c + n) // bs)
                    ids = [(offset + j) % nb for j in range(k)]
                    offset += k
                    seq = EngineSequence(rng.integers(0, vocab, c + n).tolist(), c + n)
                    if n == 1 and c > 0:  # a decode step: its working cache comes from a prefill, as in serving
                        executor.run_entry(seq, ids, c, 0)
                    prepared.append((seq, ids, n, c))
                sync_device(engine.device)
                t0 = clock()
                if executor.batched:
                    executor.run_packed(prepared)
                else:
                    for seq, ids, n, c in prepared:
                        executor.run_entry(seq, ids, n, c)
                sync_device(engine.device)
                times[i].append(clock() - t0)
                bar.update()
    bar.close()
    return _sample_frame(points, times)


def _sample_frame(points: Sequence[Point], times: Sequence[Sequence[float]]) -> pd.DataFrame:
    rows = []
    for p, ts in zip(points, times, strict=True):
        a = np.asarray(ts, dtype=np.float64)
        med = float(np.median(a))
        p10, p90 = np.percentile(a, [10, 90])
        rows.append({
            "point": describe_point(p), "entries": json.dumps([list(e) for e in p]), "batch": len(p),
            "new_tokens": p[0][0], "context": p[0][1], "seconds": med, "min_s": float(a.min()),
            "p90_s": float(p90), "spread": float((p90 - p10) / med) if med > 0 else 0.0, "repeats": len(a),
            "times": json.dumps([float(x) for x in a]),
        })
    return pd.DataFrame(rows)


def combine_rounds(rounds: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Pool several :func:`measure_steps` frames of the same batches (rounds measured at different times):
    one row per batch, every timing of every round, the median kept."""
    if not rounds:
        raise ConfigError("combine_rounds needs at least one frame")
    entries = list(rounds[0]["entries"])
    for frame in rounds[1:]:
        if list(frame["entries"]) != entries:
            raise ConfigError("combine_rounds: the rounds measured different batches")
    times = [[t for frame in rounds for t in json.loads(frame["times"].iloc[i])] for i in range(len(entries))]
    return _sample_frame(_entries(rounds[0]), times)


def _entries(samples: pd.DataFrame) -> list[Point]:
    return [tuple(tuple(int(x) for x in e) for e in json.loads(s)) for s in samples["entries"]]


# ---------------------------------------------------------------------- the fit (its algebra: kvlab.sim.fit)
def predict_seconds(cost: CostModel, points: Sequence[Point], execution: str = "sequential") -> np.ndarray:
    """Step seconds the cost model gives each batch: one step (``batched``) or one step per entry, summed."""
    if execution not in EXECUTIONS:
        raise ConfigError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
    if execution == "batched":
        return np.array([cost.duration(list(p)) for p in points])
    return np.array([sum(cost.duration([e]) for e in p) for p in points])


def residual_stats(rel: np.ndarray) -> dict:
    """Summary of relative residuals ``(predicted − measured) / measured``."""
    a = np.abs(rel)
    return {"n": len(rel), "median_abs": float(np.median(a)), "p90_abs": float(np.percentile(a, 90)),
            "max_abs": float(a.max()), "rms": float(np.sqrt(np.mean(rel**2))), "bias": float(np.mean(rel))}


@dataclass
class CalibrationFit:
    """Fitted profile, raw rates (``u_*`` in s/FLOP and s/byte, ``t0_s``), residuals and notes."""

    hardware: HardwareProfile
    theta: dict
    samples: pd.DataFrame  # the measurements plus predicted_s and residual
    stats: dict
    execution: str
    notes: list[str] = field(default_factory=list)
    batched_equation_stats: dict | None = None  # the simulator's batched step on multi-entry samples


def fit_cost_model(
    samples: pd.DataFrame,
    model: ModelProfile,
    base: HardwareProfile | str = "cpu-local",
    *,
    execution: str = "sequential",
    name: str | None = None,
    description: str = "",
) -> CalibrationFit:
    """Fit the cost model to measured steps (``samples``: :func:`measure_steps`'s ``entries`` and ``seconds``).

    ``execution``: ``"sequential"`` (the engine runs each entry as its own forward: a batch's time is the sum
    of one-entry steps) or ``"batched"`` (one step per batch, as the simulator's equation). Residuals are
    those of the saved profile (after any peak adjustment), relative to the measurement.
    """
    if execution not in EXECUTIONS:
        raise ConfigError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
    base_p = load_hardware(base)
    cost0 = CostModel(model, base_p)
    points = _entries(samples)
    feats = [_features(cost0, p, execution) for p in points]
    knots = batch_knots(feats)
    init = np.array([1 / cost0.lin_rate, 1 / cost0.attn_rate, 1 / cost0.mem_rate, cost0.overhead,
                     cost0.prefill_overhead, *(float(base_p.batch_overhead(k)) if base_p.batch_overhead_s else 0.0
                                            for k in knots)])
    theta, _ = fit_rates(feats, samples["seconds"].to_numpy(np.float64), init=init)
    changes: dict = {"name": name or f"{base_p.name}-cal-{model.name}"}
    if description:
        changes["description"] = description
    compute = np.concatenate([theta[0] * f[:, 0] + theta[1] * f[:, 1] for f in feats])
    mem = np.concatenate([f[:, 2] for f in feats])
    free_bw = float(np.max(mem / np.maximum(compute, 1e-12)) / 0.01)
    profile, notes = rates_to_profile(theta, base_p, free_memory_bandwidth=free_bw, knots=knots, **changes)
    cost = CostModel(model, profile)
    measured = samples["seconds"].to_numpy(np.float64)
    predicted = predict_seconds(cost, points, execution)
    rel = (predicted - measured) / measured
    frame = samples.copy()
    frame["predicted_s"] = predicted
    frame["residual"] = rel
    stats = residual_stats(rel)
    batched_stats = None
    multi = np.array([len(p) > 1 for p in points])
    if execution == "sequential" and multi.any():
        pb = predict_seconds(cost, [p for p, m in zip(points, multi, strict=True) if m], "batched")
        batched_stats = residual_stats((pb - measured[multi]) / measured[multi])
        frame["batched_equation_s"] = predict_seconds(cost, points, "batched")
    u = dict(zip(("u_lin_s_per_flop", "u_attn_s_per_flop", "u_mem_s_per_byte", "t0_s", "t_prefill_s"),
                 (float(x) for x in theta[:5]), strict=True))
    u.update({f"batch_overhead_s@{k}": float(b) for k, b in zip(knots, theta[5:], strict=True)})
    return CalibrationFit(profile, u, frame, stats, execution, notes, batched_stats)


# ---------------------------------------------------------------------- the whole procedure
@dataclass
class Calibration:
    """A calibration run: the fit, the model profile it is for, and what was measured where and when."""

    fit: CalibrationFit
    model: ModelProfile
    meta: dict

    @property
    def hardware(self) -> HardwareProfile:
        return self.fit.hardware

    def report(self) -> dict:
        """JSON-ready: metadata, fitted profile, raw rates, residual statistics, notes and every sample."""
        return {
            "kind": "kvlab.calibration", **self.meta, "execution": self.fit.execution,
            "hardware_profile": self.fit.hardware.to_dict(), "model_profile": self.model.to_dict(),
            "theta": self.fit.theta, "residuals": self.fit.stats,
            "batched_equation_residuals": self.fit.batched_equation_stats, "notes": self.fit.notes,
            "samples": self.fit.samples.to_dict("records"),
        }

    def save(self, path: str | Path) -> Path:
        """Write the calibrated hardware profile to ``path`` (``load_hardware(path)`` reads it), the model
        profile to ``<stem>.model.json`` and the full report to ``<stem>.fit.json`` beside it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fit.hardware.save(path)
        self.model.save(path.with_name(f"{path.stem}.model.json"))
        from kvlab.results.paths import atomic_write_file
        from kvlab.results.store import dumps

        text = dumps(self.report(), sort_keys=False) + "\n"
        atomic_write_file(path.with_name(f"{path.stem}.fit.json"), lambda tmp: tmp.write_text(text))
        return path


def calibrate(
    engine: PagedModel,
    *,
    base_hardware: HardwareProfile | str | None = None,
    grid: Iterable[Point] = DEFAULT_GRID,
    repeats: int = 5,
    timer: str = "wall",
    model: ModelProfile | None = None,
    name: str | None = None,
    seed: int = 0,
    samples: pd.DataFrame | None = None,
    progress: bool = False,
    execution: str = "sequential",
) -> Calibration:
    """Measure the engine over ``grid`` and fit a calibrated profile for its device. ``execution``:
    ``"sequential"`` (one forward per entry) or ``"batched"`` (one packed forward per batch, the engine's
    continuous batching: the fit is then the simulator's batched step equation on batched steps).

    ``base_hardware`` (default: the shipped profile of the device) supplies the nominal peak, bandwidth and
    memory; ``model`` defaults to the engine model's profile. ``samples`` (from :func:`measure_steps` or
    :func:`combine_rounds`, measured with ``timer``) skips the measurement. The profile's description names
    the device, date, model and residuals.
    """
    from kvlab.sim.engine_executor import default_hardware, device_name, engine_model_profile  # (torch-backed)

    model_p = model if model is not None else engine_model_profile(engine)
    base = load_hardware(base_hardware if base_hardware is not None else default_hardware(engine.device))
    if samples is None:
        samples = measure_steps(engine, grid, repeats=repeats, timer=timer, seed=seed, progress=progress,
                                execution=execution)
    else:
        repeats = int(samples["repeats"].min())
    dev = device_name(engine.device)
    date = datetime.now(UTC).isoformat(timespec="seconds")
    fit = fit_cost_model(samples, model_p, base, execution=execution, name=name)
    s = fit.stats
    description = (
        f"calibrated {date[:10]} on {dev} ({engine.device}) for model {model_p.name} ({model_p.dtype}), "
        f"engine {engine.model_id}, "
        + ("sequential execution (one sequence per forward)" if execution == "sequential"
           else "batched execution (one packed forward per step)")
        + f", timer {timer}; "
        f"base profile {base.name}"
    )
    source = (
        f"kvlab calibrate: least squares on relative step-time residuals over {s['n']} batches x {repeats} repeats; "
        f"|residual| median {s['median_abs']:.1%}, p90 {s['p90_abs']:.1%}, max {s['max_abs']:.1%}"
        + ("; " + "; ".join(fit.notes) if fit.notes else "")
    )
    fit.hardware = fit.hardware.with_overrides(description=description, source=source)
    meta = {
        "device": str(engine.device), "device_name": dev, "date": date, "model": model_p.name,
        "model_id": engine.model_id, "model_dtype": model_p.dtype, "block_size": engine.block_size,
        "timer": timer, "repeats": repeats, "base_hardware": base.name, "torch_threads": _threads(),
    }
    return Calibration(fit, model_p, meta)


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())
