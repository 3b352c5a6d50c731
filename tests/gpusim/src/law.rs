//! gpud's control law (`gpud::enforcement::compute::law`) on the simulated GPU: the daemon's
//! reads of NVML handed to it as the daemon hands them (per GPU, the running processes, the
//! per-process samples and the device-level utilization windows newer than the last read), its
//! commands carried out at their times through the simulated freezer and the simulated RM
//! controls by an actuator thread that sleeps to each command's time (as the daemon's,
//! `gpud::enforcement::compute::run`).

use std::collections::{BTreeMap, VecDeque};

use gpud::enforcement::compute::law::{
    Command, DeviceSample, Law, LawParams, Lever, ProcSample, Reading, Tenant,
};

use crate::{
    Nanos,
    control::{Controller, Ctx, TenantId},
};

/// From a deadline to the actuator thread running (`clock_nanosleep` wake-up and scheduling).
const WAKE_LATENCY: Nanos = 60_000;

fn wake(at: Nanos) -> Nanos {
    at + WAKE_LATENCY
}

/// The law driven in virtual time.
pub struct LawController {
    law: Law,
    /// Per GPU: the newest per-process sample timestamp read (the sampler's `last_seen`).
    last_seen: BTreeMap<u32, u64>,
    /// Per GPU: the newest device-level window read (its own `last_seen`).
    last_device: BTreeMap<u32, u64>,
    pending: VecDeque<(Nanos, u32, Command)>,
    period_end: Nanos,
}

impl LawController {
    pub fn new(params: LawParams) -> Self {
        Self {
            law: Law::new(params),
            last_seen: BTreeMap::new(),
            last_device: BTreeMap::new(),
            pending: VecDeque::new(),
            period_end: 0,
        }
    }

    pub fn law(&self) -> &Law {
        &self.law
    }

    fn tenant_of(ctx: &Ctx<'_>, pid: u32) -> Option<TenantId> {
        ctx.tenants().iter().find(|t| t.pid == pid).map(|t| t.id)
    }

    fn execute(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now();
        while self.pending.front().is_some_and(|(at, _, _)| *at <= now) {
            let Some((_, _, c)) = self.pending.pop_front() else {
                break;
            };
            match c {
                Command::Freeze { unit, frozen } => ctx.freeze_cgroup(&unit, frozen),
                Command::Hold { pid, lever, held } => {
                    if let Some(t) = Self::tenant_of(ctx, pid) {
                        match lever {
                            // FIFO_DISABLE_CHANNELS on the process's channels.
                            Lever::Channels => {
                                ctx.disable_channels(t, held);
                            }
                            // GPFIFO_SCHEDULE off, then PREEMPT; back on to let go.
                            Lever::Runlist => {
                                ctx.schedule(t, !held);
                                if held {
                                    ctx.preempt(t);
                                }
                            }
                        }
                    }
                }
                Command::Timeslice { pid, us } => {
                    if let Some(t) = Self::tenant_of(ctx, pid) {
                        ctx.set_timeslice(t, us);
                    }
                }
            }
        }
    }

    fn begin_period(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now();
        let plan = self.law.plan(now);
        // Commands planned earlier that lie ahead stand (a freezer cycle spans periods), but
        // for GPUs planned anew.
        self.pending
            .retain(|(_, gpu, _)| !plan.replanned.contains(gpu));
        self.pending.extend(
            plan.commands
                .into_iter()
                .map(|(at, gpu, c)| (if at <= now { now } else { wake(at) }, gpu, c)),
        );
        self.pending.make_contiguous().sort_by_key(|(at, _, _)| *at);
        self.period_end = wake(plan.end);
        for &(at, _, _) in &self.pending {
            ctx.wake_at(at);
        }
        ctx.wake_at(self.period_end);
        self.execute(ctx);
    }
}

impl Controller for LawController {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        self.begin_period(ctx);
    }

    fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now();
        let nvml = ctx.nvml();
        let mut readings = Vec::new();
        for gpu in 0..nvml.device_count() {
            let running = nvml
                .running_compute_processes(gpu)
                .unwrap_or_default()
                .iter()
                .map(|p| p.pid)
                .collect();
            let seen = self.last_seen.get(&gpu).copied();
            let samples: Vec<ProcSample> = nvml
                .process_utilization_stats(gpu, seen)
                .unwrap_or_default()
                .iter()
                .map(|s| ProcSample {
                    pid: s.pid,
                    timestamp_us: s.timestamp,
                    sm_util: s.sm_util,
                })
                .collect();
            if let Some(newest) = samples.iter().map(|s| s.timestamp_us).max() {
                self.last_seen.insert(gpu, newest);
            }
            let seen = self.last_device.get(&gpu).copied();
            let device: Vec<DeviceSample> = nvml
                .utilization_samples(gpu, seen)
                .unwrap_or_default()
                .iter()
                .map(|s| DeviceSample {
                    timestamp_us: s.timestamp,
                    util: s.value,
                })
                .collect();
            if let Some(newest) = device.iter().map(|s| s.timestamp_us).max() {
                self.last_device.insert(gpu, newest);
            }
            readings.push(Reading {
                gpu,
                running,
                samples,
                device,
                // The simulated NVML stamps samples with virtual time.
                clock_us: now / 1_000,
            });
        }
        let tenants: Vec<Tenant> = ctx
            .tenants()
            .iter()
            .map(|t| Tenant {
                pid: t.pid,
                gpu: t.gpu,
                unit: t.cgroup.clone(),
                limits: t.limits.clone(),
                hw: true,
            })
            .collect();
        self.law.observe(ctx.now(), &tenants, &readings);
    }

    fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
        if ctx.now() >= self.period_end {
            self.execute(ctx);
            self.begin_period(ctx);
        } else {
            self.execute(ctx);
        }
    }
}
