//! The limit schema, defined once: the limits a cgroup can have on a GPU, their names in the
//! D-Bus API (`SetLimits`' dictionary, `ClearLimits`, `ListLimits`) and in container annotations
//! (`gpud.dev/<annotation>`), what their values are and the ranges they must be in, how a value
//! is read from text (annotations, gpudctl's flags, D-Bus strings: [`LimitKind::parse`]) or from a
//! D-Bus value ([`LimitKind::decode`], the whole dictionary with [`LimitDict`]), how it is written
//! back ([`LimitKind::render`], [`to_dict`]), and the GPU selectors limits are addressed by
//! ([`GpuSelector`]).
//!
//! | kind | D-Bus name | annotation | value |
//! | --- | --- | --- | --- |
//! | [`LimitKind::MemoryMax`] | `memory_max` | `memory-max` | bytes, 1 to [`MAX_BYTES`]; text is a quantity (`8Gi`) |
//! | [`LimitKind::ComputeMax`] | `compute_max` | `compute-max` | percent of one GPU's time, 1–100 |
//! | [`LimitKind::ComputeMin`] | `compute_min` | `compute-min` | guaranteed percent, 1–100 |
//! | [`LimitKind::ComputeWeight`] | `compute_weight` | `compute-weight` | share of contended time, 1–10000 |
//! | [`LimitKind::Priority`] | `priority` | `priority` | [`Priority`] by name |
//!
//! Everything that names, parses or writes a limit uses this module: the daemon (its policy
//! stores the values decoded here, its D-Bus handler decodes `a{sv}` with [`LimitDict`]), gpudctl
//! (its `set` flags are [`LimitKind::ALL`]), the annotation parser of the NRI plugin and the OCI
//! hook (gpud-runtime) and gpud-k8s. docs/dbus-api.md's limit table is checked against it by a
//! test (gpud-api/tests/dbus_doc.rs).

mod dict;
mod gpu;
mod quantity;

use std::{collections::BTreeMap, fmt, str::FromStr};

use serde::{Deserialize, Serialize};

pub use dict::{LimitDict, to_dict};
pub use gpu::{GpuSelector, InvalidGpu, MAX_GPU_INDEX};
pub use quantity::{MAX_BYTES, QuantityError, parse_quantity, render_quantity};

use quantity::truncate;

/// The `compute_weight` of a cgroup that has none: the share of contended time it gets against
/// others.
pub const DEFAULT_WEIGHT: u32 = 100;

/// One kind of limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LimitKind {
    /// GPU memory the cgroup (and its descendants) may hold.
    MemoryMax,
    /// Cap: percent of one GPU's time.
    ComputeMax,
    /// Guarantee: percent of one GPU's time.
    ComputeMin,
    /// Share of contended GPU time.
    ComputeWeight,
    /// Scheduling class of the cgroup's GPU work.
    Priority,
}

/// What a limit's value is: its type, its range, and the D-Bus types it may be sent as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    /// Bytes, 1 to [`MAX_BYTES`]; as text, a quantity (`512Mi`, `8Gi`, `2G`).
    Bytes,
    /// Percent of one GPU's time, 1 to 100; as text, a decimal integer.
    Percent,
    /// A weight, 1 to 10000; as text, a decimal integer.
    Weight,
    /// A [`Priority`] class by name; a string only.
    Priority,
}

/// D-Bus signatures of the integers a numeric limit may be sent as (a variant inside the variant
/// is looked through).
const INTEGER_SIGNATURES: [&str; 7] = ["t", "u", "q", "y", "x", "i", "n"];

impl ValueType {
    /// The accepted values of a number, inclusive; `None` for priorities.
    pub const fn range(self) -> Option<(u64, u64)> {
        match self {
            Self::Bytes => Some((1, MAX_BYTES)),
            Self::Percent => Some((1, 100)),
            Self::Weight => Some((1, 10_000)),
            Self::Priority => None,
        }
    }

    /// The D-Bus signatures a value may be sent as in `SetLimits`: integers of any width
    /// (signed ones non-negative) and strings for numbers, strings for priorities.
    pub fn dbus_signatures(self) -> Vec<&'static str> {
        match self {
            Self::Priority => vec!["s"],
            _ => INTEGER_SIGNATURES.into_iter().chain(["s"]).collect(),
        }
    }

    /// What a D-Bus value of another type should have been, for the error.
    const fn expected(self) -> &'static str {
        match self {
            Self::Bytes => "bytes as an unsigned integer (t) or a quantity string (s)",
            Self::Percent | Self::Weight => "a number",
            Self::Priority => "a string: latency-critical, normal, best-effort",
        }
    }
}

impl LimitKind {
    /// Every kind, in the order the API lists them.
    pub const ALL: [LimitKind; 5] = [
        Self::MemoryMax,
        Self::ComputeMax,
        Self::ComputeMin,
        Self::ComputeWeight,
        Self::Priority,
    ];

    /// Every kind, in the order the API lists them: what a client iterates over rather than a
    /// list of its own.
    pub fn iter() -> impl Iterator<Item = LimitKind> {
        Self::ALL.into_iter()
    }

    /// The name in the D-Bus API: a key of `SetLimits`' and `ListLimits`' dictionaries, a name
    /// `ClearLimits` takes.
    pub const fn dbus_name(self) -> &'static str {
        match self {
            Self::MemoryMax => "memory_max",
            Self::ComputeMax => "compute_max",
            Self::ComputeMin => "compute_min",
            Self::ComputeWeight => "compute_weight",
            Self::Priority => "priority",
        }
    }

    /// The annotation name (after `gpud.dev/`), also gpudctl's flag (`--memory-max`).
    pub const fn annotation(self) -> &'static str {
        match self {
            Self::MemoryMax => "memory-max",
            Self::ComputeMax => "compute-max",
            Self::ComputeMin => "compute-min",
            Self::ComputeWeight => "compute-weight",
            Self::Priority => "priority",
        }
    }

    /// What the value is.
    pub const fn value_type(self) -> ValueType {
        match self {
            Self::MemoryMax => ValueType::Bytes,
            Self::ComputeMax | Self::ComputeMin => ValueType::Percent,
            Self::ComputeWeight => ValueType::Weight,
            Self::Priority => ValueType::Priority,
        }
    }

    /// One line for a help text.
    pub const fn description(self) -> &'static str {
        match self {
            Self::MemoryMax => "GPU-memory maximum: bytes or a quantity such as 512Mi, 8Gi",
            Self::ComputeMax => "Cap in percent of one GPU's time (1-100)",
            Self::ComputeMin => "Guaranteed percent of one GPU's time (1-100)",
            Self::ComputeWeight => "Share of contended GPU time (1-10000, default 100)",
            Self::Priority => "latency-critical, normal or best-effort",
        }
    }

    /// The value's placeholder in a usage text.
    pub const fn value_name(self) -> &'static str {
        match self.value_type() {
            ValueType::Bytes => "BYTES",
            ValueType::Percent => "PERCENT",
            ValueType::Weight => "WEIGHT",
            ValueType::Priority => "CLASS",
        }
    }

    /// The kind with this D-Bus name.
    pub fn from_dbus_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.dbus_name() == name)
    }

    /// The kind with this annotation name.
    pub fn from_annotation(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.annotation() == name)
    }

    /// A value of this limit from text (an annotation, a gpudctl flag, a D-Bus string): a byte
    /// quantity, a decimal integer, or a priority's name; surrounding whitespace is ignored. The
    /// value is checked against the limit's range.
    pub fn parse(self, text: &str) -> Result<LimitValue, ValueError> {
        let t = text.trim();
        match self.value_type() {
            ValueType::Bytes => self.check_integer(i128::from(parse_quantity(t)?)),
            ValueType::Percent | ValueType::Weight => {
                let n = t.parse::<i128>().map_err(|_| ValueError::NotWhole {
                    text: truncate(text),
                    kind: self,
                })?;
                self.check_integer(n)
            }
            ValueType::Priority => Ok(LimitValue::Priority(t.parse()?)),
        }
    }

    /// Checks an integer against the limit's range (an integer for a priority is the wrong type).
    fn check_integer(self, n: i128) -> Result<LimitValue, ValueError> {
        let Some((lo, hi)) = self.value_type().range() else {
            return Err(ValueError::NotAPriority(n));
        };
        match self.value_type() {
            ValueType::Bytes if n < 0 => Err(ValueError::Negative(n)),
            ValueType::Bytes if n == 0 => Err(ValueError::ZeroBytes),
            ValueType::Bytes if n > i128::from(hi) => Err(ValueError::TooManyBytes(n)),
            _ if n < i128::from(lo) || n > i128::from(hi) => {
                Err(ValueError::OutOfRange { n, kind: self })
            }
            // In range, so within u64.
            _ => u64::try_from(n)
                .map(LimitValue::Number)
                .map_err(|_| ValueError::OutOfRange { n, kind: self }),
        }
    }

    /// Checks a value built in code (not parsed) against the limit: type and range.
    pub fn check(self, value: &LimitValue) -> Result<(), ValueError> {
        match value {
            LimitValue::Number(n) => self.check_integer(i128::from(*n)).map(|_| ()),
            LimitValue::Priority(_) if self.value_type() == ValueType::Priority => Ok(()),
            LimitValue::Priority(p) => Err(ValueError::NotANumber(*p)),
        }
    }

    /// The value as text that [`LimitKind::parse`] reads back as the same value: bytes in the
    /// largest binary unit that divides them exactly (`8Gi`), numbers as integers, priorities
    /// by name.
    pub fn render(self, value: &LimitValue) -> String {
        match (self.value_type(), value) {
            (ValueType::Bytes, LimitValue::Number(n)) => render_quantity(*n),
            (_, LimitValue::Number(n)) => n.to_string(),
            (_, LimitValue::Priority(p)) => p.as_str().to_owned(),
        }
    }
}

impl fmt::Display for LimitKind {
    /// The D-Bus name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.dbus_name())
    }
}

/// The D-Bus names of all limits, for messages: `memory_max, compute_max, …`.
pub fn dbus_names() -> String {
    LimitKind::ALL.map(LimitKind::dbus_name).join(", ")
}

/// Scheduling class of a cgroup's GPU work.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Priority {
    /// Best-effort cgroups on its GPU are throttled as soon as it is active.
    LatencyCritical,
    /// Neither.
    #[default]
    Normal,
    /// Yields the GPU to latency-critical cgroups.
    BestEffort,
}

impl Priority {
    /// Every class, in the order of their numbers in `ListLimits` (0, 1, 2).
    pub const ALL: [Priority; 3] = [Self::LatencyCritical, Self::Normal, Self::BestEffort];

    /// The name (`latency-critical`, `normal`, `best-effort`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LatencyCritical => "latency-critical",
            Self::Normal => "normal",
            Self::BestEffort => "best-effort",
        }
    }

    /// The number `ListLimits` lists it as: 0 latency-critical, 1 normal, 2 best-effort.
    pub const fn index(self) -> u64 {
        match self {
            Self::LatencyCritical => 0,
            Self::Normal => 1,
            Self::BestEffort => 2,
        }
    }

    /// The class `ListLimits` lists as `n`.
    pub fn from_index(n: u64) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.index() == n)
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A text that names no priority class (quoted, at most 80 characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a priority ({names})", names = priority_names())]
pub struct PriorityError(pub String);

/// `latency-critical, normal, best-effort`.
fn priority_names() -> String {
    Priority::ALL.map(Priority::as_str).join(", ")
}

impl FromStr for Priority {
    type Err = PriorityError;
    fn from_str(s: &str) -> Result<Self, PriorityError> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| PriorityError(truncate(s)))
    }
}

/// A limit's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitValue {
    /// Bytes, percent or weight.
    Number(u64),
    /// A priority class.
    Priority(Priority),
}

impl LimitValue {
    /// The number, if this is one.
    pub fn number(&self) -> Option<u64> {
        match self {
            Self::Number(n) => Some(*n),
            Self::Priority(_) => None,
        }
    }

    /// The priority class, if this is one.
    pub fn priority(&self) -> Option<Priority> {
        match self {
            Self::Priority(p) => Some(*p),
            Self::Number(_) => None,
        }
    }

    /// As `ListLimits` lists it: numbers as they are, priorities as [`Priority::index`].
    pub fn listed(&self) -> u64 {
        match self {
            Self::Number(n) => *n,
            Self::Priority(p) => p.index(),
        }
    }
}

/// A value that is not one of its limit's: the message says why (the limit's name is added by
/// whoever knows where the value came from: [`LimitError`], an annotation's key).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// Not a byte quantity.
    #[error(transparent)]
    Quantity(#[from] QuantityError),
    /// Zero bytes: no limit is not a limit of 0.
    #[error("0 bytes; for no limit leave it out or clear it (ClearLimits)")]
    ZeroBytes,
    /// A negative number of bytes.
    #[error("{0} is negative")]
    Negative(i128),
    /// More bytes than [`MAX_BYTES`].
    #[error("{0} bytes is larger than gpud accepts ({MAX_BYTES})")]
    TooManyBytes(i128),
    /// Text that is not an integer, for a number.
    #[error("{text:?} is not a whole number ({kind} is {range})", range = range_text(*kind))]
    NotWhole {
        /// The text (at most 80 characters).
        text: String,
        /// The limit it was for.
        kind: LimitKind,
    },
    /// An integer outside the limit's range.
    #[error("{n} is outside {range}", range = range_text(*kind))]
    OutOfRange {
        /// The number given.
        n: i128,
        /// The limit it was for.
        kind: LimitKind,
    },
    /// Not a priority class.
    #[error(transparent)]
    Priority(#[from] PriorityError),
    /// A priority where a number belongs.
    #[error("expected a number, got the priority {0}")]
    NotANumber(Priority),
    /// A number where a priority belongs.
    #[error("expected a priority ({names}), got the number {0}", names = priority_names())]
    NotAPriority(i128),
    /// A D-Bus value of a type the limit does not take.
    #[error("expected {expected}, got type {got}", expected = kind.value_type().expected())]
    WrongType {
        /// The limit it was for.
        kind: LimitKind,
        /// The D-Bus signature sent.
        got: String,
    },
    /// A guarantee above the cap set beside it.
    #[error("{min} is above {max_name} {max}", max_name = LimitKind::ComputeMax.dbus_name())]
    AboveCap {
        /// `compute_min`.
        min: u64,
        /// `compute_max`.
        max: u64,
    },
}

/// `lo..=hi` of a numeric limit.
fn range_text(kind: LimitKind) -> String {
    match kind.value_type().range() {
        Some((lo, hi)) => format!("{lo}..={hi}"),
        None => "not a number".to_owned(),
    }
}

/// Limits that cannot be set as given; nothing of them is applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// A name that is no limit's (at most 80 characters).
    #[error("unknown limit {0:?} (known: {known})", known = dbus_names())]
    Unknown(String),
    /// A value that is not the limit's.
    #[error("limit {kind}: {reason}")]
    InvalidValue {
        /// Which limit.
        kind: LimitKind,
        /// What is wrong with the value.
        reason: ValueError,
    },
    /// An empty dictionary.
    #[error("no limits given")]
    Empty,
    /// A name given twice (at most 80 characters): which value is meant?
    #[error("limit {0:?} is given more than once (ambiguous: which value is meant?)")]
    Repeated(String),
}

/// Limits to set together, at most one value per kind, each checked against its kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitSet(BTreeMap<LimitKind, LimitValue>);

impl LimitSet {
    /// No limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets one limit (replacing an earlier value of the same kind) if the value is the
    /// limit's.
    pub fn insert(&mut self, kind: LimitKind, value: LimitValue) -> Result<(), LimitError> {
        kind.check(&value)
            .map_err(|reason| LimitError::InvalidValue { kind, reason })?;
        self.0.insert(kind, value);
        Ok(())
    }

    /// The value of one limit.
    pub fn get(&self, kind: LimitKind) -> Option<&LimitValue> {
        self.0.get(&kind)
    }

    /// Every limit set, in [`LimitKind`] order.
    pub fn iter(&self) -> impl Iterator<Item = (LimitKind, &LimitValue)> {
        self.0.iter().map(|(k, v)| (*k, v))
    }

    /// Whether no limit is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many limits are set.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Refuses a guarantee above the cap set with it.
    pub fn check_min_max(&self) -> Result<(), LimitError> {
        let number = |k| self.get(k).and_then(LimitValue::number);
        match (number(LimitKind::ComputeMin), number(LimitKind::ComputeMax)) {
            (Some(min), Some(max)) if min > max => Err(LimitError::InvalidValue {
                kind: LimitKind::ComputeMin,
                reason: ValueError::AboveCap { min, max },
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
