//! The daemon's event loop. One task owns all mutable state (the attribution tables and the
//! kernel maps); D-Bus handlers, the ring-buffer reader and timers reach it only as messages.

use std::{collections::BTreeMap, collections::BTreeSet, time::Duration};

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot, watch},
};
use tracing::{debug, info, warn};

use crate::{
    api::model::{
        CgroupRecord, GpuRecord, IdleRecord, LimitRecord, NvmlEventRecord, NvmlUsageRecord,
        ProcessRecord,
    },
    attribution::{Attribution, AttributionError, scan},
    enforcement::{EnforcementError, LimitNotice, MemoryEnforcement},
    nvml::{AttributedXid, NvmlView, Snapshot},
    policy::{
        LimitUpdate,
        idle::{IdleChange, IdleTracker, Observation},
    },
};

/// Questions and changes from the API.
pub enum Request {
    ListCgroups(oneshot::Sender<Vec<CgroupRecord>>),
    ListProcesses(oneshot::Sender<Vec<ProcessRecord>>),
    GetCgroup {
        path: String,
        reply: oneshot::Sender<Result<CgroupRecord, AttributionError>>,
    },
    KernelStats(oneshot::Sender<BTreeMap<String, u64>>),
    SetLimits {
        cgroup: String,
        gpu: String,
        update: LimitUpdate,
        reply: oneshot::Sender<Result<(), EnforcementError>>,
    },
    ClearLimits {
        cgroup: String,
        gpu: String,
        names: Vec<String>,
        reply: oneshot::Sender<Result<(), EnforcementError>>,
    },
    ListLimits(oneshot::Sender<Vec<LimitRecord>>),
    ListGpus(oneshot::Sender<Vec<GpuRecord>>),
    ListNvmlUsage(oneshot::Sender<Vec<NvmlUsageRecord>>),
    /// (available, status text).
    NvmlStatus(oneshot::Sender<(bool, String)>),
    ListNvmlEvents(oneshot::Sender<Vec<NvmlEventRecord>>),
    ListIdle(oneshot::Sender<Vec<IdleRecord>>),
}

/// Everything the state task owns.
pub struct State {
    pub attribution: Attribution,
    pub memory: MemoryEnforcement,
    /// Limit events for the D-Bus signal task.
    pub notices: tokio::sync::broadcast::Sender<LimitNotice>,
    pub nvml: NvmlView,
    /// The GPU inventory, for the task that publishes `dev.gpud.Gpu1` objects.
    pub inventory: watch::Sender<Vec<GpuRecord>>,
    /// Xid events, for the task that signals them on the `dev.gpud.Gpu1` objects.
    pub nvml_events: tokio::sync::broadcast::Sender<NvmlEventRecord>,
    /// Inputs of the compute controller (`None`: compute shares disabled).
    pub control: Option<watch::Sender<crate::enforcement::compute::ControlInput>>,
    /// The idle/hoarding report.
    pub idle: IdleTracker,
    /// Idle transitions, for the task that signals them (`None`: no signal).
    pub idle_changes: Option<tokio::sync::broadcast::Sender<IdleChange>>,
}

/// What the idle rule sees at an NVML sample: every cgroup with live attributed processes or
/// NVML-reported processes, per GPU index, with the larger of the probes' and NVML's memory
/// figure and NVML's utilization. A process without a utilization sample since the previous one
/// did not run on the GPU: it counts as 0 %.
fn idle_observations(attribution: &mut Attribution, nvml: &NvmlView) -> Vec<Observation> {
    let mut seen: BTreeMap<(String, u32), Observation> = BTreeMap::new();
    for c in attribution.list() {
        if c.pids.is_empty() {
            continue;
        }
        for (gpu, bytes) in &c.memory_current {
            let Ok(gpu) = gpu.parse::<u32>() else {
                continue;
            };
            seen.insert(
                (c.path.clone(), gpu),
                Observation {
                    cgroup: c.path.clone(),
                    cgroup_id: c.id,
                    gpu,
                    memory_bytes: *bytes,
                    util: 0,
                },
            );
        }
    }
    for ((cgroup, gpu), u) in nvml.by_cgroup() {
        if cgroup.is_empty() {
            continue;
        }
        let id = attribution.id_of(&cgroup).map_or(0, |(_, id)| id);
        let o = seen
            .entry((cgroup.clone(), gpu))
            .or_insert_with(|| Observation {
                cgroup,
                cgroup_id: id,
                gpu,
                memory_bytes: 0,
                util: 0,
            });
        o.memory_bytes = o.memory_bytes.max(u.memory_bytes);
        o.util = if u.sampled { u.sm_util } else { 0 };
    }
    seen.into_values().collect()
}

/// Runs the idle rule on the current figures and forwards its transitions.
fn update_idle(state: &mut State) {
    let now = std::time::Instant::now();
    let changes = if state.nvml.available {
        let obs = idle_observations(&mut state.attribution, &state.nvml);
        state.idle.observe(now, std::time::SystemTime::now(), obs)
    } else {
        // Utilization unknown: no cgroup can be called idle.
        state.idle.reset(now)
    };
    for c in changes {
        info!(
            cgroup = %c.cgroup,
            gpu = c.gpu,
            idle = c.idle,
            memory_bytes = c.memory_bytes,
            idle_secs = c.idle_secs,
            "{}",
            if c.idle {
                "cgroup holds GPU memory while idle"
            } else {
                "cgroup no longer idle"
            }
        );
        if let Some(tx) = &state.idle_changes {
            // No subscriber (no bus yet) is fine: the change is logged and listed.
            let _ = tx.send(c);
        }
    }
}

/// The controller's input from the last NVML sample: per GPU, each controlled unit (the deepest
/// cgroup with a compute policy above a process's cgroup, else the process's own cgroup) with its
/// summed utilization and its policy.
fn control_input(
    nvml: &NvmlView,
    memory: &MemoryEnforcement,
    seq: u64,
) -> crate::enforcement::compute::ControlInput {
    use crate::enforcement::compute::{CgroupInput, ControlInput};
    let policies = memory.compute_policies();
    let unit_of = |path: &str| -> String {
        policies
            .iter()
            .map(|(p, _, _)| p.as_str())
            .filter(|p| path == *p || path.starts_with(&format!("{}/", p.trim_end_matches('/'))))
            .max_by_key(|p| p.len())
            .unwrap_or(path)
            .to_owned()
    };
    // Per GPU and unit: summed utilization, and whether any of it was sampled this time.
    let mut per_gpu: BTreeMap<u32, BTreeMap<String, (f64, bool)>> = BTreeMap::new();
    for ((cgroup, gpu), u) in nvml.by_cgroup() {
        if cgroup.is_empty() {
            continue;
        }
        let e = per_gpu
            .entry(gpu)
            .or_default()
            .entry(unit_of(&cgroup))
            .or_default();
        e.0 += f64::from(u.sm_util);
        e.1 |= u.sampled;
    }
    let gpus_of = |path: &str| {
        per_gpu
            .values()
            .filter(|units| units.contains_key(path))
            .count() as u32
    };
    let gpus = per_gpu
        .iter()
        .map(|(&gpu, units)| {
            // NVML produced a new sample on this GPU: whoever is not in it did not run then
            // (a frozen process never appears). No new sample at all: nothing is known.
            let gpu_sampled = units.values().any(|(_, s)| *s);
            let list = units
                .iter()
                .map(|(path, (util, sampled))| CgroupInput {
                    path: path.clone(),
                    util: if *sampled {
                        Some(util.min(100.0))
                    } else if gpu_sampled {
                        Some(0.0)
                    } else {
                        None
                    },
                    limits: memory
                        .compute_policy_for(path, gpu, gpus_of(path))
                        .unwrap_or_default(),
                })
                .collect();
            (gpu, list)
        })
        // A GPU where no cgroup has a compute policy is left to the driver's own time-slicing.
        .filter(|(_, list): &(u32, Vec<CgroupInput>)| list.iter().any(|c| c.limits.has_compute()))
        .collect();
    ControlInput {
        seq,
        gpus,
        memory_frozen: memory.frozen().clone(),
    }
}

/// An inventory entry as published.
pub fn gpu_record(g: &crate::nvml::GpuInfo, xid: &BTreeMap<String, u64>) -> GpuRecord {
    GpuRecord {
        index: g.index,
        mig: g.mig.unwrap_or(u32::MAX),
        uuid: g.uuid.clone(),
        name: g.name.clone(),
        pci_bus_id: g.pci_bus_id.clone(),
        memory_total: g.memory_total,
        memory_used: g.memory_used,
        driver_version: g.driver_version.clone(),
        cuda_version: g.cuda_version.clone(),
        compute_mode: g.compute_mode.clone(),
        mig_mode: g.mig_mode.clone(),
        xid_errors: xid.get(&g.uuid).copied().unwrap_or(0),
    }
}

/// An Xid event as published.
fn event_record(e: AttributedXid) -> NvmlEventRecord {
    NvmlEventRecord {
        timestamp_us: e.timestamp_us,
        gpu: e.gpu,
        uuid: e.uuid,
        kind: "xid".into(),
        xid: e.xid,
        pid: e.pid.unwrap_or(0),
        cgroup_id: e.cgroup_id,
        cgroup: e.cgroup,
        pids: e.pids,
    }
}

/// Everything the state task reacts to.
pub enum Message {
    Request(Request),
    Kernel(gpud_common::Event),
    /// Result of a `/proc` scan run off the state task.
    Scanned(BTreeSet<u32>),
    /// What the NVML sampler saw.
    Nvml(Snapshot),
}

/// Timers of the state task.
pub struct Intervals {
    /// Periodic `/proc` scan; `None` disables it.
    pub rescan: Option<Duration>,
    pub sweep: Duration,
    /// Period of the service manager's watchdog keep-alives (`WATCHDOG=1`); `None`: no watchdog.
    pub watchdog: Option<Duration>,
}

/// Runs the state task until `shutdown` turns true or every sender is gone; hands the state back
/// for an orderly stop.
pub async fn run_state(
    mut state: State,
    intervals: Intervals,
    tx: mpsc::Sender<Message>,
    mut rx: mpsc::Receiver<Message>,
    mut shutdown: watch::Receiver<bool>,
) -> State {
    let mut sweep = tokio::time::interval(intervals.sweep);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A disabled rescan still needs a timer to select on; it just never fires usefully.
    let mut rescan = tokio::time::interval(intervals.rescan.unwrap_or(Duration::from_secs(86_400)));
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watchdog =
        tokio::time::interval(intervals.watchdog.unwrap_or(Duration::from_secs(86_400)));
    // The start-up scan already ran; skip the immediate first ticks.
    sweep.tick().await;
    rescan.tick().await;
    loop {
        tokio::select! {
            msg = rx.recv() => {
                let Some(msg) = msg else { break };
                handle(&mut state, msg);
                if rx.is_empty() {
                    state.attribution.release_pending_orphans();
                }
            }
            _ = sweep.tick() => {
                let lost = state.attribution.newly_lost_events();
                if lost > 0 {
                    warn!(
                        lost,
                        "kernel events lost (ring buffer full); the sweeps reconcile what they \
                         would have said"
                    );
                }
                state.attribution.release_pending_orphans();
                state.attribution.sweep();
                state.attribution.sweep_memory();
                state.memory.sweep(&mut state.attribution);
                release_free_heap();
            }
            _ = rescan.tick(), if intervals.rescan.is_some() => {
                // Reading every process's fd table is blocking work: do it off this task.
                let matcher = state.attribution.matcher().clone();
                let tx = tx.clone();
                tokio::task::spawn_blocking(move || {
                    let found = scan::holders(&matcher);
                    let _ = tx.blocking_send(Message::Scanned(found));
                });
            }
            // Sent from this loop, so that it stops when the state task hangs.
            _ = watchdog.tick(), if intervals.watchdog.is_some() => {
                if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
                    warn!("cannot send the watchdog keep-alive: {e}");
                }
            }
            _ = shutdown.changed() => break,
        }
    }
    debug!("state task stopped");
    state
}

/// Hands the current inventory to the task that publishes the `Gpu1` objects, if it changed.
fn publish_inventory(state: &mut State) {
    let xid = &state.nvml.xid_errors;
    let inventory: Vec<GpuRecord> = state.nvml.gpus.iter().map(|g| gpu_record(g, xid)).collect();
    state.inventory.send_if_modified(|cur| {
        let changed = *cur != inventory;
        *cur = inventory;
        changed
    });
}

fn handle(state: &mut State, msg: Message) {
    if matches!(msg, Message::Request(_)) {
        // Answers reflect every exit read so far.
        state.attribution.release_pending_orphans();
    }
    let attribution = &mut state.attribution;
    match msg {
        Message::Request(Request::ListCgroups(reply)) => {
            let _ = reply.send(attribution.list());
        }
        Message::Request(Request::ListProcesses(reply)) => {
            let _ = reply.send(attribution.processes());
        }
        Message::Request(Request::GetCgroup { path, reply }) => {
            let _ = reply.send(attribution.get(&path));
        }
        Message::Request(Request::KernelStats(reply)) => {
            let _ = reply.send(attribution.kernel_stats());
        }
        Message::Request(Request::SetLimits {
            cgroup,
            gpu,
            update,
            reply,
        }) => {
            let _ = reply.send(state.memory.set(attribution, &cgroup, &gpu, update));
        }
        Message::Request(Request::ClearLimits {
            cgroup,
            gpu,
            names,
            reply,
        }) => {
            let _ = reply.send(state.memory.clear(attribution, &cgroup, &gpu, &names));
        }
        Message::Request(Request::ListLimits(reply)) => {
            let _ = reply.send(state.memory.list());
        }
        Message::Request(Request::ListGpus(reply)) => {
            let xid = &state.nvml.xid_errors;
            let _ = reply.send(state.nvml.gpus.iter().map(|g| gpu_record(g, xid)).collect());
        }
        Message::Request(Request::NvmlStatus(reply)) => {
            let _ = reply.send((state.nvml.available, state.nvml.status.clone()));
        }
        Message::Request(Request::ListNvmlUsage(reply)) => {
            let mut out = Vec::new();
            for ((cgroup, gpu), u) in state.nvml.by_cgroup() {
                let id = attribution.id_of(&cgroup).map(|(_, id)| id).unwrap_or(0);
                let ebpf = if id == 0 {
                    0
                } else {
                    attribution.usage_of(id, gpu)
                };
                out.push(NvmlUsageRecord {
                    cgroup_id: id,
                    cgroup,
                    gpu,
                    nvml_memory_bytes: u.memory_bytes,
                    ebpf_memory_bytes: ebpf,
                    sm_util: u.sm_util,
                    enc_util: u.enc_util,
                    dec_util: u.dec_util,
                    pids: u.pids,
                });
            }
            let _ = reply.send(out);
        }
        Message::Request(Request::ListIdle(reply)) => {
            let _ = reply.send(state.idle.list(std::time::Instant::now()));
        }
        Message::Request(Request::ListNvmlEvents(reply)) => {
            let out = state
                .nvml
                .events
                .iter()
                .cloned()
                .map(event_record)
                .collect();
            let _ = reply.send(out);
        }
        Message::Nvml(Snapshot::Xid { uuid, xid }) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            let id_of = |path: &str| attribution.id_of(path).map_or(0, |(_, id)| id);
            let rec = event_record(state.nvml.on_xid(uuid, xid, now, id_of));
            warn!(
                gpu = rec.gpu,
                uuid = %rec.uuid,
                xid = rec.xid,
                pid = rec.pid,
                cgroup = %rec.cgroup,
                pids = ?rec.pids,
                "critical Xid error on the GPU"
            );
            // No subscriber (no bus yet) is fine: the event is logged and kept.
            let _ = state.nvml_events.send(rec);
            publish_inventory(state);
        }
        Message::Nvml(snapshot) => {
            let fresh = matches!(
                snapshot,
                Snapshot::Available { .. } | Snapshot::Unavailable(_)
            );
            state.nvml.apply(snapshot);
            if fresh && let Some(control) = &state.control {
                let seq = control.borrow().seq + 1;
                let input = control_input(&state.nvml, &state.memory, seq);
                let _ = control.send(input);
            }
            // Unavailable: no inventory (the Gpu1 objects go away until NVML answers again).
            publish_inventory(state);
            if fresh {
                update_idle(state);
            }
            if state.nvml.available {
                state.memory.set_catalog(Some(
                    state
                        .nvml
                        .gpus
                        .iter()
                        .filter(|g| g.mig.is_none())
                        .map(|g| (g.index, g.uuid.clone()))
                        .collect(),
                ));
                // Reconciliation: objects of processes that are gone and that the driver no
                // longer reports hold no memory any more.
                let reported = state.nvml.reported_pids();
                let n = state.attribution.release_objects_of_dead_pids(&reported);
                if n > 0 {
                    info!(
                        objects = n,
                        "released objects of processes NVML no longer reports"
                    );
                }
            }
        }
        Message::Kernel(ev) => {
            attribution.on_kernel_event(&ev);
            if let Some(notice) = state.memory.on_event(attribution, &ev) {
                // No subscriber (no bus yet) is fine: the event is logged and counted.
                let _ = state.notices.send(notice);
            }
        }
        Message::Scanned(pids) => {
            let n = attribution.track_holders(pids);
            if n > 0 {
                info!(
                    processes = n,
                    "periodic scan found untracked device holders"
                );
            }
        }
    }
}

/// Forwards ring-buffer records to the state task until the channel closes.
pub async fn read_events(ring: RingBuf<MapData>, tx: mpsc::Sender<Message>) -> std::io::Result<()> {
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
    loop {
        let mut guard = fd.readable_mut().await?;
        let ring = guard.get_inner_mut();
        let mut batch = Vec::new();
        while let Some(item) = ring.next() {
            match parse_event(&item) {
                Some(ev) => batch.push(ev),
                None => warn!(len = item.len(), "malformed ring-buffer record"),
            }
        }
        guard.clear_ready();
        for ev in batch {
            if tx.send(Message::Kernel(ev)).await.is_err() {
                return Ok(());
            }
        }
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

/// Decodes one record; `None` if its size is not that of [`gpud_common::Event`].
pub fn parse_event(bytes: &[u8]) -> Option<gpud_common::Event> {
    if bytes.len() != size_of::<gpud_common::Event>() {
        return None;
    }
    // SAFETY: the length matches and Event is plain old data; read_unaligned copes with any
    // alignment of the ring-buffer slice.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<gpud_common::Event>()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_records_must_have_the_exact_size() {
        let ev = gpud_common::Event {
            kind: gpud_common::EVENT_PROC_NEW,
            tgid: 42,
            cgroup_id: 7,
            ..Default::default()
        };
        let size = size_of::<gpud_common::Event>();
        // SAFETY: Event is repr(C) plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts((&ev as *const gpud_common::Event).cast::<u8>(), size)
        };
        assert_eq!(parse_event(bytes), Some(ev));
        assert_eq!(parse_event(&bytes[..size - 1]), None);
        assert_eq!(parse_event(&vec![0u8; size + 1]), None);
        assert_eq!(parse_event(&[]), None);
    }
}

/// Fuzz targets (`cargo xtask fuzz` runs them with many more cases): ring-buffer records of any
/// length and content.
#[cfg(test)]
mod fuzz {
    use gpud_common::Event;
    use proptest::prelude::*;

    use super::parse_event;

    fn bytes_of(ev: &Event) -> Vec<u8> {
        // SAFETY: Event is repr(C) plain data without implicit padding (48 bytes of fields).
        unsafe { std::slice::from_raw_parts((ev as *const Event).cast::<u8>(), size_of::<Event>()) }
            .to_vec()
    }

    proptest! {
        /// Any record decodes exactly when it has the event's size, and then to its own bytes.
        #[test]
        fn any_record_decodes_or_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let ev = parse_event(&bytes);
            prop_assert_eq!(ev.is_some(), bytes.len() == size_of::<Event>());
            if let Some(ev) = ev {
                prop_assert_eq!(bytes_of(&ev), bytes);
            }
        }

        /// An event read from any offset of a buffer (the ring buffer guarantees no alignment
        /// to user space) is the event written there.
        #[test]
        fn events_round_trip_at_any_alignment(
            kind in any::<u32>(), tgid in any::<u32>(), cgroup_id in any::<u64>(),
            client in any::<u32>(), object in any::<u32>(), value in any::<u64>(),
            bytes in any::<u64>(), gpu in any::<u32>(), offset in 0usize..16,
        ) {
            let ev = Event { kind, tgid, cgroup_id, client, object, value, bytes, gpu, _pad: 0 };
            let mut buf = vec![0xa5u8; offset];
            buf.extend(bytes_of(&ev));
            prop_assert_eq!(parse_event(&buf[offset..]), Some(ev));
        }
    }
}
