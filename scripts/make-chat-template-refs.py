#!/usr/bin/env python3
"""Renders the published chat templates (../shared/real-configs) on a fixed set of
conversations with transformers' own renderer (`render_jinja_template`, what
`apply_chat_template` calls), and writes the templates and the expected texts to
tests/data/chat_templates/ for tests/tests/chat_templates.rs.

Run from the repository root with a Python that has transformers (no torch needed):
    python scripts/make-chat-template-refs.py ../shared/real-configs
`strftime_now` is fixed to 2026-11-28 on both sides (the Rust test passes the same date)."""
import json, sys, os, datetime
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template
import transformers


class FixedDay(datetime.datetime):
    """`strftime_now` reads `datetime.now()`: the references use one fixed day."""

    @classmethod
    def now(cls, tz=None):
        return cls(2026, 11, 28, 12, 0, 0)


chat_template_utils.datetime = FixedDay

src = sys.argv[1]
out = "tests/data/chat_templates"
os.makedirs(out, exist_ok=True)

def tok(cfg, key):
    v = cfg.get(key)
    if isinstance(v, dict):
        return v.get("content")
    return v

def load_cfg(p):
    return json.load(open(os.path.join(src, p)))

templates = {}
for name, cfgp, tmpl in [
    ("deepseek-r1", "DeepSeek-R1/tokenizer_config.json", None),
    ("deepseek-v3", "DeepSeek-V3-tokenizer/tokenizer_config.json", None),
    ("qwen3", "Qwen3-tokenizer/tokenizer_config.json", None),
    ("kimi-k2", "Kimi-K2-Instruct/tokenizer_config.json-reconstructed", "Kimi-K2-Instruct/chat_template.jinja_from_llamacpp-Kimi-K2-Instruct"),
    ("gpt-oss", "gpt-oss-tokenizer/tokenizer_config.json", "gpt-oss-120b/chat_template.jinja"),
]:
    cfg = load_cfg(cfgp)
    text = open(os.path.join(src, tmpl)).read() if tmpl else cfg["chat_template"]
    templates[name] = {"template": text, "bos_token": tok(cfg, "bos_token") or "", "eos_token": tok(cfg, "eos_token") or ""}

tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city, now.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
                         "required": ["city"]}}}]
cases = [
    {"name": "one_user_turn", "messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {"name": "system_and_turns", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüße, 你好 <b>&'\" — what is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}], "add_generation_prompt": True},
    {"name": "no_generation_prompt", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "add_generation_prompt": False},
    {"name": "tools_offered", "messages": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris?"}], "tools": tools, "add_generation_prompt": True},
    {"name": "tool_call_and_result", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp_c\": 21}"}],
     "tools": tools, "add_generation_prompt": True},
    {"name": "thinking_off", "messages": [{"role": "user", "content": "Think briefly."}], "add_generation_prompt": True,
     "kwargs": {"enable_thinking": False}},
    {"name": "thinking_on", "messages": [{"role": "user", "content": "Think briefly."}], "add_generation_prompt": True,
     "kwargs": {"enable_thinking": True}},
]

expected = []
for name, t in templates.items():
    with open(os.path.join(out, f"{name}.jinja"), "w") as f:
        f.write(t["template"])
    for c in cases:
        kwargs = dict(c.get("kwargs", {}))
        kwargs.update(bos_token=t["bos_token"], eos_token=t["eos_token"])
        try:
            rendered, _ = render_jinja_template(conversations=[c["messages"]], tools=c.get("tools"),
                                                chat_template=t["template"],
                                                add_generation_prompt=c["add_generation_prompt"], **kwargs)
            result = {"rendered": rendered[0]}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        expected.append({"template": name, "case": c["name"], **result})
json.dump({"transformers": transformers.__version__, "today": "2026-11-28",
           "templates": {n: {"bos_token": t["bos_token"], "eos_token": t["eos_token"]} for n, t in templates.items()},
           "cases": cases, "expected": expected}, open(os.path.join(out, "expected.json"), "w"), ensure_ascii=False, indent=1)
print(f"{len(expected)} renders, {sum('error' in e for e in expected)} errors, transformers {transformers.__version__}")
