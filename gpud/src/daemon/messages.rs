//! What the state task is sent and answers with: its inbox ([`Message`]), the changes the API
//! asks for ([`Request`]), and the answers' types shared by the handle and the published view.

use std::collections::{BTreeMap, BTreeSet};

use tokio::sync::oneshot;

use crate::{
    attribution::{AttributionError, CgroupView},
    config::Config,
    enforcement::{EnforcementError, compute::ComputeStat},
    nvml::Update as NvmlUpdate,
    policy::LimitUpdate,
    probes::events::KernelEvent,
};

/// Per cgroup path, what the compute controller does.
pub type ComputeStats = BTreeMap<String, ComputeStat>;

/// Why a request to the state task failed.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The state task is gone (the daemon is stopping).
    #[error("the daemon is shutting down")]
    Stopped,
    #[error(transparent)]
    Attribution(#[from] AttributionError),
    #[error(transparent)]
    Enforcement(#[from] EnforcementError),
}

/// Whether NVML answers, and why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlStatus {
    pub available: bool,
    /// `available`, or the reason it is not (library missing, no GPU, the failing call).
    pub status: String,
}

/// Everything the state task reacts to.
pub(super) enum Message {
    Request(Request),
    /// Events in the order the ring held them.
    Kernel(Vec<KernelEvent>),
    /// Result of a `/proc` scan run off the state task.
    Scanned(BTreeSet<u32>),
    /// What the NVML sampler saw.
    Nvml(NvmlUpdate),
    /// A cgroup with limits was removed ([`removals`]).
    CgroupRemoved,
    /// A reader found the published view stale ([`view`]).
    Refresh,
}

/// Changes for the state task, each with its reply channel (reads go to the published
/// [`View`], but for one cgroup when that is stale).
pub(super) enum Request {
    /// One cgroup, when the view is stale (a whole new view costs far more).
    GetCgroup {
        path: String,
        reply: oneshot::Sender<Result<CgroupView, AttributionError>>,
    },
    SetLimits {
        cgroup: String,
        gpu: String,
        update: LimitUpdate,
        reply: oneshot::Sender<Result<gpud_api::LimitState, EnforcementError>>,
    },
    ClearLimits {
        cgroup: String,
        gpu: String,
        names: Vec<String>,
        reply: oneshot::Sender<Result<(), EnforcementError>>,
    },
    /// A cgroup's GPU memory also charged to, and held to the limits of, another cgroup.
    ShareCharges {
        cgroup: String,
        group: String,
        reply: oneshot::Sender<Result<(), EnforcementError>>,
    },
    /// Names the workload a cgroup runs (labels only).
    SetWorkload {
        cgroup: String,
        names: crate::policy::workloads::Names,
        reply: oneshot::Sender<Result<(), EnforcementError>>,
    },
    /// A reloaded configuration: each owner applies its live keys.
    Reconfigure(Box<Config>, oneshot::Sender<()>),
}
