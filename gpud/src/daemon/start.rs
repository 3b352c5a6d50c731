//! Start-up and orderly stop: the kernel stack opened ([`super::core::open`]), and the tasks
//! around the state (ring-buffer reader, restorer, NVML sampler, compute controller, state task)
//! started; then, at the end, stopped in the order that leaves nothing frozen and the probes
//! pinned or detached as configured.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use gpud_common::ObjKey;
use tokio::{
    sync::{broadcast, mpsc, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

use super::{
    core::{Core, DaemonInfo, Opened, StartError},
    handle::Handle,
    joins::ComputeFeed,
    messages::{ComputeStats, Message, Request},
    ring::read_events,
    state::{Intervals, LiveSettings, Senders, State},
    task::{Inbox, run_state},
};
use crate::{
    cgroupfs::Freezer,
    config::Config,
    enforcement::{compute, dmem::DmemLimits, restore::RestoreSender},
    notice::{Notice, NoticeBus, NoticeCounts},
    nvml::{NvmlView, Sampler, SamplerSettings},
    policy::idle::IdleTracker,
    probes::Matcher,
};

/// A started daemon: its handle, its facts, and what [`Running::stop`] needs.
pub struct Running {
    pub handle: Handle,
    pub info: DaemonInfo,
    notices: NoticeBus,
    notice_counts: NoticeCounts,
    shutdown: watch::Sender<bool>,
    state: JoinHandle<State>,
    reader: JoinHandle<std::io::Result<()>>,
    controller: Option<JoinHandle<()>>,
    keep_pinned: bool,
}

impl Running {
    /// A subscriber to the daemon's notices (from now on), for the API's publishers, the
    /// metrics and the log.
    pub fn notices(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// The notices published so far, by name, for the metrics.
    pub fn notice_counts(&self) -> NoticeCounts {
        self.notice_counts.clone()
    }

    /// Turns true when the daemon stops; for the tasks the API layer runs beside it.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// Stops in order: the state task (then what memory enforcement froze is thawed and the
    /// probes are pinned or detached), the controller (it thaws what it froze).
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        self.reader.abort();
        match self.state.await {
            Ok(state) => state.core.close(self.keep_pinned),
            Err(e) => warn!("state task: {e}"),
        }
        if let Some(c) = self.controller {
            let _ = c.await;
        }
    }
}

/// Starts the daemon's core from `config` (inside a tokio runtime): everything but the API, which
/// serves the returned handle and publishes its notices.
pub fn spawn(config: &Config) -> Result<Running, StartError> {
    let compute_on = config.compute.enabled && config.nvml.enabled;
    let Stack {
        opened,
        dmem,
        restore,
    } = open_stack(config, compute_on)?;
    let notices = NoticeBus::default();
    let notice_counts = notices.start_log_and_counts();
    let w = Wires::new(config, compute_on, &notices);
    let state = new_state(config, opened.core, dmem, w.feed, w.outputs, w.live);
    let controller = compute_on
        .then(|| spawn_compute(config, opened.freezer, opened.matcher, opened.held, w.links));
    let reader = spawn_feeders(
        config,
        (opened.events, opened.previous_events),
        restore,
        w.sampler_rx,
        w.limited_dirs_rx,
        &w.inbox.tx,
        &w.shutdown_rx,
    );
    let (handle, state) = spawn_state(
        config,
        state,
        opened.cgroup_root,
        w.inbox,
        w.writes,
        w.compute_stats_rx,
        w.shutdown_rx,
    )?;
    Ok(Running {
        handle,
        info: opened.info,
        notices,
        notice_counts,
        shutdown: w.shutdown,
        state,
        reader,
        controller,
        keep_pinned: config.probes.keep_pinned,
    })
}

/// What the state task owns: the core, its NVML view (a disabled one with NVML off), its idle
/// tracker, and its ends of the channels.
fn new_state(
    config: &Config,
    core: Core,
    dmem: Option<DmemLimits>,
    feed: Option<ComputeFeed>,
    outputs: Senders,
    live: LiveSettings,
) -> State {
    State {
        core,
        nvml: if config.nvml.enabled {
            NvmlView::default()
        } else {
            NvmlView::disabled()
        },
        compute: feed,
        idle: IdleTracker::new((&config.idle).into()),
        outputs,
        live,
        dmem,
    }
}

/// The opened kernel stack, with its dmem regions and restorer already put to use.
struct Stack {
    /// What [`super::core::open`] returned, less `dmem_regions` and `restorer`.
    opened: Opened,
    dmem: Option<DmemLimits>,
    restore: Option<RestoreSender>,
}

/// Opens the kernel stack, makes the driver's dmem limits, starts the restorer (it undoes
/// tenants' controls on its own thread) and, with compute shares on, thaws what a crash may have
/// left frozen.
fn open_stack(config: &Config, compute_on: bool) -> Result<Stack, StartError> {
    let mut opened = super::core::open(config)?;
    let regions = std::mem::take(&mut opened.dmem_regions);
    let dmem = (!regions.is_empty()).then(|| DmemLimits::new(&opened.cgroup_root, regions));
    let restore = opened.restorer.take().and_then(|r| {
        crate::enforcement::restore::spawn(r)
            .inspect_err(|e| warn!("cannot start the scheduler guard's restorer: {e}"))
            .ok()
    });
    if compute_on {
        thaw_compute_cgroups(&opened);
    }
    Ok(Stack {
        opened,
        dmem,
        restore,
    })
}

/// Thaws every cgroup with a compute policy before the controller starts: a crash may have left
/// them frozen mid-period.
fn thaw_compute_cgroups(opened: &Opened) {
    for (path, _, _) in opened.core.policies.compute_policies() {
        if opened
            .freezer
            .set(crate::cgroupfs::Holder::Compute, &path, false)
            .is_ok()
        {
            info!(cgroup = %path, "thawed at start-up");
        }
    }
}

/// The channels between the daemon's tasks, made before any of them starts, grouped by the task
/// that takes each end.
struct Wires {
    /// The state task's: its inbox, its feed of the compute task, its outputs, and the live
    /// settings it passes on.
    inbox: Inbox,
    feed: Option<ComputeFeed>,
    outputs: Senders,
    live: LiveSettings,
    /// The compute task's.
    links: compute::Links,
    /// The NVML sampler's and the cgroup-removal watcher's.
    sampler_rx: watch::Receiver<SamplerSettings>,
    limited_dirs_rx: watch::Receiver<BTreeSet<PathBuf>>,
    /// The handle's: the API's changes, and the compute shares (with compute on).
    writes: mpsc::Sender<Request>,
    compute_stats_rx: Option<watch::Receiver<ComputeStats>>,
    /// The stop signal, and a receiver of it to clone for each task.
    shutdown: watch::Sender<bool>,
    shutdown_rx: watch::Receiver<bool>,
}

impl Wires {
    /// Makes every channel and sorts its ends by the task that takes them (with compute shares
    /// off, the compute ends go unused).
    fn new(config: &Config, compute_on: bool, notices: &NoticeBus) -> Self {
        // A few seconds of NVML samples: the compute task plans between them, so it is not
        // behind.
        let (control, control_rx) = mpsc::channel(64);
        let (compute_stats, compute_stats_rx) = watch::channel(ComputeStats::default());
        let (compute_params, compute_params_rx) = watch::channel(compute::params(config));
        let (sampler, sampler_rx) = watch::channel(SamplerSettings::of(&config.nvml));
        let (shutdown, shutdown_rx) = watch::channel(false);
        let (tx, rx) = mpsc::channel::<Message>(1024);
        // The API's changes, taken before the backlog of `rx` (`run_state`).
        let (writes, writes_rx) = mpsc::channel(64);
        let (limited_dirs, limited_dirs_rx) = watch::channel(BTreeSet::new());
        Self {
            inbox: Inbox {
                writes: writes_rx,
                tx,
                rx,
            },
            feed: compute_on.then(|| ComputeFeed {
                tx: control,
                hardware: config.compute.hardware,
                groups: BTreeMap::new(),
                walked: None,
                first_seen: BTreeMap::new(),
            }),
            outputs: Senders {
                notices: notices.clone(),
                inventory: Default::default(),
                limited_dirs,
            },
            live: LiveSettings {
                compute: compute_on.then_some(compute_params),
                sampler: config.nvml.enabled.then_some(sampler),
            },
            links: compute::Links {
                input: control_rx,
                params: compute_params_rx,
                stats: compute_stats,
                notices: notices.clone(),
                shutdown: shutdown_rx.clone(),
            },
            sampler_rx,
            limited_dirs_rx,
            writes,
            compute_stats_rx: compute_on.then_some(compute_stats_rx),
            shutdown,
            shutdown_rx,
        }
    }
}

/// Starts the compute task, which runs the law and starts the actuator's thread; they hold the
/// one `cgroup.freeze` writer, the tenants' file matcher and the kernel's map of held groups.
fn spawn_compute(
    config: &Config,
    freezer: Freezer,
    matcher: Matcher,
    held: BpfHashMap<MapData, ObjKey, u32>,
    links: compute::Links,
) -> JoinHandle<()> {
    tokio::spawn(compute::run(
        compute::Settings {
            freezer,
            matcher,
            params: compute::params(config),
            hardware: config.compute.hardware,
            held: Some(compute::channel::HeldGroups::new(held)),
        },
        links,
    ))
}

/// Starts the tasks that feed the state task: the NVML sampler (with NVML on), the ring-buffer
/// reader (it hands tenants' controls to the restorer) and the cgroup-removal watcher. Returns
/// the reader, which [`Running::stop`] aborts.
fn spawn_feeders(
    config: &Config,
    // The probes' ring, and the previous ABI's after a take-over (read first).
    (events, previous_events): (RingBuf<MapData>, Option<RingBuf<MapData>>),
    restore: Option<RestoreSender>,
    sampler_rx: watch::Receiver<SamplerSettings>,
    limited_dirs_rx: watch::Receiver<BTreeSet<PathBuf>>,
    tx: &mpsc::Sender<Message>,
    shutdown_rx: &watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    if config.nvml.enabled {
        spawn_nvml_sampler(sampler_rx, tx.clone(), shutdown_rx.clone());
    }
    let reader = tokio::spawn(read_events(events, previous_events, tx.clone(), restore));
    tokio::spawn(super::removals::run(
        limited_dirs_rx,
        tx.clone(),
        shutdown_rx.clone(),
    ));
    reader
}

/// Opens the published view on the kernel's counters, makes the API's handle, and starts the
/// state task with its timers and the service manager's keep-alives.
fn spawn_state(
    config: &Config,
    state: State,
    cgroup_root: PathBuf,
    inbox: Inbox,
    writes: mpsc::Sender<Request>,
    compute_stats_rx: Option<watch::Receiver<ComputeStats>>,
    shutdown_rx: watch::Receiver<bool>,
) -> Result<(Handle, JoinHandle<State>), StartError> {
    let counters = state
        .core
        .attribution
        .counters()
        .map_err(StartError::Attribution)?;
    let (views, view_reader) = super::view::channel(counters, inbox.tx.clone(), cgroup_root);
    let handle = Handle::new(inbox.tx.clone(), writes, view_reader, compute_stats_rx);
    let state = tokio::spawn(run_state(
        state,
        views,
        Intervals::of(config),
        // Keep-alives at half the service manager's timeout, from the state task itself: a hung
        // state task stops them and systemd restarts the daemon.
        sd_notify::watchdog_enabled()
            .map(|t| t / 2)
            .filter(|t| !t.is_zero()),
        inbox,
        shutdown_rx,
    ));
    Ok((handle, state))
}

/// Samples NVML and waits for its Xid events on a thread of its own (its calls block) until
/// shutdown.
fn spawn_nvml_sampler(
    settings: watch::Receiver<SamplerSettings>,
    tx: mpsc::Sender<Message>,
    shutdown: watch::Receiver<bool>,
) {
    // One thread, one NVML handle: it samples, and waits for Xid events in between.
    let spawned = std::thread::Builder::new()
        .name("nvml".into())
        .spawn(move || {
            Sampler::new(settings).run(
                |s| tx.blocking_send(Message::Nvml(s)).is_ok(),
                || *shutdown.borrow(),
            );
        });
    if let Err(e) = spawned {
        warn!("cannot start the NVML sampler: {e}");
    }
}
