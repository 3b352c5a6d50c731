//! Who may set what on a container (docs/design.md "Who may set what"), decided in one place for
//! the NRI plugin and the OCI hook: the node's operator (gpudctl, D-Bus, by the admin group) over
//! what the cluster granted over what the pod's author wrote.
//!
//! - **Granted** is what a pod's author cannot write: the arguments of the OCI hook that a DRA
//!   claim's CDI spec runs (`--annotation`), and a container's own annotations as the kubelet
//!   hands them to the runtime (a device plugin's allocate response). NRI gets the pod's
//!   annotations apart; a container annotation that repeats a pod annotation (key and value) is
//!   the runtime's copy of the pod's and counts as the pod's.
//! - **Asked** is what the pod's author wrote: the pod's annotations and its container-scoped
//!   keys (for the OCI hook, every annotation of the OCI spec, which may hold the pod's).
//!
//! Where annotations only narrow ([`Trust::Narrow`], the default for containers of a Kubernetes
//! pod), an asked value is applied only if it is no wider than the grant on the same GPU and
//! limit ([`narrows`]): a lower memory or compute cap, a lower weight, a lower class, a lower
//! guarantee than one granted. Guarantees and classes above `normal` are the cluster's to give.
//! Everything else is ignored and reported ([`Ignored`]); it never fails the container, so that
//! a pod written for a more trusting node still runs, held to its grant.

use std::collections::HashMap;

use gpud_api::limits::{DEFAULT_WEIGHT, LimitKind, LimitValue, Priority};

use crate::annotations::{self, AnnotationError, Levels, Shares};

/// How far a container's annotations are trusted (`annotation_trust` of the NRI plugin's
/// configuration, `--annotation-trust` of the OCI hook).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Trust {
    /// `narrow` for containers of a Kubernetes pod, `full` for others (a container started with
    /// `nerdctl`, `podman` or `ctr`, whose annotations its administrator wrote).
    #[default]
    Auto,
    /// Annotations only narrow what the cluster granted.
    Narrow,
    /// Annotations count as much as a grant, key by key over it (single-tenant hosts).
    Full,
}

impl std::fmt::Display for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Narrow => "narrow",
            Self::Full => "full",
        })
    }
}

impl Trust {
    /// Whether annotations only narrow, for a container of a Kubernetes pod or not.
    pub fn narrows(self, kubernetes: bool) -> bool {
        match self {
            Self::Auto => kubernetes,
            Self::Narrow => true,
            Self::Full => false,
        }
    }
}

/// Where one container's shares come from.
#[derive(Clone, Copy, Debug)]
pub struct Sources<'a> {
    /// What the pod's author wrote: the pod's annotations (NRI), or the annotations of the OCI
    /// spec (the hook; the runtime may have copied the pod's there).
    pub asked: &'a HashMap<String, String>,
    /// What the cluster granted: the container's own annotations (NRI), the hook's
    /// `--annotation` arguments (a DRA claim).
    pub granted: &'a HashMap<String, String>,
    /// The container's name, for container-scoped pod keys.
    pub name: Option<&'a str>,
    /// Whether the container belongs to a Kubernetes pod.
    pub kubernetes: bool,
}

/// The shares to apply, and the annotations left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Everything that applies to the container: the grant with the admitted asks over it.
    pub shares: Shares,
    /// What the cluster granted alone.
    pub grant: Shares,
    /// The admitted asks alone (all of them where annotations count fully).
    pub asked: Shares,
    pub ignored: Vec<Ignored>,
}

impl Decision {
    /// Whether the cluster granted the container anything through gpud (so that gpud is
    /// expected to enforce it).
    pub fn granted(&self) -> bool {
        !self.grant.is_empty()
    }
}

/// An annotation not applied because it would widen what the cluster granted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("annotation {key}={value:?} ignored: {reason}")]
pub struct Ignored {
    pub key: String,
    pub value: String,
    pub reason: String,
}

/// The shares of one container under `trust`. Malformed annotations are errors whoever wrote
/// them (as [`annotations::resolve`] reports them); a guarantee above the cap after narrowing too.
pub fn decide(src: &Sources<'_>, trust: Trust) -> Result<Decision, AnnotationError> {
    let Levels { pod: asked, own } = annotations::levels(src.asked, src.granted, src.name)?;
    let narrow = trust.narrows(src.kubernetes);
    let mut admitted = annotations::Level::new();
    let mut ignored = Vec::new();
    for ((gpu, kind), (key, value)) in asked {
        let grant = own.get(&(gpu.clone(), kind)).map(|(_, v)| v);
        match narrows(kind, grant, &value) {
            Err(reason) if narrow => ignored.push(Ignored {
                key,
                value: kind.render(&value),
                reason,
            }),
            _ => {
                admitted.insert((gpu, kind), (key, value));
            }
        }
    }
    // Key by key, the narrower word wins where annotations only narrow, the grant otherwise.
    let merged = if narrow {
        own.clone().into_iter().chain(admitted.clone()).collect()
    } else {
        admitted.clone().into_iter().chain(own.clone()).collect()
    };
    Ok(Decision {
        shares: annotations::shares_of(merged)?,
        grant: annotations::shares_of(own)?,
        asked: annotations::shares_of(admitted)?,
        ignored,
    })
}

/// Whether `asked` for one limit on one GPU is no wider than `grant` there (`None`: nothing
/// granted, which is no cap, the default weight, the `normal` class, no guarantee); the reason
/// when it is wider.
pub fn narrows(
    kind: LimitKind,
    grant: Option<&LimitValue>,
    asked: &LimitValue,
) -> Result<(), String> {
    let granted_text = |g: &LimitValue| kind.render(g);
    match kind {
        LimitKind::MemoryMax | LimitKind::ComputeMax => match (grant, asked) {
            (None, _) => Ok(()),
            (Some(LimitValue::Number(g)), LimitValue::Number(a)) if a <= g => Ok(()),
            (Some(g), _) => Err(format!(
                "above the {} the cluster granted ({}); annotations may only lower it",
                kind.dbus_name(),
                granted_text(g)
            )),
        },
        LimitKind::ComputeWeight => {
            let base = grant
                .and_then(LimitValue::number)
                .unwrap_or(u64::from(DEFAULT_WEIGHT));
            match asked {
                LimitValue::Number(a) if *a <= base => Ok(()),
                _ => Err(match grant {
                    Some(g) => format!(
                        "above the compute_weight the cluster granted ({}); annotations may only \
                         lower it",
                        granted_text(g)
                    ),
                    None => format!(
                        "above the default compute_weight ({DEFAULT_WEIGHT}); a larger share is the \
                         cluster's to grant"
                    ),
                }),
            }
        }
        LimitKind::ComputeMin => match (grant, asked) {
            (Some(LimitValue::Number(g)), LimitValue::Number(a)) if a <= g => Ok(()),
            (Some(g), _) => Err(format!(
                "above the compute_min the cluster granted ({}); annotations may only lower it",
                granted_text(g)
            )),
            (None, _) => Err(
                "a guarantee is the cluster's to grant (a DRA claim's compute), not an annotation's"
                    .to_owned(),
            ),
        },
        LimitKind::Priority => {
            let base = match grant {
                Some(LimitValue::Priority(p)) => *p,
                _ => Priority::Normal,
            };
            // Later in the order is lower: latency-critical, normal, best-effort.
            match asked {
                LimitValue::Priority(a) if *a >= base => Ok(()),
                _ => Err(format!(
                    "a higher class than {} ({base}); annotations may only lower it",
                    if grant.is_some() {
                        "the cluster granted"
                    } else {
                        "the default"
                    }
                )),
            }
        }
    }
}

/// The annotations with which runtimes mark a container of a Kubernetes pod in its OCI spec
/// (containerd's CRI, CRI-O; a pod's author cannot remove them).
const KUBERNETES_MARKERS: &[&str] = &[
    "io.kubernetes.cri.sandbox-id",
    "io.kubernetes.cri-o.SandboxID",
    "io.kubernetes.pod.namespace",
    "io.kubernetes.cri.sandbox-namespace",
];

/// Whether OCI annotations mark a container of a Kubernetes pod.
pub fn kubernetes_container(oci_annotations: &HashMap<String, String>) -> bool {
    KUBERNETES_MARKERS
        .iter()
        .any(|k| oci_annotations.contains_key(*k))
}

/// A container's own annotations without the runtime's copies of the pod's (same key, same
/// value): containerd's `pod_annotations` copies pod annotations into every container's spec,
/// and NRI reports the spec's.
pub fn without_pod_copies(
    container: &HashMap<String, String>,
    pod: &HashMap<String, String>,
) -> HashMap<String, String> {
    container
        .iter()
        .filter(|(k, v)| pod.get(*k) != Some(*v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests;
