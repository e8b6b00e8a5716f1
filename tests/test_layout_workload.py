"""``kvlab layout-study --workload FILE --layouts ...``: a layout study of a researcher's own requests (a messages
file), one line per layout and a figure; the ``messages`` family in study configs; bad input is one line before
any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.layout.config import LayoutStudyConfig
from kvlab.layout.study import run_study

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layout" / "my_requests.jsonl"
SYSTEM = "You are the support assistant of a small invoicing service. Answer briefly and name the menus you use."
QUESTIONS = ["How do I add a logo?", "Can I send invoices monthly?", "How do I record a refund?",
             "Where is the VAT setting?", "Can my accountant log in?", "How do I export a report?"]


def six_requests(tmp_path: Path) -> Path:
    path = tmp_path / "six.jsonl"
    lines = []
    for k, q in enumerate(QUESTIONS):
        system = [{"type": "text", "text": f"Current time: 2024-07-27 09:00:{k:02d} UTC\n", "segment": "volatile"},
                  {"type": "text", "text": SYSTEM}]
        lines.append(json.dumps({"messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": q}], "output_tokens": 20}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_workload_study_prints_one_line_per_layout_and_writes_its_figure(tmp_path, capsys):
    out = tmp_path / "ls"
    argv = ["layout-study", "--workload", str(six_requests(tmp_path)), "--layouts",
            "as_generated,volatile_top,volatile_after_system", "--tokenizer", "byte", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("layout study of ") and "6 requests, tokenizer byte" in lines[0]
    body = lines[1:-1]
    assert [ln.split()[0] for ln in body] == ["as_generated", "volatile_top", "volatile_after_system"]
    for ln in body:
        assert "hit rate 0." in ln and "TTFT mean " in ln and " ms  p50 " in ln and "first miss: " in ln
    rate = {ln.split()[0]: float(ln.split("hit rate ")[1].split()[0]) for ln in body}
    assert rate["volatile_after_system"] > rate["volatile_top"] == rate["as_generated"]
    assert "first miss: volatile 6/6" in body[1]
    assert lines[-1].startswith(f"figure: {out / 'layouts.png'}")
    for ext in ("png", "pdf", "parquet", "json"):
        assert (out / f"layouts.{ext}").is_file()
    caption = json.loads((out / "layouts.json").read_text())
    assert caption["layout_problems"] == [] and caption["messages_file"]["requests"] == 6
    assert "volatile_after_system reuses" in caption["finding"]
    assert (out / "messages" / "manifest.json").is_file() and not (out / "boundary").exists()
    # again: resumed from the results, the same lines
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[1:-1] == body


@pytest.mark.parametrize(("extra", "message"), [
    (["--layouts", "volatile_top,volatile_sideways"],
     "--layouts: unknown layout 'volatile_sideways' (known: as_generated, "),
    (["--layouts", "volatile_top,,as_generated"], "--layouts: an empty layout name"),
    (["--layouts", "volatile_top,volatile_top"], "--layouts: 'volatile_top' is named twice"),
    (["--quick"], "--quick: not with --workload"),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, capsys, extra, message):
    out = tmp_path / "o"
    assert main(["layout-study", "--workload", str(six_requests(tmp_path)), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab: error: ") and message in err[0]
    if "unknown layout" in message:
        assert "volatile_after_system" in err[0] and "tools_shuffled" in err[0]
    assert not out.exists()


def test_bad_record_or_tokenizer_is_one_line_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(six_requests(tmp_path).read_text() + '{"messages": [{"role": "user", "content": 7}]}\n')
    out = tmp_path / "o"
    assert main(["layout-study", "--workload", str(bad), "--tokenizer", "byte", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvlab: error: {bad}:7: field 'messages[0].content': expected a string or a list of text parts, "
                   "got int 7"]
    assert not out.exists()
    assert main(["layout-study", "--layouts", "volatile_top", "--out", str(out)]) == 2
    assert "--layouts: only with --workload" in capsys.readouterr().err
    assert main(["layout-study", "--workload", str(six_requests(tmp_path)), "--tokenizer",
                 str(tmp_path / "no-such-tokenizer"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-tokenizer" in err[0] and not out.exists()


def test_example_file_volatile_first_loses_to_volatile_after_system(tmp_path):
    """The example (30 requests: a 311-word system prompt with a timestamp before it, tagged volatile): the file
    as written (= volatile_top) breaks every prefix at the timestamp; moving it after the system prompt lets the
    prompt be reused. Through a study config's ``family: messages``."""
    config = LayoutStudyConfig.parse({
        "cache_blocks": [None], "common_layouts": ["as_generated", "volatile_top", "volatile_after_system"],
        "boundary": None, "families": {"mine": {"family": "messages", "config": {"path": str(EXAMPLE)}}}})
    result = run_study(tmp_path / "ex", config)
    rate = result.runs.set_index("layout")["token_hit_rate"]
    assert result.runs["requests"].tolist() == [30, 30, 30]
    assert rate["volatile_top"] == rate["as_generated"] < 0.1
    assert rate["volatile_after_system"] > 0.5
    req = result.requests.set_index("layout")
    top, after = req.loc["volatile_top"], req.loc["volatile_after_system"]
    assert (top["first_miss"] == "volatile").all() and (top["hit_tokens"] <= 16).all()  # lost at the timestamp
    assert (after["hit_tokens"].iloc[1:] >= 400).all()  # the system prompt (about 470 tokens) reused after the first
    ttft = result.runs.set_index("layout")["ttft_mean_s"]
    assert ttft["volatile_after_system"] < ttft["volatile_top"]
