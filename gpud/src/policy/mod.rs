//! Policy: the limits operators set per cgroup and GPU, their validation, and their persistence in
//! the state directory. Owned by the state task; enforcement reads it, the API changes it.
//!
//! A limit is addressed by a cgroup path (relative to the cgroup v2 root) and a GPU selector:
//! `all`, an index, or a UUID. Values are validated here, before anything changes.

pub mod idle;
mod quantity;
mod store;

use std::{collections::BTreeMap, path::PathBuf, str::FromStr};

use serde::{Deserialize, Serialize};

use quantity::truncate;
pub use quantity::{MAX_BYTES, parse_quantity};
pub use store::{LimitStore, StoredLimit};

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "invalid GPU {0:?}: expected \"all\", an index (0, 1, ...) or a UUID (GPU-..., MIG-...)"
    )]
    InvalidGpu(String),
    #[error(
        "unknown limit {0:?} (known: memory_max, compute_max, compute_weight, compute_min, priority)"
    )]
    UnknownLimit(String),
    #[error("limit {name}: {reason}")]
    InvalidValue { name: String, reason: String },
    #[error("no limits given")]
    Empty,
    #[error("limit {0:?} is given more than once (ambiguous: which value is meant?)")]
    Repeated(String),
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

/// Which GPUs a limit applies to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuSelector {
    /// The sum over all GPUs.
    All,
    /// One GPU by index (the RM device instance, as `nvidia-smi` numbers them).
    Index(u32),
    /// One GPU by UUID, resolved to an index where NVML is available.
    Uuid(String),
}

impl FromStr for GpuSelector {
    type Err = PolicyError;
    /// Exact forms only: `all` (any case), an index in decimal digits (no sign or space), or
    /// `GPU-`/`MIG-` and hex digits. Anything else, `" 0"` included, is refused rather than read
    /// as something the caller may not have meant.
    fn from_str(t: &str) -> Result<Self, Self::Err> {
        if t.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        if !t.is_empty() && t.len() <= 3 && t.bytes().all(|b| b.is_ascii_digit()) {
            let i: u32 = t.parse().map_err(|_| PolicyError::InvalidGpu(t.into()))?;
            if i <= gpud_common::nv::NV_GPU_MINOR_MAX {
                return Ok(Self::Index(i));
            }
        }
        let is_uuid = (t.starts_with("GPU-") || t.starts_with("MIG-"))
            && t.len() <= 64
            && t[4..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'/');
        if is_uuid && t.len() > 4 {
            return Ok(Self::Uuid(t.to_owned()));
        }
        Err(PolicyError::InvalidGpu(t.chars().take(80).collect()))
    }
}

impl std::fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Index(i) => write!(f, "{i}"),
            Self::Uuid(u) => f.write_str(u),
        }
    }
}

impl Serialize for GpuSelector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuSelector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Scheduling class of a cgroup's GPU work.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Priority {
    /// Best-effort cgroups on its GPU are throttled as soon as it is active.
    LatencyCritical,
    #[default]
    Normal,
    /// Yields the GPU to latency-critical cgroups.
    BestEffort,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LatencyCritical => "latency-critical",
            Self::Normal => "normal",
            Self::BestEffort => "best-effort",
        }
    }
}

impl FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency-critical" => Ok(Self::LatencyCritical),
            "normal" => Ok(Self::Normal),
            "best-effort" => Ok(Self::BestEffort),
            other => Err(format!(
                "{:?} is not a priority (latency-critical, normal, best-effort)",
                truncate(other)
            )),
        }
    }
}

/// Default `compute_weight`.
pub const DEFAULT_WEIGHT: u32 = 100;

/// The limits of one (cgroup, GPU) pair; `None` is "no limit".
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

    /// Clears one named limit; `false` for an unknown name.
    pub fn clear(&mut self, name: &str) -> bool {
        match name {
            "memory_max" => self.memory_max = None,
            "compute_max" => self.compute_max = None,
            "compute_weight" => self.compute_weight = None,
            "compute_min" => self.compute_min = None,
            "priority" => self.priority = None,
            _ => return false,
        }
        true
    }

    /// Named values, for listing (priority as 0/1/2: latency-critical, normal, best-effort).
    pub fn named(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: Option<u64>| {
            if let Some(v) = v {
                m.insert(k.to_owned(), v);
            }
        };
        put("memory_max", self.memory_max);
        put("compute_max", self.compute_max.map(u64::from));
        put("compute_weight", self.compute_weight.map(u64::from));
        put("compute_min", self.compute_min.map(u64::from));
        put("priority", self.priority.map(|p| p as u64));
        m
    }
}

/// A validated change: values to set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitUpdate {
    pub memory_max: Option<u64>,
    pub compute_max: Option<u32>,
    pub compute_weight: Option<u32>,
    pub compute_min: Option<u32>,
    pub priority: Option<Priority>,
}

impl LimitUpdate {
    /// Validates named values as they arrive from D-Bus (`a{sv}`, in the order sent, repeats
    /// kept), already converted to integers where the type allowed; anything else, a repeated
    /// name included, is a typed error and changes nothing.
    pub fn from_named<'a>(
        values: impl IntoIterator<Item = (&'a String, &'a LimitValueIn)>,
    ) -> Result<Self, PolicyError> {
        // Repeats first: a repeated name is ambiguous whatever its values (the first may be the
        // invalid one).
        let values: Vec<(&String, &LimitValueIn)> = values.into_iter().collect();
        let mut seen = std::collections::BTreeSet::new();
        if let Some((name, _)) = values.iter().find(|(n, _)| !seen.insert(n.as_str())) {
            return Err(PolicyError::Repeated(truncate(name)));
        }
        let mut u = Self::default();
        for (name, v) in values {
            match name.as_str() {
                "memory_max" => u.memory_max = Some(bytes(name, v)?),
                "compute_max" => u.compute_max = Some(number(name, v, 1, 100)?),
                "compute_min" => u.compute_min = Some(number(name, v, 1, 100)?),
                "compute_weight" => u.compute_weight = Some(number(name, v, 1, 10_000)?),
                "priority" => {
                    u.priority = Some(match v {
                        LimitValueIn::Text(t) => {
                            t.parse().map_err(|reason| PolicyError::InvalidValue {
                                name: name.clone(),
                                reason,
                            })?
                        }
                        _ => {
                            return Err(PolicyError::InvalidValue {
                                name: name.clone(),
                                reason: "expected a string: latency-critical, normal, best-effort"
                                    .into(),
                            });
                        }
                    })
                }
                other => return Err(PolicyError::UnknownLimit(other.chars().take(80).collect())),
            }
        }
        if seen.is_empty() {
            return Err(PolicyError::Empty);
        }
        if let (Some(min), Some(max)) = (u.compute_min, u.compute_max)
            && min > max
        {
            return Err(PolicyError::InvalidValue {
                name: "compute_min".into(),
                reason: format!("{min} is above compute_max {max}"),
            });
        }
        Ok(u)
    }

    pub fn apply_to(&self, l: &mut Limits) {
        if let Some(m) = self.memory_max {
            l.memory_max = Some(m);
        }
        if let Some(v) = self.compute_max {
            l.compute_max = Some(v);
        }
        if let Some(v) = self.compute_weight {
            l.compute_weight = Some(v);
        }
        if let Some(v) = self.compute_min {
            l.compute_min = Some(v);
        }
        if let Some(v) = self.priority {
            l.priority = Some(v);
        }
    }
}

/// A limit value as received: the D-Bus layer maps its variants here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitValueIn {
    Unsigned(u64),
    Signed(i64),
    Text(String),
    /// Any other D-Bus type, by signature.
    Other(String),
}

fn bytes(name: &str, v: &LimitValueIn) -> Result<u64, PolicyError> {
    let invalid = |reason: String| PolicyError::InvalidValue {
        name: name.to_owned(),
        reason,
    };
    let n = match v {
        LimitValueIn::Unsigned(n) => *n,
        LimitValueIn::Signed(n) if *n < 0 => return Err(invalid(format!("{n} is negative"))),
        LimitValueIn::Signed(n) => *n as u64,
        LimitValueIn::Text(t) => parse_quantity(t).map_err(invalid)?,
        LimitValueIn::Other(sig) => {
            return Err(invalid(format!(
                "expected bytes as an unsigned integer (t) or a quantity string (s), got type {sig}"
            )));
        }
    };
    if n == 0 {
        return Err(invalid("0 bytes; use ClearLimits to remove a limit".into()));
    }
    if n > MAX_BYTES {
        return Err(invalid(format!("{n} is larger than {MAX_BYTES}")));
    }
    Ok(n)
}

/// A whole number in `lo..=hi` (percent or weight): unsigned, non-negative signed, or a decimal
/// string.
fn number(name: &str, v: &LimitValueIn, lo: u32, hi: u32) -> Result<u32, PolicyError> {
    let invalid = |reason: String| PolicyError::InvalidValue {
        name: name.to_owned(),
        reason,
    };
    let n: i128 = match v {
        LimitValueIn::Unsigned(n) => i128::from(*n),
        LimitValueIn::Signed(n) => i128::from(*n),
        LimitValueIn::Text(t) => t
            .trim()
            .parse::<i128>()
            .map_err(|_| invalid(format!("{:?} is not a whole number", truncate(t))))?,
        LimitValueIn::Other(sig) => {
            return Err(invalid(format!("expected a number, got type {sig}")));
        }
    };
    if n < i128::from(lo) || n > i128::from(hi) {
        return Err(invalid(format!("{n} is outside {lo}..={hi}")));
    }
    Ok(n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selectors() {
        assert_eq!("all".parse::<GpuSelector>().ok(), Some(GpuSelector::All));
        assert_eq!("ALL".parse::<GpuSelector>().ok(), Some(GpuSelector::All));
        assert_eq!("0".parse::<GpuSelector>().ok(), Some(GpuSelector::Index(0)));
        assert_eq!(
            "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42"
                .parse::<GpuSelector>()
                .ok(),
            Some(GpuSelector::Uuid(
                "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42".into()
            ))
        );
        for bad in [
            "",
            "-1",
            "248",
            "99999999999",
            "GPU-",
            "gpu0",
            "GPU-xyz",
            "1.5",
            " 0",
            "0 ",
            "+1",
            " all",
            "GPU-0f0b13fe ",
        ] {
            assert!(bad.parse::<GpuSelector>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn values_are_validated() {
        let one = |v| BTreeMap::from([("memory_max".to_owned(), v)]);
        assert_eq!(
            LimitUpdate::from_named(&one(LimitValueIn::Unsigned(1 << 30)))
                .ok()
                .and_then(|u| u.memory_max),
            Some(1 << 30)
        );
        for bad in [
            LimitValueIn::Unsigned(0),
            LimitValueIn::Signed(-5),
            LimitValueIn::Unsigned(u64::MAX),
            LimitValueIn::Text("lots".into()),
            LimitValueIn::Other("b".into()),
        ] {
            assert!(
                LimitUpdate::from_named(&one(bad.clone())).is_err(),
                "{bad:?}"
            );
        }
        let unknown = BTreeMap::from([("memory_maxx".to_owned(), LimitValueIn::Unsigned(1))]);
        assert!(matches!(
            LimitUpdate::from_named(&unknown),
            Err(PolicyError::UnknownLimit(_))
        ));
        assert!(matches!(
            LimitUpdate::from_named(&BTreeMap::new()),
            Err(PolicyError::Empty)
        ));
        // A repeated name is refused whatever its values: the first may be the invalid one.
        let twice = [
            ("compute_max".to_owned(), LimitValueIn::Unsigned(101)),
            ("compute_max".to_owned(), LimitValueIn::Unsigned(100)),
        ];
        assert!(matches!(
            LimitUpdate::from_named(twice.iter().map(|(k, v)| (k, v))),
            Err(PolicyError::Repeated(n)) if n == "compute_max"
        ));
    }
}

/// Fuzz targets (`cargo xtask fuzz`): GPU selectors and named limit values as they arrive from
/// D-Bus callers and annotations.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    fn value_in() -> impl Strategy<Value = LimitValueIn> {
        prop_oneof![
            any::<u64>().prop_map(LimitValueIn::Unsigned),
            any::<i64>().prop_map(LimitValueIn::Signed),
            "\\PC{0,30}".prop_map(LimitValueIn::Text),
            "[0-9]{1,22}(Ki|Mi|Gi|Ti|k|M|G|T)?".prop_map(LimitValueIn::Text),
            "[a-z()]{0,4}".prop_map(LimitValueIn::Other),
        ]
    }

    proptest! {
        /// Any text is a selector or `InvalidGpu`; an accepted one prints as text that parses
        /// back to it.
        #[test]
        fn any_gpu_selector_round_trips_or_is_invalid(text in prop_oneof![
            "(?s).{0,70}",
            "(GPU|MIG|gpu)-[0-9a-fA-F/-]{0,64}",
            "[ ]?[0-9]{1,4}[ ]?",
            "[aA][lL][lL]",
        ]) {
            match text.parse::<GpuSelector>() {
                Ok(sel) => {
                    let printed = sel.to_string();
                    prop_assert_eq!(printed.parse::<GpuSelector>().ok(), Some(sel.clone()));
                    if let GpuSelector::Index(i) = sel {
                        prop_assert!(i <= gpud_common::nv::NV_GPU_MINOR_MAX);
                    }
                }
                Err(e) => prop_assert!(matches!(e, PolicyError::InvalidGpu(_)), "{e:?}"),
            }
        }

        /// Every GPU index the driver can have round-trips; the next one is refused.
        #[test]
        fn gpu_indexes_round_trip(i in 0u32..=gpud_common::nv::NV_GPU_MINOR_MAX + 8) {
            let sel = i.to_string().parse::<GpuSelector>();
            if i <= gpud_common::nv::NV_GPU_MINOR_MAX {
                prop_assert_eq!(sel.ok(), Some(GpuSelector::Index(i)));
            } else {
                prop_assert!(sel.is_err());
            }
        }

        /// Named values of any name, type and content are an update within range or a typed
        /// error; an update carries exactly the values given.
        #[test]
        fn any_named_values_are_validated(values in proptest::collection::btree_map(
            prop_oneof![
                Just("memory_max".to_owned()),
                Just("compute_max".to_owned()),
                Just("compute_min".to_owned()),
                Just("compute_weight".to_owned()),
                Just("priority".to_owned()),
                "\\PC{0,12}",
            ],
            value_in(),
            0..6,
        )) {
            match LimitUpdate::from_named(&values) {
                Ok(u) => {
                    prop_assert!(u.memory_max.is_none_or(|m| (1..=MAX_BYTES).contains(&m)));
                    prop_assert!(u.compute_max.is_none_or(|m| (1..=100).contains(&m)));
                    prop_assert!(u.compute_min.is_none_or(|m| (1..=100).contains(&m)));
                    prop_assert!(u.compute_weight.is_none_or(|m| (1..=10_000).contains(&m)));
                    if let (Some(min), Some(max)) = (u.compute_min, u.compute_max) {
                        prop_assert!(min <= max);
                    }
                    let given = [
                        u.memory_max.is_some(),
                        u.compute_max.is_some(),
                        u.compute_min.is_some(),
                        u.compute_weight.is_some(),
                        u.priority.is_some(),
                    ];
                    prop_assert_eq!(given.iter().filter(|g| **g).count(), values.len());
                }
                Err(e) => prop_assert!(!matches!(e, PolicyError::Write { .. }), "{e:?}"),
            }
        }
    }
}
