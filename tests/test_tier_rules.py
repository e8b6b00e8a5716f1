"""One tier validation for every backend and entry point (kvlab.tiers.spec.check_tiers, docs/tiers.md "Rules").

Each rule of :data:`RULES` is a tier spec that must be refused, with the words its refusal names. It runs on
both replay backends (``compiled``, ``python``) through all three entry points (the CLI ``kvlab replay``, an
experiment file planned by kvlab.experiment, the Python API ``replay(workload, tiers=...)``), and through the
same three entry points of the serving simulator (``kvlab simulate``, ``driver: simulate``, ``simulate()``),
and every one refuses it, before any work, with the same words. The :data:`VALID` specs are accepted by all
of them. Count: 12 rules x 2 backends x 3 entry points = 72 replay checks, plus 12 x 3 = 36 simulator checks
(108 refusals), and 3 valid specs x (2 x 3 + 3) = 27 acceptances. Both backends also refuse each rule given to
them directly (TierStack, the compiled TieredReplay) with tiers built past the schema (``model_construct``).

Then one test per example of issue 23 in this area (strict ``--tier`` parsing, booleans as numbers, NaN in a
preset file, parameters that need another, tensor parallelism, ``--rate -inf``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _util import cli_error

from kvlab.cli import main
from kvlab.errors import ConfigError
from kvlab.experiment import load_experiment, plan
from kvlab.policies import make_cache
from kvlab.replay import replay
from kvlab.sim import simulate
from kvlab.tiers import Tier, TierStack, parse_tier
from kvlab.workload import save_jsonl, synthetic_chat

BACKENDS = ("compiled", "python")
#: (rule, tiers as Tier fields, options, words every refusal holds)
RULES = [
    ("chunk_needs_write_through", [dict(name="dram", capacity_blocks=100, chunk_blocks=4, write="write_back")], {},
     ["dram", "chunk=4 needs write=write_through"]),
    ("chunk_with_selective", [dict(name="dram", capacity_blocks=100, chunk_blocks=2,
                                   write="write_through_selective", selective_hits=2)], {},
     ["dram", "chunk=2 needs write=write_through"]),
    ("write_back_below_chunks", [dict(name="a", capacity_blocks=100, chunk_blocks=2),
                                 dict(name="b", capacity_blocks=100, write="write_back")], {},
     ["'b'", "write=write_back below tier 'a' of 2-block chunks"]),
    ("no_whole_chunk", [dict(name="dram", capacity_blocks=3, chunk_blocks=4)], {},
     ["dram", "blocks=3 holds no whole chunk of chunk=4 blocks"]),
    ("selective_needs_selective_write", [dict(name="dram", capacity_blocks=10, write="write_back",
                                              selective_hits=3)], {},
     ["dram", "applies to write=write_through_selective"]),
    ("exclusive_needs_write_back", [dict(name="dram", capacity_blocks=10, inclusion="exclusive")], {},
     ["dram", "inclusion=exclusive needs write=write_back"]),
    ("names_unique", [dict(name="dram", capacity_blocks=10), dict(name="dram", capacity_blocks=20)], {},
     ["'dram' given twice"]),
    ("name_reserved", [dict(name="device", capacity_blocks=10)], {}, ["'device' is reserved"]),
    ("online_policy", [dict(name="dram", capacity_blocks=10, policy="belady")], {}, ["dram", "offline"]),
    ("one_size", [dict(name="dram")], {}, ["exactly one of blocks=N and gib=X"]),
    ("max_load_needs_tiers", [], {"max_load_tokens": 64}, ["limits the tokens loaded from the lower tiers"]),
    ("max_load_not_negative", [dict(name="dram", capacity_blocks=10)], {"max_load_tokens": -1},
     ["must be in [0,", "got -1"]),
]
#: (name, tiers, options) accepted everywhere
VALID = [
    ("chunked", [dict(name="dram", capacity_blocks=64, chunk_blocks=2)], {}),
    ("write_back_cascade", [dict(name="a", capacity_blocks=64),
                            dict(name="b", capacity_blocks=128, write="write_back", inclusion="exclusive")],
     {"max_load_tokens": 512}),
    ("selective", [dict(name="dram", capacity_blocks=64, write="write_through_selective", selective_hits=2)], {}),
]
CAPACITY = 48  # device blocks (768 tokens: most prompts of the workload fit)
BLOCK = 16  # tokens per block


@pytest.fixture(scope="module")
def workload():
    return synthetic_chat(12, seed=2)


@pytest.fixture(scope="module")
def trace(tmp_path_factory, workload):
    return save_jsonl(workload, tmp_path_factory.mktemp("rules") / "chat.jsonl")


def spelled(t: dict) -> str:
    """The ``--tier`` spelling of Tier fields ``t``."""
    keys = {"capacity_blocks": "blocks", "chunk_blocks": "chunk", "write": "write", "selective_hits": "selective",
            "inclusion": "inclusion", "policy": "policy"}
    return ":".join([t["name"], *(f"{keys[k]}={v}" for k, v in t.items() if k != "name")])


def cli_args(tiers: list[dict], options: dict) -> list[str]:
    out = [a for t in tiers for a in ("--tier", spelled(t))]
    if "max_load_tokens" in options:
        out.append(f"--max-load-tokens={options['max_load_tokens']}")
    return out


def experiment_file(folder, trace, tiers: list[dict], options: dict, backend: str | None, driver: str):
    cache = {"capacity_blocks": CAPACITY, "block_size": BLOCK, "tiers": tiers, **options}
    if backend is not None:
        cache["backend"] = backend
    path = folder / f"exp-{driver}-{backend}.yaml"
    path.write_text(json.dumps({"name": "rules", "trace": {"path": str(trace)}, "cache": cache, "driver": driver}))
    return path


def entry_points(tmp_path, capsys, trace, workload, tiers, options):
    """``(entry point, backend, call)`` for every way a tier spec reaches a run: each call refuses it (raises
    ConfigError or exits 2 with one ``kvlab: error:`` line; returns the message) or accepts it (returns None)."""

    def cli(argv: list[str]) -> str | None:
        code = main([*argv, "--quiet"])
        err = capsys.readouterr().err.strip()
        if code == 0:
            return None
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("kvlab: error:"), err
        return err

    def python(fn, *args, **kwargs) -> str | None:
        try:
            fn(*args, **kwargs)
        except ConfigError as exc:
            return str(exc)
        return None

    def experiment(backend: str | None, driver: str) -> str | None:
        return python(lambda: plan(load_experiment(experiment_file(tmp_path, trace, tiers, options, backend,
                                                                   driver))))

    base = ["--capacity-blocks", str(CAPACITY), "--block-size", str(BLOCK)]
    out = []
    for backend in BACKENDS:
        out += [
            ("cli", backend, lambda b=backend: cli(["replay", str(trace), *base, "--backend", b,
                                                    *cli_args(tiers, options)])),
            ("experiment", backend, lambda b=backend: experiment(b, "replay")),
            ("api", backend, lambda b=backend: python(replay, workload, capacity_blocks=CAPACITY, block_size=BLOCK,
                                                      backend=b, tiers=tiers, **options)),
        ]
    out += [
        ("cli", "simulator", lambda: cli(["simulate", str(trace), *base, *cli_args(tiers, options)])),
        ("experiment", "simulator", lambda: experiment(None, "simulate")),
        ("api", "simulator", lambda: python(simulate, workload, capacity_blocks=CAPACITY, block_size=BLOCK,
                                            tiers=tiers, **options)),
    ]
    return out


@pytest.mark.parametrize(("rule", "tiers", "options", "words"), RULES, ids=[r[0] for r in RULES])
def test_every_rule_is_refused_on_every_backend_and_entry_point(tmp_path, capsys, trace, workload, rule, tiers,
                                                                options, words):
    results = {(where, backend): call()
               for where, backend, call in entry_points(tmp_path, capsys, trace, workload, tiers, options)}
    assert len(results) == 9  # 2 backends x 3 entry points of the replay, 3 of the simulator
    for key, message in results.items():
        assert message is not None, f"{rule}: accepted by {key}"
        assert all(w in message for w in words), (key, message)


@pytest.mark.parametrize(("name", "tiers", "options"), VALID, ids=[v[0] for v in VALID])
def test_valid_specs_are_accepted_on_every_backend_and_entry_point(tmp_path, capsys, trace, workload, name, tiers,
                                                                   options):
    for where, backend, call in entry_points(tmp_path, capsys, trace, workload, tiers, options):
        assert call() is None, (name, where, backend)


def test_rule_count_is_what_the_docstring_says():
    assert (len(RULES), len(BACKENDS), 3) == (12, 2, 3) and len(VALID) == 3


@pytest.mark.parametrize(("rule", "tiers", "options", "words"), [r for r in RULES if r[1]], ids=[r[0] for r in RULES
                                                                                                    if r[1]])
def test_both_backends_refuse_each_rule_given_to_them_directly(workload, rule, tiers, options, words):
    """Tiers made past the schema (``model_construct``: no validation) still meet check_tiers in TierStack (the
    python backend) and in the compiled TieredReplay."""
    from kvlab.hashing import BlockHasher, encode_workload
    from kvlab.policies import make_policy
    from kvlab.tiers.compiled import TieredReplay

    built = [Tier.model_construct(**t) for t in tiers]  # defaults filled in, nothing checked
    with pytest.raises(ConfigError) as err:
        TierStack(make_cache(CAPACITY, "lru", block_size=BLOCK), built, **options)
    assert all(w in str(err.value) for w in words), str(err.value)
    enc = encode_workload(workload, BlockHasher("xxh3_64"), BLOCK)
    device = make_policy("lru")
    with pytest.raises(ConfigError) as err:
        TieredReplay(device.compiled, device.compiled_params(), built, enc, CAPACITY, False,
                     options.get("max_load_tokens"))
    assert all(w in str(err.value) for w in words), str(err.value)


# ---------------------------------------------------------------------- issue 23's examples in this area
@pytest.mark.parametrize(("spec", "words"), [
    ("dram:blocks=100:chunk=4:write=write_back", ["chunk=4 needs write=write_through"]),
    ("dram:blocks=3:chunk=4", ["holds no whole chunk"]),
    ("dram:blocks=10:blocks=20", ["blocks= given twice"]),
    ("dram:blocks=10:write=selective=3", ["holds two '='", "write=write_through_selective:selective=3"]),
    ("dram:blocks=10:write=write_back:selective=3", ["selective=3 applies to write=write_through_selective",
                                                    "not write=write_back"]),
    ("dram:blocks=10:policy=lfu:policy=lru", ["policy= given twice"]),
])
def test_tier_spec_examples_are_refused_by_the_cli(tmp_path, capsys, trace, spec, words):
    for backend in BACKENDS:
        line = cli_error(capsys, ["replay", str(trace), "--capacity-blocks", "300", "--backend", backend, "--tier",
                                  spec, "--out", str(tmp_path / "t")])
        assert spec in line and all(w in line for w in words), line
    assert not (tmp_path / "t").exists()


def test_write_back_below_a_chunked_tier_is_refused_by_the_cli(capsys, trace):
    line = cli_error(capsys, ["replay", str(trace), "--capacity-blocks", "300", "--tier", "a:blocks=100:chunk=2",
                              "--tier", "b:blocks=100:write=write_back"])
    assert "--tier: tier 'b': write=write_back below tier 'a' of 2-block chunks" in line


def test_every_spelling_the_help_shows_is_accepted(capsys):
    """``--help`` == the parser: each alternative of SPEC_HELP parses, to the documented Tier."""
    from kvlab.tiers.spec import SPEC_HELP

    for command in ("replay", "simulate"):
        assert main([command, "--help"]) == 0
        assert SPEC_HELP in "".join(capsys.readouterr().out.split())  # argparse wraps long words
    for spec, write, hits in [("dram:blocks=8:write=write_through", "write_through", 1),
                              ("dram:blocks=8:write=write_through_selective", "write_through_selective", 1),
                              ("dram:blocks=8:write=write_back", "write_back", 1),
                              ("dram:blocks=8:selective=3", "write_through_selective", 3),
                              ("dram:blocks=8:write=write_through_selective:selective=3", "write_through_selective", 3),
                              ("dram:blocks=8:policy=lfu:inclusion=inclusive:chunk=2:touch=off", "write_through", 1)]:
        t = parse_tier(spec)
        assert (t.write, t.selective_hits) == (write, hits)
        assert parse_tier(t.label()) == t


def test_valid_tier_configs_keep_their_run_ids():
    """Strict checks refuse only what no backend ran correctly: a valid config's run id is the one kvlab gave
    it before them (ids computed with the code before issue 23)."""
    from kvlab.replay import ReplayConfig
    from kvlab.results import run_id
    from kvlab.sim.simulator import SimConfig

    configs = {
        "deec7f5387905042deaf": ReplayConfig(capacity_blocks=8, block_size=4, max_load_tokens=64, tiers=[
            parse_tier("dram:blocks=100:chunk=4"), parse_tier("ssd:blocks=200:selective=2")]),
        "7fdc37d76cfb8c2f36a4": ReplayConfig(capacity_blocks=8, block_size=4, model="llama-3-8b", tiers=[
            parse_tier("dram:blocks=100:write=write_back:inclusion=exclusive"), parse_tier("ssd:gib=1:write=back")]),
        "980b63554f5682394547": SimConfig(capacity_blocks=8, tier_prefetch="timeout", prefetch_timeout_s=0.5, tiers=[
            parse_tier("dram:blocks=100:link=pcie5_x16"),
            parse_tier("ssd:blocks=1000:medium=nvme_gen4:link=pcie5_x16")]),
        "70eba016774f24cc280a": ReplayConfig(capacity_blocks=8),
    }
    assert {rid: run_id({"config": c.to_dict(), "trace": {}}) for rid, c in configs.items()} == {
        rid: rid for rid in configs}


def test_tier_capacity_true_is_refused():
    with pytest.raises(ConfigError, match=r"tier 'dram': capacity_blocks \(blocks=\) must be an integer, got True"):
        Tier(name="dram", capacity_blocks=True)
    with pytest.raises(ConfigError, match=r"chunk_blocks \(chunk=\) must be an integer, got False"):
        Tier(name="dram", capacity_blocks=8, chunk_blocks=False)
    assert Tier(name="dram", capacity_blocks=8, touch=False).touch is False  # a bool field takes a bool


def test_booleans_are_never_numbers_in_any_schema():
    from kvlab.replay import ReplayConfig
    from kvlab.sim.simulator import SimConfig

    with pytest.raises(ConfigError, match=r"ReplayConfig.capacity_blocks \(--capacity-blocks\): must be an integer, "
                                          "got True"):
        ReplayConfig(capacity_blocks=True)
    with pytest.raises(ConfigError, match=r"SimConfig.rate \(--rate\): must be a number, got True"):
        SimConfig(rate=True)
    assert ReplayConfig(capacity_blocks=8, verify=True).verify is True


@pytest.mark.parametrize(("cache", "words"), [
    ({"capacity_blocks": True}, "cache.capacity_blocks: must be an integer, got True"),
    ({"capacity_blocks": 300, "max_load_tokens": 512},
     "cache.max_load_tokens limits the tokens loaded from the lower tiers: give cache.tiers too"),
    ({"capacity_blocks": 300, "tiers": [{"name": "dram", "capacity_blocks": 100, "chunk_blocks": 4,
                                         "write": "write_back"}]}, "chunk=4 needs write=write_through"),
    ({"capacity_blocks": 300, "tiers": [{"name": "dram", "capacity_blocks": True}]}, "must be an integer, got True"),
])
def test_experiment_cache_examples_are_refused_naming_the_field(tmp_path, trace, cache, words):
    """capacity_blocks: true; cache.max_load_tokens without tiers; chunk_blocks 4 with write_back."""
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: x\ntrace: {{path: {trace}}}\ncache: {json.dumps(cache)}\n")  # JSON's true: YAML's
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert str(err.value).startswith(str(path)) and words in str(err.value), str(err.value)


@pytest.mark.parametrize(("simulate_section", "words"), [
    ("{tensor_parallel: 3}", "tensor_parallel 3 does not divide llama-3-8b's 32 attention heads and 8 KV heads"),
    ("{prefetch_timeout_s: 5}", "prefetch_timeout_s (5 s) is the longest wait of tier_prefetch=timeout"),
])
def test_experiment_simulator_parameters_are_refused_at_planning(tmp_path, trace, simulate_section, words):
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: x\ntrace: {{path: {trace}}}\ncache: {{capacity_blocks: 64, tiers: [{{name: dram, "
                    f"capacity_gib: 64, link: pcie5_x16}}]}}\nmodel: llama-3-8b\ndriver: simulate\n"
                    f"simulate: {simulate_section}\n")
    with pytest.raises(ConfigError) as err:
        plan(load_experiment(path))  # before any run
    assert words in str(err.value), str(err.value)


def test_nan_latency_in_a_medium_preset_file_is_refused(tmp_path, capsys, trace):
    preset = tmp_path / "nanlat.json"
    preset.write_text('{"kind": "medium", "bandwidth": 7e9, "latency_s": NaN}')
    line = cli_error(capsys, ["simulate", str(trace), "--capacity-blocks", "200", "--tier",
                              f"ssd:blocks=5000:medium={preset}:link=pcie5_x16", "--out", str(tmp_path / "s")])
    assert "latency_s is nan; must be a finite number" in line and "nanlat.json" in line, line
    preset.write_text('{"kind": "medium", "bandwidth": true, "latency_s": 0}')
    with pytest.raises(ConfigError, match="bandwidth must be a number, got True"):
        Tier(name="ssd", capacity_blocks=10, medium=str(preset))
    assert not (tmp_path / "s").exists()


def test_nan_or_bool_in_profiles_is_refused(tmp_path):
    from kvlab.profiles import load_hardware, load_model

    hw = load_hardware("h100").to_dict()
    (tmp_path / "hw.json").write_text(json.dumps({**hw, "peak_flops": float("nan")}))
    with pytest.raises(ConfigError, match="peak_flops is nan; must be a finite number"):
        load_hardware(tmp_path / "hw.json")
    (tmp_path / "hw.json").write_text(json.dumps({**hw, "memory_bytes": True}))
    with pytest.raises(ConfigError, match="memory_bytes must be a number, got True"):
        load_hardware(tmp_path / "hw.json")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64,
                                                      "num_attention_heads": 4, "rope_theta": float("inf")}))
    with pytest.raises(ConfigError, match="rope_theta is inf; must be a finite number"):
        load_model(tmp_path / "config.json")


def test_prefetch_timeout_without_timeout_prefetch_is_refused(tmp_path, capsys, trace):
    line = cli_error(capsys, ["simulate", str(trace), "--tier", "dram:gib=64:link=pcie5_x16",
                              "--prefetch-timeout-s", "5", "--out", str(tmp_path / "s06")])
    assert "--prefetch-timeout-s (5 s)" in line and "--tier-prefetch timeout" in line, line
    assert not (tmp_path / "s06").exists()


def test_tensor_parallel_must_divide_the_heads(tmp_path, capsys, trace):
    line = cli_error(capsys, ["simulate", str(trace), "--model", "llama-3-8b", "--tensor-parallel", "3", "--out",
                              str(tmp_path / "s14")])
    assert "--tensor-parallel 3 does not divide llama-3-8b's 32 attention heads and 8 KV heads" in line, line
    from kvlab.profiles import load_model
    from kvlab.sim.cost import CostModel

    with pytest.raises(ConfigError, match="tensor_parallel 3 does not divide"):
        CostModel(load_model("llama-3-8b"), "h100", tensor_parallel=3)
    assert CostModel("llama-3-8b", "h100", tensor_parallel=16).tensor_parallel == 16  # 8 KV heads, each on 2


@pytest.mark.parametrize("value", ["-inf", "-nan", "-1e3"])
def test_rate_with_a_dash_value_is_one_line_naming_rate(capsys, trace, value):
    line = cli_error(capsys, ["simulate", str(trace), "--quiet", "--rate", value])
    assert "--rate" in line and "expected one argument" not in line, line


def test_policy_param_given_twice_is_refused(capsys, trace):
    for command in ("replay", "simulate"):
        extra = ["--capacity-blocks", "8"] if command == "replay" else []
        line = cli_error(capsys, [command, str(trace), *extra, "--policy-param", "a=1", "--policy-param", "a=2"])
        assert "--policy-param: 'a' given twice" in line, line


def test_a_valid_chunked_tier_gives_the_same_numbers_on_both_backends(workload):
    runs = [replay(workload, capacity_blocks=CAPACITY, block_size=BLOCK, backend=b,
                   tiers=[parse_tier("dram:blocks=64:chunk=2")]) for b in BACKENDS]
    assert [r.summary["backend"] for r in runs] == list(BACKENDS)
    np.testing.assert_array_equal(runs[0].requests["hit_tokens"], runs[1].requests["hit_tokens"])
    assert runs[0].requests["hit_tokens"].sum() > 0 and runs[0].summary["rejected_requests"] < len(workload)
    assert runs[0].summary["tiers"][0]["blocks_stored"] == runs[1].summary["tiers"][0]["blocks_stored"] > 0


def test_model_without_a_tier_is_refused_by_replay(capsys, trace):
    line = cli_error(capsys, ["replay", str(trace), "--capacity-blocks", "8", "--model", "llama-3-8b"])
    assert "--model gives the tiers' KV bytes per block" in line and "give --tier too" in line, line


def test_analysis_warmup_true_is_refused(tmp_path, trace):
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: x\ntrace: {{path: {trace}}}\ncache: {{capacity_blocks: 8}}\n"
                    "analysis: {warmup_requests: true}\n")
    with pytest.raises(ConfigError, match="analysis.warmup_requests: must be an integer, got True"):
        load_experiment(path)
