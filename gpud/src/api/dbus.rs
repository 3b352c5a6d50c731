//! The D-Bus service `dev.gpud.Daemon1`: object `/dev/gpud/Daemon1`, interface
//! `dev.gpud.Manager1` (documented in docs/dbus-api.md), and the client proxy gpudctl uses.
//!
//! Handlers hold no state but a cache of the last full listing: they validate arguments, read
//! the state task's published view or ask it for changes through its [`Handle`], and turn its
//! answers into gpud-api's records.

// Signal arguments are the D-Bus signature; zbus generates functions with one parameter each.
#![allow(clippy::too_many_arguments)]

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError, Weak},
};

use tokio::sync::watch;
use zbus::interface;

use gpud_api::{
    CgroupRecord, ComputeRecord, GpuRecord, IdleRecord, LimitRecord, NvmlEventRecord,
    NvmlUsageRecord, OBJECT_PATH, ProcessRecord, limits::LimitDict,
};

use super::{
    args::MAX_ARG_LEN,
    authz::Authorizer,
    error::ApiError,
    records::{all, compute_record, limit_record},
};
use crate::{
    daemon::{DaemonInfo, Handle, View},
    notice::Notice,
    policy::LimitUpdate,
};

fn check_len(what: &str, s: &str) -> Result<(), ApiError> {
    if s.len() > MAX_ARG_LEN {
        return Err(ApiError::InvalidArgument(format!(
            "{what} is {} bytes long (at most {MAX_ARG_LEN})",
            s.len()
        )));
    }
    Ok(())
}

/// `SetLimits` after its caller was authorized, for the manager and the cgroup objects alike:
/// the arguments checked, then the change asked of the state task.
pub(super) async fn set_limits_of(
    daemon: &Handle,
    cgroup: &str,
    gpu: &str,
    limits: LimitDict,
) -> Result<(String, String), ApiError> {
    check_len("cgroup", cgroup)?;
    check_len("gpu", gpu)?;
    crate::cgroupfs::CgroupFs::normalize(cgroup)
        .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
    let update = LimitUpdate::from(
        limits
            .into_result()
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?,
    );
    Ok(daemon.set_limits(cgroup, gpu, update).await?.to_wire())
}

/// `ClearLimits` after its caller was authorized (see [`set_limits_of`]).
pub(super) async fn clear_limits_of(
    daemon: &Handle,
    cgroup: &str,
    gpu: &str,
    names: Vec<String>,
) -> Result<(), ApiError> {
    check_len("cgroup", cgroup)?;
    check_len("gpu", gpu)?;
    crate::cgroupfs::CgroupFs::normalize(cgroup)
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
    Ok(daemon.clear_limits(cgroup, gpu, names).await?)
}

/// A `ListCgroups` reply and the view it was made from.
type CachedListing = (Weak<View>, Arc<Vec<CgroupRecord>>);

pub struct Manager {
    daemon: Handle,
    info: DaemonInfo,
    /// Who may call [`gpud_api::MUTATING_METHODS`].
    authz: Authorizer,
    /// The last `ListCgroups` reply and the view it was made from: calls against an unchanged
    /// view (the usual case when many clients poll) serialize the same records instead of
    /// copying and converting a thousand of them again.
    cgroups_reply: Mutex<Option<CachedListing>>,
}

impl Manager {
    /// `admin_group`: members (besides root) may call the mutating methods; it follows reloads.
    pub fn new(daemon: Handle, info: DaemonInfo, admin_group: watch::Receiver<String>) -> Self {
        Self {
            daemon,
            info,
            authz: Authorizer::new(admin_group),
            cgroups_reply: Mutex::new(None),
        }
    }

    /// The `ListCgroups` records of `view`, converted once per view.
    fn cgroup_records(&self, view: &Arc<View>) -> Arc<Vec<CgroupRecord>> {
        // A panic elsewhere while holding the lock leaves nothing half-written worth refusing.
        let mut cached = self
            .cgroups_reply
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((of, records)) = cached.as_ref()
            && Weak::ptr_eq(of, &Arc::downgrade(view))
        {
            return records.clone();
        }
        let records: Arc<Vec<CgroupRecord>> = Arc::new(
            view.cgroups
                .iter()
                .cloned()
                .map(CgroupRecord::from)
                .collect(),
        );
        *cached = Some((Arc::downgrade(view), records.clone()));
        records
    }
}

#[interface(name = "dev.gpud.Manager1")]
impl Manager {
    /// The daemon's version.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        self.info.version.clone()
    }

    /// The kernel/user ABI version: the layout of the pinned maps (`<bpffs>/gpud/v<ABI>`).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn abi_version(&self) -> u32 {
        gpud_common::ABI_VERSION
    }

    /// The source revision of this build (git's commit, or `unknown`).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn revision(&self) -> String {
        crate::REVISION.to_owned()
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

    /// The hook that stops a tenant's ioctl before the driver runs it (memory deny, the scheduler
    /// guard's refusals): `lsm`, `fmod_ret` or `none`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn deny_hook(&self) -> String {
        self.info.deny_hook.clone()
    }

    /// For each hook above the one in force (`lsm`, `fmod_ret`, `kprobe`), why it is not used:
    /// the kernel's refusal (errno and verifier line) or what the kernel lacks.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn deny_hook_refusals(&self) -> BTreeMap<String, String> {
        self.info.deny_hook_refusals.clone()
    }

    /// Tenants' calls the probes do not see on this kernel (neither charged nor guarded), and
    /// why: `32-bit ioctls` in tracepoint mode or where a compat hook did not attach. Empty when
    /// every path is seen.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn unseen_calls(&self) -> BTreeMap<String, String> {
        self.info.unseen_calls.clone()
    }

    /// The driver's own memory limits: `dmem: …` (gpud writes each `memory_max` to the
    /// `dmem.max` of the GPU's region too, so the driver itself refuses past it) with the
    /// regions, or `none: …` and why.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn driver_limits(&self) -> String {
        self.info.driver_limits.clone()
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

    /// What this daemon took over at start from the previous eBPF ABI's pinned maps (an
    /// upgrade across an ABI change): `from_abi`, objects adopted, present, released and without
    /// room, the maps copied, and what was not converted. Empty when nothing was taken over.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn probes_taken_over(&self) -> BTreeMap<String, String> {
        self.info.probes_taken_over.clone()
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
    /// index, or a UUID). `limits`: names and values of gpud-api's limit schema, decoded into
    /// typed values as the message is read (e.g. `memory_max` → bytes as t, or a quantity string
    /// such as "8Gi"). Persisted; in force in the kernel when the call returns, or pending while
    /// NVML cannot name the GPU (a UUID before NVML answers). Answers the entry's state and, when
    /// pending, why (`ListLimits`' last two fields).
    async fn set_limits(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        cgroup: &str,
        gpu: &str,
        limits: LimitDict,
    ) -> Result<(String, String), ApiError> {
        self.authz.check(conn, &header).await?;
        set_limits_of(&self.daemon, cgroup, gpu, limits).await
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
        clear_limits_of(&self.daemon, cgroup, gpu, names).await
    }

    /// GPU memory charged to `cgroup` from now on is also charged to `group` (both paths
    /// relative to the cgroup v2 root, neither below the other), and `group`'s `memory_max`
    /// limits hold it as an ancestor's would: one limit over cgroups of different subtrees, such
    /// as the containers of several pods sharing one grant (`group` a cgroup made for it, with
    /// no processes). Must come before `cgroup` is charged (a container's cgroup before the
    /// container runs): a cgroup charged already is refused (`InvalidArgument`). Lasts as long
    /// as `cgroup` does; cgroups below it charge without `group`.
    async fn share_charges(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        cgroup: &str,
        group: &str,
    ) -> Result<(), ApiError> {
        self.authz.check(conn, &header).await?;
        check_len("cgroup", cgroup)?;
        check_len("group", group)?;
        Ok(self.daemon.share_charges(cgroup, group).await?)
    }

    /// Names the Kubernetes workload a cgroup runs: `names` holds `namespace`, `pod` and, for
    /// a container's cgroup, `container` (what the runtime integrations report); empty forgets
    /// them. They label the cgroup's records and metrics (`CgroupRecord`'s `workload`) and are
    /// kept across restarts until the cgroup is removed; no limit depends on them.
    async fn set_workload(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        cgroup: &str,
        names: BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        self.authz.check(conn, &header).await?;
        check_len("cgroup", cgroup)?;
        let cgroup = crate::cgroupfs::CgroupFs::normalize(cgroup)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        gpud_api::workload::check(&names).map_err(ApiError::InvalidArgument)?;
        Ok(self.daemon.set_workload(&cgroup, names).await?)
    }

    /// Every stored limit and its state, ordered by cgroup and GPU.
    async fn list_limits(&self) -> Result<Vec<LimitRecord>, ApiError> {
        Ok(self
            .daemon
            .list_limits()
            .await?
            .into_iter()
            .map(limit_record)
            .collect())
    }

    /// An allocation took `cgroup` over its `memory_max` on `gpu` (react tier; `action` is
    /// `killed`, `frozen` or `notified`) or was refused (`denied`). `usage` is the cgroup's usage
    /// after the allocation (react) or before it (deny). `source` is `kernel` (the probes, at the
    /// allocation) or `nvml` (NVML's per-process memory stayed over the limit: `bytes` is the
    /// excess, `pid` the largest holder).
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
        source: &str,
    ) -> zbus::Result<()>;

    /// The scheduler guard met a tenant's scheduling control: `control` (the driver's name),
    /// what it did (`action`: `denied`, `refused`, `clamped`, `audited` or `unenforced`) and why
    /// (`reason`: `forbidden`, `timeslice`, `foreign-client`, `legacy-path` or `flags`);
    /// `requested` is the timeslice asked (µs) or the foreign client named, `allowed` the
    /// caller's timeslice allowance (µs).
    #[zbus(signal)]
    pub async fn scheduler_control_guarded(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        cgroup: &str,
        pid: u32,
        control: &str,
        action: &str,
        reason: &str,
        requested: u64,
        allowed: u64,
    ) -> zbus::Result<()>;

    /// Whether NVML answers (library loaded, GPUs found, last sample succeeded).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn nvml_available(&self) -> bool {
        self.daemon.nvml_status().await.is_ok_and(|s| s.available)
    }

    /// `available`, or why NVML is not (library missing, no GPU, the failing call).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn nvml_status(&self) -> String {
        self.daemon
            .nvml_status()
            .await
            .map_or_else(|e| e.to_string(), |s| s.status)
    }

    /// The in-container memory view (`[enforcement] virtualize_memory_info`): `on` (limited
    /// cgroups read their limit as the GPU's memory size), `off`, or `unavailable: <why>` where
    /// the kernel refuses the rewrite. Follows reloads.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory_info_view(&self) -> String {
        self.daemon
            .memory_info_view()
            .await
            .unwrap_or_else(|e| e.to_string())
    }

    /// The scheduler guard (`[enforcement] scheduler_guard`): `off`, `audit`, `enforce (deny,
    /// rewrite)`, `enforce (rewrite)`, `enforce (deny only; ...)`, or `unenforced: <why>` where
    /// the kernel allows neither refusing nor rewriting a call. Follows reloads.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn scheduler_guard(&self) -> String {
        self.daemon
            .scheduler_guard()
            .await
            .unwrap_or_else(|e| e.to_string())
    }

    /// GPUs and MIG devices as NVML reports them (empty while NVML is unavailable).
    async fn list_gpus(&self) -> Result<Vec<GpuRecord>, ApiError> {
        Ok(self
            .daemon
            .list_gpus()
            .await?
            .iter()
            .map(GpuRecord::from)
            .collect())
    }

    /// NVML's per-cgroup, per-GPU figures from the last sample, beside the memory the probes
    /// charged: `(cgroup_id, cgroup, gpu, nvml_memory_bytes, ebpf_memory_bytes, sm_util,
    /// enc_util, dec_util, pids)`.
    async fn list_nvml_usage(&self) -> Result<Vec<NvmlUsageRecord>, ApiError> {
        Ok(all(self.daemon.list_nvml_usage().await?))
    }

    /// What the compute controller does per cgroup: `(cgroup, duty, target, measured,
    /// throttled_usec, nr_throttled)`; empty when compute shares are off.
    async fn list_compute(&self) -> Vec<ComputeRecord> {
        self.daemon
            .compute_stats()
            .unwrap_or_default()
            .iter()
            .map(|(cgroup, s)| compute_record(cgroup, s))
            .collect()
    }

    /// The compute controller started throttling `cgroup` (freezing it for part of each period).
    #[zbus(signal)]
    pub async fn compute_throttled(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        cgroup: &str,
    ) -> zbus::Result<()>;

    /// The kernel side could not deliver `lost` events since the last report (its ring buffer
    /// was full: the daemon stopped or fell behind); the sweeps reconcile what they said.
    #[zbus(signal)]
    pub async fn kernel_events_lost(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        lost: u64,
    ) -> zbus::Result<()>;

    /// The most recent NVML events (critical Xid errors), oldest first: `(timestamp_us, gpu,
    /// uuid, kind, xid, pid, cgroup_id, cgroup, pids)`.
    async fn list_nvml_events(&self) -> Result<Vec<NvmlEventRecord>, ApiError> {
        Ok(all(self.daemon.list_nvml_events().await?))
    }

    /// cgroups holding GPU memory while their utilization on that GPU stayed under the idle
    /// threshold for at least the configured time (`[idle]`), longest idle first: `(cgroup,
    /// cgroup_id, gpu, memory_bytes, idle_secs, last_active, util)`.
    async fn list_idle(&self) -> Result<Vec<IdleRecord>, ApiError> {
        Ok(all(self.daemon.list_idle().await?))
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
    async fn list_cgroups(&self) -> Result<Arc<Vec<CgroupRecord>>, ApiError> {
        let view = self.daemon.view().await?;
        Ok(self.cgroup_records(&view))
    }

    /// Every live attributed process, ordered by pid.
    async fn list_processes(&self) -> Result<Vec<ProcessRecord>, ApiError> {
        Ok(all(self.daemon.list_processes().await?))
    }

    /// One cgroup by path relative to the cgroup v2 root ("/a/b").
    async fn get_cgroup(&self, path: &str) -> Result<CgroupRecord, ApiError> {
        check_len("path", path)?;
        // Reject obviously bad input here, before it reaches the state task.
        crate::cgroupfs::CgroupFs::normalize(path)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        Ok(self.daemon.get_cgroup(path).await?.into())
    }

    /// Health counters of the kernel side: `events_lost`, `procs_map_full`, `cgroups_map_full`,
    /// `matched_ioctls`.
    async fn get_kernel_stats(&self) -> Result<BTreeMap<String, u64>, ApiError> {
        Ok(self.daemon.kernel_stats().await?)
    }
}

/// Emits the D-Bus signal of every notice until the bus closes: the manager's on its object, a
/// GPU's `Xid` on the GPU's. The inventory is the `Gpu1` objects' ([`super::gpu`]); idle changes
/// are signalled while `idle_signal` holds (`[idle] signal`, live).
pub async fn publish_notices(
    conn: zbus::Connection,
    mut rx: tokio::sync::broadcast::Receiver<Notice>,
    idle_signal: watch::Receiver<bool>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let notice = match rx.recv().await {
            Ok(n) => n,
            Err(RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "signals dropped (subscriber too slow)");
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        let name = notice.name();
        let idle = *idle_signal.borrow();
        if let Err(e) = emit(&conn, notice, idle).await {
            tracing::warn!("cannot emit {name}: {e}");
        }
    }
}

/// One notice's D-Bus shape.
async fn emit(conn: &zbus::Connection, notice: Notice, idle_signal: bool) -> zbus::Result<()> {
    let manager = || zbus::object_server::SignalEmitter::new(conn, OBJECT_PATH);
    match notice {
        Notice::MemoryLimitExceeded(n) => {
            Manager::memory_limit_exceeded(
                &manager()?,
                &n.cgroup,
                &n.gpu,
                n.pid,
                n.bytes,
                n.usage,
                n.max,
                n.action.as_str(),
                n.source.as_str(),
            )
            .await
        }
        Notice::SchedulerControlGuarded(n) => {
            Manager::scheduler_control_guarded(
                &manager()?,
                &n.cgroup,
                n.pid,
                &n.control.to_string(),
                n.action.as_str(),
                n.reason.as_str(),
                n.requested,
                n.allowed,
            )
            .await
        }
        Notice::ComputeThrottled(cgroup) => Manager::compute_throttled(&manager()?, &cgroup).await,
        Notice::IdleChanged(c) if idle_signal => {
            Manager::idle_changed(
                &manager()?,
                &c.cgroup,
                c.gpu,
                c.idle,
                c.memory_bytes,
                c.idle_secs,
            )
            .await
        }
        Notice::Xid(e) => {
            let emitter =
                zbus::object_server::SignalEmitter::new(conn, gpud_api::gpu_path(e.gpu, u32::MAX))?;
            super::gpu::Gpu::xid(&emitter, e.xid, e.pid.unwrap_or(0), e.cgroup_id, &e.cgroup).await
        }
        Notice::KernelEventsLost(lost) => Manager::kernel_events_lost(&manager()?, lost).await,
        Notice::IdleChanged(_) | Notice::Inventory(_) => Ok(()),
    }
}
