"""The fast cache-only replay driver."""

from kvlab.replay.replay import ReplayConfig, ReplayResult, encode, replay, resolve_config

__all__ = ["ReplayConfig", "ReplayResult", "encode", "replay", "resolve_config"]
