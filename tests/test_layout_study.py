"""The layout study: one command from a YAML config to tidy parquet + manifests (tokenizer identity included),
resumed when the identity matches; bad configs are one line naming the file and the field."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from kvlab.cli import main  # noqa: E402
from kvlab.errors import ConfigError  # noqa: E402
from kvlab.layout import study as study_mod  # noqa: E402
from kvlab.layout.config import LayoutStudyConfig  # noqa: E402
from kvlab.layout.study import run_study  # noqa: E402
from kvlab.results import read_manifest  # noqa: E402
from kvlab.workload.families.base import length_tokenizer  # noqa: E402

TINY = """
block_size: 16
cache_blocks: [512, null]
common_layouts: [as_generated, volatile_top]
families:
  rag:
    family: rag
    config: {n_requests: 12, k: 3}
    layouts: [documents_canonical]
boundary: {prompt_tokens: 64, position_step: 16, block_sizes: [16, 32], requests: 2}
answers: {checkpoint: /nonexistent/model}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_file):
    shared_file("text")
    folder = tmp_path_factory.mktemp("layout")
    path = folder / "study.yaml"
    path.write_text(TINY)
    return path


def test_layout_study_command_writes_tidy_results_and_resumes(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "study"
    assert main(["layout-study", str(tiny), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "rag" in text and "hit rate best" in text and "floor(p / B) * B everywhere: True" in text
    assert "answers: skipped" in text and "/nonexistent/model" in text
    result = run_study(out, LayoutStudyConfig.load(tiny))
    runs = result.runs
    assert sorted(runs["layout"].unique()) == ["as_generated", "documents_canonical", "volatile_top"]
    assert len(runs) == 6 and set(runs["cache"]) == {"512 blocks", "device pool"}
    assert (runs["reused_tokens"] <= runs["prompt_tokens"]).all() and (runs["ttft_mean_s"] > 0).all()
    req = result.requests
    assert set(req["first_miss"].dropna()) <= {"system", "document", "user", "volatile"}
    assert (req["break_tokens"] >= req["hit_tokens"]).all() and (req["break_tokens"] <= req["prompt_tokens"]).all()
    assert set(result.first_miss["what"]) == {"first_miss", "break"}
    assert len(result.requests) == 6 * 12 and (result.requests["nonprefix_bound_tokens"] % 16 == 0).all()
    top = runs[(runs["layout"] == "volatile_top")]["token_hit_rate"]
    assert (top <= runs[runs["layout"] == "as_generated"]["token_hit_rate"].to_numpy()).all()
    bpe = length_tokenizer("kvlab-bpe")
    for folder in ("rag", "boundary"):
        manifest = read_manifest(out / folder)
        tok = manifest["trace"]["tokenizer"]
        assert tok["tokenizer_sha256"] == bpe.sha256 and tok["template_sha256"] == bpe.template_sha256
        assert manifest["driver"] == "layout-study" and manifest["run_id"]
        assert manifest["identity"]["config"]["tokenizer"]["template_sha256"] == bpe.template_sha256  # in the run id
    assert set(runs["tokenizer_sha256"]) == {bpe.sha256}
    assert result.gaps.iloc[0]["hit_gap"] >= 0 and len(result.gaps) == 2

    def no_work(*a, **k):
        raise AssertionError("recomputed a complete run")

    monkeypatch.setattr(study_mod, "study_family", no_work)
    monkeypatch.setattr(study_mod, "boundary_sweep", no_work)
    again = run_study(out, LayoutStudyConfig.load(tiny))
    assert again.runs.equals(runs)
    other = LayoutStudyConfig.parse({**yaml.safe_load(TINY), "tokenizer": "byte"})
    with pytest.raises(AssertionError, match="recomputed"):  # another tokenizer (and template) is another run
        run_study(out, other)


@pytest.mark.parametrize(("text", "message"), [
    ("block_size: 0\n", r"study.yaml: block_size: must be in \[1, 65536\], got 0$"),
    ("cache_blocks: [512, -1]\n", r"study.yaml: cache_blocks: must be greater than or equal to 1, got -1"),
    ("cache_blocks: [512, true]\n", r"study.yaml: cache_blocks: item 1 must be an integer \(blocks\) or null, "
     r"got True \(a boolean\)$"),
    ("cache_blocks: true\n", r"study.yaml: cache_blocks: must be a valid list"),
    ("nonsense: 1\n", r"study.yaml: nonsense: is not a known parameter"),
    ("families: {x: {family: pizza}}\n", r"study.yaml: families.x.family: 'pizza' is not a workload family"),
    ("families: {x: {family: rag, config: {k: 0}}}\n", r"study.yaml: families.x.config: RAGConfig.k: must be in"),
    ("families: {x: {family: rag, layouts: [tools_sideways]}}\n",
     r"study.yaml: families.x.layouts\[0\]: unknown layout transform 'tools_sideways'"),
    ("common_layouts: [volatile_top, {name: volatile_top}]\n",
     r"study.yaml: common_layouts\[1\]: layout 'volatile_top' appears twice"),
    ("clock_start: yesterday\n", r"study.yaml: clock_start: 'yesterday' is not an ISO date"),
    ("families: [1, 2\n", r"study.yaml: not valid YAML at line 2"),
    ("seed: 1\nseed: 2\n", r"study.yaml: line 2: key 'seed' is given twice"),
    ("[1, 2]\n", r"study.yaml: the layout study config must be a mapping"),
])
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, text, message):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        LayoutStudyConfig.load(path)
    assert "\n" not in str(info.value)


def test_cli_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"families": {"rag": {"family": "rag", "layouts": [{"name": "volatile_top",
                                                                                   "where": "up"}]}}}))
    assert main(["layout-study", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab: error: ")
    assert "study.json: families.rag.layouts[0]: transform 'volatile_top': unknown parameter 'where'" in err[0]


def test_answers_section_scores_reference_answers_with_a_local_checkpoint(tmp_path, shared_file):
    """A tiny random-weight checkpoint and a 512-token BPE saved as a Hugging Face folder stand in for a real
    model: the section loads both offline and scores every layout of the chat family (finite log-likelihoods)."""
    pytest.importorskip("torch")
    from kvlab.engine.model import build_random_model
    from kvlab.layout.answers import answers_section
    from kvlab.workload.sources import mt_bench_records
    from kvlab.workload.tokenizer import CHATML_TEMPLATE, wrap_tokenizers
    from kvlab.workload.tokenizer_files import train_bpe

    texts = [t.content for r in mt_bench_records(shared_file("text") / "mt_bench") for t in r.turns][:200]
    tok = wrap_tokenizers(train_bpe(texts, vocab_size=512), "tiny", chat_template=CHATML_TEMPLATE,
                          eos_token="<|endoftext|>")
    folder = tmp_path / "ckpt"
    tok.hf.save_pretrained(folder)
    build_random_model("tiny-llama", seed=0).save_pretrained(folder)
    config = LayoutStudyConfig.parse({
        "common_layouts": ["as_generated", "volatile_top"],
        "families": {"chat": {"family": "mt_bench_chat", "config": {"n_sessions": 4}}},
        "answers": {"checkpoint": str(folder), "limit": 2}})
    result = answers_section(config, {"chat": config.generate("chat")})
    assert result["status"] == "done", result["reason"]
    table = result["table"]
    assert list(table["layout"]) == ["as_generated", "volatile_top"] and (table["requests"] == 2).all()
    assert table["loglik_per_token"].between(-20, 0).all()


def test_a_hash_trace_expanded_into_text_is_a_study_family(tmp_path, shared_file):
    """``family: trace``: the Alibaba sample expanded into real text (kvlab.workload.expand_text), laid out."""
    trace = shared_file("alibaba/sample_traceA_multiturn_20.jsonl")
    config = LayoutStudyConfig.parse({
        "cache_blocks": [None], "common_layouts": ["as_generated", "volatile_top"],
        "families": {"alibaba": {"family": "trace", "config": {"trace": str(trace), "max_requests": 12}}},
        "boundary": {"prompt_tokens": 32, "block_sizes": [16]}})
    result = run_study(tmp_path / "s", config)
    runs = result.runs.set_index("layout")
    assert list(runs.index) == ["as_generated", "volatile_top"] and (runs["requests"] == 12).all()
    assert runs.loc["volatile_top", "token_hit_rate"] < runs.loc["as_generated", "token_hit_rate"]
    with pytest.raises(ConfigError, match=r"families.a.config: trace family.trace: is required"):
        LayoutStudyConfig.parse({"families": {"a": {"family": "trace"}}})
