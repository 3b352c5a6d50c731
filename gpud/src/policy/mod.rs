//! Policy: the limits operators set per cgroup and GPU, and their persistence in the state
//! directory. Owned by the state task; enforcement reads it, the API changes it.
//!
//! A limit is addressed by a cgroup path (relative to the cgroup v2 root) and a GPU selector:
//! `all`, an index, or a UUID. What limits exist, their names, value types and ranges, and how
//! values are decoded from D-Bus are gpud-api's limit schema ([`gpud_api::limits`]); this module
//! keeps what is in force ([`Limits`], one per cgroup and GPU) and stores it ([`LimitStore`]).

pub mod idle;
mod policies;
mod store;
pub mod workloads;

use std::{collections::BTreeMap, path::PathBuf};

use gpud_api::limits::{InvalidGpu, LimitKind, LimitSet, LimitValue, dbus_names};
use serde::{Deserialize, Serialize};

pub use gpud_api::limits::{GpuSelector, Priority};
pub use policies::{GpuCatalog, LimitEntry, PolicyStore};
pub use store::{LimitStore, StoredLimit};

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(transparent)]
    InvalidGpu(#[from] InvalidGpu),
    #[error("unknown limit {0:?} (known: {known})", known = dbus_names())]
    UnknownLimit(String),
    #[error("limit {name}: {reason}")]
    InvalidValue { name: String, reason: String },
    #[error("unknown GPU {0}: {1}")]
    UnknownGpu(String, String),
    /// NVML is off by configuration: a UUID can never be resolved to a GPU.
    #[error(
        "GPU {selector} cannot be resolved: NVML is disabled ([nvml] enabled = false); a limit \
         by UUID needs it, use the GPU's index or `all`"
    )]
    NoInventory { selector: String },
    /// One card under two selectors (an index and a UUID) on one cgroup: which limit holds?
    #[error(
        "GPU {selector} is GPU {index}, which this cgroup already has limits for as `{other}`: \
         change them through `{other}`, or clear those first"
    )]
    SameGpu {
        selector: String,
        index: u32,
        other: String,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "stored limits in {path} are unusable ({reason}); fix or remove the file, or set \
         [daemon] on_corrupt_state = \"start-empty\" to start without them"
    )]
    CorruptState { path: PathBuf, reason: String },
    #[error(
        "state directory {path} is not usable (gpud keeps its limits there: make it a writable \
         directory or point [daemon] state_dir elsewhere)"
    )]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub use gpud_api::limits::DEFAULT_WEIGHT;

/// The limits of one (cgroup, GPU) pair; `None` is "no limit". Stored in `limits.json` under the
/// schema's D-Bus names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// Cap in percent of one GPU's time (1–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_max: Option<u32>,
    /// Share of contended GPU time (1–10000; 100 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_weight: Option<u32>,
    /// Guaranteed percent of one GPU's time (1–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_min: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        self.memory_max.is_none() && !self.has_compute()
    }

    pub fn has_compute(&self) -> bool {
        self.compute_max.is_some()
            || self.compute_weight.is_some()
            || self.compute_min.is_some()
            || self.priority.is_some()
    }

    /// The value of one limit.
    pub fn get(&self, kind: LimitKind) -> Option<LimitValue> {
        let number = |n: Option<u32>| n.map(|n| LimitValue::Number(u64::from(n)));
        match kind {
            LimitKind::MemoryMax => self.memory_max.map(LimitValue::Number),
            LimitKind::ComputeMax => number(self.compute_max),
            LimitKind::ComputeMin => number(self.compute_min),
            LimitKind::ComputeWeight => number(self.compute_weight),
            LimitKind::Priority => self.priority.map(LimitValue::Priority),
        }
    }

    /// Sets one limit from a value the schema checked (a number where a priority belongs, or
    /// the reverse, clears it; numbers above `u32` saturate, which no checked value reaches).
    pub fn set(&mut self, kind: LimitKind, value: &LimitValue) {
        let number = || value.number().map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        match kind {
            LimitKind::MemoryMax => self.memory_max = value.number(),
            LimitKind::ComputeMax => self.compute_max = number(),
            LimitKind::ComputeMin => self.compute_min = number(),
            LimitKind::ComputeWeight => self.compute_weight = number(),
            LimitKind::Priority => self.priority = value.priority(),
        }
    }

    /// Clears one limit named by its D-Bus name; `false` for an unknown name.
    pub fn clear(&mut self, name: &str) -> bool {
        let Some(kind) = LimitKind::from_dbus_name(name) else {
            return false;
        };
        match kind {
            LimitKind::MemoryMax => self.memory_max = None,
            LimitKind::ComputeMax => self.compute_max = None,
            LimitKind::ComputeMin => self.compute_min = None,
            LimitKind::ComputeWeight => self.compute_weight = None,
            LimitKind::Priority => self.priority = None,
        }
        true
    }

    /// Named values, for listing (priority as 0/1/2: latency-critical, normal, best-effort).
    pub fn named(&self) -> BTreeMap<String, u64> {
        LimitKind::iter()
            .filter_map(|k| Some((k.dbus_name().to_owned(), self.get(k)?.listed())))
            .collect()
    }
}

/// A validated change: the values to set, decoded and checked by the schema
/// ([`gpud_api::limits::LimitDict`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitUpdate(pub LimitSet);

impl From<LimitSet> for LimitUpdate {
    fn from(set: LimitSet) -> Self {
        Self(set)
    }
}

impl LimitUpdate {
    /// Whether it sets a limit of `kind` (what a change is routed by).
    pub fn touches(&self, kind: LimitKind) -> bool {
        self.0.get(kind).is_some()
    }

    pub fn apply_to(&self, l: &mut Limits) {
        for (kind, value) in self.0.iter() {
            l.set(kind, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use gpud_api::limits::MAX_GPU_INDEX;

    use super::*;

    #[test]
    fn the_schemas_gpu_indexes_are_the_drivers() {
        assert_eq!(MAX_GPU_INDEX, gpud_common::nv::NV_GPU_MINOR_MAX);
    }

    #[test]
    fn every_limit_is_set_listed_and_cleared_by_its_schema_name() {
        let values = [
            (LimitKind::MemoryMax, LimitValue::Number(1 << 30)),
            (LimitKind::ComputeMax, LimitValue::Number(30)),
            (LimitKind::ComputeMin, LimitValue::Number(20)),
            (LimitKind::ComputeWeight, LimitValue::Number(300)),
            (
                LimitKind::Priority,
                LimitValue::Priority(Priority::BestEffort),
            ),
        ];
        let mut set = LimitSet::new();
        for (kind, value) in values.clone() {
            assert!(set.insert(kind, value).is_ok(), "{kind}");
        }
        let mut l = Limits::default();
        LimitUpdate::from(set).apply_to(&mut l);
        for (kind, value) in &values {
            assert_eq!(l.get(*kind).as_ref(), Some(value), "{kind}");
        }
        assert_eq!(l.priority, Some(Priority::BestEffort));
        assert_eq!(l.compute_weight, Some(300));
        let named = l.named();
        assert_eq!(named.len(), LimitKind::iter().count());
        assert_eq!(named.get("priority"), Some(&2));
        assert_eq!(named.get("memory_max"), Some(&(1 << 30)));
        for kind in LimitKind::iter() {
            assert!(l.clear(kind.dbus_name()), "{kind}");
        }
        assert!(l.is_empty());
        assert!(!l.clear("memory-max"));
    }

    #[test]
    fn stored_names_are_the_schemas() {
        let l = Limits {
            memory_max: Some(1),
            compute_max: Some(2),
            compute_weight: Some(3),
            compute_min: Some(1),
            priority: Some(Priority::LatencyCritical),
        };
        let json = serde_json::to_value(&l).unwrap_or_default();
        let keys: Vec<&str> = json
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        let mut want: Vec<&str> = LimitKind::iter().map(|k| k.dbus_name()).collect();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(json["priority"], "latency-critical");
    }
}
