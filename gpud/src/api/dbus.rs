//! The D-Bus service `dev.gpud.Daemon1`: object `/dev/gpud/Daemon1`, interface
//! `dev.gpud.Manager1` (documented in docs/dbus-api.md), and the client proxy gpudctl uses.
//!
//! Handlers hold no state: they validate arguments and ask the state task over a channel.

// Signal arguments are the D-Bus signature; zbus generates functions with one parameter each.
#![allow(clippy::too_many_arguments)]

use std::collections::BTreeMap;

use tokio::sync::{mpsc, oneshot};
use zbus::interface;

use super::authz::Authorizer;
use super::model::{
    CgroupRecord, ComputeRecord, GpuRecord, IdleRecord, LimitRecord, NvmlEventRecord,
    NvmlUsageRecord, ProcessRecord,
};
use crate::{
    attribution::{AttributionError, CgroupError},
    daemon::{Message, Request},
    enforcement::{EnforcementError, LimitNotice},
    policy::{LimitUpdate, LimitValueIn, PolicyError},
};

pub const BUS_NAME: &str = "dev.gpud.Daemon1";
pub const OBJECT_PATH: &str = "/dev/gpud/Daemon1";
pub const MANAGER_INTERFACE: &str = "dev.gpud.Manager1";

/// Methods (of any `dev.gpud.*` interface) that change state: only root and the admin group may
/// call them. The shipped bus policy (systemd/dev.gpud.Daemon1.conf) allows every other method to
/// everyone and these to root and the group only; the daemon checks their callers again
/// ([`Authorizer`]). A test introspects the daemon and fails on a method that is in neither list,
/// so a new method must be classified here or in the policy file.
pub const MUTATING_METHODS: &[&str] = &["SetLimits", "ClearLimits"];

/// Errors returned to D-Bus callers, named `dev.gpud.Error.<Variant>`.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "dev.gpud.Error")]
pub enum ApiError {
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The named object (e.g. a cgroup path) does not exist.
    NotFound(String),
    /// An argument is malformed (e.g. a path with `..`).
    InvalidArgument(String),
    /// The daemon could not complete the request.
    Failed(String),
    /// The caller may not call this method (it changes state: root and the admin group only).
    AccessDenied(String),
}

impl From<AttributionError> for ApiError {
    fn from(e: AttributionError) -> Self {
        match e {
            AttributionError::Cgroup(CgroupError::NotFound(_)) => Self::NotFound(e.to_string()),
            AttributionError::Cgroup(CgroupError::InvalidPath { .. }) => {
                Self::InvalidArgument(e.to_string())
            }
            other => Self::Failed(other.to_string()),
        }
    }
}

impl From<EnforcementError> for ApiError {
    fn from(e: EnforcementError) -> Self {
        match e {
            EnforcementError::Attribution(a) => a.into(),
            EnforcementError::Policy(PolicyError::Write { .. }) => Self::Failed(e.to_string()),
            EnforcementError::Policy(_) | EnforcementError::UnknownGpu(..) => {
                Self::InvalidArgument(e.to_string())
            }
        }
    }
}

/// Longest string argument accepted; longer ones are refused before any work.
const MAX_ARG_LEN: usize = 4096;

fn check_len(what: &str, s: &str) -> Result<(), ApiError> {
    if s.len() > MAX_ARG_LEN {
        return Err(ApiError::InvalidArgument(format!(
            "{what} is {} bytes long (at most {MAX_ARG_LEN})",
            s.len()
        )));
    }
    Ok(())
}

fn limit_value(v: &zbus::Variant<'_>) -> LimitValueIn {
    use zbus::Variant as V;
    match v {
        V::U64(n) => LimitValueIn::Unsigned(*n),
        V::U32(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::U16(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::U8(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::I64(n) => LimitValueIn::Signed(*n),
        V::I32(n) => LimitValueIn::Signed(i64::from(*n)),
        V::I16(n) => LimitValueIn::Signed(i64::from(*n)),
        V::Str(s) => LimitValueIn::Text(s.as_str().chars().take(MAX_ARG_LEN).collect()),
        V::Variant(inner) => limit_value(inner),
        other => LimitValueIn::Other(other.value_signature().to_string()),
    }
}

/// Facts fixed at start-up.
#[derive(Clone, Debug)]
pub struct DaemonInfo {
    pub version: String,
    pub attach_mode: String,
    /// GPU-memory enforcement tier in force: `deny`, `react` or `dmem`.
    pub enforcement_tier: String,
    /// What the react tier does: `kill`, `freeze` or `notify`.
    pub react_action: String,
    pub kernel_capabilities: BTreeMap<String, bool>,
    pub cgroup_root: String,
    pub probes_resumed: bool,
}

type ComputeStats = std::collections::BTreeMap<String, crate::enforcement::compute::ComputeStat>;

pub struct Manager {
    tx: mpsc::Sender<Message>,
    info: DaemonInfo,
    /// Published by the compute controller (its own task) after every period.
    compute: Option<tokio::sync::watch::Receiver<ComputeStats>>,
    /// Who may call [`MUTATING_METHODS`].
    authz: Authorizer,
}

impl Manager {
    pub fn new(tx: mpsc::Sender<Message>, info: DaemonInfo) -> Self {
        Self {
            tx,
            info,
            compute: None,
            authz: Authorizer::default(),
        }
    }

    /// Lets members of `group` (besides root) call the mutating methods; empty: root only.
    pub fn with_admin_group(mut self, group: &str) -> Self {
        self.authz = Authorizer::new(group);
        self
    }

    pub fn with_compute_stats(mut self, rx: tokio::sync::watch::Receiver<ComputeStats>) -> Self {
        self.compute = Some(rx);
        self
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> Result<T, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Message::Request(make(reply)))
            .await
            .map_err(|_| ApiError::Failed("daemon is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Failed("daemon is shutting down".into()))
    }
}

#[interface(name = "dev.gpud.Manager1")]
impl Manager {
    /// The daemon's version.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        self.info.version.clone()
    }

    /// How the probes are attached: `fentry` or `tracepoint`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn attach_mode(&self) -> String {
        self.info.attach_mode.clone()
    }

    /// Mechanisms this kernel offers, as probed at start-up.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn kernel_capabilities(&self) -> BTreeMap<String, bool> {
        self.info.kernel_capabilities.clone()
    }

    /// Mount point of the cgroup v2 hierarchy; cgroup paths are relative to it.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn cgroup_root(&self) -> String {
        self.info.cgroup_root.clone()
    }

    /// Whether the probes were found attached (by a previous daemon) and adopted with their counts.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn probes_resumed(&self) -> bool {
        self.info.probes_resumed
    }

    /// GPU-memory enforcement tier in force: `deny`, `react` or `dmem`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn enforcement_tier(&self) -> String {
        self.info.enforcement_tier.clone()
    }

    /// What the react tier does with an allocation that crossed a limit: `kill`, `freeze` or
    /// `notify`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn react_action(&self) -> String {
        self.info.react_action.clone()
    }

    /// Sets limits on a cgroup (path relative to the cgroup v2 root) for one GPU (`all`, an
    /// index, or a UUID). `limits`: `memory_max` → bytes (t, or a quantity string such as
    /// "8Gi"). Persisted; in force in the kernel when the call returns.
    async fn set_limits(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        cgroup: &str,
        gpu: &str,
        limits: BTreeMap<String, zbus::Variant<'_>>,
    ) -> Result<(), ApiError> {
        self.authz.check(conn, &header).await?;
        check_len("cgroup", cgroup)?;
        check_len("gpu", gpu)?;
        crate::attribution::CgroupFs::normalize(cgroup)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let named: BTreeMap<String, LimitValueIn> = limits
            .iter()
            .map(|(k, v)| (k.chars().take(MAX_ARG_LEN).collect(), limit_value(v)))
            .collect();
        let update = LimitUpdate::from_named(&named)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let (cgroup, gpu) = (cgroup.to_owned(), gpu.to_owned());
        self.ask(|reply| Request::SetLimits {
            cgroup,
            gpu,
            update,
            reply,
        })
        .await?
        .map_err(ApiError::from)
    }

    /// Clears the named limits (all of them when `names` is empty) of a cgroup on one GPU.
    async fn clear_limits(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        cgroup: &str,
        gpu: &str,
        names: Vec<String>,
    ) -> Result<(), ApiError> {
        self.authz.check(conn, &header).await?;
        check_len("cgroup", cgroup)?;
        check_len("gpu", gpu)?;
        crate::attribution::CgroupFs::normalize(cgroup)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let mut seen = std::collections::BTreeSet::new();
        for n in &names {
            check_len("limit name", n)?;
            if !seen.insert(n.as_str()) {
                return Err(ApiError::InvalidArgument(format!(
                    "limit {n:?} is named more than once"
                )));
            }
        }
        let (cgroup, gpu) = (cgroup.to_owned(), gpu.to_owned());
        self.ask(|reply| Request::ClearLimits {
            cgroup,
            gpu,
            names,
            reply,
        })
        .await?
        .map_err(ApiError::from)
    }

    /// Every limit in force, ordered by cgroup and GPU.
    async fn list_limits(&self) -> Result<Vec<LimitRecord>, ApiError> {
        self.ask(Request::ListLimits).await
    }

    /// An allocation took `cgroup` over its `memory_max` on `gpu` (react tier; `action` is
    /// `killed`, `frozen` or `notified`) or was refused (`denied`). `usage` is the cgroup's usage
    /// after the allocation (react) or before it (deny).
    #[zbus(signal)]
    pub async fn memory_limit_exceeded(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        cgroup: &str,
        gpu: &str,
        pid: u32,
        bytes: u64,
        usage: u64,
        max: u64,
        action: &str,
    ) -> zbus::Result<()>;

    /// Whether NVML answers (library loaded, GPUs found, last sample succeeded).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn nvml_available(&self) -> bool {
        self.ask(Request::NvmlStatus)
            .await
            .map(|(a, _)| a)
            .unwrap_or(false)
    }

    /// `available`, or why NVML is not (library missing, no GPU, the failing call).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn nvml_status(&self) -> String {
        self.ask(Request::NvmlStatus)
            .await
            .map(|(_, s)| s)
            .unwrap_or_else(|e| format!("{e:?}"))
    }

    /// GPUs and MIG devices as NVML reports them (empty while NVML is unavailable).
    async fn list_gpus(&self) -> Result<Vec<GpuRecord>, ApiError> {
        self.ask(Request::ListGpus).await
    }

    /// NVML's per-cgroup, per-GPU figures from the last sample, beside the memory the probes
    /// charged: `(cgroup_id, cgroup, gpu, nvml_memory_bytes, ebpf_memory_bytes, sm_util,
    /// enc_util, dec_util, pids)`.
    async fn list_nvml_usage(&self) -> Result<Vec<NvmlUsageRecord>, ApiError> {
        self.ask(Request::ListNvmlUsage).await
    }

    /// What the compute controller does per cgroup: `(cgroup, duty, target, measured,
    /// throttled_usec, nr_throttled)`; empty when compute shares are off.
    async fn list_compute(&self) -> Vec<ComputeRecord> {
        let Some(rx) = &self.compute else {
            return Vec::new();
        };
        rx.borrow()
            .iter()
            .map(|(cgroup, s)| ComputeRecord {
                cgroup: cgroup.clone(),
                duty: s.duty,
                target: s.target,
                measured: s.measured,
                throttled_usec: s.throttled_usec,
                nr_throttled: s.nr_throttled,
            })
            .collect()
    }

    /// The compute controller started throttling `cgroup` (freezing it for part of each period).
    #[zbus(signal)]
    pub async fn compute_throttled(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        cgroup: &str,
    ) -> zbus::Result<()>;

    /// The most recent NVML events (critical Xid errors), oldest first: `(timestamp_us, gpu,
    /// uuid, kind, xid, pid, cgroup_id, cgroup, pids)`.
    async fn list_nvml_events(&self) -> Result<Vec<NvmlEventRecord>, ApiError> {
        self.ask(Request::ListNvmlEvents).await
    }

    /// cgroups holding GPU memory while their utilization on that GPU stayed under the idle
    /// threshold for at least the configured time (`[idle]`), longest idle first: `(cgroup,
    /// cgroup_id, gpu, memory_bytes, idle_secs, last_active, util)`.
    async fn list_idle(&self) -> Result<Vec<IdleRecord>, ApiError> {
        self.ask(Request::ListIdle).await
    }

    /// A cgroup became idle while holding GPU memory (`idle` true, after `[idle]
    /// min_duration_secs`) or stopped being so (`idle` false: active again, memory released or
    /// gone; `memory_bytes` 0 when released).
    #[zbus(signal)]
    pub async fn idle_changed(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        cgroup: &str,
        gpu: u32,
        idle: bool,
        memory_bytes: u64,
        idle_secs: u64,
    ) -> zbus::Result<()>;

    /// Every attributed cgroup, ordered by path.
    async fn list_cgroups(&self) -> Result<Vec<CgroupRecord>, ApiError> {
        self.ask(Request::ListCgroups).await
    }

    /// Every live attributed process, ordered by pid.
    async fn list_processes(&self) -> Result<Vec<ProcessRecord>, ApiError> {
        self.ask(Request::ListProcesses).await
    }

    /// One cgroup by path relative to the cgroup v2 root ("/a/b").
    async fn get_cgroup(&self, path: &str) -> Result<CgroupRecord, ApiError> {
        check_len("path", path)?;
        // Reject obviously bad input here, before it reaches the state task.
        crate::attribution::CgroupFs::normalize(path)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let path = path.to_owned();
        self.ask(|reply| Request::GetCgroup { path, reply })
            .await?
            .map_err(ApiError::from)
    }

    /// Health counters of the kernel side: `events_lost`, `procs_map_full`, `cgroups_map_full`,
    /// `matched_ioctls`.
    async fn get_kernel_stats(&self) -> Result<BTreeMap<String, u64>, ApiError> {
        self.ask(Request::KernelStats).await
    }
}

/// Client side of `dev.gpud.Manager1`.
#[zbus::proxy(
    interface = "dev.gpud.Manager1",
    default_service = "dev.gpud.Daemon1",
    default_path = "/dev/gpud/Daemon1"
)]
pub trait Manager1 {
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn attach_mode(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn kernel_capabilities(&self) -> zbus::Result<BTreeMap<String, bool>>;
    #[zbus(property)]
    fn cgroup_root(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn probes_resumed(&self) -> zbus::Result<bool>;
    fn list_cgroups(&self) -> zbus::Result<Vec<CgroupRecord>>;
    fn list_processes(&self) -> zbus::Result<Vec<ProcessRecord>>;
    fn get_cgroup(&self, path: &str) -> zbus::Result<CgroupRecord>;
    fn get_kernel_stats(&self) -> zbus::Result<BTreeMap<String, u64>>;
    #[zbus(property)]
    fn enforcement_tier(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn react_action(&self) -> zbus::Result<String>;
    fn set_limits(
        &self,
        cgroup: &str,
        gpu: &str,
        limits: BTreeMap<&str, zbus::Variant<'_>>,
    ) -> zbus::Result<()>;
    fn clear_limits(&self, cgroup: &str, gpu: &str, names: &[&str]) -> zbus::Result<()>;
    fn list_limits(&self) -> zbus::Result<Vec<LimitRecord>>;
    // Not cached by the proxy: the daemon sends no change signal for these.
    #[zbus(property(emits_changed_signal = "false"))]
    fn nvml_available(&self) -> zbus::Result<bool>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn nvml_status(&self) -> zbus::Result<String>;
    fn list_gpus(&self) -> zbus::Result<Vec<GpuRecord>>;
    fn list_nvml_usage(&self) -> zbus::Result<Vec<NvmlUsageRecord>>;
    fn list_compute(&self) -> zbus::Result<Vec<ComputeRecord>>;
    #[zbus(signal)]
    fn compute_throttled(&self, cgroup: String) -> zbus::Result<()>;
    fn list_nvml_events(&self) -> zbus::Result<Vec<NvmlEventRecord>>;
    fn list_idle(&self) -> zbus::Result<Vec<IdleRecord>>;
    #[zbus(signal)]
    fn idle_changed(
        &self,
        cgroup: String,
        gpu: u32,
        idle: bool,
        memory_bytes: u64,
        idle_secs: u64,
    ) -> zbus::Result<()>;
    #[zbus(signal)]
    fn memory_limit_exceeded(
        &self,
        cgroup: String,
        gpu: String,
        pid: u32,
        bytes: u64,
        usage: u64,
        max: u64,
        action: String,
    ) -> zbus::Result<()>;
}

/// Publishes limit notices as `MemoryLimitExceeded` signals until the channel closes.
pub async fn publish_notices(
    conn: zbus::Connection,
    mut rx: tokio::sync::broadcast::Receiver<LimitNotice>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let n = match rx.recv().await {
            Ok(n) => n,
            Err(RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "limit signals dropped (subscriber too slow)");
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        let emitter = match zbus::object_server::SignalEmitter::new(&conn, OBJECT_PATH) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("cannot emit signal: {e}");
                continue;
            }
        };
        if let Err(e) = Manager::memory_limit_exceeded(
            &emitter, &n.cgroup, &n.gpu, n.pid, n.bytes, n.usage, n.max, &n.action,
        )
        .await
        {
            tracing::warn!("cannot emit MemoryLimitExceeded: {e}");
        }
    }
}

/// A connection builder for the bus named by `bus`: `"system"` or a D-Bus address.
pub fn connect_builder(bus: &str) -> zbus::connection::Builder<'static> {
    match bus {
        "system" => zbus::connection::Builder::system(),
        address => zbus::connection::Builder::address(address),
    }
}

/// Publishes `IdleChanged` signals until the channel closes.
pub async fn publish_idle(
    conn: zbus::Connection,
    mut rx: tokio::sync::broadcast::Receiver<crate::policy::idle::IdleChange>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let c = match rx.recv().await {
            Ok(c) => c,
            Err(RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "idle signals dropped (subscriber too slow)");
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        if let Ok(emitter) = zbus::object_server::SignalEmitter::new(&conn, OBJECT_PATH)
            && let Err(e) = Manager::idle_changed(
                &emitter,
                &c.cgroup,
                c.gpu,
                c.idle,
                c.memory_bytes,
                c.idle_secs,
            )
            .await
        {
            tracing::warn!("cannot emit IdleChanged: {e}");
        }
    }
}

/// Publishes `ComputeThrottled` signals until the channel closes.
pub async fn publish_throttled(
    conn: zbus::Connection,
    mut rx: tokio::sync::broadcast::Receiver<String>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let cgroup = match rx.recv().await {
            Ok(c) => c,
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => return,
        };
        if let Ok(emitter) = zbus::object_server::SignalEmitter::new(&conn, OBJECT_PATH)
            && let Err(e) = Manager::compute_throttled(&emitter, &cgroup).await
        {
            tracing::warn!("cannot emit ComputeThrottled: {e}");
        }
    }
}
