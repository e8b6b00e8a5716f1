"""The roofline cost model: how long one forward step of a batch takes (docs/simulator.md has the equations).

A step runs a batch of entries ``(num_new_tokens n, cached context c)``. Its totals are

* ``T = Σ n`` tokens, ``S`` = entries (one sampled position each: vLLM computes logits per entry);
* attention pairs ``A = Σ Σ_{j=1..n} min(c + j, W)`` (query-key pairs, ``W`` = sliding window or ∞);
* KV traffic ``K = Σ (min(c, W) + n)`` tokens (the cached context read once, the new tokens written).

and its duration is ::

    t_compute = (F_lin × T + F_head × S) / (peak × tp × η_lin) + F_pair × A / (peak × tp × η_attn)
    t_memory  = (B_weights + B_kv × K) / (bandwidth × tp × η_mem)
    t_comm    = [tp > 1] × (2 L × T × H × b × 2 (tp − 1) / tp / link + 2 L × latency)
    t_step    = max(t_compute, t_memory) + t_comm + overhead + batch_overhead(S) + prefill_overhead × P

with ``P`` the prefill entries (``n > 1`` or ``c = 0``; decode entries are ``(1, c > 0)``),
``F_lin`` = 2 × layer weights a token multiplies by, ``F_head`` = 2 × vocab × hidden, ``F_pair`` =
4 × layers × heads × head_dim, ``B_weights`` = bytes of the layers + LM head, ``B_kv`` = KV bytes per
token. The same expression serves Python scalars and numpy arrays, so a run of identical decode steps
computed at once (``decode_durations``) equals the steps computed one by one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile, ModelProfile, check_tensor_parallel, load_hardware, load_model


def attention_pairs(n: int, c: int, window: int | None) -> int:
    """Query-key pairs of ``n`` new tokens after ``c`` cached ones: ``Σ_{j=1..n} min(c + j, window)``."""
    if window is None or c + n <= window:
        return n * c + n * (n + 1) // 2
    m = max(0, min(n, window - c))  # tokens that still see their whole context
    return m * c + m * (m + 1) // 2 + (n - m) * window


def attention_pairs_array(n: np.ndarray, c: np.ndarray, window: int | None) -> np.ndarray:
    """Vectorised :func:`attention_pairs` (int64 arrays, broadcasting)."""
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    if window is None:
        return n * c + n * (n + 1) // 2
    m = np.clip(window - c, 0, None)
    m = np.minimum(n, m)
    return m * c + m * (m + 1) // 2 + (n - m) * window


def num_prefills(entries: Iterable[tuple[int, int]]) -> int:
    """Prefill entries of a batch: more than one new token, or a sequence's first (no cached context)."""
    return sum(1 for n, c in entries if n > 1 or c == 0)


@dataclass(frozen=True)
class StepBreakdown:
    """One step's work and time (FLOPs, bytes, seconds); ``bound`` is ``"compute"`` or ``"memory"``."""

    tokens: int
    seqs: int
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    t_compute: float
    t_memory: float
    t_comm: float
    t_overhead: float
    duration: float

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per byte moved."""
        return self.flops / self.bytes

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute >= self.t_memory else "memory"


class CostModel:
    """Step durations of one model on ``tensor_parallel`` devices of one hardware profile."""

    def __init__(self, model: ModelProfile | str, hardware: HardwareProfile | str, *, tensor_parallel: int = 1):
        self.model = model = load_model(model)
        check_tensor_parallel(model, tensor_parallel)  # vLLM's rule: it divides the attention and KV heads
        self.hardware = hw = load_hardware(hardware)
        self.tensor_parallel = tp = tensor_parallel
        self.window = model.sliding_window
        self.f_lin = model.linear_flops_per_token
        self.f_head = model.lm_head_flops
        self.f_pair = model.attention_flops_per_pair
        self.b_weights = model.step_weight_bytes
        self.b_kv = model.kv_bytes_per_token
        self.lin_rate = hw.peak_flops * tp * hw.compute_efficiency
        self.attn_rate = hw.peak_flops * tp * hw.attention_efficiency
        self.mem_rate = hw.memory_bandwidth * tp * hw.memory_efficiency
        self.overhead = hw.step_overhead_s
        self.prefill_overhead = hw.prefill_overhead_s
        self.batched_overhead = bool(hw.batch_overhead_s)  # a measured batch_overhead(S) table (calibrated)
        if tp > 1:
            if hw.interconnect_bandwidth <= 0:
                raise ConfigError(f"tensor_parallel={tp} needs an interconnect bandwidth in {hw.name!r}")
            per_token = 2 * model.num_layers * model.hidden_size * model.bytes_per_param * 2 * (tp - 1) / tp
            self.comm_per_token = per_token / hw.interconnect_bandwidth
            self.comm_fixed = 2 * model.num_layers * hw.collective_latency_s
        else:
            self.comm_per_token = 0.0
            self.comm_fixed = 0.0

    @property
    def calibrated(self) -> bool:
        return self.hardware.calibrated

    @property
    def label(self) -> str:
        """``model@hardware[xTP]`` plus ``/uncalibrated`` where the hardware factors are not fitted."""
        tp = f"x{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"{self.model.name}@{self.hardware.name}{tp}" + ("" if self.calibrated else "/uncalibrated")

    # ------------------------------------------------------------------ the equation
    def step_time(self, tokens, seqs, pairs, kv_tokens, maximum=max):
        """``t_step`` for batch totals (ints or int64 arrays; pass ``maximum=np.maximum`` for arrays)."""
        t_compute = (self.f_lin * tokens + self.f_head * seqs) / self.lin_rate + self.f_pair * pairs / self.attn_rate
        t_memory = (self.b_weights + self.b_kv * kv_tokens) / self.mem_rate
        t = maximum(t_compute, t_memory) + (self.comm_per_token * tokens + self.comm_fixed) + self.overhead
        if self.batched_overhead:  # (none unless calibrated on batched steps: bit-identical without it)
            t = t + self.hardware.batch_overhead(seqs)
        return t

    def batch_totals(self, entries: Iterable[tuple[int, int]]) -> tuple[int, int, int, int]:
        """``(T, S, A, K)`` of ``(num_new_tokens, cached_context)`` entries (exact integers)."""
        window = self.window
        tokens = seqs = pairs = kv = 0
        for n, c in entries:
            tokens += n
            seqs += 1
            if window is None:
                pairs += n * c + n * (n + 1) // 2
                kv += c + n
            else:
                pairs += attention_pairs(n, c, window)
                kv += min(c, window) + n
        return tokens, seqs, pairs, kv

    def duration(self, entries: Sequence[tuple[int, int]]) -> float:
        """Seconds of one step over ``(num_new_tokens, cached_context)`` entries (0 for an empty batch)."""
        if not entries:
            return 0.0
        t = float(self.step_time(*self.batch_totals(entries)))
        if self.prefill_overhead:
            t += self.prefill_overhead * num_prefills(entries)
        return t

    def decode_durations(self, contexts: Sequence[int] | np.ndarray, steps: int) -> np.ndarray:
        """Durations of ``steps`` consecutive decode steps of one token per sequence; in step i sequence r
        has ``contexts[r] + i`` cached tokens. Element i equals ``duration([(1, c + i) for c in contexts])``."""
        c = np.asarray(contexts, dtype=np.int64)
        s = len(c)
        i = np.arange(steps, dtype=np.int64)
        if self.window is None:
            base = int(c.sum()) + s  # Σ (c + 1): pairs and KV tokens coincide for one new token
            pairs = base + s * i
            kv = pairs
        else:
            ctx = c[None, :] + i[:, None]
            pairs = np.minimum(ctx + 1, self.window).sum(axis=1)
            kv = (np.minimum(ctx, self.window) + 1).sum(axis=1)
        tokens = np.full(steps, s, dtype=np.int64)
        return self.step_time(tokens, tokens, pairs, kv, maximum=np.maximum)

    # ------------------------------------------------------------------ analysis helpers
    def breakdown(self, entries: Sequence[tuple[int, int]]) -> StepBreakdown:
        """The parts of one step's time (see the module docstring)."""
        tokens, seqs, pairs, kv = self.batch_totals(entries)
        lin = float(self.f_lin * tokens + self.f_head * seqs)
        attn = float(self.f_pair * pairs)
        wb, kb = float(self.b_weights), float(self.b_kv * kv)
        t_c = lin / self.lin_rate + attn / self.attn_rate
        t_m = (wb + kb) / self.mem_rate
        t_comm = self.comm_per_token * tokens + self.comm_fixed
        return StepBreakdown(tokens, seqs, lin, attn, wb, kb, t_c, t_m, t_comm,
                             self.overhead + float(self.hardware.batch_overhead(seqs) if self.batched_overhead else 0)
                             + self.prefill_overhead * num_prefills(entries), self.duration(entries))

    def prefill(self, num_tokens: int, cached: int = 0) -> StepBreakdown:
        """One request's prefill of ``num_tokens`` new tokens after ``cached`` reused ones, alone in a step."""
        return self.breakdown([(num_tokens, cached)])

    def decode(self, batch_size: int, context: int) -> StepBreakdown:
        """One decode step of ``batch_size`` sequences with ``context`` cached tokens each."""
        return self.breakdown([(1, context)] * batch_size)

    def prefill_flops(self, num_tokens: np.ndarray | int, cached: np.ndarray | int = 0) -> np.ndarray:
        """FLOPs of computing ``num_tokens`` after ``cached`` tokens (linear + attention + one logit row)."""
        n = np.asarray(num_tokens, dtype=np.int64)
        c = np.asarray(cached, dtype=np.int64)
        pairs = attention_pairs_array(n, c, self.window)
        return (self.f_lin * n.astype(np.float64) + self.f_head * (n > 0)
                + self.f_pair * pairs.astype(np.float64))

    def saved_prefill_flops(self, prompt_tokens: np.ndarray, hit_tokens: np.ndarray) -> np.ndarray:
        """Prefill FLOPs a hit of ``hit_tokens`` avoided (attention over the cached context still costs)."""
        p = np.asarray(prompt_tokens, dtype=np.int64)
        h = np.asarray(hit_tokens, dtype=np.int64)
        return self.prefill_flops(p, 0) - self.prefill_flops(p - h, h)
