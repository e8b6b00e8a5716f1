"""The serving simulator: the shared cache core and a vLLM-like scheduler driven by a roofline cost model."""

from kvlab.sim.cost import CostModel, StepBreakdown, attention_pairs
from kvlab.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    kv_pool_blocks,
    load_hardware,
    load_model,
    shipped_hardware,
    shipped_models,
)
from kvlab.sim.scheduler import Executor, Request, RequestStatus, Scheduler, SimClock, WallClock
from kvlab.sim.simulator import CostModelExecutor, SimConfig, SimResult, scaled_arrivals, simulate

__all__ = [
    "CostModel",
    "CostModelExecutor",
    "Executor",
    "HardwareProfile",
    "ModelProfile",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SimClock",
    "SimConfig",
    "SimResult",
    "StepBreakdown",
    "WallClock",
    "attention_pairs",
    "kv_pool_blocks",
    "load_hardware",
    "load_model",
    "scaled_arrivals",
    "shipped_hardware",
    "shipped_models",
    "simulate",
]
