"""Messages files (kvlab.workload.messages): a researcher's own requests in the OpenAI chat shape -> tagged requests
and a token Workload (trace format ``messages``); every bad record is one line naming file, line and field, raised
before anything is rendered."""

from __future__ import annotations

import json

import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.workload import load_trace
from kvlab.workload import messages as messages_mod
from kvlab.workload.messages import DEFAULT_OUTPUT_TOKENS, load_messages, load_messages_trace
from kvlab.workload.registry import detect_format
from kvlab.workload.tokenizer import load_tokenizer

SYSTEM = "You are the support assistant of a small invoicing service. Answer briefly."
RECORDS = [
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "Current time: 09:00:00\n",
                                                  "segment": "volatile"},
                                                 {"type": "text", "text": SYSTEM}]},
                  {"role": "user", "content": "How do I add a logo?"}],
     "session": "alice", "output_tokens": 40, "id": "q1"},
    {"messages": [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "How do I add a logo?"},
                  {"role": "assistant", "content": "Open Settings > Branding."},
                  {"role": "user", "content": [{"type": "text", "text": "Here is my file: "},
                                               {"type": "text", "text": "logo.png, 2 MB", "segment": "document"}]}],
     "session": "alice"},
    {"messages": [{"role": "user", "content": "Where is my invoice?", "segment": "history"},
                  {"role": "tool", "content": "invoice 12: sent"},
                  {"role": "user", "content": "Thanks."}]},
]


def write(tmp_path, records, name="mine.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_round_trip_of_a_small_messages_file(tmp_path):
    path = write(tmp_path, RECORDS)
    reqs = load_messages(path)
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0]  # no arrival: line order, one a second
    assert [(r.session, r.turn) for r in reqs] == [(0, 1), (0, 2), (1, 1)]
    assert [r.output_tokens for r in reqs] == [40, DEFAULT_OUTPUT_TOKENS, DEFAULT_OUTPUT_TOKENS]
    assert reqs[0].meta == {"line": 1, "id": "q1"} and reqs[2].meta == {"line": 3}
    kinds = [[(m.role, [(p.kind, p.text) for p in m.parts]) for m in r.messages] for r in reqs]
    assert kinds[0] == [("system", [("volatile", "Current time: 09:00:00\n"), ("system", SYSTEM)]),
                        ("user", [("user", "How do I add a logo?")])]
    assert kinds[1] == [("system", [("system", SYSTEM)]), ("user", [("history", "How do I add a logo?")]),
                        ("assistant", [("output", "Open Settings > Branding.")]),
                        ("user", [("user", "Here is my file: "), ("document", "logo.png, 2 MB")])]
    assert kinds[2] == [("user", [("history", "Where is my invoice?")]), ("tool", [("history", "invoice 12: sent")]),
                        ("user", [("user", "Thanks.")])]

    w = load_trace(path, tokenizer="byte")  # format detected from the first line
    assert w.name == "mine" and len(w) == 3 and w.source == str(path) and len(w.checksum) == 64
    assert w.output_length.tolist() == [40, DEFAULT_OUTPUT_TOKENS, DEFAULT_OUTPUT_TOKENS]
    assert w.session.tolist() == [0, 0, 1] and w.turn.tolist() == [1, 2, 1] and w.parent.tolist() == [-1, 0, -1]
    tok = load_tokenizer("byte")
    for i, r in enumerate(reqs):  # every part of the file is a segment of the rendered prompt, in order, tagged
        segs = w.segments.of(i)
        assert [(s.kind, s.text) for s in segs] == [(p.kind, p.text) for m in r.messages for p in m.parts]
        text = tok.decode(w.prompt(i).tolist())
        for s in segs:
            assert s.text in tok.decode(w.prompt(i)[s.start:s.end].tolist())
        assert text.endswith(tok.decode(w.prompt(i)[segs[-1].start:].tolist()))
    assert w.identity()["tokenizer"]["tokenizer"] == "byte"
    again = load_messages_trace(path, tokenizer=tok)  # a TextTokenizer works as well as a spec
    assert again.content_sha256 == w.content_sha256


def test_arrival_session_and_order(tmp_path):
    recs = [{"messages": [{"role": "user", "content": q}], "arrival": a, "session": s}
            for q, a, s in (("b", 5, 1), ("a", 2.5, "1"), ("c", 5, 1))]
    reqs = load_messages(write(tmp_path, recs), output_tokens=7)
    assert [r.messages[0].content for r in reqs] == ["a", "b", "c"]  # arrival order, ties in line order
    assert [(r.session, r.turn) for r in reqs] == [(0, 1), (1, 1), (1, 2)]  # "1" and 1 are two sessions
    assert {r.output_tokens for r in reqs} == {7}


def test_format_is_detected_from_the_messages_key(tmp_path):
    assert detect_format(write(tmp_path, RECORDS)) == "messages"
    timed = [{**RECORDS[0], "arrival": 0.5}]  # an 'arrival' key does not make it kvlab native JSONL
    assert detect_format(write(tmp_path, timed, "timed.jsonl")) == "messages"
    assert load_trace(tmp_path / "timed.jsonl", format="messages", tokenizer="byte").arrival.tolist() == [0.5]


def _user(text="hi"):
    return {"role": "user", "content": text}


BAD = [
    ({"messages": [_user()], "arival": 1}, 2, "arival", "unknown key"),
    ({"prompt": "hi"}, 2, "prompt", "unknown key"),
    ({"session": 1}, 2, "messages", "missing required field"),
    ({"messages": []}, 2, "messages", "expected a non-empty list of messages"),
    ({"messages": "hi"}, 2, "messages", "expected a non-empty list of messages"),
    ({"messages": [_user(), "hi"]}, 2, "messages[1]", "expected an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 2, "messages[0].role", "is not a role"),
    ({"messages": [{"role": "user"}]}, 2, "messages[0].content", "missing required field"),
    ({"messages": [{"role": "user", "content": 3}]}, 2, "messages[0].content", "expected a string or a list"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 2, "messages[0].name", "unknown key"),
    ({"messages": [{"role": "user", "content": "x", "segment": "footer"}]}, 2, "messages[0].segment",
     "not a segment kind"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 2,
     "messages[0].content[0].image_url", "unknown key"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}, 2,
     "messages[0].content[0].type", "only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 2, "messages[0].content[0].text",
     "missing required field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 2, "messages[0].content[0].text",
     "expected a string"),
    ({"messages": [_user(), {"role": "user", "content": [{"type": "text", "text": "x", "segment": 1}]}]}, 2,
     "messages[1].content[0].segment", "not a segment kind"),
    ({"messages": [_user("\ud800")]}, 2, "messages[0].content", "lone surrogate"),
    ({"messages": [_user()], "arrival": -1}, 2, "arrival", "number of seconds"),
    ({"messages": [_user()], "arrival": "soon"}, 2, "arrival", "number of seconds"),
    ('{"messages": [{"role": "user", "content": "x"}], "arrival": NaN}', 2, "arrival", "number of seconds"),
    ({"messages": [_user()], "session": [1]}, 2, "session", "an integer or a string"),
    ({"messages": [_user()], "session": True}, 2, "session", "an integer or a string"),
    ({"messages": [_user()], "output_tokens": 2.5}, 2, "output_tokens", "expected an integer"),
    ({"messages": [_user()], "output_tokens": 2**40}, 2, "output_tokens", "expected an integer"),
    ({"messages": [_user()], "id": [1]}, 2, "id", "an integer or a string"),
    ('{"messages": [', 2, None, "invalid JSON"),
    ("[1, 2]", 2, None, "expected a JSON object"),
]


@pytest.mark.parametrize(("record", "line", "field", "message"), BAD,
                         ids=[f"{f}-{m}" for _, _, f, m in BAD])
def test_each_bad_record_is_one_line_naming_file_line_and_field(tmp_path, record, line, field, message):
    path = write(tmp_path, [{"messages": [_user()]}, record, {"messages": [_user("never read")]}])
    with pytest.raises(ConfigError) as info:
        load_messages(path)
    text = str(info.value)
    assert isinstance(info.value, TraceFormatError) and "\n" not in text
    where = f"{path}:{line}" + (f": field '{field}'" if field else "")
    assert text.startswith(where + ": "), text
    assert message in text
    assert info.value.line == line and info.value.field == field


def test_arrival_on_some_lines_only_is_refused(tmp_path):
    path = write(tmp_path, [{"messages": [_user()], "arrival": 0}, {"messages": [_user()], "arrival": 1},
                            {"messages": [_user()]}])
    with pytest.raises(ConfigError, match=r"mine.jsonl:3: field 'arrival': missing, but line 1 gives one"):
        load_messages(path)
    path = write(tmp_path, [{"messages": [_user()]}, {"messages": [_user()], "arrival": 1}])
    with pytest.raises(ConfigError, match=r"mine.jsonl:2: field 'arrival': given, but line 1 has none"):
        load_messages(path)


def test_limits_empty_files_and_bad_paths(tmp_path, monkeypatch):
    path = write(tmp_path, [{"messages": [_user()]}] * 3)
    with pytest.raises(ConfigError, match=r"mine.jsonl:3: more than 2 requests"):
        load_messages(path, max_requests=2)
    monkeypatch.setattr(messages_mod, "MAX_MESSAGES_BYTES", 10)
    with pytest.raises(ConfigError, match=r"mine.jsonl: \d+ bytes, more than the 10 a messages file may hold"):
        load_messages(path)
    monkeypatch.undo()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"empty.jsonl: no requests"):
        load_messages(empty)
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_messages(tmp_path)
    with pytest.raises(TraceFormatError, match="no such file"):
        load_messages(tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="output_tokens must be an integer"):
        load_messages(path, output_tokens=-1)


def test_a_bad_record_is_refused_before_the_tokenizer_loads(tmp_path, monkeypatch):
    path = write(tmp_path, [{"messages": [_user()]}, {"messages": [_user()], "arrival": 3}])

    def no_tokenizer(*a, **k):
        raise AssertionError("loaded the tokenizer before checking the file")

    monkeypatch.setattr(messages_mod, "load_tokenizer", no_tokenizer)
    with pytest.raises(ConfigError, match=r"mine.jsonl:2: field 'arrival'"):
        load_trace(path, tokenizer="kvlab-bpe")
    with pytest.raises(ConfigError, match="tokenizer must be a tokenizer spec"):
        load_messages_trace(write(tmp_path, [{"messages": [_user()]}], "ok.jsonl"), tokenizer=3)
