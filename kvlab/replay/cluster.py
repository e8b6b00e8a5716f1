"""N nodes over one trace, above one shared pool: the replay of a cluster with a global KV tier.

Each request goes to one node (static routing, a function of the trace alone:
:func:`kvlab.sim.simulator.route_requests`; ``prefix``: by the request's first prompt block that is not hot,
so a conversation stays on one node while a system prompt every request shares does not pull them all onto
one; ``round_robin``: request ``i`` to node ``i % N``). Every node has its own device cache (``capacity_blocks``,
``policy``) and its own lower tiers (``config.tiers``: a :class:`~kvlab.tiers.TierStack` per node); below them
all, ``pool`` is one :class:`~kvlab.tiers.stack.LowerTier` shared by the N stacks (the last tier of each, with
``inclusion="none"``): a block stored by any node is found by every node. Requests run one at a time in trace
order, each admitted on its node exactly as the replay admits it (:meth:`PrefixCache.admit`); a node's
requests see node-local request indices (``AccessContext.seq``), and an offline device policy is prepared
with its node's requests only.

With ``nodes=1`` and the pool as the last tier, the numbers are the replay's with that tier
(tests/test_tiers_cluster.py). Units as the replay's: tokens in ``hit_tokens_*``; blocks of the run's block
size in tier counts; bytes with a model. The summary's ``tiers`` list sums each private tier over the nodes
(``capacity_blocks`` per node) and gives the pool once (``shared: true``).

A driver beside the replay (it runs the replay's admission on each node); the mechanism it drives
(:class:`~kvlab.tiers.TierStack`, :class:`~kvlab.tiers.stack.LowerTier`) stays in kvlab.tiers.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from kvlab.cache import PrefixCache, pool_blocks
from kvlab.cache.compiled import ideal_hits_kernel
from kvlab.errors import ConfigError
from kvlab.hashing import EncodedWorkload
from kvlab.metrics import summarize
from kvlab.policies import EvictionPolicy, make_policy
from kvlab.profiles import kv_bytes_per_block, resolve_tiers
from kvlab.replay.replay import ReplayConfig, _requests_frame, admit_requests, encode, resolve_config
from kvlab.results import build_manifest, write_results
from kvlab.tiers.results import tier_columns, tier_summary
from kvlab.tiers.spec import Tier, check_tiers
from kvlab.tiers.stack import LowerTier, TierCounters, TierStack
from kvlab.workload.workload import Workload

ROUTERS = ("prefix", "round_robin")


@dataclass
class ClusterResult:
    """Per-request rows (trace order, with ``node``) and totals of one cluster replay."""

    requests: pd.DataFrame
    summary: dict
    config: dict  # the resolved replay config plus nodes, router and the pool
    trace: dict

    def save(self, out: str | Path) -> Path:
        """Write ``requests.parquet``, ``summary.json`` and ``manifest.json`` to ``out`` atomically."""
        manifest = build_manifest(self.config, trace=self.trace, seed=self.config.get("seed"), driver="cluster")
        return write_results(out, {"requests": self.requests}, self.summary, manifest)


def route(encoded: EncodedWorkload, nodes: int, router: str = "prefix") -> np.ndarray:
    """The node (0-based) of each request (int64 [n]): :func:`kvlab.sim.simulator.route_requests` on the
    requests' full prompt blocks."""
    if router not in ROUTERS:
        raise ConfigError(f"router must be one of {ROUTERS}, got {router!r}")
    from kvlab.sim.simulator import route_requests

    offsets = encoded.offsets.tolist()
    return route_requests(encoded.key_ids.tolist(), offsets, np.diff(encoded.offsets).tolist(), nodes, router)


def node_encoded(enc: EncodedWorkload, rows: np.ndarray) -> EncodedWorkload:
    """The requests ``rows`` of ``enc`` (in that order) as their own EncodedWorkload (same dense key ids)."""
    counts = np.diff(enc.offsets)[rows]
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    take = np.concatenate([np.arange(enc.offsets[r], enc.offsets[r + 1]) for r in rows]) if len(rows) else (
        np.zeros(0, np.int64))
    pick = (lambda a: None if a is None else a[rows])  # noqa: E731 - per-request columns
    return dataclasses.replace(
        enc, offsets=offsets, key_ids=enc.key_ids[take], prompt_tokens=enc.prompt_tokens[rows],
        num_blocks=enc.num_blocks[rows], truth_ids=None if enc.truth_ids is None else enc.truth_ids[take],
        arrival=pick(enc.arrival), category_codes=pick(enc.category_codes), turn=pick(enc.turn))


def replay_cluster(
    workload: Workload,
    config: ReplayConfig | None = None,
    *,
    nodes: int,
    pool: Tier | None = None,
    router: str = "prefix",
    encoded: EncodedWorkload | None = None,
    progress: bool = False,
    **overrides: object,
) -> ClusterResult:
    """Replay ``workload`` on ``nodes`` nodes, each with the device cache and private tiers of ``config``
    (``overrides`` set its fields), above the shared ``pool`` tier (None: no pool). Python core only."""
    if nodes < 1:
        raise ConfigError(f"nodes must be >= 1, got {nodes}")
    fields = {**(config.to_dict() if config else {}), **overrides}
    # a load limit with the pool as the only lower tier: ReplayConfig alone (no tiers) would refuse it
    pool_limit = fields.pop("max_load_tokens", None) if pool is not None and not fields.get("tiers") else None
    config = ReplayConfig(**fields)  # type: ignore[arg-type]
    max_load = config.max_load_tokens if pool_limit is None else pool_limit
    if config.backend == "compiled":
        raise ConfigError("replay_cluster runs the Python core; use backend='python' or 'auto'")
    config = resolve_config(workload, config)
    bs = config.block_size
    shared = resolve_tiers([pool], config.model, bs)[0] if pool is not None else None
    check_tiers([*config.tiers, *([shared] if shared else [])], max_load_tokens=max_load)
    if shared is not None and shared.inclusion != "none":
        raise ConfigError(f"shared tier {shared.name!r}: inclusion={shared.inclusion}; a shared pool needs "
                          "inclusion=none")
    if encoded is None:
        encoded = encode(workload, config, progress=progress)
    where = route(encoded, nodes, router)
    demand = int(encoded.num_blocks.sum())
    pool_tier = LowerTier(shared, len(config.tiers) + 1, bs, demand) if shared is not None else None
    levels = [*config.tiers, *([shared] if shared else [])]

    t0 = time.perf_counter()
    caches: list[PrefixCache] = []
    stacks: list[TierStack | None] = []
    local = np.zeros(len(where), np.int64)
    for node in range(nodes):
        rows = np.flatnonzero(where == node)
        local[rows] = np.arange(len(rows))
        policy = make_policy(config.policy, **config.policy_params)
        if type(policy).prepare is not EvictionPolicy.prepare:  # offline: the node's own future
            policy.prepare(node_encoded(encoded, rows))
        node_demand = int(encoded.num_blocks[rows].sum())
        cache = PrefixCache(pool_blocks(config.capacity_blocks, node_demand + 1), policy, block_size=bs)
        lower = [*config.tiers, *([pool_tier] if pool_tier else [])]
        stacks.append(TierStack(cache, lower, max_load_tokens=max_load, demand_blocks=demand)
                      if lower else None)
        caches.append(cache)
    cols = admit_requests(workload, encoded, config, caches, len(levels), progress, where.tolist(), local.tolist())
    cols.setdefault("tier_hit_blocks", np.zeros((len(workload), 0), np.int64))
    replay_s = time.perf_counter() - t0

    ideal = ideal_hits_kernel(encoded.offsets, encoded.key_ids, encoded.prompt_tokens, encoded.num_keys, bs,
                              config.mode == "ideal")
    frame = _requests_frame(workload, encoded, config, cols, ideal)
    if levels:
        frame = tier_columns(frame, cols, levels, bs)
    frame["node"] = where
    summary = summarize(frame, duration_s=workload.duration, capacity_blocks=config.capacity_blocks)
    summary.update(
        capacity_blocks=config.capacity_blocks, block_size=bs, policy=config.policy, mode=config.mode,
        hash=encoded.hash_label, backend="python", block_lookups=int(len(encoded.key_ids)),
        replay_seconds=replay_s, nodes=nodes, router=router,
        node_ideal_hit_rate=_node_ideal(encoded, where, nodes, config.mode == "ideal", frame),
    )
    if levels:
        summary.update(_tiers_summary(frame, stacks, config.tiers, shared, bs, config.model))
    summary["per_node"] = _per_node(frame, levels, nodes)
    limit = {"max_load_tokens": pool_limit} if pool_limit is not None else {}
    full = {**config.to_dict(), **limit, "nodes": nodes, "router": router,
            "pool": shared.to_dict() if shared else None}
    trace = {"source": workload.source, "sha256": workload.checksum, **workload.identity()}
    return ClusterResult(frame, summary, full, trace)


def _node_ideal(enc: EncodedWorkload, where: np.ndarray, nodes: int, ideal_mode: bool, frame: pd.DataFrame) -> float:
    """Token hit rate of unbounded caches private to each node (no pool): the most private tiers can give."""
    hits = 0
    for node in range(nodes):
        sub = node_encoded(enc, np.flatnonzero(where == node))
        blocks = ideal_hits_kernel(sub.offsets, sub.key_ids, sub.prompt_tokens, sub.num_keys, sub.block_size,
                                   ideal_mode)
        hits += int(np.minimum(blocks * sub.block_size, sub.prompt_tokens).sum())
    prompt = int(frame["prompt_tokens"].sum())
    return hits / prompt if prompt else 0.0


def _merged(tiers: list[LowerTier]) -> SimpleNamespace:
    """One tier's counters summed over the nodes' copies of it (a private tier) or its one copy (the pool),
    with the chunks still unread at the end and the chunks resident."""
    counters = TierCounters(**{f.name: sum(getattr(t.counters, f.name) for t in tiers)
                               for f in dataclasses.fields(TierCounters)})
    return SimpleNamespace(counters=counters, chunk=tiers[0].chunk, unread=sum(len(t.unread) for t in tiers),
                           resident=sum(t.cache.num_cached_blocks for t in tiers))


def _tiers_summary(frame: pd.DataFrame, stacks: list[TierStack | None], private: list[Tier], shared: Tier | None,
                   bs: int, model: str | None) -> dict:
    """``device_token_hit_rate`` and ``tiers`` (private tiers summed over nodes, then the pool), each tier
    with ``shared``, ``resident_blocks`` (blocks held at the end), ``ever_full`` (it evicted or skipped a
    store: its capacity bound) and ``stores_never_loaded`` (blocks stored and never loaded in the whole
    trace: ``stores_never_read``, evicted unread, plus those still unread at the end)."""
    levels = [*private, *([shared] if shared else [])]
    merged = [_merged([s.tiers[i] for s in stacks if s is not None]) for i in range(len(private))]
    if shared is not None:
        merged.append(_merged([stacks[0].tiers[-1]]))
    per_block = kv_bytes_per_block(model, bs)
    out = tier_summary(frame, [m.counters for m in merged], levels, bs, per_block)
    for row, m, t in zip(out["tiers"], merged, levels, strict=True):
        row["shared"] = t is shared
        row["resident_blocks"] = m.resident * m.chunk
        row["ever_full"] = bool(row["evictions"] or row["stores_skipped"])
        row["stores_never_loaded"] = (m.counters.evicted_unread + m.unread) * m.chunk
        row["capacity_bytes"] = t.capacity_blocks * per_block if per_block else None
    return out


def _per_node(frame: pd.DataFrame, levels: list[Tier], nodes: int) -> list[dict]:
    """Per node: requests, prompt tokens and token hit rate, with the device's and each tier's share."""
    cols = ["prompt_tokens", "hit_tokens", *[c for c in frame if c.startswith("hit_tokens_")]]
    sums = frame.groupby("node")[cols].sum().reindex(range(nodes), fill_value=0)
    counts = frame.groupby("node").size().reindex(range(nodes), fill_value=0)
    out = []
    for node, row in sums.iterrows():
        prompt = float(row["prompt_tokens"])
        entry = {"node": int(node), "requests": int(counts[node]), "prompt_tokens": int(prompt),
                 "token_hit_rate": row["hit_tokens"] / prompt if prompt else 0.0}
        for c in cols[2:]:
            entry[c.replace("hit_tokens_", "hit_share_")] = row[c] / prompt if prompt else 0.0
        out.append(entry)
    return out
