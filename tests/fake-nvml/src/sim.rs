//! The simulated GPU (module docs, "Simulated GPU" and "Device utilization"): what it remembers
//! of each process and of each GPU's device samples, processes' runtime from `/proc`, CPU shares
//! over a window, the strictly increasing timestamps, and the sample log.

use std::{
    collections::{HashMap, VecDeque},
    io::Write as _,
    path::PathBuf,
    time::SystemTime,
};

use crate::{State, scenario_path};

/// What the simulated GPU remembers of one process.
#[derive(Debug, Default)]
pub(crate) struct History {
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22): tells a reused pid.
    pub(crate) start_ticks: u64,
    /// Start time as a wall-clock timestamp (µs).
    pub(crate) start_us: u64,
    /// (timestamp returned, summed runtime in ns at that moment), oldest first.
    pub(crate) seen: VecDeque<(u64, u64)>,
}

/// How many observations per process are kept (far more than one sampling window needs).
pub(crate) const HISTORY: usize = 256;

impl History {
    /// The runtime at the start of the window after `last_seen`: the newest observation at or
    /// before it, or zero at the process's start if it started after it.
    pub(crate) fn baseline(&self, last_seen: u64) -> Option<(u64, u64)> {
        if let Some(&(ts, rt)) = self.seen.iter().rev().find(|(ts, _)| *ts <= last_seen) {
            return Some((ts, rt));
        }
        (last_seen < self.start_us).then_some((self.start_us, 0))
    }

    pub(crate) fn record(&mut self, ts: u64, runtime_ns: u64) {
        if self.seen.len() == HISTORY {
            self.seen.pop_front();
        }
        self.seen.push_back((ts, runtime_ns));
    }
}

/// Utilization in percent of one CPU: runtime growth over wall time, rounded, at most 100.
pub(crate) fn share_of_cpu(runtime_ns: u64, since: (u64, u64), now_us: u64) -> Option<u32> {
    let (t0, r0) = since;
    if now_us <= t0 {
        return None;
    }
    let busy_ns = runtime_ns.saturating_sub(r0) as f64;
    let wall_ns = (now_us - t0) as f64 * 1000.0;
    Some(((busy_ns / wall_ns) * 100.0).round().min(100.0) as u32)
}

/// A simulated process as a device-level sample saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Observed {
    /// Start in clock ticks since boot: tells a reused pid.
    pub(crate) start_ticks: u64,
    /// Start as a wall-clock timestamp (µs).
    pub(crate) start_us: u64,
    /// Summed runtime (ns) when seen.
    pub(crate) runtime_ns: u64,
}

/// What the device-level samples of one GPU remember: the last one handed out.
#[derive(Debug, Default)]
pub(crate) struct DeviceHistory {
    /// Its timestamp.
    pub(crate) ts: u64,
    /// Each simulated process on the GPU then.
    pub(crate) procs: HashMap<u32, Observed>,
}

/// Where the window of a device sample begins: at the GPU's previous device sample if there is
/// one (the caller's `lastSeenTimeStamp` is then older, or newer with nothing observed between:
/// that sample is the newest observation at or before it); on a GPU's first device sample, at
/// `lastSeenTimeStamp`, but not before its first simulated process started (a first call passes 0,
/// and a process is measured from its start, as per-process samples are).
pub(crate) fn device_window_start(
    prev: Option<u64>,
    last_seen: u64,
    earliest_start: Option<u64>,
) -> u64 {
    match prev {
        Some(ts) => ts,
        None => last_seen.max(earliest_start.unwrap_or(0)),
    }
}

/// The device utilization over (`t0`, `now`]: the sum of each process's utilization over that
/// window, at most 100. A simulated process counts its runtime growth since `prev` (the GPU's
/// previous device sample, taken at `t0`), or all its runtime if it started in the window; one
/// that was already running and that `prev` did not see gives only a baseline. A scripted process
/// counts its fixed `sm_util`.
pub(crate) fn device_utilization(
    t0: u64,
    now: u64,
    prev: Option<&DeviceHistory>,
    simulated: &[(u32, Observed)],
    scripted: &[u32],
) -> u32 {
    let mut total = scripted.iter().fold(0u32, |a, u| a.saturating_add(*u));
    for (pid, o) in simulated {
        let before = prev
            .and_then(|h| h.procs.get(pid))
            .filter(|b| b.start_ticks == o.start_ticks);
        let r0 = match before {
            Some(b) => b.runtime_ns,
            None if o.start_us >= t0 => 0,
            None => continue,
        };
        total = total.saturating_add(share_of_cpu(o.runtime_ns, (t0, r0), now).unwrap_or(0));
    }
    total.min(100)
}

/// Wall-clock time in µs.
pub(crate) fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Wall-clock time in µs, strictly increasing across calls.
pub(crate) fn next_timestamp(st: &mut State) -> u64 {
    st.last_ts = wall_us().max(st.last_ts + 1);
    st.last_ts
}

/// Runnable time (ns) of the threads of `pid`: on a CPU plus waiting in a run queue
/// (`schedstat`'s first two fields); `None` if it is gone.
pub(crate) fn runtime_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            total += s
                .split_whitespace()
                .take(2)
                .filter_map(|v| v.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    Some(total)
}

/// Start of `pid` in clock ticks since boot (`/proc/<pid>/stat` field 22).
pub(crate) fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts with field 3 (state); field 22 is the 20th after it.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Wall-clock start (µs) of a process that started `ticks` clock ticks after boot.
pub(crate) fn start_us(ticks: u64, now_us: u64) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    // SAFETY: timespec is plain data, filled in by clock_gettime.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    let since_boot_us = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000;
    let started_us = ticks * 1_000_000 / hz;
    now_us.saturating_sub(since_boot_us.saturating_sub(started_us))
}

/// The simulated SM utilization of `pid` over (`last_seen`, `now`], recording its runtime at
/// `now` for the next window. `None`: the process is gone or has no baseline yet.
pub(crate) fn simulated(st: &mut State, pid: u32, last_seen: u64, now: u64) -> Option<u32> {
    let rt = runtime_ns(pid)?;
    let ticks = start_ticks(pid)?;
    let h = st.history.entry(pid).or_default();
    if h.start_ticks != ticks || h.start_us == 0 {
        // A new process (or the pid was reused): forget what the old one did.
        *h = History {
            start_ticks: ticks,
            start_us: start_us(ticks, now),
            seen: VecDeque::new(),
        };
    }
    let since = h.baseline(last_seen);
    h.record(now, rt);
    share_of_cpu(rt, since?, now)
}

/// Appends one data call to `file` beside the scenario.
pub(crate) fn log_samples(file: &str, gpu: u32, last_seen: u64, returned: &[u64]) {
    let Some(dir) = scenario_path().and_then(|p| p.parent().map(PathBuf::from)) else {
        return;
    };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(file))
    {
        let line = serde_json::json!({"gpu": gpu, "last_seen": last_seen, "returned": returned});
        let _ = writeln!(f, "{line}");
    }
}

/// Reads a simulated process for a device sample (`None`: it is gone), keeping the start time the
/// GPU's previous device sample recorded for the same process, so its windows chain exactly.
pub(crate) fn observe(prev: Option<&DeviceHistory>, pid: u32, now: u64) -> Option<Observed> {
    let runtime_ns = runtime_ns(pid)?;
    let ticks = start_ticks(pid)?;
    let start_us = match prev.and_then(|h| h.procs.get(&pid)) {
        Some(b) if b.start_ticks == ticks => b.start_us,
        _ => start_us(ticks, now),
    };
    Some(Observed {
        start_ticks: ticks,
        start_us,
        runtime_ns,
    })
}
