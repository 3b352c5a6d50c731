//! Policy: the limits operators set per cgroup and GPU, their validation, and their persistence in
//! the state directory. Owned by the state task; enforcement reads it, the API changes it.
//!
//! A limit is addressed by a cgroup path (relative to the cgroup v2 root) and a GPU selector:
//! `all`, an index, or a UUID. Values are validated here, before anything changes.

pub mod idle;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    str::FromStr,
};

use serde::{Deserialize, Serialize};
use tracing::info;

/// Largest accepted byte value: far above any GPU, and far from overflowing when usage is added.
pub const MAX_BYTES: u64 = 1 << 60;

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
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "stored limits in {path} are unusable ({reason}); fix or remove the file, or set \
         [daemon] on_corrupt_state = \"start-empty\" to start without them"
    )]
    CorruptState { path: PathBuf, reason: String },
    #[error(
        "state directory {path} is not usable ({source}); gpud keeps its limits there: make it a \
         writable directory or point [daemon] state_dir elsewhere"
    )]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What to do with a stored limits file that cannot be read back (`[daemon] on_corrupt_state`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CorruptState {
    /// Keep it aside and start with no limits rather than wrong ones.
    #[default]
    StartEmpty,
    /// Refuse to start until a person looks at it.
    Refuse,
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
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        if !t.is_empty() && t.len() <= 3 && t.bytes().all(|b| b.is_ascii_digit()) {
            let i: u32 = t.parse().map_err(|_| PolicyError::InvalidGpu(s.into()))?;
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
        Err(PolicyError::InvalidGpu(s.chars().take(80).collect()))
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
    /// Validates named values as they arrive from D-Bus (`a{sv}`), already converted to
    /// integers where the type allowed; anything else is a typed error and changes nothing.
    pub fn from_named(values: &BTreeMap<String, LimitValueIn>) -> Result<Self, PolicyError> {
        if values.is_empty() {
            return Err(PolicyError::Empty);
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

/// Parses a byte quantity: plain bytes or a Kubernetes-style suffix (Ki, Mi, Gi, Ti; k, M, G, T).
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!("{:?} is not a byte quantity", truncate(text)));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{:?} is too large", truncate(text)))?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown suffix {:?} in {:?} (use Ki, Mi, Gi, Ti, k, M, G, T)",
                truncate(other),
                truncate(text)
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{:?} is too large", truncate(text)))
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// One stored entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredLimit {
    pub cgroup: String,
    pub gpu: GpuSelector,
    #[serde(flatten)]
    pub limits: Limits,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    version: u32,
    limits: Vec<StoredLimit>,
}

const STATE_VERSION: u32 = 1;

/// The limits in force, persisted to `<state_dir>/limits.json` on every change.
#[derive(Debug)]
pub struct LimitStore {
    path: PathBuf,
    entries: BTreeMap<(String, GpuSelector), Limits>,
}

impl LimitStore {
    pub const FILE: &'static str = "limits.json";

    /// Makes sure `state_dir` exists and takes files: a limit set later must not fail to persist
    /// because of a mistake that start-up could have shown.
    pub fn check_dir(state_dir: &Path) -> Result<(), PolicyError> {
        let err = |source| PolicyError::StateDir {
            path: state_dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(err)?;
        let probe = state_dir.join(".gpud-write-test");
        std::fs::write(&probe, b"").map_err(err)?;
        std::fs::remove_file(&probe).map_err(err)
    }

    /// Loads the store. A missing file is an empty store. An unreadable or corrupt one (bad
    /// JSON, another schema, an unsupported version) is, with [`CorruptState::StartEmpty`],
    /// moved aside (`limits.json.corrupt-<unix time>`) with an error log, and the daemon starts
    /// with no limits rather than wrong ones; with [`CorruptState::Refuse`] it is left in place
    /// and the load fails.
    pub fn load(state_dir: &Path, on_corrupt: CorruptState) -> Result<Self, PolicyError> {
        let path = state_dir.join(Self::FILE);
        let mut store = Self {
            path: path.clone(),
            entries: BTreeMap::new(),
        };
        let corrupt = |reason: String| -> Result<Self, PolicyError> {
            match on_corrupt {
                CorruptState::Refuse => Err(PolicyError::CorruptState {
                    path: path.clone(),
                    reason,
                }),
                CorruptState::StartEmpty => {
                    set_aside(&path, &reason);
                    Ok(Self {
                        path: path.clone(),
                        entries: BTreeMap::new(),
                    })
                }
            }
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(store),
            Err(e) => return corrupt(format!("cannot read it: {e}")),
        };
        match serde_json::from_str::<StateFile>(&text) {
            Ok(f) if f.version == STATE_VERSION => {
                for l in f.limits {
                    if !l.limits.is_empty() {
                        store.entries.insert((l.cgroup, l.gpu), l.limits);
                    }
                }
                info!(path = %path.display(), limits = store.entries.len(), "limits restored");
                Ok(store)
            }
            Ok(f) => corrupt(format!("unsupported version {}", f.version)),
            Err(e) => corrupt(e.to_string()),
        }
    }

    pub fn get(&self, cgroup: &str, gpu: &GpuSelector) -> Option<&Limits> {
        self.entries.get(&(cgroup.to_owned(), gpu.clone()))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&(String, GpuSelector), &Limits)> {
        self.entries.iter()
    }

    /// Replaces the whole set (after a change was validated and applied) and persists it; on a
    /// write error the previous set stays in force.
    pub fn replace(
        &mut self,
        entries: BTreeMap<(String, GpuSelector), Limits>,
    ) -> Result<(), PolicyError> {
        let entries: BTreeMap<_, _> = entries.into_iter().filter(|(_, l)| !l.is_empty()).collect();
        write_state(&self.path, &entries)?;
        self.entries = entries;
        Ok(())
    }

    pub fn entries(&self) -> &BTreeMap<(String, GpuSelector), Limits> {
        &self.entries
    }
}

fn set_aside(path: &Path, reason: &str) {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let aside = path.with_extension(format!("json.corrupt-{stamp}"));
    match std::fs::rename(path, &aside) {
        Ok(()) => tracing::error!(
            path = %path.display(), kept = %aside.display(),
            "stored limits are corrupt ({reason}); kept aside, starting with no limits"
        ),
        Err(e) => tracing::error!(
            path = %path.display(),
            "stored limits are corrupt ({reason}) and cannot be moved aside ({e}); starting with no limits"
        ),
    }
}

/// Writes atomically: a temporary file in the same directory, fsynced, then renamed.
fn write_state(
    path: &Path,
    entries: &BTreeMap<(String, GpuSelector), Limits>,
) -> Result<(), PolicyError> {
    use std::io::Write as _;
    let werr = |source| PolicyError::Write {
        path: path.to_owned(),
        source,
    };
    let file = StateFile {
        version: STATE_VERSION,
        limits: entries
            .iter()
            .map(|((cgroup, gpu), limits)| StoredLimit {
                cgroup: cgroup.clone(),
                gpu: gpu.clone(),
                limits: limits.clone(),
            })
            .collect(),
    };
    let text = serde_json::to_string_pretty(&file).map_err(|e| werr(std::io::Error::other(e)))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(werr)?;
    }
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(werr)?;
    f.write_all(text.as_bytes()).map_err(werr)?;
    f.write_all(b"\n").map_err(werr)?;
    f.sync_all().map_err(werr)?;
    std::fs::rename(&tmp, path).map_err(werr)
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
        ] {
            assert!(bad.parse::<GpuSelector>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("8Gi"), Ok(8 << 30));
        assert_eq!(parse_quantity("512Mi"), Ok(512 << 20));
        assert_eq!(parse_quantity("1000"), Ok(1000));
        assert_eq!(parse_quantity("2G"), Ok(2_000_000_000));
        for bad in [
            "",
            "Gi",
            "8 GiB",
            "-1",
            "1.5Gi",
            "99999999999999999999",
            "16384Ti0",
        ] {
            assert!(parse_quantity(bad).is_err(), "{bad:?}");
        }
        assert!(parse_quantity("17179869184Ti").is_err(), "overflow");
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
    }

    #[test]
    fn store_round_trips_and_sets_corrupt_files_aside() -> Result<(), PolicyError> {
        let dir = std::env::temp_dir().join(format!("gpud-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = LimitStore::load(&dir, CorruptState::StartEmpty)?;
        assert!(s.entries().is_empty());
        let mut e = BTreeMap::new();
        e.insert(
            ("/a".to_owned(), GpuSelector::All),
            Limits {
                memory_max: Some(42),
                compute_max: Some(30),
                priority: Some(Priority::BestEffort),
                ..Limits::default()
            },
        );
        s.replace(e.clone())?;
        assert_eq!(
            LimitStore::load(&dir, CorruptState::StartEmpty)?.entries(),
            &e
        );
        std::fs::write(dir.join(LimitStore::FILE), "{ not json").map_err(|source| {
            PolicyError::Write {
                path: dir.clone(),
                source,
            }
        })?;
        assert!(matches!(
            LimitStore::load(&dir, CorruptState::Refuse),
            Err(PolicyError::CorruptState { .. })
        ));
        assert!(
            dir.join(LimitStore::FILE).exists(),
            "refuse leaves it in place"
        );
        assert!(
            LimitStore::load(&dir, CorruptState::StartEmpty)?
                .entries()
                .is_empty()
        );
        assert!(!dir.join(LimitStore::FILE).exists(), "moved aside");
        let aside = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .any(|f| f.file_name().to_string_lossy().contains("corrupt"))
            })
            .unwrap_or(false);
        assert!(aside, "corrupt file kept aside");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}

/// Fuzz targets (`cargo xtask fuzz`): quantities, GPU selectors and named limit values as they
/// arrive from D-Bus callers and annotations.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    const SUFFIXES: [(&str, u64); 9] = [
        ("", 1),
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];

    /// `bytes` in the largest unit that divides it, as a person would write it.
    fn format_quantity(bytes: u64) -> String {
        SUFFIXES
            .iter()
            .rev()
            .filter(|(_, m)| bytes != 0 && bytes.is_multiple_of(*m))
            .max_by_key(|(_, m)| *m)
            .map_or_else(|| bytes.to_string(), |(s, m)| format!("{}{s}", bytes / m))
    }

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
        /// Any text is a byte count or a message; nothing panics.
        #[test]
        fn any_quantity_text_never_panics(text in "(?s).{0,64}") {
            if let Ok(n) = parse_quantity(&text) {
                let t = text.trim();
                prop_assert!(t.starts_with(|c: char| c.is_ascii_digit()), "{text:?} -> {n}");
            }
        }

        /// Number and suffix give their exact product, or an error where it overflows (never a
        /// wrapped value).
        #[test]
        fn quantities_multiply_exactly_or_overflow(n in any::<u64>(), s in 0usize..SUFFIXES.len(), pad in "[ \t]{0,2}") {
            let (suffix, mult) = SUFFIXES[s];
            let got = parse_quantity(&format!("{pad}{n}{suffix}{pad}"));
            match n.checked_mul(mult) {
                Some(want) => prop_assert_eq!(got, Ok(want)),
                None => prop_assert!(got.is_err_and(|e| e.contains("too large"))),
            }
        }

        /// A formatted quantity parses back to the same bytes.
        #[test]
        fn formatted_quantities_round_trip(bytes in prop_oneof![
            any::<u64>(),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n) << (10 * p)),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n).saturating_mul(1000u64.pow(p))),
        ]) {
            let text = format_quantity(bytes);
            prop_assert_eq!(parse_quantity(&text), Ok(bytes), "{}", text);
        }

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
