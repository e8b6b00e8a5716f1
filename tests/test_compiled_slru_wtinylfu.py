"""slru and wtinylfu: the replay kernel and the Python core (driving the same compiled hooks) agree hit for
hit with non-default parameters (uneven slru segments; wtinylfu with a large window, small protected area,
frequent halving and a low saturation count); wtinylfu's counters equal a readable reference."""

from __future__ import annotations

import pytest
from _util import assert_twin_equal, random_token_workload

from kvlab.replay import ReplayConfig

CASES = [
    ("slru", {"segments": 1}),
    ("slru", {"segments": 2}),
    ("slru", {"segments": (0.2, 0.8)}),
    ("slru", {"segments": (0.5, 0.1, 0.15, 0.25)}),
    ("wtinylfu", {"window_ratio": 0.3, "protected_ratio": 0.5, "sample_factor": 0.5, "max_count": 2}),
    ("wtinylfu", {"window_ratio": 0.05, "protected_ratio": 0.0, "sample_factor": 1.0, "max_count": 3}),
    ("wtinylfu", {"window_ratio": 0.5, "protected_ratio": 1.0, "sample_factor": 0.2, "max_count": 1}),
]


@pytest.mark.parametrize(("policy", "params"), CASES)
@pytest.mark.parametrize("capacity", [5, 17, 40])
@pytest.mark.parametrize("mode", ["vllm", "ideal"])
def test_compiled_equals_python_with_parameters(policy, params, capacity, mode):
    w = random_token_workload(11, n=400, vocab=4)
    cfg = ReplayConfig(capacity_blocks=capacity, block_size=2, mode=mode, policy=policy, policy_params=params)
    assert assert_twin_equal(w, cfg)["evictions"].sum() > 100


class ReferenceCounters:
    """The readable specification of W-TinyLFU's frequency counters (the policy's own are compiled only):
    exact per-key counts saturating at ``max_count``, all halved (zeros dropped) every ``sample_factor × C``
    accesses."""

    def __init__(self, capacity: int, sample_factor: float, max_count: int) -> None:
        self.freq: dict = {}
        self.max_count = max_count
        self._accesses = 0
        self._sample = max(1, int(sample_factor * capacity))

    def _record(self, key) -> None:
        freq = self.freq
        f = freq.get(key, 0)
        if f < self.max_count:
            freq[key] = f + 1
        self._accesses += 1
        if self._accesses >= self._sample:
            self.freq = {k: v >> 1 for k, v in freq.items() if v > 1}
            self._accesses //= 2


@pytest.mark.parametrize(("sample_factor", "max_count"), [(0.5, 2), (1.0, 3), (0.2, 1), (10.0, 15)])
def test_wtinylfu_counters_equal_python(sample_factor, max_count):
    """Frequency counters (saturation, halving, dropped zeros) of the twin equal the reference dict's,
    access for access (the replays above compare only their effect on admissions)."""
    import numpy as np

    from kvlab.policies import make_policy
    from kvlab.policies.wtinylfu import _init, _record

    capacity, num_keys = 20, 30
    params = make_policy("wtinylfu", window_ratio=0.1, sample_factor=sample_factor, max_count=max_count)
    py = ReferenceCounters(capacity, sample_factor, max_count)
    B, F, M = _init(capacity, num_keys, params.compiled_params())
    rng = np.random.default_rng(3)
    keys = rng.zipf(1.5, size=3000) % num_keys
    saturated = halvings = 0
    for k in keys:
        before = F.sum()
        py._record(int(k))
        _record(F, M, int(k))
        assert [py.freq.get(i, 0) for i in range(num_keys)] == F.tolist()
        saturated += F.max() == max_count
        halvings += F.sum() < before
    assert saturated > 0 and halvings > 0
