//! The virtual-time driver: GPUs (engine + NVML sampler), tenants, the cgroup freezer, the
//! daemon's sampling clock and a controller, advanced event by event. This module owns virtual
//! time, the event queue, the freezer's latencies and the ground-truth record (per-tenant engine
//! time in fixed bins, request latencies).

use std::{cmp::Reverse, collections::BinaryHeap};

use crate::{
    Nanos,
    control::{Action, Controller, Ctx, TenantId, TenantInfo},
    engine::{Engine, EngineParams},
    nvml::{NvmlModel, NvmlParams},
    rng::Rng,
    tenant::{Host, Tenant, TenantSpec},
};

/// The cgroup freezer's latencies, measured on this project's machine with a spinning process:
/// `frozen 1` about 0.2–0.3 ms after the write of 1 (up to 4 ms for the first freeze), and the
/// process running again 0.05–0.3 ms after the write of 0 (the build-and-test environment notes'
/// 13 ms thaw was not reproduced).
#[derive(Clone, Debug, PartialEq)]
pub struct FreezerParams {
    pub freeze_latency: Nanos,
    pub thaw_latency: Nanos,
}

impl Default for FreezerParams {
    fn default() -> Self {
        Self {
            freeze_latency: 300_000,
            thaw_latency: 300_000,
        }
    }
}

/// Everything about a run but its tenants.
#[derive(Clone, Debug, PartialEq)]
pub struct SimParams {
    pub gpus: u32,
    pub engine: EngineParams,
    pub nvml: NvmlParams,
    pub freezer: FreezerParams,
    /// The daemon's NVML sampling interval (`nvml.sample_interval_ms`).
    pub daemon_interval: Nanos,
    /// How long the daemon's NVML calls take: its sampler sleeps the interval after each
    /// sample (gpud/src/nvml/mod.rs, `Sampler::session`), so samples come every interval + cost.
    pub daemon_sample_cost: Nanos,
    /// When the daemon samples first (its phase against NVML's windows).
    pub daemon_phase: Nanos,
    /// When NVML's first window closes.
    pub nvml_phase: Nanos,
    /// Ground truth is recorded in bins of this length.
    pub bin: Nanos,
    pub seed: u64,
}

impl Default for SimParams {
    fn default() -> Self {
        Self {
            gpus: 1,
            engine: EngineParams::default(),
            nvml: NvmlParams::default(),
            freezer: FreezerParams::default(),
            daemon_interval: 100_000_000,
            daemon_sample_cost: 2_000_000,
            daemon_phase: 37_000_000,
            nvml_phase: 166_666_667,
            bin: 100_000_000,
            seed: 1,
        }
    }
}

/// One GPU: its engine and its NVML sampler.
#[derive(Clone, Debug)]
pub struct Gpu {
    pub engine: Engine,
    pub nvml: NvmlModel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Start(usize),
    Stop(usize),
    Wake(usize, u64),
    Arrival(usize),
    Freezer(usize, u64),
    DaemonSample,
    ControllerWake,
    Record,
}

/// Ground truth of a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub bin: Nanos,
    /// Per tenant: engine time running its kernels, cumulative at each bin boundary (index k:
    /// at k × bin).
    pub busy: Vec<Vec<Nanos>>,
    /// Per GPU: engine time running any kernel, cumulative at each bin boundary.
    pub device_busy: Vec<Vec<Nanos>>,
    /// Per tenant: (arrival, latency) of each finished request.
    pub latencies: Vec<Vec<(Nanos, Nanos)>>,
}

/// A run in virtual time.
pub struct Sim {
    params: SimParams,
    now: Nanos,
    gpus: Vec<Gpu>,
    tenants: Vec<Tenant>,
    infos: Vec<TenantInfo>,
    /// Per GPU: TSG index → tenant.
    owner: Vec<Vec<usize>>,
    heap: BinaryHeap<Reverse<(Nanos, u64, Ev)>>,
    seq: u64,
    trace: Trace,
    started: bool,
}

impl Sim {
    pub fn new(params: SimParams, specs: Vec<TenantSpec>) -> Self {
        let mut gpus: Vec<Gpu> = (0..params.gpus.max(1))
            .map(|_| Gpu {
                engine: Engine::new(params.engine.clone()),
                nvml: NvmlModel::new(params.nvml.clone(), params.nvml_phase),
            })
            .collect();
        let mut owner = vec![Vec::new(); gpus.len()];
        let mut tenants = Vec::new();
        let mut infos = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            let g = (spec.gpu as usize).min(gpus.len() - 1);
            let tsg = gpus[g].engine.add_tsg(spec.pid);
            // A TSG exists only while its process runs.
            gpus[g].engine.remove_tsg(tsg);
            owner[g].push(i);
            infos.push(TenantInfo {
                id: TenantId(i),
                name: spec.name.clone(),
                pid: spec.pid,
                cgroup: spec.cgroup.clone(),
                gpu: g as u32,
                limits: spec.limits.clone(),
                running: false,
            });
            let kernels = Rng::stream(params.seed, 2 * i as u64 + 1);
            let arrivals = Rng::stream(params.seed, 2 * i as u64 + 2);
            let mut spec = spec;
            spec.gpu = g as u32;
            tenants.push(Tenant::new(spec, tsg, kernels, arrivals));
        }
        let n = tenants.len();
        let trace = Trace {
            bin: params.bin,
            busy: vec![vec![0]; n],
            device_busy: vec![vec![0]; gpus.len()],
            latencies: vec![Vec::new(); n],
        };
        Self {
            params,
            now: 0,
            gpus,
            tenants,
            infos,
            owner,
            heap: BinaryHeap::new(),
            seq: 0,
            trace,
            started: false,
        }
    }

    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    pub fn tenants(&self) -> &[Tenant] {
        &self.tenants
    }

    /// Engine time the tenant's kernels have used so far.
    pub fn busy(&self, tenant: usize) -> Nanos {
        let t = &self.tenants[tenant];
        self.gpus[t.spec.gpu as usize].engine.busy(t.tsg)
    }

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    pub fn into_trace(mut self) -> Trace {
        for (i, t) in self.tenants.iter().enumerate() {
            self.trace.latencies[i] = t.latencies.clone();
        }
        self.trace
    }

    fn push(&mut self, at: Nanos, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at.max(self.now), self.seq, ev)));
    }

    fn begin(&mut self, controller: &mut dyn Controller) {
        self.started = true;
        for i in 0..self.tenants.len() {
            let t = &self.tenants[i];
            let (start, stop) = (t.spec.start, t.spec.stop);
            self.push(start, Ev::Start(i));
            if let Some(s) = stop {
                self.push(s, Ev::Stop(i));
            }
        }
        self.push(self.params.daemon_phase, Ev::DaemonSample);
        self.push(self.params.bin, Ev::Record);
        self.call(controller, |c, ctx| c.start(ctx));
    }

    /// Runs until `until` (inclusive of events at `until`).
    pub fn run(&mut self, controller: &mut dyn Controller, until: Nanos) {
        if !self.started {
            self.begin(controller);
        }
        loop {
            let engine_next = self
                .gpus
                .iter()
                .filter_map(|g| g.engine.next_event_time())
                .min();
            let nvml_next = self.gpus.iter().map(|g| g.nvml.next_tick()).min();
            let world_next = self.heap.peek().map(|Reverse((t, _, _))| *t);
            let Some(t) = [engine_next, nvml_next, world_next]
                .into_iter()
                .flatten()
                .min()
            else {
                break;
            };
            if t > until {
                break;
            }
            self.now = t;
            self.advance_engines(t);
            for g in 0..self.gpus.len() {
                if self.gpus[g].nvml.next_tick() <= t {
                    let gpu = &mut self.gpus[g];
                    gpu.nvml.tick(&gpu.engine);
                }
            }
            while let Some(&Reverse((at, _, ev))) = self.heap.peek() {
                if at > t {
                    break;
                }
                self.heap.pop();
                self.handle(ev, controller);
            }
        }
        self.now = until.max(self.now);
        self.advance_engines(self.now);
    }

    fn advance_engines(&mut self, t: Nanos) {
        for g in 0..self.gpus.len() {
            self.gpus[g].engine.advance_to(t);
            for c in self.gpus[g].engine.take_completions() {
                let i = self.owner[g][c.tsg.0];
                let next = {
                    let gpu = &self.gpus[g];
                    self.tenants[i].on_completion(c.at, &gpu.engine)
                };
                if let Some(at) = next {
                    self.schedule_wake(i, at);
                }
            }
        }
    }

    fn schedule_wake(&mut self, i: usize, at: Nanos) {
        self.tenants[i].wake_gen += 1;
        let g = self.tenants[i].wake_gen;
        self.push(at, Ev::Wake(i, g));
    }

    /// The tenant's host acts now, unless frozen (then it acts on thaw).
    fn act(&mut self, i: usize) {
        let t = &mut self.tenants[i];
        if t.host == Host::Stopped || t.exited {
            return;
        }
        if t.frozen {
            t.host = Host::Deferred;
            return;
        }
        let g = t.spec.gpu as usize;
        let next = t.act(self.now, &mut self.gpus[g].engine);
        if let Some(at) = next {
            self.schedule_wake(i, at);
        }
    }

    /// The process exits: RM frees its channel group, dropping the work still queued.
    fn exit(&mut self, i: usize) {
        let t = &mut self.tenants[i];
        if t.exited {
            return;
        }
        let started = t.host != Host::NotStarted;
        t.stop();
        t.exited = true;
        let (g, tsg) = (t.spec.gpu as usize, t.tsg);
        self.infos[i].running = false;
        if started {
            self.gpus[g].engine.remove_tsg(tsg);
        }
    }

    fn handle(&mut self, ev: Ev, controller: &mut dyn Controller) {
        match ev {
            Ev::Start(i) => {
                let t = &mut self.tenants[i];
                if t.exited {
                    return;
                }
                let g = t.spec.gpu as usize;
                // The process creates its context: a fresh TSG at the default timeslice.
                let tsg = self.gpus[g].engine.add_tsg(t.spec.pid);
                self.owner[g].push(i);
                t.tsg = tsg;
                t.host = Host::Busy;
                self.infos[i].running = true;
                if let Some(dt) = self.tenants[i].next_interarrival() {
                    self.push(self.now + dt, Ev::Arrival(i));
                    self.tenants[i].host = Host::Idle;
                } else {
                    self.act(i);
                }
            }
            Ev::Stop(i) => self.exit(i),
            Ev::Wake(i, g) => {
                if self.tenants[i].wake_gen == g {
                    self.act(i);
                }
            }
            Ev::Arrival(i) => {
                let t = &mut self.tenants[i];
                if t.host == Host::Stopped || t.exited {
                    return;
                }
                t.requests.push_back(self.now);
                if let Some(dt) = t.next_interarrival() {
                    self.push(self.now + dt, Ev::Arrival(i));
                }
                if self.tenants[i].host == Host::Idle {
                    self.act(i);
                }
            }
            Ev::Freezer(i, g) => {
                let t = &mut self.tenants[i];
                if t.freeze_gen != g {
                    return;
                }
                t.frozen = t.freeze_written;
                if !t.frozen && t.host == Host::Deferred {
                    t.host = Host::Busy;
                    self.act(i);
                }
            }
            Ev::DaemonSample => {
                let next = self.now + self.params.daemon_interval + self.params.daemon_sample_cost;
                self.push(next, Ev::DaemonSample);
                self.call(controller, |c, ctx| c.on_sample(ctx));
            }
            Ev::ControllerWake => self.call(controller, |c, ctx| c.on_wake(ctx)),
            Ev::Record => {
                self.push(self.now + self.params.bin, Ev::Record);
                for i in 0..self.tenants.len() {
                    let b = self.busy(i);
                    self.trace.busy[i].push(b);
                }
                for g in 0..self.gpus.len() {
                    let b = self.gpus[g].engine.device_busy();
                    self.trace.device_busy[g].push(b);
                }
            }
        }
    }

    /// Runs a controller callback, then applies what it did.
    fn call(
        &mut self,
        controller: &mut dyn Controller,
        f: impl FnOnce(&mut dyn Controller, &mut Ctx<'_>),
    ) {
        let actions = {
            let mut ctx = Ctx {
                now: self.now,
                gpus: &self.gpus,
                tenants: &self.tenants,
                infos: &self.infos,
                actions: Vec::new(),
            };
            f(controller, &mut ctx);
            ctx.actions
        };
        for a in actions {
            match a {
                Action::Freeze(t, frozen) => self.write_freeze(t.0, frozen),
                Action::Rm(t, control) => {
                    let tenant = &self.tenants[t.0];
                    let g = tenant.spec.gpu as usize;
                    let tsg = tenant.tsg;
                    self.gpus[g].engine.control(tsg, control);
                }
                Action::Wake(at) => self.push(at, Ev::ControllerWake),
            }
        }
    }

    /// A write to the tenant's `cgroup.freeze`: it takes effect after the freezer's latency, a
    /// later write replacing one not yet in effect.
    fn write_freeze(&mut self, i: usize, frozen: bool) {
        let t = &mut self.tenants[i];
        if t.freeze_written == frozen {
            return;
        }
        t.freeze_written = frozen;
        t.freeze_gen += 1;
        let g = t.freeze_gen;
        let f = &self.params.freezer;
        let latency = if frozen {
            f.freeze_latency
        } else {
            f.thaw_latency
        };
        self.push(self.now + latency, Ev::Freezer(i, g));
    }
}
