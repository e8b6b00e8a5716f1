"""The priority policy written as the example of docs/policies.md ("Writing a priority policy"): at most 40
lines, saved as a plugin file and imported, it runs compiled in the replay (equal to the Python core,
request for request) and in the simulator (the Python core)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from _util import assert_twin_equal, random_token_workload

from kvlab.policies import make_policy
from kvlab.policies.base import _REGISTRY
from kvlab.replay import ReplayConfig, replay
from kvlab.sim import simulate
from kvlab.workload.generate import synthetic_chat

DOC = Path(__file__).resolve().parent.parent / "docs" / "policies.md"


def example_source() -> str:
    text = DOC.read_text()
    block = re.search(r"<!-- example: begin -->\n```python\n(.*?)```\n<!-- example: end -->", text, re.S)
    assert block is not None, "docs/policies.md lost its example markers"
    return block.group(1)


@pytest.fixture(scope="module")
def lru2(tmp_path_factory):
    """The example imported from a file (numba caches its functions beside it); unregistered afterwards."""
    path = tmp_path_factory.mktemp("plugin") / "lru2_example.py"
    path.write_text(example_source())
    spec = importlib.util.spec_from_file_location("lru2_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lru2_example"] = module
    spec.loader.exec_module(module)
    yield module
    _REGISTRY.pop("lru-2", None)
    sys.modules.pop("lru2_example", None)


def test_the_example_is_short():
    assert len(example_source().splitlines()) <= 40


def test_the_example_runs_compiled_in_the_replay(lru2):
    assert make_policy("lru-2").compiled is not None
    for capacity, block_size in [(13, 2), (40, 1)]:
        w = random_token_workload(3, n=400)
        for mode in ("vllm", "ideal"):
            frame = assert_twin_equal(w, ReplayConfig(capacity_blocks=capacity, block_size=block_size, mode=mode,
                                                      policy="lru-2"))
            assert frame["evictions"].sum() > 100 and frame["hit_blocks"].sum() > 50
    w = synthetic_chat(300, seed=3)
    fast = replay(w, capacity_blocks=150, block_size=16, policy="lru-2", backend="compiled")
    assert fast.summary["backend"] == "compiled" and fast.requests["evictions"].sum() > 500
    lru = replay(w, capacity_blocks=150, block_size=16, policy="lru", backend="compiled")
    assert not np.array_equal(fast.requests["hit_blocks"], lru.requests["hit_blocks"])  # not LRU in disguise


def test_the_example_runs_in_the_simulator(lru2):
    w = synthetic_chat(200, seed=5)
    result = simulate(w, policy="lru-2", capacity_blocks=300, block_size=16)
    s = result.summary
    assert s["policy"] == "lru-2" and s["evictions"] > 1000
    assert 0 < s["token_hit_rate"] <= s["ideal_hit_rate"]
    assert (result.requests["hit_tokens"] <= result.requests["ideal_hit_tokens"]).all()
