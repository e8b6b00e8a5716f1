"""Helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import numpy as np

from kvlab.workload.workload import from_lists


def random_token_workload(seed: int, n: int = 300, vocab: int = 3, max_len: int = 40):
    """Prompts from a tiny vocabulary with shared prefixes: lots of hits, duplicates and evictions."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, vocab, size=rng.integers(0, max_len)).tolist() for _ in range(8)]
    prompts = []
    for _ in range(n):
        stem = stems[rng.integers(len(stems))][: rng.integers(0, max_len)]
        tail = rng.integers(0, vocab, size=rng.integers(0 if stem else 1, 12)).tolist()
        prompts.append(stem + tail)
    return from_lists(prompts, arrival=np.arange(n, dtype=float))
