//! The typed handle to the state task: what the API layer (D-Bus, metrics) may ask and change.
//! A change is one request on the state task's channel with a oneshot reply; a question reads
//! the state task's published [`View`] (see `snapshot`). Callers never see the message types.

use std::{collections::BTreeMap, sync::Arc};

use tokio::sync::{mpsc, oneshot, watch};

use super::{
    joins::NvmlUsage,
    messages::{ComputeStats, DaemonError, Message, NvmlStatus, Request},
    view::{Reader, View},
};
use crate::{
    attribution::{CgroupView, ProcessView},
    config::Config,
    nvml::{AttributedXid, GpuStatus},
    policy::{LimitEntry, LimitUpdate, idle::IdleEntry},
};
use gpud_api::LimitState;

/// Everything one metrics scrape shows, from one view of the state task.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub cgroups: Vec<CgroupView>,
    pub nvml_usage: Vec<NvmlUsage>,
    pub nvml_available: bool,
    pub gpus: Vec<GpuStatus>,
    pub kernel_stats: BTreeMap<String, u64>,
    pub idle: Vec<IdleEntry>,
    pub compute: ComputeStats,
    /// Tenants' scheduling controls the guard acted on, by (cgroup, control, action).
    pub guard_counts: crate::enforcement::guard::GuardCounts,
    /// Workload names by cgroup path.
    pub workloads: crate::policy::workloads::ByCgroup,
}

/// The state task's handle: cheap to clone, one per API object.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Message>,
    /// The state task's inbox for changes, taken before kernel events ([`super::task::run_state`]).
    writes: mpsc::Sender<Request>,
    reader: Reader,
    /// Published by the compute controller (its own task) after every period; `None` when
    /// compute shares are off.
    compute: Option<watch::Receiver<ComputeStats>>,
}

impl Handle {
    pub(super) fn new(
        tx: mpsc::Sender<Message>,
        writes: mpsc::Sender<Request>,
        reader: Reader,
        compute: Option<watch::Receiver<ComputeStats>>,
    ) -> Self {
        Self {
            tx,
            writes,
            reader,
            compute,
        }
    }

    /// The latest view of the state: everything changed before this call is in it (see
    /// [`View`]'s module for the rule); one reply built from one view is never torn.
    pub async fn view(&self) -> Result<Arc<View>, DaemonError> {
        self.reader.view().await
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> Result<T, DaemonError> {
        let (reply, rx) = oneshot::channel();
        let request = make(reply);
        // Changes go ahead of the kernel's backlog; a stale cgroup's read stays in line with
        // the events it must reflect.
        let sent = match request {
            Request::GetCgroup { .. } => self.tx.send(Message::Request(request)).await.is_ok(),
            Request::SetLimits { .. }
            | Request::ClearLimits { .. }
            | Request::SetWorkload { .. }
            | Request::ShareCharges { .. }
            | Request::Reconfigure(..) => self.writes.send(request).await.is_ok(),
        };
        if !sent {
            return Err(DaemonError::Stopped);
        }
        rx.await.map_err(|_| DaemonError::Stopped)
    }

    /// Every live attributed process, ordered by pid.
    pub async fn list_processes(&self) -> Result<Vec<ProcessView>, DaemonError> {
        Ok(self.view().await?.processes.clone())
    }

    /// One cgroup by path relative to the cgroup v2 root.
    pub async fn get_cgroup(&self, path: &str) -> Result<CgroupView, DaemonError> {
        self.reader.cgroup(path).await
    }

    /// Health counters of the kernel side.
    pub async fn kernel_stats(&self) -> Result<BTreeMap<String, u64>, DaemonError> {
        Ok(self.reader.kernel_stats())
    }

    /// Sets limits on a cgroup for one GPU selector; persisted and in force when it returns,
    /// or pending (the state says why) while NVML cannot name the GPU.
    pub async fn set_limits(
        &self,
        cgroup: &str,
        gpu: &str,
        update: LimitUpdate,
    ) -> Result<LimitState, DaemonError> {
        let (cgroup, gpu) = (cgroup.to_owned(), gpu.to_owned());
        Ok(self
            .ask(|reply| Request::SetLimits {
                cgroup,
                gpu,
                update,
                reply,
            })
            .await??)
    }

    /// Clears the named limits (all when `names` is empty) of a cgroup on one GPU selector.
    pub async fn clear_limits(
        &self,
        cgroup: &str,
        gpu: &str,
        names: Vec<String>,
    ) -> Result<(), DaemonError> {
        let (cgroup, gpu) = (cgroup.to_owned(), gpu.to_owned());
        Ok(self
            .ask(|reply| Request::ClearLimits {
                cgroup,
                gpu,
                names,
                reply,
            })
            .await??)
    }

    /// GPU memory charged to `cgroup` from now on is also charged to `group` and held to its
    /// limits ([`crate::attribution::Attribution::share_charges`]).
    pub async fn share_charges(&self, cgroup: &str, group: &str) -> Result<(), DaemonError> {
        let (cgroup, group) = (cgroup.to_owned(), group.to_owned());
        Ok(self
            .ask(|reply| Request::ShareCharges {
                cgroup,
                group,
                reply,
            })
            .await??)
    }

    /// Names the workload `cgroup` runs (no names: forgets them); persisted when it returns.
    pub async fn set_workload(
        &self,
        cgroup: &str,
        names: crate::policy::workloads::Names,
    ) -> Result<(), DaemonError> {
        let cgroup = cgroup.to_owned();
        Ok(self
            .ask(|reply| Request::SetWorkload {
                cgroup,
                names,
                reply,
            })
            .await??)
    }

    /// Every stored limit and its state, ordered by cgroup and GPU.
    pub async fn list_limits(&self) -> Result<Vec<(LimitEntry, LimitState)>, DaemonError> {
        Ok(self.view().await?.limits.clone())
    }

    /// GPUs and MIG devices as NVML last reported them.
    pub async fn list_gpus(&self) -> Result<Vec<GpuStatus>, DaemonError> {
        Ok(self.view().await?.gpus.clone())
    }

    /// NVML's per-cgroup figures from the last sample beside the probes' memory figures.
    pub async fn list_nvml_usage(&self) -> Result<Vec<NvmlUsage>, DaemonError> {
        Ok(self.view().await?.nvml_usage.clone())
    }

    pub async fn nvml_status(&self) -> Result<NvmlStatus, DaemonError> {
        Ok(self.view().await?.nvml.clone())
    }

    /// The in-container memory view: `on`, `off` or `unavailable: <why>`.
    pub async fn memory_info_view(&self) -> Result<String, DaemonError> {
        Ok(self.view().await?.memory_info.clone())
    }

    /// The scheduler guard's state (`enforce (deny, rewrite)`, `audit`, ...).
    pub async fn scheduler_guard(&self) -> Result<String, DaemonError> {
        Ok(self.view().await?.scheduler_guard.clone())
    }

    /// The most recent Xid events, oldest first.
    pub async fn list_nvml_events(&self) -> Result<Vec<AttributedXid>, DaemonError> {
        Ok(self.view().await?.nvml_events.clone())
    }

    /// cgroups reported idle while holding GPU memory, longest idle first.
    pub async fn list_idle(&self) -> Result<Vec<IdleEntry>, DaemonError> {
        Ok(self.view().await?.idle())
    }

    /// What a metrics scrape shows, all from one moment of the state task.
    pub async fn snapshot(&self) -> Result<Figures, DaemonError> {
        let view = self.view().await?;
        Ok(Figures {
            cgroups: view.cgroups.clone(),
            nvml_usage: view.nvml_usage.clone(),
            nvml_available: view.nvml.available,
            gpus: view.gpus.clone(),
            kernel_stats: self.reader.kernel_stats(),
            idle: view.idle(),
            compute: self.compute_stats().unwrap_or_default(),
            guard_counts: view.guard_counts.clone(),
            workloads: view.workloads.clone(),
        })
    }

    /// What the compute controller does per cgroup; `None` when compute shares are off.
    pub fn compute_stats(&self) -> Option<ComputeStats> {
        self.compute.as_ref().map(|rx| rx.borrow().clone())
    }

    /// Hands a reloaded configuration to the state task, which applies its live keys and passes
    /// on the controller's and the NVML sampler's; returns once they are in force.
    pub async fn reconfigure(&self, config: Config) -> Result<(), DaemonError> {
        self.ask(|reply| Request::Reconfigure(Box::new(config), reply))
            .await
    }
}
