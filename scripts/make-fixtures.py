#!/usr/bin/env python3
"""The HF oracle fixtures: tiny random checkpoints of DeepSeek-V2, DeepSeek-V3 and Qwen3-MoE
with what Hugging Face transformers computes from them in float64, in the layout
tests/src/lib.rs reads (docs/FORMATS.md, "HF oracle fixtures").

usage: make-fixtures.py OUT [--only NAME ...]
Needs torch (CPU use only), transformers, safetensors, numpy and tokenizers
(scripts/make-fixtures.sh makes a venv with them). Writes, for each fixture NAME:

  OUT/NAME/config.json            the hub config (same shapes as the fixtures in ../shared)
  OUT/NAME/model.safetensors      random weights in the hub's per-expert layout: BF16
                                  (dsv3-fp8-tiny: FP8 e4m3 in 128x128 blocks with
                                  `weight_scale_inv`, norms, router and embeddings BF16)
  OUT/NAME/tokenizer.json         byte-level BPE learned from krasis-model/src/synth/corpus.txt
  OUT/NAME/tokenizer_config.json  special tokens and a plain chat template
  OUT/NAME/reference.safetensors  transformers in float64, eager attention, on those weights:
                                  prompt_ids I64 [T], prefill_logits F32 [T,V],
                                  hidden_states F32 [L+1,T,H], greedy_ids I64 [N],
                                  greedy_logits F32 [N,V]
  OUT/NAME/reference.json         how the reference was made (versions, seed, margins)

and OUT/quant_bounds.json: what an ideal weight-only INT8/INT4 quantisation and transformers'
own BF16 run reach on each fixture (quant_fidelity.rs, gpu_oracle.rs, hybrid_oracle.rs and
gguf_oracle.rs judge Krasis's quantised and BF16 paths against these).

Each fixture's weights come from a seeded generator; a seed whose greedy decode has a near-tie
(top-2 logit gap below MIN_GREEDY_MARGIN) or whose routing has one (MIN_ROUTER_MARGIN) is
skipped for the next, since an engine that is right within float32 rounding could pick the
other token or expert there; so is a seed whose prompt routes change under 8-bit weights
(ROBUST_GROUPS), where a correct quantised path would meet quant_bounds.json's bars by luck.
The same versions of torch and transformers give the same files.
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "krasis-model", "src", "synth", "corpus.txt")

VOCAB = 512
BOS, EOS = "<|bos|>", "<|eos|>"
# The tests' prompt and decode lengths (the shared fixtures' too).
PROMPT_LEN = 20
NEW_TOKENS = 24
# Standard deviation of every random matrix (the configs' initializer_range).
INIT_STD = 0.05
# Norm weights are 1 + this x N(0, 1): not all ones, so an engine that skips one is caught.
NORM_JITTER = 0.1
# DeepSeek-V3's e_score_correction_bias: N(0, this), the size of the sigmoid scores' spread.
BIAS_STD = 0.05
# Smallest top-1 minus top-2 logit gap allowed in the greedy decode: the tests want greedy ids
# exact, and an engine within their 1e-4 relative bar (logit vectors' norm ~16) may move two
# logits by 1.6e-3 each at worst.
MIN_GREEDY_MARGIN = 5e-3
# Smallest gap between the last chosen and the first rejected expert (or group) score: the
# reference routes in float32, whose rounding moves a score by ~1e-8.
MIN_ROUTER_MARGIN = 1e-6
# A seed is kept only if the prompt's routes (every MoE layer, every position) survive 8-bit
# weights: every linear quantised to INT8 in groups of each of these sizes along K. Most random
# draws have some route within INT8 noise of a tie, and there a correct 8-bit path is right or
# wrong by luck; quant_bounds.json's comparisons assume the routes hold.
ROBUST_GROUPS = (128, 64, 32)
# Seeds tried per fixture before giving up.
MAX_ATTEMPTS = 64
# FP8 e4m3's largest finite value, and the block DeepSeek-V3 scales it in.
FP8_MAX = 448.0
FP8_BLOCK = 128
# The ideal quantisation of quant_bounds.json: groups of 128 along K, halved while K is not a
# multiple, never below 32.
QUANT_GROUP, QUANT_MIN_GROUP = 128, 32
# Greedy tokens the BF16 run decodes for its agreement count.
BF16_GREEDY = 8

DEEPSEEK_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 192,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_nope_head_dim": 40,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": INIT_STD,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def deepseek(arch, model_type, **changes):
    return {"architectures": [arch], "model_type": model_type, **DEEPSEEK_BASE, **changes}


V3 = dict(
    n_shared_experts=1,
    num_experts_per_tok=3,
    q_lora_rank=96,
    topk_method="noaux_tc",
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
)

# name -> (config, weights "bf16" | "fp8"). The order is tests/src/lib.rs's FIXTURE_NAMES.
FIXTURES = {
    "dsv2-lite-tiny": (deepseek("DeepseekV2ForCausalLM", "deepseek_v2"), "bf16"),
    "dsv2-k256-tiny": (
        deepseek(
            "DeepseekV2ForCausalLM",
            "deepseek_v2",
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=512,
            num_hidden_layers=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
        ),
        "bf16",
    ),
    "dsv2-grouped-tiny": (
        deepseek(
            "DeepseekV2ForCausalLM",
            "deepseek_v2",
            num_experts_per_tok=3,
            q_lora_rank=96,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
        ),
        "bf16",
    ),
    "dsv3-tiny": (deepseek("DeepseekV3ForCausalLM", "deepseek_v3", **V3), "bf16"),
    "dsv3-fp8-tiny": (
        deepseek(
            "DeepseekV3ForCausalLM",
            "deepseek_v3",
            **V3,
            quantization_config={
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            },
        ),
        "fp8",
    ),
    "qwen3moe-tiny": (
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": VOCAB,
            "hidden_size": 192,
            "intermediate_size": 384,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-06,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": INIT_STD,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        },
        "bf16",
    ),
}

TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "model_max_length": 163840,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}",
}

NOTES = (
    "prefill_logits: full forward of prompt_ids; greedy_logits[i]: logits that chose greedy_ids[i] "
    "(teacher-forced on greedy_ids[:i]); hidden_states[0] is the embedding output, [l] the output of "
    "layer l-1 (the last entry has the final norm applied, as transformers returns it)."
)


# ---------------------------------------------------------------------------------------------
# Checkpoint layout


def is_moe_layer(cfg, layer):
    if cfg["model_type"] == "qwen3_moe":
        return layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0
    return layer >= cfg["first_k_dense_replace"] and layer % cfg["moe_layer_freq"] == 0


def n_experts(cfg):
    return cfg["num_experts"] if cfg["model_type"] == "qwen3_moe" else cfg["n_routed_experts"]


def hub_layout(cfg):
    """Every tensor of the hub checkpoint in order: name -> (shape, role). Roles: "embed",
    "norm", "router", "bias" (e_score_correction_bias), "dense" (a linear outside the routed
    experts), "expert" (a routed expert's linear), "head" (lm_head)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": ([v, h], "embed")}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = ([h], "norm")
        t[f"{p}.post_attention_layernorm.weight"] = ([h], "norm")
        a = f"{p}.self_attn"
        if cfg["model_type"] == "qwen3_moe":
            heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            t[f"{a}.q_proj.weight"] = ([heads * hd, h], "dense")
            t[f"{a}.k_proj.weight"] = ([kv * hd, h], "dense")
            t[f"{a}.v_proj.weight"] = ([kv * hd, h], "dense")
            t[f"{a}.o_proj.weight"] = ([h, heads * hd], "dense")
            t[f"{a}.q_norm.weight"] = ([hd], "norm")
            t[f"{a}.k_norm.weight"] = ([hd], "norm")
        else:
            heads = cfg["num_attention_heads"]
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            if qr is None:
                t[f"{a}.q_proj.weight"] = ([heads * (nope + rope), h], "dense")
            else:
                t[f"{a}.q_a_proj.weight"] = ([qr, h], "dense")
                t[f"{a}.q_a_layernorm.weight"] = ([qr], "norm")
                t[f"{a}.q_b_proj.weight"] = ([heads * (nope + rope), qr], "dense")
            t[f"{a}.kv_a_proj_with_mqa.weight"] = ([kvr + rope, h], "dense")
            t[f"{a}.kv_a_layernorm.weight"] = ([kvr], "norm")
            t[f"{a}.kv_b_proj.weight"] = ([heads * (nope + vd), kvr], "dense")
            t[f"{a}.o_proj.weight"] = ([h, heads * vd], "dense")
        m = f"{p}.mlp"
        if not is_moe_layer(cfg, layer):
            i = cfg["intermediate_size"]
            t[f"{m}.gate_proj.weight"] = ([i, h], "dense")
            t[f"{m}.up_proj.weight"] = ([i, h], "dense")
            t[f"{m}.down_proj.weight"] = ([h, i], "dense")
            continue
        mi, e = cfg["moe_intermediate_size"], n_experts(cfg)
        t[f"{m}.gate.weight"] = ([e, h], "router")
        if cfg["model_type"] == "deepseek_v3":
            t[f"{m}.gate.e_score_correction_bias"] = ([e], "bias")
        for x in range(e):
            t[f"{m}.experts.{x}.gate_proj.weight"] = ([mi, h], "expert")
            t[f"{m}.experts.{x}.up_proj.weight"] = ([mi, h], "expert")
            t[f"{m}.experts.{x}.down_proj.weight"] = ([h, mi], "expert")
        shared = cfg.get("n_shared_experts") or 0
        if shared:
            t[f"{m}.shared_experts.gate_proj.weight"] = ([mi * shared, h], "dense")
            t[f"{m}.shared_experts.up_proj.weight"] = ([mi * shared, h], "dense")
            t[f"{m}.shared_experts.down_proj.weight"] = ([h, mi * shared], "dense")
    t["model.norm.weight"] = ([h], "norm")
    t["lm_head.weight"] = ([v, h], "head")
    return t


def random_weights(cfg, seed):
    """The checkpoint's tensors as the hub stores them: BF16, the V3 score bias F32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, role) in hub_layout(cfg).items():
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if role == "norm":
            out[name] = (1.0 + NORM_JITTER * x).to(torch.bfloat16)
        elif role == "bias":
            out[name] = BIAS_STD * x
        else:
            out[name] = (INIT_STD * x).to(torch.bfloat16)
    return out


def fp8_blocks(w):
    """`w` [out, in] as FP8 e4m3 with one scale per 128x128 block: (fp8, weight_scale_inv),
    w ~= fp8 * scale (block-broadcast)."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    w = w.float()
    scale = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK]
            s = float(blk.abs().max()) / FP8_MAX or 1.0
            scale[i, j] = s
            q[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK] = (blk / s).to(
                torch.float8_e4m3fn
            )
    return q, scale


def fp8_dequant(q, scale):
    s = scale.repeat_interleave(FP8_BLOCK, 0)[: q.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : q.shape[1]]
    return q.float() * s


def stored_and_effective(cfg, weights, kind):
    """(the tensors model.safetensors holds, the weights they stand for, for the reference)."""
    if kind == "bf16":
        return weights, weights
    layout = hub_layout(cfg)
    stored, effective = {}, {}
    for name, w in weights.items():
        if layout[name][1] in ("dense", "expert"):
            q, s = fp8_blocks(w)
            stored[name], stored[name + "_scale_inv"] = q, s
            effective[name] = fp8_dequant(q, s)
        else:
            stored[name] = effective[name] = w
    return stored, effective


# ---------------------------------------------------------------------------------------------
# transformers runs


class Routes:
    """Records each MoE router's choices and the smallest gap at which one would change
    (forward hooks on the routers, which return logits, weights and expert indices)."""

    def __init__(self, cfg, model):
        self.cfg, self.min_margin, self.chosen = cfg, math.inf, []
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate") and hasattr(mod, "weight"):
                bias = getattr(mod, "e_score_correction_bias", None)
                mod.register_forward_hook(lambda _m, _i, out, b=bias: self.seen(out, b))

    def seen(self, out, bias):
        self.chosen.append(out[2].detach().sort(-1).values)
        logits, cfg = out[0], self.cfg
        logits = logits.detach().double().reshape(-1, logits.shape[-1])
        k, e = cfg["num_experts_per_tok"], logits.shape[-1]
        if cfg.get("scoring_func") == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        if bias is not None:
            scores = scores + bias.double()
        method = cfg.get("topk_method", "greedy")
        if method in ("group_limited_greedy", "noaux_tc") and cfg["n_group"] > 1:
            grouped = scores.view(-1, cfg["n_group"], e // cfg["n_group"])
            if method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(-1).values
            self.gap(group_scores, cfg["topk_group"])
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, group_scores.topk(cfg["topk_group"], -1).indices, 1.0)
            mask = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, e).bool()
            scores = scores.masked_fill(~mask, -math.inf)
        self.gap(scores, k)

    def gap(self, scores, k):
        top = scores.topk(k + 1, dim=-1).values
        finite = torch.isfinite(top[:, k])
        if finite.any():
            self.min_margin = min(self.min_margin, float((top[finite, k - 1] - top[finite, k]).min()))


def load(cfg, weights, dtype):
    """transformers' own model class for `cfg` on `weights` (hub names), eager attention and
    experts, loaded through from_pretrained as any checkpoint is."""
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp,
            dtype=dtype,
            attn_implementation="eager",
            experts_implementation="eager",
            output_loading_info=True,
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"make-fixtures: the checkpoint does not fit {cfg['architectures'][0]}: {bad}")
    return model.eval()


@torch.no_grad()
def greedy(model, prompt, steps, min_margin=None):
    """Greedy ids and, for each, the logits that chose it (each step a full forward of the
    sequence so far: no cache). Stops early after a step whose top-2 gap is below `min_margin`."""
    ids, logits, seq = [], [], prompt
    last = model(prompt[None]).logits[0, -1]
    for i in range(steps):
        nxt = int(torch.argmax(last))
        ids.append(nxt)
        logits.append(last.double())
        top2 = last.topk(2).values
        if min_margin is not None and float(top2[0] - top2[1]) < min_margin:
            break
        if i + 1 < steps:
            seq = torch.cat([seq, torch.tensor([nxt])])
            last = model(seq[None]).logits[0, -1]
    return ids, torch.stack(logits)


@torch.no_grad()
def prefill(model, prompt):
    return model(prompt[None]).logits[0].double()


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def prompt_routes(cfg, weights, prompt):
    """The experts each MoE layer picks for each prompt position, in a float64 prefill."""
    model = load(cfg, weights, torch.float64)
    routes = Routes(cfg, model)
    prefill(model, prompt)
    return routes.chosen


def routes_flip_under_int8(cfg, effective, prompt, chosen):
    """The first group size of ROBUST_GROUPS whose INT8 weights change a prompt route, or None."""
    layout = hub_layout(cfg)
    for g in ROBUST_GROUPS:
        w = dict(effective)
        for n, (_, role) in layout.items():
            if role in ("expert", "dense", "head"):
                w[n] = ideal_quant(effective[n], 127, g)
        if any(not torch.equal(a, b) for a, b in zip(chosen, prompt_routes(cfg, w, prompt))):
            return g
    return None


def reference(cfg, effective, prompt):
    model = load(cfg, effective, torch.float64)
    routes = Routes(cfg, model)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    chosen = list(routes.chosen)
    prefill_logits = out.logits[0].double()
    hidden = torch.stack([h[0] for h in out.hidden_states]).double()
    ids, step_logits = greedy(model, prompt, NEW_TOKENS, MIN_GREEDY_MARGIN)
    top2 = step_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    return {
        "prefill_logits": prefill_logits,
        "hidden_states": hidden,
        "greedy_ids": ids,
        "greedy_logits": step_logits,
        "greedy_margins": margins,
        "router_margin": routes.min_margin,
        "prompt_routes": chosen,
    }


# ---------------------------------------------------------------------------------------------
# quant_bounds.json


def group_size(k, group=QUANT_GROUP):
    g = group
    while k % g:
        g //= 2
    if g < QUANT_MIN_GROUP:
        raise SystemExit(f"make-fixtures: K = {k} has no quantisation group of at least {QUANT_MIN_GROUP}")
    return g


def ideal_quant(w, qmax, group=QUANT_GROUP):
    """Symmetric per-group quantisation along K (the last axis) of w [out, in], dequantised."""
    w = w.double()
    rows, k = w.shape
    g = group_size(k, group)
    blocks = w.reshape(rows, k // g, g)
    scale = blocks.abs().amax(-1, keepdim=True) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(blocks / scale), -qmax, qmax) * scale).reshape(rows, k)


def fidelity(logits, ref):
    a, b = logits.double(), ref.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)
    top1 = (a.argmax(-1) == b.argmax(-1)).double().mean()
    return {"min_cos": round(float(cos.min()), 6), "mean_cos": round(float(cos.mean()), 6), "top1": float(top1)}


def bounds(cfg, effective, prompt, ref):
    layout = hub_layout(cfg)
    out = {}
    first = ref["greedy_ids"][0]
    for kind, qmax, roles in [
        ("int8", 127, ("expert",)),
        ("int4", 7, ("expert",)),
        ("int8dense", 127, ("expert", "dense", "head")),
    ]:
        # MLA's kv_b_proj stays exact: Krasis keeps it per head (W_UK^T, W_UV), grouped along
        # other axes than the hub matrix's K.
        names = [n for n, (_, role) in layout.items() if role in roles and "kv_b_proj" not in n]
        w = dict(effective)
        for n in names:
            w[n] = ideal_quant(effective[n], qmax)
        logits = prefill(load(cfg, w, torch.float64), prompt)
        entry = fidelity(logits, ref["prefill_logits"])
        if kind == "int8dense":
            a, b = logits, ref["prefill_logits"]
            cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
            entry["median_cos"] = round(float(cos.median()), 6)
        entry["first_token_same"] = bool(int(logits[-1].argmax()) == first)
        entry["tensors"] = len(names)
        out[kind] = entry
    model = load(cfg, effective, torch.bfloat16)
    logits = prefill(model, prompt)
    entry = {"rel": round(rel_l2(logits, ref["prefill_logits"]), 6), **fidelity(logits, ref["prefill_logits"])}
    ids, _ = greedy(model, prompt, BF16_GREEDY)
    entry["greedy_match_of_8"] = sum(int(a == b) for a, b in zip(ids, ref["greedy_ids"][:BF16_GREEDY]))
    out["bf16"] = entry
    return out


BOUNDS_WHAT = (
    "Fidelity an ideal weight-only quantisation of the routed experts reaches on each fixture: "
    f"symmetric per-group along K (group {QUANT_GROUP}, halved while K is not divisible, min {QUANT_MIN_GROUP}), "
    "scale = amax/qmax (qmax 7 for INT4, 127 for INT8), all other weights and all arithmetic exact "
    f"(float64, transformers {transformers.__version__}). \"int8dense\" quantises the dense linears "
    "(attention projections but MLA's kv_b_proj, dense MLPs, shared experts, LM head) the same way as well. Compared with "
    "reference.safetensors prefill_logits: per-position cosine (min, mean), top-1 agreement over prompt "
    "positions, and whether the first greedy token survives; \"tensors\" counts the hub tensors quantised. "
    "Router near-ties flip under any perturbation in these tiny random models, so min cosine and top-1 are "
    "noisy; mean cosine is the stable figure. The \"bf16\" entry is transformers' own BF16 run of the fixture "
    f"on the CPU (torch {torch.__version__}, eager attention, eager experts), compared the same way, plus "
    f"how many of its first {BF16_GREEDY} greedy ids equal the reference's: the noise any correct BF16 path "
    "shows. Written by scripts/make-fixtures.py."
)
BOUNDS_RULE = (
    "a quantised path passes a fixture when (1 - its mean per-position cosine) <= 2 * (1 - ideal mean_cos) "
    "+ 1e-4 and its top-1 agreement >= ideal top1 - 0.1; at INT8 also its first greedy token is the "
    "reference's wherever the ideal keeps it"
)
BOUNDS_RULE_BF16 = (
    "a BF16 path passes a fixture when (1 - its mean per-position cosine) <= 3 * (1 - bf16 mean_cos) + 1e-4 "
    "and its top-1 agreement >= bf16 top1 - 0.1"
)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_json():
    """A byte-level BPE of VOCAB ids: <|bos|> 0, <|eos|> 1, the 256 byte symbols, then merges
    learned from Krasis's synth corpus."""
    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer)
    if tok.get_vocab_size() != VOCAB or tok.token_to_id(BOS) != 0 or tok.token_to_id(EOS) != 1:
        raise SystemExit(f"make-fixtures: the tokenizer learned {tok.get_vocab_size()} ids, not {VOCAB}")
    text = "Hello, world! The experts live in RAM."
    if tok.decode(tok.encode(text).ids) != text:
        raise SystemExit("make-fixtures: the tokenizer does not round-trip")
    return json.loads(tok.to_str())


# ---------------------------------------------------------------------------------------------


def base_seed(name):
    """A seed per fixture that does not depend on Python's hash randomisation."""
    return sum((i + 1) * c for i, c in enumerate(name.encode())) * 1000


def make(name, out, tok):
    cfg, kind = FIXTURES[name]
    for attempt in range(MAX_ATTEMPTS):
        seed = base_seed(name) + attempt
        weights = random_weights(cfg, seed)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, cfg["vocab_size"], (PROMPT_LEN,), generator=g, dtype=torch.int64)
        stored, effective = stored_and_effective(cfg, weights, kind)
        ref = reference(cfg, effective, prompt)
        if min(ref["greedy_margins"]) < MIN_GREEDY_MARGIN or ref["router_margin"] < MIN_ROUTER_MARGIN:
            why = f"near-tie (greedy margin {min(ref['greedy_margins']):.2e}, router margin {ref['router_margin']:.2e})"
        elif (g := routes_flip_under_int8(cfg, effective, prompt, ref["prompt_routes"])) is not None:
            why = f"a prompt route flips under INT8 weights in groups of {g}"
        else:
            break
        print(f"make-fixtures: {name} seed {seed}: {why}; next seed", file=sys.stderr)
    else:
        raise SystemExit(f"make-fixtures: {name}: no seed of {MAX_ATTEMPTS} without a near-tie")

    # A float32 run of the same weights: how far plain single precision lands from the oracle.
    f32 = prefill(load(cfg, effective, torch.float32), prompt)
    margins = sorted(ref["greedy_margins"])
    info = {
        "name": name,
        "generator": "scripts/make-fixtures.py",
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "reference_dtype": "float64",
        "attn_implementation": "eager",
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "reload_rel_err_f32": rel_l2(f32, ref["prefill_logits"]),
        "logits_std": float(ref["prefill_logits"].std()),
        "min_greedy_margin": margins[0],
        "median_greedy_margin": margins[len(margins) // 2],
        "min_router_margin": ref["router_margin"],
        "prompt_routes_hold_under_int8_groups": list(ROBUST_GROUPS),
        "weights": "bf16" if kind == "bf16" else "fp8 e4m3 128x128 blocks (weight_scale_inv), rest bf16",
        "notes": NOTES,
    }
    tensors = {
        "prompt_ids": prompt.to(torch.int64),
        "prefill_logits": ref["prefill_logits"].float(),
        "hidden_states": ref["hidden_states"].float(),
        "greedy_ids": torch.tensor(ref["greedy_ids"], dtype=torch.int64),
        "greedy_logits": ref["greedy_logits"].float(),
    }
    dst = os.path.join(out, name)
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in stored.items()}, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "reference.safetensors"))
    with open(os.path.join(tmp, "reference.json"), "w") as f:
        json.dump(info, f, indent=2)
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    b = bounds(cfg, effective, prompt, ref)
    print(
        f"make-fixtures: {name}: seed {seed}, min greedy margin {margins[0]:.2e}, "
        f"router margin {ref['router_margin']:.2e}, float32 rel {info['reload_rel_err_f32']:.1e}, "
        f"ideal 1-cos int8 {1 - b['int8']['mean_cos']:.2e} int4 {1 - b['int4']['mean_cos']:.2e}"
    )
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to write the fixtures into")
    ap.add_argument("--only", nargs="+", choices=list(FIXTURES), help="make these fixtures only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tok = tokenizer_json()
    path = os.path.join(args.out, "quant_bounds.json")
    fixtures = {}
    if args.only and os.path.exists(path):
        with open(path) as f:
            fixtures = json.load(f).get("fixtures", {})
    for name in args.only or FIXTURES:
        fixtures[name] = make(name, args.out, tok)
    qb = {"_what": BOUNDS_WHAT, "rule": BOUNDS_RULE, "fixtures": fixtures, "rule_bf16": BOUNDS_RULE_BF16}
    with open(path + ".tmp", "w") as f:
        json.dump(qb, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"make-fixtures: {', '.join(args.only or FIXTURES)} -> {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
