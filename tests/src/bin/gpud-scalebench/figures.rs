//! The figures a run measures: latency distributions, CPU and memory of a process over a
//! window, and where the CPU went during a D-Bus run ([`CpuSplit`]).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// p50, p99, max of microsecond samples.
pub(crate) fn dist(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    json!({"n": v.len(), "p50": q(0.5), "p99": q(0.99), "max": v[v.len() - 1]})
}

/// CPU time (user + system, seconds) and RSS/HWM (KiB) of `pid`.
pub(crate) fn usage(pid: u32) -> anyhow::Result<(f64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) closing parenthesis.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = (f.get(11).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0))
        // SAFETY: sysconf has no preconditions.
        / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Ok((ticks, kib("VmRSS:"), kib("VmHWM:")))
}

/// Daemon CPU (percent of one core) over `window`, and its RSS/HWM at the end.
pub(crate) fn cpu_over(pid: u32, window: Duration) -> anyhow::Result<Value> {
    let (c0, _, _) = usage(pid)?;
    let t = Instant::now();
    std::thread::sleep(window);
    let (c1, rss, hwm) = usage(pid)?;
    Ok(json!({
        "cpu_percent": (c1 - c0) / t.elapsed().as_secs_f64() * 100.0,
        "rss_kib": rss, "hwm_kib": hwm, "window_s": window.as_secs_f64(),
    }))
}

/// Where the CPU went during a D-Bus run (percent of one core each): the daemon, the bus daemon,
/// and this process (the clients: their calls, replies' deserialization, bookkeeping). The
/// machine's total is 100 per CPU; what is left of it was idle or other processes'.
pub(crate) struct CpuSplit {
    pids: [(&'static str, u32); 3],
    start: [f64; 3],
    at: Instant,
}

impl CpuSplit {
    pub(crate) fn start(daemon: u32, bus: u32) -> anyhow::Result<Self> {
        let pids = [
            ("daemon", daemon),
            ("bus", bus),
            ("clients", std::process::id()),
        ];
        let mut start = [0.0; 3];
        for (i, (_, pid)) in pids.iter().enumerate() {
            start[i] = usage(*pid)?.0;
        }
        Ok(Self {
            pids,
            start,
            at: Instant::now(),
        })
    }

    pub(crate) fn end(self) -> anyhow::Result<Value> {
        let secs = self.at.elapsed().as_secs_f64();
        let mut out = serde_json::Map::new();
        for (i, (name, pid)) in self.pids.iter().enumerate() {
            let used = usage(*pid)?.0 - self.start[i];
            out.insert((*name).into(), json!(used / secs * 100.0));
        }
        Ok(Value::Object(out))
    }
}
