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
use tracing::{debug, warn};

use super::{
    channel::{ControlError, Controls, HeldGroups, on_gpu},
    law::Command,
};
use crate::{
    attribution::ChannelGroup,
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
    /// The tenants' channel groups, by process.
    Groups(BTreeMap<u32, Vec<ChannelGroup>>),
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
    groups: BTreeMap<u32, Vec<ChannelGroup>>,
    /// Processes whose controls failed: reported once, not tried again (except to put their
    /// groups back on the runlist).
    failed: BTreeSet<u32>,
    /// Processes whose groups were taken off the runlist: their groups are kept until they are
    /// back on it, whatever the tenants' list says meanwhile.
    off: BTreeSet<u32>,
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
                    for pid in &self.off {
                        if let Some(g) = self.groups.remove(pid) {
                            groups.entry(*pid).or_insert(g);
                        }
                    }
                    self.controls.retain(|pid| groups.contains_key(&pid));
                    self.failed.retain(|pid| groups.contains_key(pid));
                    self.groups = groups;
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
            Command::Schedule { pid, enabled } => {
                self.on_groups(pid, gpu, enabled, |controls, g| {
                    controls.schedule(g, enabled)
                });
                if enabled {
                    self.off.remove(&pid);
                } else {
                    self.off.insert(pid);
                }
            }
            Command::Timeslice { pid, us } => {
                self.on_groups(pid, gpu, false, |controls, g| controls.timeslice(g, us));
            }
        }
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
        let Some(groups) = self.groups.get(&pid) else {
            return;
        };
        let mut gone = Vec::new();
        for g in groups
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
                    self.failed.insert(pid);
                    let _ = self.failures.send(Failure { pid, error });
                    return;
                }
            }
        }
        if let Some(groups) = self.groups.get_mut(&pid) {
            groups.retain(|g| !gone.contains(g));
        }
    }
}
