"""Talks to a running `krasis serve` with the official `openai` Python package.

Usage: openai_client.py BASE_URL API_KEY. Exits non-zero (with a traceback) on any mismatch;
prints one "openai <version>: N checks passed" line on success.
"""

import sys

import openai
from openai import OpenAI

base_url, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


models = client.models.list()
ids = [m.id for m in models.data]
check(ids == ["tiny"], f"models: {ids}")

msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about experts"}]
extra = {"top_k": 40, "ignore_eos": True}
whole = client.chat.completions.create(
    model="tiny", messages=msgs, max_tokens=16, seed=11, temperature=0.8, top_p=0.9, extra_body=extra
)
check(whole.object == "chat.completion", whole.object)
choice = whole.choices[0]
check(choice.finish_reason == "length", choice.finish_reason)
check(choice.message.role == "assistant", choice.message.role)
check(whole.usage.completion_tokens == 16, whole.usage)
check(whole.usage.total_tokens == whole.usage.prompt_tokens + 16, whole.usage)

stream = client.chat.completions.create(
    model="tiny", messages=msgs, max_tokens=16, seed=11, temperature=0.8, top_p=0.9, extra_body=extra,
    stream=True, stream_options={"include_usage": True},
)
parts, finish, usage = [], None, None
for chunk in stream:
    check(chunk.object == "chat.completion.chunk", chunk.object)
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
check("".join(parts) == choice.message.content, f"streamed {''.join(parts)!r} != {choice.message.content!r}")
check(finish == "length", finish)
check(usage is not None and usage.completion_tokens == 16, usage)
check(usage.prompt_tokens == whole.usage.prompt_tokens, usage)

comp = client.completions.create(model="tiny", prompt="The experts live in", max_tokens=12, seed=5, extra_body=extra)
check(comp.object == "text_completion", comp.object)
check(comp.usage.completion_tokens == 12, comp.usage)
text = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model="tiny", prompt="The experts live in", max_tokens=12, seed=5, extra_body=extra, stream=True
    )
    if c.choices
)
check(text == comp.choices[0].text, f"streamed {text!r} != {comp.choices[0].text!r}")

stop = comp.choices[0].text[4:6]
cut = client.completions.create(
    model="tiny", prompt="The experts live in", max_tokens=12, seed=5, extra_body=extra, stop=[stop]
)
check(cut.choices[0].text == comp.choices[0].text[: comp.choices[0].text.find(stop)], cut.choices[0].text)
check(cut.choices[0].finish_reason == "stop", cut.choices[0].finish_reason)

try:
    client.chat.completions.create(model="tiny", messages=msgs, temperature=7)
    check(False, "temperature 7 was accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "temperature" in str(e), str(e))

try:
    OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    check(False, "a wrong key was accepted")
except openai.AuthenticationError as e:
    check(e.status_code == 401, str(e))

print(f"openai {openai.__version__}: {checks} checks passed")
