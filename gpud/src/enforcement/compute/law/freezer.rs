//! The fallback where the controls are ignored or cannot be issued: exclusive freezer slots.

use std::collections::BTreeSet;

use super::{Command, Gpu, LawParams, MS, Nanos, Unit};
use crate::policy::Priority;

/// Longest freezer cycle.
const MAX_CYCLE: Nanos = 1_600 * MS;

/// The smallest freezer slot lasts this many thaw latencies (a thaw's delay varies).
const MIN_SLOT_THAWS: u64 = 5;

/// The fallback: each active unit alone (the others frozen) for its slot of a cycle, slots in
/// proportion to the targets, the cycle long enough that the smallest slot lasts a period (a
/// frozen unit's queued work drains into the next slot: shorter than the period, the slot
/// absorbs it); latency-critical units are never frozen, and best-effort ones are frozen while
/// a latency-critical one is active. Returns the cycle's length.
pub(super) fn plan_freezer(
    p: &LawParams,
    g: &mut Gpu,
    active: &[String],
    now: Nanos,
    offset: u64,
    memory_frozen: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Nanos {
    let mut cmds = Commands { out, memory_frozen };
    let slotted = slotted_units(g, active);
    release_and_exempt(p, g, active, &slotted, now, &mut cmds);
    if slotted.is_empty() || run_lone_uncapped(g, &slotted, now, &mut cmds) {
        return p.period;
    }
    let want = slot_wants(g, &slotted, now);
    let cycle = Cycle::new(p, g.phase, &want);
    emit_slots(p, g, &slotted, &cycle, now, offset, &mut cmds);
    record_cycle_stats(g, &slotted, &cycle);
    cycle.len
}

/// The plan's commands, with the units memory enforcement froze: the law leaves their
/// `cgroup.freeze` alone.
struct Commands<'a> {
    out: &'a mut Vec<(Nanos, Command)>,
    memory_frozen: &'a BTreeSet<String>,
}

impl Commands<'_> {
    /// Freezes or thaws `unit` at `t`, unless memory enforcement froze it.
    fn freeze(&mut self, t: Nanos, unit: &str, frozen: bool) {
        if !self.memory_frozen.contains(unit) {
            self.out.push((
                t,
                Command::Freeze {
                    unit: unit.to_owned(),
                    frozen,
                },
            ));
        }
    }
}

/// The active units given slots, in order: all but the latency-critical (never frozen) and,
/// while one of those is active, the best-effort (frozen instead).
fn slotted_units(g: &Gpu, active: &[String]) -> Vec<String> {
    let priority = |n: &String| g.units[n].limits.priority;
    let lc_active = active
        .iter()
        .any(|n| priority(n) == Some(Priority::LatencyCritical));
    active
        .iter()
        .filter(|n| match priority(n) {
            Some(Priority::LatencyCritical) => false,
            Some(Priority::BestEffort) => !lc_active,
            _ => true,
        })
        .cloned()
        .collect()
}

/// Lets go of every active unit's work held by a lever (the freezer alone acts now), and settles
/// the units without a slot for the period: latency-critical ones run freely, best-effort ones
/// beside them are frozen.
fn release_and_exempt(
    p: &LawParams,
    g: &mut Gpu,
    active: &[String],
    slotted: &[String],
    now: Nanos,
    cmds: &mut Commands<'_>,
) {
    for n in active {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        if u.off.is_some() || u.unsure {
            let mut undo = Vec::new();
            u.unhold(&mut undo);
            cmds.out.extend(undo.into_iter().map(|c| (now, c)));
        }
        if slotted.contains(n) {
            continue;
        }
        let frozen = u.limits.priority == Some(Priority::BestEffort);
        if u.frozen != frozen || u.unsure {
            cmds.freeze(now, n, frozen);
            u.frozen = frozen;
        }
        if frozen {
            u.stopped = Some(now);
            u.stat.duty = 0.0;
            u.stat.nr_throttled += 1;
            u.stat.throttled_usec += p.period / 1_000;
        } else {
            u.stat.duty = 100.0;
        }
    }
}

/// A lone slotted unit whose target is the whole GPU needs no cycle: it is thawed and runs
/// freely. Returns whether that was the case.
fn run_lone_uncapped(g: &mut Gpu, slotted: &[String], now: Nanos, cmds: &mut Commands<'_>) -> bool {
    let [n] = slotted else {
        return false;
    };
    let Some(u) = g.units.get_mut(n).filter(|u| u.target >= 99.5) else {
        return false;
    };
    if u.frozen || u.unsure {
        cmds.freeze(now, n, false);
        u.frozen = false;
    }
    u.stat.duty = 100.0;
    true
}

/// Each slotted unit's wanted part of the cycle (a fraction, before scaling): its target, or
/// for a lone capped unit its slot as corrected by the overrun it measured ([`trim_lone`]);
/// units sharing the cycle forget such a correction.
fn slot_wants(g: &mut Gpu, slotted: &[String], now: Nanos) -> Vec<f64> {
    if let [n] = slotted {
        if let Some(u) = g.units.get_mut(n) {
            trim_lone(u, now);
        }
    } else {
        for n in slotted {
            if let Some(u) = g.units.get_mut(n) {
                u.slot = None;
            }
        }
    }
    slotted
        .iter()
        .map(|n| {
            let u = &g.units[n];
            match (slotted.len(), u.slot) {
                (1, Some(slot)) => slot,
                _ => u.target / 100.0,
            }
        })
        .collect()
}

/// A fallback cycle: its length and each slotted unit's time in it.
struct Cycle {
    len: Nanos,
    lens: Vec<Nanos>,
}

impl Cycle {
    /// Sizes the cycle so that the smallest slot lasts a period (and several thaw latencies, as
    /// a thaw's delay is only roughly known), at most [`MAX_CYCLE`], and shares it by `want`.
    /// Its length varies by a few percent with `phase`, which keeps it from aliasing with NVML's
    /// windows.
    fn new(p: &LawParams, phase: u64, want: &[f64]) -> Self {
        let scale = want.iter().sum::<f64>().max(1.0);
        let smallest = want
            .iter()
            .map(|w| w / scale)
            .filter(|w| *w > 0.0)
            .fold(1.0, f64::min);
        let base = (MIN_SLOT_THAWS * p.thaw_latency).max(p.period) as f64 / smallest;
        let jitter = 0.95 + 0.1 * ((phase >> 40) % 1024) as f64 / 1024.0;
        let len = ((base * jitter) as Nanos).min(MAX_CYCLE);
        let lens = want
            .iter()
            .map(|w| (len as f64 * w / scale) as Nanos)
            .collect();
        Self { len, lens }
    }

    /// When the first slot starts: `offset` into the first tenth of the cycle's idle part, so
    /// that each stretch of a few cycles holds the same number of slots.
    fn start(&self, now: Nanos, offset: u64) -> Nanos {
        let used: Nanos = self.lens.iter().sum();
        now + offset % ((self.len - used.min(self.len)) / 10).max(1)
    }

    /// The slots in order, as (index of the unit, length): each unit's time in pieces about as
    /// long as the smallest slot, spread over the cycle (stride order), so that any few seconds
    /// hold each unit's share, not only whole cycles; neighbouring pieces of one unit are one
    /// slot.
    fn slots(&self) -> Vec<(usize, Nanos)> {
        let shortest = self
            .lens
            .iter()
            .copied()
            .filter(|l| *l > 0)
            .min()
            .unwrap_or(self.len);
        let mut pieces: Vec<(f64, usize, Nanos)> = Vec::new();
        for (i, &len) in self.lens.iter().enumerate() {
            let n = (len / shortest.max(1)).max(1);
            for k in 0..n {
                let piece = len / n + if k == n - 1 { len % n } else { 0 };
                pieces.push(((k as f64 + 0.5) / n as f64, i, piece));
            }
        }
        pieces.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut slots: Vec<(usize, Nanos)> = Vec::new();
        for (_, i, len) in pieces {
            match slots.last_mut() {
                Some((j, l)) if *j == i => *l += len,
                _ => slots.push((i, len)),
            }
        }
        slots
    }
}

/// Issues the cycle's slots back to back from [`Cycle::start`]: each unit thawed a thaw latency
/// before its slot and frozen at its end; a unit running from before (first cycle, or released)
/// is frozen at once to wait for its first slot.
fn emit_slots(
    p: &LawParams,
    g: &mut Gpu,
    slotted: &[String],
    cycle: &Cycle,
    now: Nanos,
    offset: u64,
    cmds: &mut Commands<'_>,
) {
    let mut t = cycle.start(now, offset);
    let mut first = vec![true; slotted.len()];
    for (i, len) in cycle.slots() {
        if len == 0 {
            continue;
        }
        let n = &slotted[i];
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        let thaw_at = t.saturating_sub(p.thaw_latency).max(now);
        if first[i] && (!u.frozen || u.unsure) && thaw_at > now {
            cmds.freeze(now, n, true);
        }
        first[i] = false;
        cmds.freeze(thaw_at, n, false);
        cmds.freeze(t + len, n, true);
        u.frozen = true;
        u.stopped = Some(now + cycle.len);
        t += len;
    }
}

/// Each slotted unit's statistics for the cycle: its duty, and one throttling for the part of
/// the cycle it is frozen.
fn record_cycle_stats(g: &mut Gpu, slotted: &[String], cycle: &Cycle) {
    for (n, &len) in slotted.iter().zip(&cycle.lens) {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        u.stat.duty = len as f64 * 100.0 / cycle.len as f64;
        u.stat.nr_throttled += 1;
        u.stat.throttled_usec += (cycle.len - len.min(cycle.len)) / 1_000;
    }
}

/// How often a lone capped unit's slot is corrected, from the windows NVML sampled since.
const TRIM_EVERY: Nanos = 2_000 * MS;
/// Windows it takes at the least (NVML's are 1/6 s).
const TRIM_WINDOWS: usize = 8;

/// A capped unit alone in the fallback: whatever it queued before its slot ended runs into the
/// idle part, so it gets more than its cap. Alone, NVML's samples read its real utilization (no
/// one else holds the engine), so the slot is corrected by what it measured over the last
/// stretch at the present slot: slot += target - measured (bounded), every [`TRIM_EVERY`].
fn trim_lone(u: &mut Unit, now: Nanos) {
    let target = u.target / 100.0;
    let Some(slot) = u.slot else {
        u.slot = Some(target);
        u.trim_at = now;
        u.recent.clear();
        return;
    };
    if now < u.trim_at + TRIM_EVERY {
        return;
    }
    // Windows sampled at the present slot (the first after a change still holds the old one).
    let since = u.trim_at + MS * 200;
    let got: Vec<f64> = u
        .recent
        .iter()
        .filter(|(at, _)| *at >= since)
        .map(|(_, x)| *x)
        .collect();
    if got.len() >= TRIM_WINDOWS {
        let measured = got.iter().sum::<f64>() / got.len() as f64;
        u.slot = Some((slot + target - measured).clamp(0.2 * target, target));
    }
    u.recent.clear();
    u.trim_at = now;
}
