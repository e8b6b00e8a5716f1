"""The cost model and its profiles: seed 003's roofline facts, KV sizes, shipped configs, JSON round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.profiles import HardwareProfile, kv_pool_blocks, load_hardware, load_model, shipped_hardware, shipped_models
from kvlab.sim import CostModel, attention_pairs
from kvlab.sim.cost import attention_pairs_array

# seed 003's illustrative GPU: 300 TFLOP/s, 2 TB/s, ridge ~150 FLOP/byte
SEED_GPU = HardwareProfile("seed-003", peak_flops=300e12, memory_bandwidth=2e12, memory_bytes=80 * 2**30)


def test_kv_bytes_per_token_seed_003():
    llama2, llama3 = load_model("llama-2-7b"), load_model("llama-3-8b")
    assert llama2.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB per token
    assert llama3.kv_bytes_per_token == 131_072  # 128 KiB (8 KV heads, GQA)
    assert 4096 * llama2.kv_bytes_per_token == 2 * 2**30  # 4,096 tokens = 2 GiB
    assert 16_384 * 8 * llama2.kv_bytes_per_token == pytest.approx(68.7e9, rel=1e-3)  # 8 x 16k sequences
    assert llama2.weight_bytes == pytest.approx(13.5e9, rel=0.01)  # weights 13.5 GB
    assert load_model("llama-3-8b", kv_dtype="fp8").kv_bytes_per_token == 65_536


def test_ridge_point():
    assert SEED_GPU.ridge_point == pytest.approx(150)
    h100 = load_hardware("h100")
    assert h100.ridge_point == pytest.approx(989.4e12 / 3.35e12)
    assert load_hardware("H100_SXM") == h100  # aliases and spelling


@pytest.mark.parametrize("gpu", [SEED_GPU, "h100", "a100-80gb", "rtx-4090"])
def test_prefill_is_compute_bound_decode_is_memory_bound(gpu):
    cost = CostModel("llama-2-7b", gpu)
    ridge = cost.hardware.ridge_point
    prefill = cost.prefill(512)
    # ~P FLOPs per weight byte: 512 tokens ~ 502 FLOP/byte (seed 003)
    assert 480 < prefill.intensity < 512
    assert prefill.intensity > ridge and prefill.bound == "compute"
    decode = cost.decode(1, 0)
    assert decode.intensity == pytest.approx(1.0, abs=0.01)  # ~1 FLOP/byte
    assert decode.intensity < ridge and decode.bound == "memory"
    # intensity grows with the prompt, about one FLOP/byte per token
    assert cost.prefill(64).intensity == pytest.approx(64, rel=0.06)


def test_decode_time_is_the_weight_read_and_grows_with_context():
    cost = CostModel("llama-3-8b", "h100")
    hw, m = cost.hardware, cost.model
    t = cost.decode(1, 0).duration
    expected = (m.step_weight_bytes + m.kv_bytes_per_token) / (hw.memory_bandwidth * hw.memory_efficiency)
    assert t == pytest.approx(expected + hw.step_overhead_s)
    assert cost.decode(32, 8192).duration > cost.decode(32, 1024).duration > cost.decode(1, 1024).duration
    # a long prefill is compute-bound: doubling the tokens roughly doubles the time
    assert cost.prefill(8192).duration / cost.prefill(4096).duration == pytest.approx(2.0, rel=0.15)


def test_shipped_model_configs_match_published_sizes():
    assert {"llama-2-7b", "llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b"} <= set(shipped_models())
    published = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "qwen2.5-7b": 7.62e9,
                 "mistral-7b": 7.24e9}
    for name, params in published.items():
        assert load_model(name).num_params == pytest.approx(params, rel=0.005), name
    qwen, mistral = load_model("qwen2.5-7b"), load_model("mistral-7b")
    assert qwen.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert qwen.sliding_window is None  # use_sliding_window: false
    assert mistral.sliding_window == 4096
    assert load_model("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_shipped_hardware_profiles_are_uncalibrated():
    assert {"h100", "h200", "a100-80gb", "l40s", "rtx-4090", "cpu-local"} <= set(shipped_hardware())
    for name in shipped_hardware():
        hw = load_hardware(name)
        assert not hw.calibrated and hw.label.endswith("/uncalibrated") and hw.source
    assert CostModel("llama-3-8b", "h100").label == "llama-3-8b@h100/uncalibrated"


def test_profile_json_round_trip(tmp_path):
    model = load_model("mistral-7b", kv_dtype="fp8")
    assert load_model(model.save(tmp_path / "m.json")) == model
    hw = load_hardware("h200").with_overrides(compute_efficiency=0.7, calibrated=True)
    assert load_hardware(hw.save(tmp_path / "h.json")) == hw
    assert CostModel(model, hw).label == "mistral-7b@h200"
    assert json.loads((tmp_path / "h.json").read_text())["kind"] == "kvlab.hardware_profile"


def test_any_hf_config_path_or_folder(tmp_path):
    folder = tmp_path / "tiny-gpt2"
    folder.mkdir()
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg))
    m = load_model(folder)
    assert (m.name, m.num_layers, m.hidden_size, m.num_kv_heads, m.head_dim) == ("tiny-gpt2", 2, 64, 4, 16)
    assert m.intermediate_size == 256 and not m.gated_mlp and m.bytes_per_param == 4
    assert m.kv_bytes_per_token == 2 * 2 * 4 * 16 * 4
    assert load_model(folder / "config.json") == m
    with pytest.raises(ConfigError, match="no model profile"):
        load_model("no-such-model")
    with pytest.raises(ConfigError, match="no hardware profile"):
        load_hardware("no-such-gpu")


def test_kv_pool_from_memory():
    m, h100 = load_model("llama-3-8b"), load_hardware("h100")
    blocks = kv_pool_blocks(m, h100, 16)
    # ~0.9 x 79.6 GiB - 16 GB weights - activations, in 2 MiB blocks
    assert 26_000 < blocks < 30_000
    assert kv_pool_blocks(m, h100, 512) == pytest.approx(blocks / 32, abs=1)
    assert kv_pool_blocks(m, h100, 16, gpu_memory_utilization=0.5) < blocks
    with pytest.raises(ConfigError, match="does not leave room"):
        kv_pool_blocks(load_model("llama-3-70b"), h100, 16)
    assert kv_pool_blocks(load_model("llama-3-70b"), h100, 16, tensor_parallel=4) > 0


def test_attention_pairs_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, c = int(rng.integers(1, 50)), int(rng.integers(0, 80))
        window = None if rng.random() < 0.3 else int(rng.integers(1, 100))
        brute = sum(min(c + j, window) if window else c + j for j in range(1, n + 1))
        assert attention_pairs(n, c, window) == brute
        assert int(attention_pairs_array(np.array([n]), np.array([c]), window)[0]) == brute


@pytest.mark.parametrize("model", ["llama-3-8b", "mistral-7b"])
def test_decode_durations_equal_single_steps_bit_for_bit(model):
    cost = CostModel(model, "h100")
    contexts = [0, 5, 4000, 4095, 4096, 9000]
    run = cost.decode_durations(contexts, 20)
    for i in range(20):
        assert run[i] == cost.duration([(1, c + i) for c in contexts])


def test_tensor_parallel_and_saved_flops():
    one, four = CostModel("llama-3-70b", "h100"), CostModel("llama-3-70b", "h100", tensor_parallel=4)
    assert four.prefill(8192).duration < one.prefill(8192).duration / 3
    assert four.label == "llama-3-70b@h100x4/uncalibrated"
    cost = CostModel("llama-3-8b", "h100")
    saved = cost.saved_prefill_flops(np.array([1000, 1000, 1000]), np.array([0, 512, 992]))
    assert saved[0] == 0 and 0 < saved[1] < saved[2]
    m = cost.model
    # the saved part: linear FLOPs of the hit tokens + their own attention pairs
    assert saved[1] == pytest.approx(512 * m.linear_flops_per_token + m.attention_flops_per_pair * 512 * 513 / 2)


def test_prefill_overhead_counts_prefill_entries_only():
    hw = load_hardware("h100")
    with_p = hw.with_overrides(prefill_overhead_s=0.004)
    base, cost = CostModel("llama-3-8b", hw), CostModel("llama-3-8b", with_p)
    batch = [(128, 0), (64, 512), (1, 700), (1, 30), (1, 0)]  # 3 prefills (n > 1, or a first token), 2 decodes
    assert cost.duration(batch) == pytest.approx(base.duration(batch) + 3 * 0.004, rel=1e-12)
    assert cost.breakdown(batch).t_overhead == pytest.approx(hw.step_overhead_s + 3 * 0.004)
    decodes = [(1, 100), (1, 250)]
    assert cost.duration(decodes) == base.duration(decodes)
    np.testing.assert_array_equal(cost.decode_durations([100, 250], 5), base.decode_durations([100, 250], 5))
    with pytest.raises(ConfigError):
        hw.with_overrides(prefill_overhead_s=-1.0)


def test_batch_overhead_is_interpolated_per_batch_size_and_none_changes_nothing():
    hw = load_hardware("h100")
    knots = [(2, 0.002), (3, 0.006), (4, 0.003), (8, 0.005)]  # uneven on purpose: 3 entries cost more than 4
    with_b = hw.with_overrides(batch_overhead_s=[list(k) for k in reversed(knots)])  # JSON-style, any order
    assert with_b.batch_overhead_s == tuple(knots)
    base, cost = CostModel("llama-3-8b", hw), CostModel("llama-3-8b", with_b)
    expect = {1: 0.0, 2: 0.002, 3: 0.006, 4: 0.003, 6: 0.004, 8: 0.005, 12: 0.007}  # (1, 0); linear; past 8 on slope
    for s, extra in expect.items():
        batch = [(64, 0)] + [(1, 100 + i) for i in range(s - 1)]
        assert cost.duration(batch) == pytest.approx(base.duration(batch) + extra, rel=1e-12, abs=1e-15), s
        assert cost.breakdown(batch).t_overhead == pytest.approx(hw.step_overhead_s + extra)
    expected = base.decode_durations([100, 250, 7], 6) + 0.006
    np.testing.assert_allclose(cost.decode_durations([100, 250, 7], 6), expected, rtol=1e-12)
    assert [cost.duration([(1, c + i) for c in (100, 250, 7)]) for i in range(6)] == pytest.approx(expected)
    assert float(hw.with_overrides(batch_overhead_s=[(2, 0.004), (3, 0.001)]).batch_overhead(9)) == 0.0  # >= 0
    loaded = type(hw).from_dict(json.loads(json.dumps(with_b.to_dict())))
    assert loaded == with_b
    none = CostModel("llama-3-8b", hw.with_overrides(batch_overhead_s=()))  # the default: bit-identical
    batch = [(128, 0), (1, 700), (1, 30)]
    assert none.duration(batch) == base.duration(batch)
    for bad in ([(1, 0.001)], [(2, -1e-3)], [(2, 0.001), (2, 0.002)], [("x", 1)]):
        with pytest.raises(ConfigError, match="batch_overhead_s"):
            hw.with_overrides(batch_overhead_s=bad)
