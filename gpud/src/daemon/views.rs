//! Joins of what the state task owns, computed on demand: attribution × NVML per cgroup, the idle
//! rule's observations, and the compute controller's input. Pure functions of the state, so the
//! switchboard in `mod.rs` stays one line per message.

use std::collections::BTreeMap;

use tracing::info;

use super::State;
use crate::{
    attribution::Attribution,
    enforcement::{
        MemoryEnforcement,
        compute::{CgroupInput, ControlInput},
    },
    nvml::{CgroupUsage, NvmlView},
    policy::idle::Observation,
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
fn idle_observations(attribution: &mut Attribution, nvml: &NvmlView) -> Vec<Observation> {
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

/// Runs the idle rule on the current figures and forwards its transitions.
pub(super) fn update_idle(state: &mut State) {
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
        if state.idle_signal {
            // No subscriber (no bus yet) is fine: the change is logged and listed.
            let _ = state.outputs.idle_changes.send(c);
        }
    }
}

/// The controller's input from the last NVML sample: per GPU, each controlled unit (the deepest
/// cgroup with a compute policy above a process's cgroup, else the process's own cgroup) with its
/// summed utilization and its policy.
pub(super) fn control_input(nvml: &NvmlView, memory: &MemoryEnforcement, seq: u64) -> ControlInput {
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
