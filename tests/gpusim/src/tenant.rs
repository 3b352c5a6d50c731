//! Tenants: processes that feed one TSG asynchronously, like CUDA streams. A launch is accepted
//! while fewer than `depth` kernels are pending and blocks otherwise; a synchronize waits until
//! the queue is empty. This module owns the workload shapes and each tenant's host-side state
//! machine; the driver ([`crate::sim::Sim`]) owns time, freezing and the engine.

use std::collections::VecDeque;

use gpud::policy::Limits;

use crate::{
    Nanos,
    engine::{Engine, TsgId},
    rng::Rng,
};

/// What a tenant's process does.
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    /// Keeps `depth` kernels queued, always (a training loop with a deep stream).
    Saturating { kernel: Nanos, depth: usize },
    /// Launches `batch` kernels, synchronizes, repeats (tests/gpu/matmul_loop.py: 10 matmuls,
    /// then `torch.cuda.synchronize()`).
    Batched {
        kernel: Nanos,
        batch: u32,
        depth: usize,
    },
    /// Requests arrive as a Poisson process at `load` × the GPU (each request's GPU work is
    /// `kernels_per_request` × `kernel`); each launches its kernels then synchronizes; requests
    /// queue FIFO behind each other. Latency: arrival to the synchronize's return.
    LatencyCritical {
        kernel: Nanos,
        kernels_per_request: u32,
        load: f64,
    },
}

/// CUDA's default launch queue holds about a thousand launches per stream.
pub const CUDA_QUEUE_DEPTH: usize = 1024;

impl Workload {
    pub fn kernel(&self) -> Nanos {
        match *self {
            Self::Saturating { kernel, .. }
            | Self::Batched { kernel, .. }
            | Self::LatencyCritical { kernel, .. } => kernel,
        }
    }

    /// Kernels that may be pending before a launch blocks.
    pub fn depth(&self) -> usize {
        match *self {
            Self::Saturating { depth, .. } | Self::Batched { depth, .. } => depth.max(1),
            Self::LatencyCritical { .. } => CUDA_QUEUE_DEPTH,
        }
    }

    /// Mean time between requests of a latency-critical workload.
    pub fn mean_interarrival(&self) -> Option<f64> {
        match *self {
            Self::LatencyCritical {
                kernel,
                kernels_per_request,
                load,
            } => Some(kernel as f64 * f64::from(kernels_per_request) / load.max(1e-6)),
            _ => None,
        }
    }
}

/// Host-side costs of the submitting process (CPU time, not GPU time).
#[derive(Clone, Debug, PartialEq)]
pub struct HostParams {
    /// CPU time of one launch before its kernel is queued.
    pub launch: Nanos,
    /// From a queue slot freeing to a blocked launch being queued.
    pub unblock: Nanos,
    /// From the queue emptying to a synchronize returning.
    pub sync_return: Nanos,
}

impl Default for HostParams {
    fn default() -> Self {
        Self {
            launch: 5_000,
            unblock: 2_000,
            sync_return: 10_000,
        }
    }
}

/// A tenant process: what it runs, where, under which policy, when.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSpec {
    pub name: String,
    /// cgroup v2 path (relative to the root), as `/proc/<pid>/cgroup` shows it.
    pub cgroup: String,
    pub pid: u32,
    pub gpu: u32,
    pub workload: Workload,
    pub limits: Limits,
    pub start: Nanos,
    /// When the process exits: its channel group is freed and the work still queued dropped
    /// (a neighbour that goes away, not one that winds down).
    pub stop: Option<Nanos>,
    pub host: HostParams,
    /// Kernel durations vary uniformly by ± this fraction (real kernels do; it also keeps fixed
    /// durations from aliasing with the sample period).
    pub jitter: f64,
}

impl TenantSpec {
    /// A tenant named `name` in cgroup `/name`, starting at 0, never stopping.
    pub fn new(name: &str, pid: u32, workload: Workload, limits: Limits) -> Self {
        Self {
            name: name.to_owned(),
            cgroup: format!("/{name}"),
            pid,
            gpu: 0,
            workload,
            limits,
            start: 0,
            stop: None,
            host: HostParams::default(),
            jitter: 0.05,
        }
    }

    pub fn starting(mut self, at: Nanos) -> Self {
        self.start = at;
        self
    }

    pub fn stopping(mut self, at: Nanos) -> Self {
        self.stop = Some(at);
        self
    }
}

/// What the host thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    NotStarted,
    /// It acts at a scheduled wake-up.
    Busy,
    /// A launch waits for a queue slot.
    Blocked,
    /// A synchronize waits for the queue to empty.
    Syncing,
    /// Latency-critical, no request waiting.
    Idle,
    /// It came due while frozen: it acts when thawed.
    Deferred,
    Stopped,
}

enum Step {
    Request,
    Launch,
    Sync,
}

/// One tenant's state in a run.
#[derive(Clone, Debug)]
pub struct Tenant {
    pub spec: TenantSpec,
    pub tsg: TsgId,
    pub host: Host,
    /// Effective freezer state.
    pub frozen: bool,
    /// The value last written to `cgroup.freeze`.
    pub freeze_written: bool,
    pub freeze_gen: u64,
    pub wake_gen: u64,
    pub exited: bool,
    /// Requests waiting (arrival times).
    pub requests: VecDeque<Nanos>,
    /// Per finished request: (arrival, latency).
    pub latencies: Vec<(Nanos, Nanos)>,
    launched: u32,
    sync_returning: bool,
    request: Option<Nanos>,
    tag: u64,
    /// Kernel durations and request arrivals draw from separate streams, so a tenant's arrivals
    /// are the same whatever else runs (solo and shared runs compare like for like).
    kernels: Rng,
    arrivals: Rng,
}

impl Tenant {
    pub fn new(spec: TenantSpec, tsg: TsgId, kernels: Rng, arrivals: Rng) -> Self {
        Self {
            spec,
            tsg,
            host: Host::NotStarted,
            frozen: false,
            freeze_written: false,
            freeze_gen: 0,
            wake_gen: 0,
            exited: false,
            requests: VecDeque::new(),
            latencies: Vec::new(),
            launched: 0,
            sync_returning: false,
            request: None,
            tag: 0,
            kernels,
            arrivals,
        }
    }

    /// Time to the next request (latency-critical only).
    pub fn next_interarrival(&mut self) -> Option<Nanos> {
        let mean = self.spec.workload.mean_interarrival()?;
        Some((self.arrivals.exponential(mean) as Nanos).max(1))
    }

    fn kernel_duration(&mut self) -> Nanos {
        let k = self.spec.workload.kernel() as f64;
        let j = self.spec.jitter * (2.0 * self.kernels.unit() - 1.0);
        (k * (1.0 + j)).round().max(1.0) as Nanos
    }

    fn step(&self) -> Step {
        match self.spec.workload {
            Workload::Saturating { .. } => Step::Launch,
            Workload::Batched { batch, .. } if self.launched < batch => Step::Launch,
            Workload::Batched { .. } => Step::Sync,
            Workload::LatencyCritical { .. } if self.request.is_none() => Step::Request,
            Workload::LatencyCritical {
                kernels_per_request,
                ..
            } if self.launched < kernels_per_request => Step::Launch,
            Workload::LatencyCritical { .. } => Step::Sync,
        }
    }

    /// The host acts at `now` (running, not frozen): returns when it acts next, or `None` when it
    /// now waits for the GPU or for a request (`host` says which).
    pub fn act(&mut self, now: Nanos, engine: &mut Engine) -> Option<Nanos> {
        let host = self.spec.host.clone();
        loop {
            match self.step() {
                Step::Request => {
                    let Some(arrival) = self.requests.pop_front() else {
                        self.host = Host::Idle;
                        return None;
                    };
                    self.request = Some(arrival);
                    self.host = Host::Busy;
                    return Some(now + host.launch);
                }
                Step::Launch => {
                    if engine.pending(self.tsg) >= self.spec.workload.depth() {
                        self.host = Host::Blocked;
                        return None;
                    }
                    let d = self.kernel_duration();
                    self.tag += 1;
                    engine.submit(self.tsg, d, self.tag);
                    self.launched += 1;
                    self.host = Host::Busy;
                    return Some(now + host.launch);
                }
                Step::Sync => {
                    if engine.pending(self.tsg) > 0 {
                        self.sync_returning = false;
                        self.host = Host::Syncing;
                        return None;
                    }
                    if !self.sync_returning {
                        self.sync_returning = true;
                        self.host = Host::Busy;
                        return Some(now + host.sync_return);
                    }
                    self.sync_returning = false;
                    self.launched = 0;
                    if let Some(arrival) = self.request.take() {
                        self.latencies.push((arrival, now - arrival));
                        // The next request, if one waits, is taken at once.
                        continue;
                    }
                    self.host = Host::Busy;
                    return Some(now + host.launch);
                }
            }
        }
    }

    /// One of its kernels finished at `now`: when a waiting host goes on, if it does.
    pub fn on_completion(&mut self, now: Nanos, engine: &Engine) -> Option<Nanos> {
        let pending = engine.pending(self.tsg);
        match self.host {
            Host::Blocked if pending < self.spec.workload.depth() => {
                self.host = Host::Busy;
                Some(now + self.spec.host.unblock)
            }
            Host::Syncing if pending == 0 => {
                self.sync_returning = true;
                self.host = Host::Busy;
                Some(now + self.spec.host.sync_return)
            }
            _ => None,
        }
    }

    /// It stops issuing work; waiting requests are dropped.
    pub fn stop(&mut self) {
        self.host = Host::Stopped;
        self.requests.clear();
        self.request = None;
    }
}
