"""Helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvlab.policies.belady import NEVER, next_use
from kvlab.workload.workload import from_lists


def shared_prefix_prompts(rng: np.random.Generator, n: int, vocab: int, max_len: int) -> list[list[int]]:
    """``n`` prompts from a tiny vocabulary: a prefix of one of 8 random stems, then a short random tail."""
    stems = [rng.integers(0, vocab, size=rng.integers(0, max_len)).tolist() for _ in range(8)]
    prompts = []
    for _ in range(n):
        stem = stems[rng.integers(len(stems))][: rng.integers(0, max_len)]
        tail = rng.integers(0, vocab, size=rng.integers(0 if stem else 1, 12)).tolist()
        prompts.append(stem + tail)
    return prompts


def random_token_workload(seed: int, n: int = 300, vocab: int = 3, max_len: int = 40):
    """Prompts from a tiny vocabulary with shared prefixes: lots of hits, duplicates and evictions."""
    prompts = shared_prefix_prompts(np.random.default_rng(seed), n, vocab, max_len)
    return from_lists(prompts, arrival=np.arange(n, dtype=float))


# ---------------------------------------------------------------------- compiled twins vs Python classes
ENGINE_COLUMNS = ["hit_blocks", "new_blocks", "evictions", "admitted", "cached_blocks", "orphan_blocks",
                  "orphan_evictions"]


def assert_twin_equal(w, cfg):
    """Replay ``w`` with ``cfg`` on the compiled and on the Python engine; every per-request column (and
    the token hit rate) must be equal. Returns the Python run's columns."""
    from kvlab.replay import encode, replay

    enc = encode(w, cfg)
    fast = replay(w, cfg, encoded=enc, engine="compiled")
    slow = replay(w, cfg, encoded=enc, engine="python")
    assert fast.summary["engine"] == "compiled" and slow.summary["engine"] == "python"
    a = fast.requests[ENGINE_COLUMNS].reset_index(drop=True)
    b = slow.requests[ENGINE_COLUMNS].reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_dtype=False)
    assert fast.summary["token_hit_rate"] == slow.summary["token_hit_rate"]
    return b


def assert_twin_on_random_tokens(policy: str, capacity: int, block_size: int, seed: int, *, min_hits: int = 20):
    """:func:`assert_twin_equal` on :func:`random_token_workload` ``(seed)`` in both counting modes; a case
    under pressure (3..24 blocks) must evict more than 50 blocks and one with room (>= 8 blocks) hit more
    than ``min_hits``, so that every case exercises the policy."""
    from kvlab.replay import ReplayConfig

    w = random_token_workload(seed)
    for mode in ("vllm", "ideal"):
        frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode,
                                                  policy=policy))
        if 3 <= capacity <= 24:
            assert frame["evictions"].sum() > 50
        if capacity >= 8:
            assert frame["hit_blocks"].sum() > min_hits


def random_category_workload(seed: int, n: int = 500, vocab: int = 3, max_len: int = 40, *,
                             long_gap: float = 4.0, turns: bool = False):
    """Shared-prefix prompts with random categories (some missing), optionally turns (-1, 0 .. 14), and
    arrival times on a coarse grid (many ties, gaps up to ``long_gap`` s) starting below zero."""
    rng = np.random.default_rng(seed)
    prompts = shared_prefix_prompts(rng, n, vocab, max_len)
    arrival = np.cumsum(rng.choice([0.0, 0.0, 0.0, 0.25, 1.5, long_gap], size=n)) - 3.0
    labels = np.array(["chat", "rag", "search", None], dtype=object)[rng.integers(0, 4, size=n)]
    extra = {"turn": rng.integers(-1, 15, size=n)} if turns else {}
    return from_lists(prompts, arrival=arrival, category=pd.Categorical(labels), **extra)


def conversation_workload(seed: int, n: int = 300, sessions: int = 12, system: int = 12, turn_max: int = 10):
    """Interleaved multi-turn conversations over one system prompt (each prompt is its session's previous
    prompt plus a new turn): a deep prefix tree, for leaf-only policies."""
    rng = np.random.default_rng(seed)
    system_prompt = rng.integers(0, 50, size=system).tolist()
    history = [list(system_prompt) for _ in range(sessions)]
    prompts = []
    for _ in range(n):
        s = int(rng.integers(sessions))
        if rng.random() < 0.1:
            history[s] = list(system_prompt)  # a new conversation in this slot
        history[s] += rng.integers(0, 50, size=int(rng.integers(1, turn_max))).tolist()
        prompts.append(list(history[s]))
    return from_lists(prompts, arrival=np.arange(n, dtype=float))


def deep_prefix_workload(seed: int, n: int = 300, depth: int = 120, branch: int = 3):
    """Prefixes of one long trunk plus a short tail: in vllm mode trunk keys get duplicates, and a duplicate
    whose children are pinned can be the only kind of evictable block left (the leaf-only fallback)."""
    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, 50, size=depth).tolist()
    prompts = []
    for _ in range(n):
        stem = trunk[: int(rng.integers(1, depth))]
        prompts.append(stem + rng.integers(0, branch, size=int(rng.integers(0, 8))).tolist())
    return from_lists(prompts, arrival=np.arange(n, dtype=float))


# ---------------------------------------------------------------------- libCacheSim traces
def write_oracle_general(path, keys: np.ndarray) -> None:
    """libCacheSim's oracleGeneral binary trace: packed (uint32 time, uint64 id, uint32 size, int64 next).

    ``next`` is the index of the object's next access, -1 for none (the reader maps -1 to "never").
    """
    n = len(keys)
    nxt = next_use(np.arange(n + 1), keys)
    rec = np.zeros(n, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    assert rec.dtype.itemsize == 24
    rec["t"] = np.arange(n)
    rec["id"] = keys + 1
    rec["size"] = 1
    rec["next"] = np.where(nxt == NEVER, -1, nxt)
    rec.tofile(path)


def tiny_chat(n: int, seed: int = 3, max_output: int = 4):
    """A small multi-turn chat trace in tiny-llama's vocabulary (1,024 ids; shared system prompts and documents),
    outputs capped at ``max_output`` tokens."""
    import dataclasses

    from kvlab.workload import synthetic_chat

    wl = synthetic_chat(n, seed=seed, n_tenants=2, system_tokens=(16, 48), n_docs=4, doc_tokens=(40, 120),
                        user_median=12, answer_median=10, vocab_size=1024, vocab_offset=8)
    return dataclasses.replace(wl, output_length=np.minimum(wl.output_length, max_output))


def cli_error(capsys, argv: list[str]) -> str:
    """``kvlab argv`` exits 2 with exactly one ``kvlab: error:`` line on stderr; that line."""
    from kvlab.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: error:"), err
    return lines[0]
