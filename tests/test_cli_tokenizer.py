"""``--tokenizer`` (replay, sweep, simulate, trace stats) and ``trace.tokenizer`` (experiment files): a native
JSONL text trace works from the CLI; the tokenizer changes the run id exactly when it changes the ids (and is
recorded in the manifest); a trace without text keeps its run ids; bad specs are one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from kvlab.cli import main  # noqa: E402
from kvlab.experiment import Experiment, load_experiment, run_experiment  # noqa: E402
from kvlab.results import read_manifest  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly and cite the passages you used. "


@pytest.fixture(scope="module")
def text_trace(tmp_path_factory) -> Path:
    """12 requests as native JSONL ``text`` records sharing a system prompt."""
    path = tmp_path_factory.mktemp("text") / "text.jsonl"
    lines = [json.dumps({"arrival": i * 0.5, "text": SYSTEM * 3 + f"Question {i}: what is block {i % 3}?",
                         "output_length": 8}) for i in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def token_trace(tmp_path_factory) -> Path:
    """The same shape as token ids (no text)."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.jsonl"
    lines = [json.dumps({"arrival": i * 0.5, "tokens": list(range(40)) + [100 + i % 3] * 8, "output_length": 8})
             for i in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(trace: Path, out: Path, *extra: str) -> dict:
    args = ["replay", str(trace), "--capacity-blocks", "64", "--block-size", "16", "--quiet", "--out", str(out)]
    assert main([*args, *extra]) == 0
    return read_manifest(out)


def test_text_trace_replays_with_each_tokenizer(text_trace, tmp_path, capsys):
    byte = replay(text_trace, tmp_path / "byte", "--tokenizer", "byte")
    bpe = replay(text_trace, tmp_path / "bpe", "--tokenizer", "kvlab-bpe")
    default = replay(text_trace, tmp_path / "default")
    assert byte["trace"]["tokenizer"]["tokenizer"] == "byte"
    assert bpe["trace"]["tokenizer"]["tokenizer"] == "kvlab-bpe-16384" == default["trace"]["tokenizer"]["tokenizer"]
    assert byte["run_id"] != bpe["run_id"] == default["run_id"]  # other ids, other run; kvlab-bpe is the default
    text = (SYSTEM * 3 + "Question 0: what is block 0?").encode()
    assert main(["trace", "stats", str(text_trace), "--tokenizer", "byte", "--limit", "1"]) == 0
    stats = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert stats["prompt_tokens"].replace(",", "") == str(len(text))


def test_a_trace_without_text_keeps_its_run_id_and_refuses_an_unused_tokenizer(token_trace, tmp_path, capsys):
    plain = replay(token_trace, tmp_path / "plain")
    assert "tokenizer" not in plain["trace"]
    capsys.readouterr()
    args = ["replay", str(token_trace), "--capacity-blocks", "64", "--block-size", "16", "--tokenizer", "byte"]
    assert main([*args, "--out", str(tmp_path / "unused")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer byte:" in err and "holds no text" in err
    assert not (tmp_path / "unused").exists()


def test_sweep_and_simulate_take_the_tokenizer(text_trace, token_trace, tmp_path, capsys):
    assert main(["sweep", str(text_trace), str(token_trace), "--capacity-blocks", "64", "--block-size", "16",
                 "--tokenizer", "byte", "--quiet", "--out", str(tmp_path / "sw")]) == 0  # one of them has text
    assert main(["simulate", str(text_trace), "--tokenizer", "byte", "--capacity-blocks", "64", "--quiet",
                 "--out", str(tmp_path / "sim")]) == 0
    assert "requests" in capsys.readouterr().out
    assert read_manifest(tmp_path / "sim")["trace"]["tokenizer"]["tokenizer"] == "byte"


def test_a_messages_file_gets_the_tokenizer(tmp_path):
    path = tmp_path / "msgs.jsonl"
    rows = [{"messages": [{"role": "system", "content": SYSTEM * 4},
                          {"role": "user", "content": f"Question {i}: where is order {i}?"}], "arrival": i}
            for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    byte = replay(path, tmp_path / "byte", "--tokenizer", "byte")
    default = replay(path, tmp_path / "default")
    assert byte["trace"]["tokenizer"]["tokenizer"] == "byte"
    assert default["trace"]["tokenizer"]["tokenizer"] == "kvlab-bpe-16384" and byte["run_id"] != default["run_id"]


@pytest.mark.parametrize(("spec", "message"), [
    ("no-such-tokenizer", "--tokenizer: tokenizer 'no-such-tokenizer': not a kvlab tokenizer"),
    ("tekken", "run `kvlab tokenizer fetch tekken`"),
    ("missing.tiktoken", "--tokenizer: missing.tiktoken: no such tokenizer file"),
])
def test_a_bad_tokenizer_is_one_line_before_any_work(text_trace, tmp_path, capsys, monkeypatch, spec, message):
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    for command in (["replay", str(text_trace), "--capacity-blocks", "64"], ["trace", "stats", str(text_trace)],
                    ["simulate", str(text_trace)]):
        assert main([*command, "--tokenizer", spec, "--out", str(tmp_path / "o")] if command[0] != "trace"
                    else [*command, "--tokenizer", spec]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- experiment files
def experiment(trace: Path, name: str, **trace_fields: object) -> dict:
    return {"name": name, "trace": {"path": str(trace), **trace_fields},
            "cache": {"capacity_blocks": 64, "block_size": 16, "backend": "python"}}


def test_experiment_trace_tokenizer(text_trace, tmp_path):
    base = Experiment(**experiment(text_trace, "tok"))
    assert "tokenizer" not in base.model_dump()["trace"]  # left out at its default: definitions unchanged
    byte = run_experiment(Experiment(**experiment(text_trace, "tok_byte", tokenizer="byte")), tmp_path, progress=False)
    bpe = run_experiment(base, tmp_path, progress=False)
    assert byte["run_id"][0] != bpe["run_id"][0]
    assert byte["token_hit_rate"][0] != bpe["token_hit_rate"][0]
    cli = replay(text_trace, tmp_path / "cli", "--tokenizer", "byte", "--backend", "python")
    assert cli["run_id"] == byte["run_id"][0]  # kvlab replay and a replay experiment: one id
    swept = {**experiment(text_trace, "tok_axis"), "sweep": {"grid": {"trace.tokenizer": ["byte", "kvlab-bpe"]}}}
    table = run_experiment(Experiment(**swept), tmp_path, progress=False)
    assert list(table["run_id"]) == [byte["run_id"][0], bpe["run_id"][0]]


@pytest.mark.parametrize(("trace_fields", "sweep", "message"), [
    ({"tokenizer": "tekken"}, None, "trace.tokenizer: tokenizer 'tekken' (Mistral NeMo"),
    ({"tokenizer": "no-such"}, None, "trace.tokenizer: tokenizer 'no-such': not a kvlab tokenizer"),
    ({}, {"grid": {"trace.tokenizer": ["byte", "no-such"]}}, "sweep.grid.trace.tokenizer: tokenizer 'no-such'"),
    ({"tokenizer": ""}, None, "trace.tokenizer"),
])
def test_experiment_refuses_an_unknown_tokenizer_at_load(text_trace, tmp_path, monkeypatch, capsys, trace_fields,
                                                         sweep, message):
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    data = experiment(text_trace, "bad", **trace_fields)
    if sweep:
        data["sweep"] = sweep
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(data))
    assert main(["run", str(file), "--results", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvlab: error: {file}: ") and message in err, err
    assert not (tmp_path / "r").exists()
    if trace_fields.get("tokenizer"):
        with pytest.raises(Exception, match="trace.tokenizer"):
            load_experiment(file)
