#!/usr/bin/env python3
"""The oracle for a quantised GGUF: transformers in float64 (eager attention), running the HF
fixture's architecture with the GGUF's weights dequantised by the `gguf` package's reference
dequantisers put in. Writes REFERENCE (safetensors) in the layout of the fixtures'
reference.safetensors: prompt_ids (the fixture's), prefill_logits [T,V], hidden_states [L+1,T,H],
greedy_ids [N], greedy_logits [N,V] (teacher-forced logits that chose each greedy id).

usage: gguf-dequant-reference.py FIXTURE_DIR MODEL.gguf REFERENCE.safetensors
Needs torch, transformers, safetensors, numpy and gguf-py (scripts/make-gguf-fixtures.sh's venv;
gguf-py is found through GGUF_PY or the llama.cpp copy beside the GGUF fixtures).

GGUF names are mapped back to the hub's (the inverse of Krasis's mapping): stacked experts
ffn_{gate,up,down}_exps split per expert, *_shexp to shared_experts, exp_probs_b to
e_score_correction_bias, attn_k_b (transposed) + attn_v_b re-interleaved into kv_b_proj.
The dequantised weights are written as an f32 checkpoint beside the fixture's config.json and
loaded with from_pretrained, the path the fixture's own oracle took. The families' own hub names
(ARCH_LAYER): qwen2moe's one shared expert `mlp.shared_expert.*` with its gate
`mlp.shared_expert_gate` and the q/k/v biases; minimax-m2's `block_sparse_moe` router, correction
bias (beside the gate) and experts `w1` / `w3` / `w2`; glm4moe's `post_attention_norm` and q/k/v
biases; gpt-oss's biases, sinks, router with its bias and fused, transposed experts (rebuilt from
the split ones, gate and up interleaved again); Mixtral's (`llama`) `block_sparse_moe` router and
experts `w1` / `w3` / `w2`, and its q and k rows, which llama.cpp's converter permuted for its
rotary layout, put back.

llama.cpp's qwen3next and qwen35moe (the gated-DeltaNet fixtures, written in the fixture's own
layout): every transformation of llama.cpp's converter (conversion/qwen.py) is undone:
- the zero-centred norms (layer norms, final norm, q/k norms) were stored as 1 + w: w = stored - 1,
  kept in float64 (transformers' norm computes 1 + w in float32, which gives the stored value back);
- `ssm_a` is -exp(A_log): A_log = log(-ssm_a), kept in float64 (the model runs in float64);
- `ssm_conv1d` [C, K] is conv1d.weight [C, 1, K];
- qwen3next: `attn_qkv` (q of all key heads, k, v) and `attn_gate` (z) are regrouped per key head into
  in_proj_qkvz, `ssm_ba` is in_proj_ba as stored;
- qwen35moe: the value heads were reordered from grouped by key head to tiled
  ([k0 v0, k1 v0, ..., k0 v1, ...]) in the v rows of attn_qkv, attn_gate, ssm_beta / ssm_alpha
  (in_proj_b / in_proj_a), ssm_a, ssm_dt, the v channels of ssm_conv1d and the columns of ssm_out:
  put back; the routed experts are fused again (gate_up_proj [E, 2I, H], down_proj [E, H, I]) under
  model.language_model.
The gated delta rule runs in float64 as in the fixtures' own oracle (transformers' torch fallback
casts to float32; its two functions are re-created with float64, as tools/fixtures/make_fixtures.py
does).
"""
import json, os, re, shutil, sys, tempfile

import numpy as np

fixture, gguf_path, out = sys.argv[1:4]
gguf_py = os.environ.get("GGUF_PY") or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(gguf_path))), ".llama.cpp", "gguf-py")
sys.path.insert(0, gguf_py)
import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

SIMPLE = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}

# Per architecture, the layer names that differ from LAYER's, and the routed experts' prefix and
# projection names (gate, up, down).
ARCH_LAYER = {
    "qwen2moe": {
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "glm4moe": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "minimax-m2": {
        "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
        "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias",
    },
    "gpt-oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    },
}
ARCH_LAYER["llama"] = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}  # Mixtral
ARCH_EXPERTS = {
    "minimax-m2": ("block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}),
    "llama": ("block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}),
}

def unpermute(w, n_head):
    """The inverse of llama.cpp's LlamaModel.permute of q/k rows (each head's rotary halves
    interleaved): rows [n_head, d/2, 2] back to [n_head, 2, d/2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

def gguf_arch(r):
    f = r.fields["general.architecture"]
    return bytes(f.parts[f.data[0]]).decode()

def grouped_heads(w, dim, nk, r, head):
    """Value heads from llama.cpp's tiled order back to grouped by key head, along `dim`."""
    shape = list(w.shape)
    t = w.reshape(shape[:dim] + [r, nk, head] + shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(shape)

def deltanet_state_dict(r, arch, fixture):
    """The fixture's own checkpoint layout from a qwen3next / qwen35moe GGUF (module docs)."""
    cfg = json.load(open(os.path.join(fixture, "config.json")))
    c = cfg.get("text_config", cfg)
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    rr = nv // nk
    q35 = arch == "qwen35moe"
    base = "model.language_model" if q35 else "model"
    sd, exps = {}, {}
    def f64(w):
        return w.to(torch.float64)
    for t in r.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        w = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape).copy())
        if t.name == "token_embd.weight":
            sd[f"{base}.embed_tokens.weight"] = w
            continue
        if t.name == "output_norm.weight":
            sd[f"{base}.norm.weight"] = f64(w) - 1
            continue
        if t.name == "output.weight":
            sd["lm_head.weight"] = w
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if not m:
            raise SystemExit(f"unmapped GGUF tensor {t.name}")
        l, rest = int(m.group(1)), m.group(2)
        p, la = f"{base}.layers.{l}", f"{base}.layers.{l}.linear_attn"
        tiled = q35 and nk != nv
        def v_rows(x, head):
            return grouped_heads(x, 0, nk, rr, head) if tiled else x
        simple = {
            "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
            "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
            "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
            "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
        }
        centred = {
            "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
            "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
        }
        if rest in centred:
            sd[f"{p}.{centred[rest]}"] = f64(w) - 1
        elif rest == "ssm_out.weight" and tiled:
            sd[f"{la}.out_proj.weight"] = grouped_heads(w, 1, nk, rr, dv)
        elif rest in simple:
            sd[f"{p}.{simple[rest]}"] = w
        elif rest == "ssm_a":
            sd[f"{la}.A_log"] = v_rows(torch.log(-f64(w)), 1)
        elif rest == "ssm_dt.bias":
            sd[f"{la}.dt_bias"] = v_rows(w, 1)
        elif rest == "ssm_conv1d.weight":  # [C, K]
            if tiled:
                w = torch.cat([w[: 2 * nk * dk], grouped_heads(w[2 * nk * dk :], 0, nk, rr, dv)])
            sd[f"{la}.conv1d.weight"] = w[:, None, :].contiguous()
        elif rest == "attn_qkv.weight":
            q, k, v = w[: nk * dk], w[nk * dk : 2 * nk * dk], w[2 * nk * dk :]
            if q35:
                sd[f"{la}.in_proj_qkv.weight"] = torch.cat([q, k, v_rows(v, dv)])
            else:
                exps[("qkv", l)] = (q, k, v)
        elif rest == "attn_gate.weight":
            if q35:
                sd[f"{la}.in_proj_z.weight"] = v_rows(w, dv)
            else:
                exps[("z", l)] = w
        elif rest == "ssm_ba.weight":
            sd[f"{la}.in_proj_ba.weight"] = w
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight"):
            sd[f"{la}.in_proj_{rest[4]}.weight"] = v_rows(w, 1)
        elif (e := re.fullmatch(r"ffn_(gate|up|down)_exps\.weight", rest)):
            if q35:
                exps[(e.group(1), l)] = w
            else:
                for x in range(w.shape[0]):
                    sd[f"{p}.mlp.experts.{x}.{e.group(1)}_proj.weight"] = w[x].clone()
        else:
            raise SystemExit(f"unmapped GGUF tensor {t.name}")
    for (kind, l), w in exps.items():
        p, la = f"{base}.layers.{l}", f"{base}.layers.{l}.linear_attn"
        if kind == "qkv":  # per key head: q, k, then the v and z rows of its value heads
            q, k, v = w
            z = exps[("z", l)]
            h = q.shape[1]
            parts = [q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, rr * dv, h), z.reshape(nk, rr * dv, h)]
            sd[f"{la}.in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, h).contiguous()
        elif kind == "gate":
            sd[f"{p}.mlp.experts.gate_up_proj"] = torch.cat([w, exps[("up", l)]], dim=1).contiguous()
        elif kind == "down":
            sd[f"{p}.mlp.experts.down_proj"] = w
    return sd

def float64_delta_rule():
    """transformers' torch gated delta rule of Qwen3-Next / Qwen3.5 with float64 for float32."""
    import inspect
    import importlib
    for mod_name in ("qwen3_next.modeling_qwen3_next", "qwen3_5_moe.modeling_qwen3_5_moe"):
        mod = importlib.import_module(f"transformers.models.{mod_name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            src = inspect.getsource(getattr(mod, fn)).replace("torch.float32", "torch.float64")
            exec(compile(src, mod.__file__, "exec"), mod.__dict__)

def hub_state_dict(path, fixture):
    r = GGUFReader(path)
    arch = gguf_arch(r)
    if arch in ("qwen3next", "qwen35moe"):
        float64_delta_rule()
        return deltanet_state_dict(r, arch, fixture)
    sd, kb, vb, fused = {}, {}, {}, {}
    layer_names = {**LAYER, **ARCH_LAYER.get(arch, {})}
    exp_prefix, exp_names = ARCH_EXPERTS.get(arch, ("mlp.experts", {k: f"{k}_proj" for k in ("gate", "up", "down")}))
    for t in r.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]  # ggml dims are innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(w.copy())
        if t.name in SIMPLE:
            sd[SIMPLE[t.name]] = w
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if not m:
            raise SystemExit(f"unmapped GGUF tensor {t.name}")
        l, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{l}"
        if rest in layer_names:
            sd[f"{p}.{layer_names[rest]}"] = w
        elif arch == "gpt-oss" and (e := re.fullmatch(r"ffn_(gate|up|down)_exps\.(weight|bias)", rest)):
            fused[(l, e.group(1), e.group(2))] = w
        elif (e := re.fullmatch(r"ffn_(gate|up|down)_exps\.weight", rest)):
            for x in range(w.shape[0]):
                sd[f"{p}.{exp_prefix}.{x}.{exp_names[e.group(1)]}.weight"] = w[x].clone()
        elif rest == "attn_k_b.weight":
            kb[l] = w  # [heads, rank, nope]
        elif rest == "attn_v_b.weight":
            vb[l] = w  # [heads, v, rank]
        else:
            raise SystemExit(f"unmapped GGUF tensor {t.name}")
    # gpt-oss's fused experts, as the hub stores them (x @ W): gate_up_proj [E, H, 2I] with gate j in
    # column 2j and up j in 2j + 1 (llama.cpp's converter transposed and split them), gate_up_proj_bias
    # [E, 2I] interleaved alike, down_proj [E, I, H] (stored transposed), down_proj_bias [E, H].
    for l in sorted({k[0] for k in fused}):
        g, u, d = (fused[(l, x, "weight")] for x in ("gate", "up", "down"))
        gb, ub, db = (fused[(l, x, "bias")] for x in ("gate", "up", "down"))
        e, i, h = g.shape
        p = f"model.layers.{l}.mlp.experts"
        sd[f"{p}.gate_up_proj"] = torch.stack([g, u], dim=2).reshape(e, 2 * i, h).transpose(1, 2).contiguous()
        sd[f"{p}.gate_up_proj_bias"] = torch.stack([gb, ub], dim=2).reshape(e, 2 * i).contiguous()
        sd[f"{p}.down_proj"] = d.transpose(1, 2).contiguous()
        sd[f"{p}.down_proj_bias"] = db.contiguous()
    if arch == "llama":
        # llama.cpp's converter permuted q and k rows for its rotary layout (Mixtral: `llama`).
        cfg = json.load(open(os.path.join(fixture, "config.json")))
        nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        for name in list(sd):
            if name.endswith("self_attn.q_proj.weight"):
                sd[name] = unpermute(sd[name], nh).contiguous()
            elif name.endswith("self_attn.k_proj.weight"):
                sd[name] = unpermute(sd[name], nkv).contiguous()
    for l, k in kb.items():
        v = vb[l]
        kv = torch.cat([k.transpose(1, 2), v], dim=1)  # [heads, nope + v, rank]
        sd[f"model.layers.{l}.self_attn.kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1]).contiguous()
    return sd

def main():
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    prompt = ref["prompt_ids"].to(torch.long)
    n_new = ref["greedy_ids"].numel()
    sd = hub_state_dict(gguf_path, fixture)
    with tempfile.TemporaryDirectory() as tmp:
        # The weights written are dequantised floats in the unquantised layout: a quantisation
        # config (gptoss-mxfp4-tiny's mxfp4) would make transformers expect its packed tensors.
        cfg = json.load(open(os.path.join(fixture, "config.json")))
        cfg.pop("quantization_config", None)
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
        save_file(sd, os.path.join(tmp, "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"checkpoint does not fit the model: {bad}")
    model.eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        o = model(prompt[None], output_hidden_states=True)
        prefill = o.logits[0].float()
        hidden = torch.stack([h[0] for h in o.hidden_states]).float()
        ids, step_logits, seq = [], [], prompt.clone()
        last = prefill[-1]
        for _ in range(n_new):
            nxt = int(torch.argmax(last))
            ids.append(nxt)
            step_logits.append(last)
            seq = torch.cat([seq, torch.tensor([nxt])])
            last = model(seq[None]).logits[0, -1].float()
    save_file(
        {
            "prompt_ids": prompt.to(torch.int64),
            "prefill_logits": prefill.contiguous(),
            "hidden_states": hidden.contiguous(),
            "greedy_ids": torch.tensor(ids, dtype=torch.int64),
            "greedy_logits": torch.stack(step_logits).contiguous(),
        },
        out + ".tmp",
    )
    os.replace(out + ".tmp", out)
    # How far the GGUF's weights are from the fixture's (the quantisation the test measures).
    hub = load_file(os.path.join(fixture, "model.safetensors"))
    num = sum(float(((sd[k].double() - hub[k].double()) ** 2).sum()) for k in hub if k in sd)
    den = sum(float((hub[k].double() ** 2).sum()) for k in hub if k in sd)
    # FP8's scales, and MXFP4's blocks and scales, whose values the dequantised tensor holds.
    def held(k):
        return k.endswith("_scale_inv") or (k.endswith(("_blocks", "_scales")) and k.rsplit("_", 1)[0] in sd)
    missing = [k for k in hub if k not in sd and not held(k)]
    print(json.dumps({"gguf": gguf_path, "params": len(params), "tensors": len(sd),
                      "weights_rel_err": (num / den) ** 0.5, "missing_from_gguf": missing[:5]}))
    if missing:
        raise SystemExit(f"GGUF lacks {len(missing)} hub tensors, e.g. {missing[:3]}")

main()
