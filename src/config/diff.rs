//! What differs between two run configurations, field by field: what `--resume` and the ranks of
//! a distributed run check before they agree to continue.

use super::RunConfig;

/// Every difference between two configurations, in field order, as (field, A, B): the field a
/// dotted path (`model.quant.modules.h.0.mlp.c_fc.bits`), the values as JSON. An object on one
/// side and anything else on the other is one difference at the object's path.
pub fn differences(a: &RunConfig, b: &RunConfig) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    if let (Ok(va), Ok(vb)) = (serde_json::to_value(a), serde_json::to_value(b)) {
        diff_values("", &va, &vb, &mut out);
    }
    out
}

/// The first of `differences`, or None when the configurations are equal.
pub fn first_difference(a: &RunConfig, b: &RunConfig) -> Option<(String, String, String)> {
    differences(a, b).into_iter().next()
}

fn diff_values(at: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<(String, String, String)>) {
    use serde_json::Value;
    let join = |k: &str| if at.is_empty() { k.to_string() } else { format!("{at}.{k}") };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                diff_values(&join(k), x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), out);
            }
        }
        _ if a == b => {}
        _ => out.push((at.to_string(), a.to_string(), b.to_string())),
    }
}
