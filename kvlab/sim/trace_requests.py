"""A trace as the serving scheduler's requests, shared by the simulator and the engine executor: arrivals
scaled to a rate, every request's known block keys (prompt, then known output tokens), routing to instances,
the ideal hits and the KV manager each instance starts with.

Units: times in seconds, counts in blocks of ``block_size`` tokens, prompts in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.cache import AccessContext, PrefixCache
from kvlab.cache.manager import KVCacheManager
from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher, EncodedWorkload, encode_workload
from kvlab.policies import EvictionPolicy, make_policy
from kvlab.sim.scheduler import Request
from kvlab.workload.workload import Workload

ROUTERS = ("prefix", "round_robin")


def route_requests(keys: list, offsets: list[int], prompt_full: list[int], instances: int,
                   router: str = "prefix") -> np.ndarray:
    """The instance (0-based) of each request, a function of the trace alone (static routing).

    ``round_robin``: request i goes to ``i % instances``. ``prefix`` (cache affinity): a request goes by
    its first prompt block key that is not *hot* (contained in more than ``n / (2 × instances)`` of the
    ``n`` prompts, such as a system prompt every request shares), so requests that share a conversation
    or document prefix share an instance and its cache while a shared system prompt does not pull every
    request onto one instance; a request whose prompt blocks are all hot goes round robin.
    """
    n = len(offsets) - 1
    if instances == 1:
        return np.zeros(n, dtype=np.int64)
    if router == "round_robin":
        return np.arange(n, dtype=np.int64) % instances
    if router != "prefix":
        raise ConfigError(f"router must be one of {ROUTERS}, got {router!r}")
    prompt_keys = [k for i in range(n) for k in keys[offsets[i] : offsets[i] + prompt_full[i]]]
    counts = np.bincount(np.asarray(prompt_keys, dtype=np.int64)) if prompt_keys else np.zeros(0, np.int64)
    hot = n / (2 * instances)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        out[i] = i % instances
        for k in keys[offsets[i] : offsets[i] + prompt_full[i]]:
            if counts[k] <= hot:
                mixed = (k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # spread dense ids (Fibonacci hashing)
                out[i] = (mixed >> 32) % instances
                break
    return out


def _future(requests: list[Request], block_size: int, num_keys: int, label: str) -> EncodedWorkload:
    """What an offline policy's ``prepare`` reads: the instance's requests' known keys in arrival order."""
    counts = np.fromiter((len(r.keys) for r in requests), dtype=np.int64, count=len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    keys = np.fromiter((k for r in requests for k in r.keys), dtype=np.int64, count=int(offsets[-1]))
    prompt = np.fromiter((r.prompt_tokens for r in requests), dtype=np.int64, count=len(requests))
    return EncodedWorkload(offsets=offsets, key_ids=keys, num_keys=num_keys, prompt_tokens=prompt,
                           num_blocks=-(-prompt // block_size), block_size=block_size, hash_label=label)


def scaled_arrivals(workload: Workload, *, rate: float | None = None, time_scale: float = 1.0) -> tuple[np.ndarray,
                                                                                                        float]:
    """Arrival times in simulated seconds and the factor applied: ``arrival × time_scale``, or with ``rate``
    (requests/s) the factor that makes the mean rate ``(n - 1) / duration`` equal ``rate``."""
    arrival = np.asarray(workload.arrival, dtype=np.float64)
    if rate is not None:
        duration = workload.duration
        if len(workload) < 2 or duration <= 0:
            raise ConfigError("rate needs a trace with at least two distinct arrival times")
        time_scale = ((len(workload) - 1) / duration) / rate
    return arrival * time_scale, float(time_scale)


def _gather(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(values[s : s + c])`` over the ranges, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return values[:0].copy()
    offsets = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    return values[np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)]


def sequence_keys(workload: Workload, hasher: BlockHasher, block_size: int) -> tuple[np.ndarray, np.ndarray,
                                                                                     np.ndarray, int]:
    """Dense keys of every request's known full blocks: prompt, then known output tokens (token traces).

    Returns ``(seq_offsets, seq_keys, prompt_full_blocks, num_keys)``: request i's keys are
    ``seq_keys[seq_offsets[i]:seq_offsets[i + 1]]``, of which the first ``prompt_full_blocks[i]`` are its
    prompt's (a chained key does not depend on what follows it). Hash traces: prompt keys only.
    """
    prompt = np.asarray(workload.input_length, dtype=np.int64)
    if workload.kind == "tokens" and workload.output_offsets is not None:
        out_counts = np.diff(workload.output_offsets)
        n = len(workload)
        src = np.concatenate([workload.prompt_values, workload.output_values])
        starts = np.empty(2 * n, dtype=np.int64)
        counts = np.empty(2 * n, dtype=np.int64)
        starts[0::2] = workload.prompt_offsets[:-1]
        counts[0::2] = prompt
        starts[1::2] = len(workload.prompt_values) + workload.output_offsets[:-1]
        counts[1::2] = out_counts
        lengths = prompt + out_counts
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        extended = Workload(
            arrival=workload.arrival, input_length=lengths, output_length=workload.output_length,
            prompt_offsets=offsets, prompt_values=_gather(src, starts, counts), kind="tokens",
            adapter=workload.adapter, salt=workload.salt, name=workload.name,
        )
        enc = encode_workload(extended, hasher, block_size)
    else:
        enc = encode_workload(workload, hasher, block_size)
    return enc.offsets, enc.key_ids, prompt // block_size, enc.num_keys


def ideal_hits(keys: list, offsets: list[int], prompt: list[int], output: list[int], block_size: int) -> np.ndarray:
    """Hit blocks per request with unbounded capacity and instant service, in arrival order.

    Request i looks up its prompt's keys (capped at ``(prompt - 1) // block_size`` blocks, stopping at the
    first miss), then leaves every full block it computes cached: ``(prompt + output - 1) // block_size``
    of its known keys (output blocks are keyed on token traces only, as in the simulation).
    """
    seen: set = set()
    out = np.zeros(len(prompt), dtype=np.int64)
    for i, p in enumerate(prompt):
        a, b = offsets[i], offsets[i + 1]
        limit = min(b - a, (p - 1) // block_size)
        h = 0
        while h < limit and keys[a + h] in seen:
            h += 1
        out[i] = h
        seen.update(keys[a + h : a + min(b - a, (p + output[i] - 1) // block_size)])
    return out


def _labels(col: pd.Categorical | None, n: int) -> list:
    return [None] * n if col is None else [None if pd.isna(x) else str(x) for x in col]


@dataclass
class TraceRequests:
    """A trace as the scheduler's requests (trace order), shared by :func:`simulate` and the engine executor.

    ``arrival``: simulated seconds, the trace's times × ``scale``. Request i's known block keys (prompt, then
    known output tokens on token traces) are ``keys[offsets[i]:offsets[i + 1]]``, the first
    ``prompt_full[i]`` of them its prompt's; ``num_keys`` dense keys in all, hashed under ``hash_label``.
    ``prompt``: prompt tokens per request. Output lengths of 0 become 1 (a request samples at least one).
    """

    requests: list[Request]
    arrival: np.ndarray
    scale: float
    keys: list
    offsets: list[int]
    prompt: np.ndarray
    prompt_full: np.ndarray
    num_keys: int
    hash_label: str


def trace_requests(workload: Workload, *, model_id: str, block_size: int, rate: float | None, time_scale: float,
                   hash: str, root_seed: int) -> TraceRequests:
    """Scale the arrivals, key every request's known blocks (:func:`sequence_keys`) and build its
    :class:`~kvlab.sim.scheduler.Request` with the trace's labels in its access context."""
    arrival, scale = scaled_arrivals(workload, rate=rate, time_scale=time_scale)
    hasher = BlockHasher(hash, root_seed=root_seed, model_id=model_id)
    seq_off, seq_keys, prompt_full, num_keys = sequence_keys(workload, hasher, block_size)
    n = len(workload)
    prompt = np.asarray(workload.input_length, dtype=np.int64)
    keys, offs = seq_keys.tolist(), seq_off.tolist()
    rid = workload.request_id.tolist()
    tenant, category = _labels(workload.tenant, n), _labels(workload.category, n)
    turn = workload.turn.tolist() if workload.turn is not None else [-1] * n
    arr = arrival.tolist()
    p_list = prompt.tolist()
    o_list = np.maximum(np.asarray(workload.output_length, dtype=np.int64), 1).tolist()
    requests = [
        Request(
            request_id=rid[r], prompt_tokens=p_list[r], keys=keys[offs[r]:offs[r + 1]],
            ctx=AccessContext(time=arr[r], seq=r, request_id=rid[r], tenant=tenant[r], category=category[r],
                              turn=turn[r], prompt_tokens=p_list[r]),
            row=r, arrival=arr[r], output_length=o_list[r],
        )
        for r in range(n)
    ]
    return TraceRequests(requests, arrival, scale, keys, offs, prompt, prompt_full, num_keys, hasher.label)


def serving_demand_blocks(workload: Workload, block_size: int) -> int:
    """An upper bound on the blocks serving ``workload`` can hold at once: every block of every request's
    prompt and output (outputs of 0 are served as 1 token), plus one. A pool this large never evicts or
    preempts, so it gives the numbers of any larger capacity (see :func:`kvlab.cache.pool_blocks`)."""
    tokens = workload.input_length + np.maximum(workload.output_length, 1)
    return int((-(-tokens // block_size)).sum()) + 1


def make_manager(requests: list[Request], trace: TraceRequests, *, policy: str, policy_params: dict | None,
                 capacity_blocks: int, block_size: int, cache_at: str, tiers: list | None = None,
                 max_load_tokens: int | None = None) -> KVCacheManager:
    """A cold KV manager over ``capacity_blocks`` blocks of ``block_size`` tokens with a fresh ``policy`` for
    ``requests`` (one instance's, in FCFS order); an offline policy is prepared with their known keys. With
    ``tiers`` (resolved to blocks) a :class:`~kvlab.tiers.TierStack` is attached to its cache and the manager
    is a :class:`~kvlab.tiers.serving.TieredKVManager` (its ``serving`` is the caller's to set)."""
    pol = make_policy(policy, **(policy_params or {}))
    if type(pol).prepare is not EvictionPolicy.prepare:  # offline policies read the future
        pol.prepare(_future(requests, block_size, trace.num_keys, trace.hash_label))
    cache = PrefixCache(capacity_blocks, pol, block_size=block_size)
    if not tiers:
        return KVCacheManager(cache, cache_at=cache_at)
    from kvlab.tiers import TierStack
    from kvlab.tiers.serving import TieredKVManager

    demand = sum(-(-(r.prompt_tokens + r.output_length) // block_size) for r in requests) + 1
    TierStack(cache, tiers, max_load_tokens=max_load_tokens, demand_blocks=demand)
    return TieredKVManager(cache, cache_at=cache_at)
