"""The real engine: a transformers causal LM on a paged KV pool run by the shared cache core (docs/engine.md).

Importing this package needs torch and transformers (CPU builds suffice); nothing CUDA-specific is imported.
"""

from kvlab.engine.adapters import AdapterSet
from kvlab.engine.compute import PagedModel, sync_device
from kvlab.engine.driver import Engine
from kvlab.engine.faults import FAULTS, FaultyEngine
from kvlab.engine.kv_pool import KVLayout, KVPool
from kvlab.engine.model import SHAPES, build_random_model, load_model, resolve_device, shape_config
from kvlab.engine.request import DecodeResult, PrefillResult, Request, SequenceState
from kvlab.engine.result import EngineResult
from kvlab.engine.unsafe import SCENARIOS, UnsafeScenario, measure_unsafe, unsafe_scenarios
from kvlab.engine.verify import TOLERANCES, Tolerance, VerifyReport, verify_prefill
from kvlab.engine.workloads import clip_prompts, prefix_variants

__all__ = [
    "FAULTS",
    "SCENARIOS",
    "SHAPES",
    "TOLERANCES",
    "AdapterSet",
    "DecodeResult",
    "Engine",
    "EngineResult",
    "FaultyEngine",
    "KVLayout",
    "KVPool",
    "PagedModel",
    "PrefillResult",
    "Request",
    "SequenceState",
    "Tolerance",
    "UnsafeScenario",
    "VerifyReport",
    "build_random_model",
    "clip_prompts",
    "load_model",
    "measure_unsafe",
    "prefix_variants",
    "resolve_device",
    "shape_config",
    "sync_device",
    "unsafe_scenarios",
    "verify_prefill",
]
