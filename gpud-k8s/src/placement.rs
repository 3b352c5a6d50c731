//! GetPreferredAllocation's choice: which units of one resource a container gets.
//!
//! - A request that fits on one GPU (at most one GPU's units) gets all its units on one GPU:
//!   best fit (the GPU with the fewest free units that still hold it, keeping large holes for
//!   large requests), among GPUs where the other resource still has room (gpud's limits say how
//!   much is taken). No single GPU with room is an error: splitting 8 GiB over two GPUs gives a
//!   process two 4 GiB GPUs, not what it asked for.
//! - A larger request spans the fewest GPUs that hold it, chosen by topology: joined by NVLink
//!   first, then by the closest PCIe/NUMA ancestor.
//! - Memory and compute of one container belong on the same GPUs. The kubelet allocates the two
//!   resources one after the other and never says for which container, so the caller passes the
//!   GPUs the other resource of the same admission just got ([`Context::partner`]); the choice is
//!   then limited to them, and an error says so if they lack room.

use std::collections::{BTreeMap, BTreeSet};

use crate::{
    inventory::{Inventory, Slot},
    topology::Topology,
    units::{Resource, Unit},
};

/// Why no preferred allocation can be given; the kubelet fails the pod's admission with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "{resource}: {size} units asked, but no GPU has that many free (free per GPU: {free}); a container's units are kept on one GPU"
    )]
    NoSingleGpu {
        resource: Resource,
        size: u32,
        free: String,
    },
    #[error(
        "{resource}: {size} units asked, but the GPUs holding this container's {other} ({partner}) have only {free} free; memory and compute of a container are kept on the same GPUs"
    )]
    PartnerFull {
        resource: Resource,
        other: Resource,
        size: u32,
        partner: String,
        free: u32,
    },
    #[error("{resource}: {size} units asked, {free} free on healthy GPUs")]
    NotEnough {
        resource: Resource,
        size: u32,
        free: u32,
    },
    #[error("{resource}: unknown device ID {id:?}")]
    UnknownDevice { resource: Resource, id: String },
}

/// What the kubelet asked for.
#[derive(Clone, Debug)]
pub struct Request<'a> {
    pub resource: Resource,
    pub size: u32,
    pub available: &'a [String],
    pub must_include: &'a [String],
}

/// What else the choice depends on.
#[derive(Clone, Debug)]
pub struct Context<'a> {
    pub inventory: &'a Inventory,
    pub topology: &'a Topology,
    /// The GPUs (slot UUIDs) that got this container's other resource just before.
    pub partner: Option<&'a [String]>,
    /// Units of the other resource taken per slot (from gpud's limits).
    pub other_taken: &'a BTreeMap<String, u32>,
}

/// The preferred device IDs for `req`: `must_include` first, then the chosen units.
pub fn prefer(req: &Request<'_>, ctx: &Context<'_>) -> Result<Vec<String>, PlacementError> {
    let free = free_units(req, ctx.inventory)?;
    // The kubelet may name more units to include than it asks for: all of them are kept.
    let size = req
        .size
        .max(u32::try_from(req.must_include.len()).unwrap_or(u32::MAX));
    if size == 0 {
        return Ok(Vec::new());
    }
    let candidates = Candidates::new(free, ctx);
    let chosen = choose(req, size, &candidates, ctx)?;
    Ok(unit_ids(req, size, &candidates, chosen))
}

/// Free unit numbers per slot UUID from the offered IDs: healthy slots only, but a unit the
/// kubelet insists on counts wherever it is. An ID that names no slot is an error.
fn free_units<'i>(
    req: &Request<'_>,
    inventory: &'i Inventory,
) -> Result<BTreeMap<&'i str, BTreeSet<u32>>, PlacementError> {
    let unknown = |id: &String| PlacementError::UnknownDevice {
        resource: req.resource,
        id: id.clone(),
    };
    let mut free: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
    for id in req.available.iter().chain(req.must_include) {
        let unit = Unit::parse(id).ok_or_else(|| unknown(id))?;
        let slot = inventory.slot(&unit.uuid).ok_or_else(|| unknown(id))?;
        if slot.healthy() || req.must_include.contains(id) {
            free.entry(slot.uuid.as_str()).or_default().insert(unit.n);
        }
    }
    Ok(free)
}

/// The slots a request may use and their free units.
struct Candidates<'i> {
    /// Free unit numbers per slot UUID (from [`free_units`]).
    free: BTreeMap<&'i str, BTreeSet<u32>>,
    /// Slots with free units (within the partner's, if any), in inventory order.
    slots: Vec<&'i Slot>,
    /// Free units over `slots`.
    total: u32,
}

impl<'i> Candidates<'i> {
    fn new(free: BTreeMap<&'i str, BTreeSet<u32>>, ctx: &Context<'i>) -> Self {
        let slots: Vec<&Slot> = ctx
            .inventory
            .slots
            .iter()
            .filter(|s| free.contains_key(s.uuid.as_str()))
            .filter(|s| ctx.partner.is_none_or(|p| p.contains(&s.uuid)))
            .collect();
        let mut c = Self {
            free,
            slots,
            total: 0,
        };
        c.total = c.slots.iter().map(|s| c.n_free(s)).sum();
        c
    }

    /// Free units on `s`; 0 for a slot not offered.
    fn n_free(&self, s: &Slot) -> u32 {
        u32::try_from(self.free.get(s.uuid.as_str()).map_or(0, BTreeSet::len)).unwrap_or(u32::MAX)
    }
}

/// The slots to take `size` units from: one GPU when the request fits one, else the fewest
/// closest GPUs; or why none will do.
fn choose<'i>(
    req: &Request<'_>,
    size: u32,
    c: &Candidates<'i>,
    ctx: &Context<'i>,
) -> Result<Vec<&'i Slot>, PlacementError> {
    let r = req.resource;
    if let Some(partner) = ctx.partner
        && c.total < size
    {
        return Err(PlacementError::PartnerFull {
            resource: r,
            other: r.other(),
            size,
            partner: partner.join(", "),
            free: c.total,
        });
    }
    // The GPUs of units the kubelet insists on.
    let must: BTreeSet<&str> = req
        .must_include
        .iter()
        .filter_map(|id| id.rsplit_once("::").map(|(u, _)| u))
        .collect();
    if size <= max_units(ctx.inventory, r) && must.len() <= 1 {
        if let Some(s) = best_fit(r, size, &must, c, ctx) {
            return Ok(vec![s]);
        }
        // Without a partner a split would only be fragmentation; the partner's GPUs, though,
        // may hold the request only together.
        if ctx.partner.is_none() && c.total >= size {
            return Err(PlacementError::NoSingleGpu {
                resource: r,
                size,
                free: c
                    .slots
                    .iter()
                    .map(|s| format!("{} {}", s.uuid, c.n_free(s)))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    if c.total < size {
        return Err(PlacementError::NotEnough {
            resource: r,
            size,
            free: c.total,
        });
    }
    Ok(spread(&c.slots, size, ctx.topology, &|s| c.n_free(s)))
}

/// The most units of `r` any healthy slot offers: requests up to it stay on one GPU.
fn max_units(inventory: &Inventory, r: Resource) -> u32 {
    inventory
        .slots
        .iter()
        .filter(|s| s.healthy())
        .map(|s| inventory.units_of(s, r))
        .max()
        .unwrap_or(0)
}

/// Best fit on one GPU: the candidate with the fewest free units that still hold `size`,
/// preferring GPUs where the other resource has room, limited to `must`'s GPU if it names one.
fn best_fit<'i>(
    r: Resource,
    size: u32,
    must: &BTreeSet<&str>,
    c: &Candidates<'i>,
    ctx: &Context<'_>,
) -> Option<&'i Slot> {
    let other_room = |s: &Slot| {
        let cap = ctx.inventory.units_of(s, r.other());
        cap.saturating_sub(ctx.other_taken.get(&s.uuid).copied().unwrap_or(0)) > 0
    };
    c.slots
        .iter()
        .copied()
        .filter(|s| c.n_free(s) >= size)
        .filter(|s| must.is_empty() || must.contains(s.uuid.as_str()))
        .min_by_key(|s| (!other_room(s), c.n_free(s), s.index, s.mig))
}

/// `must_include` first, then the lowest free units of the chosen slots, fullest first, up to
/// `size` IDs.
fn unit_ids(
    req: &Request<'_>,
    size: u32,
    c: &Candidates<'_>,
    mut chosen: Vec<&Slot>,
) -> Vec<String> {
    let mut out: Vec<String> = req.must_include.to_vec();
    chosen.sort_by_key(|s| std::cmp::Reverse(c.n_free(s)));
    for s in chosen {
        for n in c.free.get(s.uuid.as_str()).into_iter().flatten() {
            if out.len() >= size as usize {
                break;
            }
            let id = Unit {
                uuid: s.uuid.clone(),
                n: *n,
            }
            .to_string();
            if !out.contains(&id) {
                out.push(id);
            }
        }
    }
    out
}

/// The fewest slots holding `size` units, closest together: grown greedily from each slot by
/// adding the slot closest to all chosen (the weakest link counts), and the best set kept.
fn spread<'s>(
    slots: &[&'s Slot],
    size: u32,
    topo: &Topology,
    n_free: &dyn Fn(&Slot) -> u32,
) -> Vec<&'s Slot> {
    let closeness = |set: &[&Slot], s: &Slot| {
        let scores = set.iter().map(|m| topo.score(&m.parent, &s.parent));
        (scores.clone().min().unwrap_or(0), scores.sum::<u32>())
    };
    let mut best: Option<(usize, u32, u64, Vec<&'s Slot>)> = None;
    for seed in slots {
        let mut set = vec![*seed];
        let mut held = n_free(seed);
        while held < size {
            let next = slots
                .iter()
                .filter(|s| !set.iter().any(|m| m.uuid == s.uuid))
                .max_by_key(|s| (closeness(&set, s), n_free(s)));
            let Some(next) = next else { break };
            held += n_free(next);
            set.push(*next);
        }
        if held < size {
            continue;
        }
        let mut weakest = u32::MAX;
        let mut sum = 0u64;
        for (i, a) in set.iter().enumerate() {
            for b in &set[i + 1..] {
                let s = topo.score(&a.parent, &b.parent);
                weakest = weakest.min(s);
                sum += u64::from(s);
            }
        }
        let better = best.as_ref().is_none_or(|(len, w, s, _)| {
            (
                set.len(),
                std::cmp::Reverse(weakest),
                std::cmp::Reverse(sum),
            ) < (*len, std::cmp::Reverse(*w), std::cmp::Reverse(*s))
        });
        if better {
            best = Some((set.len(), weakest, sum, set));
        }
    }
    best.map(|(_, _, _, set)| set).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::Link;
    use gpud_api::GpuRecord;

    const GIB: u64 = 1 << 30;

    fn inventory(n: u32, gib: u64) -> Inventory {
        let recs: Vec<GpuRecord> = (0..n)
            .map(|i| GpuRecord {
                index: i,
                mig: u32::MAX,
                uuid: format!("GPU-{i}"),
                memory_total: gib * GIB,
                mig_mode: "disabled".into(),
                ..Default::default()
            })
            .collect();
        Inventory::from_records(&recs, GIB)
    }

    fn ids(gpu: u32, units: std::ops::Range<u32>) -> Vec<String> {
        units.map(|n| format!("GPU-{gpu}::{n}")).collect()
    }

    fn gpus_of(ids: &[String]) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for id in ids {
            *m.entry(Unit::parse(id).map(|u| u.uuid).unwrap_or_default())
                .or_insert(0) += 1;
        }
        m
    }

    fn ctx<'a>(
        inv: &'a Inventory,
        topo: &'a Topology,
        taken: &'a BTreeMap<String, u32>,
    ) -> Context<'a> {
        Context {
            inventory: inv,
            topology: topo,
            partner: None,
            other_taken: taken,
        }
    }

    #[test]
    fn one_gpu_best_fit_and_clear_errors() {
        let inv = inventory(2, 16);
        let topo = Topology::default();
        let taken = BTreeMap::new();
        // GPU-0 has 10 free, GPU-1 16: 8 units go to GPU-0 (best fit).
        let mut avail = ids(0, 6..16);
        avail.extend(ids(1, 0..16));
        let req = Request {
            resource: Resource::Memory,
            size: 8,
            available: &avail,
            must_include: &[],
        };
        let got = prefer(&req, &ctx(&inv, &topo, &taken)).unwrap_or_default();
        assert_eq!(got, ids(0, 6..14));
        // 12 units: only GPU-1.
        let got = prefer(
            &Request {
                size: 12,
                ..req.clone()
            },
            &ctx(&inv, &topo, &taken),
        );
        assert_eq!(
            gpus_of(&got.unwrap_or_default()),
            [("GPU-1".to_owned(), 12)].into()
        );
        // GPU-0 full on compute: memory goes where compute has room.
        let full: BTreeMap<String, u32> = [("GPU-0".to_owned(), 100)].into();
        let got = prefer(&req, &ctx(&inv, &topo, &full)).unwrap_or_default();
        assert_eq!(gpus_of(&got), [("GPU-1".to_owned(), 8)].into());
        // 6 + 5 free: 8 fit the node but no GPU.
        let mut frag = ids(0, 0..6);
        frag.extend(ids(1, 0..5));
        let err = prefer(
            &Request {
                available: &frag,
                ..req.clone()
            },
            &ctx(&inv, &topo, &taken),
        );
        let msg = err.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("no GPU has that many free") && msg.contains("GPU-0 6"),
            "{msg}"
        );
        // Garbage IDs are refused by name.
        let junk = vec!["nvidia0".to_owned()];
        let err = prefer(
            &Request {
                available: &junk,
                ..req
            },
            &ctx(&inv, &topo, &taken),
        );
        assert!(matches!(err, Err(PlacementError::UnknownDevice { .. })));
    }

    #[test]
    fn the_partner_resource_pins_the_gpu() {
        let inv = inventory(2, 16);
        let topo = Topology::default();
        let taken = BTreeMap::new();
        let mut avail = ids(0, 0..100);
        avail.extend(ids(1, 0..100));
        let partner = vec!["GPU-1".to_owned()];
        let c = Context {
            partner: Some(&partner),
            ..ctx(&inv, &topo, &taken)
        };
        let req = Request {
            resource: Resource::Compute,
            size: 30,
            available: &avail,
            must_include: &[],
        };
        let got = prefer(&req, &c).unwrap_or_default();
        assert_eq!(gpus_of(&got), [("GPU-1".to_owned(), 30)].into());
        // GPU-1 has only 20 % left: refused rather than split.
        let mut avail = ids(0, 0..100);
        avail.extend(ids(1, 80..100));
        let err = prefer(
            &Request {
                available: &avail,
                ..req
            },
            &c,
        );
        let msg = err.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("GPU-1") && msg.contains("only 20 free"),
            "{msg}"
        );
    }

    #[test]
    fn multi_gpu_requests_prefer_nvlink_then_pcie() {
        // Four GPUs: 0-1 PCIe switch, 0-3 and 2-3 NVLink, the rest across NUMA nodes.
        let inv = inventory(4, 8);
        let mut topo = Topology::default();
        for a in 0..4 {
            for b in (a + 1)..4 {
                topo.insert(&format!("GPU-{a}"), &format!("GPU-{b}"), Link::System);
            }
        }
        topo.insert("GPU-0", "GPU-1", Link::PcieSwitch);
        topo.insert("GPU-2", "GPU-3", Link::NvLink(4));
        let taken = BTreeMap::new();
        let avail: Vec<String> = (0..4).flat_map(|g| ids(g, 0..100)).collect();
        let req = Request {
            resource: Resource::Compute,
            size: 200,
            available: &avail,
            must_include: &[],
        };
        let got = prefer(&req, &ctx(&inv, &topo, &taken)).unwrap_or_default();
        assert_eq!(
            gpus_of(&got),
            [("GPU-2".to_owned(), 100), ("GPU-3".to_owned(), 100)].into()
        );
        // GPU-3 busy: next best pair is the PCIe switch.
        let avail: Vec<String> = (0..3).flat_map(|g| ids(g, 0..100)).collect();
        let got = prefer(
            &Request {
                available: &avail,
                ..req.clone()
            },
            &ctx(&inv, &topo, &taken),
        )
        .unwrap_or_default();
        assert_eq!(
            gpus_of(&got),
            [("GPU-0".to_owned(), 100), ("GPU-1".to_owned(), 100)].into()
        );
        // 150 units: two GPUs, one full, the rest on the closest one.
        let avail: Vec<String> = (0..4).flat_map(|g| ids(g, 0..100)).collect();
        let got = prefer(
            &Request {
                size: 150,
                available: &avail,
                ..req
            },
            &ctx(&inv, &topo, &taken),
        )
        .unwrap_or_default();
        let g = gpus_of(&got);
        assert_eq!(g.len(), 2, "{g:?}");
        assert!(g.contains_key("GPU-2") && g.contains_key("GPU-3"), "{g:?}");
    }

    #[test]
    fn must_include_is_kept() {
        let inv = inventory(2, 8);
        let topo = Topology::default();
        let taken = BTreeMap::new();
        let mut avail = ids(0, 0..8);
        avail.extend(ids(1, 0..8));
        let must = ids(1, 3..4);
        let got = prefer(
            &Request {
                resource: Resource::Memory,
                size: 4,
                available: &avail,
                must_include: &must,
            },
            &ctx(&inv, &topo, &taken),
        )
        .unwrap_or_default();
        assert_eq!(got.first(), must.first());
        assert_eq!(gpus_of(&got), [("GPU-1".to_owned(), 4)].into());
    }
}
