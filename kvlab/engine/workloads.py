"""Token workloads shaped for the engine: shortened prompts and shared-prefix variants of real prompts.

CPU runs need prompts of a few hundred tokens; real traces (RAG prompts ~14 k byte tokens, expanded
Mooncake requests ~10 k tokens) are cut to a prefix. Cutting keeps the prefix structure: two prompts
that share their first ``n`` tokens still share ``min(n, max_tokens)`` after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvlab.errors import ConfigError
from kvlab.workload._common import csr
from kvlab.workload.workload import Workload, _gather_ranges


def clip_prompts(workload: Workload, max_tokens: int) -> Workload:
    """A copy of a token workload whose prompts keep their first ``max_tokens`` tokens (other columns kept)."""
    if workload.kind != "tokens":
        raise ConfigError("clip_prompts needs a token workload (expand a block-id trace first)")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = np.minimum(workload.input_length, max_tokens)
    values = _gather_ranges(workload.prompt_values, workload.prompt_offsets[:-1], lengths)
    meta = {**workload.meta, "clipped_to_tokens": int(max_tokens)}
    return dataclasses.replace(workload, input_length=lengths, prompt_offsets=csr(lengths), prompt_values=values,
                               meta=meta, name=f"{workload.name}@{max_tokens}")


def prefix_variants(
    workload: Workload,
    lengths: Sequence[int],
    *,
    rounds: int = 1,
    output_length: int = 1,
    interval: float = 1.0,
) -> Workload:
    """Requests that are prefixes of the workload's prompts: for each round, each length, each row,
    ``prompt[:length]`` (shorter if the prompt is). Longer variants extend shorter ones exactly, so a
    cache can reuse them; a capacity below the working set makes them evict each other.

    Columns: ``session`` = source row, ``category`` = source category if any, arrivals ``k * interval``.
    """
    if workload.kind != "tokens":
        raise ConfigError("prefix_variants needs a token workload")
    if not lengths or min(lengths) < 1 or rounds < 1:
        raise ConfigError(f"need lengths >= 1 and rounds >= 1, got {list(lengths)}, {rounds}")
    rows, cuts = [], []
    for _ in range(rounds):
        for length in lengths:
            for i in range(len(workload)):
                rows.append(i)
                cuts.append(min(int(length), int(workload.input_length[i])))
    rows_a = np.asarray(rows, dtype=np.int64)
    cut_a = np.asarray(cuts, dtype=np.int64)
    values = _gather_ranges(workload.prompt_values, workload.prompt_offsets[rows_a], cut_a)
    n = len(rows_a)
    return Workload(
        arrival=np.arange(n, dtype=np.float64) * interval,
        input_length=cut_a,
        output_length=np.full(n, output_length, dtype=np.int64),
        prompt_offsets=csr(cut_a),
        prompt_values=values,
        kind="tokens",
        session=rows_a,
        category=workload.category[rows_a] if workload.category is not None else None,
        name=f"{workload.name}-prefixes",
        source=workload.source,
        checksum=workload.checksum,
        meta={**workload.meta, "prefix_lengths": [int(x) for x in lengths], "rounds": rounds},
    )
