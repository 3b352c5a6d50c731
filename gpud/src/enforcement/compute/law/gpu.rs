//! One GPU's plan for a period: which of its units are controlled, the firmware probe, and the
//! hand-over to hardware windows or freezer slots; and releasing a unit from control.

use std::collections::BTreeSet;

use super::{Command, Firmware, Gpu, Law, LawParams, Nanos, Unit, targets};
use super::{freezer::plan_freezer, hardware::plan_hardware};
use crate::policy::Limits;

/// Thaws a unit and puts its groups back on the runlist.
pub(super) fn release(name: &str, u: &mut Unit, held: &BTreeSet<String>, out: &mut Vec<Command>) {
    if (u.frozen || u.unsure) && !held.contains(name) {
        out.push(Command::Freeze {
            unit: name.to_owned(),
            frozen: false,
        });
        u.frozen = false;
    }
    if u.off || u.unsure {
        for &pid in &u.pids {
            out.push(Command::Schedule { pid, enabled: true });
        }
        u.off = false;
    }
}

/// The units of a GPU that are active now, with their policies, in order.
pub(super) fn active_units(
    p: &LawParams,
    g: &Gpu,
    now: Nanos,
    held: &BTreeSet<String>,
) -> Vec<(String, Limits)> {
    g.units
        .iter()
        .filter(|(n, u)| !held.contains(*n) && Law::active(p, u, now))
        .map(|(n, u)| (n.clone(), u.limits.clone()))
        .collect()
}

/// Plans one GPU from `now`; returns how long the plan lasts.
pub(super) fn plan_gpu(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    active: &[(String, Limits)],
    held: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Nanos {
    // The probe, while it runs, is the whole plan.
    if let Firmware::Probing { pid, until, .. } = g.firmware {
        if now < until {
            return p.period;
        }
        g.firmware = Firmware::Honors;
        out.push((now, Command::Schedule { pid, enabled: true }));
        for u in g.units.values_mut().filter(|u| u.pids.contains(&pid)) {
            u.off = false;
        }
    }
    let active: Vec<String> = active.iter().map(|(n, _)| n.clone()).collect();
    let any_policy = active.iter().any(|n| g.units[n].limits.has_compute());
    let demands: Vec<(f64, Limits)> = active
        .iter()
        .map(|n| (100.0, g.units[n].limits.clone()))
        .collect();
    let pairs: Vec<(f64, &Limits)> = demands.iter().map(|(d, l)| (*d, l)).collect();
    let t = targets(&pairs);
    let total: f64 = t.iter().sum();
    let needs_control = any_policy && (active.len() > 1 || total < 99.5);
    g.controlled = any_policy;
    // Units not controlled this period run freely.
    let mut released = Vec::new();
    for (name, u) in g.units.iter_mut() {
        if !needs_control || !active.contains(name) {
            release(name, u, held, &mut released);
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
    let hw = active.iter().all(|n| g.units[n].hw);
    if g.firmware == Firmware::Unknown && hw {
        // Probe with the tenant that was listed last (it has work to show).
        let probe = active
            .iter()
            .filter_map(|n| Some((g.units[n].listed?, n.clone())))
            .max()
            .and_then(|(_, n)| g.units[&n].pids.first().copied());
        if let Some(pid) = probe {
            let mut released = Vec::new();
            for (name, u) in g.units.iter_mut() {
                release(name, u, held, &mut released);
            }
            out.extend(released.into_iter().map(|c| (now, c)));
            g.firmware = Firmware::Probing {
                pid,
                since: now,
                until: now + p.probe,
            };
            out.push((
                now,
                Command::Schedule {
                    pid,
                    enabled: false,
                },
            ));
            for u in g.units.values_mut() {
                // What the fallback measured so far was not under its own slots.
                u.slot = None;
                if u.pids.contains(&pid) {
                    u.off = true;
                    u.stopped = Some(now);
                }
            }
            return p.period;
        }
    }
    g.phase = g
        .phase
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let offset = (g.phase >> 33) % p.period;
    if hw && g.firmware == Firmware::Honors {
        plan_hardware(p, g, &active, now, offset, out);
        p.period
    } else {
        plan_freezer(p, g, &active, now, offset, held, out)
    }
}
