"""Step-level records of an engine serving run, and the cost model's error on them.

The engine executor (:class:`~kvlab.sim.engine_executor.EngineExecutor`) keeps every step it runs: the
batch's entries ``(n new tokens, c cached context)`` and the seconds its timer measured
(:meth:`EngineExecutor.execute <kvlab.sim.engine_executor.EngineExecutor.execute>`, the one place a step
is timed). :func:`step_frame` turns them into a tidy frame, one row per step, and — given a cost model —
adds the seconds that model gives the same batch: :meth:`CostModel.duration
<kvlab.sim.cost.CostModel.duration>`, the simulator's step time (the one definition). :func:`step_errors`
summarises the relative error per step kind. Comparing steps one by one is free of the queueing that
amplifies a step-time error into a TTFT error.

Kinds: a step is ``prefill`` when every entry is a prefill entry (``n > 1`` or ``c = 0``, as
:func:`~kvlab.sim.cost.num_prefills`), ``decode`` when none is, ``mixed`` otherwise.

Units: seconds, tokens. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvlab.sim.cost import CostModel

STEP_KINDS = ("prefill", "decode", "mixed")
Step = tuple[tuple[tuple[int, int], ...], float]  # ((n, c) entries, measured seconds)
STEP_COLUMNS = ["step", "kind", "entries", "new_tokens", "prefill_tokens", "decode_tokens", "cached_tokens",
                "context_tokens", "attention_pairs", "seconds", "batch"]
ERROR_COLUMNS = ["kind", "steps", "median_abs_error", "p90_abs_error", "mean_signed_error", "measured_s",
                 "predicted_s", "measured_mean_s", "predicted_mean_s"]


def step_kind(entries: Sequence[tuple[int, int]]) -> str:
    """``prefill``, ``decode`` or ``mixed`` (module docstring) of a batch of ``(n, c)`` entries."""
    pre = sum(1 for n, c in entries if n > 1 or c == 0)
    return "prefill" if pre == len(entries) else "decode" if pre == 0 else "mixed"


def step_frame(steps: Sequence[Step], cost: CostModel | None = None) -> pd.DataFrame:
    """One row per recorded step, in execution order.

    Columns: ``step`` (index), ``kind``, ``entries`` (sequences in the batch), ``new_tokens`` (Σ n),
    ``prefill_tokens`` (Σ n over prefill entries), ``decode_tokens`` (decode entries, one token each),
    ``cached_tokens`` (Σ c), ``context_tokens`` (Σ (c + n): positions the entries' last tokens attend),
    ``attention_pairs`` (query-key pairs, :meth:`CostModel.batch_totals` without a cost model: no window),
    ``seconds`` (measured), ``batch`` (the entries as JSON ``[[n, c], ...]``). With ``cost``:
    :func:`predict_steps` columns too.
    """
    rows = []
    for i, (entries, seconds) in enumerate(steps):
        pre = [(n, c) for n, c in entries if n > 1 or c == 0]
        rows.append((i, step_kind(entries), len(entries), sum(n for n, _ in entries), sum(n for n, _ in pre),
                     len(entries) - len(pre), sum(c for _, c in entries), sum(c + n for n, c in entries),
                     sum(n * c + n * (n + 1) // 2 for n, c in entries), float(seconds),
                     json.dumps([[int(n), int(c)] for n, c in entries])))
    frame = pd.DataFrame(rows, columns=STEP_COLUMNS)
    for col in STEP_COLUMNS[2:9]:
        frame[col] = frame[col].astype(np.int64)
    frame["seconds"] = frame["seconds"].astype(np.float64)
    return predict_steps(frame, cost) if cost is not None else frame


def batch_entries(frame: pd.DataFrame) -> list[list[tuple[int, int]]]:
    """The ``(n, c)`` entries of each row of a :func:`step_frame` (from its ``batch`` column)."""
    return [[(int(n), int(c)) for n, c in json.loads(b)] for b in frame["batch"]]


def predict_steps(frame: pd.DataFrame, cost: CostModel) -> pd.DataFrame:
    """``frame`` with ``predicted_s`` (the cost model's step time of each row's batch, the simulator's
    :meth:`CostModel.duration`), ``signed_error`` ``(predicted − measured) / measured`` and ``abs_error``."""
    out = frame.copy()
    pred = np.array([cost.duration(e) for e in batch_entries(frame)], dtype=np.float64)
    out["predicted_s"] = pred
    out["signed_error"] = (pred - out["seconds"].to_numpy()) / out["seconds"].to_numpy()
    out["abs_error"] = np.abs(out["signed_error"])
    return out


def _summary(part: pd.DataFrame, kind: str) -> dict:
    err = part["abs_error"].to_numpy()
    empty = len(part) == 0
    return {
        "kind": kind, "steps": len(part),
        "median_abs_error": np.nan if empty else float(np.median(err)),
        "p90_abs_error": np.nan if empty else float(np.percentile(err, 90)),
        "mean_signed_error": np.nan if empty else float(part["signed_error"].mean()),
        "measured_s": float(part["seconds"].sum()), "predicted_s": float(part["predicted_s"].sum()),
        "measured_mean_s": np.nan if empty else float(part["seconds"].mean()),
        "predicted_mean_s": np.nan if empty else float(part["predicted_s"].mean()),
    }


def step_errors(frame: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Per step kind (and an ``all`` row) of a predicted :func:`step_frame`, within each group of ``by``:
    ``steps`` (count), ``median_abs_error`` / ``p90_abs_error`` of ``|predicted − measured| / measured``,
    ``mean_signed_error`` (bias: negative when the model is too fast), total and mean seconds of both.
    Kinds without steps are left out."""
    groups = frame.groupby(list(by), sort=True) if by else [((), frame)]
    rows = []
    for key, part in groups:
        key = key if isinstance(key, tuple) else (key,)
        for kind in (*STEP_KINDS, "all"):
            sel = part if kind == "all" else part[part["kind"] == kind]
            if len(sel):
                rows.append({**dict(zip(by, key, strict=True)), **_summary(sel, kind)})
    return pd.DataFrame(rows, columns=[*by, *ERROR_COLUMNS])


NOISE_COLUMNS = ["kind", "common_batches", "engine_median_dev", "engine_p90_dev", "model_median_error",
                 "model_p90_error", "model_mean_signed_error"]


def step_noise(frame: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """The engine's step-level noise floor across repeats, and the cost model against it, per step kind.

    ``frame``: a predicted :func:`step_frame` of several runs of the same trace with a ``repeat`` column.
    A batch (same ``(n, c)`` entries) that every repeat of a group ran has a median of its seconds over
    the repeats (each repeat's own median where it ran the batch more than once). ``engine_median_dev`` /
    ``engine_p90_dev``: ``|seconds − median| / median`` of every repeat (how far one run's step strays);
    ``model_*``: ``(predicted − median) / median`` per batch (the cost model against the engine's typical
    step, the repeats' drift medianed out). ``common_batches``: batches every repeat ran."""
    rows = []
    groups = frame.groupby(list(by), sort=True) if by else [((), frame)]
    for key, part in groups:
        key = key if isinstance(key, tuple) else (key,)
        per = part.groupby(["batch", "repeat"])["seconds"].median().unstack("repeat").dropna()
        med = per.median(axis=1)
        first = part.drop_duplicates("batch").set_index("batch").loc[per.index]
        dev = per.sub(med, axis=0).div(med, axis=0).abs()
        model = (first["predicted_s"] - med) / med
        for kind in (*STEP_KINDS, "all"):
            sel = np.ones(len(per), bool) if kind == "all" else (first["kind"] == kind).to_numpy()
            if not sel.any():
                continue
            d, m = dev[sel].to_numpy().ravel(), model[sel].to_numpy()
            rows.append({**dict(zip(by, key, strict=True)), "kind": kind, "common_batches": int(sel.sum()),
                         "engine_median_dev": float(np.median(d)), "engine_p90_dev": float(np.percentile(d, 90)),
                         "model_median_error": float(np.median(np.abs(m))),
                         "model_p90_error": float(np.percentile(np.abs(m), 90)),
                         "model_mean_signed_error": float(np.mean(m))})
    return pd.DataFrame(rows, columns=[*by, *NOISE_COLUMNS])
