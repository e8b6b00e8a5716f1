"""The per-request results frame every driver starts from: one row per request, in trace order.

Leading columns, in this order (tokens, blocks, seconds): ``request_id``, ``arrival`` (s), ``prompt_tokens``,
``output_tokens``, ``full_blocks``, ``hit_blocks``, ``hit_tokens`` = ``min(hit_blocks × block_size,
prompt_tokens)``, ``new_blocks``, ``evictions``, ``orphan_evictions``, ``admitted``, ``cached_blocks`` and
``orphan_blocks`` (after the request), ``ideal_hit_tokens`` = ``min(ideal hit blocks × block_size,
prompt_tokens)``; then a driver's own columns given as ``extra``; then the workload's label columns that
it has. The replay, the simulator (and the engine under its scheduler) and the sequential engine build
their frames here and append the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from kvlab.workload.workload import Workload

#: the per-request counts a driver gives :func:`requests_frame` (blocks; ``admitted``: bool)
DRIVER_COLUMNS = ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "admitted", "cached_blocks",
                  "orphan_blocks")
#: the workload's label columns a frame carries when the workload has them (the replay's and simulator's)
LABELS = ("session", "turn", "tenant", "category")
#: the sequential engine's: the adapter too (it serves adapters; the replay only keys them)
ENGINE_LABELS = (*LABELS, "adapter")


def requests_frame(
    workload: Workload,
    block_size: int,
    columns: Mapping[str, np.ndarray | pd.Series | Sequence],
    ideal_blocks: np.ndarray,
    *,
    arrival: np.ndarray | None = None,
    prompt_tokens: np.ndarray | None = None,
    full_blocks: np.ndarray | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
    labels: Sequence[str] = LABELS,
) -> pd.DataFrame:
    """The leading columns (module docstring) of ``workload``'s requests, then ``extra``, then ``labels``.

    ``columns``: the driver's :data:`DRIVER_COLUMNS`, one value per request; ``ideal_blocks``: hit blocks per
    request with an unbounded cache; ``block_size`` in tokens. Defaults: ``arrival`` the workload's (s),
    ``prompt_tokens`` its input lengths, ``full_blocks`` ``prompt_tokens // block_size``.
    """
    bs = block_size
    prompt = np.asarray(workload.input_length, dtype=np.int64) if prompt_tokens is None else prompt_tokens
    hit_blocks = np.asarray(columns["hit_blocks"], dtype=np.int64)

    def count(name: str) -> np.ndarray:
        return np.asarray(columns[name], dtype=np.int64)

    frame = pd.DataFrame({
        "request_id": workload.request_id,
        "arrival": workload.arrival if arrival is None else arrival,
        "prompt_tokens": prompt,
        "output_tokens": workload.output_length,
        "full_blocks": prompt // bs if full_blocks is None else full_blocks,
        "hit_blocks": hit_blocks,
        "hit_tokens": np.minimum(hit_blocks * bs, prompt),
        "new_blocks": count("new_blocks"),
        "evictions": count("evictions"),
        "orphan_evictions": count("orphan_evictions"),
        "admitted": np.asarray(columns["admitted"], dtype=bool),
        "cached_blocks": count("cached_blocks"),
        "orphan_blocks": count("orphan_blocks"),
        "ideal_hit_tokens": np.minimum(ideal_blocks * bs, prompt),
        **(extra or {}),
    })
    for name in labels:
        col = getattr(workload, name)
        if col is not None:
            frame[name] = col
    return frame


__all__ = ["DRIVER_COLUMNS", "ENGINE_LABELS", "LABELS", "requests_frame"]
