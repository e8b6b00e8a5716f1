"""The correctness oracle: a cached prefill against a full uncached forward of the same prompt and model.

For one admitted request (seed 000: "validate by comparing cached execution against the uncached path"):

1. **Reference**: the whole prompt through the model with an empty cache (same adapter, same attention
   implementation, same call path), giving the last position's logits and the K/V of every position.
2. **Logits**: ``logit_max_abs = max |cached - reference|`` over the vocabulary at the last prompt
   position, ``logit_rel = logit_max_abs / max |reference|``. Allowed: ``atol + rtol x max |reference|``.
3. **KV**: the request's K/V *as stored in the pool* (every prompt slot, hit and computed blocks, read back
   with a fault-free gather) against the reference K/V; ``kv_max_abs``, ``kv_rel``, allowed likewise.
   This catches a bad write (stale or misplaced K/V) at the request that made it.
4. **Argmax**: the top-1 tokens must agree when the reference's top-2 margin is *clear*, i.e. larger than
   ``margin_factor x`` the allowed logit error (an in-tolerance perturbation cannot flip it); an unclear
   margin is reported (``argmax_clear = False``) and not held against the run.
5. **Greedy continuation**: ``k`` greedy tokens from the cached state (the request's working cache) and
   from the reference; ``greedy_agree`` = leading tokens that match. A mismatch fails only if the
   reference's margin at that step was clear (steps after a mismatch are not compared: contexts differ).

``passed`` = logits, KV, argmax and greedy all within tolerance. Tolerances per dtype are in
:data:`TOLERANCES` (fp32: 1e-4 absolute plus 1e-5 relative; measured differences on CPU are ~1e-6).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from kvlab.engine.adapters import AdapterSet
from kvlab.engine.model import cache_from_kv, forward_logits, kv_from_cache
from kvlab.errors import ConfigError


@dataclass(frozen=True)
class Tolerance:
    """Allowed differences: ``atol + rtol x max |reference|`` for logits and for K/V values."""

    logit_atol: float
    logit_rtol: float
    kv_atol: float
    kv_rtol: float
    margin_factor: float = 2.0

    @classmethod
    def for_dtypes(cls, *dtypes: torch.dtype) -> Tolerance:
        """The loosest of :data:`TOLERANCES` over ``dtypes`` (e.g. the model's and the pool's)."""
        tols = []
        for dt in dtypes:
            if dt not in TOLERANCES:
                raise ConfigError(f"no default verify tolerance for {dt}; pass tolerance=Tolerance(...)")
            tols.append(TOLERANCES[dt])
        return cls(
            max(t.logit_atol for t in tols),
            max(t.logit_rtol for t in tols),
            max(t.kv_atol for t in tols),
            max(t.kv_rtol for t in tols),
            max(t.margin_factor for t in tols),
        )

    def logits_allowed(self, ref_max: float) -> float:
        return self.logit_atol + self.logit_rtol * ref_max

    def kv_allowed(self, ref_max: float) -> float:
        return self.kv_atol + self.kv_rtol * ref_max


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(1e-4, 1e-5, 1e-4, 1e-5),
    # half precision: cached and uncached runs use kernels of different shapes; initial values, to be
    # calibrated on the GPU (bf16 keeps 8 mantissa bits: 0.4 % per rounding, accumulated over layers)
    torch.float16: Tolerance(1e-3, 1e-2, 1e-3, 1e-2),
    torch.bfloat16: Tolerance(1e-2, 5e-2, 1e-2, 5e-2),
}


@dataclass
class VerifyReport:
    """The oracle's verdict on one cached prefill (module docstring: definitions)."""

    logit_max_abs: float
    logit_rel: float
    logit_allowed: float
    kv_max_abs: float
    kv_rel: float
    kv_allowed: float
    ref_margin: float
    argmax_clear: bool
    argmax_match: bool
    greedy_k: int
    greedy_agree: int
    greedy_ok: bool
    passed: bool
    cached_tokens: list[int]
    reference_tokens: list[int]

    def as_row(self) -> dict[str, float | int | bool]:
        """Scalar fields with a ``verify_`` prefix (token lists left out), for the requests frame."""
        row = asdict(self)
        row.pop("cached_tokens")
        row.pop("reference_tokens")
        return {f"verify_{k}": v for k, v in row.items()}


def _margin(logits: torch.Tensor) -> tuple[int, float]:
    """(argmax, top-1 minus top-2) of a logits vector, in float32."""
    top = logits.float().topk(2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def greedy_tokens(
    model: torch.nn.Module, cache: object, logits: torch.Tensor, start: int, k: int
) -> tuple[list[int], list[float]]:
    """``k`` greedy tokens continuing a sequence of ``start`` tokens whose K/V are in ``cache`` and whose
    last logits are ``logits``; also each step's top-2 margin. ``cache`` is extended (pass a copy)."""
    device = logits.device
    tokens: list[int] = []
    margins: list[float] = []
    for j in range(k):
        tok, margin = _margin(logits)
        tokens.append(tok)
        margins.append(margin)
        if j + 1 < k:
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)
            pos = torch.tensor([[start + j]], dtype=torch.long, device=device)
            logits = forward_logits(model, ids, pos, cache)
    return tokens, margins


def reference_prefill(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The uncached forward of a whole prompt ``tokens`` [P]: (last logits, DynamicCache of every position)."""
    cache = cache_from_kv(None, 0)
    ids = tokens.view(1, -1)
    pos = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
    return forward_logits(model, ids, pos, cache), cache


def verify_prefill(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    cached_logits: torch.Tensor,
    cached_kv: torch.Tensor,
    pool_kv: torch.Tensor,
    *,
    k: int = 4,
    tolerance: Tolerance | None = None,
    adapters: AdapterSet | None = None,
    adapter: str | None = None,
) -> VerifyReport:
    """Judge one cached prefill of prompt ``tokens`` [P] (module docstring).

    ``cached_logits``: the engine's last-position logits; ``cached_kv``: the K/V the request continues
    from (its working cache, ``[layers, 2, kv_heads, P, head_dim]``); ``pool_kv``: the same slots read back
    from the pool. ``k`` >= 1 greedy tokens are compared. Runs under ``adapter`` when ``adapters`` is given.
    """
    if k < 1:
        raise ConfigError(f"verify needs k >= 1 greedy tokens, got {k}")
    num_layers = int(cached_kv.shape[0])
    p = int(tokens.shape[0])
    tol = tolerance or Tolerance.for_dtypes(cached_logits.dtype, pool_kv.dtype)
    ctx = adapters.use(adapter) if adapters is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        ref_logits, ref_cache = reference_prefill(model, tokens)
        ref_kv = kv_from_cache(ref_cache)
        ref_tokens, ref_margins = greedy_tokens(model, cache_from_kv(ref_kv, num_layers), ref_logits, p, k)
        own_tokens, _ = greedy_tokens(model, cache_from_kv(cached_kv, num_layers), cached_logits, p, k)

    ref32, own32 = ref_logits.float(), cached_logits.float()
    logit_ref_max = float(ref32.abs().max())
    logit_max_abs = float((own32 - ref32).abs().max())
    logit_allowed = tol.logits_allowed(logit_ref_max)
    kv_ref_max = float(ref_kv.float().abs().max())
    kv_max_abs = float((pool_kv.float() - ref_kv.float()).abs().max())
    kv_allowed = tol.kv_allowed(kv_ref_max)
    clear_at = tol.margin_factor * logit_allowed

    argmax_clear = ref_margins[0] > clear_at
    argmax_match = own_tokens[0] == ref_tokens[0]
    agree = 0
    while agree < k and own_tokens[agree] == ref_tokens[agree]:
        agree += 1
    greedy_ok = agree == k or ref_margins[agree] <= clear_at
    passed = (
        logit_max_abs <= logit_allowed
        and kv_max_abs <= kv_allowed
        and (argmax_match or not argmax_clear)
        and greedy_ok
    )
    return VerifyReport(
        logit_max_abs=logit_max_abs,
        logit_rel=logit_max_abs / logit_ref_max if logit_ref_max else 0.0,
        logit_allowed=logit_allowed,
        kv_max_abs=kv_max_abs,
        kv_rel=kv_max_abs / kv_ref_max if kv_ref_max else 0.0,
        kv_allowed=kv_allowed,
        ref_margin=ref_margins[0],
        argmax_clear=bool(argmax_clear),
        argmax_match=bool(argmax_match),
        greedy_k=k,
        greedy_agree=agree,
        greedy_ok=bool(greedy_ok),
        passed=bool(passed),
        cached_tokens=own_tokens,
        reference_tokens=ref_tokens,
    )
