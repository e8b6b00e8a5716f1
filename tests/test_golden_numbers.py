"""Golden numbers: replay summaries recorded with the SEMANTICS_VERSION that produced them.

A finished run is reused whenever its run identity matches, and SEMANTICS_VERSION is part of that
identity; so when kvlab's numbers change for the same inputs, SEMANTICS_VERSION must be bumped or old
results would be mixed with new ones. This test fails when the numbers differ from tests/golden/replay.json
while the version is unchanged. After an intended change: bump
``kvlab.results.identity.SEMANTICS_VERSION`` and re-record with

    .venv/bin/python tests/test_golden_numbers.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvlab.replay import ReplayConfig, replay
from kvlab.results.identity import SEMANTICS_VERSION
from kvlab.workload.generate import synthetic_chat

GOLDEN = Path(__file__).resolve().parent / "golden" / "replay.json"
WORKLOAD = {"generator": "synthetic_chat", "n_requests": 400, "seed": 0}
POLICIES = ("lru", "arc", "lfu", "s3fifo")
MODES = ("vllm", "ideal")
CAPACITIES = (64, 512)
BLOCK_SIZE = 16
METRICS = ("token_hit_rate", "block_hit_rate", "request_hit_rate", "mean_request_hit_rate", "ideal_hit_rate",
           "evictions", "rejected_requests", "mean_occupancy", "final_cached_blocks", "block_lookups")
COLUMNS = ("hit_blocks", "new_blocks", "evictions", "cached_blocks", "admitted")
FIX_HINT = ("if the change is intended, bump kvlab.results.identity.SEMANTICS_VERSION and re-record with "
            "`.venv/bin/python tests/test_golden_numbers.py --write`")


def _case_key(policy: str, mode: str, capacity: int) -> str:
    return f"{policy}/{mode}/{capacity}"


def compute() -> dict[str, dict]:
    """Summary metrics, per-request totals and a digest of the per-request columns of every case."""
    w = synthetic_chat(WORKLOAD["n_requests"], seed=WORKLOAD["seed"])
    cases = {}
    for policy in POLICIES:
        for mode in MODES:
            for capacity in CAPACITIES:
                res = replay(w, ReplayConfig(capacity_blocks=capacity, block_size=BLOCK_SIZE, policy=policy,
                                             mode=mode))
                frame = res.requests
                digest = hashlib.sha256()
                for col in COLUMNS:
                    digest.update(np.ascontiguousarray(frame[col].to_numpy(np.int64)).tobytes())
                cases[_case_key(policy, mode, capacity)] = {
                    **{m: res.summary[m] for m in METRICS},
                    "hit_blocks": int(frame["hit_blocks"].sum()),
                    "new_blocks": int(frame["new_blocks"].sum()),
                    "requests_sha256": digest.hexdigest(),
                }
    return cases


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-12, abs=1e-15)
    return a == b


def test_golden_replay_numbers():
    golden = json.loads(GOLDEN.read_text())
    if golden["semantics_version"] != SEMANTICS_VERSION:
        pytest.fail(f"SEMANTICS_VERSION is {SEMANTICS_VERSION} but {GOLDEN.name} was recorded with "
                    f"{golden['semantics_version']}: re-record it with "
                    "`.venv/bin/python tests/test_golden_numbers.py --write`")
    assert golden["workload"] == WORKLOAD and golden["block_size"] == BLOCK_SIZE
    now = compute()
    assert set(now) == set(golden["cases"]), "the golden cases changed: re-record"
    diffs = [f"{case} {name}: recorded {want!r}, now {now[case][name]!r}"
             for case, values in sorted(golden["cases"].items()) for name, want in values.items()
             if not _same(now[case].get(name), want)]
    if diffs:
        pytest.fail(f"replay numbers changed while SEMANTICS_VERSION is still {SEMANTICS_VERSION} "
                    f"({len(diffs)} differences; {FIX_HINT}):\n  " + "\n  ".join(diffs[:20]))


def test_golden_cases_exercise_eviction():
    cases = json.loads(GOLDEN.read_text())["cases"]
    assert all(c["evictions"] > 0 for k, c in cases.items() if k.endswith("/64"))
    assert len({c["requests_sha256"] for c in cases.values()}) > len(POLICIES)  # policies differ


def write() -> None:
    """Re-record tests/golden/replay.json with the current numbers and SEMANTICS_VERSION."""
    GOLDEN.parent.mkdir(exist_ok=True)
    data = {"semantics_version": SEMANTICS_VERSION, "workload": WORKLOAD, "block_size": BLOCK_SIZE,
            "cases": compute()}
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} (SEMANTICS_VERSION {SEMANTICS_VERSION}, {len(data['cases'])} cases)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden_numbers.py --write")
    write()
