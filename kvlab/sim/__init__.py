"""The serving simulator: the shared cache core and a vLLM-like scheduler driven by a roofline cost model.

Model and hardware profiles are :mod:`kvlab.profiles` (below every driver).

The real-engine executor (:mod:`kvlab.sim.engine_executor`: ``EngineExecutor``, ``run_engine_serving``,
``engine_model_profile``) imports torch and the engine, so it is loaded on first use of one of its names;
calibration (:mod:`kvlab.sim.calibrate`) and the fidelity study (:mod:`kvlab.sim.fidelity`) load it when they
first measure.
"""

from kvlab.sim.calibrate import Calibration, CalibrationFit, calibrate, fit_cost_model, measure_steps
from kvlab.sim.clocks import ThreadClock
from kvlab.sim.cost import CostModel, StepBreakdown, attention_pairs
from kvlab.sim.fidelity import FidelityResult, fidelity
from kvlab.sim.scheduler import Executor, Request, RequestStatus, Scheduler, SimClock, WallClock
from kvlab.sim.simulator import CostModelExecutor, SimConfig, SimResult, scaled_arrivals, simulate

_ENGINE_NAMES = ("EngineExecutor", "EngineServingResult", "engine_model_profile", "run_engine_serving")


def __getattr__(name: str) -> object:
    """Lazy access to the torch-backed engine executor names."""
    if name in _ENGINE_NAMES:
        from kvlab.sim import engine_executor

        return getattr(engine_executor, name)
    raise AttributeError(f"module 'kvlab.sim' has no attribute {name!r}")


__all__ = [
    "Calibration",
    "CalibrationFit",
    "CostModel",
    "CostModelExecutor",
    "EngineExecutor",
    "EngineServingResult",
    "Executor",
    "FidelityResult",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SimClock",
    "SimConfig",
    "SimResult",
    "StepBreakdown",
    "ThreadClock",
    "WallClock",
    "attention_pairs",
    "calibrate",
    "engine_model_profile",
    "fidelity",
    "fit_cost_model",
    "measure_steps",
    "run_engine_serving",
    "scaled_arrivals",
    "simulate",
]
