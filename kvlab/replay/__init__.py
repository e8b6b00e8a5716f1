"""The fast cache-only replay driver, and whole hit-rate curves from one pass (:mod:`kvlab.replay.curves`,
:mod:`kvlab.replay.minisim`)."""

from kvlab.replay.curves import lru_curve
from kvlab.replay.minisim import mini_curve
from kvlab.replay.replay import ReplayConfig, ReplayResult, encode, replay, resolve_config

__all__ = ["ReplayConfig", "ReplayResult", "encode", "lru_curve", "mini_curve", "replay", "resolve_config"]
