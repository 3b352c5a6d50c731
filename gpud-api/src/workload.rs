//! The names of the Kubernetes workload a cgroup runs (`SetWorkload`, `CgroupRecord::workload`):
//! which keys there are and what a value may be. They label the cgroup's metrics and listings;
//! no limit depends on them.

use std::collections::BTreeMap;

/// The namespace of the pod.
pub const NAMESPACE: &str = "namespace";
/// The pod's name.
pub const POD: &str = "pod";
/// The container's name (absent for a pod's own cgroup).
pub const CONTAINER: &str = "container";
/// Every key a workload may carry, in the order metrics labels list them.
pub const KEYS: [&str; 3] = [NAMESPACE, POD, CONTAINER];

/// The longest name accepted: a DNS subdomain's, the longest Kubernetes object name.
pub const MAX_LEN: usize = 253;

/// Checks a workload's names: known keys only, each value 1 to [`MAX_LEN`] bytes without
/// control characters. An empty map is valid (it clears the cgroup's names).
pub fn check(names: &BTreeMap<String, String>) -> Result<(), String> {
    for (k, v) in names {
        if !KEYS.contains(&k.as_str()) {
            return Err(format!(
                "unknown workload key {k:?} (known: {})",
                KEYS.join(", ")
            ));
        }
        if v.is_empty() || v.len() > MAX_LEN {
            return Err(format!(
                "workload {k} must be 1 to {MAX_LEN} bytes, not {}",
                v.len()
            ));
        }
        if v.chars().any(char::is_control) {
            return Err(format!("workload {k} {v:?} has control characters"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn known_keys_with_printable_names_pass() {
        assert_eq!(check(&names(&[])), Ok(()));
        let full = names(&[
            ("namespace", "ml"),
            ("pod", "train-0"),
            ("container", "main"),
        ]);
        assert_eq!(check(&full), Ok(()));
    }

    #[test]
    fn unknown_keys_empty_long_and_control_characters_are_refused() {
        for bad in [
            names(&[("node", "n1")]),
            names(&[("pod", "")]),
            names(&[("pod", &"p".repeat(MAX_LEN + 1))]),
            names(&[("container", "a\nb")]),
        ] {
            assert!(check(&bad).is_err(), "{bad:?}");
        }
    }
}
