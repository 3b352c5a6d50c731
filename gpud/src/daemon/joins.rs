//! Joins of what the state task owns, computed on demand: attribution × NVML per cgroup, the idle
//! rule's observations, and the compute controller's input. Pure functions of the state, so the
//! switchboard in `mod.rs` stays one line per message.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use tokio::sync::mpsc;
use tracing::debug;

use crate::{
    attribution::{Attribution, TenantObjects},
    enforcement::{
        MemoryEnforcement,
        compute::{
            ControlInput,
            law::{DeviceSample, ProcSample, Reading, Tenant},
        },
    },
    nvml::{CgroupUsage, NvmlView, ProcessSample},
    policy::{PolicyStore, idle::Observation},
};

/// NVML's figures for one cgroup on one GPU beside the memory the probes charged to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvmlUsage {
    /// cgroup v2 id (0 if the cgroup is gone).
    pub cgroup_id: u64,
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    pub gpu: u32,
    /// What NVML reported for the cgroup's processes on that GPU.
    pub usage: CgroupUsage,
    /// GPU memory the probes charged to the cgroup on that GPU (bytes; hierarchical).
    pub ebpf_memory_bytes: u64,
}

/// Per cgroup and GPU that NVML reported at the last sample: its figures and the probes'.
pub(super) fn nvml_usage(attribution: &mut Attribution, nvml: &NvmlView) -> Vec<NvmlUsage> {
    nvml.by_cgroup()
        .into_iter()
        .map(|((cgroup, gpu), usage)| {
            let cgroup_id = attribution.id_of(&cgroup).map_or(0, |(_, id)| id);
            let ebpf_memory_bytes = if cgroup_id == 0 {
                0
            } else {
                attribution.usage_of(cgroup_id, gpu)
            };
            NvmlUsage {
                cgroup_id,
                cgroup,
                gpu,
                usage,
                ebpf_memory_bytes,
            }
        })
        .collect()
}

/// What the idle rule sees at an NVML sample: every cgroup with live attributed processes or
/// NVML-reported processes, per GPU index, with the larger of the probes' and NVML's memory
/// figure and NVML's utilization. A process without a utilization sample since the previous one
/// did not run on the GPU: it counts as 0 %.
pub(super) fn idle_observations(
    attribution: &mut Attribution,
    nvml: &NvmlView,
) -> Vec<Observation> {
    let mut seen: BTreeMap<(String, u32), Observation> = BTreeMap::new();
    for c in attribution.list() {
        if c.pids.is_empty() {
            continue;
        }
        for (gpu, bytes) in &c.memory.current {
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

/// What the state task keeps to feed the compute task.
pub(super) struct ComputeFeed {
    pub tx: mpsc::Sender<ControlInput>,
    /// Whether hardware controls are on (`compute.hardware`): only then are channel groups
    /// looked up.
    pub hardware: bool,
    /// Channel groups, channels and subdevices by tenant process, from the last walk of the
    /// objects map (empty: walked, none found).
    pub groups: BTreeMap<u32, TenantObjects>,
    pub walked: Option<Instant>,
    /// When each tenant was first seen: CUDA makes its groups and channels over a second or
    /// two after NVML lists the process, so young tenants are looked up again sooner.
    pub first_seen: BTreeMap<u32, Instant>,
}

/// How often the objects map is walked for new tenants' channel groups, at most.
const WALK_NEW: Duration = Duration::from_secs(1);
/// ... and for channel groups created after a tenant was first seen.
const WALK_ALL: Duration = Duration::from_secs(10);
/// A tenant seen for less than this is looked up at the pace of new ones.
const YOUNG: Duration = Duration::from_secs(5);

/// Sends the compute task what the last NVML sample shows: per GPU, every process with its
/// controlled unit (the deepest cgroup with a compute policy above the process's cgroup, else
/// its own cgroup) and that unit's policy there, NVML's new windows, and the channel groups.
pub(super) fn feed_compute(
    feed: &mut ComputeFeed,
    attribution: &mut Attribution,
    nvml: &NvmlView,
    memory: &MemoryEnforcement,
    store: &PolicyStore,
) {
    let policies = store.compute_policies();
    let unit_of = |path: &str| -> String {
        policies
            .iter()
            .map(|(p, _, _)| p.as_str())
            .filter(|p| path == *p || path.starts_with(&format!("{}/", p.trim_end_matches('/'))))
            .max_by_key(|p| p.len())
            .unwrap_or(path)
            .to_owned()
    };
    let procs: Vec<(&ProcessSample, String)> = nvml
        .processes
        .iter()
        .filter(|p| !p.cgroup.is_empty())
        .map(|p| (p, unit_of(&p.cgroup)))
        .collect();
    let mut gpus_of: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
    for (p, unit) in &procs {
        gpus_of.entry(unit.as_str()).or_default().insert(p.gpu);
    }
    let pids: BTreeSet<u32> = procs.iter().map(|(p, _)| p.pid).collect();
    if feed.hardware {
        refresh_groups(feed, attribution, &pids);
    }
    let tenants = procs
        .iter()
        .map(|(p, unit)| Tenant {
            pid: p.pid,
            gpu: p.gpu,
            limits: store
                .compute_policy_for(unit, p.gpu, gpus_of[unit.as_str()].len() as u32)
                .unwrap_or_default(),
            unit: unit.clone(),
            hw: feed
                .groups
                .get(&p.pid)
                .is_some_and(|g| !g.groups.is_empty()),
        })
        .collect();
    let mut readings: BTreeMap<u32, Reading> = nvml
        .gpus
        .iter()
        .filter(|g| g.mig.is_none())
        .map(|g| {
            let r = Reading {
                gpu: g.index,
                clock_us: nvml.clock_us,
                device: nvml
                    .device_windows
                    .get(&g.index)
                    .into_iter()
                    .flatten()
                    .map(|&(timestamp_us, util)| DeviceSample { timestamp_us, util })
                    .collect(),
                ..Reading::default()
            };
            (g.index, r)
        })
        .collect();
    for p in &nvml.processes {
        let r = readings.entry(p.gpu).or_insert_with(|| Reading {
            gpu: p.gpu,
            clock_us: nvml.clock_us,
            ..Reading::default()
        });
        r.running.push(p.pid);
        r.samples
            .extend(p.windows.iter().map(|&(timestamp_us, sm_util)| ProcSample {
                pid: p.pid,
                timestamp_us,
                sm_util,
            }));
    }
    let input = ControlInput {
        at: nvml.updated.unwrap_or_else(Instant::now),
        tenants,
        readings: readings.into_values().collect(),
        memory_frozen: memory.frozen(),
        groups: feed.groups.clone(),
    };
    if feed.tx.try_send(input).is_err() {
        // Full: the compute task is behind by many samples; closed: it stopped.
        debug!("compute input dropped");
    }
}

/// Keeps the channel groups of the processes in `pids`: walks the objects map when one of them
/// has not been looked up yet (at most every [`WALK_NEW`]) and every [`WALK_ALL`].
fn refresh_groups(feed: &mut ComputeFeed, attribution: &Attribution, pids: &BTreeSet<u32>) {
    feed.groups.retain(|pid, _| pids.contains(pid));
    feed.first_seen.retain(|pid, _| pids.contains(pid));
    for p in pids {
        feed.first_seen.entry(*p).or_insert_with(Instant::now);
    }
    let since = feed.walked.map(|t| t.elapsed());
    let new = pids.iter().any(|p| !feed.groups.contains_key(p))
        || feed.first_seen.values().any(|t| t.elapsed() < YOUNG);
    let due = match since {
        None => true,
        Some(s) => (new && s >= WALK_NEW) || s >= WALK_ALL,
    };
    if !due {
        return;
    }
    feed.walked = Some(Instant::now());
    let mut found = attribution.tenant_objects(pids);
    feed.groups = pids
        .iter()
        .map(|p| (*p, found.remove(p).unwrap_or_default()))
        .collect();
}
