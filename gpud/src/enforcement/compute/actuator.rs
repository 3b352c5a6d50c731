//! Carries out the law's commands at their times, on a thread of its own: hardware windows are
//! a few milliseconds long, so a command must not wait behind the async tasks, and the
//! controls' ioctls and `cgroup.freeze` writes block. It owns the queue of commands still to
//! do and the controls' descriptors ([`Controls`]); the compute task sends it orders and hears
//! back the processes whose controls fail.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::mpsc::{self, RecvTimeoutError},
    thread::JoinHandle,
    time::Instant,
};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, trace, warn};

use gpud_common::GPU_UNKNOWN;

use super::{
    channel::{ControlError, Controls, HeldGroups, on_gpu},
    law::{Command, Lever},
};
use crate::{
    attribution::{ChannelGroup, RmRef, TenantObjects},
    cgroupfs::{Freezer, Holder},
    probes::Matcher,
    report::Chain,
};

/// What the compute task asks of the actuator.
pub(super) enum Order {
    /// Commands to do at their times (per GPU); the commands still pending for the GPUs in
    /// `replanned` are void.
    Plan {
        commands: Vec<(Instant, u32, Command)>,
        replanned: Vec<u32>,
    },
    /// The tenants' channel groups, channels and subdevices, by process.
    Groups(BTreeMap<u32, TenantObjects>),
    /// Do these now, then stop.
    Finish(Vec<Command>),
}

/// A process whose channel groups cannot be controlled: the law falls back to the freezer for
/// its unit.
#[derive(Debug)]
pub(super) struct Failure {
    pub pid: u32,
    pub error: ControlError,
}

pub(super) struct Actuator {
    orders: mpsc::Sender<Order>,
    thread: JoinHandle<()>,
}

impl Actuator {
    pub fn spawn(
        freezer: Freezer,
        matcher: Matcher,
        held: Option<HeldGroups>,
        failures: UnboundedSender<Failure>,
    ) -> std::io::Result<Self> {
        let (orders, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("compute-actuator".into())
            .spawn(move || {
                Worker {
                    freezer,
                    controls: Controls::new(matcher, held),
                    groups: BTreeMap::new(),
                    failed: BTreeSet::new(),
                    off: BTreeSet::new(),
                    disabled: BTreeMap::new(),
                    timeslices: BTreeMap::new(),
                    failures,
                }
                .run(rx)
            })?;
        Ok(Self { orders, thread })
    }

    pub fn send(&self, order: Order) {
        // The worker stops only on `Finish` or a panic; either way nothing is left to do.
        let _ = self.orders.send(order);
    }

    /// Does `last` and waits for the worker to stop.
    pub fn finish(self, last: Vec<Command>) {
        self.send(Order::Finish(last));
        drop(self.orders);
        if self.thread.join().is_err() {
            warn!("the compute actuator panicked");
        }
    }
}

struct Worker {
    /// The one writer of `cgroup.freeze`, shared with the memory enforcement.
    freezer: Freezer,
    controls: Controls,
    groups: BTreeMap<u32, TenantObjects>,
    /// Processes whose controls failed: reported once, not tried again (except to put their
    /// groups back on the runlist).
    failed: BTreeSet<u32>,
    /// Processes whose work is held: their objects are kept until they are let go, whatever the
    /// tenants' list says meanwhile.
    off: BTreeSet<u32>,
    /// Per process, the channels this actuator disabled and has not enabled since. The driver
    /// counts disables (on the H200 a channel disabled twice stayed stopped through every later
    /// enable until its group was scheduled again), so no channel is disabled twice and only
    /// these are enabled.
    disabled: BTreeMap<u32, BTreeSet<RmRef>>,
    /// Per process, the timeslice last set on its groups: groups seen later get it too.
    timeslices: BTreeMap<u32, u64>,
    failures: UnboundedSender<Failure>,
}

impl Worker {
    fn run(mut self, orders: mpsc::Receiver<Order>) {
        // Pending commands by time, then arrival (a plan's order within one instant matters:
        // a unit is frozen before the next one is thawed).
        let mut queue: BTreeMap<(Instant, u64), (u32, Command)> = BTreeMap::new();
        let mut seq = 0u64;
        loop {
            let order = match queue.first_key_value() {
                Some((&(at, _), _)) => {
                    orders.recv_timeout(at.saturating_duration_since(Instant::now()))
                }
                None => orders.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match order {
                Ok(Order::Plan {
                    commands,
                    replanned,
                }) => {
                    queue.retain(|_, (gpu, _)| !replanned.contains(gpu));
                    for (at, gpu, c) in commands {
                        seq += 1;
                        queue.insert((at, seq), (gpu, c));
                    }
                }
                Ok(Order::Groups(mut groups)) => {
                    for (pid, o) in &groups {
                        let before = self.groups.get(pid);
                        if before.is_none_or(|b| {
                            (b.groups.len(), b.channels.len(), b.subdevices.len())
                                != (o.groups.len(), o.channels.len(), o.subdevices.len())
                        }) {
                            debug!(
                                pid,
                                groups = o.groups.len(),
                                channels = o.channels.len(),
                                subdevices = o.subdevices.len(),
                                "tenant's RM objects"
                            );
                        }
                    }
                    for pid in &self.off {
                        if let Some(g) = self.groups.remove(pid) {
                            groups.entry(*pid).or_insert(g);
                        }
                    }
                    self.controls.retain(|pid| groups.contains_key(&pid));
                    self.failed.retain(|pid| groups.contains_key(pid));
                    self.disabled.retain(|pid, _| groups.contains_key(pid));
                    self.timeslices.retain(|pid, _| groups.contains_key(pid));
                    let old = std::mem::replace(&mut self.groups, groups);
                    self.timeslice_new_groups(&old);
                }
                Ok(Order::Finish(last)) => {
                    queue.clear();
                    for c in last {
                        // Where a command names no GPU, every group of the process is meant.
                        self.execute(None, c);
                    }
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            let now = Instant::now();
            while let Some(entry) = queue.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let (gpu, c) = entry.remove();
                self.execute(Some(gpu), c);
            }
        }
    }

    fn execute(&mut self, gpu: Option<u32>, c: Command) {
        match c {
            Command::Freeze { unit, frozen } => {
                // Through the one writer: a thaw here leaves a memory freeze in force.
                if let Err(e) = self.freezer.set(Holder::Compute, &unit, frozen) {
                    // A unit removed meanwhile; the law forgets it at the next sample.
                    debug!(cgroup = %unit, frozen, "{}", Chain(&e));
                }
            }
            Command::Hold {
                pid,
                lever: Lever::Runlist,
                held,
            } => {
                trace!(pid, held, "GPFIFO_SCHEDULE");
                self.on_groups(pid, gpu, !held, |controls, g| controls.schedule(g, !held));
                self.mark(pid, held);
            }
            Command::Hold {
                pid,
                lever: Lever::Channels,
                held,
            } => {
                self.on_channels(pid, gpu, held);
                self.mark(pid, held);
            }
            Command::Timeslice { pid, us } => {
                self.timeslices.insert(pid, us);
                self.on_groups(pid, gpu, false, |controls, g| controls.timeslice(g, us));
            }
        }
    }

    fn mark(&mut self, pid: u32, held: bool) {
        if held {
            self.off.insert(pid);
        } else {
            self.off.remove(&pid);
        }
    }

    /// A process's groups made after its timeslice was set (CUDA makes its groups one by one;
    /// the objects map may be read in between) get the timeslice too.
    fn timeslice_new_groups(&mut self, old: &BTreeMap<u32, TenantObjects>) {
        let late: Vec<(ChannelGroup, u64)> = self
            .timeslices
            .iter()
            .filter_map(|(pid, us)| Some((self.groups.get(pid)?, old.get(pid), *us)))
            .flat_map(|(now, before, us)| {
                now.groups
                    .iter()
                    .filter(move |g| before.is_none_or(|b| !b.groups.contains(g)))
                    .map(move |g| (*g, us))
            })
            .collect();
        for (g, us) in late {
            if let Err(e) = self.controls.timeslice(&g, us) {
                debug!(pid = g.pid, group = g.handle, "{}", Chain(&e));
            }
        }
    }

    /// Disables (`held`) the process's channels on `gpu` (all its channels where no GPU is
    /// named) that this actuator has not disabled yet, or enables those it disabled: one
    /// `FIFO_DISABLE_CHANNELS` per GPU, on a subdevice of the process's own there.
    fn on_channels(&mut self, pid: u32, gpu: Option<u32>, held: bool) {
        if self.failed.contains(&pid) && held {
            return;
        }
        let Some(objects) = self.groups.get(&pid) else {
            return;
        };
        let on = |c: &RmRef| gpu.is_none_or(|gpu| c.gpu == gpu || c.gpu == GPU_UNKNOWN);
        let mine = self.disabled.get(&pid);
        let todo: Vec<RmRef> = if held {
            objects
                .channels
                .iter()
                .filter(|c| on(c) && !mine.is_some_and(|d| d.contains(c)))
                .copied()
                .collect()
        } else {
            mine.into_iter()
                .flatten()
                .filter(|c| on(c))
                .copied()
                .collect()
        };
        let mut by_gpu: BTreeMap<u32, Vec<RmRef>> = BTreeMap::new();
        for c in todo {
            by_gpu.entry(c.gpu).or_default().push(c);
        }
        for (on, channels) in by_gpu {
            // A subdevice of the same GPU (any, where the channels' GPU is not known).
            let Some(sub) = objects
                .subdevices
                .iter()
                .find(|s| on == GPU_UNKNOWN || s.gpu == on || s.gpu == GPU_UNKNOWN)
                .copied()
            else {
                if held {
                    self.fail(pid, ControlError::NoSubdevice { pid, gpu: on });
                }
                return;
            };
            let result = self.controls.disable_channels(pid, sub, &channels, held);
            trace!(
                pid,
                held,
                channels = channels.len(),
                subdevice = format_args!("{:#x}/{:#x}", sub.client, sub.handle),
                ok = result.is_ok(),
                "FIFO_DISABLE_CHANNELS"
            );
            let mine = self.disabled.entry(pid).or_default();
            match result {
                Ok(()) if held => mine.extend(channels),
                Ok(()) => mine.retain(|c| !channels.contains(c)),
                Err(ControlError::Gone { .. }) => return,
                Err(e) if !held || e.group_gone() => {
                    // An enable that failed is not tried again: the group goes back on the
                    // runlist when the unit is released, which enables its channels.
                    mine.retain(|c| !channels.contains(c));
                    debug!(pid, "{}", Chain(&e));
                }
                Err(e) => {
                    self.fail(pid, e);
                    return;
                }
            }
        }
    }

    fn fail(&mut self, pid: u32, error: ControlError) {
        self.failed.insert(pid);
        let _ = self.failures.send(Failure { pid, error });
    }

    /// Applies `f` to the process's groups (on `gpu`); `restore`: it undoes a control (back on
    /// the runlist), tried even after a failure, each group on its own.
    fn on_groups(
        &mut self,
        pid: u32,
        gpu: Option<u32>,
        restore: bool,
        mut f: impl FnMut(&mut Controls, &ChannelGroup) -> Result<(), ControlError>,
    ) {
        if self.failed.contains(&pid) && !restore {
            return;
        }
        let Some(objects) = self.groups.get(&pid) else {
            return;
        };
        let mut gone = Vec::new();
        for g in objects
            .groups
            .iter()
            .filter(|g| gpu.is_none_or(|gpu| on_gpu(g, gpu)))
        {
            match f(&mut self.controls, g) {
                Ok(()) => {}
                Err(e) if e.group_gone() => gone.push(*g),
                Err(ControlError::Gone { .. }) => return,
                Err(error) if restore => {
                    debug!(pid, group = g.handle, "{}", Chain(&error));
                }
                Err(error) => {
                    self.fail(pid, error);
                    return;
                }
            }
        }
        if let Some(objects) = self.groups.get_mut(&pid) {
            objects.groups.retain(|g| !gone.contains(g));
        }
    }
}
