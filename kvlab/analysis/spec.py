"""How an experiment's runs are analysed (:class:`AnalysisSpec`): a schema only, so that the experiment schema
(kvlab.experiment.config) can hold it without importing the results readers of :mod:`kvlab.analysis.runs`."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from kvlab.analysis.intervals import batch_means
from kvlab.schema import NO_BOOL_NUMBERS, Schema

#: default batch-means windows (kvlab.analysis.intervals.batch_means's default)
DEFAULT_WINDOWS: int = batch_means.__kwdefaults__["n_batches"]


class AnalysisSpec(BaseModel):
    """How an experiment's runs are analysed: warm-up, batch-means windows, confidence level.

    ``warmup_requests``: the first N requests of each run are left out of every metric (they still ran and
    filled the cache); ``warmup_seconds``: so are requests arriving less than this many seconds (arrival
    time, the driver's clock) after the first; ``windows``: contiguous batch-means windows (>= 2);
    ``confidence``: level of every interval, in (0, 1).
    """

    model_config = Schema.model_config
    _no_bool_numbers = NO_BOOL_NUMBERS  # a boolean is never a number (kvlab.schema.refuse_bool_numbers)

    warmup_requests: Annotated[int, Field(ge=0)] = 0
    warmup_seconds: Annotated[float, Field(ge=0)] = 0.0
    windows: Annotated[int, Field(ge=2)] = DEFAULT_WINDOWS
    confidence: Annotated[float, Field(gt=0, lt=1)] = 0.95

    def warmup(self) -> dict:
        """The warm-up as keyword arguments of :mod:`kvlab.analysis` functions."""
        return {"warmup_requests": self.warmup_requests, "warmup_seconds": self.warmup_seconds}


__all__ = ["DEFAULT_WINDOWS", "AnalysisSpec"]
