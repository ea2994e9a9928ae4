//! A structural check of the JSON Schema a tool gives for its arguments (OpenAI's
//! `function.parameters`, Anthropic's `input_schema`): each keyword that JSON Schema defines
//! (drafts 4 to 2020-12) holds a value of the kind the draft says, and every subschema is a
//! schema. Keywords it does not define are allowed, as JSON Schema allows them. The check does
//! not compile regular expressions or resolve `$ref`.

use serde_json::Value;

/// The names of JSON Schema's primitive types.
const TYPES: [&str; 7] = ["null", "boolean", "object", "array", "number", "string", "integer"];

/// Whether `schema` is a JSON Schema; `Err("PATH: why")` for the first keyword that is not,
/// PATH from `path` (the schema's own place, such as `tools[0].function.parameters`).
pub(super) fn check(schema: &Value, path: &str) -> Result<(), String> {
    match schema {
        Value::Bool(_) => Ok(()),
        Value::Object(o) => {
            for (k, v) in o {
                check_keyword(k, v, &format!("{path}.{k}"))?;
            }
            Ok(())
        }
        other => Err(format!("{path}: a schema must be an object or a boolean, not {}", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_keyword(k: &str, v: &Value, at: &str) -> Result<(), String> {
    let bad = |why: String| Err(format!("{at}: {why}"));
    match k {
        "type" => match v {
            Value::String(t) if TYPES.contains(&t.as_str()) => Ok(()),
            Value::Array(ts) if !ts.is_empty() => {
                for (i, t) in ts.iter().enumerate() {
                    if !t.as_str().is_some_and(|t| TYPES.contains(&t)) {
                        return Err(format!("{at}[{i}]: {t} is not a JSON Schema type (one of {})", TYPES.join(", ")));
                    }
                    if ts[..i].contains(t) {
                        return Err(format!("{at}[{i}]: {t} is listed twice"));
                    }
                }
                Ok(())
            }
            _ => bad(format!("{v} is not a JSON Schema type (one of {}, or a list of them)", TYPES.join(", "))),
        },
        "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => match v {
            Value::Object(o) => o.iter().try_for_each(|(name, s)| check(s, &format!("{at}.{name}"))),
            _ => bad(format!("must be an object of schemas, not {}", kind(v))),
        },
        "additionalProperties"
        | "additionalItems"
        | "not"
        | "if"
        | "then"
        | "else"
        | "contains"
        | "propertyNames"
        | "unevaluatedItems"
        | "unevaluatedProperties" => check(v, at),
        // A schema, or (drafts before 2020-12) a list of schemas, one per position.
        "items" => match v {
            Value::Array(a) => a.iter().enumerate().try_for_each(|(i, s)| check(s, &format!("{at}[{i}]"))),
            _ => check(v, at),
        },
        "allOf" | "anyOf" | "oneOf" | "prefixItems" => match v {
            Value::Array(a) if !a.is_empty() => {
                a.iter().enumerate().try_for_each(|(i, s)| check(s, &format!("{at}[{i}]")))
            }
            _ => bad(format!("must be a non-empty list of schemas, not {}", kind(v))),
        },
        "required" => match v {
            Value::Array(a) => {
                for (i, name) in a.iter().enumerate() {
                    if !name.is_string() {
                        return Err(format!("{at}[{i}]: must be a property name (a string), not {}", kind(name)));
                    }
                    if a[..i].contains(name) {
                        return Err(format!("{at}[{i}]: {name} is listed twice"));
                    }
                }
                Ok(())
            }
            // Draft 3 wrote `required: true` inside a property; OpenAI's clients still send it.
            Value::Bool(_) => Ok(()),
            _ => bad(format!("must be a list of property names, not {}", kind(v))),
        },
        "enum" => match v {
            Value::Array(_) => Ok(()),
            _ => bad(format!("must be a list of values, not {}", kind(v))),
        },
        "minimum" | "maximum" => match v {
            Value::Number(_) => Ok(()),
            _ => bad(format!("must be a number, not {}", kind(v))),
        },
        // A number (draft 6 on) or a boolean (draft 4).
        "exclusiveMinimum" | "exclusiveMaximum" => match v {
            Value::Number(_) | Value::Bool(_) => Ok(()),
            _ => bad(format!("must be a number, not {}", kind(v))),
        },
        "multipleOf" => match v.as_f64() {
            Some(x) if x > 0.0 => Ok(()),
            _ => bad(format!("must be a number above 0, not {v}")),
        },
        "minLength" | "maxLength" | "minItems" | "maxItems" | "minProperties" | "maxProperties" | "minContains"
        | "maxContains" => match v.as_u64() {
            Some(_) => Ok(()),
            // 2.0 is an integer to JSON Schema.
            None if v.as_f64().is_some_and(|x| x >= 0.0 && x.fract() == 0.0) => Ok(()),
            None => bad(format!("must be a non-negative integer, not {v}")),
        },
        "uniqueItems" => match v {
            Value::Bool(_) => Ok(()),
            _ => bad(format!("must be a boolean, not {}", kind(v))),
        },
        "pattern" | "format" | "title" | "description" | "$ref" | "$id" | "$schema" | "$anchor" | "$comment"
        | "contentEncoding" | "contentMediaType" => match v {
            Value::String(_) => Ok(()),
            _ => bad(format!("must be a string, not {}", kind(v))),
        },
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schemas_clients_send_pass() {
        for s in [
            json!({}),
            json!({"type": "object", "properties": {"city": {"type": "string", "description": "a city"},
                "days": {"type": ["integer", "null"], "minimum": 1, "maximum": 16},
                "unit": {"enum": ["C", "F"]}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 0},
                "at": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
                "any": true, "x-vendor": {"whatever": [1, 2]}},
                "required": ["city"], "additionalProperties": false, "$defs": {"p": {"type": "number"}}}),
            json!({"type": "object", "properties": {"old": {"type": "number", "exclusiveMinimum": true, "required": true}}}),
            json!({"type": "array", "items": [{"type": "string"}, {"type": "integer"}], "maxItems": 2.0}),
        ] {
            assert_eq!(check(&s, "p"), Ok(()), "{s}");
        }
    }

    #[test]
    fn keywords_of_the_wrong_kind_are_named() {
        for (s, want) in [
            (json!("a string"), "p: a schema must be an object or a boolean, not a string"),
            (json!({"type": "strnig"}), "p.type: \"strnig\" is not a JSON Schema type"),
            (json!({"type": ["string", "string"]}), "p.type[1]: \"string\" is listed twice"),
            (json!({"type": []}), "p.type: [] is not a JSON Schema type"),
            (json!({"properties": {"city": {"type": 5}}}), "p.properties.city.type: 5 is not a JSON Schema type"),
            (json!({"properties": {"city": "string"}}), "p.properties.city: a schema must be an object or a boolean"),
            (json!({"properties": []}), "p.properties: must be an object of schemas, not an array"),
            (json!({"required": "city"}), "p.required: must be a list of property names, not a string"),
            (json!({"required": ["a", 1]}), "p.required[1]: must be a property name"),
            (json!({"items": {"type": "list"}}), "p.items.type: \"list\" is not a JSON Schema type"),
            (json!({"anyOf": []}), "p.anyOf: must be a non-empty list of schemas"),
            (json!({"anyOf": [{"type": "string"}, 3]}), "p.anyOf[1]: a schema must be an object or a boolean"),
            (json!({"enum": "C"}), "p.enum: must be a list of values"),
            (json!({"minimum": "1"}), "p.minimum: must be a number"),
            (json!({"multipleOf": 0}), "p.multipleOf: must be a number above 0"),
            (json!({"minLength": -1}), "p.minLength: must be a non-negative integer"),
            (json!({"maxItems": 1.5}), "p.maxItems: must be a non-negative integer"),
            (json!({"pattern": 3}), "p.pattern: must be a string"),
            (json!({"additionalProperties": "no"}), "p.additionalProperties: a schema must be an object or a boolean"),
        ] {
            let got = check(&s, "p").unwrap_err();
            assert!(got.starts_with(want), "{s}: {got}");
        }
    }
}
