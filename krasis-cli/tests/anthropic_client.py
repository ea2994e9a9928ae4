"""`krasis serve`'s /v1/messages through the official `anthropic` Python package (issue #41 item 3).

Usage: anthropic_client.py BASE_URL API_KEY SCRIPT_FILE. The server runs with
KRASIS_TEST_SCRIPT=SCRIPT_FILE, `--api-key API_KEY` and a Qwen3-style chat template (see
anthropic_sdk.rs): each reply is the text this script writes into SCRIPT_FILE before the request.
Exits non-zero on any mismatch; prints one "anthropic <version>: N checks passed" line on success.
"""

import json
import sys

import anthropic
from anthropic import Anthropic

base_url, key, script = sys.argv[1], sys.argv[2], sys.argv[3]
client = Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=60)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def reply(text):
    with open(script, "w") as f:
        f.write(text)


def raises(cls, fn, *words):
    """fn() raises `cls` with Anthropic's error body, its message naming each of `words`."""
    try:
        fn()
    except cls as e:
        body = e.body
        check(isinstance(body, dict) and body.get("type") == "error", body)
        msg = body["error"]["message"]
        for w in words:
            check(w in msg, (w, msg))
        return body["error"]["type"]
    raise AssertionError(f"no {cls.__name__} from {fn}")


user = [{"role": "user", "content": "Hi"}]

# A plain message.
reply("Hello there.")
m = client.messages.create(model="tiny", max_tokens=50, system="Be brief.", messages=user)
check(m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m)
check([b.type for b in m.content] == ["text"] and m.content[0].text == "Hello there.", m.content)
check(m.stop_reason == "end_turn" and m.stop_sequence is None, m)
check(m.usage.input_tokens > 0 and m.usage.output_tokens > 0, m.usage)

# Streaming text: the helper's text stream and final message, and the raw event order.
with client.messages.stream(model="tiny", max_tokens=50, messages=user) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
check(text == "Hello there.", text)
check(final.content[0].text == "Hello there." and final.stop_reason == "end_turn", final)
check(final.usage.output_tokens == m.usage.output_tokens, (final.usage, m.usage))
kinds = [e.type for e in client.messages.create(model="tiny", max_tokens=50, messages=user, stream=True)]
check(kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds)
check("content_block_start" in kinds and "content_block_delta" in kinds and "content_block_stop" in kinds, kinds)

# A tool call, whole and streamed (its input put together from input_json_delta).
tools = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}},
]
ask = [{"role": "user", "content": "Weather in Paris?"}]
reply('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
m = client.messages.create(model="tiny", max_tokens=300, messages=ask, tools=tools)
check(m.stop_reason == "tool_use", m.stop_reason)
check([b.type for b in m.content] == ["text", "tool_use"], m.content)
use = m.content[1]
check(use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_"), use)
with client.messages.stream(model="tiny", max_tokens=300, messages=ask, tools=tools) as stream:
    deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
    final = stream.get_final_message()
check("input_json_delta" in deltas, deltas)
check(final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}, final)
check(final.content[0].text == "Let me check.", final.content)

# A named tool_choice: the call.
m = client.messages.create(model="tiny", max_tokens=300, messages=ask, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"})
check(m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}, m)

# The result sent back: the reply is text.
reply("It is sunny in Paris.")
turn = ask + [
    {"role": "assistant", "content": m.content},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[-1].id, "content": "sunny"}]},
]
done = client.messages.create(model="tiny", max_tokens=50, messages=turn, tools=tools)
check(done.content[0].text == "It is sunny in Paris." and done.stop_reason == "end_turn", done)
check(done.usage.input_tokens > m.usage.input_tokens, (done.usage, m.usage))

# Thinking on a Qwen3-style template: a thinking block, then the text; streamed as thinking_delta.
reply("<think>\nParis is usually mild.\n</think>\n\nParis is sunny.")
think = {"type": "enabled", "budget_tokens": 1024}
m = client.messages.create(model="tiny", max_tokens=100, messages=ask, thinking=think)
check([b.type for b in m.content] == ["thinking", "text"], m.content)
check(m.content[0].thinking == "Paris is usually mild." and m.content[1].text == "Paris is sunny.", m.content)
with client.messages.stream(model="tiny", max_tokens=100, messages=ask, thinking=think) as stream:
    deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
    final = stream.get_final_message()
check("thinking_delta" in deltas and "text_delta" in deltas, deltas)
check([(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content]
      == [("thinking", "Paris is usually mild."), ("text", "Paris is sunny.")], final.content)
# The thinking block passed back in the next turn is accepted.
reply("Yes.")
again = client.messages.create(model="tiny", max_tokens=20, thinking=think,
                               messages=ask + [{"role": "assistant", "content": m.content},
                                               {"role": "user", "content": "Sure?"}])
check(again.content[-1].text == "Yes.", again)
# The thinking switch reaches the template: disabled adds the empty think block to the prompt.
on = client.messages.count_tokens(model="tiny", messages=ask, thinking=think).input_tokens
off = client.messages.count_tokens(model="tiny", messages=ask, thinking={"type": "disabled"}).input_tokens
check(off > on > 0, (on, off))

# Stop reasons.
reply("one two three four five six seven eight nine ten")
m = client.messages.create(model="tiny", max_tokens=3, messages=user)
check(m.stop_reason == "max_tokens" and m.usage.output_tokens == 3, m)
m = client.messages.create(model="tiny", max_tokens=100, messages=user, stop_sequences=["four"])
check(m.stop_reason == "stop_sequence" and m.stop_sequence == "four", m)
check(m.content[0].text.startswith("one two three") and "four" not in m.content[0].text, m.content)
with client.messages.stream(model="tiny", max_tokens=100, messages=user, stop_sequences=["four"]) as stream:
    final = stream.get_final_message()
check(final.stop_reason == "stop_sequence" and final.stop_sequence == "four", final)

# Errors in Anthropic's shape.
kind = raises(anthropic.BadRequestError,
              lambda: client.post("/v1/messages", body={"model": "tiny", "messages": user}, cast_to=object),
              "max_tokens")
check(kind == "invalid_request_error", kind)
raises(anthropic.BadRequestError,
       lambda: client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "robot", "content": "x"}]),
       "messages.0.role")
raises(anthropic.BadRequestError,
       lambda: client.messages.create(model="tiny", max_tokens=5,
                                      messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
       "messages.0.content.0.type")
raises(anthropic.BadRequestError,
       lambda: client.messages.create(model="tiny", max_tokens=5, messages=ask, tools=tools,
                                      tool_choice={"type": "tool", "name": "nope"}),
       "tool_choice.name", "nope")
raises(anthropic.BadRequestError,
       lambda: client.messages.create(model="tiny", max_tokens=5, messages=ask + [
           {"role": "assistant", "content": "ok"},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]),
       "tool_use_id", "toolu_none")
raises(anthropic.BadRequestError,
       lambda: client.messages.create(model="tiny", max_tokens=5, messages=ask,
                                      tools=[{"name": "f", "input_schema": "not a schema"}]),
       "tools.0.input_schema")
wrong = Anthropic(base_url=base_url, api_key="wrong-key", max_retries=0, timeout=60)
kind = raises(anthropic.AuthenticationError, lambda: wrong.messages.create(model="tiny", max_tokens=5, messages=user))
check(kind == "authentication_error", kind)

print(f"anthropic {anthropic.__version__}: {checks} checks passed")
