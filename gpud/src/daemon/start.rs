//! Start-up and orderly stop: the kernel stack opened ([`super::core::open`]), and the tasks
//! around the state (ring-buffer reader, restorer, NVML sampler, compute controller, state task)
//! started; then, at the end, stopped in the order that leaves nothing frozen and the probes
//! pinned or detached as configured.

use std::collections::{BTreeMap, BTreeSet};

use tokio::{
    sync::{broadcast, mpsc, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

use super::{
    core::{DaemonInfo, Opened, StartError},
    handle::Handle,
    messages::{ComputeStats, Message},
    ring::read_events,
    state::{Intervals, LiveSettings, Senders, State},
    task::run_state,
};
use crate::{
    config::Config,
    enforcement::compute,
    notice::{Notice, NoticeBus, NoticeCounts},
    nvml::{NvmlView, Sampler, SamplerSettings},
    policy::idle::IdleTracker,
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
    let opened: Opened = super::core::open(config)?;
    let (core, cgroup_root) = (opened.core, opened.cgroup_root);
    let dmem = (!opened.dmem_regions.is_empty())
        .then(|| crate::enforcement::dmem::DmemLimits::new(&cgroup_root, opened.dmem_regions));
    // The restorer undoes tenants' controls on its own thread.
    let restore = opened.restorer.and_then(|r| {
        crate::enforcement::restore::spawn(r)
            .inspect_err(|e| warn!("cannot start the scheduler guard's restorer: {e}"))
            .ok()
    });
    let compute_on = config.compute.enabled && config.nvml.enabled;
    if compute_on {
        // A crash may have left cgroups frozen mid-period: thaw every cgroup with a compute
        // policy before the controller starts.
        for (path, _, _) in core.policies.compute_policies() {
            if opened
                .freezer
                .set(crate::cgroupfs::Holder::Compute, &path, false)
                .is_ok()
            {
                info!(cgroup = %path, "thawed at start-up");
            }
        }
    }
    let notices = NoticeBus::default();
    let notice_counts = notices.start_log_and_counts();
    // A few seconds of NVML samples: the compute task plans between them, so it is not behind.
    let (control, control_rx) = mpsc::channel(64);
    let (compute_stats, compute_stats_rx) = watch::channel(ComputeStats::default());
    let (compute_params, compute_params_rx) = watch::channel(compute::params(config));
    let (sampler, sampler_rx) = watch::channel(SamplerSettings::of(&config.nvml));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let (tx, rx) = mpsc::channel::<Message>(1024);
    // The API's changes, taken before the backlog of `rx` (`run_state`).
    let (writes, writes_rx) = mpsc::channel(64);
    let (limited_dirs, limited_dirs_rx) = watch::channel(BTreeSet::new());

    let state = State {
        core,
        nvml: if config.nvml.enabled {
            NvmlView::default()
        } else {
            NvmlView::disabled()
        },
        compute: compute_on.then(|| super::joins::ComputeFeed {
            tx: control,
            hardware: config.compute.hardware,
            groups: BTreeMap::new(),
            walked: None,
            first_seen: BTreeMap::new(),
        }),
        idle: IdleTracker::new((&config.idle).into()),
        outputs: Senders {
            notices: notices.clone(),
            inventory: Default::default(),
            limited_dirs,
        },
        live: LiveSettings {
            compute: compute_on.then_some(compute_params),
            sampler: config.nvml.enabled.then_some(sampler),
        },
        dmem,
    };
    let controller = compute_on.then(|| {
        tokio::spawn(compute::run(
            compute::Settings {
                freezer: opened.freezer,
                matcher: opened.matcher,
                params: compute::params(config),
                hardware: config.compute.hardware,
                held: Some(compute::channel::HeldGroups::new(opened.held)),
            },
            compute::Links {
                input: control_rx,
                params: compute_params_rx,
                stats: compute_stats,
                notices: notices.clone(),
                shutdown: shutdown_rx.clone(),
            },
        ))
    });
    if config.nvml.enabled {
        spawn_nvml_sampler(sampler_rx, tx.clone(), shutdown_rx.clone());
    }
    let reader = tokio::spawn(read_events(opened.events, tx.clone(), restore));
    tokio::spawn(super::removals::run(
        limited_dirs_rx,
        tx.clone(),
        shutdown_rx.clone(),
    ));
    let (views, view_reader) = super::view::channel(
        state
            .core
            .attribution
            .counters()
            .map_err(StartError::Attribution)?,
        tx.clone(),
        cgroup_root.clone(),
    );
    let handle = Handle::new(
        tx.clone(),
        writes,
        view_reader,
        compute_on.then_some(compute_stats_rx),
    );
    let state = tokio::spawn(run_state(
        state,
        views,
        Intervals::of(config),
        // Keep-alives at half the service manager's timeout, from the state task itself: a hung
        // state task stops them and systemd restarts the daemon.
        sd_notify::watchdog_enabled()
            .map(|t| t / 2)
            .filter(|t| !t.is_zero()),
        super::task::Inbox {
            writes: writes_rx,
            tx,
            rx,
        },
        shutdown_rx,
    ));
    let running = Running {
        handle,
        info: opened.info,
        notices,
        notice_counts,
        shutdown,
        state,
        reader,
        controller,
        keep_pinned: config.probes.keep_pinned,
    };
    Ok(running)
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
