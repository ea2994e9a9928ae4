//! Issue #41, "Done when": the official `openai` and `anthropic` Python packages against
//! `krasis serve` on a synthetic model of each supported family, with the family's chat template,
//! the reply forced into the family's own tool-call and reasoning text by `KRASIS_TEST_SCRIPT`
//! (random weights would write nothing parseable). One server and one Python process
//! (`families_client.py`) per family: reasoning, a sentence and a parallel call, whole and
//! streamed, with arguments as valid JSON and the reasoning in `reasoning_content`; the round trip
//! with the results sent back; the same through `/v1/messages` (thinking, text, tool_use and
//! tool_result blocks). Qwen3-MoE's also checks that bad input (a schema that is not JSON Schema,
//! a tool result that answers no call, content blocks of the wrong type) gets a 400 in each API's
//! error shape.
//!
//! Each model is a preset's configuration with its widths cut down (as `tests/real_configs.rs`
//! cuts the published ones) and two layers deep, so each family's own forward pass runs. The
//! templates:
//! - published ones, copied into `tests/data/chat_templates/` (see `tests/tests/chat_templates.rs`):
//!   DeepSeek-V3, DeepSeek-R1, Qwen3 (also for Qwen3-Next and Qwen3.5/3.6, whose published
//!   templates are not in this repository), gpt-oss; and Kimi-K2's, as llama.cpp's
//!   `models/templates/moonshotai-Kimi-K2.jinja` carries it (`data/kimi-k2-moonshotai.jinja`,
//!   from `../shared/real-configs`): the Kimi-K2-Instruct copy in `tests/data` appends to a list
//!   when it renders a tool result, which transformers' sandbox refuses and so does Krasis;
//! - written here from memory of the published ones: Mixtral-8x7B-Instruct's and Qwen1.5-MoE's
//!   (both without tools);
//! - written here in the family's call form, not the published text (which is not in this
//!   repository): Qwen3-Coder's XML calls, GLM-4.5's and MiniMax-M2's (calls and results as those
//!   families write them, MiniMax's generation prompt opening the think block as the published
//!   one does).
//!
//! Python comes from `KRASIS_PYTHON` (`.ci/run` points it at a venv with `openai` and
//! `anthropic`), else `python3`; without either package each test says so on a `*** SKIPPED`
//! line, and `KRASIS_REQUIRE_OPENAI=1` / `KRASIS_REQUIRE_ANTHROPIC=1` make that a failure.

mod common;

use std::path::Path;

use common::Scripted;
use krasis_model::synth::{preset_config, synthesize, Preset, SynthOptions};
use serde_json::{json, Value};

/// A published template copied into the tests crate's data.
macro_rules! published {
    ($name:literal) => {
        include_str!(concat!("../../tests/data/chat_templates/", $name, ".jinja"))
    };
}

/// Mixtral-8x7B-Instruct-v0.1's template (user and assistant turns only, no tools).
const MIXTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

/// Qwen1.5-MoE-A2.7B-Chat's ChatML template (no tools in it: its calls are read by the model
/// type's `<tool_call>` parser).
const QWEN2_MOE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GLM-4.5's call form (`<tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…`), its
/// role markers and thinking switch.
const GLM45: &str = r#"[gMASK]<sop>
{%- if tools %}<|system|>
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|assistant|>
{{ m.content }}{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments | items %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- else %}<|{{ m.role }}|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}
<think></think>{% endif %}{% endif %}"#;

/// MiniMax-M2's call form (`<minimax:tool_call>` around `<invoke name=…>` blocks), its role
/// markers, and a generation prompt that opens the think block.
const MINIMAX_M2: &str = r#"]~!b[]~b]system
{% if tools %}# Tools
<tools>
{% for t in tools %}<tool>{{ t.function | tojson }}</tool>
{% endfor %}</tools>
{% endif %}[e~[
{%- for m in messages %}
{%- if m.role == 'assistant' %}]~b]ai
{{ m.content }}{% if m.tool_calls %}<minimax:tool_call>
{% for tc in m.tool_calls %}<invoke name="{{ tc.function.name }}">
{% for k, v in tc.function.arguments | items %}<parameter name="{{ k }}">{{ v if v is string else v | tojson }}</parameter>
{% endfor %}</invoke>
{% endfor %}</minimax:tool_call>{% endif %}[e~[
{%- elif m.role == 'tool' %}]~b]tool
<response>{{ m.content }}</response>[e~[
{%- else %}]~b]{{ m.role }}
{{ m.content }}[e~[
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}]~b]ai
<think>
{% endif %}"#;

/// Qwen3-Coder's call form (`<tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>…`), which
/// Qwen3-Coder-Next writes (Qwen3.5/3.6 may too: their published templates are not in this
/// repository), with Qwen3's ChatML turns.
const QWEN3_CODER: &str = r#"{%- if tools %}<|im_start|>system
# Tools

<tools>
{%- for t in tools %}
<function>
<name>{{ t.function.name }}</name>
<parameters>{{ t.function.parameters | tojson }}</parameters>
</function>
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls or [] %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments | items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

/// A configuration's widths cut down (each key present set to a small value; structure,
/// routing and rope kept), as `tests/real_configs.rs` cuts the published ones.
fn shrink(text: &mut Value) {
    let mla = text.get("kv_lora_rank").is_some();
    let q_lora = text.get("q_lora_rank").is_some_and(|v| !v.is_null());
    let mut set = |k: &str, v: Value| {
        if text.get(k).is_some() {
            text[k] = v;
        }
    };
    for (k, v) in [
        ("vocab_size", 4096),
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 128),
        ("shared_expert_intermediate_size", 128),
        ("n_routed_experts", 16),
        ("num_experts", 16),
        ("num_local_experts", 16),
        ("num_experts_per_tok", 4),
        ("rotary_dim", 32),
        ("num_attention_heads", 4),
        ("num_key_value_heads", if mla { 4 } else { 2 }),
        ("head_dim", 64),
        ("kv_lora_rank", 64),
        ("qk_nope_head_dim", 32),
        ("qk_rope_head_dim", 16),
        ("v_head_dim", 32),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("linear_key_head_dim", 32),
        ("linear_value_head_dim", 32),
        ("n_group", 4),
        ("topk_group", 2),
    ] {
        set(k, json!(v));
    }
    if q_lora {
        set("q_lora_rank", json!(128));
    }
}

/// Writes `config` (a whole `config.json`) to a model directory with random weights.
fn synth_config(model: &Path, config: Value) {
    let file = model.with_extension("config.json");
    std::fs::write(&file, config.to_string()).unwrap();
    let opts = SynthOptions { config: Some(file), seed: 7, force: true, ..SynthOptions::new(Preset::Tiny, model) };
    synthesize(&opts).unwrap_or_else(|e| panic!("synthesize {}: {e}", model.display()));
}

/// `preset` two layers deep with its widths cut down, after `edit`.
fn preset_model(preset: Preset, edit: impl FnOnce(&mut Value)) -> impl FnOnce(&Path) {
    move |model: &Path| {
        let mut config = preset_config(preset, Some(2));
        if config.get("text_config").is_some() {
            shrink(&mut config["text_config"]);
        } else {
            shrink(&mut config);
        }
        edit(&mut config);
        synth_config(model, config);
    }
}

/// Qwen2-MoE (no preset): q/k/v biases and a sigmoid-gated shared expert.
fn qwen2_moe_model(model: &Path) {
    synth_config(
        model,
        json!({
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 4096,
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": false,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "use_sliding_window": false,
            "sliding_window": 32768, "hidden_act": "silu", "tie_word_embeddings": false,
            "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"
        }),
    );
}

/// What the client script is told about a family (see `families_client.py`).
struct Family {
    name: &'static str,
    format: Option<&'static str>,
    thinking: bool,
    opens_think: bool,
    parallel: bool,
    system: bool,
    /// Also check that bad input gets a 400 in each API's error shape (one family does).
    bad_input: bool,
}

impl Family {
    /// A family with tool calls in `format`, reasoning, parallel calls and system messages.
    fn tools(name: &'static str, format: &'static str) -> Family {
        Family {
            name,
            format: Some(format),
            thinking: true,
            opens_think: false,
            parallel: true,
            system: true,
            bad_input: false,
        }
    }
}

/// Starts the server on the model `build` writes with `template`, runs the client script for
/// `family` with both packages, and checks it passed.
fn check_family(family: Family, template: &str, build: impl FnOnce(&Path)) {
    let Some(python) = common::openai_python() else { return };
    if common::anthropic_python().is_none() {
        return;
    }
    let s = Scripted::start_built(template, &[], build);
    let spec = json!({"family": family.name, "format": family.format, "thinking": family.thinking,
        "opens_think": family.opens_think, "parallel": family.parallel, "system": family.system,
        "bad_input": family.bad_input});
    let base = format!("http://{}", s.server.addr);
    let out = common::run_client(
        &python,
        "families_client.py",
        &[&base, s.script.to_str().unwrap(), &spec.to_string()],
        &s.server,
    );
    eprintln!("{}", out.trim());
}

#[test]
fn deepseek_v3() {
    let f = Family { thinking: false, ..Family::tools("DeepSeek-V3", "deepseek") };
    check_family(f, published!("deepseek-v3"), preset_model(Preset::V3Mini, |_| {}));
}

#[test]
fn deepseek_r1() {
    check_family(
        Family::tools("DeepSeek-R1", "deepseek"),
        published!("deepseek-r1"),
        preset_model(Preset::V3Mini, |_| {}),
    );
}

/// DeepSeek-V2-Lite-Chat's own template writes no tool calls: V3's template on V2's architecture.
#[test]
fn deepseek_v2_lite() {
    check_family(Family::tools("DeepSeek-V2-Lite", "deepseek"), published!("deepseek-v3"), krasis_tests::tiny_model);
}

#[test]
fn kimi_k2() {
    // Kimi-K2 is DeepSeek-V3's architecture under its own model type.
    let build = preset_model(Preset::V3Mini, |c| c["model_type"] = json!("kimi_k2"));
    check_family(Family::tools("Kimi-K2", "kimi"), include_str!("data/kimi-k2-moonshotai.jinja"), build);
}

#[test]
fn qwen3_moe() {
    let f = Family { bad_input: true, ..Family::tools("Qwen3-MoE", "qwen3") };
    check_family(f, published!("qwen3"), preset_model(Preset::Qwen3_30bA3b, |_| {}));
}

#[test]
fn qwen3_next() {
    check_family(Family::tools("Qwen3-Next", "qwen3"), published!("qwen3"), preset_model(Preset::Qwen3Next80b, |_| {}));
}

#[test]
fn qwen3_6() {
    check_family(Family::tools("Qwen3.6", "qwen3"), published!("qwen3"), preset_model(Preset::Qwen36_35b, |_| {}));
}

#[test]
fn qwen3_coder_next() {
    let f = Family::tools("Qwen3-Coder-Next", "qwen3-coder");
    check_family(f, QWEN3_CODER, preset_model(Preset::Qwen3Next80b, |_| {}));
}

#[test]
fn glm_4_5() {
    check_family(Family::tools("GLM-4.5", "glm45"), GLM45, preset_model(Preset::Glm45Air, |_| {}));
}

#[test]
fn minimax_m2() {
    let f = Family { opens_think: true, ..Family::tools("MiniMax-M2", "minimax-m2") };
    check_family(f, MINIMAX_M2, preset_model(Preset::MiniMaxM2, |_| {}));
}

#[test]
fn qwen2_moe() {
    let f = Family { thinking: false, ..Family::tools("Qwen2-MoE", "qwen3") };
    check_family(f, QWEN2_MOE, qwen2_moe_model);
}

#[test]
fn mixtral() {
    let f = Family {
        name: "Mixtral",
        format: None,
        thinking: false,
        opens_think: false,
        parallel: false,
        system: false,
        bad_input: false,
    };
    check_family(f, MIXTRAL, preset_model(Preset::Mixtral8x7b, |_| {}));
}

#[test]
fn gpt_oss() {
    let f = Family { parallel: false, ..Family::tools("gpt-oss", "harmony") };
    check_family(f, published!("gpt-oss"), preset_model(Preset::GptOss120b, |_| {}));
}
