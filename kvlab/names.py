"""One vocabulary: the renames kvlab has made, applied wherever names are read.

Every name a user sees (a config field, a CLI flag, a summary key, a results column) has one spelling
from the command line to the core. When a name changes, the old spelling goes into :data:`ALIASES`,
and everything that reads names — configs (``ReplayConfig(engine=...)``), results written before the
rename (:func:`kvlab.results.read_results`, :func:`kvlab.sweep.read_sweep`) — goes through
:func:`canonical_keys` / :func:`canonical_columns`, so old code and old results keep working.
The metric names themselves are defined once, in :data:`kvlab.metrics.METRICS`.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

#: old name -> current name (configs, summaries and result tables)
ALIASES: dict[str, str] = {
    # the replay's compiled/python choice: "engine" means the real transformers engine only
    "engine": "backend",
    # the real engine's latency summary, now named as the simulator's
    "mean_ttft_s": "ttft_mean_s",
    "p50_ttft_s": "ttft_p50_s",
    "p90_ttft_s": "ttft_p90_s",
    "p99_ttft_s": "ttft_p99_s",
    "prefill_seconds": "prefill_busy_s",
    "decode_seconds": "decode_busy_s",
    "bytes_per_block": "kv_bytes_per_block",
}


def canonical(name: str) -> str:
    """The current spelling of ``name``."""
    return ALIASES.get(name, name)


class Summary(dict):
    """A run's summary (a plain dict, JSON as usual) in which an old name still finds its value:
    ``summary["engine"]`` reads ``summary["backend"]``. New keys are always written under today's names."""

    def __missing__(self, key: str) -> object:
        new = ALIASES.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        return self[new]


def canonical_keys(data: Mapping[str, object]) -> dict[str, object]:
    """``data`` with old keys renamed; where both spellings are present the current one wins."""
    out: dict[str, object] = Summary()
    for key, value in data.items():
        new = canonical(key)
        if new != key and new in data:
            continue
        out[new] = value
    return out


def canonical_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with old column names renamed (a copy only when something changes)."""
    renames = {c: canonical(c) for c in frame.columns if canonical(c) != c and canonical(c) not in frame.columns}
    return frame.rename(columns=renames) if renames else frame


__all__ = ["ALIASES", "Summary", "canonical", "canonical_columns", "canonical_keys"]
