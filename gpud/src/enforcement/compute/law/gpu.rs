//! One GPU's plan for a period: which of its units are controlled, the firmware probe, and the
//! hand-over to hardware windows or freezer slots.

use std::collections::BTreeSet;

use super::{Command, Firmware, Gpu, Law, LawParams, Nanos, probe, share::targets};
use super::{freezer::plan_freezer, hardware::plan_hardware};
use crate::policy::{Limits, Priority};

/// The units of a GPU that are active now, with their policies, in order.
pub(super) fn active_units(
    p: &LawParams,
    g: &Gpu,
    now: Nanos,
    memory_frozen: &BTreeSet<String>,
) -> Vec<(String, Limits)> {
    g.units
        .iter()
        .filter(|(n, u)| !memory_frozen.contains(*n) && Law::active(p, u, now))
        .map(|(n, u)| (n.clone(), u.limits.clone()))
        .collect()
}

/// A class's timeslice: latency-critical long, best-effort short (µs); `None` for no class.
fn class_timeslice(p: &LawParams, priority: Option<Priority>) -> Option<u64> {
    match priority {
        Some(Priority::LatencyCritical) => Some(p.max_timeslice_us),
        Some(Priority::BestEffort) => Some(p.min_timeslice_us),
        _ => None,
    }
}

/// Gives every controllable unit with a priority class its class's timeslice, from the first
/// plan that sees it, active or not; a unit whose class was removed gets the base timeslice
/// back. Returns the units the timeslices serve (they are neither held nor frozen for shares).
fn class_timeslices(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    out: &mut Vec<(Nanos, Command)>,
) -> BTreeSet<String> {
    let mut classed = BTreeSet::new();
    for (name, u) in g.units.iter_mut().filter(|(_, u)| u.hw) {
        let want = match class_timeslice(p, u.limits.priority) {
            Some(us) => {
                classed.insert(name.clone());
                us
            }
            // Back to the base timeslice after a class (a normal unit's windows set it too).
            None if u.timeslice.is_some_and(|t| t != p.base_timeslice_us) => p.base_timeslice_us,
            None => continue,
        };
        if u.timeslice != Some(want) {
            for &pid in &u.pids {
                out.push((now, Command::Timeslice { pid, us: want }));
            }
            u.timeslice = Some(want);
        }
    }
    classed
}

/// Plans one GPU from `now`; returns how long the plan lasts.
pub(super) fn plan_gpu(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    active: &[(String, Limits)],
    memory_frozen: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Nanos {
    if let Some(lasts) = probe::go_on(p, g, now, memory_frozen, out) {
        // The probe, while it runs, is the whole plan.
        return lasts;
    }
    let mut classed = class_timeslices(p, g, now, out);
    if g.firmware == Firmware::Ignores {
        // A GPU that ignores every lever may ignore timeslices too: the classes also get the
        // freezer's rule (best-effort frozen while latency-critical is seen active).
        classed.clear();
    }
    let everyone: Vec<String> = active.iter().map(|(n, _)| n.clone()).collect();
    let any_policy = everyone.iter().any(|n| g.units[n].limits.has_compute());
    g.controlled = any_policy;
    // Classed units run on their timeslices; the rest share by windows or slots.
    let active: Vec<String> = everyone
        .iter()
        .filter(|n| !classed.contains(*n))
        .cloned()
        .collect();
    let demands: Vec<(f64, Limits)> = active
        .iter()
        .map(|n| (100.0, g.units[n].limits.clone()))
        .collect();
    let pairs: Vec<(f64, &Limits)> = demands.iter().map(|(d, l)| (*d, l)).collect();
    let t = targets(&pairs);
    let total: f64 = t.iter().sum();
    let shared = active.iter().any(|n| g.units[n].limits.has_compute());
    let needs_control = shared && (active.len() > 1 || total < 99.5);
    // Units not controlled this period run freely.
    let mut released = Vec::new();
    for (name, u) in g.units.iter_mut() {
        if !needs_control || !active.contains(name) {
            u.release(name, memory_frozen, &mut released);
            u.stat.duty = 100.0;
            u.stat.target = 0.0;
        }
    }
    out.extend(released.into_iter().map(|c| (now, c)));
    if !needs_control {
        return p.period;
    }
    for (i, n) in active.iter().enumerate() {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        if u.target != t[i] {
            // Another target: the lone unit's correction starts over.
            u.slot = None;
        }
        u.target = t[i];
        u.stat.target = t[i];
    }
    let hw = g.units.values().all(|u| u.hw);
    if hw && probe::start(p, g, now, memory_frozen, out) {
        return p.period;
    }
    g.phase = g
        .phase
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let offset = (g.phase >> 33) % p.period;
    match g.firmware {
        Firmware::Honors(lever) if hw => {
            plan_hardware(p, g, &active, now, offset, lever, out);
            p.period
        }
        _ => plan_freezer(p, g, &active, now, offset, memory_frozen, out),
    }
}
