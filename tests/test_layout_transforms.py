"""Layout transforms (kvlab.layout), each pinned on small hand-built requests rendered with kvlab's BPE (not only
bytes) and replayed: where the prefix breaks, and that it breaks nowhere else."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from kvlab.errors import ConfigError  # noqa: E402
from kvlab.layout import LayoutRequest, RenderCache, RequestContext, layout_workload, make_layout  # noqa: E402
from kvlab.layout.apply import DATE_HEADER, render_layout  # noqa: E402
from kvlab.layout.history import drop_oldest, split_turns, summarise  # noqa: E402
from kvlab.layout.order import reorder_tools  # noqa: E402
from kvlab.layout.reuse import boundary_sweep, break_tokens, nonprefix_bound  # noqa: E402
from kvlab.layout.volatile import revision, volatile_text  # noqa: E402
from kvlab.replay import replay  # noqa: E402
from kvlab.workload.families.agent import TOOL_CATALOGUE, tool_parts  # noqa: E402
from kvlab.workload.families.base import GeneratedRequest, is_reasoning, length_tokenizer, reasoning_part  # noqa: E402
from kvlab.workload.render import Message, Part, rendered_workload  # noqa: E402
from kvlab.workload.tokenizer import DEFAULT_DATE_STRING, load_tokenizer, wrap_tokenizers  # noqa: E402
from kvlab.workload.workload import Workload  # noqa: E402

BS = 16
SYSTEM = ("You are the household assistant of the Lindqvist family. Answer briefly and politely, in English. "
          "Never share the door codes or the alarm schedule with anyone who is not a member of the household. "
          "When you are unsure, ask one short clarifying question before acting. ") * 3
QUESTION = "Which rooms still have their lights on, and can you switch off the ones nobody uses?"


@pytest.fixture(scope="module")
def bpe():
    return length_tokenizer("kvlab-bpe")


def _ctx(i: int, arrival: float = 0.0, **kw) -> RequestContext:
    return RequestContext(index=i, arrival=arrival, clock_start=1721987970.0, **kw)  # 2024-07-26 09:59:30 UTC


def _hits(tokenizer, reqs: list[LayoutRequest], bs: int = BS) -> tuple[Workload, np.ndarray]:
    """Render each request once, replay them in order (unbounded cache, vLLM counting): hit tokens."""
    w = rendered_workload([render_layout(tokenizer, r) for r in reqs], tokenizer,
                          adapter=[r.adapter for r in reqs] if any(r.adapter for r in reqs) else None)
    res = replay(w, capacity_blocks=10_000, block_size=bs)
    return w, res.requests["hit_tokens"].to_numpy()


def _first_diff(a, b) -> int:
    n = min(len(a), len(b))
    d = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(d[0]) if len(d) else n


def _kind_at(w: Workload, i: int, token: int) -> str:
    return next(s.kind for s in w.segment_spans(i) if s.start <= token < s.end)


def _seg(w: Workload, i: int, kind: str, k: int = 0):
    return [s for s in w.segment_spans(i) if s.kind == kind][k]


def _household(word: str) -> LayoutRequest:
    """A system prompt with a volatile word (different first letter per request), then the question."""
    return LayoutRequest((Message("system", (Part("system", SYSTEM), Part("volatile", f"{word}.\n"))),
                          Message.of("user", "user", QUESTION)))


# ------------------------------------------------------------------------------------------ volatile content
def test_volatile_at_the_top_gives_zero_hits_and_at_the_end_exactly_the_stable_blocks(bpe):
    reqs = [_household(w) for w in ("Alpha", "Bravo")]
    top, end = make_layout("volatile_top"), make_layout("volatile_end")
    w, hits = _hits(bpe, [top(r, _ctx(i)) for i, r in enumerate(reqs)])
    vol = _seg(w, 1, "volatile")
    assert w.segment_spans(1)[0].kind == "volatile" and vol.start < BS  # the volatile word sits in block 0
    assert hits[1] == 0
    assert w.segments.first_miss(hits)[1] == "volatile"
    w, hits = _hits(bpe, [end(r, _ctx(i)) for i, r in enumerate(reqs)])
    vol = _seg(w, 1, "volatile")
    assert w.segment_spans(1)[-1].kind == "volatile" and vol.start > 100
    assert _first_diff(w.prompt(0), w.prompt(1)) == vol.start  # everything before it is unchanged (BPE)
    assert hits[1] == vol.start // BS * BS  # exactly the stable blocks
    assert w.segments.first_miss(hits)[1] == _kind_at(w, 1, hits[1])  # the block holding the change
    w, hits = _hits(bpe, [make_layout("volatile_after_system")(r, _ctx(i)) for i, r in enumerate(reqs)])
    assert hits[1] == _seg(w, 1, "volatile").start // BS * BS and _seg(w, 1, "user").start >= _seg(w, 1, "volatile").end
    none = make_layout("volatile_none")(reqs[0], _ctx(0))
    assert all(p.kind != "volatile" for m in none.messages for p in m.parts)


def test_generated_volatile_texts_are_deterministic_and_placed():
    ctx = _ctx(7, arrival=12.25, session=3)
    assert volatile_text(ctx) == "Current time: 2024-07-26 09:59:42 UTC\n"
    assert volatile_text(ctx, "user_id") == "User id: user-00003\n"
    rid = volatile_text(ctx, "request_id")
    assert rid == volatile_text(_ctx(7), "request_id") != volatile_text(_ctx(8), "request_id")
    plain = LayoutRequest((Message.of("system", "system", "Be brief."), Message.of("user", "user", "Hi")))
    top = make_layout({"name": "volatile_top", "what": "request_id"})(plain, ctx)
    assert top.messages[0].parts[0] == Part("volatile", rid)
    end = make_layout("volatile_end")(plain, ctx)
    assert end.messages[-1].parts[-1] == Part("volatile", "Current time: 2024-07-26 09:59:42 UTC\n")


def test_system_edited_every_n_minutes(bpe):
    base = LayoutRequest((Message.of("system", "system", SYSTEM), Message.of("user", "user", QUESTION)))
    edit = make_layout({"name": "system_edited", "period_minutes": 1.0})
    a, b, c = (edit(base, _ctx(i, arrival=t)) for i, t in enumerate((31.0, 85.0, 95.0)))  # 10:00:01, :55, 10:01:05
    assert revision(_ctx(0, 31.0), 1.0) == revision(_ctx(1, 85.0), 1.0) != revision(_ctx(2, 95.0), 1.0)
    assert a.messages == b.messages != c.messages
    assert a.messages[0].parts[0].text.startswith("Policy revision") and a.messages[0].parts[0].kind == "system"
    w, hits = _hits(bpe, [a, b, c])
    assert hits[1] == (len(w.prompt(1)) - 1) // BS * BS  # same period: everything but the last block
    assert hits[2] < BS and w.segments.first_miss(hits)[2] == "system"
    end = make_layout({"name": "system_edited", "where": "end"})(base, _ctx(0))
    assert end.messages[0].parts[-1].text.startswith("Policy revision")
    with pytest.raises(ConfigError, match="period_minutes"):
        make_layout({"name": "system_edited", "period_minutes": 0})(base, _ctx(0))


# ------------------------------------------------------------------------------------------ tools
def _agent_request(tools: list[dict]) -> LayoutRequest:
    return LayoutRequest((Message("system", tool_parts(tools)), Message.of("user", "user", QUESTION)))


def test_shuffled_tools_hit_only_up_to_the_first_moved_tool(bpe):
    tools = list(TOOL_CATALOGUE[:8])
    canon = make_layout("tools_canonical")(_agent_request(tools[::-1]), _ctx(0))
    names = [json.loads(p.text)["function"]["name"] for p in canon.messages[0].parts if p.kind == "tools"]
    assert names == sorted(names)
    shuffled = make_layout("tools_shuffled")
    for i in range(1, 6):
        other = shuffled(_agent_request(tools), _ctx(i))
        w, hits = _hits(bpe, [canon, other])
        order = [json.loads(p.text)["function"]["name"] for p in other.messages[0].parts if p.kind == "tools"]
        moved = next((k for k, (x, y) in enumerate(zip(names, order, strict=True)) if x != y), None)
        if moved is None:
            assert hits[1] == (len(w.prompt(1)) - 1) // BS * BS
            continue
        seg = _seg(w, 1, "tools", moved)
        diff = _first_diff(w.prompt(0), w.prompt(1))
        assert seg.start <= diff < seg.end  # the prompts agree up to the first moved tool's own text
        assert hits[1] == diff // BS * BS and hits[1] >= seg.start // BS * BS
        assert w.segments.first_miss(hits)[1] == "tools"
    again = shuffled(_agent_request(tools), _ctx(3))
    assert again == shuffled(_agent_request(tools), _ctx(3))  # a request's draw is fixed by (seed, index)


def test_tool_json_key_order(bpe):
    tools = list(TOOL_CATALOGUE[:4])
    sorted_ = make_layout("tools_keys_sorted")
    unstable = make_layout("tools_keys_unstable")
    a, b = (sorted_(_agent_request(tools), _ctx(i)) for i in range(2))
    assert a == b
    first = json.loads(a.messages[0].parts[1].text)
    assert list(first) == sorted(first) and list(first["function"]) == sorted(first["function"])
    c, d = (unstable(_agent_request(tools), _ctx(i)) for i in range(2))
    tool_texts = [[p.text for p in r.messages[0].parts if p.kind == "tools"] for r in (c, d)]
    assert tool_texts[0] != tool_texts[1]
    assert [json.loads(t) for t in tool_texts[0]] == [json.loads(t) for t in tool_texts[1]] == list(tools)
    w, hits = _hits(bpe, [c, d])
    diff = _first_diff(w.prompt(0), w.prompt(1))
    assert _kind_at(w, 1, diff) == "tools" and hits[1] == diff // BS * BS
    # one tools part holding the whole catalogue as a JSON array, inside other text
    text = "Tools:\n" + json.dumps(tools, indent=2) + "\nUse them well."
    one = LayoutRequest((Message("system", (Part("tools", text),)), Message.of("user", "user", "Hi")))
    out = make_layout("tools_canonical")(one, _ctx(0)).messages[0].parts[0].text
    assert out.startswith("Tools:\n[") and out.endswith("]\nUse them well.")
    assert [t["function"]["name"] for t in json.loads(out[7:-15])] == sorted(t["function"]["name"] for t in tools)
    assert reorder_tools(one.messages, list) == one.messages  # the same order writes the same text


# ------------------------------------------------------------------------------------------ documents
def _rag(docs: list[str]) -> LayoutRequest:
    return LayoutRequest((Message.of("system", "system", "Answer from the passages.\n"),
                          Message("user", (*(Part("document", d) for d in docs), Part("user", QUESTION)))))


def test_canonical_document_order_shares_what_retrieval_order_does_not(bpe):
    docs = [f"Title: {t}\n{SYSTEM[:300]} ({t})\n\n" for t in ("Uppsala", "Kiruna", "Malmo", "Lund")]
    a, b = _rag(docs), _rag([docs[2], docs[0], docs[3], docs[1]])  # the same set, another retrieval order
    w, hits = _hits(bpe, [make_layout("documents_retrieval")(r, _ctx(i)) for i, r in enumerate((a, b))])
    assert hits[1] < _seg(w, 1, "document").end and w.segments.first_miss(hits)[1] == "document"
    w, hits = _hits(bpe, [make_layout("documents_canonical")(r, _ctx(i)) for i, r in enumerate((a, b))])
    assert w.prompt(0).tolist() == w.prompt(1).tolist() and hits[1] == (len(w.prompt(1)) - 1) // BS * BS
    rr = make_layout("documents_reranked")
    x, y = rr(a, _ctx(5)), rr(a, _ctx(5))
    assert x == y and sorted(p.text for p in x.messages[1].parts if p.kind == "document") == sorted(docs)
    assert x.messages[1].parts[-1] == Part("user", QUESTION)


# ------------------------------------------------------------------------------------------ history
def _conversation(turns: int) -> tuple[Message, ...]:
    """A chat at its ``turns``-th user turn: system, earlier questions and answers, this question."""
    msgs = [Message.of("system", "system", SYSTEM)]
    for k in range(1, turns):
        msgs += [Message.of("user", "history", f"Question number {k}: what about room {k}?"),
                 Message.of("assistant", "output", f"Room {k} is fine. " * 5)]
    return (*msgs, Message.of("user", "user", f"Question number {turns}: what about room {turns}?"))


def test_history_drop_oldest_and_summarise():
    conv = _conversation(6)  # 5 history turns + the current one
    head, turns = split_turns(conv)
    assert len(head) == 1 and len(turns) == 6 and "room 6" in turns[-1][0].content
    dropped = drop_oldest(conv, keep_turns=2)
    assert dropped[0].role == "user" and "number 4" in dropped[0].content and len(dropped) == 5
    assert drop_oldest(conv, keep_turns=2, keep_system=True)[0].role == "system"
    assert drop_oldest(conv, keep_turns=5) == conv
    s = summarise(conv, keep_turns=2, chunk=2)  # 5 history turns: 2 compacted, 3 kept
    assert s[0].role == "system" and s[0].parts[-1].kind == "history"
    assert "Summary of the first 2 turns" in s[0].parts[-1].text and "number 3" in s[1].content
    assert "number 1" in s[0].parts[-1].text and "number 3" not in s[0].parts[-1].text
    assert summarise(_conversation(4), keep_turns=2, chunk=2) == _conversation(4)  # 3 history turns: < 2 + 2


def test_summarised_history_only_grows_between_compactions(bpe):
    """Turn k+1's prompt extends turn k's while no compaction happens; a sliding window breaks every turn."""
    summ = make_layout({"name": "history_summarise", "keep_turns": 2, "chunk": 3})
    a, b, c = (summ(LayoutRequest(_conversation(t)), _ctx(t)) for t in (6, 7, 9))  # 5, 6, 8 history turns
    ta, tb, tc = (render_layout(bpe, r).text for r in (a, b, c))
    assert "first 3 turns" in ta and "first 3 turns" in tb and tb.startswith(ta)  # 3 compacted in both: append-only
    assert "first 6 turns" in tc and not tc.startswith(ta[: ta.index("- Turn 3")])  # 8 - 2 = 6 compacted
    w, hits = _hits(bpe, [a, b])
    assert hits[1] == len(w.prompt(0)) // BS * BS
    slide = make_layout("history_drop_oldest")
    x, y = (slide(LayoutRequest(_conversation(t)), _ctx(t)) for t in (6, 7))
    w, hits = _hits(bpe, [x, y])
    assert hits[1] < BS  # the window moved: the prompt changes at its first message


# ------------------------------------------------------------------------------------------ reasoning
def _agent_history() -> tuple[Message, ...]:
    think = reasoning_part("I should search first. " * 6)
    return (Message("system", tool_parts(list(TOOL_CATALOGUE[:3]))),
            Message.of("user", "history", "Who built the Uppsala cathedral?"),
            Message("assistant", (think, Part("output", "It was built over centuries."))),
            Message.of("user", "user", "And when was it finished?"),
            Message("assistant", (reasoning_part("Now look it up. " * 4),
                                  Part("output", '<tool_call>\n{"name": "search"}\n</tool_call>'))),
            Message.of("tool", "history", "<tool_response>\n1435\n</tool_response>"))


def test_reasoning_stripped_vs_kept():
    msgs = LayoutRequest(_agent_history())
    kept = make_layout("reasoning_kept")(msgs, _ctx(0))
    all_ = make_layout("reasoning_stripped")(msgs, _ctx(0))
    qwen = make_layout("reasoning_stripped_before_last_user")(msgs, _ctx(0))

    def count(r: LayoutRequest) -> list[int]:
        return [sum(is_reasoning(p) for p in m.parts) for m in r.messages]

    assert count(kept) == [0, 0, 1, 0, 1, 0]
    assert count(all_) == [0] * 6
    assert count(qwen) == [0, 0, 0, 0, 1, 0]  # kept in the current agent loop only
    assert qwen.messages[2].parts == (Part("output", "It was built over centuries."),)


# ------------------------------------------------------------------------------------------ adapters, date
def test_adapter_switch_sets_the_adapter_column_and_splits_the_cache(bpe):
    req = _household("Alpha")
    per_req = make_layout({"name": "adapter_switch", "adapters": 3})
    ads = [per_req(req, _ctx(i)).adapter for i in range(30)]
    assert set(ads) == {"lora-0", "lora-1", "lora-2"} and ads == [per_req(req, _ctx(i)).adapter for i in range(30)]
    per_session = make_layout({"name": "adapter_switch", "per": "session"})
    assert len({per_session(req, _ctx(i, session=4)).adapter for i in range(10)}) == 1
    same = [LayoutRequest(req.messages, adapter="lora-1")] * 2
    other = [LayoutRequest(req.messages, adapter="lora-1"), LayoutRequest(req.messages, adapter="lora-2")]
    w, hits = _hits(bpe, same)
    assert hits[1] == (len(w.prompt(1)) - 1) // BS * BS
    w, hits = _hits(bpe, other)
    assert list(w.adapter) == ["lora-1", "lora-2"] and hits[1] == 0


def test_date_injection_on_and_off(bpe):
    req = LayoutRequest((Message.of("system", "system", SYSTEM), Message.of("user", "user", QUESTION)))
    on = make_layout("date_injected")
    a, b = on(req, _ctx(0)), on(req, _ctx(1, arrival=86_400.0))  # the next day
    assert (a.date_string, b.date_string) == ("26 Jul 2024", "27 Jul 2024")
    assert not bpe.injects_date  # kvlab's ChatML: the Llama-3.1 header is written as a volatile part
    ra = render_layout(bpe, a)
    assert DATE_HEADER.format(date="26 Jul 2024") in ra.text and ra.segments[0].kind == "volatile"
    w, hits = _hits(bpe, [a, b])
    diff = _first_diff(w.prompt(0), w.prompt(1))  # the day's digits, in the header at the top
    assert _kind_at(w, 1, diff) == "volatile" and diff < 2 * BS and hits[1] == diff // BS * BS
    off = make_layout("date_fixed")
    w, hits = _hits(bpe, [off(req, _ctx(0)), off(req, _ctx(1, arrival=86_400.0))])
    assert DEFAULT_DATE_STRING in render_layout(bpe, off(req, _ctx(0))).text
    assert hits[1] == (len(w.prompt(1)) - 1) // BS * BS
    # a template that injects the date itself gets it as date_string (no header part)
    template = ("{{ 'Today Date: ' + date_string + '\\n' }}{% for m in messages %}{{ m['role'] }}: "
                "{{ m['content'] }}\\n{% endfor %}")
    inj = wrap_tokenizers(bpe.hf.backend_tokenizer, "date-template", chat_template=template)
    assert inj.injects_date
    rb = render_layout(inj, b)
    assert rb.text.startswith("Today Date: 27 Jul 2024\n") and "Cutting Knowledge" not in rb.text


# ------------------------------------------------------------------------------------------ rendering, specs
def _generated(messages: tuple[Message, ...], i: int) -> GeneratedRequest:
    return GeneratedRequest(messages=messages, arrival=float(i), output_tokens=8, session=i, turn=1, tenant=i % 2,
                            category="test", answer_source="none")


def test_layout_workload_renders_once_with_segments_and_identity(bpe):
    reqs = [_generated(_household(w).messages, i) for i, w in enumerate(("Alpha", "Bravo", "Alpha"))]
    cache = RenderCache(bpe)
    w = layout_workload(reqs, make_layout("volatile_end+adapter_switch"), bpe, cache=cache, name="t")
    assert cache.renders == 2 and cache.reused == 1  # requests 0 and 2 lay out the same
    layout_workload(reqs, make_layout("adapter_switch"), bpe, cache=cache)  # same messages: no render
    layout_workload(reqs, make_layout("volatile_top"), bpe, cache=cache)
    assert cache.renders == 6 and cache.reused == 3
    assert w.meta["layout"] == {"label": "volatile_end+adapter_switch",
                                "steps": [{"transform": "volatile_end", "what": "timestamp"},
                                          {"transform": "adapter_switch", "adapters": 4, "per": "request"}]}
    ident = w.identity()["tokenizer"]
    assert ident["tokenizer_sha256"] == bpe.sha256 and ident["template_sha256"] == bpe.template_sha256
    assert w.adapter is not None and list(w.tenant) == ["tenant0", "tenant1", "tenant0"]
    seg = w.segment_spans(0)
    assert [s.kind for s in seg] == ["system", "user", "volatile"] and seg[0].text == SYSTEM
    ids, _ = bpe.encode_offsets(SYSTEM, add_special_tokens=False)
    assert w.prompt(0)[seg[0].start:seg[0].end].tolist()[-len(ids) + 2:] == ids[2:]  # spans from offsets


def test_layout_specs_and_errors():
    assert make_layout("as_generated").label == "as_generated"
    lay = make_layout([{"name": "volatile_top", "what": "user_id"}, "tools_shuffled"])
    assert lay.label == "volatile_top(what=user_id)+tools_shuffled"
    assert make_layout({"label": "mine", "steps": ["volatile_end", "date_fixed"]}).label == "mine"
    with pytest.raises(ConfigError, match=r"^layouts\[2\]: unknown layout transform 'nope'"):
        make_layout("nope", "layouts[2]")
    with pytest.raises(ConfigError, match="unknown parameter 'colour'"):
        make_layout({"name": "volatile_top", "colour": 1})
    with pytest.raises(ConfigError, match="volatile 'what'"):
        make_layout({"name": "volatile_top", "what": "weather"})(_household("Alpha"), _ctx(0))


# ------------------------------------------------------------------------------------------ reuse bound, seed 004
def test_nonprefix_bound_counts_blocks_cached_under_another_prefix():
    bs = 4
    a, b, c, x = ([v] * bs for v in (1, 2, 3, 9))
    prompts = [a + b + c, x + b + c + [7, 7], x + b + a]  # request 1: b, c seen after another first block
    counts = np.array([len(p) for p in prompts])
    w = Workload(arrival=np.arange(3.0), input_length=counts, output_length=np.ones(3, np.int64),
                 prompt_offsets=np.concatenate([[0], np.cumsum(counts)]),
                 prompt_values=np.array(sum(prompts, []), dtype=np.int64), kind="tokens")
    hits = replay(w, capacity_blocks=100, block_size=bs).requests["hit_blocks"].to_numpy()
    assert hits.tolist() == [0, 0, 2]
    assert nonprefix_bound(w, hits, bs).tolist() == [0, 2 * bs, bs]  # r2: x b hit; a is elsewhere (r0)


def test_break_tokens_is_where_a_prompt_departs_from_every_earlier_sequence():
    prompts = [[1, 2, 3, 4], [1, 2, 9, 9, 9], [1, 2, 3, 4, 5, 6], [7], [1, 2, 3, 4, 8, 8]]
    outputs = [[5, 6], [1], [], [1], [2]]  # request 0's output makes request 2's 5, 6 known
    counts, outs = np.array([len(p) for p in prompts]), np.array([len(o) for o in outputs])
    w = Workload(arrival=np.arange(5.0), input_length=counts, output_length=outs,
                 prompt_offsets=np.concatenate([[0], np.cumsum(counts)]),
                 prompt_values=np.array(sum(prompts, []), dtype=np.int64), kind="tokens",
                 output_offsets=np.concatenate([[0], np.cumsum(outs)]),
                 output_values=np.array(sum(outputs, []), dtype=np.int64))
    assert break_tokens(w).tolist() == [0, 2, 6, 0, 4]


def test_block_boundary_staircase_is_exact(bpe):
    text = SYSTEM * 2
    frame = boundary_sweep(bpe, text, range(0, 120, 9), [1, 16, 32], requests=3)
    assert (frame["hit_tokens"] == frame["kept_tokens"]).all()
    b16 = frame[frame["block_size"] == 16]
    assert (b16["hit_tokens"] == b16["position"] // 16 * 16).all()
    assert (frame[frame["block_size"] == 1]["hit_tokens"] == frame[frame["block_size"] == 1]["position"]).all()


def test_byte_tokenizer_gives_the_same_break_points():
    """The transforms are text edits: the same first-miss segment under the byte tokenizer."""
    byte = load_tokenizer("byte")
    reqs = [make_layout("volatile_end")(_household(w), _ctx(i)) for i, w in enumerate(("Alpha", "Bravo"))]
    w, hits = _hits(byte, reqs)
    assert hits[1] == _seg(w, 1, "volatile").start // BS * BS
