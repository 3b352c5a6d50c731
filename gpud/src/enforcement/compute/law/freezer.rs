//! The fallback where the controls are ignored or cannot be issued: exclusive freezer slots.

use std::collections::BTreeSet;

use super::{Command, Gpu, LawParams, MS, Nanos};
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
    let lc_active = active
        .iter()
        .any(|n| g.units[n].limits.priority == Some(Priority::LatencyCritical));
    let freeze = |out: &mut Vec<(Nanos, Command)>, t: Nanos, n: &str, frozen: bool| {
        if !memory_frozen.contains(n) {
            out.push((
                t,
                Command::Freeze {
                    unit: n.to_owned(),
                    frozen,
                },
            ));
        }
    };
    let slotted: Vec<String> = active
        .iter()
        .filter(|n| g.units[*n].limits.priority != Some(Priority::LatencyCritical))
        .filter(|n| !(lc_active && g.units[*n].limits.priority == Some(Priority::BestEffort)))
        .cloned()
        .collect();
    for n in active {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        if u.off.is_some() || u.unsure {
            let mut undo = Vec::new();
            u.unhold(&mut undo);
            out.extend(undo.into_iter().map(|c| (now, c)));
        }
        if !slotted.contains(n) {
            // Latency-critical: runs freely; best-effort beside it: frozen for the period.
            let frozen = u.limits.priority == Some(Priority::BestEffort);
            if u.frozen != frozen || u.unsure {
                freeze(out, now, n, frozen);
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
    if slotted.is_empty() {
        return p.period;
    }
    if let [n] = slotted.as_slice()
        && let Some(u) = g.units.get_mut(n)
        && u.target >= 99.5
    {
        if u.frozen || u.unsure {
            freeze(out, now, n, false);
            u.frozen = false;
        }
        u.stat.duty = 100.0;
        return p.period;
    }
    // Slots back to back in a rotating order, from a varying offset where they leave part of the
    // period idle; each unit thawed a thaw latency before its slot and frozen at its end.
    if let [n] = slotted.as_slice() {
        if let Some(u) = g.units.get_mut(n) {
            trim_lone(u, now);
        }
    } else {
        for n in &slotted {
            if let Some(u) = g.units.get_mut(n) {
                u.slot = None;
            }
        }
    }
    let want: Vec<f64> = slotted
        .iter()
        .map(|n| {
            let u = &g.units[n];
            match (slotted.len(), u.slot) {
                (1, Some(slot)) => slot,
                _ => u.target / 100.0,
            }
        })
        .collect();
    let scale = want.iter().sum::<f64>().max(1.0);
    // The smallest slot lasts several thaw latencies (a thaw's delay is only roughly known).
    let smallest = want
        .iter()
        .map(|w| w / scale)
        .filter(|w| *w > 0.0)
        .fold(1.0, f64::min);
    // A cycle length that varies by a few percent keeps it from aliasing with NVML's windows;
    // the slots start within the first tenth of the free part, so that each stretch of a few
    // cycles holds the same number of them.
    let base = (MIN_SLOT_THAWS * p.thaw_latency).max(p.period) as f64 / smallest;
    let jitter = 0.95 + 0.1 * ((g.phase >> 40) % 1024) as f64 / 1024.0;
    let cycle = ((base * jitter) as Nanos).min(MAX_CYCLE);
    let lens: Vec<Nanos> = want
        .iter()
        .map(|w| (cycle as f64 * w / scale) as Nanos)
        .collect();
    let used: Nanos = lens.iter().sum();
    // Each unit's time in pieces about as long as the smallest slot, spread over the cycle
    // (stride order), so that any few seconds hold each unit's share, not only whole cycles.
    let shortest = lens
        .iter()
        .copied()
        .filter(|l| *l > 0)
        .min()
        .unwrap_or(cycle);
    let mut pieces: Vec<(f64, usize, Nanos)> = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let n = (len / shortest.max(1)).max(1);
        for k in 0..n {
            let piece = len / n + if k == n - 1 { len % n } else { 0 };
            pieces.push(((k as f64 + 0.5) / n as f64, i, piece));
        }
    }
    pieces.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    // Neighbouring pieces of one unit are one slot.
    let mut slots: Vec<(usize, Nanos)> = Vec::new();
    for (_, i, len) in pieces {
        match slots.last_mut() {
            Some((j, l)) if *j == i => *l += len,
            _ => slots.push((i, len)),
        }
    }
    let mut t = now + offset % ((cycle - used.min(cycle)) / 10).max(1);
    let mut first = vec![true; slotted.len()];
    for (i, len) in slots {
        if len == 0 {
            continue;
        }
        let n = &slotted[i];
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        let thaw_at = t.saturating_sub(p.thaw_latency).max(now);
        if first[i] && (!u.frozen || u.unsure) && thaw_at > now {
            // Running from before (first cycle, or released): it waits for its slot.
            freeze(out, now, n, true);
        }
        first[i] = false;
        freeze(out, thaw_at, n, false);
        freeze(out, t + len, n, true);
        u.frozen = true;
        u.stopped = Some(now + cycle);
        t += len;
    }
    for (i, n) in slotted.iter().enumerate() {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        u.stat.duty = lens[i] as f64 * 100.0 / cycle as f64;
        u.stat.nr_throttled += 1;
        u.stat.throttled_usec += (cycle - lens[i].min(cycle)) / 1_000;
    }
    cycle
}

/// How often a lone capped unit's slot is corrected, from the windows NVML sampled since.
const TRIM_EVERY: Nanos = 2_000 * MS;
/// Windows it takes at the least (NVML's are 1/6 s).
const TRIM_WINDOWS: usize = 8;

/// A capped unit alone in the fallback: whatever it queued before its slot ended runs into the
/// idle part, so it gets more than its cap. Alone, NVML's samples read its real utilization (no
/// one else holds the engine), so the slot is corrected by what it measured over the last
/// stretch at the present slot: slot += target - measured (bounded), every [`TRIM_EVERY`].
fn trim_lone(u: &mut super::Unit, now: Nanos) {
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
