"""The unsafe key schemes on the real engine: each makes false hits the oracle flags; the safe scheme does not.

The divergence table (printed with ``pytest -s``) is :func:`kvlab.engine.unsafe.measure_unsafe` on the
tiny random Llama; docs/engine.md records it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab.engine import build_random_model
from kvlab.engine.model import model_id
from kvlab.engine.unsafe import SCENARIOS, forge_collision, measure_unsafe, text_key_values, unsafe_scenarios
from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    torch.set_num_threads(1)
    model = build_random_model("tiny-llama", seed=0)
    out = measure_unsafe(model, num_threads=1, verify_tokens=3)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print("\n" + out.drop(columns=["breaks"]).to_string(index=False))
    return out.set_index(["scenario", "scheme"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_unsafe_variant_is_caught_and_safe_scheme_is_not(table, scenario):
    safe, unsafe = table.loc[(scenario, "safe")], table.loc[(scenario, "unsafe")]
    assert unsafe["hash"].endswith("/unsafe") and not safe["hash"].endswith("unsafe")
    # the unsafe scheme reuses blocks whose true identity differs, and the oracle fails those requests
    assert unsafe["false_hit_blocks"] > 0 and unsafe["hit_blocks"] > safe["hit_blocks"]
    assert unsafe["failed_requests"] > 0 and unsafe["logit_max_abs_false"] > 1.0
    assert unsafe["argmax_agreement"] < 1.0 and unsafe["greedy_agreement"] < 1.0
    assert unsafe["false_hit_requests"] == unsafe["failed_requests"]
    # the safe scheme on the same workload: no false hit, every request within the fp32 tolerance
    assert safe["false_hit_blocks"] == 0 and safe["failed_requests"] == 0
    assert safe["logit_max_abs"] <= 1e-4 and safe["kv_max_abs"] <= 1e-4


def test_adapter_scenario_keeps_true_hits_under_the_safe_scheme(table):
    # the third request per document (adapter A again) hits the first one's blocks: 3 documents x 3 blocks
    assert table.loc[("no_adapter", "safe"), "hit_blocks"] == 9


def test_forged_collisions_and_text_keys():
    h = BlockHasher(truncate_bits=8)
    rng = np.random.default_rng(0)
    target = h.token_keys(np.arange(16), 16)[0]
    forged = forge_collision(h, target, 16, 1024, rng)
    assert h.token_keys(forged, 16)[0] == target and not np.array_equal(forged, np.arange(16))
    full = BlockHasher()
    assert full.token_keys(forged, 16)[0] != full.token_keys(np.arange(16), 16)[0]
    with pytest.raises(ConfigError, match="one byte per token"):
        text_key_values("é", [1])
    sc = {s.name: s for s in unsafe_scenarios(model_id(build_random_model("tiny-llama")), 1024)}
    wl, values = sc["text_keyed"].workload, sc["text_keyed"].unsafe_key_values
    assert np.array_equal(values[0], values[1]) and np.array_equal(wl.prompt(1), wl.prompt(0) + 3)
