"""Family 4, agents and tool use: a JSON tool catalogue, a growing tool-call / tool-result history, reasoning.

A session is ``tasks`` user tasks (real MuSiQue questions); a task is ``steps`` tool calls and a final
answer, one request (model call) each. Every prompt is: the system prompt (``system`` parts) with the tool
catalogue in Qwen3's layout (``# Tools`` ... ``<tools>``, then one ``tools`` part per tool definition, one
JSON object a line, then ``</tools>``), the task, and the history so far: assistant messages (kind
``output``: a ``<tool_call>`` JSON, or an answer) and tool results (role ``tool``, kind ``history``:
``<tool_response>`` with a real passage). Each call's response is reasoning (an ``output`` part marked by
:func:`~kvlab.workload.families.base.reasoning_part`: ``<think>...</think>``) followed by the call or answer.

Reasoning in the history (``reasoning``):

* ``"strip"`` (default): every earlier reasoning block is removed before the next request, as clients that
  keep only ``content`` do (and as the Alibaba traces record: ``<think>`` of the previous output is
  stripped). The model's KV after a call covers prompt + reasoning + call, but the next prompt has the call
  right after the prompt: the prefix breaks at the answer, whose tokens shift position.
* ``"qwen3"``: Qwen3's chat template: reasoning is kept for assistant messages after the last user message
  (the current task's tool loop) and stripped before it.
* ``"keep"``: every reasoning block stays (the history is exactly what the model produced).

Reasoning, answers and tool arguments are spans of real corpus text (``answer_source="corpus"``) with
lengths drawn from ``reasoning_tokens``, ``output`` and ``tool_result_tokens``; arrivals: sessions by
``arrival``, a tool result after the call's decode time plus ``tool_time_s`` (exponential mean), the next
task after a think time.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field

from kvlab.workload.families.base import (
    ArrivalProcess,
    FamilyConfig,
    GeneratedRequest,
    LengthDist,
    Message,
    corpus,
    corpus_pool,
    is_reasoning,
    reasoning_part,
    rng_of,
)
from kvlab.workload.render import Part


def _tool(name: str, description: str, **params: tuple[str, str]) -> dict:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(params)[:1]}}}


TOOL_CATALOGUE: tuple[dict, ...] = (
    _tool("search", "Search the document index and return the most relevant passages.",
          query=("string", "What to search for."), top_k=("integer", "How many passages to return.")),
    _tool("open_page", "Open a page by its title and return its text.", title=("string", "Exact page title.")),
    _tool("lookup", "Find a phrase inside the currently open page.", phrase=("string", "The phrase to find.")),
    _tool("calculator", "Evaluate an arithmetic expression.", expression=("string", "For example 3 * (4 + 5).")),
    _tool("get_current_time", "Current date and time in a time zone.", timezone=("string", "IANA time zone name.")),
    _tool("get_weather", "Weather forecast for a place.", location=("string", "City and country."),
          days=("integer", "Days ahead, 0 to 7.")),
    _tool("run_python", "Run Python code in a sandbox and return stdout.", code=("string", "The program.")),
    _tool("read_file", "Read a text file from the workspace.", path=("string", "Path relative to the workspace.")),
    _tool("write_file", "Write a text file in the workspace.", path=("string", "Path."),
          content=("string", "The new content.")),
    _tool("send_email", "Send an email.", to=("string", "Recipient address."), subject=("string", "Subject line."),
          body=("string", "Message text.")),
    _tool("translate", "Translate text to another language.", text=("string", "Text to translate."),
          target=("string", "Target language code.")),
    _tool("sql_query", "Run a read-only SQL query on the analytics database.", query=("string", "SQL statement.")),
)
"""Tool definitions (OpenAI function format); the catalogue is the first ``n_tools`` of them."""

AGENT_SYSTEM = "You are a research assistant. Use the tools to find facts before you answer."
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags.")


def tool_parts(tools: list[dict]) -> tuple[Part, ...]:
    """The system message with the catalogue: one ``tools`` part per definition (keys in catalogue order)."""
    return (Part("system", AGENT_SYSTEM + TOOLS_HEADER),
            *(Part("tools", json.dumps(t, ensure_ascii=False) + "\n") for t in tools),
            Part("system", TOOLS_FOOTER))


class AgentConfig(FamilyConfig):
    """Tool-using agent sessions (module docstring); lengths in tokens, times in seconds."""

    family: Literal["agent"] = "agent"
    n_sessions: Annotated[int, Field(ge=0)] = 50
    n_tools: Annotated[int, Field(ge=1, le=len(TOOL_CATALOGUE))] = len(TOOL_CATALOGUE)
    tasks: LengthDist = LengthDist(kind="uniform", min=1, max=3)
    steps: LengthDist = LengthDist(kind="uniform", min=1, max=4)
    reasoning: Literal["strip", "qwen3", "keep"] = "strip"
    reasoning_tokens: LengthDist = LengthDist(kind="uniform", min=32, max=256)
    tool_result_tokens: LengthDist = LengthDist(kind="uniform", min=64, max=400)
    output: LengthDist = LengthDist(kind="fitted", fit="mooncake_conversation", min=1)
    arrival: ArrivalProcess = ArrivalProcess(process="poisson", rate=0.2)
    tool_time_s: Annotated[float, Field(ge=0)] = 1.0
    think_time_s: Annotated[float, Field(ge=0)] = 20.0
    decode_s_per_token: Annotated[float, Field(ge=0)] = 0.02


def _history_message(response: tuple[Part, ...], keep_reasoning: bool) -> Message:
    parts = tuple(p for p in response if keep_reasoning or not is_reasoning(p))
    return Message("assistant", parts)


def generate_agent(config: AgentConfig) -> list[GeneratedRequest]:
    """The requests of ``config`` in arrival order (module docstring)."""
    rng = rng_of(config)
    pool = corpus_pool(config.tokenizer, config.text_dir)
    tasks_src = [r.user_turns[0] for r in corpus(config.text_dir)["musique"]]
    tools = list(TOOL_CATALOGUE[: config.n_tools])
    names = [t["function"]["name"] for t in tools]
    head = Message("system", tool_parts(tools))
    starts = config.arrival.times(rng, config.n_sessions)
    rows: list[dict] = []
    for s in range(config.n_sessions):
        t = float(starts[s])
        # (message, reasoning-bearing response or None, task index): the history as the model produced it
        history: list[tuple[Message, tuple[Part, ...] | None, int]] = []
        n_req = 0
        for task in range(max(1, int(config.tasks.sample(rng, 1)[0]))):
            question = tasks_src[int(rng.integers(0, len(tasks_src)))]
            history.append((Message("user", (Part("user", question),)), None, task))
            n_steps = int(config.steps.sample(rng, 1)[0])
            for step in range(n_steps + 1):
                msgs = [head]
                for m, resp, k in history:
                    if resp is None and m.role == "user" and k != task:  # an earlier task: history now
                        msgs.append(Message("user", tuple(Part("history", p.text) for p in m.parts)))
                    elif resp is None:
                        msgs.append(m)
                    else:
                        keep = config.reasoning == "keep" or (config.reasoning == "qwen3" and k == task)
                        msgs.append(_history_message(resp, keep))
                thought = reasoning_part(pool.cut(rng, int(config.reasoning_tokens.sample(rng, 1)[0])))
                if step < n_steps:
                    name = names[int(rng.integers(0, len(names)))]
                    arg = question if name == "search" else pool.cut(rng, int(rng.integers(4, 24)))
                    first = next(iter(tools[names.index(name)]["function"]["parameters"]["properties"]))
                    call = json.dumps({"name": name, "arguments": {first: arg}}, ensure_ascii=False)
                    act = Part("output", f"<tool_call>\n{call}\n</tool_call>")
                else:
                    act = Part("output", pool.cut(rng, int(config.output.sample(rng, 1)[0])))
                response = (thought, act)
                n_out = pool.count(thought.text) + pool.count(act.text)
                n_req += 1
                rows.append({"messages": tuple(msgs), "arrival": t, "output_tokens": n_out, "session": s,
                             "turn": n_req, "response": response, "meta": {"task": task, "step": step}})
                history.append((Message("assistant", response), response, task))
                t += config.decode_s_per_token * n_out
                if step < n_steps:
                    result = pool.cut(rng, int(config.tool_result_tokens.sample(rng, 1)[0]))
                    history.append((Message("tool", (Part("history", f"<tool_response>\n{result}\n</tool_response>"),)),
                                    None, task))
                    t += float(rng.exponential(config.tool_time_s))
                else:
                    t += float(rng.exponential(config.think_time_s))
    rows.sort(key=lambda r: (r["arrival"], r["session"], r["turn"]))
    return [GeneratedRequest(tenant=0, category="agent", answer_source="corpus", **r) for r in rows]
