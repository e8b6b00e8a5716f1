"""What a run of the sequential driver returns: one row per request in trace order, the totals, the config.

Units: token counts in tokens, block counts in blocks, times in seconds (``*_s``), sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.results import build_manifest, write_results
from kvlab.results.frame import DRIVER_COLUMNS, ENGINE_LABELS, requests_frame
from kvlab.workload.workload import Workload


@dataclass
class EngineResult:
    """Per-request rows (trace order; the replay's columns plus timing, memory and verify columns),
    totals, the run's config and the trace's identity."""

    requests: pd.DataFrame
    summary: dict
    config: dict
    trace: dict

    def save(self, out: str | Path) -> Path:
        """Write ``requests.parquet``, ``summary.json`` and ``manifest.json`` to ``out`` atomically."""
        manifest = build_manifest(self.config, trace=self.trace, seed=self.config.get("model_seed"), driver="engine")
        return write_results(out, {"requests": self.requests}, self.summary, manifest)


def request_frame(workload: Workload, rows: list[dict], ideal: np.ndarray, block_size: int) -> pd.DataFrame:
    """One row per request in trace order: the replay's columns (hits, evictions, cached blocks, ideal hits in
    tokens; :func:`kvlab.results.frame.requests_frame`), the workload's labels (the adapter too), then every
    column of ``rows`` (one dict per request) and the derived ``prefill_tokens_per_s`` and ``tpot_s`` (NaN
    without decode steps)."""
    cols = pd.DataFrame(rows)
    frame = requests_frame(workload, block_size, {name: cols[name].to_numpy() for name in DRIVER_COLUMNS}, ideal,
                           labels=ENGINE_LABELS)
    extra = cols.drop(columns=[c for c in frame.columns if c in cols.columns])
    frame = pd.concat([frame, extra.set_index(frame.index)], axis=1)
    comp = frame["computed_prompt_tokens"].to_numpy(np.float64)
    secs = frame["prefill_s"].to_numpy(np.float64)
    frame["prefill_tokens_per_s"] = np.divide(comp, secs, out=np.zeros_like(comp), where=secs > 0)
    steps = frame["decode_steps"].to_numpy(np.float64)
    dsec = frame["decode_s"].to_numpy(np.float64)
    frame["tpot_s"] = np.divide(dsec, steps, out=np.full_like(dsec, np.nan), where=steps > 0)
    return frame
