//! The controller interface: what a daemon outside the tenants can see and do, and when.
//!
//! A [`Controller`] is called on every NVML sampling interval of the daemon with a [`Ctx`] that
//! answers the NVML calls as they would return at that moment ([`Nvml`]), lists the tenants the
//! daemon knows (pid, cgroup, policy), and takes its actions: `cgroup.freeze` writes and the RM
//! controls on a tenant's channel group, each with its modelled latency, plus timer wake-ups.
//! Actions take effect after the callback returns, at the same virtual instant.

use gpud::policy::Limits;

use crate::{
    Nanos,
    engine::{Control, RmStatus},
    nvml::{NvmlError, ProcessUtilizationSample, UtilizationSample},
    sim::Gpu,
    tenant::Tenant,
};

/// A tenant, by its index in the scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantId(pub usize);

/// What the daemon knows of a tenant process.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantInfo {
    pub id: TenantId,
    pub name: String,
    pub pid: u32,
    /// Its cgroup (what `/proc/<pid>/cgroup` reads).
    pub cgroup: String,
    pub gpu: u32,
    /// The policy in force for its cgroup on its GPU.
    pub limits: Limits,
    /// It has a context on its GPU (started, not yet exited).
    pub running: bool,
}

/// A controller under test.
pub trait Controller {
    /// Called once at time 0, before anything runs.
    fn start(&mut self, _ctx: &mut Ctx<'_>) {}
    /// The daemon's NVML sampling interval came round (`nvml.sample_interval_ms`).
    fn on_sample(&mut self, ctx: &mut Ctx<'_>);
    /// A wake-up asked for with [`Ctx::wake_at`] came due.
    fn on_wake(&mut self, _ctx: &mut Ctx<'_>) {}
}

/// No control at all: the driver's own time-slicing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoControl;

impl Controller for NoControl {
    fn on_sample(&mut self, _ctx: &mut Ctx<'_>) {}
}

/// An action a controller took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Action {
    Freeze(TenantId, bool),
    Rm(TenantId, Control),
    Wake(Nanos),
}

/// One `nvmlDeviceGetComputeRunningProcesses` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    pub used_gpu_memory: u64,
}

/// The NVML calls, answered as of the callback's instant.
#[derive(Clone, Copy)]
pub struct Nvml<'a> {
    gpus: &'a [Gpu],
    tenants: &'a [Tenant],
}

impl<'a> Nvml<'a> {
    fn gpu(&self, gpu: u32) -> Result<&'a Gpu, NvmlError> {
        self.gpus
            .get(gpu as usize)
            .ok_or(NvmlError::InvalidArgument)
    }

    pub fn device_count(&self) -> u32 {
        self.gpus.len() as u32
    }

    /// `nvmlDeviceGetComputeRunningProcesses`: processes with a context on the GPU (frozen or
    /// not, running kernels or not).
    pub fn running_compute_processes(&self, gpu: u32) -> Result<Vec<ProcessInfo>, NvmlError> {
        self.gpu(gpu)?;
        Ok(self
            .tenants
            .iter()
            .filter(|t| t.spec.gpu == gpu && t.host != crate::tenant::Host::NotStarted && !t.exited)
            .map(|t| ProcessInfo {
                pid: t.spec.pid,
                used_gpu_memory: 1 << 30,
            })
            .collect())
    }

    /// `nvmlDeviceGetProcessUtilization(last_seen)` (nvml-wrapper's
    /// `process_utilization_stats`): `NotFound` when no sample is newer.
    pub fn process_utilization_stats(
        &self,
        gpu: u32,
        last_seen: Option<u64>,
    ) -> Result<Vec<ProcessUtilizationSample>, NvmlError> {
        self.gpu(gpu)?.nvml.process_utilization_stats(last_seen)
    }

    /// `nvmlDeviceGetUtilizationRates().gpu` (percent of the last window).
    pub fn utilization_rate(&self, gpu: u32) -> Result<u32, NvmlError> {
        Ok(self.gpu(gpu)?.nvml.utilization_rate())
    }

    /// `nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES, last_seen)`.
    pub fn utilization_samples(
        &self,
        gpu: u32,
        last_seen: Option<u64>,
    ) -> Result<Vec<UtilizationSample>, NvmlError> {
        self.gpu(gpu)?.nvml.utilization_samples(last_seen)
    }
}

/// What a controller callback sees and does.
pub struct Ctx<'a> {
    pub(crate) now: Nanos,
    pub(crate) gpus: &'a [Gpu],
    pub(crate) tenants: &'a [Tenant],
    pub(crate) infos: &'a [TenantInfo],
    pub(crate) actions: Vec<Action>,
}

impl<'a> Ctx<'a> {
    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn nvml(&self) -> Nvml<'a> {
        Nvml {
            gpus: self.gpus,
            tenants: self.tenants,
        }
    }

    /// The tenants the daemon knows (all of the scenario's; `running` says which have a
    /// context now).
    pub fn tenants(&self) -> &'a [TenantInfo] {
        self.infos
    }

    /// The cgroup of a process (`/proc/<pid>/cgroup`), if it exists.
    pub fn cgroup_of(&self, pid: u32) -> Option<&'a str> {
        self.infos
            .iter()
            .find(|t| t.pid == pid)
            .map(|t| t.cgroup.as_str())
    }

    /// Writes `cgroup.freeze` of the tenant's cgroup: it stops (or resumes) issuing work after
    /// the freezer's latency; its queued kernels keep running.
    pub fn freeze(&mut self, tenant: TenantId, frozen: bool) {
        self.actions.push(Action::Freeze(tenant, frozen));
    }

    /// Freezes or thaws every tenant in `cgroup` (one `cgroup.freeze` write).
    pub fn freeze_cgroup(&mut self, cgroup: &str, frozen: bool) {
        for t in self.infos.iter().filter(|t| t.cgroup == cgroup) {
            self.actions.push(Action::Freeze(t.id, frozen));
        }
    }

    fn rm(&mut self, tenant: TenantId, control: Control) -> RmStatus {
        let Some(t) = self.tenants.get(tenant.0) else {
            return RmStatus::InvalidObjectHandle;
        };
        if t.exited || t.host == crate::tenant::Host::NotStarted {
            return RmStatus::InvalidObjectHandle;
        }
        self.actions.push(Action::Rm(tenant, control));
        RmStatus::Ok
    }

    /// NVA06C_CTRL_CMD_SET_TIMESLICE on the tenant's channel group.
    pub fn set_timeslice(&mut self, tenant: TenantId, us: u64) -> RmStatus {
        self.rm(tenant, Control::SetTimeslice(us))
    }

    /// NVA06C_CTRL_CMD_GPFIFO_SCHEDULE (`enabled`: on the runlist).
    pub fn schedule(&mut self, tenant: TenantId, enabled: bool) -> RmStatus {
        self.rm(tenant, Control::Schedule(enabled))
    }

    /// NVA06C_CTRL_CMD_PREEMPT.
    pub fn preempt(&mut self, tenant: TenantId) -> RmStatus {
        self.rm(tenant, Control::Preempt)
    }

    /// NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS on the tenant's channels (queued work kept).
    pub fn disable_channels(&mut self, tenant: TenantId, disabled: bool) -> RmStatus {
        self.rm(tenant, Control::DisableChannels(disabled))
    }

    /// NVA06C_CTRL_CMD_GET_TIMESLICE (µs): the value last set, not what the hardware uses.
    pub fn get_timeslice(&self, tenant: TenantId) -> Option<u64> {
        let t = self.tenants.get(tenant.0)?;
        let gpu = self.gpus.get(t.spec.gpu as usize)?;
        Some(gpu.engine.requested_timeslice(t.tsg) / 1_000)
    }

    /// Calls [`Controller::on_wake`] at `at` (not before now).
    pub fn wake_at(&mut self, at: Nanos) {
        self.actions.push(Action::Wake(at.max(self.now)));
    }
}
