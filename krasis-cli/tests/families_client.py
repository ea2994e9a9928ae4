"""One model family's tool calls and reasoning through both official clients (issue #41, "Done when").

Usage: families_client.py BASE_URL SCRIPT_FILE SPEC_JSON. The server runs on a synthetic model of
the family with the family's chat template and KRASIS_TEST_SCRIPT=SCRIPT_FILE (see families_sdk.rs):
each reply is the text this script writes into SCRIPT_FILE before the request, written in the
family's own tool-call and reasoning format. SPEC_JSON says which:
  format       the family's format (tool_calls.rs names: qwen3, deepseek, kimi, glm45, minimax-m2,
               harmony; qwen3-coder: Qwen3-Coder's XML calls, read by the qwen3 parser), or null for a family whose template has no tool calls (plain text only);
  thinking     whether the family writes reasoning (a think block, or harmony's analysis channel);
  opens_think  whether the template's generation prompt already opens the think block;
  parallel     whether a reply may hold several calls (harmony ends a turn at its first call);
  system       whether the template accepts a system message;
  bad_input    whether to check that bad input gets a 400 in each API's error shape.
Through `openai`: reasoning, a sentence and a parallel call, whole and streamed (arguments valid JSON,
reasoning_content, content), the
round trip with the results sent back, streamed plain text and reasoning. Through `anthropic`:
the same calls as tool_use blocks whole and streamed, thinking blocks, the tool_result round trip.
Exits non-zero on any mismatch; prints "<family>: openai <v>, anthropic <v>: N checks passed".
"""

import json
import sys

import anthropic
import openai

base_url, script, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
fmt, thinking, opens_think = spec["format"], spec["thinking"], spec.get("opens_think", False)
oa = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(f"{spec['family']}: {what}")
    checks += 1


def reply(text):
    with open(script, "w") as f:
        f.write(text)


WEATHER = {"city": "São Paulo", "days": 3}
TIME = {"tz": "CET"}
CALLS = [("get_weather", WEATHER), ("get_time", TIME)] if spec["parallel"] else [("get_weather", WEATHER)]
THOUGHT = "I should look it up."
PREAMBLE = "Let me check."


def think(text):
    """`text` as the family writes reasoning at the start of a reply."""
    if fmt == "harmony":
        return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant"
    return ("" if opens_think else "<think>\n") + f"{text}\n</think>\n\n"


def final(text):
    """`text` as the family writes the answer after any reasoning."""
    return f"<|channel|>final<|message|>{text}<|return|>" if fmt == "harmony" else text


def plain(text):
    """A reply of `text` alone (a template that opens the think block needs it closed first)."""
    return ("\n</think>\n\n" if opens_think else "") + final(text)


def preamble(text):
    """`text` as the family writes it before its calls."""
    if fmt == "harmony":
        return f"<|channel|>commentary<|message|>{text}<|end|><|start|>assistant"
    return f"{text}\n"


def calls_text(calls):
    """`calls` [(name, arguments)] as the family writes them."""
    if fmt == "qwen3":
        return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if fmt == "qwen3-coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                                 for k, v in a.items()) + "</function>\n</tool_call>"
                         for n, a in calls)
    if fmt == "deepseek":
        body = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
                       for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "kimi":
        body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                       for i, (n, a) in enumerate(calls))
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    if fmt == "glm45":
        return "".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                                     for k, v in a.items()) + "</tool_call>" for n, a in calls)
    if fmt == "minimax-m2":
        return "<minimax:tool_call>\n" + "".join(
            f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in a.items())
            + "</invoke>\n" for n, a in calls) + "</minimax:tool_call>"
    if fmt == "harmony":
        (n, a), = calls
        return f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
    raise ValueError(fmt)


oa_tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]}}},
    # gpt-oss's template needs a description (jinja2 refuses "// " + undefined too).
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
an_tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"]["parameters"]} for t in oa_tools]
ask = [{"role": "user", "content": "Weather in São Paulo, and the time?"}]
if spec.get("system"):
    ask = [{"role": "system", "content": "Be brief."}] + ask
an_ask = [m for m in ask if m["role"] != "system"]
an_system = {"system": "Be brief."} if spec.get("system") else {}
names = [n for n, _ in CALLS]
args = [a for _, a in CALLS]

# Plain text, streamed (every family).
reply(plain("Sunny, and it is noon."))
text = "".join(c.choices[0].delta.content or "" for c in
               oa.chat.completions.create(model="m", messages=ask, max_tokens=400, stream=True) if c.choices)
check(text == "Sunny, and it is noon.", text)
m = an.messages.create(model="m", max_tokens=400, messages=an_ask, **an_system)
check([b.type for b in m.content] == ["text"] and m.content[0].text == "Sunny, and it is noon.", m.content)
check(m.stop_reason == "end_turn", m.stop_reason)

if thinking:
    # Reasoning, then the answer: reasoning_content apart from content; Anthropic thinking blocks.
    reply(think("Paris is usually mild.") + final("Paris is sunny."))
    msg = oa.chat.completions.create(model="m", messages=ask, max_tokens=400).choices[0].message
    check(getattr(msg, "reasoning_content", None) == "Paris is usually mild." and msg.content == "Paris is sunny.", msg)
    reasoning, content = "", ""
    for c in oa.chat.completions.create(model="m", messages=ask, max_tokens=400, stream=True):
        for ch in c.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    check((reasoning, content) == ("Paris is usually mild.", "Paris is sunny."), (reasoning, content))
    with an.messages.stream(model="m", max_tokens=400, messages=an_ask, **an_system) as s:
        deltas = {e.delta.type for e in s if e.type == "content_block_delta"}
        m = s.get_final_message()
    check({"thinking_delta", "text_delta"} <= deltas, deltas)
    got = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]
    check(got == [("thinking", "Paris is usually mild."), ("text", "Paris is sunny.")], got)

if fmt:
    calls_reply = (think(THOUGHT) if thinking else "") + preamble(PREAMBLE) + calls_text(CALLS)
    reply(calls_reply)
    # OpenAI, whole.
    whole = oa.chat.completions.create(model="m", messages=ask, tools=oa_tools, max_tokens=400)
    choice = whole.choices[0]
    check(choice.finish_reason == "tool_calls", choice.finish_reason)
    calls = choice.message.tool_calls or []
    check([c.function.name for c in calls] == names, calls)
    check([json.loads(c.function.arguments) for c in calls] == args, calls)
    check(all(c.type == "function" and c.id for c in calls) and len({c.id for c in calls}) == len(calls), calls)
    check(choice.message.content == PREAMBLE, choice.message)
    if thinking:
        check(getattr(choice.message, "reasoning_content", None) == THOUGHT, choice.message)
    # OpenAI, streamed: the calls put together from their deltas.
    acc, reasoning, content, finish = {}, "", "", None
    for chunk in oa.chat.completions.create(model="m", messages=ask, tools=oa_tools, max_tokens=400, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = acc.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    check(finish == "tool_calls", finish)
    check([acc[i]["name"] for i in sorted(acc)] == names, acc)
    check([json.loads(acc[i]["arguments"]) for i in sorted(acc)] == args, acc)
    check(all(acc[i]["id"] for i in acc), acc)
    check(reasoning == (THOUGHT if thinking else ""), reasoning)
    check(content == PREAMBLE, content)
    # The round trip: the calls and their results in the messages; the reply is text.
    reply(plain("Sunny, and it is noon."))
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, ["sunny", "12:00"])]
    done = oa.chat.completions.create(model="m", messages=follow, tools=oa_tools, max_tokens=400)
    check(done.choices[0].message.content == "Sunny, and it is noon.", done.choices[0].message)
    check(done.choices[0].finish_reason == "stop" and not done.choices[0].message.tool_calls, done.choices[0])
    check(done.usage.prompt_tokens > whole.usage.prompt_tokens, (done.usage, whole.usage))

    # Anthropic, whole and streamed: tool_use blocks (after a thinking block).
    reply(calls_reply)
    m = an.messages.create(model="m", max_tokens=400, messages=an_ask, tools=an_tools, **an_system)
    kinds = (["thinking"] if thinking else []) + ["text"] + ["tool_use"] * len(CALLS)
    check([b.type for b in m.content] == kinds, m.content)
    uses = [b for b in m.content if b.type == "tool_use"]
    check([(u.name, u.input) for u in uses] == CALLS, uses)
    check(m.stop_reason == "tool_use", m.stop_reason)
    if thinking:
        check(m.content[0].thinking == THOUGHT, m.content[0])
    check([b.text for b in m.content if b.type == "text"] == [PREAMBLE], m.content)
    with an.messages.stream(model="m", max_tokens=400, messages=an_ask, tools=an_tools, **an_system) as s:
        deltas = {e.delta.type for e in s if e.type == "content_block_delta"}
        streamed = s.get_final_message()
    check("input_json_delta" in deltas, deltas)
    check([b.type for b in streamed.content] == kinds and streamed.stop_reason == "tool_use", streamed)
    check([(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == CALLS, streamed.content)
    check([b.text for b in streamed.content if b.type == "text"] == [PREAMBLE], streamed.content)
    # The results sent back as tool_result blocks.
    reply(plain("Sunny, and it is noon."))
    turn = an_ask + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": r}
                                     for u, r in zip(uses, ["sunny", "12:00"])]},
    ]
    done = an.messages.create(model="m", max_tokens=400, messages=turn, tools=an_tools, **an_system)
    check([b.type for b in done.content] == ["text"] and done.content[0].text == "Sunny, and it is noon.", done)
    check(done.stop_reason == "end_turn" and done.usage.input_tokens > m.usage.input_tokens, done)

if spec.get("bad_input"):
    # Bad input gets a 400 in each API's error shape: a tool schema that is not JSON Schema, a tool
    # result that answers no call, content blocks of the wrong type for their turn.
    def refused(cls, fn, *words):
        try:
            fn()
        except cls as e:
            check(e.status_code == 400, e)
            body = e.body if isinstance(e.body, dict) else {}
            if cls is anthropic.BadRequestError:
                check(body.get("type") == "error" and body["error"]["type"] == "invalid_request_error", body)
                message = body["error"]["message"]
            else:
                message = body.get("message", "")
            for w in words:
                check(w in message, (w, message))
            return body
        raise AssertionError(f"{spec['family']}: accepted: {words}")

    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "strnig"}}}}}]
    body = refused(openai.BadRequestError,
                   lambda: oa.chat.completions.create(model="m", messages=ask, tools=bad_tools),
                   "tools[0].function.parameters.properties.city.type")
    check(body.get("param") == "tools" and body.get("type") == "invalid_request_error", body)
    refused(openai.BadRequestError, lambda: oa.chat.completions.create(
        model="m", messages=ask + [{"role": "tool", "tool_call_id": "nope", "content": "x"}], tools=oa_tools),
        "tool_call_id")
    refused(anthropic.BadRequestError, lambda: an.messages.create(
        model="m", max_tokens=10, messages=an_ask,
        tools=[{"name": "f", "input_schema": {"type": "object", "required": "city"}}]),
        "tools.0.input_schema.required")
    refused(anthropic.BadRequestError, lambda: an.messages.create(
        model="m", max_tokens=10, messages=an_ask + [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]),
        "tool_use_id", "toolu_nope")
    refused(anthropic.BadRequestError, lambda: an.messages.create(
        model="m", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]),
        "messages.0.content.0")
    refused(anthropic.BadRequestError, lambda: an.messages.create(
        model="m", max_tokens=10, messages=an_ask + [{"role": "assistant", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
        "messages.1.content.0")

print(f"{spec['family']}: openai {openai.__version__}, anthropic {anthropic.__version__}: {checks} checks passed")
