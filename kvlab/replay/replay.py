"""The replay driver: sequential, cache-only, no timing (docs/semantics.md, "The sequential replay").

Each request, in trace order, is looked up, admitted (hits pinned, new blocks allocated and keyed) and
released before the next one, with its prompt only. Two backends give identical results:

* ``compiled``: the numba kernel (``kvlab.cache.compiled``) with the policy's compiled hooks;
* ``python``: the shared :class:`~kvlab.cache.PrefixCache` with any registered policy (plugins too).

``backend="auto"`` picks ``compiled`` when the policy has compiled hooks. (The old field name
``engine`` is still accepted: "engine" now means the real transformers engine only.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
from pydantic import model_validator
from tqdm.auto import tqdm

from kvlab.arguments import require_instance
from kvlab.cache import AccessContext, PrefixCache, pool_blocks
from kvlab.cache.compiled import ideal_hits_kernel, run_compiled, warm_up
from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher, EncodedWorkload, encode_workload
from kvlab.metrics import summarize
from kvlab.names import canonical_keys
from kvlab.policies import EvictionPolicy, make_policy
from kvlab.policies.base import resolved_policy_params
from kvlab.profiles import kv_bytes_per_block, resolve_tiers
from kvlab.results import build_manifest, write_results
from kvlab.results.frame import requests_frame
from kvlab.schema import CapacityBlocks, HashScheme, Seed, renamed_fields
from kvlab.tiers import Tier, TierCounters, TierStack
from kvlab.tiers.compiled import TieredReplay
from kvlab.tiers.config import ReplayCacheConfig
from kvlab.tiers.results import compiled_tiers, tier_columns, tier_summary
from kvlab.workload.workload import Workload, require_workload


class ReplayConfig(ReplayCacheConfig):
    """Everything that determines a replay's numbers (capacity in blocks, block size in tokens).

    The cache fields and their checks (policy name, its parameters, the tier rules) are the ones every driver
    shares (kvlab.tiers.config.ReplayCacheConfig); here the capacity is required. Validated at construction
    (kvlab.schema): ranges, NaN/inf, the policy name and its parameters (checked by the policy) — a bad value
    raises ConfigError naming the field and its CLI flag.
    """

    capacity_blocks: CapacityBlocks
    hash: HashScheme = "xxh3_128"
    root_seed: Seed = 0
    model_id: str = "kvlab"
    seed: Seed = 0
    model: str | None = None  # names the KV bytes per block: tier sizes in GiB, bytes written and read

    _old_names = model_validator(mode="before")(renamed_fields)

    _FIELD_ORDER: ClassVar[tuple[str, ...]] = (
        "capacity_blocks", "block_size", "policy", "policy_params", "hash", "root_seed", "model_id", "mode",
        "backend", "verify", "seed", "tiers", "max_load_tokens", "model")

    #: fields added after run identities were first written: left out of ``to_dict`` (the identity) at their
    #: defaults, so a run without tiers keeps its run id
    _LATER: ClassVar[dict[str, Any]] = {"tiers": [], "max_load_tokens": None, "model": None}

    def validate(self) -> None:
        """Checks that need the policy instance (construction already checked everything else)."""
        if self.backend == "compiled" and make_policy(self.policy, **self.policy_params).compiled is None:
            raise ConfigError(f"no compiled kernel for policy {self.policy!r}; use backend='python' (--backend python)")
        if self.backend == "compiled" and not compiled_tiers(self.tiers):
            raise ConfigError("no compiled kernel for these tiers; use backend='python' (--backend python)")


@dataclass
class ReplayResult:
    """Per-request rows (trace order) and totals of one replay."""

    requests: pd.DataFrame
    summary: dict
    config: ReplayConfig
    trace: dict

    def save(self, out: str | Path) -> Path:
        """Write ``requests.parquet``, ``summary.json`` and ``manifest.json`` to ``out`` atomically."""
        manifest = build_manifest(self.config.to_dict(), trace=self.trace, seed=self.config.seed, driver="replay")
        return write_results(out, {"requests": self.requests}, self.summary, manifest)


def uses_compiled(policy: EvictionPolicy, backend: str, tiers: list[Tier]) -> bool:
    """Whether :func:`replay` runs ``policy`` on the compiled kernel (``backend`` auto or compiled, a policy with
    compiled hooks, tiers the kernel supports), not on the Python core."""
    return policy.compiled is not None and backend != "python" and compiled_tiers(tiers)


def resolve_config(workload: Workload, config: ReplayConfig) -> ReplayConfig:
    """``config`` with every default that changes numbers filled in: the block size from the workload,
    the policy's parameters with its constructor defaults. Its ``to_dict()`` is the config part of the
    run identity (kvlab.results); the capacity is kept as given."""
    return ReplayConfig(**{
        **config.to_dict(),
        "block_size": config.block_size or workload.default_block_size,
        "policy_params": resolved_policy_params(config.policy, config.policy_params),
        "tiers": resolve_tiers(config.tiers, config.model, config.block_size or workload.default_block_size),
    })


def make_hasher(config: ReplayConfig) -> BlockHasher:
    return BlockHasher(config.hash, root_seed=config.root_seed, model_id=config.model_id)


def encode(workload: Workload, config: ReplayConfig, *, progress: bool = False) -> EncodedWorkload:
    """Hash a workload's prompts for ``config`` (reusable across capacities and policies)."""
    workload = require_workload(workload)
    require_instance(config, ReplayConfig, "config")
    block_size = config.block_size or workload.default_block_size
    return encode_workload(workload, make_hasher(config), block_size, verify=config.verify, progress=progress)


def replay(
    workload: Workload,
    config: ReplayConfig | None = None,
    *,
    encoded: EncodedWorkload | None = None,
    progress: bool = False,
    **overrides: object,
) -> ReplayResult:
    """Replay ``workload`` through one cache; ``overrides`` set ReplayConfig fields.

    Pass ``encoded`` (from :func:`encode` with the same hash settings) to skip hashing in sweeps. A wrong
    argument type (a path instead of a Workload, a dict as ``config``) is one ConfigError naming the argument.
    """
    workload = require_workload(workload)
    require_instance(config, ReplayConfig, "config", optional=True)
    require_instance(encoded, EncodedWorkload, "encoded", optional=True)
    overrides = canonical_keys(overrides)  # old field names (kvlab.names) override under their new ones
    if config is None:
        config = ReplayConfig(**overrides)  # type: ignore[arg-type]
    elif overrides:
        config = ReplayConfig(**{**config.to_dict(), **overrides})
    config.validate()
    config = resolve_config(workload, config)  # block size and policy defaults filled in: the run's identity
    if encoded is None:
        encoded = encode(workload, config, progress=progress)
    policy = make_policy(config.policy, **config.policy_params)
    use_compiled = uses_compiled(policy, config.backend, config.tiers)
    # state for at most the blocks the trace ever allocates (numbers unchanged; the capacity is recorded)
    pool = pool_blocks(config.capacity_blocks, int(encoded.num_blocks.sum()) + 1)
    compile_s = 0.0
    tiered: TieredReplay | None = None
    if use_compiled:
        policy.prepare(encoded)
        params = policy.compiled_params()
        if config.tiers:
            tiered = TieredReplay(policy.compiled, params, config.tiers, encoded, pool, config.mode == "ideal",
                                  config.max_load_tokens)
            compile_s = tiered.warm_up()
        else:
            compile_s = warm_up(policy.compiled, encoded, pool, config.mode == "ideal", params)
    t0 = time.perf_counter()
    if tiered is not None:
        cols = tiered.run()
    elif use_compiled:
        cols = run_compiled(policy.compiled, encoded, pool, config.mode == "ideal", params)
    else:
        cols = _replay_python(workload, encoded, config, policy, pool, progress)
    counters: list[TierCounters] | None = cols.pop("_counters", None)  # type: ignore[assignment]
    replay_s = time.perf_counter() - t0
    ideal = ideal_hits_kernel(
        encoded.offsets, encoded.key_ids, encoded.prompt_tokens, encoded.num_keys, encoded.block_size,
        config.mode == "ideal",
    )
    frame = _requests_frame(workload, encoded, config, cols, ideal)
    if config.tiers:
        frame = tier_columns(frame, cols, config.tiers, encoded.block_size)
    summary = summarize(frame, duration_s=workload.duration, capacity_blocks=config.capacity_blocks)
    summary.update(
        capacity_blocks=config.capacity_blocks,
        block_size=encoded.block_size,
        policy=config.policy,
        mode=config.mode,
        hash=encoded.hash_label,
        backend="compiled" if use_compiled else "python",
        block_lookups=int(len(encoded.key_ids)),
        replay_seconds=replay_s,
        compile_seconds=compile_s,
    )
    if config.tiers:
        summary.update(tier_summary(frame, counters, config.tiers, encoded.block_size,
                                    kv_bytes_per_block(config.model, encoded.block_size)))
    trace = {"source": workload.source, "sha256": workload.checksum, **workload.identity()}
    return ReplayResult(frame, summary, config, trace)


def _replay_python(
    workload: Workload, enc: EncodedWorkload, config: ReplayConfig, policy: EvictionPolicy, pool: int,
    progress: bool,
) -> dict[str, np.ndarray]:
    policy.prepare(enc)
    cache = PrefixCache(pool, policy, block_size=enc.block_size)
    stack = TierStack(cache, config.tiers, max_load_tokens=config.max_load_tokens,
                      demand_blocks=int(enc.num_blocks.sum())) if config.tiers else None
    out = admit_requests(workload, enc, config, [cache], len(config.tiers), progress)
    if stack is not None:
        out["_counters"] = [t.counters for t in stack.tiers]  # type: ignore[assignment]
    return out


def admit_requests(
    workload: Workload, enc: EncodedWorkload, config: ReplayConfig, caches: list[PrefixCache], levels: int,
    progress: bool, node_of: list[int] | None = None, seq_of: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """The Python core's per-request loop: each request, in trace order, admitted with its whole prompt into
    ``caches[node_of[r]]`` (default: the one cache) as request ``seq_of[r]`` of its cache (default: ``r``) and
    released; the :data:`PYTHON_COLUMNS`, ``admitted`` and, with ``levels`` lower tiers, ``tier_hit_blocks``
    (blocks loaded per tier). Shared by the replay and the cluster replay (kvlab.replay.cluster)."""
    n = len(enc.prompt_tokens)
    out = {name: np.zeros(n, np.int64) for name in PYTHON_COLUMNS}
    tier_hits = np.zeros((n, levels), np.int64)
    admitted = np.zeros(n, np.bool_)
    offsets = enc.offsets.tolist()
    keys_all = enc.key_ids.tolist()
    truths_all = enc.truth_ids.tolist() if enc.truth_ids is not None else None
    prompt = enc.prompt_tokens.tolist()
    arrival = workload.arrival.tolist()
    rid = workload.request_id.tolist()
    tenant = _labels(workload.tenant)
    category = _labels(workload.category)
    turn = workload.turn.tolist() if workload.turn is not None else None
    desc = f"{'cluster' if len(caches) > 1 else 'replay'} {config.policy}"
    cache = caches[0]
    for r in tqdm(range(n), disable=not progress, desc=desc, unit="req"):
        a, b = offsets[r], offsets[r + 1]
        if node_of is not None:
            cache = caches[node_of[r]]
        ctx = AccessContext(
            time=arrival[r], seq=r if seq_of is None else seq_of[r], request_id=rid[r], prompt_tokens=prompt[r],
            tenant=tenant[r] if tenant else None, category=category[r] if category else None,
            turn=turn[r] if turn else -1,
        )
        adm = cache.admit(keys_all[a:b], prompt[r], ctx, mode=config.mode,
                          truths=truths_all[a:b] if truths_all is not None else None)
        if adm is not None:
            admitted[r] = True
            out["hit_blocks"][r] = adm.hit_blocks
            out["new_blocks"][r] = adm.new_blocks
            out["evictions"][r] = adm.evictions
            out["orphan_evictions"][r] = adm.orphan_evictions
            out["collisions"][r] = adm.collisions
            if adm.tier_hits:
                tier_hits[r] = adm.tier_hits
            cache.release(adm.blocks, ctx)
        out["cached_blocks"][r] = cache.num_cached_blocks
        out["orphan_blocks"][r] = cache.num_orphan_blocks
    out["admitted"] = admitted
    if levels:
        out["tier_hit_blocks"] = tier_hits
    return out


PYTHON_COLUMNS = ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "collisions", "cached_blocks",
                  "orphan_blocks")


def _labels(col: pd.Categorical | None) -> list | None:
    return None if col is None else [None if pd.isna(x) else str(x) for x in col]


def _requests_frame(
    workload: Workload, enc: EncodedWorkload, config: ReplayConfig, cols: dict[str, np.ndarray], ideal: np.ndarray
) -> pd.DataFrame:
    """The common per-request columns (:func:`kvlab.results.frame.requests_frame`), ``collisions`` when
    verifying, then the labels."""
    return requests_frame(
        workload, enc.block_size, cols, ideal, prompt_tokens=enc.prompt_tokens, full_blocks=np.diff(enc.offsets),
        extra={"collisions": cols["collisions"]} if config.verify else None,
    )
