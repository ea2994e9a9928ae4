"""Generates the Kimi tiktoken test fixture (run from this directory; needs `pip install tiktoken regex`).

Kimi-K2's own `tiktoken.model` cannot be fetched here, so this writes a small synthetic one in the same format:
the 256 single bytes (rank = byte value) and the merges a tiny byte-level BPE learns from CORPUS below, split with
Kimi's pattern. The pattern is copied verbatim from Kimi-K2's `tokenization_kimi.py`. The special tokens follow that
file's scheme (ids from len(ranks) on, 256 + 2 of them, named by `added_tokens_decoder` or `<|reserved_token_{id}|>`),
with Kimi-K2-Instruct's `added_tokens_decoder` moved down to this vocabulary's size.

Outputs (all read by tests/tests/tiktoken.rs):
- tiktoken.model, tokenizer_config.json: the tokenizer.
- encode.json: texts (or `text_parts`, [piece, repeat] pairs) and, as [id, repeat] runs, the ids Python tiktoken gives for them, through the same steps as `TikTokenTokenizer.encode`
  (chunks of 400,000 characters, runs of at most 25,000 spaces or non-spaces, then `Encoding.encode` with
  `allowed_special="all"`; or `disallowed_special=()` for `allow_special_tokens=False`).
- splits.json: tricky strings (and 400 random ones) and their pieces under Kimi's pattern read by the Python `regex` module in VERSION1 mode,
  where `&&` is class intersection, as in the Rust fancy-regex that tiktoken compiles the pattern with. (The module's
  default VERSION0 reads `&&` and the nested class literally, which matches no letters at all.) For each string the
  script checks that tiktoken's ids equal the ids of the pieces encoded one by one.
"""

import base64
import collections
import json
import random

import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
PAT = regex.compile(PAT_STR, flags=regex.VERSION1)

CORPUS = """
The quick brown fox jumps over the lazy dog. The dog didn't care; it's the fox's problem, and they've said so.
Tokenizers split text into pieces, then merge bytes into tokens. We'll see whether they're right.
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text if c.isprintable()]
for (int i = 0; i < 1024; ++i) { total += values[i] * 2; }
人工智能正在改变世界。我们使用分词器把文本切成词元。中文没有空格，所以汉字连续出现。
模型的输入是词元序列，输出是下一个词元的概率分布。
日本語の文章も少し含めます。ひらがなとカタカナ、そして漢字。
Числа: 1234567890, 3.14159, 2026-11-28. Привет, мир! Ελληνικά γράμματα.
Emoji: 😀 👍🏽 🚀 ❤️ and symbols like ©, ™, → and ∑.
""" * 3

SPECIALS_FROM_KIMI = "../../../../shared/real-configs/Kimi-K2-Instruct/tokenizer_config.json-reconstructed"
KIMI_BASE = 163584
NUM_MERGES = 600


def train(corpus: str, num_merges: int) -> dict[bytes, int]:
    words = collections.Counter(tuple(bytes([b]) for b in p.encode()) for p in PAT.findall(corpus))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        # Most frequent pair; ties go to the smallest bytes, so the result is deterministic.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        new = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += n
        words = new
    return ranks


def split_spaces(s: str, max_len: int):
    # Verbatim logic of TikTokenTokenizer._split_whitespaces_or_nonwhitespaces.
    current_len = 0
    current_is_space = s[0].isspace() if len(s) > 0 else False
    start = 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > max_len:
                yield s[start:i]
                start = i
                current_len = 1
    yield s[start:]


def kimi_encode(enc, text: str, allow_special_tokens: bool = True) -> list[int]:
    # The steps of TikTokenTokenizer.encode (without transformers).
    substrs = [
        sub
        for i in range(0, len(text), 400_000)
        for sub in split_spaces(text[i : i + 400_000], 25_000)
    ]
    ids = []
    for sub in substrs:
        if allow_special_tokens:
            ids.extend(enc.encode(sub, allowed_special="all"))
        else:
            ids.extend(enc.encode(sub, disallowed_special=()))
    return ids


def rle(ids: list[int]) -> list[list[int]]:
    # Runs of one id as [id, count], to keep the long case small.
    out = []
    for i in ids:
        if out and out[-1][0] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def main():
    ranks = train(CORPUS, NUM_MERGES)
    with open("tiktoken.model", "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    # Loaded back exactly as tokenization_kimi.py does.
    ranks = load_tiktoken_bpe("tiktoken.model")
    n = len(ranks)

    kimi = json.load(open(SPECIALS_FROM_KIMI))
    decoder = {str(int(i) - KIMI_BASE + n): v for i, v in kimi["added_tokens_decoder"].items()}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": kimi["bos_token"],
        "eos_token": kimi["eos_token"],
        "pad_token": kimi["pad_token"],
        "unk_token": kimi["unk_token"],
        "tokenizer_class": kimi["tokenizer_class"],
        "auto_map": kimi["auto_map"],
    }
    with open("tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")

    mapping = {int(i): v["content"] for i, v in decoder.items()}
    special_tokens = {mapping.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256 + 2)}
    enc = tiktoken.Encoding(name="tiktoken.model", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special_tokens)

    text = (
        "Hello, world! The tokenizer's test: they'RE here, WE'LL see, I'm sure. HTTPServer camelCase ÉCOLE école\n"
        "人工智能正在改变世界。中文和English混合mixed文本。々〆〇 豈 日本語のひらがなカタカナーです。\n"
        "def f(x):\n\treturn x**2  # square\n\n\n    if a && b || c[0] != d[-1]:\n        pass\n"
        "Digits: 1 12 123 1234 12345678 ١٢٣٤ Ⅻ ½ 3.14159e-10\n"
        "Emoji: 😀👍🏽🚀 👨‍👩‍👧 ❤️ 🇫🇷\n"
        "Spaces:   three,\u00a0nbsp,\u3000ideographic, tabs\t\t, trailing   \n"
        "  \r\n\r\n mixed \n \n  end.  "
        "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>[BOS]x<|reserved_token_" + str(n + 17) + "|>y"
        " Ελληνικά ΑΒΓ ǅemal ʰello e\u0301te Ǆ Привет МИР ÀbcDEF&[^] \x1c\x1d x\x85z"
    )
    cases = [
        {"name": "multilingual", "text": text},
        {"name": "empty", "text": ""},
        {"name": "long_runs", "text_parts": [["x", 1], ["he", 12_600], [" ", 25_003], ["\n", 1], ["y", 3]]},
    ]
    for c in cases:
        if "text_parts" in c:
            c["text"] = "".join(p * k for p, k in c["text_parts"])
    for c in cases:
        c["ids"] = kimi_encode(enc, c["text"], True)
        c["ids_no_special"] = kimi_encode(enc, c["text"], False)
        assert enc.decode(c["ids"]) == c["text"]
        assert enc.decode(c["ids_no_special"]) == c["text"]
    assert cases[0]["ids"] != cases[0]["ids_no_special"]
    assert max(cases[0]["ids"]) >= n
    # The chunking must matter in the long case: one Encoding.encode call of the whole text differs.
    assert enc.encode(cases[2]["text"]) != cases[2]["ids"]
    for c in cases:
        if "text_parts" in c:
            del c["text"]
        for key in ("ids", "ids_no_special"):
            c[key] = rle(c[key])
    with open("encode.json", "w") as f:
        json.dump({"num_base_tokens": n, "cases": cases}, f, ensure_ascii=False)
        f.write("\n")

    tricky = [
        "Hello world", "I'm", "DON'T", "they'RE", "'s", "x's'S", "HTTPServer", "camelCaseWord", "ÉCOLE école",
        "abc中文def", "中文,English", " 中文", "々〆〇", "豈更", "ひらがなカタカナー", "한국어 텍스트", "ǅemal", "Ǆ", "ʰello",
        "e\u0301te", "\u0301abc", "ΑΒΓαβγ", "Привет МИР", "ภาษาไทย", "مرحبا بالعالم",
        "1234567", "١٢٣٤٥", "Ⅻ½", "3.14", "a1b2", "x²",
        "😀👍🏽🚀", "👨‍👩‍👧", "❤️", "🇫🇷",
        "a && b", "[^\\p{Han}]", "&&[", "c[0] != d[-1]", "...!!!\n\n", " ?!\r\n\r\nx",
        "   ", "a   b", "a   ", "\n\n\n", " \n \n ", "\r\n", "\t\tx", "x\u00a0y", "\u3000x", "x\u2028y",
        "\x1c\x1d x", "x\x85z", "\x0bv\x0c", "\u200bzw\u200d", "",
        "fn main() {\n    println!(\"hi\");\n}\n",
    ]
    # The Python regex module's own \s and tiktoken's (the Rust regex crate's) could differ on these controls;
    # the cross-check below would show it.
    # Random strings over a pool of the characters each alternative of the pattern cares about.
    pool = (
        list("aZqQ'sStTdDmM&[]^-_.,;!?()<>|\\/\"#*0159") + [" ", " ", "  ", "\n", "\r", "\t", "\x0b", "\x0c"]
        + list("中文々〆〇豈ひカーÉéǅʰΑβПр한\u0301\u0308\u00a0\u3000\u2028\x1c\x1f\x85\u200b١Ⅻ½²😀🏽\u200d")
    )
    rng = random.Random(38)
    tricky += ["".join(rng.choice(pool) for _ in range(rng.randrange(0, 24))) for _ in range(400)]
    splits = []
    for s in tricky:
        pieces = PAT.findall(s)
        assert "".join(pieces) == s, (s, pieces)
        assert enc.encode(s, disallowed_special=()) == [t for p in pieces for t in enc._encode_single_piece(p)], s
        splits.append({"text": s, "pieces": pieces})
    with open("splits.json", "w") as f:
        json.dump(splits, f, ensure_ascii=False, indent=0)
        f.write("\n")
    v0 = regex.compile(PAT_STR, flags=regex.VERSION0)
    assert v0.findall("Hello world") != PAT.findall("Hello world")
    print(f"{n} ranks, {len(special_tokens)} specials, {len(cases[0]['ids'])} ids, {len(splits)} split cases")


if __name__ == "__main__":
    main()
