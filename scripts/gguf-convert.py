"""llama.cpp's converter (shared/tools/peer-llama/convert.py's way) with extra converter arguments and the tokenizer
class the model directory declares.

usage: gguf-convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf OUTTYPE [--gpt2-vocab] [CONVERTER ARGS...]
  e.g. `--no-mtp` for the gated-DeltaNet fixtures (qwen3next-tiny, qwen35moe-tiny), which have no MTP layers.
  `--gpt2-vocab` (ours, not passed on): read the vocabulary as a plain GPT-2 BPE where the converter reads a
  family's own special tokens: GLM-4.x's `_set_vocab_glm` looks up `[gMASK]`, `<|user|>` and `<|observation|>`,
  which glm4moe-tiny's synthetic 512-token vocabulary lacks (a KeyError). The weights and metadata are converted
  as for a published checkpoint.

Two things differ from running convert_hf_to_gguf.py directly, neither touching the weights or config.json:
- The pre-tokenizer name is pinned to "gpt-2", as peer-llama's convert.py does (the fixtures' synthetic byte-level
  BPE tokenizer is not in llama.cpp's hash table; its regex is GPT-2's).
- The converter reads the vocabulary with `transformers.AutoTokenizer`, which in transformers 5 picks the tokenizer
  class registered for config.json's `model_type` over `tokenizer_config.json`'s `tokenizer_class`. For
  `qwen3_5_moe` that is `Qwen3_5Tokenizer`, which adds an `<|endoftext|>` token the fixture's 512-token vocabulary
  lacks (as id 512), and the converter then stops on `assert max(vocab ids) < vocab_size`. Here a directory whose
  tokenizer_config.json names `PreTrainedTokenizerFast` is read with that class (the tokenizer.json as written).
"""
import json
import os
import runpy
import sys

lcpp, model, out, outtype = sys.argv[1:5]
extra = sys.argv[5:]
gpt2_vocab = "--gpt2-vocab" in extra
extra = [a for a in extra if a != "--gpt2-vocab"]
sys.path.insert(0, lcpp)
sys.path.insert(0, os.path.join(lcpp, "gguf-py"))

import conversion.base as base  # noqa: E402
import transformers  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
if gpt2_vocab:
    base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2

_auto = transformers.AutoTokenizer.from_pretrained


def _declared_tokenizer(path, *args, **kwargs):
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f).get("tokenizer_class")
    except (OSError, TypeError, ValueError):
        declared = None
    if declared == "PreTrainedTokenizerFast":
        return transformers.PreTrainedTokenizerFast.from_pretrained(path, *args, **kwargs)
    return _auto(path, *args, **kwargs)


transformers.AutoTokenizer.from_pretrained = _declared_tokenizer
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype] + extra
runpy.run_path(os.path.join(lcpp, "convert_hf_to_gguf.py"), run_name="__main__")
