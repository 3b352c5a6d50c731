//! The law where a lever holds queued work: exclusive windows for the units that share by
//! targets.

use super::{Command, Gpu, LawParams, Lever, MS, Nanos, Unit, share::targets};
use crate::policy::Limits;

/// Shares in hardware: every unit gets an exclusive window of the period in proportion to its
/// target (let run alone; the others held with `lever`, their queued work stopped), so its share
/// does not depend on how it feeds its queue: a tenant that keeps one kernel queued yields the
/// engine after each kernel and would get no more than its neighbours' turns under round robin,
/// whatever its timeslice. Windows shorter than the period leave the rest idle (caps). Units with
/// a priority class are not here: their timeslices serve them (`super::gpu`).
pub(super) fn plan_hardware(
    p: &LawParams,
    g: &mut Gpu,
    slotted: &[String],
    now: Nanos,
    offset: u64,
    lever: Lever,
    out: &mut Vec<(Nanos, Command)>,
) {
    let on = |u: &mut Unit, out: &mut Vec<(Nanos, Command)>, t: Nanos| {
        if u.off.is_some() || u.unsure {
            let mut undo = Vec::new();
            u.unhold(&mut undo);
            out.extend(undo.into_iter().map(|c| (t, c)));
        }
    };
    for n in slotted {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        if u.frozen || u.unsure {
            out.push((
                now,
                Command::Freeze {
                    unit: n.clone(),
                    frozen: false,
                },
            ));
            u.frozen = false;
        }
        if u.off.is_some_and(|l| l != lever) {
            // Held with another lever (a verdict changed): let go first.
            on(u, out, now);
        }
        let us = p.base_timeslice_us;
        if u.timeslice != Some(us) {
            for &pid in &u.pids {
                out.push((now, Command::Timeslice { pid, us }));
            }
            u.timeslice = Some(us);
        }
    }
    // Targets among the windowed units.
    let windowed: Vec<(f64, Limits)> = slotted
        .iter()
        .map(|n| (100.0, g.units[n].limits.clone()))
        .collect();
    let pairs: Vec<(f64, &Limits)> = windowed.iter().map(|(d, l)| (*d, l)).collect();
    let t = targets(&pairs);
    if slotted.len() == 1 && t[0] >= 99.5 {
        if let Some(u) = g.units.get_mut(&slotted[0]) {
            on(u, out, now);
            u.stat.duty = 100.0;
        }
        return;
    }
    // The windows repeat in cycles of about HW_CYCLE within the period: preemption makes short
    // windows exact, and the shares hold over any second, not only over the period.
    let cycles = (p.period / HW_CYCLE).max(1);
    let cycle = p.period / cycles;
    // Segments back to back over the period, in an order that rotates from period to period
    // (so the switch costs and the timer's error do not fall on the same unit every time), the
    // idle part (caps) taking its turn like a unit.
    let mut shares: Vec<f64> = t.iter().map(|x| x / 100.0).collect();
    shares.push((1.0 - t.iter().sum::<f64>() / 100.0).max(0.0));
    let order: Vec<usize> = (0..shares.len())
        .map(|k| (k + offset as usize) % shares.len())
        .collect();
    let scale = shares.iter().sum::<f64>().max(1e-9);
    let mut ideal = 0.0f64;
    let mut at = now;
    let mut segments: Vec<Vec<(Nanos, Nanos)>> = vec![Vec::new(); slotted.len()];
    for _ in 0..cycles {
        for &i in &order {
            ideal += cycle as f64 * shares[i] / scale;
            let end = now + ideal.round() as u64;
            if end > at && i < slotted.len() {
                segments[i].push((at, end));
            }
            at = end.max(at);
        }
    }
    for (i, n) in slotted.iter().enumerate() {
        let Some(u) = g.units.get_mut(n) else {
            continue;
        };
        u.stat.target = t[i];
        u.stat.duty = t[i];
        let first_on = segments[i].first().map(|(s, _)| *s);
        let hold = |pid, held| Command::Hold { pid, lever, held };
        for &pid in &u.pids {
            if first_on != Some(now) && (u.off.is_none() || u.unsure) {
                out.push((now, hold(pid, true)));
            }
            for &(start, end) in &segments[i] {
                out.push((start, hold(pid, false)));
                out.push((end, hold(pid, true)));
            }
        }
        u.off = Some(lever);
        u.stopped = Some(now);
        u.stat.nr_throttled += 1;
        let ran: Nanos = segments[i].iter().map(|(s, e)| e - s).sum();
        u.stat.throttled_usec += p.period.saturating_sub(ran) / 1_000;
    }
}

/// Length of the hardware windows' cycle.
const HW_CYCLE: Nanos = 50 * MS;
