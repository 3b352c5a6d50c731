//! The annotations by which containers ask for GPU shares (documented in
//! docs/runtime-integration.md): their keys, levels and precedence, parsed and rendered on
//! gpud-api's limit schema ([`gpud_api::limits`]: the limits, their annotation names, value
//! types, ranges and text forms are the schema's).
//!
//! Keys, each with an optional GPU suffix (`.0`, `.GPU-<uuid>`, `.MIG-<uuid>`; none: the limit
//! applies to the sum over all GPUs, gpud's `all`):
//!
//! | key | value | D-Bus limit |
//! | --- | --- | --- |
//! | `gpud.dev/memory-max[.GPU]` | bytes, or a quantity: `512Mi`, `8Gi`, `2G` | `memory_max` |
//! | `gpud.dev/compute-max[.GPU]` | percent of one GPU's time, 1–100 | `compute_max` |
//! | `gpud.dev/compute-min[.GPU]` | guaranteed percent, 1–100 | `compute_min` |
//! | `gpud.dev/compute-weight[.GPU]` | 1–10000 | `compute_weight` |
//! | `gpud.dev/priority[.GPU]` | `latency-critical`, `normal`, `best-effort` | `priority` |
//!
//! Three levels, each overriding the one before it key by key (limit and GPU): the pod's
//! annotations (`gpud.dev/…`), the pod's annotations scoped to one container by name
//! (`<container>.container.gpud.dev/…`; Kubernetes users cannot annotate single containers
//! otherwise), and the container's own annotations (`gpud.dev/…`, as a runtime or a device plugin
//! sets them). Every `gpud.dev` annotation is validated, also those scoped to other containers,
//! so a typo fails the whole pod the same way; other annotations are ignored.
//!
//! [`render`] is the inverse for producers of annotations (gpud-k8s's device plugin): the
//! container-level keys and values that [`resolve`] reads back as the same [`Shares`].

use std::{collections::BTreeMap, collections::HashMap};

pub use gpud_api::limits::{GpuSelector, LimitKind, LimitValue, Priority};

/// The domain of gpud's annotation keys.
pub const DOMAIN: &str = "gpud.dev";
/// The prefix of pod- and container-level keys.
pub const PREFIX: &str = "gpud.dev/";
/// The prefix-suffix of container-scoped pod keys: `<container>.container.gpud.dev/…`.
pub const CONTAINER_SCOPE: &str = ".container.gpud.dev/";

/// Longest annotation value looked at; longer values are invalid.
const MAX_VALUE_LEN: usize = 256;

/// An annotation that cannot be used; the message names the annotation and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    #[error("annotation {key}: unknown gpud annotation (known: {known})", known = known_keys())]
    UnknownKey { key: String },
    #[error("annotation {key}: invalid GPU suffix {gpu:?}: {reason}")]
    InvalidGpu {
        key: String,
        gpu: String,
        reason: String,
    },
    #[error("annotation {key}={value:?}: {reason}")]
    InvalidValue {
        key: String,
        value: String,
        reason: String,
    },
    #[error("annotations {key} and {other} set the same limit on the same GPU")]
    Duplicate { key: String, other: String },
    #[error(
        "annotation {min_key}={min} exceeds {max_key}={max}: the guaranteed share cannot be larger than the cap"
    )]
    MinAboveMax {
        min_key: String,
        min: u32,
        max_key: String,
        max: u32,
    },
}

fn known_keys() -> String {
    LimitKind::iter()
        .map(|k| format!("{PREFIX}{}[.GPU]", k.annotation()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shares asked for, by GPU (`all` or one GPU) and limit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shares {
    pub gpus: BTreeMap<GpuSelector, BTreeMap<LimitKind, LimitValue>>,
}

impl Shares {
    pub fn is_empty(&self) -> bool {
        self.gpus.values().all(BTreeMap::is_empty)
    }

    /// The value of one limit on one GPU.
    pub fn get(&self, gpu: &GpuSelector, kind: LimitKind) -> Option<&LimitValue> {
        self.gpus.get(gpu).and_then(|l| l.get(&kind))
    }
}

/// One parsed annotation: which limit on which GPU, and for which container if scoped.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    container: Option<String>,
    gpu: GpuSelector,
    kind: LimitKind,
    value: LimitValue,
}

/// Parses one annotation. `Ok(None)` for annotations that are not gpud's.
fn parse_one(key: &str, value: &str) -> Result<Option<Entry>, AnnotationError> {
    let (container, rest) = if let Some(rest) = key.strip_prefix(PREFIX) {
        (None, rest)
    } else if let Some((scope, rest)) = key.split_once(CONTAINER_SCOPE) {
        if scope.is_empty() || scope.contains('/') {
            return Ok(None);
        }
        (Some(scope.to_owned()), rest)
    } else {
        // `foo.gpud.dev/x` or `gpud.dev.example/x`: not ours unless it is our domain exactly.
        if key
            .split_once('/')
            .is_some_and(|(d, _)| d == DOMAIN || d.ends_with(&format!(".{DOMAIN}")))
        {
            return Err(AnnotationError::UnknownKey {
                key: key.to_owned(),
            });
        }
        return Ok(None);
    };
    let (name, gpu) = match rest.split_once('.') {
        Some((n, g)) => (n, Some(g)),
        None => (rest, None),
    };
    let kind = LimitKind::from_annotation(name).ok_or_else(|| AnnotationError::UnknownKey {
        key: key.to_owned(),
    })?;
    let gpu = match gpu {
        None => GpuSelector::All,
        Some(g) => match g.parse::<GpuSelector>() {
            Ok(GpuSelector::All) => {
                return Err(AnnotationError::InvalidGpu {
                    key: key.to_owned(),
                    gpu: g.to_owned(),
                    reason: format!("leave the suffix out for all GPUs ({PREFIX}{name})"),
                });
            }
            Ok(sel) => sel,
            Err(e) => {
                return Err(AnnotationError::InvalidGpu {
                    key: key.to_owned(),
                    gpu: g.chars().take(80).collect(),
                    reason: e.to_string(),
                });
            }
        },
    };
    let value = parse_value(kind, value).map_err(|reason| AnnotationError::InvalidValue {
        key: key.to_owned(),
        value: value.chars().take(80).collect(),
        reason,
    })?;
    Ok(Some(Entry {
        container,
        gpu,
        kind,
        value,
    }))
}

/// One annotation's value: at most [`MAX_VALUE_LEN`] bytes, then the schema's text form of the
/// limit (a quantity, a whole number in range, a priority's name).
fn parse_value(kind: LimitKind, value: &str) -> Result<LimitValue, String> {
    if value.len() > MAX_VALUE_LEN {
        return Err(format!("longer than {MAX_VALUE_LEN} bytes"));
    }
    kind.parse(value).map_err(|e| e.to_string())
}

/// Parsed annotations of one level: (GPU, limit) → (the annotation's key, its value).
pub(crate) type Level = BTreeMap<(GpuSelector, LimitKind), (String, LimitValue)>;

/// A container's annotations by who wrote them: `pod` holds the pod's own keys and the pod's keys
/// scoped to this container (the scoped ones over the pod's, key by key), `own` the container's
/// own annotations.
#[derive(Debug, Default)]
pub(crate) struct Levels {
    pub pod: Level,
    pub own: Level,
}

/// Parses the annotations of one container into its [`Levels`]; see the module documentation for
/// the precedence. Errors name the first offending annotation (in key order).
pub(crate) fn levels(
    pod: &HashMap<String, String>,
    container: &HashMap<String, String>,
    container_name: Option<&str>,
) -> Result<Levels, AnnotationError> {
    let mut pod_level = Level::new();
    let mut scoped = Level::new();
    let mut own = Level::new();
    let insert = |level: &mut Level, key: &str, e: Entry| match level.get(&(e.gpu.clone(), e.kind))
    {
        Some((other, _)) => Err(AnnotationError::Duplicate {
            key: key.to_owned(),
            other: other.clone(),
        }),
        None => {
            level.insert((e.gpu, e.kind), (key.to_owned(), e.value));
            Ok(())
        }
    };
    // Sorted so that the error reported for several bad annotations is always the same.
    let sorted = |m: &HashMap<String, String>| {
        let mut v: Vec<(String, String)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort();
        v
    };
    for (key, value) in sorted(pod) {
        let Some(e) = parse_one(&key, &value)? else {
            continue;
        };
        match e.container.as_deref() {
            None => insert(&mut pod_level, &key, e)?,
            Some(c) if Some(c) == container_name => insert(&mut scoped, &key, e)?,
            Some(_) => {}
        }
    }
    for (key, value) in sorted(container) {
        let Some(e) = parse_one(&key, &value)? else {
            continue;
        };
        // A container-scoped key among the container's annotations (a runtime that copied the
        // pod's annotations there) counts at the scoped level when it names this container.
        match e.container.as_deref() {
            None => insert(&mut own, &key, e)?,
            Some(c) if Some(c) == container_name => insert(&mut scoped, &key, e)?,
            Some(_) => {}
        }
    }
    pod_level.extend(scoped);
    Ok(Levels {
        pod: pod_level,
        own,
    })
}

/// The shares of one merged level, checked (a guarantee never above the cap on the same GPU).
pub(crate) fn shares_of(merged: Level) -> Result<Shares, AnnotationError> {
    check_min_max(&merged)?;
    let mut shares = Shares::default();
    for ((gpu, kind), (_, value)) in merged {
        shares.gpus.entry(gpu).or_default().insert(kind, value);
    }
    Ok(shares)
}

/// The shares of one container, from the pod's annotations, the container's name (for
/// container-scoped pod keys) and the container's own annotations, each level overriding the one
/// before it (see the module documentation): every annotation trusted alike. What the runtime
/// integrations apply goes through [`crate::trust::decide`], which also says whose word counts.
pub fn resolve(
    pod: &HashMap<String, String>,
    container: &HashMap<String, String>,
    container_name: Option<&str>,
) -> Result<Shares, AnnotationError> {
    let Levels {
        pod: mut merged,
        own,
    } = levels(pod, container, container_name)?;
    merged.extend(own);
    shares_of(merged)
}

/// The container-level annotations (`gpud.dev/<limit>[.<gpu>]`) that [`resolve`] reads back as
/// `shares`: memory in the largest binary unit that divides it exactly (`8Gi`), numbers as
/// integers, priorities by name.
pub fn render(shares: &Shares) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (gpu, limits) in &shares.gpus {
        let suffix = match gpu {
            GpuSelector::All => String::new(),
            other => format!(".{other}"),
        };
        for (kind, value) in limits {
            out.insert(
                format!("{PREFIX}{}{suffix}", kind.annotation()),
                kind.render(value),
            );
        }
    }
    out
}

fn check_min_max(
    merged: &BTreeMap<(GpuSelector, LimitKind), (String, LimitValue)>,
) -> Result<(), AnnotationError> {
    for ((gpu, kind), (min_key, min)) in merged {
        if *kind != LimitKind::ComputeMin {
            continue;
        }
        let Some((max_key, max)) = merged.get(&(gpu.clone(), LimitKind::ComputeMax)) else {
            continue;
        };
        if let (LimitValue::Number(min), LimitValue::Number(max)) = (min, max)
            && min > max
        {
            return Err(AnnotationError::MinAboveMax {
                min_key: min_key.clone(),
                min: u32::try_from(*min).unwrap_or(u32::MAX),
                max_key: max_key.clone(),
                max: u32::try_from(*max).unwrap_or(u32::MAX),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const UUID: &str = "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42";

    /// Valid annotations: (key, value, GPU, limit, parsed value).
    #[test]
    #[rustfmt::skip]
    fn valid_values() {
        use LimitKind::*;
        use LimitValue::{Number as N, Priority as P};
        let all = || GpuSelector::All;
        let idx = GpuSelector::Index;
        let uuid = || GpuSelector::Uuid(UUID.into());
        let uuid_key = format!("gpud.dev/memory-max.{UUID}");
        let cases: Vec<(&str, &str, GpuSelector, LimitKind, LimitValue)> = vec![
            ("gpud.dev/memory-max",        "8Gi",        all(),  MemoryMax, N(8 << 30)),
            ("gpud.dev/memory-max",        "512Mi",      all(),  MemoryMax, N(512 << 20)),
            ("gpud.dev/memory-max",        "1073741824", all(),  MemoryMax, N(1 << 30)),
            ("gpud.dev/memory-max",        " 2G ",       all(),  MemoryMax, N(2_000_000_000)),
            ("gpud.dev/memory-max",        "100k",       all(),  MemoryMax, N(100_000)),
            ("gpud.dev/memory-max",        "1Ti",        all(),  MemoryMax, N(1 << 40)),
            ("gpud.dev/memory-max",        "1",          all(),  MemoryMax, N(1)),
            ("gpud.dev/memory-max.0",      "4Gi",        idx(0), MemoryMax, N(4 << 30)),
            ("gpud.dev/memory-max.7",      "4Gi",        idx(7), MemoryMax, N(4 << 30)),
            (&uuid_key,                    "1Gi",        uuid(), MemoryMax, N(1 << 30)),
            ("gpud.dev/compute-max",       "30",         all(),  ComputeMax, N(30)),
            ("gpud.dev/compute-max",       "1",          all(),  ComputeMax, N(1)),
            ("gpud.dev/compute-max.1",     "100",        idx(1), ComputeMax, N(100)),
            ("gpud.dev/compute-min",       "60",         all(),  ComputeMin, N(60)),
            ("gpud.dev/compute-weight",    "1",          all(),  ComputeWeight, N(1)),
            ("gpud.dev/compute-weight",    "10000",      all(),  ComputeWeight, N(10000)),
            ("gpud.dev/priority",          "latency-critical", all(), Priority, P(super::Priority::LatencyCritical)),
            ("gpud.dev/priority",          "normal",     all(),  Priority, P(super::Priority::Normal)),
            ("gpud.dev/priority.0",        "best-effort", idx(0), Priority, P(super::Priority::BestEffort)),
            ("train.container.gpud.dev/memory-max", "2Gi", all(), MemoryMax, N(2 << 30)),
        ];
        for (key, value, gpu, kind, want) in cases {
            let got = resolve(&map(&[(key, value)]), &HashMap::new(), Some("train"))
                .unwrap_or_else(|e| panic!("{key}={value:?}: {e}"));
            assert_eq!(got.get(&gpu, kind), Some(&want), "{key}={value:?}");
            assert_eq!(got.gpus.len(), 1, "{key}={value:?}");
        }
    }

    /// Invalid annotations: (key, value, words the message must contain).
    #[test]
    #[rustfmt::skip]
    fn invalid_values() {
        let uuid_key = format!("gpud.dev/memory-max.{UUID}x");
        let long = "1".repeat(300);
        let cases: Vec<(&str, &str, &[&str])> = vec![
            ("gpud.dev/memory-max",      "",           &["gpud.dev/memory-max", "not a byte quantity"]),
            ("gpud.dev/memory-max",      "0",          &["gpud.dev/memory-max=\"0\"", "0 bytes"]),
            ("gpud.dev/memory-max",      "0Gi",        &["0 bytes"]),
            ("gpud.dev/memory-max",      "8GB",        &["\"8GB\"", "unknown suffix"]),
            ("gpud.dev/memory-max",      "8 Gi",       &["unknown suffix"]),
            ("gpud.dev/memory-max",      "-1",         &["not a byte quantity"]),
            ("gpud.dev/memory-max",      "1.5Gi",      &["unknown suffix"]),
            ("gpud.dev/memory-max",      "lots",       &["not a byte quantity"]),
            ("gpud.dev/memory-max",      "2000000Ti",  &["larger than gpud accepts"]),
            ("gpud.dev/memory-max",      "99999999999999999999", &["too large"]),
            ("gpud.dev/memory-max",      "17179869184Ti", &["too large"]),
            ("gpud.dev/memory-max",      &long,        &["longer than 256 bytes"]),
            ("gpud.dev/memory-max.all",  "1Gi",        &["gpud.dev/memory-max.all", "leave the suffix out"]),
            ("gpud.dev/memory-max.",     "1Gi",        &["invalid GPU suffix"]),
            ("gpud.dev/memory-max.gpu0", "1Gi",        &["invalid GPU suffix \"gpu0\""]),
            ("gpud.dev/memory-max.999",  "1Gi",        &["invalid GPU suffix"]),
            ("gpud.dev/memory-max.-1",   "1Gi",        &["invalid GPU suffix"]),
            ("gpud.dev/memory-max.0.1",  "1Gi",        &["invalid GPU suffix"]),
            (&uuid_key,                  "1Gi",        &["invalid GPU suffix"]),
            ("gpud.dev/memory-maxx",     "1Gi",        &["gpud.dev/memory-maxx", "unknown gpud annotation"]),
            ("gpud.dev/memory",          "1Gi",        &["unknown gpud annotation"]),
            ("gpud.dev/",                "1Gi",        &["unknown gpud annotation"]),
            ("gpud.dev/Memory-Max",      "1Gi",        &["unknown gpud annotation"]),
            ("a.b.gpud.dev/memory-max",  "1Gi",        &["a.b.gpud.dev/memory-max", "unknown gpud annotation"]),
            ("x.container.gpud.dev/cpu", "1",          &["x.container.gpud.dev/cpu", "unknown gpud annotation"]),
            ("gpud.dev/compute-max",     "0",          &["gpud.dev/compute-max", "outside 1..=100"]),
            ("gpud.dev/compute-max",     "101",        &["outside 1..=100"]),
            ("gpud.dev/compute-max",     "30%",        &["not a whole number (compute_max is 1..=100)"]),
            ("gpud.dev/compute-max",     "-5",         &["outside 1..=100"]),
            ("gpud.dev/compute-max",     "",           &["not a whole number"]),
            ("gpud.dev/compute-max",     "99999999999999999999999", &["outside 1..=100"]),
            ("gpud.dev/compute-min",     "0",          &["gpud.dev/compute-min", "outside 1..=100"]),
            ("gpud.dev/compute-min",     "1000",       &["outside 1..=100"]),
            ("gpud.dev/compute-weight",  "0",          &["gpud.dev/compute-weight", "outside 1..=10000"]),
            ("gpud.dev/compute-weight",  "10001",      &["outside 1..=10000"]),
            ("gpud.dev/compute-weight",  "1.5",        &["not a whole number (compute_weight is 1..=10000)"]),
            ("gpud.dev/priority",        "high",       &["gpud.dev/priority", "is not a priority (latency-critical, normal, best-effort)"]),
            ("gpud.dev/priority",        "Normal",     &["is not a priority (latency-critical, normal, best-effort)"]),
            ("gpud.dev/priority",        "",           &["is not a priority (latency-critical, normal, best-effort)"]),
        ];
        for (key, value, words) in cases {
            let err = match resolve(&map(&[(key, value)]), &HashMap::new(), None) {
                Ok(s) => panic!("{key}={value:?} accepted as {s:?}"),
                Err(e) => e.to_string(),
            };
            for w in words {
                assert!(err.contains(w), "{key}={value:?}: {err:?} lacks {w:?}");
            }
            // The same annotation on the container is rejected the same way.
            assert!(
                resolve(&HashMap::new(), &map(&[(key, value)]), None).is_err(),
                "{key}={value:?} on the container"
            );
        }
    }

    #[test]
    fn other_annotations_are_ignored() {
        let s = resolve(
            &map(&[
                ("io.kubernetes.pod.name", "x"),
                ("example.com/memory-max", "garbage"),
                ("gpud.dev.example.com/memory-max", "garbage"),
                ("notgpud.dev/memory-max", "garbage"),
                ("memory-max", "garbage"),
            ]),
            &HashMap::new(),
            Some("c"),
        );
        assert_eq!(s, Ok(Shares::default()));
    }

    #[test]
    fn container_overrides_scoped_overrides_pod_key_by_key() {
        let pod = map(&[
            ("gpud.dev/memory-max", "8Gi"),
            ("gpud.dev/memory-max.0", "6Gi"),
            ("gpud.dev/compute-max", "50"),
            ("gpud.dev/priority", "normal"),
            ("train.container.gpud.dev/memory-max", "4Gi"),
            ("train.container.gpud.dev/compute-weight", "300"),
            ("infer.container.gpud.dev/memory-max", "2Gi"),
        ]);
        let own = map(&[
            ("gpud.dev/compute-max", "20"),
            ("gpud.dev/memory-max.1", "1Gi"),
        ]);
        let s = resolve(&pod, &own, Some("train")).unwrap_or_default();
        let n = |v| Some(LimitValue::Number(v));
        let all = GpuSelector::All;
        assert_eq!(
            s.get(&all, LimitKind::MemoryMax).cloned(),
            n(4 << 30),
            "scoped over pod"
        );
        assert_eq!(
            s.get(&all, LimitKind::ComputeMax).cloned(),
            n(20),
            "own over pod"
        );
        assert_eq!(s.get(&all, LimitKind::ComputeWeight).cloned(), n(300));
        assert_eq!(
            s.get(&all, LimitKind::Priority).cloned(),
            Some(LimitValue::Priority(Priority::Normal)),
            "pod value kept"
        );
        assert_eq!(
            s.get(&GpuSelector::Index(0), LimitKind::MemoryMax).cloned(),
            n(6 << 30)
        );
        assert_eq!(
            s.get(&GpuSelector::Index(1), LimitKind::MemoryMax).cloned(),
            n(1 << 30)
        );
        // The other container gets its own scoped value, and no container name: only the pod's.
        let infer = resolve(&pod, &HashMap::new(), Some("infer")).unwrap_or_default();
        assert_eq!(infer.get(&all, LimitKind::MemoryMax).cloned(), n(2 << 30));
        let anon = resolve(&pod, &HashMap::new(), None).unwrap_or_default();
        assert_eq!(anon.get(&all, LimitKind::MemoryMax).cloned(), n(8 << 30));
        // The container's own annotations beat scoped ones too.
        let own = map(&[("gpud.dev/memory-max", "3Gi")]);
        let s = resolve(&pod, &own, Some("train")).unwrap_or_default();
        assert_eq!(s.get(&all, LimitKind::MemoryMax).cloned(), n(3 << 30));
    }

    #[test]
    fn invalid_scoped_annotations_of_other_containers_still_fail() {
        let pod = map(&[("other.container.gpud.dev/memory-max", "8GB")]);
        let err = resolve(&pod, &HashMap::new(), Some("me"))
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("other.container.gpud.dev/memory-max")),
            "{err:?}"
        );
    }

    #[test]
    fn duplicates_and_min_above_max() {
        let dup = map(&[
            ("gpud.dev/memory-max.0", "1Gi"),
            ("gpud.dev/memory-max.00", "2Gi"),
        ]);
        assert!(matches!(
            resolve(&dup, &HashMap::new(), None),
            Err(AnnotationError::Duplicate { .. })
        ));
        let bad = map(&[
            ("gpud.dev/compute-max", "30"),
            ("gpud.dev/compute-min", "60"),
        ]);
        let err = resolve(&bad, &HashMap::new(), None)
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("gpud.dev/compute-min=60")
                    && e.contains("gpud.dev/compute-max=30")),
            "{err:?}"
        );
        // min <= max, and a min on another GPU than the max, are fine.
        let ok = map(&[
            ("gpud.dev/compute-max", "30"),
            ("gpud.dev/compute-min", "30"),
            ("gpud.dev/compute-min.0", "90"),
        ]);
        assert!(resolve(&ok, &HashMap::new(), None).is_ok());
        // The container lowering the pod's max below the pod's min is caught after merging.
        let pod = map(&[("gpud.dev/compute-min", "40")]);
        let own = map(&[("gpud.dev/compute-max", "20")]);
        assert!(matches!(
            resolve(&pod, &own, None),
            Err(AnnotationError::MinAboveMax { .. })
        ));
    }

    #[test]
    fn rendered_shares_resolve_to_themselves() {
        let mut shares = Shares::default();
        let uuid = GpuSelector::Uuid(UUID.into());
        let one = |k, v| (k, v);
        shares.gpus.insert(
            uuid.clone(),
            [
                one(LimitKind::MemoryMax, LimitValue::Number(8 << 30)),
                one(LimitKind::ComputeMax, LimitValue::Number(30)),
                one(
                    LimitKind::Priority,
                    LimitValue::Priority(Priority::BestEffort),
                ),
            ]
            .into(),
        );
        shares.gpus.insert(
            GpuSelector::All,
            [one(LimitKind::MemoryMax, LimitValue::Number(1_500_000_000))].into(),
        );
        let text = render(&shares);
        assert_eq!(
            text.get(&format!("gpud.dev/memory-max.{UUID}"))
                .map(String::as_str),
            Some("8Gi")
        );
        assert_eq!(
            text.get("gpud.dev/memory-max").map(String::as_str),
            Some("1500000000")
        );
        let own: HashMap<String, String> = text.into_iter().collect();
        assert_eq!(resolve(&HashMap::new(), &own, None), Ok(shares));
    }

    proptest! {
        /// Arbitrary keys and values never panic; whatever is accepted is within range.
        #[test]
        fn random_annotations_never_panic(
            pairs in proptest::collection::vec(
                (
                    prop_oneof![
                        "\\PC{0,40}",
                        "(gpud\\.dev/|[a-z]{1,8}\\.container\\.gpud\\.dev/)(memory-max|compute-max|compute-min|compute-weight|priority)(\\.[0-9A-Za-z-]{0,45})?",
                    ],
                    prop_oneof!["\\PC{0,40}", "[0-9]{0,25}(Ki|Mi|Gi|Ti|k|M|G|T|%|)", "(latency-critical|normal|best-effort)"],
                ),
                0..6,
            ),
            name in proptest::option::of("[a-z]{1,8}"),
        ) {
            let m: HashMap<String, String> = pairs.into_iter().collect();
            let empty = HashMap::new();
            for (pod, own) in [(&m, &empty), (&empty, &m), (&m, &m)] {
                if let Ok(shares) = resolve(pod, own, name.as_deref()) {
                    for limits in shares.gpus.values() {
                        for (kind, value) in limits {
                            prop_assert!(kind.check(value).is_ok(), "{kind}: {value:?}");
                        }
                    }
                    // What was accepted renders to annotations that mean the same.
                    let own: HashMap<String, String> = render(&shares).into_iter().collect();
                    prop_assert_eq!(resolve(&HashMap::new(), &own, None), Ok(shares));
                }
            }
        }
    }
}

/// Fuzz targets (`cargo xtask fuzz`): annotation keys and values of any content.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any value of any limit is in the limit's range or a message; nothing panics.
        #[test]
        fn any_value_is_in_range_or_refused(k in 0usize..LimitKind::iter().count(), value in prop_oneof![
            "(?s).{0,300}",
            "[ ]?[0-9]{0,22}(Ki|Mi|Gi|Ti|k|M|G|T|%)?[ ]?",
        ]) {
            let Some(kind) = LimitKind::iter().nth(k) else {
                return Err(TestCaseError::fail("no such kind"));
            };
            if let Ok(v) = parse_value(kind, &value) {
                prop_assert!(kind.check(&v).is_ok(), "{kind} {value:?}: {v:?}");
            }
        }

        /// Any single annotation is ignored, accepted, or refused with a typed error that names
        /// its key; nothing panics.
        #[test]
        fn any_single_annotation_is_typed(
            key in prop_oneof![
                "(?s).{0,80}",
                "([a-z.]{0,12}gpud\\.dev|[a-z]{0,8}\\.container\\.gpud\\.dev)/[a-z.-]{0,20}",
                "gpud\\.dev/(memory-max|compute-max|compute-min|compute-weight|priority)\\.(?s).{0,70}",
            ],
            value in "(?s).{0,40}",
        ) {
            match parse_one(&key, &value) {
                Ok(None) => prop_assert!(!key.starts_with(PREFIX)),
                Ok(Some(_)) => prop_assert!(key.contains(DOMAIN)),
                Err(
                    AnnotationError::UnknownKey { key: k }
                    | AnnotationError::InvalidGpu { key: k, .. }
                    | AnnotationError::InvalidValue { key: k, .. },
                ) => prop_assert_eq!(k, key),
                Err(other) => prop_assert!(false, "one annotation cannot give {other:?}"),
            }
        }
    }
}
