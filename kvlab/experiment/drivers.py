"""One experiment run on its driver: the workload (trace transforms), the resolved config, the identity, the run.

The three drivers share the cache core: ``replay`` (kvlab.replay), ``simulate`` (kvlab.sim, simulated time) and
``engine`` (kvlab.sim.run_engine_serving: the simulator's scheduler driving the real engine, measured time).
A run's identity (kvlab.results.identity) is its resolved driver config and its workload's content, so a trace
transform (``trace.limit``, ``trace.resample_seed``) or the tokenizer of a text trace (``trace.tokenizer``)
changes the run id exactly when it changes the requests (a hash trace's ids never depend on it).
An engine run's identity also holds the whole ``engine:`` section; its times are measurements (wall or thread
seconds) and are not reproducible, which its manifest says.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.errors import ConfigError
from kvlab.experiment.config import Experiment
from kvlab.experiment.sections import EngineSpec, capacity_blocks, engine_model_config
from kvlab.results import run_identity
from kvlab.tiers.config import CacheConfig
from kvlab.workload.workload import Workload

_ENCODINGS: dict[tuple, object] = {}  # the last hashed trace of this process
#: the manifest's word on an engine run's numbers
ENGINE_NOTE = ("engine times (ttft_s, tpot_s, wall_seconds, throughputs...) are measured seconds of this machine's "
               "run: not reproducible; with timing-dependent scheduling (arrivals, batches) hits may vary too")


# ----------------------------------------------------------------------------- the workload
_STAMPS: dict[str, tuple] = {}  # trace path -> the file version this process read last


def _file_stamp(path: str) -> tuple | None:
    """(size, mtime in ns, inode) of a trace file: part of the in-process trace caches' key, so a trace edited in
    place between two runs of one process is read again. None for a name kvlab resolves (a registry trace); a
    file that vanished since this process read it keeps its last version (the copy in memory is that trace)."""
    try:
        st = os.stat(path)
    except OSError:
        return _STAMPS.get(path)
    _STAMPS[path] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return _STAMPS[path]


@functools.lru_cache(maxsize=4)
def _workload(path: str, format: str | None, limit: int | None, stamp: tuple | None = None,
              tokenizer: str | None = None) -> Workload:
    """The trace of a run, loaded once per process and file version (``stamp``: :func:`_file_stamp`); text
    tokenised with ``tokenizer`` (``trace.tokenizer``; None: kvlab-bpe, loaded only for text)."""
    from kvlab.workload.trace_tokenizer import load_trace_with

    workload, _ = load_trace_with(path, format=format, tokenizer=tokenizer, field="trace.tokenizer")
    return workload.head(limit) if limit is not None else workload


@functools.lru_cache(maxsize=16)
def _resampled(path: str, format: str | None, limit: int | None, seed: int, by: str,
               stamp: tuple | None = None, tokenizer: str | None = None) -> Workload:
    """One session resample of a trace (kvlab.analysis.resample_sessions), deterministic given ``seed``."""
    from kvlab.analysis.resample import prefix_groups, resample_sessions

    workload = _workload(path, format, limit, stamp, tokenizer)
    if by == "session" and workload.session is None:
        raise ConfigError(f"trace.resample_by: trace {path} has no session column; allowed here: 'prefix' or 'auto' "
                          "(requests sharing their first two prompt values form a session)")
    groups = prefix_groups(workload) if by == "prefix" or (by == "auto" and workload.session is None) else None
    return resample_sessions(workload, np.random.default_rng(seed), groups)


def workload_of(run: Experiment) -> Workload:
    """The run's requests: the trace (text tokenised with ``trace.tokenizer``), its first ``limit``, then its
    session resample when ``resample_seed`` is set."""
    t = run.trace
    stamp = _file_stamp(t.path)
    if t.resample_seed is None:
        return _workload(t.path, t.format, t.limit, stamp, t.tokenizer)
    return _resampled(t.path, t.format, t.limit, t.resample_seed, t.resample_by, stamp, t.tokenizer)


def block_size_of(run: Experiment, workload: Workload) -> int:
    """The run's block size (tokens); a hash trace's block size must divide it."""
    bs = run.cache.block_size or workload.default_block_size
    if workload.kind == "blocks" and bs % workload.block_size:
        raise ConfigError(f"cache.block_size: {bs} is not a multiple of the block size of trace "
                          f"{run.trace.path} ({workload.block_size} tokens per hash id); allowed: multiples of "
                          f"{workload.block_size}")
    return bs


# ----------------------------------------------------------------------------- the engine's config
def _engine_vocab(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = text.get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None


@dataclasses.dataclass(frozen=True)
class EngineRunConfig:
    """The resolved config of an engine run: the cache (kvlab.tiers.config.CacheConfig, the section every driver
    embeds: block size and capacity in blocks resolved, the policy's parameters with its defaults, tiers), the
    hasher, the seed and the whole ``engine`` section, plus the model's transformers config (a checkpoint's
    weights are named by path, not hashed). A dataclass, not a Schema: ``model_config`` is pydantic's own name."""

    engine: EngineSpec
    model_config: dict
    cache: CacheConfig
    hash: str
    root_seed: int
    seed: int

    def to_dict(self) -> dict:
        """The run identity's config: the cache's fields flat, in the order first recorded (tiers without their
        unset options)."""
        c = self.cache
        return {"engine": self.engine.model_dump(mode="json"), "model_config": self.model_config,
                "policy": c.policy, "policy_params": c.policy_params, "capacity_blocks": c.capacity_blocks,
                "block_size": c.block_size, "hash": self.hash, "root_seed": self.root_seed, "seed": self.seed,
                "tiers": [t.model_dump(mode="json", exclude_none=True) for t in c.tiers],
                "max_load_tokens": c.max_load_tokens}


def _engine_config(run: Experiment, workload: Workload, bs: int, cap: int, params: dict) -> EngineRunConfig:
    if workload.kind != "tokens":
        raise ConfigError(f"trace: the engine driver serves token traces; {run.trace.path} holds block hash ids "
                          "(use a token or request-log trace, or driver: replay / simulate)")
    spec = run.engine or EngineSpec()
    model_config = engine_model_config(spec.model)
    vocab = _engine_vocab(model_config)
    top = int(workload.prompt_values.max(initial=-1))
    if vocab is not None and top >= vocab:
        raise ConfigError(f"trace: token id {top} of {run.trace.path} is not below engine.model {spec.model!r}'s "
                          f"vocabulary ({vocab} ids)")
    c = run.cache
    cache = CacheConfig(block_size=bs, capacity_blocks=cap, policy=c.policy, policy_params=params, tiers=c.tiers,
                        max_load_tokens=c.max_load_tokens)
    return EngineRunConfig(spec, model_config, cache, run.hasher.scheme, run.hasher.root_seed, run.seed)


# ----------------------------------------------------------------------------- config, identity, run
def driver_config(run: Experiment, workload: Workload):  # noqa: ANN201 - a ReplayConfig, SimConfig or EngineRunConfig
    """The run's resolved driver config (every default that changes numbers filled in)."""
    from kvlab.policies.base import resolved_policy_params

    bs = block_size_of(run, workload)
    cap = capacity_blocks(run.cache, bs, run.model)
    c = run.cache
    params = resolved_policy_params(c.policy, c.policy_params)
    if run.driver == "engine":
        return _engine_config(run, workload, bs, cap, params)
    if run.driver == "replay":
        from kvlab.replay import ReplayConfig, resolve_config

        extra = {"model": run.model, "max_load_tokens": c.max_load_tokens} if c.tiers else {}
        config = ReplayConfig(capacity_blocks=cap, block_size=bs, policy=c.policy, policy_params=params,
                              hash=run.hasher.scheme, root_seed=run.hasher.root_seed, model_id=run.hasher.model_id,
                              mode=c.mode, backend=c.backend, verify=c.verify, seed=run.seed, tiers=c.tiers, **extra)
        return resolve_config(workload, config)
    from kvlab.sim.simulator import SimConfig

    return SimConfig(model=run.model or "llama-3-8b", hardware=run.hardware or "h100", policy=c.policy,
                     policy_params=params, capacity_blocks=cap, block_size=bs, hash=run.hasher.scheme,
                     root_seed=run.hasher.root_seed, seed=run.seed, tiers=c.tiers, max_load_tokens=c.max_load_tokens,
                     **run.simulate)


def identity_of(run: Experiment, workload: Workload) -> dict:
    config = driver_config(run, workload).to_dict()
    if run.driver != "replay":  # replay runs keep the ids ``kvlab sweep`` gives them
        config = {"driver": run.driver, **config}
    return run_identity(config, workload.identity())


def _run_engine(workload: Workload, config: EngineRunConfig):  # noqa: ANN202 - an EngineServingResult
    """Serve ``workload`` on a fresh engine, as ``kvlab simulate --executor engine`` does."""
    from kvlab.engine import build_random_model, load_model
    from kvlab.sim.engine_executor import run_engine_serving, serving_engine

    e, c = config.engine, config.cache
    if Path(e.model).is_dir():
        model = load_model(e.model, device=e.device, dtype=e.dtype, attn_implementation=e.attn_implementation,
                           local_files_only=True)
    else:
        shape = e.model if not Path(e.model).is_file() else config.model_config
        model = build_random_model(shape, seed=e.model_seed, dtype=e.dtype, device=e.device,
                                   attn_implementation=e.attn_implementation)
    engine = serving_engine(model, workload, c.capacity_blocks, c.block_size, dtype=e.kv_dtype, num_threads=e.threads)
    return run_engine_serving(
        workload, engine, policy=c.policy, policy_params=c.policy_params,
        capacity_blocks=c.capacity_blocks, max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens, rate=e.rate, time_scale=e.time_scale, cache_at=e.cache_at,
        hash=config.hash, root_seed=config.root_seed, timer=e.timer, warmup=e.warmup, seed=config.seed,
        batched=e.batched, verify=e.verify, verify_tokens=e.verify_tokens, tiers=list(c.tiers) or None,
        max_load_tokens=c.max_load_tokens)


def compute(run: Experiment, workload: Workload) -> tuple[dict[str, pd.DataFrame], dict, dict, str]:
    """Run one experiment point: its tables, summary, config (as recorded) and driver name."""
    config = driver_config(run, workload)
    if run.driver == "replay":
        from kvlab.replay import encode, replay
        from kvlab.sweep import HASH_FIELDS

        key = (run.trace.model_dump_json(), _file_stamp(run.trace.path), *(getattr(config, f) for f in HASH_FIELDS))
        if key not in _ENCODINGS:  # hashing once per trace and hash setting in this process
            _ENCODINGS.clear()
            _ENCODINGS[key] = encode(workload, config)
        result = replay(workload, config, encoded=_ENCODINGS[key])
        return {"requests": result.requests}, result.summary, config.to_dict(), "replay"
    if run.driver == "engine":
        result = _run_engine(workload, config)
        return ({"requests": result.requests, "timeseries": result.timeseries}, result.summary,
                {**result.config.to_dict(), "model_profile": result.model.to_dict(),
                 "hardware_profile": result.hardware.to_dict(), "engine": result.engine,
                 "experiment_engine": config.to_dict(), "reproducible": ENGINE_NOTE}, "engine-serving")
    from kvlab.sim.simulator import simulate

    result = simulate(workload, config)
    return ({"requests": result.requests, "timeseries": result.timeseries}, result.summary,
            {**result.config.to_dict(), "model_profile": result.model.to_dict(),
             "hardware_profile": result.hardware.to_dict()}, "simulator")


__all__ = ["ENGINE_NOTE", "EngineRunConfig", "block_size_of", "compute", "driver_config",
           "identity_of", "workload_of"]
