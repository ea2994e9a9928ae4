#!/usr/bin/env python3
"""Encodes a fixed multilingual text with Hugging Face's Python `tokenizers` (the reference) for
each tokenizer fetched by scripts/fetch-tokenizers.py, and writes the ids to
tests/data/tokenizers/expected.json for tests/tests/tokenizers_ref.rs.
    python scripts/make-tokenizer-refs.py .tokenizers"""
import json, os, sys
import tokenizers

TEXTS = [
    "Hello, world! The experts live in RAM; prefill runs on the GPU.",
    "Grüße aus Zürich — naïve café, façade, Ångström.",
    "你好，世界！混合专家模型在内存中运行。日本語のテキストも。한국어 문장.",
    "def f(x):\n    return x ** 2  # squares\n\n\tfor i in range(10): print(i)",
    "Numbers 1234567890, 3.14159, -42, 1e-5 and emoji 🙂🚀👩‍💻 and   multiple   spaces\n\n\n",
    "Special-looking text <|im_start|> and <｜end▁of▁sentence｜> written as plain text.",
]

src = sys.argv[1] if len(sys.argv) > 1 else ".tokenizers"
out = {"tokenizers": tokenizers.__version__, "texts": TEXTS, "expected": {}}
for name in sorted(os.listdir(src)):
    tok = tokenizers.Tokenizer.from_file(os.path.join(src, name, "tokenizer.json"))
    cfg = json.load(open(os.path.join(src, name, "tokenizer_config.json")))
    bos = cfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    bos_id = tok.token_to_id(bos) if bos else None
    rows = []
    for t in TEXTS:
        # With the tokenizer's post-processor, and BOS in front where tokenizer_config asks for it
        # (`add_bos_token`), as transformers' fast tokenizers do.
        ids = tok.encode(t, add_special_tokens=True).ids
        if cfg.get("add_bos_token") and bos_id is not None and ids[:1] != [bos_id]:
            ids = [bos_id] + ids
        rows.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    out["expected"][name] = rows
json.dump(out, open("tests/data/tokenizers/expected.json", "w"), ensure_ascii=False, indent=1)
print(f"{len(out['expected'])} tokenizers × {len(TEXTS)} texts, tokenizers {tokenizers.__version__}")
