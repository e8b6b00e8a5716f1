"""Causal LMs for the real engine: named random-weight shapes, Hugging Face checkpoints, one forward call.

Random-weight models are the offline default (no download). Their init is scaled so that outputs are
*informative* for the cached-vs-uncached oracle (docs/engine.md, "Random weights"):

* every weight matrix and embedding is drawn with std ``init_gain / sqrt(hidden_size)``, so a projection
  of a normalised hidden state has unit-scale entries and attention scores ``q.k / sqrt(head_dim)`` are
  O(1): attention is peaked and depends strongly on positions and earlier tokens (HF's default std 0.02
  leaves attention almost uniform at small widths, and a one-position RoPE shift barely moves a logit);
* the LM head is re-drawn with std ``logit_std / sqrt(hidden_size)``: the final norm's output has unit
  RMS, so logits have a standard deviation of about ``logit_std`` (default 4) and the top-2 margin of a
  1k-token vocabulary is ~1 logit, far above float error, instead of ~0.05 with HF's default init.

Word embeddings are never tied in random models (the head is re-drawn on its own).

The forward helper :func:`forward_logits` passes the cache under the keyword the installed transformers
uses (``cache`` in 5.2x, ``past_key_values`` before) and only ``input_ids``, ``position_ids``,
``use_cache`` and ``logits_to_keep``: the attention mask and any cache positions are derived by the model
from the cache length, identically in cached and uncached runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from kvlab.errors import ConfigError

_NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
_TINY = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    **_NO_SPECIAL,
}

SHAPES: dict[str, dict[str, Any]] = {
    # tests: 4 layers, hidden 128, 4 query heads sharing 2 KV heads (GQA), 1k vocabulary (bytes fit)
    "tiny-llama": {"model_type": "llama", **_TINY},
    "tiny-qwen2": {"model_type": "qwen2", **_TINY},
    "tiny-mistral": {"model_type": "mistral", **_TINY, "sliding_window": None},
    "tiny-gpt2": {"model_type": "gpt2", "vocab_size": 1024, "n_embd": 128, "n_layer": 4, "n_head": 4,
                  "n_positions": 4096, **_NO_SPECIAL},
    # CPU timing: 4 layers, hidden 512, 8 query heads / 2 KV heads, Llama-2 vocabulary size, fp32
    "cpu-bench": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                  "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, **_NO_SPECIAL},
    # GPU timing: Llama-3-8B's shape (128 KiB of bf16 KV per token), random weights built on the device
    "llama-3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                   **_NO_SPECIAL},
}
SHAPE_DTYPES = {"llama-3-8b": torch.bfloat16}  # others default to float32
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else CPU; anything else as given (CUDA only probed then)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp32"``, ...) or a dtype."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    value = getattr(torch, names.get(str(dtype), str(dtype)), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype or its name, got {dtype!r}")
    return value


def shape_config(shape: str | Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A transformers config from a named shape (:data:`SHAPES`), a dict with ``model_type``, or a config."""
    if isinstance(shape, PretrainedConfig):
        return copy.deepcopy(shape)
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"unknown model shape {shape!r}; named shapes: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    params = dict(shape)
    model_type = params.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError("a model config dict needs a 'model_type' (e.g. 'llama', 'qwen2', 'mistral', 'gpt2')")
    try:
        return AutoConfig.for_model(model_type, **params)
    except ValueError as e:
        raise ConfigError(f"cannot build a {model_type!r} config: {e}") from None


def build_random_model(
    shape: str | Mapping[str, Any] | PretrainedConfig = "tiny-llama",
    seed: int = 0,
    *,
    init_gain: float = 1.0,
    logit_std: float = 4.0,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A causal LM with seeded random weights (module docstring: the scaled init), in eval mode.

    Weights are created directly on ``device`` (``torch.device`` context: an 8B-shaped model never
    materialises on the CPU) in ``dtype`` (default: the shape's, bfloat16 for ``llama-3-8b``, else
    float32). The same seed, shape, dtype and device give identical weights; CPU and CUDA draw different
    numbers. The model gets ``kvlab_model_id`` (``random:<shape>:seed<seed>``), used as the hasher's model id.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if init_gain <= 0 or logit_std <= 0:
        raise ConfigError(f"init_gain and logit_std must be > 0, got {init_gain}, {logit_std}")
    name = shape if isinstance(shape, str) else "custom"
    config = shape_config(shape)
    hidden = int(config.hidden_size)
    config.initializer_range = init_gain / math.sqrt(hidden)
    config.tie_word_embeddings = False
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, SHAPE_DTYPES.get(name, torch.float32))
    torch.manual_seed(seed)
    with dev:
        model = AutoModelForCausalLM.from_config(config, dtype=dt, attn_implementation=attn_implementation)
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"{type(model).__name__} has no output embeddings to scale")
    with torch.no_grad():
        head.weight.normal_(0.0, logit_std / math.sqrt(hidden))
    model.eval().requires_grad_(False)
    model.kvlab_model_id = f"random:{name}:seed{seed}"
    model.kvlab_seed = int(seed)
    return model


def load_model(
    name_or_path: str,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    **kwargs: Any,
) -> PreTrainedModel:
    """A Hugging Face causal LM by hub name or local path, on ``device``, in eval mode.

    ``dtype`` defaults to the checkpoint's own (``"auto"``); ``kwargs`` go to ``from_pretrained``
    (e.g. ``local_files_only=True``, ``revision=``). The model id for block keys is ``name_or_path``.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    dev = resolve_device(device)
    dt = "auto" if dtype is None else resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dt, attn_implementation=attn_implementation, device_map=None, **kwargs
    )
    model.to(dev).eval().requires_grad_(False)
    model.kvlab_model_id = str(name_or_path)
    return model


def model_id(model: PreTrainedModel) -> str:
    """The id that goes into block keys: ``kvlab_model_id`` if set, else the config's name or type."""
    return str(
        getattr(model, "kvlab_model_id", None) or getattr(model.config, "_name_or_path", "") or model.config.model_type
    )


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding (token ids must be below this)."""
    return int(model.get_input_embeddings().num_embeddings)


@dataclass(frozen=True)
class _CallSpec:
    cache_kw: str  # "cache" (transformers >= 5.2x) or "past_key_values"
    logits_to_keep: bool


_SPECS: dict[type, _CallSpec] = {}


def _call_spec(model: torch.nn.Module) -> _CallSpec:
    spec = _SPECS.get(type(model))
    if spec is None:
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            kw = "cache"
        elif "past_key_values" in params:
            kw = "past_key_values"
        else:
            raise ConfigError(f"{type(model).__name__}.forward takes no KV cache argument")
        spec = _SPECS[type(model)] = _CallSpec(kw, "logits_to_keep" in params)
    return spec


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    *,
    last_only: bool = True,
) -> torch.Tensor:
    """Run ``input_ids`` [1, T] at ``position_ids`` [1, T] after the tokens already in ``cache``.

    ``cache`` is extended in place with the new tokens' K/V. Returns the last position's logits
    ``[vocab]`` (``last_only``) or all ``[T, vocab]``, in the model's dtype.
    """
    spec = _call_spec(model)
    kwargs: dict[str, Any] = {spec.cache_kw: cache, "use_cache": True, "position_ids": position_ids}
    if last_only and spec.logits_to_keep:
        kwargs["logits_to_keep"] = 1
    logits = model(input_ids=input_ids, **kwargs).logits
    return logits[0, -1] if last_only else logits[0]


class _MaskedGQA:
    """State of :func:`masked_gqa`: nesting depth and transformers' own ``use_gqa_in_sdpa`` (None: not installed)."""

    depth = 0
    original = None
    available: bool | None = None


def _use_gqa_in_sdpa(attention_mask: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> bool:
    """transformers' choice, except inside :func:`masked_gqa` on the CPU: grouped-query SDPA with a mask."""
    if _MaskedGQA.depth and key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
        return True
    return _MaskedGQA.original(attention_mask, key, value)


def _install_masked_gqa() -> bool:
    if _MaskedGQA.available is None:
        _MaskedGQA.available = False
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2] if x.isdigit())
        try:
            from transformers.integrations import sdpa_attention
        except ImportError:
            return False
        original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
        if version >= (2, 5) and callable(original):  # SDPA's enable_gqa exists from torch 2.5
            _MaskedGQA.original = original
            sdpa_attention.use_gqa_in_sdpa = _use_gqa_in_sdpa
            _MaskedGQA.available = True
    return _MaskedGQA.available


@contextlib.contextmanager
def masked_gqa(enabled: bool = True) -> Iterator[None]:
    """Within this context, transformers' SDPA attention on the CPU passes grouped-query K/V to torch with
    ``enable_gqa=True`` also when there is an attention mask (a suffix after cached tokens), instead of
    first copying every K/V head ``num_attention_heads / num_key_value_heads`` times (``repeat_kv``).

    Same arithmetic (the kernel reads K/V head ``h // groups`` for query head ``h``), one copy of the
    context's K/V per layer less: 6-8 % of the CPU time of a prefill computing 208 tokens after 1,840 on
    ``cpu-bench``. Outside it, and off the CPU (CUDA kernels fall back to math with a mask and GQA),
    transformers decides as usual. A no-op where transformers has no ``use_gqa_in_sdpa`` or torch < 2.5.
    """
    if not enabled or not _install_masked_gqa():
        yield
        return
    _MaskedGQA.depth += 1
    try:
        yield
    finally:
        _MaskedGQA.depth -= 1


def cache_from_kv(kv: torch.Tensor | None, num_layers: int, dtype: torch.dtype | None = None) -> DynamicCache:
    """A DynamicCache holding ``kv`` [layers, 2, kv_heads, tokens, head_dim] (None or 0 tokens: empty)."""
    cache = DynamicCache()
    if kv is None or kv.shape[3] == 0:
        return cache
    if kv.shape[0] != num_layers:
        raise ConfigError(f"KV for {kv.shape[0]} layers given to a {num_layers}-layer model")
    if dtype is not None and kv.dtype != dtype:
        kv = kv.to(dtype)
    for layer in range(num_layers):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    return cache


def kv_from_cache(cache: DynamicCache, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Token slots ``[start, stop)`` of every layer of ``cache`` as one ``[layers, 2, kv_heads, T, head_dim]``."""
    return torch.stack(
        [torch.stack((layer.keys[0, :, start:stop], layer.values[0, :, start:stop])) for layer in cache.layers]
    )


def cache_length(cache: DynamicCache) -> int:
    """Tokens held by ``cache`` (0 when empty)."""
    return int(cache.get_seq_length())


@dataclass(frozen=True)
class ModelKV:
    """What one token's K/V looks like in ``model``: per layer ``[kv_heads, head_dim]`` keys and values."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def probe_kv(model: torch.nn.Module) -> ModelKV:
    """Run one token through ``model`` and read the shape of the K/V it caches (any architecture whose
    layers all cache ``[batch, kv_heads, tokens, head_dim]``, e.g. MHA and GQA)."""
    dev = model_device(model)
    cache = DynamicCache()
    with torch.no_grad():
        forward_logits(model, torch.zeros((1, 1), dtype=torch.long, device=dev),
                       torch.zeros((1, 1), dtype=torch.long, device=dev), cache)
    shapes = {tuple(layer.keys.shape[1::2]) for layer in cache.layers} | {
        tuple(layer.values.shape[1::2]) for layer in cache.layers
    }
    if len(cache.layers) == 0 or len(shapes) != 1:
        raise ConfigError(f"{type(model).__name__}: layers cache K/V of different shapes {sorted(shapes)}; "
                          "the paged pool needs one [kv_heads, head_dim] for all layers")
    heads, head_dim = shapes.pop()
    return ModelKV(len(cache.layers), int(heads), int(head_dim), cache.layers[0].keys.dtype)


def sync_device(device: torch.device) -> None:
    """Wait for queued device work (CUDA/MPS) so host timers cover it; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
