//! gpud-runtime: gpud's container-runtime side, a client of gpud's D-Bus API (gpud-api) that
//! links nothing of the daemon (no eBPF, no NVML). Containers ask for GPU shares with
//! annotations ([`annotations`], on gpud-api's limit schema); the OCI hook (`gpud-oci-hook`,
//! [`oci`]) and the NRI plugin (`gpud-nri`, [`nri`]) find the container's cgroup ([`cgroup`])
//! and set the shares through gpud's D-Bus API ([`client`]), and clear them when the container
//! goes; they also tell gpud which Kubernetes workload each cgroup they limit runs
//! ([`workload`]). gpud-k8s produces the same annotations ([`annotations::render`]) and logs like
//! the two binaries ([`logging`]). docs/runtime-integration.md is the operator's guide.
//!
//! What happens when something goes wrong is the operator's choice ([`FailPolicy`]): an invalid
//! request (a malformed annotation, a limit gpud refuses, a cgroup that cannot be found) fails
//! the container by default (closed); an unreachable gpud fails a container whose shares the
//! cluster granted through gpud (a DRA claim, the device plugin: gpud is expected there) and lets
//! others run without limits (open), by default. Both are logged. Whose annotations count for
//! how much is [`trust`]'s.

pub mod annotations;
pub mod cgroup;
pub mod claim;
pub mod client;
pub mod logging;
pub mod nri;
pub mod oci;
pub mod pod;
pub mod report;
pub mod trust;
pub mod workload;

pub use annotations::AnnotationError;

/// Errors of the runtime integration.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    /// The container's cgroup cannot be determined or is not one to limit.
    #[error("container cgroup: {0}")]
    Cgroup(String),
    /// gpud answered with one of its errors (`dev.gpud.Error.InvalidArgument`, `NotFound`, …)
    /// other than `Failed`: it refused the request.
    #[error("gpud refused {call}: {name}: {message}")]
    Refused {
        call: String,
        name: String,
        message: String,
    },
    /// No answer from gpud: no bus, no daemon on it, a timeout, the bus's own errors, or
    /// `dev.gpud.Error.Failed` (it could not complete the request, e.g. while shutting down).
    #[error("gpud unreachable ({call}): {reason}")]
    Unreachable { call: String, reason: String },
    /// The runtime handed over something unusable (e.g. an OCI state that does not parse).
    #[error("{0}")]
    Input(String),
    #[error("cannot access {path}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Which policy decides about an error: see [`FailPolicy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureClass {
    /// The request cannot be honoured as given.
    Invalid,
    /// gpud cannot be asked.
    Unreachable,
}

impl RuntimeError {
    pub fn class(&self) -> FailureClass {
        match self {
            Self::Unreachable { .. } => FailureClass::Unreachable,
            Self::Annotation(_)
            | Self::Cgroup(_)
            | Self::Refused { .. }
            | Self::Input(_)
            | Self::Io { .. } => FailureClass::Invalid,
        }
    }
}

/// What to do with the container when its shares cannot be applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// Fail the container (the hook exits non-zero; the NRI plugin returns an error).
    Closed,
    /// Log and let the container run without the shares.
    Open,
}

/// The operator's choice per class of failure; the default is closed for invalid requests, and
/// for an unreachable gpud closed where the cluster granted the container's shares and open
/// otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailPolicy {
    pub on_invalid: FailMode,
    /// `None`: by the container ([`FailPolicy::mode_for`]).
    pub on_unreachable: Option<FailMode>,
}

impl Default for FailPolicy {
    fn default() -> Self {
        Self {
            on_invalid: FailMode::Closed,
            on_unreachable: None,
        }
    }
}

impl FailPolicy {
    /// What to do with a container after `e`; `granted`: whether the cluster granted it shares
    /// through gpud ([`trust::Decision::granted`]). A granted container does not run
    /// unenforced by default: the scheduler counted its share as held to it.
    pub fn mode_for(&self, e: &RuntimeError, granted: bool) -> FailMode {
        match e.class() {
            FailureClass::Invalid => self.on_invalid,
            FailureClass::Unreachable => self.on_unreachable.unwrap_or(if granted {
                FailMode::Closed
            } else {
                FailMode::Open
            }),
        }
    }
}
