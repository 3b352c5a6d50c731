//! The state task: one loop owns the [`State`], and every message, timer and request is handled
//! here, one at a time (the switchboard [`handle`], the changes asked through the API
//! [`answer`], what follows a change of limits, NVML's samples and Xid events).

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use super::{
    joins,
    messages::{Message, Request},
    state::{Intervals, State},
    view,
};
use crate::{
    attribution::scan,
    config::Config,
    enforcement::{compute, guard},
    notice::Notice,
    nvml::{SamplerSettings, Update as NvmlUpdate},
    policy::GpuCatalog,
    probes::events::KernelEvent,
    report::Chain,
};

/// How long after checking control files on exits they are checked once more.
const RECHECK_AFTER_EXIT: Duration = Duration::from_millis(250);

/// A timer that first fires one `every` from now (the start-up scan and sweep already ran).
fn timer(every: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// The state task's two inboxes: changes asked through the API (`writes`), and everything else
/// (kernel events, NVML samples, scans, removals, readers' refreshes) in `rx`, whose sender `tx`
/// the task keeps for the scans it starts.
pub(super) struct Inbox {
    pub writes: mpsc::Receiver<Request>,
    pub tx: mpsc::Sender<Message>,
    pub rx: mpsc::Receiver<Message>,
}

/// Runs the state task until `shutdown` turns true or every sender is gone; hands the state back
/// for an orderly stop. `watchdog`: the period of the service manager's keep-alives, sent from
/// here so that they stop when this task hangs.
///
/// Messages are taken in a fixed order of precedence: the API's changes first (a tenant flooding
/// open/close events must not delay a `SetLimits` past a hook's timeout: it waits for at most the
/// one message in hand), then shutdown and the timers (the sweep and the watchdog's keep-alives
/// are not starved either), then the rest in arrival order.
pub(super) async fn run_state(
    mut state: State,
    view: view::Publisher,
    mut intervals: Intervals,
    watchdog: Option<Duration>,
    inbox: Inbox,
    mut shutdown: watch::Receiver<bool>,
) -> State {
    let Inbox {
        mut writes,
        tx,
        mut rx,
    } = inbox;
    // A disabled rescan or watchdog still needs a timer to select on; it never fires usefully.
    const NEVER: Duration = Duration::from_secs(86_400);
    let mut sweep = timer(intervals.sweep);
    let mut rescan = timer(intervals.rescan.unwrap_or(NEVER));
    // Keep-alives start at once: the service manager may have been waiting since the start.
    let mut keepalive = tokio::time::interval(watchdog.unwrap_or(NEVER));
    // The limits restored at start.
    publish_limited_dirs(&mut state);
    // A second look at the control files shortly after exits were checked: a file an exiting
    // process held is closed a moment after its exit is reported.
    let recheck = tokio::time::sleep(NEVER);
    tokio::pin!(recheck);
    let mut recheck_armed = false;
    loop {
        let msg = tokio::select! {
            biased;
            Some(request) = writes.recv() => Message::Request(request),
            _ = shutdown.changed() => break,
            () = &mut recheck, if recheck_armed => {
                recheck_armed = false;
                view.changing();
                state.core.attribution.release_closed_files();
                continue;
            }
            _ = sweep.tick() => {
                view.changing();
                sweep_all(&mut state);
                limits_changed(&mut state);
                continue;
            }
            _ = rescan.tick(), if intervals.rescan.is_some() => {
                // Reading every process's fd table is blocking work: do it off this task.
                let matcher = state.core.attribution.matcher().clone();
                let tx = tx.clone();
                tokio::task::spawn_blocking(move || {
                    let found = scan::holders(&matcher);
                    let _ = tx.blocking_send(Message::Scanned(found));
                });
                continue;
            }
            _ = keepalive.tick(), if watchdog.is_some() => {
                if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
                    warn!("cannot send the watchdog keep-alive: {e}");
                }
                continue;
            }
            msg = rx.recv() => match msg {
                Some(msg) => msg,
                None => break,
            },
        };
        let refresh = matches!(msg, Message::Refresh);
        if !refresh {
            view.changing();
        }
        // SetLimits, ClearLimits and a reload follow their changes through before they answer
        // (`answer`); a removal changes limits too. Kernel events come by the thousand and a
        // stale GetCgroup is on the readers' path: both must stay cheap.
        let limits_may_change = matches!(msg, Message::CgroupRemoved);
        if let Some(new) = handle(&mut state, msg)
            && new != intervals
        {
            intervals = new;
            sweep = timer(intervals.sweep);
            rescan = timer(intervals.rescan.unwrap_or(NEVER));
        }
        if limits_may_change {
            limits_changed(&mut state);
        }
        // A view reflects every exit read so far: the files they held are checked first.
        if (refresh || rx.is_empty()) && state.core.attribution.check_pending_files() {
            recheck
                .as_mut()
                .reset(tokio::time::Instant::now() + RECHECK_AFTER_EXIT);
            recheck_armed = true;
        }
        if refresh {
            view.refresh(&mut state);
        }
    }
    debug!("state task stopped");
    state
}

/// The periodic reconciliation: lost events reported, exited processes and removed cgroups
/// forgotten, their memory and limits released.
fn sweep_all(state: &mut State) {
    let lost = state.core.attribution.newly_lost_events();
    if lost > 0 {
        state.outputs.notices.send(Notice::KernelEventsLost(lost));
    }
    state.core.attribution.release_closed_files();
    state.core.attribution.sweep();
    state.core.attribution.sweep_memory();
    state.core.forget_removed_cgroups();
    guard::sweep(&mut state.core.attribution, &mut state.core.settings);
    release_free_heap();
}

/// The switchboard: one arm per message. Returns new timer intervals after a reload.
fn handle(state: &mut State, msg: Message) -> Option<Intervals> {
    match msg {
        Message::Request(request) => return answer(state, request),
        Message::Kernel(events) => on_kernel_events(state, &events),
        Message::Nvml(NvmlUpdate::Xid { uuid, xid }) => on_xid(state, uuid, xid),
        Message::Nvml(update) => on_nvml(state, update),
        Message::CgroupRemoved => state.core.forget_removed_cgroups(),
        // Answered by the loop before it gets here.
        Message::Refresh => {}
        Message::Scanned(pids) => {
            let n = state.core.attribution.track_holders(pids);
            if n > 0 {
                info!(
                    processes = n,
                    "periodic scan found untracked device holders"
                );
            }
        }
    }
    None
}

/// Sends a reply; a requester that gave up (timed out, disconnected) is no reason to stop.
fn reply<T>(to: oneshot::Sender<T>, value: T) {
    let _ = to.send(value);
}

/// Carries out one change asked through the API (or answers a question the view could not).
fn answer(state: &mut State, request: Request) -> Option<Intervals> {
    match request {
        Request::GetCgroup { path, reply: to } => {
            // Answers reflect every exit read so far.
            let attribution = &mut state.core.attribution;
            attribution.check_pending_files();
            let got = attribution.get(&path);
            reply(to, got.map(|v| state.core.with_workload(v)));
        }
        // A change is in force when its caller hears back: the guard's allowances (a priority
        // class) are in the kernel before the reply, so a tenant's next control meets them.
        Request::SetLimits {
            cgroup,
            gpu,
            update,
            reply: to,
        } => {
            let done = state.core.set_limits(&cgroup, &gpu, &update);
            limits_changed(state);
            reply(to, done);
        }
        Request::ClearLimits {
            cgroup,
            gpu,
            names,
            reply: to,
        } => {
            let done = state.core.clear_limits(&cgroup, &gpu, &names);
            limits_changed(state);
            reply(to, done);
        }
        Request::ShareCharges {
            cgroup,
            group,
            reply: to,
        } => {
            let done = state.core.attribution.share_charges(&cgroup, &group);
            reply(to, done.map_err(Into::into));
        }
        Request::SetWorkload {
            cgroup,
            names,
            reply: to,
        } => {
            let done = state.core.set_workload(&cgroup, names);
            reply(to, done.map_err(Into::into));
        }
        Request::Reconfigure(config, to) => {
            let intervals = reconfigure(state, &config);
            limits_changed(state);
            reply(to, ());
            return Some(intervals);
        }
    }
    None
}

/// Applies the live keys of a reloaded configuration that this task and the tasks it feeds own
/// (`config::LIVE_KEYS`); returns the timers' new intervals.
fn reconfigure(state: &mut State, config: &Config) -> Intervals {
    state.idle.set_rule((&config.idle).into());
    state
        .core
        .memory
        .set_backstop(crate::enforcement::backstop::BackstopRule::configured(
            &config.enforcement,
        ));
    if let Some(params) = &state.live.compute {
        params.send_replace(compute::params(config));
    }
    if let Some(sampler) = &state.live.sampler {
        // The library path is read only when NVML is loaded: a restart-only key.
        let new = SamplerSettings::of(&config.nvml);
        sampler.send_modify(|s| {
            s.sample_interval = new.sample_interval;
            s.retry_interval = new.retry_interval;
        });
    }
    if let Err(e) = state
        .core
        .probes
        .set_memory_info(config.enforcement.virtualize_memory_info)
    {
        warn!("memory view not changed: {}", Chain(&e));
    }
    if let Err(e) = state
        .core
        .probes
        .set_guard(config.enforcement.scheduler_guard)
    {
        warn!("scheduler guard not changed: {}", Chain(&e));
    }
    let intervals = Intervals::of(config);
    info!(
        sweep_secs = intervals.sweep.as_secs(),
        rescan_secs = intervals.rescan.map_or(0, |d| d.as_secs()),
        idle_threshold_percent = config.idle.threshold_percent,
        idle_min_duration_secs = config.idle.min_duration_secs,
        idle_signal = config.idle.signal,
        compute_period_ms = config.compute.period_ms,
        nvml_sample_interval_ms = config.nvml.sample_interval_ms,
        memory_view = state.core.memory_info(),
        scheduler_guard = state.core.scheduler_guard(),
        "live settings applied"
    );
    intervals
}

/// A kernel event to its owner ([`core::Core::route`]), what it announces to the bus.
fn on_kernel_events(state: &mut State, events: &[KernelEvent]) {
    for notice in state.core.route_all(events) {
        state.outputs.notices.send(notice);
    }
}

fn on_xid(state: &mut State, uuid: String, xid: Option<u64>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let attribution = &mut state.core.attribution;
    let id_of = |path: &str| attribution.id_of(path).map_or(0, |(_, id)| id);
    let event = state.nvml.on_xid(uuid, xid, now, id_of);
    state.outputs.notices.send(Notice::Xid(event));
    publish_inventory(state);
}

/// A new NVML sample (or NVML going away): the controller's input, the inventory, the idle rule,
/// the GPU catalog for limit selectors, and the release of objects NVML no longer reports.
fn on_nvml(state: &mut State, update: NvmlUpdate) {
    let fresh = matches!(
        update,
        NvmlUpdate::Available { .. } | NvmlUpdate::Unavailable(_)
    );
    state.nvml.apply(update);
    if fresh && let Some(feed) = &mut state.compute {
        joins::feed_compute(
            feed,
            &mut state.core.attribution,
            &state.nvml,
            &state.core.memory,
            &state.core.policies,
        );
    }
    // Unavailable: no inventory (the Gpu1 objects go away until NVML answers again).
    publish_inventory(state);
    if fresh {
        // A per-GPU limit reaches the driver's region once NVML names the GPU's PCI address.
        sync_dmem(state);
    }
    if fresh {
        update_idle(state);
    }
    if fresh && state.nvml.available {
        let core = &mut state.core;
        for n in core.memory.on_nvml(
            &mut core.attribution,
            &core.policies,
            &state.nvml.processes,
            std::time::Instant::now(),
        ) {
            state.outputs.notices.send(Notice::MemoryLimitExceeded(n));
        }
    }
    if fresh {
        let catalog = if state.nvml.available {
            GpuCatalog::Known(
                state
                    .nvml
                    .gpus
                    .iter()
                    .filter(|g| g.mig.is_none())
                    .map(|g| (g.index, g.uuid.clone()))
                    .collect(),
            )
        } else {
            GpuCatalog::Unavailable(state.nvml.status.clone())
        };
        let core = &mut state.core;
        core.memory.set_catalog(
            &mut core.attribution,
            &mut core.settings,
            &mut core.policies,
            catalog,
        );
    }
}

/// Hands the directories of the cgroups that have limits to the removal watcher, if they changed.
fn publish_limited_dirs(state: &mut State) {
    let root = state.core.attribution.cgroup_root().to_owned();
    let dirs: BTreeSet<std::path::PathBuf> = state
        .core
        .policies
        .list()
        .into_iter()
        .map(|l| root.join(l.cgroup.trim_start_matches('/')))
        .collect();
    state.outputs.limited_dirs.send_if_modified(|cur| {
        let changed = *cur != dirs;
        *cur = dirs;
        changed
    });
}

/// What follows the memory limits in force: the removal watch's directories and the driver's
/// own limits.
fn limits_changed(state: &mut State) {
    publish_limited_dirs(state);
    sync_dmem(state);
}

/// The driver's own limits follow the memory limits in force (and NVML's PCI addresses).
fn sync_dmem(state: &mut State) {
    let Some(dmem) = &mut state.dmem else { return };
    let gpus = state.nvml.inventory();
    let pci_of = |gpu: u32| {
        gpus.iter()
            .find(|g| g.info.index == gpu && g.info.mig.is_none())
            .and_then(|g| crate::probes::caps::PciAddr::parse(&g.info.pci_bus_id))
    };
    for e in dmem.sync(
        state.core.memory.memory_limits(&state.core.policies),
        pci_of,
    ) {
        tracing::error!("the driver's limit is not in force: {}", Chain(&e));
    }
}

/// Publishes the inventory (for the `Gpu1` objects) if it changed.
fn publish_inventory(state: &mut State) {
    let inventory = state.nvml.inventory();
    if *state.outputs.inventory != inventory {
        state.outputs.inventory = Arc::new(inventory);
        state
            .outputs
            .notices
            .send(Notice::Inventory(state.outputs.inventory.clone()));
    }
}

/// Gives the heap's free pages back to the system. A burst of large replies (ListCgroups of
/// thousands of cgroups to many clients at once) leaves glibc's per-thread arenas holding
/// 100+ MiB that they would otherwise keep for the daemon's lifetime.
fn release_free_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions; it only returns free memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Runs the idle rule on the current figures and announces its transitions.
fn update_idle(state: &mut State) {
    let now = std::time::Instant::now();
    let changes = if state.nvml.available {
        let obs = joins::idle_observations(&mut state.core.attribution, &state.nvml);
        state.idle.observe(now, std::time::SystemTime::now(), obs)
    } else {
        // Utilization unknown: no cgroup can be called idle.
        state.idle.reset(now)
    };
    for c in changes {
        state.outputs.notices.send(Notice::IdleChanged(c));
    }
}
