"""Tool calls and reasoning through the official `openai` Python package (issue #41 item 2).

Usage: openai_tools.py BASE_URL SCRIPT_FILE. The server runs with KRASIS_TEST_SCRIPT=SCRIPT_FILE
and a Qwen3-style chat template (see serve_tools.rs / openai_sdk.rs): each reply is the text this
script writes into SCRIPT_FILE before the request. Exits non-zero on any mismatch; prints one
"openai <version>: N tool checks passed" line on success.
"""

import json
import sys

import openai
from openai import OpenAI

base_url, script = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def reply(text):
    with open(script, "w") as f:
        f.write(text)


tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
msgs = [{"role": "user", "content": "Weather in Paris, and the time?"}]
reply(
    "<think>\nI should look it up.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)

whole = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=300)
choice = whole.choices[0]
check(choice.finish_reason == "tool_calls", choice.finish_reason)
calls = choice.message.tool_calls
check(calls is not None and len(calls) == 2, calls)
check(calls[0].type == "function" and calls[0].function.name == "get_weather", calls[0])
check(json.loads(calls[0].function.arguments) == {"city": "Paris"}, calls[0].function.arguments)
check(json.loads(calls[1].function.arguments) == {"tz": "CET"}, calls[1].function.arguments)
check(getattr(choice.message, "reasoning_content", None) == "I should look it up.", choice.message)

stream = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=300, stream=True)
acc, reasoning, finish = {}, "", None
for chunk in stream:
    for c in chunk.choices:
        reasoning += getattr(c.delta, "reasoning_content", None) or ""
        for tc in c.delta.tool_calls or []:
            slot = acc.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        if c.finish_reason:
            finish = c.finish_reason
check(finish == "tool_calls", finish)
check(reasoning == "I should look it up.", reasoning)
check([acc[i]["name"] for i in sorted(acc)] == ["get_weather", "get_time"], acc)
check(json.loads(acc[0]["arguments"]) == {"city": "Paris"} and acc[0]["id"], acc)

# The round trip: the calls and their results back in the messages; the reply is text.
reply("Sunny, and it is noon.")
follow = msgs + [
    {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
    {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
]
done = client.chat.completions.create(model="tiny", messages=follow, tools=tools, max_tokens=50)
check(done.choices[0].message.content == "Sunny, and it is noon.", done.choices[0].message)
check(done.choices[0].finish_reason == "stop", done.choices[0].finish_reason)
check(done.usage.prompt_tokens > whole.usage.prompt_tokens, (done.usage, whole.usage))

try:
    client.chat.completions.create(
        model="tiny", messages=msgs + [{"role": "tool", "tool_call_id": "nope", "content": "x"}], tools=tools
    )
    check(False, "a tool result with no matching call was accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "tool_call_id" in str(e), str(e))

print(f"openai {openai.__version__}: {checks} tool checks passed")
