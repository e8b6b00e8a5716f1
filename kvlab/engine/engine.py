"""The real engine: a transformers causal LM whose KV state lives in a paged pool run by the shared cache core.

One :class:`Engine` owns a :class:`~kvlab.cache.PrefixCache` (key index, ref counts, eviction policy: the
same core as the replay and the simulator), a :class:`~kvlab.engine.kv_pool.KVPool` whose block ``b`` is
the cache core's block id ``b``, a :class:`~kvlab.hashing.BlockHasher` and the model.

Prefill with reuse (one request; docs/engine.md has the picture):

1. hash the prompt's full blocks (chained keys; adapter and salt as extra keys);
2. ``lookup`` (stops at the first miss, at most ``(P - 1) // block_size`` blocks: the last prompt token is
   always computed), ``can_allocate`` (otherwise the request is not admitted and nothing changes),
   ``touch`` the hits, ``allocate`` ``ceil(P / block_size) - hits`` new blocks (evicting by the policy);
3. gather the hit blocks from the pool into a transformers ``DynamicCache`` (the request's *working
   cache*: attention kernels read contiguous K/V, so the pool is the store and this is a per-request copy);
4. run the model on the uncached suffix only, at positions ``hit_tokens .. P - 1``;
5. scatter the suffix's new K/V from the working cache into the new blocks, then ``cache_blocks`` gives
   the full new blocks their keys (after they hold computed K/V);
6. ``decode`` appends one token per step: K/V into the next slot (a block is allocated when one fills),
   and a block filled by output tokens is keyed too (``cache_outputs``, as vLLM does); ``release`` drops
   the references tail first.

Keys handed to the cache core are dense ids (first appearance order) of the hasher's keys, exactly like
the replay's, so offline policies (``prepare``) and hit-for-hit comparisons work unchanged. Units: token
counts in tokens, block counts in blocks, times in seconds (``*_s``), sizes in bytes.

Fault injection (``faults=``) deliberately breaks one step; it exists for the mutation tests that show the
oracle (:mod:`kvlab.engine.verify`) catches each bug. Never use it for measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.cache import AccessContext, KVBlock, PrefixCache
from kvlab.cache.compiled import ideal_hits_kernel
from kvlab.engine.adapters import AdapterSet
from kvlab.engine.kv_pool import KVLayout, KVPool
from kvlab.engine.model import (
    cache_from_kv,
    cache_length,
    forward_logits,
    kv_from_cache,
    masked_gqa,
    model_device,
    model_dtype,
    model_id,
    probe_kv,
    resolve_device,
    resolve_dtype,
    vocab_size,
)
from kvlab.engine.verify import Tolerance, VerifyReport, verify_prefill
from kvlab.errors import CapacityError, ConfigError
from kvlab.hashing import BlockHasher, EncodedWorkload, truth_hasher
from kvlab.metrics import summarize
from kvlab.results import build_manifest, write_results
from kvlab.workload.workload import Workload

FAULTS: dict[str, type] = {
    "position_offset": int,  # the suffix after a hit starts at position hit_tokens + offset (an off-by-one)
    "wrong_block": bool,  # the gather reads block (b + 1) % num_blocks instead of hit block b
    "stale_block": bool,  # at prefill, the K/V write into a block taken by eviction is lost: it keeps the old K/V
    "reuse_evicted": bool,  # an engine-side key -> block memo, never invalidated, extends lookups past a
    # miss with blocks that were evicted and reallocated to another prefix
}


def _sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA/MPS) so wall-clock timings cover it; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _label(column: pd.Categorical | None, i: int) -> str | None:
    if column is None:
        return None
    value = column[i]
    return None if pd.isna(value) else str(value)


@dataclass(eq=False)
class Request:
    """One prompt to serve.

    ``tokens``: int64 token ids (P >= 1). ``output_tokens``: tokens to generate (>= 1; the first comes
    from the prefill's logits, each further one costs a decode step). ``forced_outputs``: known output
    ids emitted instead of the argmax (teacher forcing, so a later turn can reuse the answer's blocks).
    ``key_values`` (unsafe research hook): values hashed instead of the token ids (same length), e.g.
    the text's bytes for text-keyed reuse. ``seq``: admission index for the policy context (-1: the
    engine's counter).
    """

    tokens: np.ndarray
    request_id: int = -1
    arrival: float = 0.0
    output_tokens: int = 1
    forced_outputs: np.ndarray | None = None
    adapter: str | None = None
    salt: str | None = None
    tenant: str | None = None
    category: str | None = None
    turn: int = -1
    key_values: np.ndarray | None = None
    seq: int = -1
    _keys: tuple[list[int], list[Hashable]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int64)
        if self.tokens.ndim != 1 or len(self.tokens) == 0:
            raise ConfigError(f"a request needs a 1-D prompt of >= 1 token ids, got shape {self.tokens.shape}")
        if int(self.output_tokens) < 1:
            raise ConfigError(f"output_tokens must be >= 1 (the prefill emits one), got {self.output_tokens}")
        if self.key_values is not None:
            self.key_values = np.ascontiguousarray(self.key_values, dtype=np.int64)
            if self.key_values.shape != self.tokens.shape:
                raise ConfigError(
                    f"key_values has shape {self.key_values.shape}, the prompt {self.tokens.shape}: "
                    "custom keys need one value per token"
                )

    @classmethod
    def from_workload(
        cls, workload: Workload, i: int, *, output_tokens: int | str = 1, force_outputs: bool = False
    ) -> Request:
        """Row ``i`` of a token workload. ``output_tokens``: an int, or ``"workload"`` for the row's
        ``output_length`` (at least 1). ``force_outputs`` emits the row's known output ids when it has them."""
        if workload.kind != "tokens":
            raise ConfigError(
                "the engine runs token workloads; expand a block-id trace first (kvlab.workload.expand_to_tokens)"
            )
        if output_tokens == "workload":
            n_out = max(1, int(workload.output_length[i]))
        elif isinstance(output_tokens, int | np.integer) and not isinstance(output_tokens, bool):
            n_out = int(output_tokens)
        else:
            raise ConfigError(f"output_tokens must be an int >= 1 or 'workload', got {output_tokens!r}")
        forced = workload.output(i) if force_outputs else None
        return cls(
            tokens=workload.prompt(i),
            request_id=int(workload.request_id[i]),
            arrival=float(workload.arrival[i]),
            output_tokens=n_out,
            forced_outputs=None if forced is None or len(forced) == 0 else np.asarray(forced, dtype=np.int64),
            adapter=_label(workload.adapter, i),
            salt=_label(workload.salt, i),
            tenant=_label(workload.tenant, i),
            category=_label(workload.category, i),
            turn=int(workload.turn[i]) if workload.turn is not None else -1,
            seq=i,
        )


@dataclass(eq=False)
class SequenceState:
    """A running request between prefill and release.

    Invariants: ``tokens`` are the ids whose K/V are computed (prompt, then fed output tokens), in the
    pool at positions ``0 .. len(tokens) - 1`` of ``blocks`` and in ``cache`` (the working copy);
    ``blocks[:len(keys)]`` carry keys; ``emitted[-1]`` is the next token to feed; ``logits`` are the
    last computed position's logits.
    """

    request: Request
    tokens: list[int]
    blocks: list[KVBlock]
    keys: list[int]
    cache: object
    logits: torch.Tensor
    emitted: list[int]
    ctx: AccessContext
    hit_blocks: int
    decode_blocks: int = 0
    decode_evictions: int = 0
    released: bool = False

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are stored (positions)."""
        return len(self.tokens)


@dataclass
class PrefillResult:
    """What one prefill did. ``state`` is None when the request was not admitted (nothing changed).

    Times (seconds, device-synchronised): ``lookup_s`` hashing, lookup and allocation (``hash_s`` of it:
    the prompt's block keys, 0 when the request was hashed before, as ``run`` does); ``gather_s`` pool
    -> working cache; ``forward_s`` the suffix forward; ``scatter_s`` working cache -> pool and keying;
    ``prefill_s`` the whole call, which is the TTFT when the request did not queue.
    """

    admitted: bool
    prompt_tokens: int
    full_blocks: int
    hit_blocks: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    new_blocks: int = 0
    evictions: int = 0
    orphan_evictions: int = 0
    false_hit_blocks: int = 0
    first_token: int = -1
    logits: torch.Tensor | None = None
    lookup_s: float = 0.0
    gather_s: float = 0.0
    forward_s: float = 0.0
    scatter_s: float = 0.0
    prefill_s: float = 0.0
    state: SequenceState | None = None
    hash_s: float = 0.0


@dataclass
class DecodeResult:
    """Tokens emitted by ``decode`` (in order), the steps run, blocks allocated and evicted, seconds."""

    tokens: list[int]
    steps: int
    new_blocks: int
    evictions: int
    decode_s: float


@dataclass
class EngineResult:
    """Per-request rows (trace order; the replay's columns plus timing, memory and verify columns),
    totals, the run's config and the trace's identity."""

    requests: pd.DataFrame
    summary: dict
    config: dict
    trace: dict

    def save(self, out: str | Path) -> Path:
        """Write ``requests.parquet``, ``summary.json`` and ``manifest.json`` to ``out`` atomically."""
        manifest = build_manifest(self.config, trace=self.trace, seed=self.config.get("model_seed"), driver="engine")
        return write_results(out, {"requests": self.requests}, self.summary, manifest)


def _check_faults(faults: dict | None) -> dict:
    out = dict(faults or {})
    for name, value in out.items():
        kind = FAULTS.get(name)
        if kind is None:
            raise ConfigError(f"unknown fault {name!r}; faults: {', '.join(FAULTS)}")
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"fault {name!r} takes an int, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"fault {name!r} takes a bool, got {value!r}")
    return {k: v for k, v in out.items() if v}


class Engine:
    """A causal LM serving requests from a paged, prefix-cached KV pool (module docstring: the steps).

    Capacity: exactly one of ``num_blocks`` (usable blocks, the cache core's capacity) or
    ``capacity_bytes`` (converted to whole blocks of ``layout.bytes_per_block`` bytes). ``dtype`` is the
    pool's (default: the model's K/V dtype); a narrower pool dtype makes reuse lossy, which the oracle
    reports. ``device`` defaults to the model's; a model elsewhere is moved there. ``hasher`` defaults to
    ``BlockHasher("xxh3_128", model_id=<model id>)``. ``adapters`` serves requests that name an adapter.
    ``num_threads`` sets torch's CPU threads (None: leave as is; ignored on accelerators).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int | None = None,
        capacity_bytes: int | None = None,
        block_size: int = 16,
        policy: str | object = "lru",
        policy_params: dict | None = None,
        hasher: BlockHasher | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        adapters: AdapterSet | None = None,
        cache_outputs: bool = True,
        num_threads: int | None = 2,
        faults: dict | None = None,
    ) -> None:
        if (num_blocks is None) == (capacity_bytes is None):
            raise ConfigError("give exactly one of num_blocks and capacity_bytes")
        self.device = model_device(model) if device is None else resolve_device(device)
        if model_device(model) != self.device:
            model.to(self.device)
        if self.device.type == "cpu" and num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.model = model.eval()
        self.model_dtype = model_dtype(model)
        self.model_id = model_id(model)
        self.vocab_size = vocab_size(model)
        kv = probe_kv(model)
        self.layout = KVLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, int(block_size),
                               resolve_dtype(dtype, kv.dtype))
        self.kv_dtype = kv.dtype
        if capacity_bytes is not None:
            num_blocks = self.layout.blocks_for_bytes(int(capacity_bytes))
        self.block_size = int(block_size)
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        self.policy_params = dict(policy_params or {})
        self.cache = PrefixCache(int(num_blocks), policy, block_size=self.block_size, policy_params=policy_params)
        self.pool = KVPool(self.layout, int(num_blocks), self.device)
        self.hasher = hasher if hasher is not None else BlockHasher(model_id=self.model_id)
        self._truth = truth_hasher(self.hasher)
        self._truth_is_key = self._truth.config() == self.hasher.config()
        self.adapters = adapters
        self.cache_outputs = bool(cache_outputs)
        self.num_threads = num_threads
        self.faults = _check_faults(faults)
        self._dense: dict[int, int] = {}  # hasher key -> dense id handed to the cache core
        self._memo: dict[int, KVBlock] = {}  # fault "reuse_evicted" only
        self._seq = 0

    # ------------------------------------------------------------------ description
    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def capacity_bytes(self) -> int:
        """Bytes of K/V the pool holds (``num_blocks x bytes_per_block``)."""
        return self.pool.nbytes

    def config(self) -> dict:
        """What determines this engine's numbers (for manifests)."""
        return {
            "driver": "engine",
            "model_id": self.model_id,
            "model_type": getattr(self.model.config, "model_type", None),
            "model_seed": getattr(self.model, "kvlab_seed", None),
            "model_dtype": str(self.model_dtype).removeprefix("torch."),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "device": str(self.device),
            "capacity_blocks": self.num_blocks,
            "capacity_bytes": self.capacity_bytes,
            "block_size": self.block_size,
            "layout": self.layout.to_dict(),
            "policy": self.policy_name,
            "policy_params": self.policy_params,
            "mode": "vllm",
            "hash": self.hasher.config(),
            "adapters": self.adapters.config() if self.adapters is not None else None,
            "cache_outputs": self.cache_outputs,
            "num_threads": self.num_threads,
            "faults": dict(self.faults),
        }

    # ------------------------------------------------------------------ keys
    def _dense_ids(self, keys: Sequence[int]) -> list[int]:
        dense = self._dense
        out = []
        for k in keys:
            d = dense.get(k)
            if d is None:
                d = dense[k] = len(dense)
            out.append(d)
        return out

    def _hash(self, tokens: np.ndarray, key_values: np.ndarray | None, request: Request) -> tuple[list[int], list]:
        """(dense key ids, true identities) of the full blocks of ``tokens``."""
        bs = self.block_size
        values = tokens if key_values is None else key_values
        raw = self.hasher.token_keys(values, bs, adapter=request.adapter, salt=request.salt)
        if self._truth_is_key and key_values is None:
            truths: list = list(raw)
        else:
            truths = self._truth.token_keys(tokens, bs, adapter=request.adapter, salt=request.salt)
        return self._dense_ids(raw), truths

    def request_keys(self, request: Request) -> tuple[list[int], list]:
        """(dense key ids, true identities) of a request's full prompt blocks (computed once per request)."""
        if request._keys is None:
            request._keys = self._hash(request.tokens, request.key_values, request)
        return request._keys

    def _check(self, request: Request) -> None:
        t = request.tokens
        if int(t.min()) < 0 or int(t.max()) >= self.vocab_size:
            raise ConfigError(
                f"request {request.request_id}: token ids must lie in [0, {self.vocab_size}), "
                f"got [{int(t.min())}, {int(t.max())}]"
            )
        if request.adapter is not None:
            if self.adapters is None:
                raise ConfigError(f"request {request.request_id} names adapter {request.adapter!r} but the engine "
                                  "has no AdapterSet")
            self.adapters.check(request.adapter)

    # ------------------------------------------------------------------ admission
    def _lookup(self, request: Request) -> tuple[list[KVBlock], int, list[int], list]:
        """(hit blocks, blocks to allocate, keys, truths): no side effects."""
        keys, truths = self.request_keys(request)
        p = len(request.tokens)
        max_hit = self.cache.max_hit_blocks(p, len(keys), "vllm")
        hits, _ = self.cache.lookup(keys, max_hit)
        if self.faults.get("reuse_evicted"):
            hits = self._stale_hits(hits, keys, max_hit)
        return hits, -(-p // self.block_size) - len(hits), keys, truths

    def _stale_hits(self, hits: list[KVBlock], keys: list[int], max_hit: int) -> list[KVBlock]:
        """Fault: extend ``hits`` through the engine memo without checking that a block still holds its key."""
        out = list(hits)
        for i in range(len(out), max_hit):
            block = self._memo.get(keys[i])
            if block is None or block in out or block.ref_cnt != 0 or block.key is None:
                break
            out.append(block)
        return out

    def can_admit(self, request: Request) -> bool:
        """Whether ``prefill(request)`` would be admitted now (no side effects)."""
        hits, num_new, _, _ = self._lookup(request)
        return self.cache.can_allocate(num_new, hits)

    def blocks_needed(self, state: SequenceState, steps: int = 1) -> int:
        """New blocks ``steps`` more decode steps would allocate."""
        return max(0, -(-(state.num_computed + steps) // self.block_size) - len(state.blocks))

    # ------------------------------------------------------------------ executor primitive
    def forward_tokens(
        self,
        tokens: np.ndarray | Sequence[int],
        block_ids: Sequence[int],
        start: int,
        *,
        working: object | None = None,
        adapter: str | None = None,
        times: dict | None = None,
    ) -> tuple[torch.Tensor, object]:
        """Compute the K/V of ``tokens`` at positions ``[start, start + T)`` of a sequence stored in the pool
        blocks ``block_ids`` (position p in slot ``p % block_size`` of ``block_ids[p // block_size]``; they must
        cover ``start + T`` positions), write them to the pool and return ``(last logits, working cache)``.

        ``working``: the sequence's working cache holding exactly positions ``[0, start)``; None gathers
        them from the pool (a fresh request after its prefix hits, or one recomputed after preemption). The
        block bookkeeping (lookup, allocation, keys, release) is the caller's: :meth:`prefill` /
        :meth:`decode` here, a scheduler's ``KVCacheManager`` for an executor (chunked prefill: call once per
        chunk with the same working cache). ``times`` receives ``gather_s``, ``forward_s``, ``write_s``.
        """
        if adapter is not None and self.adapters is None:
            raise ConfigError(f"adapter {adapter!r} requested but the engine has no AdapterSet")
        dev = self.device
        t0 = time.perf_counter()
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=dev).view(1, -1)
        ctx = self.adapters.use(adapter) if self.adapters is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            gathered = working is None
            if gathered:
                gather_ids = list(block_ids[: -(-start // self.block_size)])
                if self.faults.get("wrong_block"):
                    gather_ids = [(b + 1) % self.num_blocks for b in gather_ids]
                working = cache_from_kv(self.pool.gather(gather_ids, start), self.layout.num_layers, self.kv_dtype)
            elif cache_length(working) != start:
                raise ConfigError(f"the working cache holds {cache_length(working)} positions, not start={start}")
            _sync(dev)
            t1 = time.perf_counter()
            first = start + (self.faults.get("position_offset", 0) if gathered and start > 0 else 0)
            pos = torch.arange(first, first + ids.shape[1], device=dev).view(1, -1)
            with masked_gqa(dev.type == "cpu" and ids.shape[1] > 1 and start > 0):
                logits = forward_logits(self.model, ids, pos, working)
            _sync(dev)
            t2 = time.perf_counter()
            self.pool.write(block_ids, start, kv_from_cache(working, start))
            _sync(dev)
        if times is not None:
            times.update(gather_s=t1 - t0, forward_s=t2 - t1, write_s=time.perf_counter() - t2)
        return logits, working

    # ------------------------------------------------------------------ prefill
    def prefill(self, request: Request) -> PrefillResult:
        """Prefill one prompt with prefix reuse (module docstring, steps 1-5). Not admitted (too few free
        blocks) -> ``admitted=False`` and nothing changed. Decode with :meth:`decode`, then :meth:`release`."""
        self._check(request)
        dev, bs, cache = self.device, self.block_size, self.cache
        _sync(dev)
        t0 = time.perf_counter()
        p = len(request.tokens)
        self.request_keys(request)
        hash_s = time.perf_counter() - t0
        hits, num_new, keys, truths = self._lookup(request)
        full = len(keys)
        if not cache.can_allocate(num_new, hits):
            return PrefillResult(False, p, full, lookup_s=time.perf_counter() - t0,
                                 prefill_s=time.perf_counter() - t0, hash_s=hash_s)
        seq = request.seq if request.seq >= 0 else self._seq
        self._seq = seq + 1
        ctx = AccessContext(time=request.arrival, seq=seq, request_id=request.request_id, tenant=request.tenant,
                            category=request.category, turn=request.turn, prompt_tokens=p)
        false_hits = sum(1 for i, b in enumerate(hits) if b.truth != truths[i])
        cache.touch(hits, ctx)
        orphans_before = cache.stats.orphan_evictions
        h = len(hits)
        new, evicted = cache.allocate(num_new, ctx, keys[h:])
        blocks = hits + new
        start = h * bs
        t1 = time.perf_counter()
        times: dict[str, float] = {}
        try:
            victims = [b.block_id for b in new[len(new) - evicted:]] if self.faults.get("stale_block") else []
            kept = self.pool.data[victims].clone() if victims else None
            logits, working = self.forward_tokens(request.tokens[start:], [b.block_id for b in blocks], start,
                                                  adapter=request.adapter, times=times)
            if kept is not None:  # fault: the writes into blocks taken by eviction are lost
                self.pool.data[victims] = kept
            cache.cache_blocks(new[: full - h], keys, h, ctx, truths)
            if self.faults.get("reuse_evicted"):
                self._memo.update(zip(keys[h:full], new[: full - h], strict=True))
        except BaseException:
            cache.release(blocks, ctx)
            raise
        if request.forced_outputs is not None and len(request.forced_outputs):
            first = int(request.forced_outputs[0])
        else:
            first = int(logits.argmax())
        _sync(dev)
        t4 = time.perf_counter()
        t2 = t1 + times["gather_s"]
        t3 = t2 + times["forward_s"]
        state = SequenceState(
            request=request, tokens=request.tokens.tolist(), blocks=blocks, keys=list(keys), cache=working,
            logits=logits, emitted=[first], ctx=ctx, hit_blocks=h,
        )
        return PrefillResult(
            admitted=True, prompt_tokens=p, full_blocks=full, hit_blocks=h, hit_tokens=min(start, p),
            computed_tokens=p - start, new_blocks=num_new, evictions=evicted,
            orphan_evictions=cache.stats.orphan_evictions - orphans_before, false_hit_blocks=false_hits,
            first_token=first, logits=logits, lookup_s=t1 - t0, gather_s=t2 - t1, forward_s=t3 - t2,
            scatter_s=t4 - t3, prefill_s=t4 - t0, state=state, hash_s=hash_s,
        )

    def prefill_batch(self, requests: Sequence[Request]) -> list[PrefillResult]:
        """Prefill several requests, one sequence per step, in order (later ones may hit earlier ones)."""
        return [self.prefill(r) for r in requests]

    # ------------------------------------------------------------------ decode
    def _decode_one(self, state: SequenceState) -> None:
        if state.released:
            raise CapacityError(f"request {state.request.request_id} was released; it cannot decode")
        bs = self.block_size
        tok = state.emitted[-1]
        pos = state.num_computed
        j = pos // bs
        if j == len(state.blocks):
            new, evicted = self.cache.allocate(1, state.ctx)  # CapacityError (nothing changed) when full
            state.blocks.extend(new)
            state.decode_blocks += 1
            state.decode_evictions += evicted
        logits, _ = self.forward_tokens(np.array([tok], dtype=np.int64), [b.block_id for b in state.blocks], pos,
                                        working=state.cache, adapter=state.request.adapter)
        state.tokens.append(tok)
        state.logits = logits
        req = state.request
        if self.cache_outputs and req.key_values is None and (pos + 1) % bs == 0:
            keys, truths = self._hash(np.asarray(state.tokens, dtype=np.int64), None, req)
            state.keys = keys
            self.cache.cache_blocks([state.blocks[j]], keys, j, state.ctx, truths)
            if self.faults.get("reuse_evicted"):
                self._memo[keys[j]] = state.blocks[j]
        forced = req.forced_outputs
        k = len(state.emitted)
        state.emitted.append(int(forced[k]) if forced is not None and k < len(forced) else int(logits.argmax()))

    def decode(self, state: SequenceState, steps: int) -> DecodeResult:
        """Run ``steps`` decode steps: each feeds the last emitted token, appends its K/V to the pool and
        emits the next token. Raises CapacityError (before the step) when a needed block cannot be allocated."""
        _sync(self.device)
        t0 = time.perf_counter()
        blocks0, ev0, n0 = state.decode_blocks, state.decode_evictions, len(state.emitted)
        for _ in range(int(steps)):
            self._decode_one(state)
        _sync(self.device)
        return DecodeResult(state.emitted[n0:], int(steps), state.decode_blocks - blocks0,
                            state.decode_evictions - ev0, time.perf_counter() - t0)

    def decode_step(self, states: Sequence[SequenceState]) -> list[int]:
        """One decode step for each state (one sequence per forward pass); returns each one's new token."""
        out = []
        for state in states:
            self._decode_one(state)
            out.append(state.emitted[-1])
        return out

    def release(self, state: SequenceState) -> None:
        """Drop the request's references (tail first) and its working cache. Once per state."""
        if state.released:
            raise CapacityError(f"request {state.request.request_id} released twice")
        self.cache.release(state.blocks, state.ctx)
        state.cache = None
        state.released = True

    # ------------------------------------------------------------------ oracle
    def verify(self, state: SequenceState, *, k: int = 4, tolerance: Tolerance | None = None) -> VerifyReport:
        """The oracle (:func:`~kvlab.engine.verify.verify_prefill`) on a state right after its prefill."""
        p = len(state.request.tokens)
        if state.released or state.num_computed != p:
            raise ConfigError("verify a state right after its prefill (before decode and release)")
        cached_kv = kv_from_cache(state.cache, 0, p)
        pool_kv = self.pool.gather([b.block_id for b in state.blocks], p)
        tokens = torch.as_tensor(state.request.tokens, device=self.device)
        return verify_prefill(
            self.model, tokens, state.logits, cached_kv, pool_kv, k=k,
            tolerance=tolerance or Tolerance.for_dtypes(self.model_dtype, self.layout.dtype),
            adapters=self.adapters, adapter=state.request.adapter,
        )

    # ------------------------------------------------------------------ trace driver
    def requests(
        self, workload: Workload, *, output_tokens: int | str = 1, force_outputs: bool = False,
        key_values: Sequence[np.ndarray] | None = None,
    ) -> Iterator[Request]:
        """The workload's rows as :class:`Request` objects (``key_values``: per-row custom key values)."""
        if key_values is not None and len(key_values) != len(workload):
            raise ConfigError(f"key_values has {len(key_values)} rows, the workload {len(workload)}")
        for i in range(len(workload)):
            req = Request.from_workload(workload, i, output_tokens=output_tokens, force_outputs=force_outputs)
            yield req if key_values is None else dataclasses.replace(req, key_values=key_values[i])

    def run(
        self,
        workload: Workload,
        *,
        verify: bool = False,
        verify_tokens: int = 4,
        tolerance: Tolerance | None = None,
        output_tokens: int | str = 1,
        force_outputs: bool = False,
        key_values: Sequence[np.ndarray] | None = None,
        key_label: str = "custom-keys",
        progress: bool = False,
    ) -> EngineResult:
        """Serve ``workload`` sequentially, like the replay: each request is prefilled, optionally verified,
        decoded to its output length and released before the next one (arrival times are not waited for,
        so TTFT = prefill time).

        With ``output_tokens=1`` (default) no decode step runs and the cache sees exactly the replay's
        events: hits, evictions and cached blocks equal ``kvlab.replay.replay`` on the same trace, block
        size, hash and capacity. More output tokens allocate (and with ``cache_outputs`` key) blocks for
        them; a request whose decode finds no free block stops early (``decode_truncated``). ``key_values``
        replaces the hashed values per row (unsafe research hook; output blocks are then not keyed), and
        ``key_label`` names it in the hash label (``<hasher label>/<key_label>/unsafe``).
        """
        reqs = list(self.requests(workload, output_tokens=output_tokens, force_outputs=force_outputs,
                                  key_values=key_values))
        n = len(reqs)
        prompt = np.asarray([len(r.tokens) for r in reqs], dtype=np.int64)
        keys = [self.request_keys(r)[0] for r in reqs]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=offsets[1:])
        key_ids = np.asarray([k for ks in keys for k in ks], dtype=np.int64)
        enc = EncodedWorkload(offsets=offsets, key_ids=key_ids, num_keys=len(self._dense), prompt_tokens=prompt,
                              num_blocks=-(-prompt // self.block_size), block_size=self.block_size,
                              hash_label=self._hash_label(key_label if key_values is not None else None))
        self.cache.policy.prepare(enc)
        ideal = ideal_hits_kernel(offsets, key_ids, prompt, max(enc.num_keys, 1), self.block_size, False)
        rows = []
        t_run = time.perf_counter()
        for req in tqdm(reqs, disable=not progress, desc="engine", unit="req"):
            rows.append(self._serve(req, verify, verify_tokens, tolerance))
        wall = time.perf_counter() - t_run
        frame = self._frame(workload, rows, ideal)
        summary = self._summary(frame, workload, wall, verify, key_label if key_values is not None else None)
        config = {**self.config(), "verify": verify, "verify_tokens": verify_tokens if verify else None,
                  "output_tokens": output_tokens, "force_outputs": force_outputs,
                  "custom_keys": key_values is not None, "hash_label": summary["hash"]}
        trace = {"name": workload.name, "source": workload.source, "sha256": workload.checksum,
                 "requests": len(workload), "kind": workload.kind}
        return EngineResult(frame, summary, config, trace)

    def _hash_label(self, key_label: str | None) -> str:
        """The hasher's label, plus ``key_label`` (marked unsafe) when custom key values replace token ids."""
        label = self.hasher.label
        if key_label is not None:
            label = f"{label.removesuffix('/unsafe')}/{key_label}/unsafe"
        return label

    def _serve(self, req: Request, verify: bool, verify_tokens: int, tolerance: Tolerance | None) -> dict:
        res = self.prefill(req)
        bpb = self.layout.bytes_per_block
        row: dict = {
            "admitted": res.admitted, "hit_blocks": res.hit_blocks, "new_blocks": res.new_blocks,
            "evictions": res.evictions, "orphan_evictions": res.orphan_evictions,
            "false_hit_blocks": res.false_hit_blocks, "computed_tokens": res.computed_tokens,
            "ttft_s": res.prefill_s if res.admitted else np.nan, "prefill_s": res.prefill_s if res.admitted else 0.0,
            "lookup_s": res.lookup_s,
            "gather_s": res.gather_s, "forward_s": res.forward_s, "scatter_s": res.scatter_s,
            "kv_blocks_in_use": self.cache.num_running_blocks,
            "kv_bytes_in_use": self.cache.num_running_blocks * bpb,
            "generated_tokens": 0, "decode_steps": 0, "decode_s": 0.0, "decode_blocks": 0,
            "decode_evictions": 0, "decode_truncated": False,
        }
        state = res.state
        if state is not None:
            if verify:
                row.update(self.verify(state, k=verify_tokens, tolerance=tolerance).as_row())
            steps = req.output_tokens - 1
            t0 = time.perf_counter()
            done = 0
            while done < steps and self.blocks_needed(state) <= self.cache.num_free_blocks:
                self._decode_one(state)
                done += 1
            _sync(self.device)
            row.update(decode_s=time.perf_counter() - t0, decode_steps=done, generated_tokens=len(state.emitted),
                       decode_blocks=state.decode_blocks, decode_evictions=state.decode_evictions,
                       decode_truncated=done < steps)
            self.release(state)
        row["cached_blocks"] = self.cache.num_cached_blocks
        row["orphan_blocks"] = self.cache.num_orphan_blocks
        row["kv_bytes_cached"] = self.cache.num_cached_blocks * bpb
        return row

    def _frame(self, workload: Workload, rows: list[dict], ideal: np.ndarray) -> pd.DataFrame:
        bs = self.block_size
        cols = pd.DataFrame(rows)
        prompt = np.asarray(workload.input_length, dtype=np.int64)
        hit_blocks = cols["hit_blocks"].to_numpy(np.int64)
        frame = pd.DataFrame({
            "request_id": workload.request_id,
            "arrival": workload.arrival,
            "prompt_tokens": prompt,
            "output_tokens": workload.output_length,
            "full_blocks": prompt // bs,
            "hit_blocks": hit_blocks,
            "hit_tokens": np.minimum(hit_blocks * bs, prompt),
            "new_blocks": cols["new_blocks"].to_numpy(np.int64),
            "evictions": cols["evictions"].to_numpy(np.int64),
            "orphan_evictions": cols["orphan_evictions"].to_numpy(np.int64),
            "admitted": cols["admitted"].to_numpy(bool),
            "cached_blocks": cols["cached_blocks"].to_numpy(np.int64),
            "orphan_blocks": cols["orphan_blocks"].to_numpy(np.int64),
            "ideal_hit_tokens": np.minimum(ideal * bs, prompt),
        })
        for name in ("session", "turn", "tenant", "category", "adapter"):
            col = getattr(workload, name)
            if col is not None:
                frame[name] = col
        extra = cols.drop(columns=[c for c in frame.columns if c in cols.columns])
        frame = pd.concat([frame, extra.set_index(frame.index)], axis=1)
        comp = frame["computed_tokens"].to_numpy(np.float64)
        secs = frame["prefill_s"].to_numpy(np.float64)
        frame["prefill_tokens_per_s"] = np.divide(comp, secs, out=np.zeros_like(comp), where=secs > 0)
        steps = frame["decode_steps"].to_numpy(np.float64)
        dsec = frame["decode_s"].to_numpy(np.float64)
        frame["tpot_s"] = np.divide(dsec, steps, out=np.full_like(dsec, np.nan), where=steps > 0)
        return frame

    def _summary(
        self, frame: pd.DataFrame, workload: Workload, wall: float, verify: bool, key_label: str | None
    ) -> dict:
        summary = summarize(frame, duration_s=workload.duration, capacity=self.num_blocks)
        adm = frame[frame["admitted"]]
        prefill_s = float(adm["prefill_s"].sum())
        decode_s = float(adm["decode_s"].sum())
        ttft = adm["ttft_s"].to_numpy(np.float64)
        summary.update(
            capacity_blocks=self.num_blocks,
            capacity_bytes=self.capacity_bytes,
            bytes_per_block=self.layout.bytes_per_block,
            kv_bytes_per_token=self.layout.bytes_per_token,
            block_size=self.block_size,
            policy=self.policy_name,
            mode="vllm",
            hash=self._hash_label(key_label),
            model_id=self.model_id,
            device=str(self.device),
            dtype=str(self.layout.dtype).removeprefix("torch."),
            wall_seconds=wall,
            prefill_seconds=prefill_s,
            decode_seconds=decode_s,
            computed_tokens=int(adm["computed_tokens"].sum()),
            prefill_throughput=float(adm["computed_tokens"].sum()) / prefill_s if prefill_s else 0.0,
            effective_prefill_throughput=float(adm["prompt_tokens"].sum()) / prefill_s if prefill_s else 0.0,
            decode_throughput=float(adm["decode_steps"].sum()) / decode_s if decode_s else 0.0,
            mean_ttft_s=float(ttft.mean()) if len(ttft) else 0.0,
            p50_ttft_s=float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
            p99_ttft_s=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
            max_kv_bytes_in_use=int(frame["kv_bytes_in_use"].max()) if len(frame) else 0,
            false_hit_blocks=int(frame["false_hit_blocks"].sum()),
            generated_tokens=int(frame["generated_tokens"].sum()),
            decode_truncated=int(frame["decode_truncated"].sum()),
        )
        if self.device.type == "cuda":
            summary["peak_device_memory_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        if verify:
            v = adm
            clear = v["verify_argmax_clear"].to_numpy(bool)
            summary.update(
                verified_requests=len(v),
                verify_failures=int((~v["verify_passed"].to_numpy(bool)).sum()),
                verify_pass_rate=float(v["verify_passed"].mean()) if len(v) else 1.0,
                verify_max_logit_abs=float(v["verify_logit_max_abs"].max()) if len(v) else 0.0,
                verify_max_logit_rel=float(v["verify_logit_rel"].max()) if len(v) else 0.0,
                verify_max_kv_abs=float(v["verify_kv_max_abs"].max()) if len(v) else 0.0,
                verify_argmax_agreement=float(v["verify_argmax_match"].to_numpy(bool)[clear].mean())
                if clear.any() else 1.0,
                verify_greedy_agreement=float((v["verify_greedy_agree"] / v["verify_greedy_k"]).mean())
                if len(v) else 1.0,
            )
        return summary
