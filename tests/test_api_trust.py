"""Issue 23, "text/tokenizer" and "Python API" cases: tokenizers that encode text to nothing are refused when they
load (the layout study ends with one line instead of spinning), text with a lone surrogate is refused naming the
field, and a wrong argument type at a public entry point is one ConfigError naming the argument (a path where a
Workload belongs says to call load_trace)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload import synthetic_chat
from kvlab.workload.render import Message, Part, render_prompt
from kvlab.workload.segments import Segment, Segments
from kvlab.workload.tokenizer import ByteTextTokenizer, check_tokenizer, load_tokenizer

LOAD_TRACE = re.escape("load it first with kvlab.workload.load_trace(path)")


# ------------------------------------------------------------------------------------------ tokenizers
def test_layout_study_with_an_empty_tiktoken_ends_with_one_line(tmp_path):
    """TSV: empty .tiktoken rank file as the study tokenizer (was: hang, nothing printed)."""
    (tmp_path / "empty.tiktoken").touch()
    (tmp_path / "l23.yaml").write_text("tokenizer: empty.tiktoken\n")
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "layout-study", "l23.yaml", "--out", "l23"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: error:") and "Traceback" not in proc.stderr
    assert "empty.tiktoken" in lines[0] and "empty" in lines[0].split("empty.tiktoken", 1)[1]
    assert not (tmp_path / "l23").exists()  # refused before any work: nothing written


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_load_tokenizer_refuses_an_empty_tiktoken(tmp_path, content):
    """TSV: Python load_tokenizer of an empty .tiktoken file (was: accepted, encode -> [])."""
    path = tmp_path / "empty.tiktoken"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"empty\.tiktoken: the tokenizer file is empty"):
        load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_rank_file_without_every_byte_is_refused(tmp_path):
    """A rank vocabulary lacking single bytes would drop the text holding them silently."""
    path = tmp_path / "a.tiktoken"
    path.write_text("YQ== 0\n")  # only b"a"
    with pytest.raises(ConfigError, match=r"a\.tiktoken: the vocabulary lacks 255 of the 256 single bytes"):
        load_tokenizer(path, cache_dir=tmp_path / "cache")


def test_tokenizer_file_must_be_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.tiktoken"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"fifo\.tiktoken: is a FIFO \(named pipe\), not a regular tokenizer file"):
        load_tokenizer(fifo, cache_dir=tmp_path / "cache")  # refused by stat, never opened (no hang)
    with pytest.raises(ConfigError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.tiktoken", cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="tokenizer: expected a tokenizer spec"):
        load_tokenizer(3)  # type: ignore[arg-type]


def test_a_tokenizer_that_encodes_text_to_nothing_is_refused():
    class Silent(ByteTextTokenizer):
        def _encode_offsets(self, text, add_special_tokens):
            return [], []

    with pytest.raises(ConfigError, match="tokenizer silent: encodes the probe text .* to no tokens"):
        check_tokenizer(Silent(), "silent")
    tok = ByteTextTokenizer()
    assert check_tokenizer(tok, "byte") is tok


# ------------------------------------------------------------------------------------------ lone surrogates
def test_render_prompt_refuses_a_lone_surrogate():
    """TSV: render_prompt with a lone surrogate (was: raw UnicodeEncodeError)."""
    msgs = [Message("user", (Part("user", "bad \ud800 surrogate"),))]
    with pytest.raises(ConfigError, match=r"^messages\[0\]\.content: holds a lone surrogate \(U\+D800\) at "
                                          "character 4; text must be valid Unicode$"):
        render_prompt(load_tokenizer("byte"), msgs)
    two = [Message.of("system", "system", "ok"), Message("user", (Part("system", "fine "), Part("user", "x\udfff")))]
    with pytest.raises(ConfigError, match=r"messages\[1\]\.content: holds a lone surrogate \(U\+DFFF\) at character 6"):
        render_prompt(ByteTextTokenizer(), two)


def test_encode_and_segments_refuse_a_lone_surrogate():
    tok = ByteTextTokenizer()
    with pytest.raises(ConfigError, match=r"^text: holds a lone surrogate \(U\+DC80\) at character 2"):
        tok.encode("ab\udc80")
    with pytest.raises(ConfigError, match=r"^text: holds a lone surrogate"):
        tok.bytes.encode("\ud800")
    with pytest.raises(ConfigError, match=r"^segments\[0\]\[1\]\.text: holds a lone surrogate"):
        Segments.from_lists([[Segment("system", 0, 1, "a"), Segment("user", 1, 2, "\ud800")]])


def test_text_trace_with_a_lone_surrogate_names_the_file_and_field(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "0", "conversations": [{"from": "human", "value": "hi \ud800"}]}]))
    from kvlab.workload.text import sharegpt_first_turns

    with pytest.raises(TraceFormatError, match=r"sharegpt\.json: field 'conversations': item 0: holds a lone "
                                               r"surrogate \(U\+D800\) at character 3"):
        sharegpt_first_turns(path, ByteTextTokenizer())


def test_native_trace_segment_text_with_a_lone_surrogate_names_the_line(tmp_path):
    from kvlab.workload import from_lists, load_jsonl, save_jsonl

    path = tmp_path / "seg.jsonl"
    save_jsonl(from_lists([[1, 2, 3]], segments=[[Segment("system", 0, 3, "abc")]]), path)
    path.write_text(path.read_text().replace('"abc"', '"a\\ud800"'))
    with pytest.raises(TraceFormatError, match=r"seg\.jsonl:2: field 'segments': segment 0: text holds a lone "
                                               r"surrogate \(U\+D800\) at character 1"):
        load_jsonl(path)


# ------------------------------------------------------------------------------------------ Python API
@pytest.fixture(scope="module")
def small():
    return synthetic_chat(8, seed=1)


def test_replay_none_is_a_config_error():
    """TSV: replay(None, ...) (was: AttributeError 'NoneType' object has no attribute 'default_block_size')."""
    from kvlab.replay import replay

    with pytest.raises(ConfigError, match="^workload: expected a Workload, got None"):
        replay(None, capacity_blocks=100)  # type: ignore[arg-type]


def test_replay_path_says_to_load_the_trace():
    """TSV: replay('path/to/trace.jsonl', ...) (was: AttributeError 'str' object has no attribute ...)."""
    from kvlab.replay import replay

    with pytest.raises(ConfigError, match=rf"^workload: expected a Workload, got a str \('IN/mc20.jsonl'\); "
                                          rf"{LOAD_TRACE}"):
        replay("IN/mc20.jsonl", capacity_blocks=100)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, "trace.jsonl"])
def test_simulate_refuses_a_path_or_none(bad):
    from kvlab.sim import simulate

    with pytest.raises(ConfigError, match="^workload: expected a Workload, got "):
        simulate(bad)  # type: ignore[arg-type]


def test_every_workload_entry_point_names_the_argument(small, tmp_path):
    from pathlib import Path

    from kvlab.replay import ReplayConfig, encode, lru_curve, mini_curve, replay
    from kvlab.sim.engine_executor import run_engine_serving, serving_engine
    from kvlab.sweep import run_sweep, run_sweeps
    from kvlab.workload.expand_text import expand_with_text, trace_requests

    cfg = ReplayConfig(capacity_blocks=10)
    calls = {
        "encode": lambda w: encode(w, cfg),
        "expand_with_text": lambda w: expand_with_text(w),
        "trace_requests": lambda w: trace_requests(w),
        "lru_curve": lambda w: lru_curve(w),
        "mini_curve": lambda w: mini_curve(w, "lru", [10], sample_rate=0.5),
        "run_sweep": lambda w: run_sweep(w, [cfg]),
        "run_engine_serving": lambda w: run_engine_serving(w, None),
        "serving_engine": lambda w: serving_engine(None, w, 10, 16),
    }
    for call in calls.values():
        with pytest.raises(ConfigError, match=rf"^workload: expected a Workload, got a path \('t.jsonl'\); "
                                              rf"{LOAD_TRACE}"):
            call(Path("t.jsonl"))
        with pytest.raises(ConfigError, match="^workload: expected a Workload, got None"):
            call(None)
    with pytest.raises(ConfigError, match=r"^workloads\[1\]: expected a Workload, got a str"):
        run_sweeps([small, "t.jsonl"], [cfg], tmp_path / "s", progress=False)
    with pytest.raises(ConfigError, match=r"^workloads: expected an iterable of Workloads, got a str"):
        run_sweeps("t.jsonl", [cfg], tmp_path / "s2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^configs: expected a list of ReplayConfigs, got a ReplayConfig"):
        run_sweep(small, cfg)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^config: expected a ReplayConfig or None, got a dict"):
        replay(small, {"capacity_blocks": 10})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^engine: expected an Engine, got None"):
        run_engine_serving(small, None)  # type: ignore[arg-type]


def test_layout_study_config_argument_is_checked(tmp_path):
    from kvlab.layout.study import run_study

    with pytest.raises(ConfigError, match=r"^config: expected a LayoutStudyConfig or None, got a str \('l23.yaml'\)"):
        run_study(tmp_path / "out", "l23.yaml")  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_plain_number_arguments_refuse_bools_and_strings(small):
    from kvlab.replay import lru_curve, mini_curve
    from kvlab.sim.engine_executor import serving_engine

    with pytest.raises(ConfigError, match=r"^serving_engine: capacity_blocks must be an integer, got a bool \(True\)"):
        serving_engine(None, small, True, 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^serving_engine: block_size must be an integer, got a str \('16'\)"):
        serving_engine(None, small, 10, "16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^lru_curve: capacities\[1\] must be an integer, got a bool"):
        lru_curve(small, capacities=[10, True])
    with pytest.raises(ConfigError, match=r"^lru_curve: capacities must be a list of integers, got a str"):
        lru_curve(small, capacities="100")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^mini_curve: sample_rate must be a finite number, got a bool"):
        mini_curve(small, "lru", [10], sample_rate=True)


@pytest.mark.parametrize("make", ["synthetic_chat", "zipf_blocks"])
def test_generators_are_bounded_before_any_work(make: str) -> None:
    """A generator's request count is checked before anything is generated: 10**9 and booleans are refused
    naming n_requests (10**9 requests would take minutes and exhaust memory)."""
    import kvlab.workload.generate as gen

    for bad, words in ((10**9, "1,000,000"), (True, "must be an integer")):
        with pytest.raises(ConfigError, match=words) as info:
            getattr(gen, make)(bad)
        assert f"{make}: n_requests" in str(info.value)


def test_results_and_experiment_entry_points_name_the_argument(tmp_path) -> None:
    """load / read_results / run_experiment with a wrong type: one ConfigError naming the argument (not a
    TypeError); run_experiment refuses a dict (Experiment(**data) makes one) before anything is written."""
    import kvlab.results
    from kvlab.experiment import run_experiment

    with pytest.raises(ConfigError, match=r"^experiment: expected an experiment name.*, got None$"):
        kvlab.results.load(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^results: expected the results root folder .*, got an int$"):
        kvlab.results.load("x", results=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^path: expected a run's results folder .*, got None$"):
        kvlab.results.read_results(None)  # type: ignore[arg-type]
    data = {"name": "x", "trace": {"path": "t.jsonl"}, "cache": {"capacity_blocks": 100}}
    with pytest.raises(ConfigError, match=r"^experiment: expected an Experiment or the path .*, got a dict; "
                                          r"build one with Experiment\(\*\*data\)$"):
        run_experiment(data, tmp_path / "res", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^results: expected the results root folder"):
        run_experiment(tmp_path / "x.yaml", None, progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "res").exists()


def test_sweep_grid_refuses_boolean_capacities() -> None:
    """grid([True, 100]) is not a 1-block run: refused naming capacity_blocks; integers (numpy's too) kept."""
    import numpy as np

    from kvlab.sweep import grid

    with pytest.raises(ConfigError, match=r"capacity_blocks.*must be an integer, got True \(a boolean\)"):
        grid([True, 100])
    with pytest.raises(ConfigError, match=r"^grid: capacities \(capacity_blocks\) must be a list of integers"):
        grid("100")  # type: ignore[arg-type]
    assert [c.capacity_blocks for c in grid([np.int64(4), 100])] == [4, 100]
