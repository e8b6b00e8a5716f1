"""Synthetic workloads that need no download: deterministic functions of their arguments and seed.

:func:`synthetic_chat` is kvlab's embedded default token trace (multi-tenant multi-turn chat with RAG);
:func:`zipf_blocks` is a small block-id trace with Zipf-popular shared prefixes, handy in tests.
Only ``numpy.random.Generator(PCG64(seed))`` is used, so the same arguments give an identical workload on
every machine and numpy 2.x version.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.workload._common import csr
from kvlab.workload.workload import Workload

#: the most requests a generator makes in one call (synthetic_chat averages ~1,550 prompt tokens a request, so
#: 10**6 requests are ~1.5 G tokens, ~6 GiB as int32: near what a 24 GiB machine can hash and replay)
MAX_GENERATED_REQUESTS = 1_000_000


def _check_count(function: str, n_requests: object) -> None:
    """``n_requests`` an integer (never a bool) in [0, MAX_GENERATED_REQUESTS]; ConfigError naming it otherwise,
    before anything is generated."""
    import numbers

    if isinstance(n_requests, bool) or not isinstance(n_requests, numbers.Integral):
        raise ConfigError(f"{function}: n_requests must be an integer, got {n_requests!r}")
    if not 0 <= n_requests <= MAX_GENERATED_REQUESTS:
        raise ConfigError(f"{function}: n_requests must be in [0, {MAX_GENERATED_REQUESTS:,}] (the generators' "
                          f"bound: memory grows with it), got {n_requests:,}")


def _zipf_weights(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


def _lognormal_len(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(round(rng.lognormal(np.log(median), sigma)), lo, hi))


def synthetic_chat(
    n_requests: int = 2000,
    *,
    seed: int = 0,
    n_tenants: int = 4,
    system_tokens: tuple[int, int] = (200, 600),
    n_docs: int = 40,
    doc_tokens: tuple[int, int] = (1000, 3000),
    rag_fraction: float = 0.3,
    doc_zipf: float = 1.1,
    mean_turns: float = 3.0,
    max_turns: int = 8,
    user_median: float = 60.0,
    answer_median: float = 150.0,
    session_rate: float = 1.0,
    think_time: float = 20.0,
    decode_time_per_token: float = 0.02,
    vocab_size: int = 32000,
    vocab_offset: int = 1000,
) -> Workload:
    """A deterministic token trace of multi-turn chat sessions from several tenants (~3.1 M prompt tokens).

    Structure (what a prefix cache can reuse):

    * ``n_tenants`` tenants, each with its own system prompt of ``system_tokens`` (uniform range) tokens;
      a session's tenant is drawn with Zipf(1) weights (tenant0 busiest).
    * A share ``rag_fraction`` of sessions (category ``"rag"``, else ``"chat"``) attach one of ``n_docs``
      documents of ``doc_tokens`` tokens after the system prompt; documents are drawn Zipf(``doc_zipf``),
      so a few are hot.
    * A session has ``1 + Geometric`` turns (mean ``mean_turns``, at most ``max_turns``). Turn 1's prompt
      is system prompt [+ document] + user message; turn k's prompt is turn k-1's prompt + turn k-1's
      answer + a new user message, so each turn extends its parent's prompt exactly. User messages and
      answers are log-normal in length (medians ``user_median``/``answer_median`` tokens); the answer
      tokens are stored as ``output_tokens`` and ``output_length`` is their count.
    * Sessions start as a Poisson process (``session_rate`` per second); turn k arrives after turn k-1's
      decode (``decode_time_per_token`` s per output token) plus an exponential think time
      (mean ``think_time`` s). Requests are ordered by arrival; exactly ``n_requests`` are kept, the
      earliest ones (later turns past the cut are dropped, never earlier ones).

    Columns: tenant (``tenant0``...), category (``chat``/``rag``), session (0-based session index),
    turn (1-based), parent (row of the previous turn), request_id = row. Token ids lie in
    ``[vocab_offset, vocab_size)``. The defaults give 2,000 requests in ~740 sessions, ~3.1 M prompt
    tokens over ~12 minutes.
    """
    _check_count("synthetic_chat", n_requests)
    if n_requests < 0 or n_tenants < 1 or n_docs < 1 or max_turns < 1 or mean_turns < 1:
        raise ConfigError("synthetic_chat: need n_requests >= 0, n_tenants, n_docs, max_turns >= 1, mean_turns >= 1")
    if not 0 <= vocab_offset < vocab_size:
        raise ConfigError(f"synthetic_chat: need 0 <= vocab_offset < vocab_size, got {vocab_offset}, {vocab_size}")
    if session_rate <= 0 or not 0 <= rag_fraction <= 1:
        raise ConfigError("synthetic_chat: need session_rate > 0 and 0 <= rag_fraction <= 1")
    rng = np.random.Generator(np.random.PCG64(seed))

    def tokens(n: int) -> np.ndarray:
        return rng.integers(vocab_offset, vocab_size, size=n, dtype=np.int64)

    systems = [tokens(int(rng.integers(system_tokens[0], system_tokens[1] + 1))) for _ in range(n_tenants)]
    docs = [tokens(int(rng.integers(doc_tokens[0], doc_tokens[1] + 1))) for _ in range(n_docs)]
    tenant_w = _zipf_weights(n_tenants, 1.0)
    doc_w = _zipf_weights(n_docs, doc_zipf)

    reqs: list[tuple[float, int, int, int, int, int, np.ndarray, np.ndarray]] = []
    # (arrival, session, turn, tenant, rag, seq, prompt, answer)
    start = 0.0
    session = 0
    while True:
        if len(reqs) >= n_requests:
            # Every later session starts after `start`; once the n-th earliest arrival is before it,
            # the first n requests by arrival are final.
            kth = np.partition(np.array([r[0] for r in reqs]), n_requests - 1)[n_requests - 1] if n_requests else 0.0
            if kth < start or n_requests == 0:
                break
        start += rng.exponential(1.0 / session_rate)
        tenant = int(rng.choice(n_tenants, p=tenant_w))
        rag = bool(rng.random() < rag_fraction)
        prefix = [systems[tenant]]
        if rag:
            prefix.append(docs[int(rng.choice(n_docs, p=doc_w))])
        n_turns = min(max_turns, int(rng.geometric(1.0 / mean_turns)))
        history = np.concatenate(prefix)
        t = start
        for turn in range(1, n_turns + 1):
            user = tokens(_lognormal_len(rng, user_median, 0.8, 4, 4000))
            prompt = np.concatenate([history, user])
            answer = tokens(_lognormal_len(rng, answer_median, 0.7, 8, 2000))
            reqs.append((t, session, turn, tenant, int(rag), len(reqs), prompt, answer))
            history = np.concatenate([prompt, answer])
            t += decode_time_per_token * len(answer) + rng.exponential(think_time)
        session += 1

    reqs.sort(key=lambda r: (r[0], r[5]))
    reqs = reqs[:n_requests]
    row_of = {(r[1], r[2]): i for i, r in enumerate(reqs)}
    prompts = [r[6] for r in reqs]
    answers = [r[7] for r in reqs]
    in_len = np.array([len(x) for x in prompts], dtype=np.int64)
    out_len = np.array([len(x) for x in answers], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return Workload(
        arrival=np.array([r[0] for r in reqs], dtype=np.float64),
        input_length=in_len,
        output_length=out_len,
        prompt_offsets=csr(in_len),
        prompt_values=np.concatenate(prompts) if prompts else empty,
        kind="tokens",
        session=np.array([r[1] for r in reqs], dtype=np.int64),
        turn=np.array([r[2] for r in reqs], dtype=np.int64),
        parent=np.array([row_of[(r[1], r[2] - 1)] if r[2] > 1 else -1 for r in reqs], dtype=np.int64),
        tenant=pd.Categorical.from_codes(
            np.array([r[3] for r in reqs], dtype=np.int64),
            categories=[f"tenant{i}" for i in range(n_tenants)],
        ),
        category=pd.Categorical.from_codes(np.array([r[4] for r in reqs], dtype=np.int64), categories=["chat", "rag"]),
        output_offsets=csr(out_len),
        output_values=np.concatenate(answers) if answers else empty,
        name=f"synthetic_chat-n{n_requests}-s{seed}",
        source="kvlab.workload.generate.synthetic_chat",
        meta={
            "generator": "synthetic_chat",
            "seed": seed,
            "n_tenants": n_tenants,
            "n_docs": n_docs,
            "rag_fraction": rag_fraction,
            "doc_zipf": doc_zipf,
            "mean_turns": mean_turns,
            "session_rate": session_rate,
            "think_time": think_time,
            "vocab_size": vocab_size,
            "vocab_offset": vocab_offset,
        },
    )


def zipf_blocks(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    n_prefixes: int = 100,
    prefix_blocks: tuple[int, int] = (1, 16),
    suffix_blocks: tuple[int, int] = (0, 4),
    block_size: int = 16,
    zipf_a: float = 1.1,
    rate: float = 10.0,
    max_output: int = 256,
) -> Workload:
    """A ``kind="blocks"`` trace of chained ids: Zipf-popular shared prefixes plus private suffixes.

    Prefix p (``n_prefixes`` of them, drawn Zipf(``zipf_a``)) is a chain of ``prefix_blocks`` (uniform,
    inclusive) block ids; a request takes the first k >= 1 of them (k uniform), then ``suffix_blocks``
    fresh ids used nowhere else. Only a request with a suffix has a partial last block (so a shared id is
    always a full block). Poisson arrivals at ``rate`` per second; output lengths uniform in
    ``[1, max_output]``. Ids are dense: prefix ids first, then suffix ids in request order.
    """
    _check_count("zipf_blocks", n_requests)
    if n_requests < 0 or n_prefixes < 1 or block_size < 1 or prefix_blocks[0] < 1 or rate <= 0:
        raise ConfigError("zipf_blocks: need n_requests >= 0, n_prefixes, block_size, prefix_blocks >= 1, rate > 0")
    rng = np.random.Generator(np.random.PCG64(seed))
    lengths = rng.integers(prefix_blocks[0], prefix_blocks[1] + 1, size=n_prefixes)
    bases = csr(lengths)[:-1]
    next_id = int(lengths.sum())
    which = rng.choice(n_prefixes, size=n_requests, p=_zipf_weights(n_prefixes, zipf_a))
    keep = rng.integers(1, lengths[which] + 1)
    n_suffix = rng.integers(suffix_blocks[0], suffix_blocks[1] + 1, size=n_requests)
    cut = np.where(n_suffix > 0, rng.integers(0, block_size, size=n_requests), 0)
    prompts = []
    for i in range(n_requests):
        pre = bases[which[i]] + np.arange(keep[i], dtype=np.int64)
        suf = np.arange(next_id, next_id + n_suffix[i], dtype=np.int64)
        next_id += int(n_suffix[i])
        prompts.append(np.concatenate([pre, suf]))
    counts = keep + n_suffix
    return Workload(
        arrival=np.cumsum(rng.exponential(1.0 / rate, size=n_requests)),
        input_length=counts * block_size - cut,
        output_length=rng.integers(1, max_output + 1, size=n_requests),
        prompt_offsets=csr(counts),
        prompt_values=np.concatenate(prompts) if prompts else np.zeros(0, dtype=np.int64),
        kind="blocks",
        block_size=block_size,
        name=f"zipf_blocks-n{n_requests}-s{seed}",
        source="kvlab.workload.generate.zipf_blocks",
        meta={"generator": "zipf_blocks", "seed": seed, "n_prefixes": n_prefixes, "zipf_a": zipf_a},
    )
