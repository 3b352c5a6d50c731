//! What the real API server's validation refuses of the objects the test server stores (a
//! subset of k8s.io/kubernetes pkg/apis/resource/validation for ResourceSlices: names, the pool,
//! node selection, device names, attributes, capacities, taints, the immutable fields), and the
//! defaults it fills in (a taint's `timeAdded`).

use hyper::StatusCode;
use serde_json::{Value, json};

use super::{Failure, GROUP, Kind};

/// A 422 Invalid Status listing the field errors.
pub(super) fn invalid(kind: &Kind, name: &str, errors: &[(String, String)]) -> Failure {
    let list: Vec<String> = errors.iter().map(|(f, m)| format!("{f}: {m}")).collect();
    let causes: Vec<Value> = errors
        .iter()
        .map(|(f, m)| json!({ "reason": "FieldValueInvalid", "message": m, "field": f }))
        .collect();
    Failure {
        details: Some(json!({ "name": name, "group": GROUP, "kind": kind.kind, "causes": causes })),
        ..Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "{}.{GROUP} \"{name}\" is invalid: [{}]",
                kind.kind,
                list.join(", ")
            ),
        )
    }
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(dns_label)
}

/// A label value: at most 63 characters, alphanumerics with `-_.` inside.
fn label_value(s: &str) -> bool {
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

/// A qualified name: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters.
fn qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(dns_subdomain) && !name.is_empty() && label_value(name)
}

/// A resource.Quantity's string form (`16Gi`, `100`, `1.5`, `500m`, `1e3`).
fn quantity(v: &Value) -> bool {
    let Some(s) = v.as_str() else { return false };
    let digits = s.trim_start_matches(['+', '-']);
    let end = digits
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(digits.len());
    let (number, suffix) = digits.split_at(end);
    let exponent = suffix
        .strip_prefix(['e', 'E'])
        .is_some_and(|e| e.trim_start_matches(['+', '-']).parse::<u32>().is_ok());
    !number.is_empty()
        && number.parse::<f64>().is_ok()
        && (exponent
            || [
                "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
            ]
            .contains(&suffix))
}

/// Refuses `obj` (named `name`) as the real validation would, on create (`old` None) or update.
pub(super) fn object(
    kind: &Kind,
    name: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Result<(), Failure> {
    let mut errs: Vec<(String, String)> = Vec::new();
    if !dns_subdomain(name) {
        errs.push((
            "metadata.name".into(),
            format!("Invalid value: {name:?}: a lowercase RFC 1123 subdomain"),
        ));
    }
    if !obj["spec"].is_object() {
        errs.push(("spec".into(), "Required value".into()));
    } else if kind.kind == "ResourceSlice" {
        slice_spec(&obj["spec"], &mut errs);
        if let Some(old) = old {
            for (field, path) in [
                ("spec.driver", &["driver"][..]),
                ("spec.nodeName", &["nodeName"][..]),
                ("spec.pool.name", &["pool", "name"][..]),
            ] {
                let get = |v: &Value| path.iter().fold(v["spec"].clone(), |v, k| v[*k].clone());
                if get(obj) != get(old) {
                    errs.push((field.into(), "Invalid value: field is immutable".into()));
                }
            }
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(invalid(kind, name, &errs))
    }
}

fn slice_spec(spec: &Value, errs: &mut Vec<(String, String)>) {
    let mut err = |f: String, m: String| errs.push((f, m));
    let driver = spec["driver"].as_str().unwrap_or_default();
    if driver.is_empty() || driver.len() > 63 || !dns_subdomain(driver) {
        err(
            "spec.driver".into(),
            format!("Invalid value: {driver:?}: a DNS subdomain of at most 63 characters"),
        );
    }
    let pool = &spec["pool"];
    if pool["name"].as_str().is_none_or(str::is_empty) {
        err("spec.pool.name".into(), "Required value".into());
    }
    if pool["generation"].as_i64().is_none_or(|g| g < 0) {
        err(
            "spec.pool.generation".into(),
            "Invalid value: must be an integer of at least 0".into(),
        );
    }
    if pool["resourceSliceCount"].as_i64().is_none_or(|c| c <= 0) {
        err(
            "spec.pool.resourceSliceCount".into(),
            "Invalid value: must be greater than zero".into(),
        );
    }
    let selections = [
        spec["nodeName"].as_str().is_some_and(|n| !n.is_empty()),
        !spec["nodeSelector"].is_null(),
        spec["allNodes"] == true,
        spec["perDeviceNodeSelection"] == true,
    ];
    if selections.iter().filter(|s| **s).count() != 1 {
        err(
            "spec".into(),
            "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required".into(),
        );
    }
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    let tainted = devices
        .iter()
        .any(|d| d["taints"].as_array().is_some_and(|t| !t.is_empty()));
    let max = if tainted { 64 } else { 128 };
    if devices.len() > max {
        err(
            "spec.devices".into(),
            format!("Too many: {}: must have at most {max} items", devices.len()),
        );
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, d) in devices.iter().enumerate() {
        let f = format!("spec.devices[{i}]");
        let name = d["name"].as_str().unwrap_or_default();
        if !dns_label(name) {
            err(
                format!("{f}.name"),
                format!("Invalid value: {name:?}: a DNS label"),
            );
        } else if !names.insert(name.to_owned()) {
            err(format!("{f}.name"), format!("Duplicate value: {name:?}"));
        }
        let attrs = d["attributes"].as_object().cloned().unwrap_or_default();
        let caps = d["capacity"].as_object().cloned().unwrap_or_default();
        if attrs.len() + caps.len() > 32 {
            err(
                f.clone(),
                "Too many: attributes and capacities together must have at most 32 items".into(),
            );
        }
        for (k, a) in &attrs {
            let set = ["int", "bool", "string", "version"]
                .iter()
                .filter(|t| !a[**t].is_null())
                .count();
            if !qualified_name(k) || set != 1 {
                err(
                    format!("{f}.attributes[{k}]"),
                    "Invalid value: exactly one value must be specified".into(),
                );
            }
        }
        for (k, c) in &caps {
            if !qualified_name(k) || !quantity(&c["value"]) {
                err(
                    format!("{f}.capacity[{k}].value"),
                    format!("Invalid value: {}: not a quantity", c["value"]),
                );
            }
        }
        let taints = d["taints"].as_array().cloned().unwrap_or_default();
        if taints.len() > 16 {
            err(
                format!("{f}.taints"),
                "Too many: must have at most 16 items".into(),
            );
        }
        for (j, t) in taints.iter().enumerate() {
            let tf = format!("{f}.taints[{j}]");
            if !t["key"].as_str().is_some_and(qualified_name) {
                err(
                    format!("{tf}.key"),
                    "Invalid value: a qualified name".into(),
                );
            }
            if !t["value"].is_null() && !t["value"].as_str().is_some_and(label_value) {
                err(format!("{tf}.value"), "Invalid value: a label value".into());
            }
            let effect = t["effect"].as_str().unwrap_or_default();
            if !["NoSchedule", "NoExecute"].contains(&effect) {
                err(
                    format!("{tf}.effect"),
                    format!(
                        "Unsupported value: {effect:?}: supported values: \"NoExecute\", \"NoSchedule\""
                    ),
                );
            }
        }
    }
}

/// Sets `timeAdded` on each device taint that has none, as the API server does on create and
/// update.
pub(super) fn default_taint_times(obj: &mut Value) {
    let Some(devices) = obj["spec"]["devices"].as_array_mut() else {
        return;
    };
    for t in devices
        .iter_mut()
        .filter_map(|d| d["taints"].as_array_mut())
        .flatten()
    {
        if t["timeAdded"].is_null() {
            t["timeAdded"] = "2026-01-01T00:00:00Z".into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_quantities_follow_the_api_rules() {
        assert!(dns_label("gpu-0") && !dns_label("GPU-0") && !dns_label("-a"));
        assert!(qualified_name("gpu.gpud.dev/unhealthy") && !qualified_name("a/b/c"));
        for q in ["16Gi", "100", "1.5", "500m", "1e3"] {
            assert!(quantity(&json!(q)), "{q}");
        }
        for q in ["", "Gi", "16GB", "x"] {
            assert!(!quantity(&json!(q)), "{q}");
        }
        assert!(!quantity(&json!(100)), "a number, not a string");
    }
}
