"""Model and hardware profiles of the cost model: what a step's roofline needs to know.

* :class:`ModelProfile` — layer shapes from a Hugging Face ``config.json`` (layers, hidden size, heads,
  KV heads, head dim, intermediate size, vocabulary, dtype, sliding window, experts). Derived: parameter
  counts, weight bytes, FLOPs per token, KV bytes per token.
* :class:`HardwareProfile` — one accelerator: dense peak FLOP/s at the model's 16-bit dtype, memory
  bandwidth and size, links (device-to-device for tensor parallelism; host, storage and network for KV
  tiers), efficiency factors and a fixed per-step overhead. ``calibrated`` is False until the factors
  have been fitted to measurements on that hardware; results carry the label.

Shipped profiles live in ``kvlab/data/models/<name>.json`` (verbatim public ``config.json`` values, with
``_kvlab_source`` citing the file) and ``kvlab/data/hardware/<name>.json``. :func:`load_model` and
:func:`load_hardware` accept a shipped name, a path to a JSON file (a Hugging Face ``config.json`` or a
profile written by ``save``) or a folder holding ``config.json``.

Sizing helpers of the floors above: :func:`kv_pool_blocks` (the device pool as vLLM sizes it),
:func:`kv_bytes_per_block` and :func:`resolve_tiers` (tier capacities in GiB as blocks).

Units: bytes, FLOPs, seconds, FLOP/s, bytes/s; sizes in tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Self

from kvlab.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvlab.tiers.spec import Tier

MODEL_KIND = "kvlab.model_profile"
HARDWARE_KIND = "kvlab.hardware_profile"
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}
# model types whose MLP has two matrices (up, down) instead of the gated three (gate, up, down)
NON_GATED_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "gpt_bigcode", "mpt")


def _dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).removeprefix("torch.").lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


def _norm_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _read_json(path: Path, what: str) -> dict:
    """The JSON object of profile file ``path`` (kvlab.inputs.load_json_object: a regular file, no NaN or
    infinite number)."""
    from kvlab.inputs import load_json_object

    return load_json_object(path, what)


def _no_bool_numbers(data: dict, fields: tuple, what: str) -> None:
    """A profile's number fields are numbers, never booleans (``true`` would count as 1)."""
    for f in fields:
        value = data.get(f)
        if isinstance(value, bool) or (value is not None and not isinstance(value, int | float)):
            raise ConfigError(f"{what}: {f} must be a number, got {value!r}")


def _data_dir(kind: str) -> Path:
    return Path(str(resources.files("kvlab") / "data" / kind))


def shipped_models() -> list[str]:
    """Names of the model profiles shipped with kvlab."""
    return sorted(p.stem for p in _data_dir("models").glob("*.json"))


def shipped_hardware() -> list[str]:
    """Names of the hardware profiles shipped with kvlab."""
    return sorted(p.stem for p in _data_dir("hardware").glob("*.json"))


# ---------------------------------------------------------------------- model
class _JsonProfile:
    """JSON round trip of a profile dataclass: ``{"kind": KIND, **fields}``; unknown fields are refused."""

    KIND: ClassVar[str]
    WHAT: ClassVar[str]  # "model" or "hardware", for error messages

    def to_dict(self) -> dict:
        return {"kind": self.KIND, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON, atomically (a temporary in the same folder, then renamed)."""
        from kvlab.results.paths import atomic_write_file

        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        atomic_write_file(path, lambda tmp: tmp.write_text(text))
        return path

    @classmethod
    def from_dict(cls, data: dict) -> Self:
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - fields - {"kind"}
        if unknown:
            raise ConfigError(f"unknown {cls.WHAT} profile fields: {sorted(unknown)}")
        numbers = tuple(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                        if f.type in ("int", "float", "int | None", "float | None"))
        _no_bool_numbers(data, numbers, f"{cls.WHAT} profile {data.get('name')!r}")
        return cls(**{k: v for k, v in data.items() if k in fields})


@dataclass(frozen=True)
class ModelProfile(_JsonProfile):
    """A decoder-only transformer's shapes (all layers alike).

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim`` defaults to ``hidden_size // num_heads``;
    ``kv_dtype`` (default: ``dtype``) sets the bytes per cached value; ``sliding_window`` (tokens, or
    None) caps the attended context; ``num_experts > 0`` makes the MLP a mixture of experts with
    ``experts_per_token`` active per token (all experts' weights are resident and read).
    """

    KIND: ClassVar[str] = MODEL_KIND
    WHAT: ClassVar[str] = "model"

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    sliding_window: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    kv_bytes_per_token_override: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model profile {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model profile {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        _dtype_bytes(self.dtype)
        if self.kv_dtype is not None:
            _dtype_bytes(self.kv_dtype)
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"model profile {self.name!r}: experts_per_token must be in 1..num_experts")

    # ------------------------------------------------------------------ derived sizes
    @property
    def bytes_per_param(self) -> int:
        return _dtype_bytes(self.dtype)

    @property
    def kv_bytes_per_value(self) -> int:
        return _dtype_bytes(self.kv_dtype or self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 × layers × kv_heads × head_dim × bytes per value`` (K and V), unless overridden."""
        if self.kv_bytes_per_token_override is not None:
            return self.kv_bytes_per_token_override
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def attention_params_per_layer(self) -> int:
        """Q, K, V and O projections."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return 2 * q + kv

    @property
    def mlp_params_per_layer(self) -> int:
        """All experts' MLP weights (resident)."""
        one = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return one * max(self.num_experts, 1)

    @property
    def active_mlp_params_per_layer(self) -> int:
        """MLP weights one token multiplies by (``experts_per_token`` experts, plus the router)."""
        one = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        if not self.num_experts:
            return one
        return one * self.experts_per_token + self.hidden_size * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Weights held in memory: layers (norms included) + embedding + untied LM head."""
        router = self.hidden_size * self.num_experts
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer + router + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.num_layers * per_layer + self.embedding_params + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def step_weight_bytes(self) -> int:
        """Weights one forward step reads: every layer plus the LM head (embedding rows are gathered)."""
        router = self.hidden_size * self.num_experts
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer + router
        return (self.num_layers * per_layer + self.lm_head_params) * self.bytes_per_param

    @property
    def linear_flops_per_token(self) -> int:
        """``2 ×`` the weights one token multiplies by in the layers (the LM head is per sequence)."""
        return 2 * self.num_layers * (self.attention_params_per_layer + self.active_mlp_params_per_layer)

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the logits of one sampled position."""
        return 2 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers: QKᵀ and AV, ``4 × heads × head_dim``."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    # ------------------------------------------------------------------ variants and I/O
    def with_dtypes(self, dtype: str | None = None, kv_dtype: str | None = None) -> ModelProfile:
        """The same model served at another weight and/or KV dtype."""
        changes = {}
        if dtype is not None:
            changes["dtype"] = dtype
        if kv_dtype is not None:
            changes["kv_dtype"] = kv_dtype
        return dataclasses.replace(self, **changes) if changes else self


    def summary(self) -> dict:
        """The profile plus its derived sizes (for manifests and reports)."""
        return {
            **self.to_dict(),
            "num_params": self.num_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "linear_flops_per_token": self.linear_flops_per_token,
        }

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> ModelProfile:
        """Read a Hugging Face ``config.json`` dict (nested ``text_config`` of multimodal models too).

        Field aliases of common architectures are accepted (``n_layer``/``n_embd``/``n_head`` of GPT-2,
        ``num_layers``, ``d_model``, ``ffn_dim``, ``n_inner``, ``multi_query``). A sliding window counts
        only where the config enables it (Qwen2's ``use_sliding_window: false`` disables it).
        """
        cfg = config.get("text_config") or config

        def pick(*names: str, default: object = None) -> object:
            for n in names:
                if cfg.get(n) is not None:
                    return cfg[n]
            return default

        name = name or str(config.get("_name_or_path") or cfg.get("model_type") or "model")
        _no_bool_numbers(cfg, ("num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model",
                               "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "num_kv_heads",
                               "n_head_kv", "head_dim", "intermediate_size", "ffn_dim", "n_inner", "vocab_size",
                               "sliding_window", "num_local_experts", "num_experts", "n_routed_experts",
                               "num_experts_per_tok", "moe_topk", "moe_intermediate_size"), f"config {name!r}")
        layers = pick("num_hidden_layers", "n_layer", "num_layers")
        hidden = pick("hidden_size", "n_embd", "d_model")
        heads = pick("num_attention_heads", "n_head", "num_heads")
        if layers is None or hidden is None or heads is None:
            raise ConfigError(f"config {name!r}: needs layers, hidden size and attention heads")
        kv_heads = pick("num_key_value_heads", "num_kv_heads", "n_head_kv")
        if kv_heads is None:
            kv_heads = 1 if cfg.get("multi_query") else heads
        head_dim = pick("head_dim") or hidden // heads
        inter = pick("intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        experts = int(pick("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
        per_token = int(pick("num_experts_per_tok", "moe_topk", default=0) or 0) if experts else 0
        if experts:
            inter = pick("moe_intermediate_size") or inter
        dtype = str(pick("torch_dtype", "dtype", default=None) or config.get("torch_dtype") or "bfloat16")
        model_type = str(cfg.get("model_type") or config.get("model_type") or "")
        return cls(
            name=name,
            num_layers=int(layers),
            hidden_size=int(hidden),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(inter),
            vocab_size=int(pick("vocab_size", default=32000)),
            dtype=dtype.removeprefix("torch."),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            gated_mlp=model_type not in NON_GATED_MLP,
            sliding_window=int(window) if window else None,
            num_experts=experts,
            experts_per_token=per_token,
            source=str(config.get("_kvlab_source") or config.get("_name_or_path") or ""),
        )


def load_model(name_or_path: str | Path | ModelProfile, *, dtype: str | None = None,
               kv_dtype: str | None = None) -> ModelProfile:
    """A model profile by shipped name (``llama-3-8b``), JSON path (HF ``config.json`` or a saved profile)
    or folder holding ``config.json``; ``dtype`` / ``kv_dtype`` override the served precision."""
    if isinstance(name_or_path, ModelProfile):
        return name_or_path.with_dtypes(dtype, kv_dtype)
    path = Path(name_or_path)
    shipped = _data_dir("models") / f"{_norm_name(str(name_or_path))}.json"
    if not path.exists() and shipped.exists():
        data = json.loads(shipped.read_text())
        return ModelProfile.from_hf_config(data, name=shipped.stem).with_dtypes(dtype, kv_dtype)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"no model profile {str(name_or_path)!r}: not a shipped name "
                          f"({', '.join(shipped_models())}), a config.json or a folder holding one")
    data = _read_json(path, "model config")
    try:
        if data.get("kind") == MODEL_KIND:
            profile = ModelProfile.from_dict(data)
        else:
            stem = path.parent.name if path.name == "config.json" else path.stem
            profile = ModelProfile.from_hf_config(data, name=stem)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return profile.with_dtypes(dtype, kv_dtype)


def check_tensor_parallel(model: ModelProfile, tensor_parallel: int) -> int:
    """``tensor_parallel`` if ``model`` can be sharded over that many devices, as vLLM requires: the attention
    heads divide by it, and so do the KV heads (or, with fewer KV heads than devices, it divides by their
    number: each KV head replicated). ConfigError naming ``tensor_parallel`` and the sizes that fit otherwise."""
    heads, kv = model.num_heads, model.num_kv_heads

    def fits(tp: int) -> bool:
        return heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)

    if tensor_parallel < 1 or not fits(tensor_parallel):
        sizes = [tp for tp in range(1, heads + 1) if fits(tp)]
        raise ConfigError(f"tensor_parallel {tensor_parallel} does not divide {model.name}'s {heads} attention heads "
                          f"and {kv} KV heads (vLLM's rule); it fits {', '.join(map(str, sizes))}")
    return tensor_parallel


# ---------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class HardwareProfile(_JsonProfile):
    """One accelerator (bandwidths per direction, bytes/s; peak in FLOP/s at 16-bit, dense).

    Efficiency factors are the attained share of the peak: ``compute_efficiency`` for the linear layers,
    ``attention_efficiency`` for attention FLOPs, ``memory_efficiency`` for weight and KV traffic.
    ``step_overhead_s`` is added once per step (scheduling, launch, sampling); ``prefill_overhead_s`` once
    per prefill entry of a step (a sequence computing more than one token, or its first: gathering its
    cached context, writing new KV into the pool; 0 unless calibrated); ``batch_overhead_s`` the extra seconds
    of a step of ``S`` entries over the equation (per-sequence work of a batched engine: attention calls,
    sampling; on a CPU, BLAS kernels that price 2-4 logit rows unevenly), measured at knots ``(S, seconds)``
    with ``S >= 2`` and interpolated through ``(1, 0)`` (:meth:`batch_overhead`; empty unless calibrated on
    batched steps); ``collective_latency_s`` once per all-reduce under tensor parallelism.
    """

    KIND: ClassVar[str] = HARDWARE_KIND
    WHAT: ClassVar[str] = "hardware"

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: int
    interconnect_bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    storage_bandwidth: float = 0.0
    network_bandwidth: float = 0.0
    compute_efficiency: float = 0.6
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.001
    collective_latency_s: float = 1e-05
    prefill_overhead_s: float = 0.0
    batch_overhead_s: tuple[tuple[int, float], ...] = ()
    calibrated: bool = False
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "memory_bandwidth", "memory_bytes"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"hardware profile {self.name!r}: {f} must be > 0")
        for f in ("compute_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ConfigError(f"hardware profile {self.name!r}: {f} must be in (0, 1]")
        if min(self.step_overhead_s, self.collective_latency_s, self.prefill_overhead_s) < 0:
            raise ConfigError(f"hardware profile {self.name!r}: overheads must be >= 0")
        try:
            knots = tuple(sorted((int(s), float(t)) for s, t in self.batch_overhead_s))
        except (TypeError, ValueError):
            raise ConfigError(f"hardware profile {self.name!r}: batch_overhead_s must be [entries, seconds] pairs, "
                              f"got {self.batch_overhead_s!r}") from None
        if any(s < 2 or t < 0 for s, t in knots) or len({s for s, _ in knots}) != len(knots):
            raise ConfigError(f"hardware profile {self.name!r}: batch_overhead_s needs distinct entries >= 2 and "
                              f"seconds >= 0, got {list(knots)}")
        object.__setattr__(self, "batch_overhead_s", knots)  # JSON lists -> sorted tuples (frozen dataclass)

    def batch_overhead(self, entries):  # noqa: ANN001, ANN201 - an int or an int array in, the same shape out
        """Extra seconds of a step of ``entries`` sequences (``batch_overhead_s``): piecewise linear through
        ``(1, 0)`` and the knots, along the last segment past the last knot, never below 0."""
        import numpy as np

        xs = np.array([1] + [s for s, _ in self.batch_overhead_s], dtype=np.float64)
        ys = np.array([0.0] + [t for _, t in self.batch_overhead_s])
        e = np.asarray(entries, dtype=np.float64)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(e > xs[-1], ys[-1] + (e - xs[-1]) * slope, np.interp(e, xs, ys))
        return np.maximum(out, 0.0)

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound at peak."""
        return self.peak_flops / self.memory_bandwidth

    @property
    def label(self) -> str:
        """``name`` plus ``/uncalibrated`` unless fitted to measurements."""
        return self.name if self.calibrated else f"{self.name}/uncalibrated"

    def with_overrides(self, **changes: object) -> HardwareProfile:
        """A copy with some fields changed (e.g. fitted efficiencies, ``calibrated=True``)."""
        return dataclasses.replace(self, **changes)



HARDWARE_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200", "a100": "a100-80gb",
                    "a100-sxm": "a100-80gb", "4090": "rtx-4090", "rtx4090": "rtx-4090", "cpu": "cpu-local"}


def load_hardware(name_or_path: str | Path | HardwareProfile) -> HardwareProfile:
    """A hardware profile by shipped name (``h100``, ``h200``, ``a100-80gb``, ``l40s``, ``rtx-4090``,
    ``cpu-local``) or a JSON path written by :meth:`HardwareProfile.save`."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    path = Path(name_or_path)
    key = _norm_name(str(name_or_path))
    shipped = _data_dir("hardware") / f"{HARDWARE_ALIASES.get(key, key)}.json"
    if not path.exists() and shipped.exists():
        path = shipped
    if not path.exists():
        raise ConfigError(f"no hardware profile {str(name_or_path)!r}: not a shipped name "
                          f"({', '.join(shipped_hardware())}) or a profile JSON file")
    data = _read_json(path, "hardware profile")
    try:
        return HardwareProfile.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def kv_pool_blocks(
    model: ModelProfile,
    hardware: HardwareProfile,
    block_size: int,
    *,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel: int = 1,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> int:
    """KV blocks that fit beside the weights, as vLLM sizes its pool (per device, summed over devices):

    ``tp × (memory × utilization − weights / tp − activations) / (block_size × kv_bytes_per_token)``,
    with activations ≈ ``max_num_batched_tokens × (2 × intermediate + 4 × hidden) × bytes / tp`` (the
    widest intermediate tensors of one step) + fp32 logits of ``max_num_seqs`` sampled positions.
    Raises ConfigError if the weights do not fit or no block does.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    check_tensor_parallel(model, tensor_parallel)
    budget = hardware.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes / tensor_parallel
    act = (max_num_batched_tokens * (2 * model.intermediate_size + 4 * model.hidden_size) * model.bytes_per_param
           / tensor_parallel + max_num_seqs * model.vocab_size * 4)
    free = budget - weights - act
    per_block = block_size * model.kv_bytes_per_token / tensor_parallel
    blocks = math.floor(free / per_block) if free > 0 else 0
    if blocks < 1:
        raise ConfigError(
            f"{model.name} does not leave room for KV blocks on {tensor_parallel} x {hardware.name}: "
            f"{budget / 1e9:.1f} GB usable per device, weights {weights / 1e9:.1f} GB, activations "
            f"{act / 1e9:.1f} GB (raise tensor_parallel or gpu_memory_utilization, or give capacity_blocks)"
        )
    return blocks


# ---------------------------------------------------------------------- tier sizes
def kv_bytes_per_block(model: str | None, block_size: int) -> int | None:
    """KV bytes of one block of ``block_size`` tokens for ``model`` (a profile name or file), None without a
    model."""
    if model is None:
        return None
    return int(load_model(model).kv_bytes_per_token) * block_size


def resolve_tiers(tiers: Sequence[Tier], model: str | None, block_size: int) -> list[Tier]:
    """``tiers`` with every ``capacity_gib`` converted to blocks of ``block_size`` for ``model`` (the model is
    loaded only when a tier is sized in GiB)."""
    if not tiers:
        return []
    per_block = kv_bytes_per_block(model, block_size) if any(t.capacity_blocks is None for t in tiers) else None
    return [t.resolve(per_block) for t in tiers]
