//! What the node has to hand out, as gpud reports it: the GPUs and MIG devices of gpud's
//! `ListGpus` (NVML's inventory), their health, and the units each offers.
//!
//! A GPU in MIG mode is handed out by its MIG devices (each a slot of its own, with its own memory
//! and 100 % compute units); a GPU without MIG is one slot. A slot is unhealthy while gpud cannot
//! be asked (without gpud, limits could not be enforced), while gpud's NVML is unavailable, when
//! it left gpud's inventory, or after a critical Xid error gpud reported for it (sticky until the
//! plugin restarts, as a GPU needs a reset; application Xids such as 13 or 43 are ignored).

use std::collections::{BTreeMap, BTreeSet};

use gpud_api::{GpuRecord, NvmlEventRecord};

use crate::{api::deviceplugin as dp, units::Resource, units::Unit};

/// The device-plugin API's health strings.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// Xid errors caused by applications rather than the GPU (NVIDIA's device plugin skips the
/// same): a pod's bad kernel must not take the GPU away from the node.
pub const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// One GPU or MIG device that units are handed out on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// `GPU-…` or `MIG-…`: the key of limits and of device IDs.
    pub uuid: String,
    /// The physical GPU's UUID (itself for a whole GPU): topology is the parent's.
    pub parent: String,
    /// NVML index of the (parent) GPU.
    pub index: u32,
    /// MIG device number, for a MIG device.
    pub mig: Option<u32>,
    pub memory_total: u64,
    /// Why it is unhealthy; `None`: healthy.
    pub unhealthy: Option<Unhealthy>,
    /// NUMA node of the GPU, where known (reported to the kubelet's topology manager).
    pub numa_node: Option<u32>,
}

impl Slot {
    pub fn healthy(&self) -> bool {
        self.unhealthy.is_none()
    }
}

/// Why a slot is unhealthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unhealthy {
    /// A critical Xid gpud reported for the GPU (the first one seen).
    Xid(u64),
    /// The GPU left gpud's inventory.
    Gone,
    /// gpud's NVML is unavailable.
    NvmlUnavailable,
    /// gpud does not answer (why).
    GpudUnreachable(String),
}

impl Unhealthy {
    /// A short CamelCase reason (a valid label value), e.g. for a DRA device taint.
    pub fn reason(&self) -> String {
        match self {
            Self::Xid(x) => format!("Xid{x}"),
            Self::Gone => "NotInInventory".into(),
            Self::NvmlUnavailable => "NVMLUnavailable".into(),
            Self::GpudUnreachable(_) => "GpudUnreachable".into(),
        }
    }
}

impl std::fmt::Display for Unhealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Xid(x) => write!(f, "critical Xid {x} reported by gpud"),
            Self::Gone => f.write_str("no longer in gpud's inventory"),
            Self::NvmlUnavailable => f.write_str("gpud's NVML is unavailable"),
            Self::GpudUnreachable(why) => write!(f, "gpud unreachable: {why}"),
        }
    }
}

/// The slots and the unit size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inventory {
    pub slots: Vec<Slot>,
    /// Bytes per `gpud.dev/gpu-memory` unit.
    pub memory_unit: u64,
}

impl Inventory {
    pub fn empty(memory_unit: u64) -> Self {
        Self {
            slots: Vec::new(),
            memory_unit,
        }
    }

    /// The slots of gpud's `ListGpus`: MIG devices of GPUs in MIG mode, whole GPUs otherwise.
    pub fn from_records(records: &[GpuRecord], memory_unit: u64) -> Self {
        let parents: BTreeMap<u32, &GpuRecord> = records
            .iter()
            .filter(|r| r.mig == u32::MAX)
            .map(|r| (r.index, r))
            .collect();
        let mut slots = Vec::new();
        for r in records {
            let whole = r.mig == u32::MAX;
            let has_migs = records
                .iter()
                .any(|m| m.mig != u32::MAX && m.index == r.index);
            if whole && (r.mig_mode == "enabled" || has_migs) {
                // Handed out by its MIG devices; a MIG-mode GPU without MIG devices has nothing
                // to offer.
                continue;
            }
            let parent = if whole {
                r.uuid.clone()
            } else {
                parents
                    .get(&r.index)
                    .map_or_else(|| r.uuid.clone(), |p| p.uuid.clone())
            };
            slots.push(Slot {
                uuid: r.uuid.clone(),
                parent,
                index: r.index,
                mig: (!whole).then_some(r.mig),
                memory_total: r.memory_total,
                unhealthy: None,
                numa_node: None,
            });
        }
        slots.sort_by_key(|s| (s.index, s.mig));
        Self { slots, memory_unit }
    }

    /// Units of `r` one slot offers.
    pub fn units_of(&self, slot: &Slot, r: Resource) -> u32 {
        match r {
            Resource::Memory => {
                u32::try_from(slot.memory_total / self.memory_unit.max(1)).unwrap_or(u32::MAX)
            }
            Resource::Compute => 100,
        }
    }

    pub fn slot(&self, uuid: &str) -> Option<&Slot> {
        self.slots.iter().find(|s| s.uuid == uuid)
    }

    /// Every unit of `r` as the kubelet sees it.
    pub fn devices(&self, r: Resource) -> Vec<dp::Device> {
        let mut out = Vec::new();
        for s in &self.slots {
            let health = if s.healthy() { HEALTHY } else { UNHEALTHY };
            let topology = s.numa_node.map(|n| dp::TopologyInfo {
                nodes: vec![dp::NumaNode { id: i64::from(n) }],
            });
            for n in 0..self.units_of(s, r) {
                out.push(dp::Device {
                    id: Unit {
                        uuid: s.uuid.clone(),
                        n,
                    }
                    .to_string(),
                    health: health.to_owned(),
                    topology: topology.clone(),
                });
            }
        }
        out
    }

    /// Marks every slot unhealthy for `why` (gpud unreachable, NVML unavailable).
    pub fn all_unhealthy(&mut self, why: &Unhealthy) {
        for s in &mut self.slots {
            s.unhealthy.get_or_insert_with(|| why.clone());
        }
    }
}

/// Health over time: keeps slots that left gpud's inventory (as unhealthy, so the kubelet keeps
/// counting their allocated units) and Xid verdicts (sticky).
#[derive(Debug)]
pub struct HealthTracker {
    memory_unit: u64,
    ignored_xids: BTreeSet<u64>,
    /// UUIDs with a critical Xid seen, and the first such Xid.
    xid: BTreeMap<String, u64>,
    last: Inventory,
}

impl HealthTracker {
    pub fn new(memory_unit: u64, ignored_xids: impl IntoIterator<Item = u64>) -> Self {
        Self {
            memory_unit,
            ignored_xids: ignored_xids.into_iter().collect(),
            xid: BTreeMap::new(),
            last: Inventory::empty(memory_unit),
        }
    }

    /// The inventory from one round of answers from gpud: its GPUs, whether its NVML is
    /// available, its recent NVML events, and each GPU's NUMA node where known.
    pub fn update(
        &mut self,
        gpus: &[GpuRecord],
        nvml_available: bool,
        events: &[NvmlEventRecord],
        numa: &BTreeMap<String, u32>,
    ) -> Inventory {
        for e in events {
            if e.kind == "xid" && !self.ignored_xids.contains(&e.xid) {
                self.xid.entry(e.uuid.clone()).or_insert(e.xid);
            }
        }
        let mut inv = Inventory::from_records(gpus, self.memory_unit);
        for s in &mut inv.slots {
            s.numa_node = numa.get(&s.parent).copied();
            // An Xid named on the parent GPU affects all its MIG devices.
            let xid = self.xid.get(&s.uuid).or_else(|| self.xid.get(&s.parent));
            if let Some(x) = xid {
                s.unhealthy = Some(Unhealthy::Xid(*x));
            }
        }
        // GPUs that vanished stay listed, unhealthy: units allocated on them remain counted.
        for old in &self.last.slots {
            if inv.slot(&old.uuid).is_none() {
                let mut gone = old.clone();
                gone.unhealthy = Some(Unhealthy::Gone);
                inv.slots.push(gone);
            }
        }
        if !nvml_available {
            inv.all_unhealthy(&Unhealthy::NvmlUnavailable);
        }
        self.last = inv.clone();
        inv
    }

    /// The last inventory with every slot unhealthy: gpud cannot be asked.
    pub fn unreachable(&mut self, why: &str) -> Inventory {
        let mut inv = self.last.clone();
        for s in &mut inv.slots {
            s.unhealthy = Some(Unhealthy::GpudUnreachable(why.to_owned()));
        }
        inv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    pub(crate) fn gpu(index: u32, uuid: &str, memory: u64) -> GpuRecord {
        GpuRecord {
            index,
            mig: u32::MAX,
            uuid: uuid.into(),
            memory_total: memory,
            mig_mode: "disabled".into(),
            ..Default::default()
        }
    }

    #[test]
    fn whole_gpus_and_mig_devices_become_slots_with_units() {
        let mut a100 = gpu(1, "GPU-b", 40 * GIB);
        a100.mig_mode = "enabled".into();
        let mig = |m, uuid: &str, mem| GpuRecord {
            index: 1,
            mig: m,
            uuid: uuid.into(),
            memory_total: mem,
            ..Default::default()
        };
        let recs = vec![
            gpu(0, "GPU-a", 80 * GIB + 512 * (1 << 20)),
            a100,
            mig(0, "MIG-x", 20 * GIB),
            mig(1, "MIG-y", 10 * GIB),
        ];
        let inv = Inventory::from_records(&recs, GIB);
        let uuids: Vec<&str> = inv.slots.iter().map(|s| s.uuid.as_str()).collect();
        assert_eq!(uuids, ["GPU-a", "MIG-x", "MIG-y"]);
        assert_eq!(inv.slots[1].parent, "GPU-b");
        // Partial units are not offered: 80.5 GiB is 80 units.
        assert_eq!(inv.devices(Resource::Memory).len(), 80 + 20 + 10);
        assert_eq!(inv.devices(Resource::Compute).len(), 300);
        assert!(
            inv.devices(Resource::Memory)
                .iter()
                .all(|d| d.health == HEALTHY)
        );
        let two_gib = Inventory::from_records(&recs, 2 * GIB);
        assert_eq!(two_gib.devices(Resource::Memory).len(), 40 + 10 + 5);
    }

    #[test]
    fn xids_make_gpus_unhealthy_for_good_and_vanished_gpus_stay_listed() {
        let mut t = HealthTracker::new(GIB, APPLICATION_XIDS.iter().copied());
        let recs = vec![gpu(0, "GPU-a", 2 * GIB), gpu(1, "GPU-b", 2 * GIB)];
        let xid = |uuid: &str, xid| NvmlEventRecord {
            uuid: uuid.into(),
            kind: "xid".into(),
            xid,
            ..Default::default()
        };
        let none = BTreeMap::new();
        let inv = t.update(&recs, true, &[xid("GPU-a", 43)], &none);
        assert!(
            inv.slots.iter().all(Slot::healthy),
            "Xid 43 is the application's"
        );
        let inv = t.update(&recs, true, &[xid("GPU-b", 79)], &none);
        assert_eq!(inv.slots[1].unhealthy, Some(Unhealthy::Xid(79)));
        assert_eq!(
            inv.slots[1].unhealthy.as_ref().map(ToString::to_string),
            Some("critical Xid 79 reported by gpud".to_owned())
        );
        assert!(inv.slots[0].healthy());
        // gpud's event list moved on: still unhealthy.
        let inv = t.update(&recs, true, &[], &none);
        assert!(!inv.slots[1].healthy());
        // GPU-a fell off the bus: listed, unhealthy.
        let inv = t.update(&recs[1..], true, &[], &none);
        assert_eq!(inv.slots.len(), 2);
        assert!(inv.slots.iter().all(|s| !s.healthy()));
        let inv = t.unreachable("no bus");
        assert!(inv.slots.iter().all(|s| {
            matches!(&s.unhealthy, Some(Unhealthy::GpudUnreachable(w)) if w == "no bus")
        }));
        let inv = t.update(&recs, false, &[], &none);
        assert!(inv.slots.iter().all(|s| !s.healthy()), "NVML unavailable");
    }
}
