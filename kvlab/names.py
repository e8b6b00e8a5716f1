"""One vocabulary: the renames kvlab has made, applied wherever names are read.

Every name a user sees (a config field, a CLI flag, a summary key, a results column) has one spelling
from the command line to the core. When a name changes, the old spelling goes into :data:`ALIASES`,
and everything that reads names — configs (``ReplayConfig(engine=...)``), results written before the
rename (:func:`kvlab.results.read_results`, :func:`kvlab.sweep.read_sweep`) — goes through
:func:`canonical_keys` / :func:`canonical_columns`, so old code and old results keep working. Renamed
keyword arguments and attributes of the Python API are in :data:`KEYWORD_ALIASES`, applied by
:func:`renamed_keyword` and :func:`renamed_attribute`.
The metric names themselves are defined once, in :data:`kvlab.metrics.METRICS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the cache core reads this module: no pandas import at run time
    import pandas as pd

T = TypeVar("T")

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


#: driver (``manifest.json``'s ``driver``) -> {old name -> current name}: a name that meant something else in
#: that driver's results only. The engine's ``computed_tokens`` counted the prompt tokens run through the model;
#: the simulator's counts every executed token (decode and recomputation too), so the engine now writes that
#: count as ``computed_prompt_tokens``, the simulator's name for it.
DRIVER_ALIASES: dict[str, dict[str, str]] = {
    "engine": {"computed_tokens": "computed_prompt_tokens"},
}


#: old keyword argument / attribute -> current name, in the Python API only (constructors and functions).
#: Not a config, summary or column alias: ``num_blocks`` still means blocks per request elsewhere
#: (``EncodedWorkload.num_blocks``) and the physical size of a KV pool tensor (``KVPool.num_blocks``).
KEYWORD_ALIASES: dict[str, str] = {
    # the cache size, in blocks: PrefixCache, Engine / PagedModel, measure_unsafe
    "num_blocks": "capacity_blocks",
}


def renamed_keyword(where: str, name: str, value: T, old: Mapping[str, object]) -> T:
    """The value of keyword argument ``name`` of ``where``: ``value``, or the one given under an old spelling
    of ``name`` (:data:`KEYWORD_ALIASES`) in ``old`` (the call's other keyword arguments, e.g. ``**old``).

    Raises TypeError, as Python does, for a keyword in ``old`` that is no old spelling of ``name``, or for a
    value given under both spellings (``value`` not None).
    """
    for key, given in old.items():
        if KEYWORD_ALIASES.get(key) != name:
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
        if value is not None:
            raise TypeError(f"{where}() got {name!r} and its old name {key!r}: give {name!r} only")
        value = given  # type: ignore[assignment]
    return value


def renamed_attribute(name: str) -> property:
    """A read-only property, for a class attribute under an old spelling of ``name`` (:data:`KEYWORD_ALIASES`),
    that reads attribute ``name``: ``num_blocks = renamed_attribute("capacity_blocks")``."""

    def read(self: object) -> object:
        return getattr(self, name)

    return property(read, doc=f"The old name of ``{name}`` (read-only).")


def canonical(name: str, driver: object = None) -> str:
    """The current spelling of ``name``; ``driver`` (a manifest's, may be anything): its
    :data:`DRIVER_ALIASES` apply first."""
    scoped = DRIVER_ALIASES.get(driver, {}) if isinstance(driver, str) else {}
    return scoped.get(name) or ALIASES.get(name, name)


class Summary(dict):
    """A run's summary (a plain dict, JSON as usual) in which an old name still finds its value:
    ``summary["engine"]`` reads ``summary["backend"]``. New keys are always written under today's names."""

    def __missing__(self, key: str) -> object:
        new = ALIASES.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        return self[new]


def canonical_keys(data: Mapping[str, object], driver: object = None) -> dict[str, object]:
    """``data`` with old keys renamed (``driver``'s too, :func:`canonical`); where both spellings are present the
    current one wins."""
    out: dict[str, object] = Summary()
    for key, value in data.items():
        new = canonical(key, driver)
        if new != key and new in data:
            continue
        out[new] = value
    return out


def canonical_columns(frame: pd.DataFrame, driver: object = None) -> pd.DataFrame:
    """``frame`` with old column names renamed (``driver``'s too, :func:`canonical`; a copy only when something
    changes)."""
    renames = {c: canonical(c, driver) for c in frame.columns
               if canonical(c, driver) != c and canonical(c, driver) not in frame.columns}
    return frame.rename(columns=renames) if renames else frame


__all__ = [
    "ALIASES",
    "DRIVER_ALIASES",
    "KEYWORD_ALIASES",
    "Summary",
    "canonical",
    "canonical_columns",
    "canonical_keys",
    "renamed_attribute",
    "renamed_keyword",
]
