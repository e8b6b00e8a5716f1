"""Trace statistics (``kvlab trace stats``): sizes, lengths, unique blocks and ideal hit rates."""

from __future__ import annotations

import numpy as np

from kvlab.cache.compiled import ideal_hits_kernel
from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher, encode_workload
from kvlab.workload.workload import Workload


def trace_stats(workload: Workload, *, block_size: int | None = None, hash_scheme: str = "xxh3_128") -> dict:
    """Statistics of a workload at ``block_size`` (default: the trace's own, or 16 for token traces).

    Hit rates are those of an unbounded cache: ``ideal_hit_rate`` counts like vLLM (the last prompt
    token is recomputed), ``ideal_hit_rate_nocap`` does not; each has an aggregate (tokens) and a
    per-request mean. ``repeated_block_ratio`` is the share of all prompt block ids (full and partial)
    that occurred earlier in the trace — the block-level "cache ratio" some papers report.
    """
    if block_size is None:
        bs = workload.default_block_size
    else:  # 0 is a mistake, not "the default"; encode_workload names any other bad value
        bs = block_size
        if bs == 0 and not isinstance(bs, bool):
            raise ConfigError("block_size must be a positive int, got 0")
    enc = encode_workload(workload, BlockHasher(hash_scheme), bs)
    prompt = enc.prompt_tokens
    out: dict[str, object] = {
        "trace": workload.name,
        "requests": len(workload),
        "duration_s": workload.duration,
        "mean_input_tokens": float(workload.input_length.mean()) if len(workload) else 0.0,
        "mean_output_tokens": float(workload.output_length.mean()) if len(workload) else 0.0,
        "prompt_tokens": int(prompt.sum()),
        "block_size": bs,
        "full_blocks": int(len(enc.key_ids)),
        "unique_blocks": int(enc.num_keys),
    }
    if workload.kind == "blocks" and bs == workload.block_size:
        ids = workload.prompt_values
        out["trace_block_ids"] = int(len(ids))
        out["unique_trace_block_ids"] = int(len(np.unique(ids)))
        total = out["trace_block_ids"]
        out["repeated_block_ratio"] = 1.0 - out["unique_trace_block_ids"] / total if total else 0.0
    for label, ideal in (("", False), ("_nocap", True)):
        hits = ideal_hits_kernel(enc.offsets, enc.key_ids, prompt, enc.num_keys, bs, ideal)
        hit_tokens = np.minimum(hits * bs, prompt)
        out[f"ideal_hit_rate{label}"] = float(hit_tokens.sum() / prompt.sum()) if prompt.sum() else 0.0
        mask = prompt > 0
        per_request = hit_tokens[mask] / prompt[mask]
        out[f"ideal_mean_request_hit_rate{label}"] = float(per_request.mean()) if mask.any() else 0.0
    return out
