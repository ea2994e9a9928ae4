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
loaded with from_pretrained, the path the fixture's own oracle took.
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

def hub_state_dict(path):
    r = GGUFReader(path)
    sd, kb, vb = {}, {}, {}
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
        if rest in LAYER:
            sd[f"{p}.{LAYER[rest]}"] = w
        elif (e := re.fullmatch(r"ffn_(gate|up|down)_exps\.weight", rest)):
            for x in range(w.shape[0]):
                sd[f"{p}.mlp.experts.{x}.{e.group(1)}_proj.weight"] = w[x].clone()
        elif rest == "attn_k_b.weight":
            kb[l] = w  # [heads, rank, nope]
        elif rest == "attn_v_b.weight":
            vb[l] = w  # [heads, v, rank]
        else:
            raise SystemExit(f"unmapped GGUF tensor {t.name}")
    for l, k in kb.items():
        v = vb[l]
        kv = torch.cat([k.transpose(1, 2), v], dim=1)  # [heads, nope + v, rank]
        sd[f"model.layers.{l}.self_attn.kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1]).contiguous()
    return sd

def main():
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    prompt = ref["prompt_ids"].to(torch.long)
    n_new = ref["greedy_ids"].numel()
    sd = hub_state_dict(gguf_path)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(fixture, "config.json"), tmp)
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
    missing = [k for k in hub if k not in sd and not k.endswith("_scale_inv")]
    print(json.dumps({"gguf": gguf_path, "params": len(params), "tensors": len(sd),
                      "weights_rel_err": (num / den) ** 0.5, "missing_from_gguf": missing[:5]}))
    if missing:
        raise SystemExit(f"GGUF lacks {len(missing)} hub tensors, e.g. {missing[:3]}")

main()
