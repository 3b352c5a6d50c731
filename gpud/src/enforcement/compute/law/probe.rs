//! The firmware probe: whether a lever ([`Lever`]) stops a GPU's queued work, judged by what the
//! GPU does. Every process on the GPU is held with the lever for [`LawParams::probe`], and NVML's
//! device utilization windows (listed every window, zeros included, unlike the per-process
//! samples) are read: a window inside the hold that is busy rejects the lever, an idle one
//! accepts it. Levers are tried in [`Lever::ALL`]'s order; none accepted leaves the GPU to the
//! freezer. Verdicts are checked again every [`LawParams::recheck`].

use std::collections::BTreeSet;

use super::{Command, DeviceSample, Firmware, Gpu, LawParams, Lever, MS, Nanos, Reading};

/// Device windows a probe may not judge by: the first this long after the hold (the lever's own
/// latency; on the H200 it stops queued work within 15 ms).
const SETTLE: Nanos = 50 * MS;
/// A device window at least this busy (percent) inside a probe means its lever is ignored.
const BUSY: u32 = 10;
/// NVML's device window where none has been seen twice yet (µs).
const DEVICE_WINDOW_US: u64 = 200_000;
/// How long an inconclusive probe waits for its windows, and before it is tried again.
const JUDGE_WAIT: Nanos = 1_000 * MS;
const RETRY: Nanos = 10_000 * MS;

/// Takes NVML's new device windows: a probe's verdict where a window lies inside its hold.
pub(super) fn judge_device(g: &mut Gpu, r: &Reading, now: Nanos, probe: Nanos) {
    let mut new: Vec<DeviceSample> = r
        .device
        .iter()
        .copied()
        .filter(|s| s.timestamp_us > g.last_device)
        .collect();
    new.sort_by_key(|s| s.timestamp_us);
    for s in new {
        if g.last_device > 0 {
            let gap = s.timestamp_us - g.last_device;
            if gap >= 10_000 {
                g.device_window_us = Some(g.device_window_us.map_or(gap, |w| w.min(gap)));
            }
        }
        g.last_device = s.timestamp_us;
        let end = now.saturating_sub(
            r.clock_us
                .saturating_sub(s.timestamp_us)
                .saturating_mul(1_000),
        );
        if s.util >= 2 * BUSY {
            g.device_busy = Some(g.device_busy.map_or(end, |b| b.max(end)));
        }
        let start = end.saturating_sub(g.device_window_us.unwrap_or(DEVICE_WINDOW_US) * 1_000);
        if let Firmware::Probing {
            lever,
            since,
            until,
        } = g.firmware
            && start >= since + SETTLE.min(probe / 4)
            && end <= until
        {
            if s.util >= BUSY {
                reject(g, lever, now);
            } else {
                g.probe_quiet = true;
            }
        }
    }
}

/// The probe found `lever` ignored: the next lever is probed, or the freezer falls back.
pub(super) fn reject(g: &mut Gpu, lever: Lever, now: Nanos) {
    if !g.rejected.contains(&lever) {
        g.rejected.push(lever);
    }
    g.replan = true;
    g.firmware = if Lever::ALL.iter().all(|l| g.rejected.contains(l)) {
        g.checked = now;
        Firmware::Ignores
    } else {
        Firmware::Unknown
    };
}

/// Lets every unit of the GPU run again (before a probe holds them all, and after).
fn release_all(
    g: &mut Gpu,
    memory_frozen: &BTreeSet<String>,
    now: Nanos,
    out: &mut Vec<(Nanos, Command)>,
) {
    let mut released = Vec::new();
    for (name, u) in g.units.iter_mut() {
        u.release(name, memory_frozen, &mut released);
    }
    out.extend(released.into_iter().map(|c| (now, c)));
}

/// How recent a busy device window must be for a probe to start.
const BUSY_WITHIN: Nanos = 2_000 * super::MS;

/// Where a probe is under way (or a verdict is due to be checked again): carries it on, and
/// returns how long the plan lasts while it does; `None` once the GPU is planned as usual.
pub(super) fn go_on(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    memory_frozen: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Option<Nanos> {
    // A verdict is checked again after a while (a firmware update, a GPU reset, a wrong one).
    if matches!(g.firmware, Firmware::Honors(_) | Firmware::Ignores) && now >= g.checked + p.recheck
    {
        g.firmware = Firmware::Unknown;
        g.rejected.clear();
    }
    if let Firmware::Probing { lever, until, .. } = g.firmware {
        let all_held = g.units.values().all(|u| u.off == Some(lever));
        if now < until && all_held {
            return Some(p.period);
        }
        release_all(g, memory_frozen, now, out);
        if !all_held {
            // Someone came or was let go meanwhile: the device's windows tell nothing.
            g.firmware = Firmware::Unknown;
            g.checked = now + RETRY;
        } else if g.probe_quiet || g.device_window_us.is_none() {
            // An idle window inside the hold, or (NVML without device windows) no held process
            // was sampled running: the lever holds queued work.
            g.firmware = Firmware::Honors(lever);
            g.checked = now;
        } else if now >= until + JUDGE_WAIT {
            // No window inside the hold arrived: try again later.
            g.firmware = Firmware::Unknown;
            g.checked = now + RETRY;
        } else {
            // Released; waiting for the windows of the hold.
            return Some(p.period);
        }
    }
    None
}

/// Starts a probe where one is due and the GPU can show what a lever does; true if it started
/// (the plan is then the hold).
pub(super) fn start(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    memory_frozen: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> bool {
    let probe_due = g.firmware == Firmware::Unknown && now >= g.checked;
    // Where NVML reads device windows, only a GPU busy of late can show what a lever does (a
    // lone capped unit's freezer slots leave many windows idle).
    let busy = g.device_window_us.is_none()
        || g.device_busy
            .is_some_and(|b| now.saturating_sub(b) < BUSY_WITHIN);
    if probe_due
        && busy
        && let Some(&lever) = Lever::ALL.iter().find(|l| !g.rejected.contains(l))
    {
        // Every process of the GPU held with the lever: the device's own windows then say
        // whether queued work stopped.
        release_all(g, memory_frozen, now, out);
        g.firmware = Firmware::Probing {
            lever,
            since: now,
            until: now + p.probe,
        };
        g.probe_quiet = false;
        for u in g.units.values_mut() {
            for &pid in &u.pids {
                out.push((
                    now,
                    Command::Hold {
                        pid,
                        lever,
                        held: true,
                    },
                ));
            }
            // What the fallback measured so far was not under its own slots.
            u.slot = None;
            u.off = Some(lever);
            u.stopped = Some(now);
        }
        return true;
    }
    false
}
