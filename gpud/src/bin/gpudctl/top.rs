//! `gpudctl top`: a refreshing per-cgroup view, like nvtop or gpustat, built from the same D-Bus
//! lists as `gpudctl list` and differences between successive samples (rates).

use std::{
    collections::BTreeMap,
    io::Write as _,
    time::{Duration, Instant},
};

use crossterm::{
    cursor,
    event::{Event, EventStream, KeyCode, KeyEvent, KeyModifiers},
    execute, terminal,
};
use futures_util::StreamExt as _;
use gpud_api::{CgroupRecord, GpuRecord, Manager1Proxy, container_id};
use serde::Serialize;

use crate::{Failure, daemon_err, duration, human};

#[derive(clap::Args, Debug)]
pub struct TopArgs {
    /// Seconds between refreshes.
    #[arg(long, short = 'd', default_value_t = 1.0, value_name = "SECS")]
    interval: f64,
    /// Column to sort by (largest first; cgroup: by name).
    #[arg(long, value_enum, default_value_t = SortKey::Memory)]
    sort: SortKey,
    /// Only this GPU index (memory, utilization and idle time on it).
    #[arg(long, value_name = "INDEX")]
    gpu: Option<u32>,
    /// Refresh this many times, then exit (for scripts; also turns off the interactive screen).
    #[arg(long, short = 'n', value_name = "N")]
    iterations: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SortKey {
    Memory,
    Util,
    Share,
    Throttled,
    Ioctls,
    Cgroup,
}

/// One cgroup in one frame.
#[derive(Clone, Debug, Default, Serialize)]
struct Row {
    cgroup: String,
    container_id: Option<String>,
    pids: usize,
    /// Charged by the probes (the selected GPU, else all).
    memory_bytes: u64,
    memory_max: Option<u64>,
    nvml_memory_bytes: u64,
    sm_util: u32,
    compute_target: Option<f64>,
    compute_measured: Option<f64>,
    /// Share of the last interval the controller kept it frozen (percent).
    throttled_percent: Option<f64>,
    /// ioctls per second over the last interval.
    ioctl_rate: Option<f64>,
    idle_secs: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Frame {
    time: f64,
    nvml_available: bool,
    enforcement_tier: String,
    sort: SortKey,
    gpus: Vec<GpuRecord>,
    cgroups: Vec<Row>,
}

/// What the previous frame saw, for rates.
#[derive(Default)]
struct Previous {
    at: Option<Instant>,
    ioctls: BTreeMap<String, u64>,
    throttled_usec: BTreeMap<String, u64>,
}

fn total_ioctls(c: &CgroupRecord) -> u64 {
    c.ioctls.values().sum()
}

async fn sample(
    proxy: &Manager1Proxy<'_>,
    args: &TopArgs,
    sort: SortKey,
    prev: &mut Previous,
) -> Result<Frame, Failure> {
    let cgroups = proxy.list_cgroups().await.map_err(daemon_err)?;
    let nvml = proxy.list_nvml_usage().await.map_err(daemon_err)?;
    let compute = proxy.list_compute().await.map_err(daemon_err)?;
    let idle = proxy.list_idle().await.map_err(daemon_err)?;
    let gpus = proxy.list_gpus().await.map_err(daemon_err)?;
    let nvml_available = proxy.nvml_available().await.map_err(daemon_err)?;
    let enforcement_tier = proxy.enforcement_tier().await.map_err(daemon_err)?;
    let now = Instant::now();
    let elapsed = prev.at.map(|t| now.duration_since(t).as_secs_f64());
    let on_gpu = |gpu: u32| args.gpu.is_none_or(|g| g == gpu);
    let key = args.gpu.map_or_else(|| "all".to_owned(), |g| g.to_string());

    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let row = |rows: &mut BTreeMap<String, Row>, path: &str| -> Row {
        rows.remove(path).unwrap_or_else(|| Row {
            cgroup: path.to_owned(),
            container_id: container_id(path),
            ..Row::default()
        })
    };
    let mut ioctls = BTreeMap::new();
    for c in &cgroups {
        let mut r = row(&mut rows, &c.path);
        r.pids = c.pids.len();
        r.memory_bytes = c.memory_current.get(&key).copied().unwrap_or(0);
        r.memory_max = c
            .memory_max
            .get(&key)
            .or_else(|| c.memory_max.get("all"))
            .copied();
        let n = total_ioctls(c);
        r.ioctl_rate = elapsed
            .filter(|e| *e > 0.0)
            .zip(prev.ioctls.get(&c.path))
            .map(|(e, before)| n.saturating_sub(*before) as f64 / e);
        ioctls.insert(c.path.clone(), n);
        rows.insert(c.path.clone(), r);
    }
    for u in nvml.iter().filter(|u| on_gpu(u.gpu)) {
        let mut r = row(&mut rows, &u.cgroup);
        r.nvml_memory_bytes += u.nvml_memory_bytes;
        r.sm_util += u.sm_util;
        rows.insert(u.cgroup.clone(), r);
    }
    let mut throttled = BTreeMap::new();
    for c in &compute {
        let mut r = row(&mut rows, &c.cgroup);
        r.compute_target = Some(c.target);
        r.compute_measured = Some(c.measured);
        r.throttled_percent = elapsed
            .filter(|e| *e > 0.0)
            .zip(prev.throttled_usec.get(&c.cgroup))
            .map(|(e, before)| {
                (c.throttled_usec.saturating_sub(*before) as f64 / 1e6 / e * 100.0).min(100.0)
            });
        throttled.insert(c.cgroup.clone(), c.throttled_usec);
        rows.insert(c.cgroup.clone(), r);
    }
    for i in idle.iter().filter(|i| on_gpu(i.gpu)) {
        let mut r = row(&mut rows, &i.cgroup);
        r.idle_secs = Some(r.idle_secs.unwrap_or(0).max(i.idle_secs));
        rows.insert(i.cgroup.clone(), r);
    }
    *prev = Previous {
        at: Some(now),
        ioctls,
        throttled_usec: throttled,
    };

    let mut cgroups: Vec<Row> = rows.into_values().collect();
    let num = |v: Option<f64>| v.unwrap_or(-1.0);
    cgroups.sort_by(|a, b| {
        let by = match sort {
            SortKey::Memory => b
                .memory_bytes
                .max(b.nvml_memory_bytes)
                .cmp(&a.memory_bytes.max(a.nvml_memory_bytes)),
            SortKey::Util => b.sm_util.cmp(&a.sm_util),
            SortKey::Share => num(b.compute_measured).total_cmp(&num(a.compute_measured)),
            SortKey::Throttled => num(b.throttled_percent).total_cmp(&num(a.throttled_percent)),
            SortKey::Ioctls => num(b.ioctl_rate).total_cmp(&num(a.ioctl_rate)),
            SortKey::Cgroup => std::cmp::Ordering::Equal,
        };
        by.then_with(|| a.cgroup.cmp(&b.cgroup))
    });
    Ok(Frame {
        time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        nvml_available,
        enforcement_tier,
        sort,
        gpus: gpus.into_iter().filter(|g| on_gpu(g.index)).collect(),
        cgroups,
    })
}

/// The frame as text lines (no trailing newline handling: the caller ends lines).
fn render(f: &Frame, width: usize) -> Vec<String> {
    let opt =
        |v: Option<f64>, unit: &str| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}{unit}"));
    let mut out = vec![format!(
        "gpud top — NVML {}, memory limits: {} tier, sorted by {:?} (q quits; m u s t i c sort)",
        if f.nvml_available { "up" } else { "unavailable" },
        f.enforcement_tier,
        f.sort
    )
    .to_lowercase()];
    for g in &f.gpus {
        out.push(format!(
            "GPU {}{} {} {}: {} / {} used, Xid errors {}",
            g.index,
            if g.mig == u32::MAX {
                String::new()
            } else {
                format!(" MIG {}", g.mig)
            },
            g.name,
            g.uuid,
            human(g.memory_used),
            human(g.memory_total),
            g.xid_errors
        ));
    }
    out.push(String::new());
    let name_w = width.saturating_sub(86).clamp(16, 60);
    out.push(format!(
        "{:<name_w$} {:>4} {:>10} {:>10} {:>10} {:>5} {:>6} {:>6} {:>6} {:>8} {:>8}",
        "CGROUP",
        "PIDS",
        "MEMORY",
        "LIMIT",
        "NVML MEM",
        "UTIL",
        "TARGET",
        "SHARE",
        "THROT",
        "IOCTL/S",
        "IDLE"
    ));
    for r in &f.cgroups {
        let name = match &r.container_id {
            Some(id) => format!(
                "{} ({})",
                short(&r.cgroup, name_w.saturating_sub(15)),
                &id[..12]
            ),
            None => short(&r.cgroup, name_w),
        };
        out.push(format!(
            "{:<name_w$} {:>4} {:>10} {:>10} {:>10} {:>4}% {:>6} {:>6} {:>6} {:>8} {:>8}",
            name,
            r.pids,
            human(r.memory_bytes),
            r.memory_max.map_or_else(|| "-".to_owned(), human),
            human(r.nvml_memory_bytes),
            r.sm_util,
            opt(r.compute_target, "%"),
            opt(r.compute_measured, "%"),
            opt(r.throttled_percent, "%"),
            opt(r.ioctl_rate, ""),
            r.idle_secs.map_or_else(|| "-".to_owned(), duration),
        ));
    }
    out
}

/// The end of a long path, marked with `…`.
fn short(path: &str, width: usize) -> String {
    let n = path.chars().count();
    if n <= width || width < 2 {
        return path.to_owned();
    }
    let tail: String = path.chars().skip(n - (width - 1)).collect();
    format!("…{tail}")
}

fn sort_for(key: &KeyEvent) -> Option<SortKey> {
    match key.code {
        KeyCode::Char('m') => Some(SortKey::Memory),
        KeyCode::Char('u') => Some(SortKey::Util),
        KeyCode::Char('s') => Some(SortKey::Share),
        KeyCode::Char('t') => Some(SortKey::Throttled),
        KeyCode::Char('i') => Some(SortKey::Ioctls),
        KeyCode::Char('c') => Some(SortKey::Cgroup),
        _ => None,
    }
}

fn quits(key: &KeyEvent) -> bool {
    matches!(key.code, KeyCode::Char('q') | KeyCode::Esc)
        || (key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL))
}

/// Restores the terminal however the interactive loop ends.
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Self> {
        terminal::enable_raw_mode()?;
        if let Err(e) = execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        ) {
            let _ = terminal::disable_raw_mode();
            return Err(e);
        }
        Ok(Self)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(
            std::io::stdout(),
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

pub async fn run(proxy: &Manager1Proxy<'_>, args: TopArgs, json: bool) -> Result<(), Failure> {
    if !(args.interval.is_finite() && args.interval >= 0.1) {
        eprintln!("gpudctl: --interval must be at least 0.1 seconds");
        return Err(Failure::Usage);
    }
    let interval = Duration::from_secs_f64(args.interval);
    let interactive =
        !json && args.iterations.is_none() && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut prev = Previous::default();
    let mut sort = args.sort;
    if !interactive {
        let mut n = 0u64;
        loop {
            let frame = sample(proxy, &args, sort, &mut prev).await?;
            if json {
                println!("{}", serde_json::to_string(&frame).unwrap_or_default());
            } else {
                if n > 0 {
                    println!();
                }
                for line in render(&frame, 140) {
                    println!("{line}");
                }
            }
            n += 1;
            if args.iterations.is_some_and(|max| n >= max) {
                return Ok(());
            }
            tokio::time::sleep(interval).await;
        }
    }

    let screen = Screen::enter().map_err(|e| {
        eprintln!("gpudctl: cannot use the terminal: {e}");
        Failure::Usage
    })?;
    let mut keys = EventStream::new();
    let result = loop {
        let frame = match sample(proxy, &args, sort, &mut prev).await {
            Ok(f) => f,
            Err(e) => break Err(e),
        };
        let (w, h) = terminal::size().unwrap_or((140, 40));
        let mut out = std::io::stdout().lock();
        let _ = execute!(
            out,
            cursor::MoveTo(0, 0),
            terminal::Clear(terminal::ClearType::All)
        );
        for line in render(&frame, usize::from(w)).iter().take(usize::from(h)) {
            let line: String = line.chars().take(usize::from(w)).collect();
            // Raw mode: lines end with CR LF.
            let _ = write!(out, "{line}\r\n");
        }
        let _ = out.flush();
        drop(out);
        let deadline = tokio::time::Instant::now() + interval;
        let quit = loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break false,
                ev = keys.next() => match ev {
                    Some(Ok(Event::Key(k))) if quits(&k) => break true,
                    Some(Ok(Event::Key(k))) => if let Some(s) = sort_for(&k) {
                        sort = s;
                        break false;
                    },
                    Some(Ok(Event::Resize(..))) => break false,
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break true,
                },
            }
        };
        if quit {
            break Ok(());
        }
    };
    drop(screen);
    result
}
