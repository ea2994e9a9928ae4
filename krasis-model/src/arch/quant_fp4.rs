//! `quantization_config` of the 4-bit float checkpoints: NVIDIA ModelOpt's NVFP4
//! (`quant_method` `modelopt`, `quant_algo` `NVFP4`) and OpenAI's MXFP4 (`quant_method`
//! `mxfp4`, gpt-oss). Which linears are quantised is read from the tensors themselves (a uint8
//! `P.weight` for NVFP4, `*_blocks` for MXFP4), which is what ModelOpt's `ignore` /
//! `exclude_modules` and OpenAI's `modules_to_not_convert` select; every variant Krasis cannot
//! run exactly is refused here, naming the field.

use serde_json::Value;

use super::Fields;
use crate::error::Result;
use crate::spec::SourceQuant;

const Q: &str = "quantization_config";

/// ModelOpt's older form, `hf_quant_config.json` beside `config.json` (all that early NVIDIA FP4
/// checkpoints carry): `{"producer": …, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
/// "kv_cache_quant_algo": null, "exclude_modules": […]}}`. Read only when `config.json` has no
/// `quantization_config`; `None` when the file is absent or its `quant_algo` is null. Its fields
/// are checked as [`parse_modelopt`] checks `quantization_config`'s, errors naming
/// `quantization.<field>` in this file.
pub(super) fn hf_quant_config(dir: &std::path::Path) -> Result<Option<SourceQuant>> {
    let path = dir.join("hf_quant_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(crate::error::ModelError::io(&path, e)),
    };
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| crate::error::ModelError::Json { path: path.clone(), msg: e.to_string() })?;
    let top = value.as_object().ok_or_else(|| crate::error::ModelError::Json {
        path: path.clone(),
        msg: "top level is not a JSON object".into(),
    })?;
    let f = Fields { path: &path, obj: top };
    let q = match f.present("quantization") {
        None => return Ok(None),
        Some(Value::Object(q)) => q,
        Some(v) => return Err(f.err("quantization", format!("expected an object, found {v}"))),
    };
    let s = Fields { path: &path, obj: q };
    if s.present("quant_algo").is_none() {
        return Ok(None);
    }
    parse_modelopt_at(&f, &s, "quantization").map(Some)
}

/// ModelOpt: `quant_algo` must be `NVFP4` (weights E2M1 with an E4M3 scale per 16 and a global
/// FP32 scale); `config_groups`, where present, must describe 4-bit float weights in groups of
/// 16. Their `input_activations` (W4A4 kernels' activation scales, `input_scale` in the file) are
/// accepted and not used: Krasis quantises activations itself (INT8 per group). A quantised KV
/// cache (`kv_cache_quant_algo`, `kv_cache_scheme`) is refused.
pub(super) fn parse_modelopt(f: &Fields, s: &Fields) -> Result<SourceQuant> {
    parse_modelopt_at(f, s, Q)
}

/// [`parse_modelopt`] on the object `s` found at `q_name` in `f` (errors name `q_name.<field>`).
fn parse_modelopt_at(f: &Fields, s: &Fields, q_name: &str) -> Result<SourceQuant> {
    let unsupported = |field: &str, found: String, want: &str| {
        f.err(&format!("{q_name}.{field}"), format!("{found} is not supported (Krasis reads {want})"))
    };
    match s.str_opt("quant_algo")? {
        Some("NVFP4") => {}
        Some(other) => return Err(unsupported("quant_algo", format!("`{other}`"), "`NVFP4`")),
        None => return Err(f.err(&format!("{q_name}.quant_algo"), "missing (expected `NVFP4`)")),
    }
    for kv in ["kv_cache_quant_algo", "kv_cache_scheme"] {
        if let Some(v) = s.present(kv) {
            return Err(unsupported(kv, v.to_string(), "null (an unquantised KV cache)"));
        }
    }
    if let Some(gs) = s.usize_opt("group_size")? {
        if gs != 16 {
            return Err(unsupported("group_size", gs.to_string(), "16 (NVFP4)"));
        }
    }
    let groups = match s.present("config_groups") {
        None => return Ok(SourceQuant::ModelOptNvfp4),
        Some(Value::Object(g)) => g,
        Some(v) => return Err(f.err(&format!("{q_name}.config_groups"), format!("expected an object, found {v}"))),
    };
    for (name, g) in groups {
        let at = format!("config_groups.{name}");
        let Some(obj) = g.as_object() else {
            return Err(f.err(&format!("{q_name}.{at}"), format!("expected an object, found {g}")));
        };
        let grp = Fields { path: f.path, obj };
        let Some(Value::Object(w)) = grp.present("weights") else {
            return Err(f.err(&format!("{q_name}.{at}.weights"), "missing or not an object"));
        };
        let w = Fields { path: f.path, obj: w };
        let wf = |field: &str| format!("{at}.weights.{field}");
        match w.usize_opt("num_bits")? {
            Some(4) | None => {}
            Some(b) => return Err(unsupported(&wf("num_bits"), b.to_string(), "4")),
        }
        match w.str_opt("type")? {
            Some("float") | None => {}
            Some(t) => return Err(unsupported(&wf("type"), format!("`{t}`"), "`float` (E2M1)")),
        }
        match w.usize_opt("group_size")? {
            Some(16) | None => {}
            Some(gs) => return Err(unsupported(&wf("group_size"), gs.to_string(), "16 (NVFP4)")),
        }
        if w.bool_or("dynamic", false)? {
            return Err(unsupported(&wf("dynamic"), "true".into(), "false"));
        }
    }
    Ok(SourceQuant::ModelOptNvfp4)
}

/// OpenAI MXFP4 (`quant_method` `mxfp4`, gpt-oss): E2M1 with an E8M0 scale per 32; nothing else
/// to choose.
pub(super) fn parse_mxfp4(_f: &Fields, _s: &Fields) -> Result<SourceQuant> {
    Ok(SourceQuant::Mxfp4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn parse(q: Value) -> Result<SourceQuant> {
        let top = json!({ "quantization_config": q });
        let f = Fields { path: Path::new("config.json"), obj: top.as_object().unwrap() };
        let s = Fields { path: f.path, obj: q.as_object().unwrap() };
        match q["quant_method"].as_str() {
            Some("mxfp4") => parse_mxfp4(&f, &s),
            _ => parse_modelopt(&f, &s),
        }
    }

    /// The README's config (ModelOpt 0.47's export) and the bare form.
    #[test]
    fn modelopt_nvfp4_parses() {
        let q = json!({"config_groups": {"group_0": {
            "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}},
            "ignore": ["lm_head", "model.layers.0*"], "quant_algo": "NVFP4",
            "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"});
        assert_eq!(parse(q).unwrap(), SourceQuant::ModelOptNvfp4);
        assert_eq!(
            parse(json!({"quant_method": "modelopt", "quant_algo": "NVFP4"})).unwrap(),
            SourceQuant::ModelOptNvfp4
        );
        assert_eq!(parse(json!({"quant_method": "mxfp4"})).unwrap(), SourceQuant::Mxfp4);
    }

    /// Unknown algorithms and groups are refused naming the field.
    #[test]
    fn unsupported_variants_name_the_field() {
        let cases = [
            (json!({"quant_method": "modelopt", "quant_algo": "FP8"}), "quantization_config.quant_algo"),
            (json!({"quant_method": "modelopt"}), "quantization_config.quant_algo"),
            (
                json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}),
                "quantization_config.kv_cache_quant_algo",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "NVFP4",
                       "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}),
                "quantization_config.config_groups.g.weights.group_size",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "NVFP4",
                       "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}),
                "quantization_config.config_groups.g.weights.type",
            ),
        ];
        for (q, field) in cases {
            let e = parse(q.clone()).unwrap_err().to_string();
            assert!(e.contains(field), "{q}: {e}");
        }
    }
}
