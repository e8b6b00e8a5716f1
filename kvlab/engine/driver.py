"""The sequential driver: requests served one at a time from a paged pool run by the shared cache core.

An :class:`Engine` is a :class:`~kvlab.engine.compute.PagedModel` (the model, its
:class:`~kvlab.engine.kv_pool.KVPool` and the pool-compute primitive ``forward_tokens``) plus a
:class:`~kvlab.cache.PrefixCache` (key index, ref counts, eviction policy: the same core as the replay and
the simulator) whose block id ``b`` is pool block ``b``, driven through the simulator's
:class:`~kvlab.cache.manager.KVCacheManager` (``cache_at="compute"``: a block is keyed right after the
forward pass that wrote it), and a :class:`~kvlab.hashing.BlockHasher`.

Prefill with reuse (one request; docs/engine.md has the picture). Steps 2 and 5 are the admission sequence
of :mod:`kvlab.cache.admission`, the same as the replay's and the simulator's:

1. hash the prompt's full blocks (chained keys; adapter and salt as extra keys);
2. ``get_computed_blocks`` (lookup: stops at the first miss, at most ``(P - 1) // block_size`` blocks, so
   the last prompt token is always computed), then ``allocate_slots`` for the uncached suffix (fit, else
   the request is not admitted and nothing changes; pin the hits; ``on_miss``; allocate
   ``ceil(P / block_size) - hits`` new blocks, evicting by the policy);
3. gather the hit blocks from the pool into a transformers ``DynamicCache`` (the request's *working
   cache*: attention kernels read contiguous K/V, so the pool is the store and this is a per-request copy);
4. run the model on the uncached suffix only, at positions ``hit_tokens .. P - 1``;
5. scatter the suffix's new K/V from the working cache into the new blocks, then ``cache_computed`` gives
   the full new blocks their keys (only after they hold computed K/V: a failed forward keys nothing);
6. ``decode`` appends one token per step: K/V into the next slot (a block is allocated when one fills),
   and a block filled by output tokens is keyed too (``cache_outputs``, as vLLM does: its key is appended
   with ``extend_keys``); ``release`` frees the blocks tail first.

Keys handed to the cache core are dense ids (first appearance order) of the hasher's keys, exactly like
the replay's, so offline policies (``prepare``) and hit-for-hit comparisons work unchanged. The access
context's time is the request's arrival (the manager's ``now=None``), as in the replay. Units: token
counts in tokens, block counts in blocks, times in seconds (``*_s``), sizes in bytes.

Fault injection for the oracle's mutation tests lives apart (:class:`~kvlab.engine.faults.FaultyEngine`,
overriding the two seams below and those of :class:`~kvlab.engine.compute.PagedModel`); an ``Engine``
injects nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.cache import AccessContext, KVBlock, PrefixCache, admission
from kvlab.cache.compiled import ideal_hits_kernel
from kvlab.cache.manager import KVCacheManager, KVRequest
from kvlab.engine.adapters import AdapterSet
from kvlab.engine.compute import PagedModel, sync_device
from kvlab.engine.model import kv_from_cache
from kvlab.engine.request import DecodeResult, PrefillResult, Request, SequenceState
from kvlab.engine.result import EngineResult, request_frame
from kvlab.engine.tiers import attach_tiers, request_tier_hits, tier_config, tier_results
from kvlab.engine.verify import Tolerance, VerifyReport, verify_prefill
from kvlab.errors import CapacityError, ConfigError
from kvlab.hashing import BlockHasher, EncodedWorkload, truth_hasher
from kvlab.metrics import latency_stats, summarize
from kvlab.policies import make_policy
from kvlab.tiers import Tier
from kvlab.workload.workload import Workload


@dataclass(eq=False)
class _State(SequenceState):
    """A :class:`SequenceState` and the request's KV state in the manager (``kv``): ``blocks``, ``keys`` and
    ``ctx`` are ``kv``'s own (the same objects) while the request runs."""

    kv: KVRequest | None = None


class Engine(PagedModel):
    """A causal LM serving requests from a paged, prefix-cached KV pool (module docstring: the steps).

    Capacity: exactly one of ``capacity_blocks`` (usable blocks, the cache core's capacity) or
    ``capacity_bytes`` (converted to whole blocks of ``layout.bytes_per_block`` bytes); the old keyword
    ``num_blocks`` still means ``capacity_blocks``. ``dtype`` is the pool's (default: the model's K/V dtype);
    a narrower pool dtype makes reuse lossy, which the oracle reports. ``device`` defaults to the model's; a
    model elsewhere is moved there. ``hasher`` defaults to ``BlockHasher("xxh3_128", model_id=<model id>)``.
    ``adapters`` serves requests that name an adapter. ``num_threads`` sets torch's CPU threads (None: leave
    as is; ignored on accelerators). ``tiers``: lower tiers with real stores (kvlab.engine.tiers.attach: DRAM, and
    with ``tier_dir`` the last tier on disk there), ``max_load_tokens`` per request from them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        capacity_blocks: int | None = None,
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
        tiers: Sequence[Tier] | None = None, tier_dir: str | Path | None = None, max_load_tokens: int | None = None,
        **old_names: int | None,
    ) -> None:
        super().__init__(model, capacity_blocks=capacity_blocks, capacity_bytes=capacity_bytes, block_size=block_size,
                         device=device, dtype=dtype, adapters=adapters, num_threads=num_threads, **old_names)
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        self.policy_params = dict(policy_params or {})
        self.cache = PrefixCache(self.capacity_blocks, make_policy(policy, **(policy_params or {})),
                                 block_size=self.block_size)
        self.manager = KVCacheManager(self.cache, cache_at="compute", now=None)  # ctx.time: each request's arrival
        self.tier_io = attach_tiers(self.cache, self.pool, tiers, tier_dir=tier_dir, max_load_tokens=max_load_tokens)
        self.hasher = hasher if hasher is not None else BlockHasher(model_id=self.model_id)
        self._truth = truth_hasher(self.hasher)
        self._truth_is_key = self._truth.config() == self.hasher.config()
        self.cache_outputs = bool(cache_outputs)
        self._dense: dict[int, int] = {}  # hasher key -> dense id handed to the cache core
        self._seq = 0
        self.faults: dict[str, object] = {}  # none (recorded in the config); FaultyEngine sets its own

    # ------------------------------------------------------------------ description
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
            "capacity_blocks": self.capacity_blocks,
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
            **tier_config(self.tier_io),
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
    def _kv_request(self, request: Request) -> KVRequest:
        """The request's KV state for the manager: its prompt's keys and truths (copies: decode appends to
        them) and its access context (time: the arrival; ``seq``: the request's, else the engine's next)."""
        keys, truths = self.request_keys(request)
        p = len(request.tokens)
        ctx = AccessContext(time=request.arrival, seq=request.seq if request.seq >= 0 else self._seq,
                            request_id=request.request_id, tenant=request.tenant, category=request.category,
                            turn=request.turn, prompt_tokens=p)
        return KVRequest(request.request_id, p, list(keys), truths=list(truths), ctx=ctx)

    def _lookup(self, kv: KVRequest) -> list[KVBlock]:
        """The request's hit blocks (admission steps 1-2; no side effects)."""
        return self.manager.get_computed_blocks(kv)[0]

    def can_admit(self, request: Request) -> bool:
        """Whether ``prefill(request)`` would be admitted now (no side effects)."""
        kv = self._kv_request(request)
        hits = self._lookup(kv)
        num_new = self.manager.blocks_needed(kv.prompt_tokens) - len(hits)
        return admission.fits(self.cache, admission.Lookup(hits), num_new)

    def blocks_needed(self, state: SequenceState, steps: int = 1) -> int:
        """New blocks ``steps`` more decode steps would allocate."""
        return max(0, -(-(state.num_computed + steps) // self.block_size) - len(state.blocks))

    def _cache_computed(self, kv: KVRequest) -> None:
        """Key ``kv``'s blocks that are full of computed tokens (right after the forward pass wrote them)."""
        k0 = kv.num_keyed_blocks
        if self.manager.cache_computed(kv):
            self._cached(kv.keys, kv.blocks[k0:kv.num_keyed_blocks], k0)

    # ------------------------------------------------------------------ prefill
    def prefill(self, request: Request) -> PrefillResult:
        """Prefill one prompt with prefix reuse (module docstring, steps 1-5). Not admitted (too few free
        blocks) -> ``admitted=False`` and nothing changed. Decode with :meth:`decode`, then :meth:`release`."""
        self._check(request)
        dev, bs, manager = self.device, self.block_size, self.manager
        sync_device(dev)
        t0 = time.perf_counter()
        p = len(request.tokens)
        self.request_keys(request)
        hash_s = time.perf_counter() - t0
        kv = self._kv_request(request)
        hits = self._lookup(kv)
        h, full = len(hits), len(kv.keys)
        start = (h + len(kv.lower)) * bs  # device hits, then the blocks loaded from lower tiers
        if not manager.allocate_slots(kv, p - start, hits):
            return PrefillResult(False, p, full, lookup_s=time.perf_counter() - t0,
                                 prefill_s=time.perf_counter() - t0, hash_s=hash_s)
        self._seq = kv.ctx.seq + 1
        false_hits = sum(1 for i, b in enumerate(hits) if b.truth != kv.truths[i])
        new = kv.blocks[h:]
        t1 = time.perf_counter()
        times: dict[str, float] = {}
        try:
            logits, working = self._compute_prefill(request, kv.blocks, new[len(new) - kv.evictions:], start, times)
            kv.num_computed_tokens = p  # positions start .. p - 1 are in the pool now
            self._cache_computed(kv)
        except BaseException:
            manager.free(kv)  # keys only blocks of computed tokens: none of a failed forward's
            raise
        if request.forced_outputs is not None and len(request.forced_outputs):
            first = int(request.forced_outputs[0])
        else:
            first = int(logits.argmax())
        sync_device(dev)
        t4 = time.perf_counter()
        t2 = t1 + times["gather_s"]
        t3 = t2 + times["forward_s"]
        state = _State(
            request=request, tokens=request.tokens.tolist(), blocks=kv.blocks, keys=kv.keys, cache=working,
            logits=logits, emitted=[first], ctx=kv.ctx, hit_blocks=start // bs, kv=kv,
        )
        return PrefillResult(
            admitted=True, prompt_tokens=p, full_blocks=full, hit_blocks=start // bs, hit_tokens=min(start, p),
            computed_prompt_tokens=p - start, new_blocks=kv.new_blocks, evictions=kv.evictions,
            orphan_evictions=kv.orphan_evictions, false_hit_blocks=false_hits,
            first_token=first, logits=logits, lookup_s=t1 - t0, gather_s=t2 - t1, forward_s=t3 - t2,
            scatter_s=t4 - t3, prefill_s=t4 - t0, state=state, hash_s=hash_s,
        )

    def prefill_batch(self, requests: Sequence[Request]) -> list[PrefillResult]:
        """Prefill several requests, one sequence per step, in order (later ones may hit earlier ones)."""
        return [self.prefill(r) for r in requests]

    # Seams for kvlab.engine.faults (plain here): the compute of a prefill's uncached suffix (``taken``: its
    # new blocks that eviction took from other prefixes), and blocks just given their keys.
    def _compute_prefill(self, request: Request, blocks: list[KVBlock], taken: list[KVBlock], start: int,
                         times: dict) -> tuple[torch.Tensor, object]:
        return self.forward_tokens(request.tokens[start:], [b.block_id for b in blocks], start,
                                   adapter=request.adapter, times=times)

    def _cached(self, keys: Sequence[int], blocks: Sequence[KVBlock], start: int) -> None:
        """``blocks`` now hold keys ``keys[start:start + len(blocks)]``."""

    # ------------------------------------------------------------------ decode
    def _decode_one(self, state: _State) -> None:
        if state.released:
            raise CapacityError(f"request {state.request.request_id} was released; it cannot decode")
        bs, kv = self.block_size, state.kv
        tok = state.emitted[-1]
        pos = state.num_computed
        new_blocks, evictions = kv.new_blocks, kv.evictions
        if not self.manager.allocate_slots(kv, 1):  # a slot for position pos (nothing changed when full)
            raise CapacityError(f"request {state.request.request_id}: no free block for position {pos}")
        kv.num_tokens = pos + 1
        state.decode_blocks += kv.new_blocks - new_blocks
        state.decode_evictions += kv.evictions - evictions
        logits, _ = self.forward_tokens(np.array([tok], dtype=np.int64), [b.block_id for b in state.blocks], pos,
                                        working=state.cache, adapter=state.request.adapter)
        state.tokens.append(tok)
        kv.num_computed_tokens = pos + 1
        state.logits = logits
        req = state.request
        if self.cache_outputs and req.key_values is None and (pos + 1) % bs == 0:
            keys, truths = self._hash(np.asarray(state.tokens, dtype=np.int64), None, req)
            n = len(kv.keys)
            self.manager.extend_keys(kv, keys[n:], truths[n:])
            self._cache_computed(kv)
        forced = req.forced_outputs
        k = len(state.emitted)
        state.emitted.append(int(forced[k]) if forced is not None and k < len(forced) else int(logits.argmax()))

    def decode(self, state: SequenceState, steps: int) -> DecodeResult:
        """Run ``steps`` decode steps: each feeds the last emitted token, appends its K/V to the pool and
        emits the next token. Raises CapacityError (before the step) when a needed block cannot be allocated."""
        sync_device(self.device)
        t0 = time.perf_counter()
        blocks0, ev0, n0 = state.decode_blocks, state.decode_evictions, len(state.emitted)
        for _ in range(int(steps)):
            self._decode_one(state)
        sync_device(self.device)
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
        self.manager.free(state.kv)
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
        tier_hits = [row.pop("tier_hit_blocks") for row in rows] if self.tier_io is not None else []
        frame = request_frame(workload, rows, ideal, self.block_size)
        summary = self._summary(frame, workload, wall, verify, key_label if key_values is not None else None)
        summary.update(tier_results(frame, tier_hits, self.tier_io, self.block_size))  # (nothing without tiers)
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
            "false_hit_blocks": res.false_hit_blocks, "computed_prompt_tokens": res.computed_prompt_tokens,
            "ttft_s": res.prefill_s if res.admitted else np.nan, "prefill_s": res.prefill_s if res.admitted else 0.0,
            "lookup_s": res.lookup_s,
            "gather_s": res.gather_s, "forward_s": res.forward_s, "scatter_s": res.scatter_s,
            "kv_blocks_in_use": self.cache.num_running_blocks,
            "kv_bytes_in_use": self.cache.num_running_blocks * bpb,
            "generated_tokens": 0, "decode_steps": 0, "decode_s": 0.0, "decode_blocks": 0,
            "decode_evictions": 0, "decode_truncated": False,
        }
        state = res.state
        if self.tier_io is not None:
            row["tier_hit_blocks"] = request_tier_hits(self.tier_io, state.kv.tier_hits if state else None)
        if state is not None:
            if verify:
                row.update(self.verify(state, k=verify_tokens, tolerance=tolerance).as_row())
            steps = req.output_tokens - 1
            t0 = time.perf_counter()
            done = 0
            while done < steps and self.blocks_needed(state) <= self.cache.num_free_blocks:
                self._decode_one(state)
                done += 1
            sync_device(self.device)
            row.update(decode_s=time.perf_counter() - t0, decode_steps=done, generated_tokens=len(state.emitted),
                       decode_blocks=state.decode_blocks, decode_evictions=state.decode_evictions,
                       decode_truncated=done < steps)
            self.release(state)
        row["cached_blocks"] = self.cache.num_cached_blocks
        row["orphan_blocks"] = self.cache.num_orphan_blocks
        row["kv_bytes_cached"] = self.cache.num_cached_blocks * bpb
        return row

    def _summary(
        self, frame: pd.DataFrame, workload: Workload, wall: float, verify: bool, key_label: str | None
    ) -> dict:
        """Totals of a run: :func:`~kvlab.metrics.summarize` of ``frame`` plus capacity, layout and labels,
        prefill and decode seconds and throughputs (tokens/s), TTFT mean and percentiles (s,
        :func:`kvlab.metrics.latency_stats`: NaN on a run that admitted nothing), peak KV bytes and, with
        ``verify``, the oracle's pass rate and largest deviations."""
        summary = summarize(frame, duration_s=workload.duration, capacity_blocks=self.capacity_blocks)
        adm = frame[frame["admitted"]]
        prefill_s = float(adm["prefill_s"].sum())
        decode_s = float(adm["decode_s"].sum())
        summary.update(
            capacity_blocks=self.capacity_blocks,
            capacity_bytes=self.capacity_bytes,
            kv_bytes_per_block=self.layout.bytes_per_block,
            kv_bytes_per_token=self.layout.bytes_per_token,
            block_size=self.block_size,
            policy=self.policy_name,
            mode="vllm",
            hash=self._hash_label(key_label),
            model_id=self.model_id,
            device=str(self.device),
            dtype=str(self.layout.dtype).removeprefix("torch."),
            wall_seconds=wall,
            prefill_busy_s=prefill_s,
            decode_busy_s=decode_s,
            computed_prompt_tokens=int(adm["computed_prompt_tokens"].sum()),
            prefill_throughput=float(adm["computed_prompt_tokens"].sum()) / prefill_s if prefill_s else 0.0,
            effective_prefill_throughput=float(adm["prompt_tokens"].sum()) / prefill_s if prefill_s else 0.0,
            decode_throughput=float(adm["decode_steps"].sum()) / decode_s if decode_s else 0.0,
            **latency_stats(frame, columns=("ttft_s",)),  # NaN when nothing was admitted, as the simulator's
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
