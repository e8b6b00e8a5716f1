"""The calibration fit's algebra (docs/simulator.md, "Calibration"; the procedure is :mod:`kvlab.sim.calibrate`).

Each measured batch is turned into features per group of work (a packed step, or one forward of the sequential
engine): ``[lin FLOPs, attention FLOPs, bytes, prefill entries, entries]``. :func:`fit_rates` finds the inverse
rates, overheads and per-batch-size overheads that minimise the relative residuals, all non-negative, and
:func:`rates_to_profile` turns them into a calibrated :class:`~kvlab.profiles.HardwareProfile`. Units:
seconds, FLOPs, bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile
from kvlab.sim.cost import CostModel, num_prefills

Point = tuple[tuple[int, int], ...]  # a batch: entries (new tokens, cached context)


def _features(cost: CostModel, point: Point, execution: str) -> np.ndarray:
    """``[lin FLOPs, attention FLOPs, bytes, prefill entries, entries]`` per group of a batch (one group per
    entry when sequential; the entries column is then 0: one-entry forwards have no batch overhead)."""
    groups = [[e] for e in point] if execution == "sequential" else [list(point)]
    out = np.empty((len(groups), 5))
    for g, entries in enumerate(groups):
        tokens, seqs, pairs, kv = cost.batch_totals(entries)
        out[g] = (cost.f_lin * tokens + cost.f_head * seqs, cost.f_pair * pairs, cost.b_weights + cost.b_kv * kv,
                  num_prefills(entries), seqs if execution == "batched" else 0)
    return out


def batch_knots(feats: list[np.ndarray]) -> list[int]:
    """The batch sizes ``S >= 2`` the samples measure (one batch-overhead unknown each, batched execution)."""
    return sorted({int(s) for f in feats for s in f[:, 4] if s >= 2})


def _knot_columns(f: np.ndarray, knots: Sequence[int]) -> np.ndarray:
    """How many of a sample's groups have each knot's batch size."""
    return np.array([float(np.sum(f[:, 4] == k)) for k in knots])


def _predict(theta: np.ndarray, feats: list[np.ndarray]) -> np.ndarray:
    u_l, u_a, u_m, t0, t_p = theta[:5]
    knots = batch_knots(feats)
    return np.array([float(np.maximum(u_l * f[:, 0] + u_a * f[:, 1], u_m * f[:, 2]).sum()) + len(f) * t0
                     + t_p * float(f[:, 3].sum()) + float(_knot_columns(f, knots) @ theta[5:]) for f in feats])


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best feasible solution over all column subsets."""
    m = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_x = np.inf, np.zeros(m)
    for k in range(1, m + 1):
        for cols in itertools.combinations(range(m), k):
            sub = a_s[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            r = float(np.sum((sub @ x - b) ** 2))
            if r < best:
                best, best_x = r, np.zeros(m)
                best_x[list(cols)] = x
    return best_x / scale


def fit_rates(feats: list[np.ndarray], seconds: np.ndarray, *, init: np.ndarray | None = None,
              max_iter: int = 100) -> tuple[np.ndarray, float]:
    """``theta = (u_lin, u_attn, u_mem, t_0, t_prefill, b_S for S in batch_knots(feats))`` minimising
    Σ ((predicted − t) / t)², all ≥ 0; and that sum.

    ``feats[i]``: the groups of sample i (rows ``[lin, attn, bytes, prefill entries, entries]``). Alternates
    branch assignment and a non-negative linear solve from several starts (all compute-bound, all memory-bound,
    ``init``).
    """
    t = np.asarray(seconds, dtype=np.float64)
    if len(feats) != len(t) or len(t) < 4 or np.any(t <= 0):
        raise ConfigError("fit_rates needs >= 4 samples with positive times")
    w = 1.0 / t

    def objective(theta: np.ndarray) -> float:
        return float(np.sum(((_predict(theta, feats) - t) * w) ** 2))

    knots = batch_knots(feats)

    def solve(assign: list[np.ndarray]) -> np.ndarray:
        a = np.zeros((len(t), 5 + len(knots)))
        for i, (f, comp) in enumerate(zip(feats, assign, strict=True)):
            a[i, 0] = f[comp, 0].sum()
            a[i, 1] = f[comp, 1].sum()
            a[i, 2] = f[~comp, 2].sum()
            a[i, 3] = len(f)
            a[i, 4] = f[:, 3].sum()
            a[i, 5:] = _knot_columns(f, knots)
        return _nnls(a * w[:, None], np.ones(len(t)))

    def assignment(theta: np.ndarray) -> list[np.ndarray]:
        u_l, u_a, u_m = theta[:3]
        return [u_l * f[:, 0] + u_a * f[:, 1] >= u_m * f[:, 2] for f in feats]

    starts = [[np.ones(len(f), bool) for f in feats], [np.zeros(len(f), bool) for f in feats]]
    if init is not None:
        starts.append(assignment(np.asarray(init, dtype=np.float64)))
    # a split by arithmetic intensity: the upper half compute-bound
    ratio = np.concatenate([(f[:, 0] + f[:, 1]) / f[:, 2] for f in feats])
    cut = float(np.median(ratio))
    starts.append([(f[:, 0] + f[:, 1]) / f[:, 2] >= cut for f in feats])
    best_theta, best_obj = None, np.inf
    for assign in starts:
        seen: set[bytes] = set()
        for _ in range(max_iter):
            theta = solve(assign)
            obj = objective(theta)
            if obj < best_obj:
                best_theta, best_obj = theta, obj
            new = assignment(theta)
            sig = b"".join(np.packbits(a).tobytes() + b"|" for a in new)
            if sig in seen:
                break
            seen.add(sig)
            assign = new
    assert best_theta is not None
    return best_theta, best_obj


def rates_to_profile(theta: np.ndarray, base: HardwareProfile, *, free_memory_bandwidth: float | None = None,
                     knots: Sequence[int] = (), **changes: object) -> tuple[HardwareProfile, list[str]]:
    """A calibrated copy of ``base`` whose cost model has the fitted rates (module docstring, step 3).

    A fitted memory cost of 0 (the memory branch never binds in the data) is expressed as the bandwidth
    ``free_memory_bandwidth`` (B/s) at η_mem = 1: :func:`fit_cost_model` passes one at which the memory
    branch stays below 1 % of the compute branch of every measured step. A fitted compute or attention
    cost of 0 gets η = 1 at the (possibly raised) peak.
    """
    u_l, u_a, u_m, t0, t_p = (float(x) for x in theta[:5])
    batch = tuple((int(k), float(b)) for k, b in zip(knots, theta[5:], strict=True))
    notes = []
    r_l = 1.0 / u_l if u_l > 0 else np.inf
    r_a = 1.0 / u_a if u_a > 0 else np.inf
    r_m = 1.0 / u_m if u_m > 0 else np.inf
    peak = max([base.peak_flops] + [r for r in (r_l, r_a) if np.isfinite(r)])
    bandwidth = max([base.memory_bandwidth] + ([r_m] if np.isfinite(r_m) else [free_memory_bandwidth or 0.0]))
    if peak > base.peak_flops:
        notes.append(f"peak_flops raised from {base.peak_flops:.4g} to the attained {peak:.4g} FLOP/s")
    if bandwidth > base.memory_bandwidth:
        what = "attained" if np.isfinite(r_m) else "unbinding (memory cost not visible in the data)"
        notes.append(f"memory_bandwidth raised from {base.memory_bandwidth:.4g} to the {what} {bandwidth:.4g} B/s")
    for name, r in (("compute", r_l), ("attention", r_a), ("memory", r_m)):
        if not np.isfinite(r):
            notes.append(f"{name} rate not identified by the data (fitted cost 0): efficiency set to 1")
    profile = base.with_overrides(
        peak_flops=float(peak), memory_bandwidth=float(bandwidth),
        compute_efficiency=float(min(1.0, r_l / peak)) if np.isfinite(r_l) else 1.0,
        attention_efficiency=float(min(1.0, r_a / peak)) if np.isfinite(r_a) else 1.0,
        memory_efficiency=float(min(1.0, r_m / bandwidth)) if np.isfinite(r_m) else 1.0,
        step_overhead_s=float(t0), prefill_overhead_s=float(t_p), batch_overhead_s=batch, calibrated=True, **changes,
    )
    return profile, notes
