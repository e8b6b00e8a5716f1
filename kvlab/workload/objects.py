"""Object sequences: classic cache traces (one key per access) as kvlab workloads.

Each access becomes a one-block request (``kind="blocks"``, ``block_size=1``, ``input_length=1``).
Replayed with ``mode="ideal"`` (a one-token prompt would otherwise never hit) and ``block_size=1``,
every request looks up, pins and releases exactly one block, so the replay's ``hit_blocks`` column
is the per-access hit vector of the policy on that object sequence — comparable with libCacheSim.
"""

from __future__ import annotations

import numpy as np

from kvlab.workload.workload import Workload, from_lists


def object_sequence(keys: np.ndarray | list[int], *, name: str = "objects") -> Workload:
    """A workload of one-block requests, one per key, in order (arrival = access index, seconds)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    w = from_lists([], kind="blocks", block_size=1) if n == 0 else Workload(
        arrival=np.arange(n, dtype=np.float64),
        input_length=np.ones(n, np.int64),
        output_length=np.zeros(n, np.int64),
        prompt_offsets=np.arange(n + 1, dtype=np.int64),
        prompt_values=keys,
        kind="blocks",
        block_size=1,
    )
    w.name = name
    return w


def flatten_blocks(workload: Workload) -> np.ndarray:
    """Every full-block id access of a hash trace in order (prefix structure dropped): an object sequence."""
    if workload.kind != "blocks":
        raise ValueError("flatten_blocks needs a block-id trace (kind='blocks')")
    full = workload.input_length // workload.block_size
    starts = workload.prompt_offsets[:-1]
    idx = np.repeat(starts, full) + (np.arange(full.sum()) - np.repeat(np.cumsum(full) - full, full))
    return workload.prompt_values[idx]
