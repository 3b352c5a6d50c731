//! The optional Prometheus endpoint (`[metrics] listen`): `GET /metrics` in the OpenMetrics text
//! format, built with `prometheus-client` and served over HTTP/1.1 by hyper.
//!
//! Every scrape asks the state task for one snapshot (it owns the data; nothing here caches or
//! mutates it), turns it into the same records the D-Bus API serves, and builds a fresh registry
//! from them, so a scrape shows one consistent moment and a vanished cgroup leaves no stale
//! series behind. [`build`] registers one group of families per helper, in a fixed order (the
//! order of the text). The metric names are documented in docs/metrics.md.

use std::{collections::BTreeMap, convert::Infallible, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    Method, Request as HttpRequest, Response, StatusCode, body::Bytes, header, server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, info::Info},
    registry::Registry,
};
use std::sync::atomic::AtomicU64;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, warn};

use gpud_api::{CgroupRecord, GpuRecord, IdleRecord, NvmlUsageRecord, container_id};

use super::records::all;
use crate::{
    daemon::{self, DaemonInfo, Handle},
    notice::NoticeCounts,
    report::Chain,
};

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long a scrape waits for the state task.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen on {addr} for metrics")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the daemon's state task did not answer")]
    State(#[source] daemon::DaemonError),
    #[error("the daemon's state task did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("cannot encode the metrics")]
    Encode(#[from] std::fmt::Error),
}

type Labels = Vec<(String, String)>;

/// Everything one scrape shows, as records.
#[derive(Debug, Default)]
pub struct Scrape {
    pub cgroups: Vec<CgroupRecord>,
    pub nvml_usage: Vec<NvmlUsageRecord>,
    pub nvml_available: bool,
    pub gpus: Vec<GpuRecord>,
    pub kernel_stats: BTreeMap<String, u64>,
    pub idle: Vec<IdleRecord>,
    pub compute: daemon::ComputeStats,
    /// Tenants' scheduling controls the guard acted on, by (cgroup, control, action).
    pub guard_counts: crate::enforcement::guard::GuardCounts,
    /// Notices published since start, by name.
    pub notices: BTreeMap<&'static str, u64>,
    /// Workload names by cgroup path.
    pub workloads: crate::policy::workloads::ByCgroup,
}

/// Gathers snapshots and renders them.
pub struct Exporter {
    daemon: Handle,
    info: DaemonInfo,
    started: std::time::SystemTime,
    notices: NoticeCounts,
}

impl Exporter {
    /// `notices`: the daemon's notice counts ([`crate::daemon::Running::notice_counts`]).
    pub fn new(daemon: Handle, info: DaemonInfo, notices: NoticeCounts) -> Self {
        Self {
            daemon,
            info,
            started: std::time::SystemTime::now(),
            notices,
        }
    }

    async fn snapshot(&self) -> Result<Scrape, MetricsError> {
        let s = tokio::time::timeout(ASK_TIMEOUT, self.daemon.snapshot())
            .await
            .map_err(|_| MetricsError::TimedOut(ASK_TIMEOUT))?
            .map_err(MetricsError::State)?;
        let mut snap = Scrape::from(s);
        snap.notices = self.notices.get();
        Ok(snap)
    }

    /// The text of one scrape.
    pub async fn render(&self) -> Result<String, MetricsError> {
        let t = std::time::Instant::now();
        let snap = self.snapshot().await?;
        let mut registry = build(&snap, &self.info, self.started);
        let took: Gauge<f64, AtomicU64> = Gauge::default();
        took.set(t.elapsed().as_secs_f64());
        registry.register(
            "gpud_scrape_collect_seconds",
            "Time this scrape waited for the daemon's figures",
            took,
        );
        let mut out = String::new();
        encode(&mut out, &registry)?;
        Ok(out)
    }

    async fn respond(&self, req: HttpRequest<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let reply = |status, ctype: &str, body: String| {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            *r.status_mut() = status;
            if let Ok(v) = header::HeaderValue::from_str(ctype) {
                r.headers_mut().insert(header::CONTENT_TYPE, v);
            }
            r
        };
        if req.uri().path() != "/metrics" {
            return reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                "gpud serves /metrics only\n".into(),
            );
        }
        if req.method() != Method::GET {
            return reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "use GET\n".into(),
            );
        }
        match self.render().await {
            Ok(text) => reply(StatusCode::OK, CONTENT_TYPE, text),
            Err(e) => {
                warn!("metrics scrape failed: {}", Chain(&e));
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("{}\n", Chain(&e)),
                )
            }
        }
    }
}

impl From<daemon::Figures> for Scrape {
    fn from(s: daemon::Figures) -> Self {
        Self {
            cgroups: all(s.cgroups),
            nvml_usage: all(s.nvml_usage),
            nvml_available: s.nvml_available,
            gpus: s.gpus.iter().map(GpuRecord::from).collect(),
            kernel_stats: s.kernel_stats,
            idle: all(s.idle),
            compute: s.compute,
            guard_counts: s.guard_counts,
            notices: BTreeMap::new(),
            workloads: s.workloads,
        }
    }
}

/// Binds `addr` (at start-up, so a taken port fails the start with a clear error).
pub async fn bind(addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener, MetricsError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })
}

/// Serves scrapes on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    exporter: Arc<Exporter>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of fds or similar: back off rather than spin.
                warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let exporter = exporter.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = service_fn(move |req| {
                let exporter = exporter.clone();
                async move { Ok::<_, Infallible>(exporter.respond(req).await) }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                // A client that never finishes its request does not hold a slot forever.
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                debug!(%peer, "metrics connection: {e}");
            }
        });
    }
}

/// The labels of a cgroup's series: its path, the container id the path names, and the
/// workload names the runtime integrations reported (`namespace`, `pod`, `container`; each
/// present, empty where unknown, so every series of a family has the same label names).
struct Namer<'a>(&'a BTreeMap<String, crate::policy::workloads::Names>);

impl Namer<'_> {
    fn cgroup_labels(&self, path: &str) -> Labels {
        let names = self.0.get(path);
        let mut l = vec![
            ("cgroup".into(), path.to_owned()),
            (
                "container_id".into(),
                container_id(path).unwrap_or_default(),
            ),
        ];
        for key in gpud_api::workload::KEYS {
            let v = names.and_then(|n| n.get(key)).cloned().unwrap_or_default();
            l.push((key.to_owned(), v));
        }
        l
    }
}

fn with(mut labels: Labels, k: &str, v: impl ToString) -> Labels {
    labels.push((k.to_owned(), v.to_string()));
    labels
}

/// Fractional values (percent, seconds).
fn gauges() -> Family<Labels, Gauge<f64, AtomicU64>> {
    Family::default()
}

/// Whole values (bytes, counts).
fn int_gauges() -> Family<Labels, Gauge> {
    Family::default()
}

fn counters() -> Family<Labels, Counter> {
    Family::default()
}

fn seconds_counters() -> Family<Labels, Counter<f64, AtomicU64>> {
    Family::default()
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The registry for one snapshot.
pub fn build(snap: &Scrape, info: &DaemonInfo, started: std::time::SystemTime) -> Registry {
    let mut r = Registry::default();
    // Families are encoded in registration order: keep the order stable for readers of the text.
    register_daemon(&mut r, snap, info, started);
    let names = Namer(&snap.workloads);
    register_cgroups(&mut r, &names, &snap.cgroups);
    register_notices(&mut r, &names, &snap.notices, &snap.guard_counts);
    register_nvml_usage(&mut r, &names, &snap.nvml_usage);
    register_compute(&mut r, &names, &snap.compute);
    register_idle(&mut r, &names, &snap.idle);
    register_gpus(&mut r, &snap.gpus);
    r
}

/// Registers what runs: build info, start time, NVML availability and the eBPF counters.
fn register_daemon(
    r: &mut Registry,
    snap: &Scrape,
    info: &DaemonInfo,
    started: std::time::SystemTime,
) {
    r.register(
        "gpud_build",
        "gpud version and how it enforces",
        Info::new(vec![
            ("version".to_owned(), info.version.clone()),
            ("attach_mode".to_owned(), info.attach_mode.clone()),
            ("enforcement_tier".to_owned(), info.enforcement_tier.clone()),
            ("deny_hook".to_owned(), info.deny_hook.clone()),
            ("react_action".to_owned(), info.react_action.clone()),
        ]),
    );
    let start: Gauge<f64, AtomicU64> = Gauge::default();
    start.set(
        started
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    );
    r.register(
        "gpud_start_time_seconds",
        "When the daemon started (Unix time)",
        start,
    );
    let nvml: Gauge = Gauge::default();
    nvml.set(i64::from(snap.nvml_available));
    r.register(
        "gpud_nvml_available",
        "1 while NVML answers, 0 otherwise (see NvmlStatus on D-Bus)",
        nvml,
    );
    let kernel = counters();
    for (name, v) in &snap.kernel_stats {
        kernel
            .get_or_create(&vec![("event".to_owned(), name.clone())])
            .inc_by(*v);
    }
    r.register(
        "gpud_kernel_events",
        "Counters kept by the eBPF programs (events_lost, limit_crossings, objects_map_full, ...)",
        kernel,
    );
}

/// Registers the probes' per-cgroup memory, limits, limit events, ioctls and processes.
fn register_cgroups(r: &mut Registry, names: &Namer, cgroups: &[CgroupRecord]) {
    let memory = int_gauges();
    let limit = int_gauges();
    let limit_events = counters();
    let ioctls = counters();
    let processes = int_gauges();
    for c in cgroups {
        let l = names.cgroup_labels(&c.path);
        for (gpu, bytes) in &c.memory_current {
            // "all" is the sum of the others: leave summing to PromQL.
            if gpu != "all" {
                memory
                    .get_or_create(&with(l.clone(), "gpu", gpu))
                    .set(int(*bytes));
            }
        }
        for (gpu, bytes) in &c.memory_max {
            limit
                .get_or_create(&with(l.clone(), "gpu", gpu))
                .set(int(*bytes));
        }
        limit_events.get_or_create(&l).inc_by(c.memory_events);
        for (class, n) in &c.ioctls {
            ioctls
                .get_or_create(&with(l.clone(), "class", class))
                .inc_by(*n);
        }
        processes.get_or_create(&l).set(int(c.pids.len() as u64));
    }
    r.register(
        "gpud_cgroup_memory_bytes",
        "GPU memory the probes charged to the cgroup and its descendants, by GPU index (or unknown)",
        memory,
    );
    r.register(
        "gpud_cgroup_memory_limit_bytes",
        "memory_max in force on the cgroup, by GPU index or all",
        limit,
    );
    r.register(
        "gpud_cgroup_memory_limit_events",
        "Allocations that crossed (react) or were refused by (deny) the cgroup's limits",
        limit_events,
    );
    r.register(
        "gpud_cgroup_ioctls",
        "ioctls on NVIDIA files by the cgroup's processes, by class",
        ioctls,
    );
    r.register(
        "gpud_cgroup_processes",
        "Live processes attributed to the cgroup",
        processes,
    );
}

/// Registers the notices published by name and the guard's actions by cgroup and control.
fn register_notices(
    r: &mut Registry,
    names: &Namer,
    notices: &BTreeMap<&'static str, u64>,
    guard_counts: &crate::enforcement::guard::GuardCounts,
) {
    let guarded = counters();
    for ((cgroup, control, action), n) in guard_counts {
        let l = with(
            with(names.cgroup_labels(cgroup), "control", control),
            "action",
            action,
        );
        guarded.get_or_create(&l).inc_by(*n);
    }
    let by_name = counters();
    for (name, n) in notices {
        by_name
            .get_or_create(&vec![("notice".to_owned(), (*name).to_owned())])
            .inc_by(*n);
    }
    r.register(
        "gpud_notices",
        "Notices published since start (each a D-Bus signal, but Inventory, and a log line), \
         by name; `missed`: notices the counter fell behind on",
        by_name,
    );
    r.register(
        "gpud_scheduler_guard",
        "Scheduling controls of the cgroup's processes the guard acted on (denied, refused, \
         clamped) or reported (audited, unenforced), by control",
        guarded,
    );
}

/// Registers NVML's per-cgroup figures: memory and SM utilization by GPU.
fn register_nvml_usage(r: &mut Registry, names: &Namer, usage: &[NvmlUsageRecord]) {
    let nvml_memory = int_gauges();
    let util = gauges();
    for u in usage {
        let l = with(names.cgroup_labels(&u.cgroup), "gpu", u.gpu);
        nvml_memory.get_or_create(&l).set(int(u.nvml_memory_bytes));
        util.get_or_create(&l).set(f64::from(u.sm_util));
    }
    r.register(
        "gpud_cgroup_nvml_memory_bytes",
        "GPU memory NVML reports for the cgroup's processes, by GPU index",
        nvml_memory,
    );
    r.register(
        "gpud_cgroup_sm_utilization_percent",
        "SM utilization of the cgroup's processes over the last NVML sample, by GPU index",
        util,
    );
}

/// Registers the compute controller's per-cgroup duty, target, measured share and throttling.
fn register_compute(r: &mut Registry, names: &Namer, compute: &daemon::ComputeStats) {
    let duty = gauges();
    let target = gauges();
    let measured = gauges();
    let throttled = seconds_counters();
    let periods = counters();
    for (cgroup, s) in compute {
        let l = names.cgroup_labels(cgroup);
        duty.get_or_create(&l).set(s.duty);
        target.get_or_create(&l).set(s.target);
        measured.get_or_create(&l).set(s.measured);
        throttled
            .get_or_create(&l)
            .inc_by(s.throttled_usec as f64 / 1e6);
        periods.get_or_create(&l).inc_by(s.nr_throttled);
    }
    r.register(
        "gpud_cgroup_compute_duty_percent",
        "Share of each compute period the cgroup may run",
        duty,
    );
    r.register(
        "gpud_cgroup_compute_target_percent",
        "GPU utilization the compute controller aims the cgroup at",
        target,
    );
    r.register(
        "gpud_cgroup_compute_measured_percent",
        "GPU utilization measured for the cgroup at the last sample",
        measured,
    );
    r.register(
        "gpud_cgroup_compute_throttled_seconds",
        "Time the compute controller kept the cgroup frozen",
        throttled,
    );
    r.register(
        "gpud_cgroup_compute_throttled_periods",
        "Compute periods in which the cgroup was frozen",
        periods,
    );
}

/// Registers the cgroups reported idle: how long, and the GPU memory they hold.
fn register_idle(r: &mut Registry, names: &Namer, idle: &[IdleRecord]) {
    let secs = int_gauges();
    let memory = int_gauges();
    for i in idle {
        let l = with(names.cgroup_labels(&i.cgroup), "gpu", i.gpu);
        secs.get_or_create(&l).set(int(i.idle_secs));
        memory.get_or_create(&l).set(int(i.memory_bytes));
    }
    r.register(
        "gpud_cgroup_idle_seconds",
        "How long a cgroup reported idle ([idle]) has held GPU memory under the utilization threshold",
        secs,
    );
    r.register(
        "gpud_cgroup_idle_memory_bytes",
        "GPU memory held by a cgroup reported idle, by GPU index",
        memory,
    );
}

/// Registers the per-GPU (and MIG device) figures: identity, memory and Xid errors.
fn register_gpus(r: &mut Registry, gpus: &[GpuRecord]) {
    let gpu_info = int_gauges();
    let total = int_gauges();
    let used = int_gauges();
    let xid = counters();
    for g in gpus {
        let mig = if g.mig == u32::MAX {
            String::new()
        } else {
            g.mig.to_string()
        };
        let l: Labels = vec![
            ("gpu".into(), g.index.to_string()),
            ("mig".into(), mig),
            ("uuid".into(), g.uuid.clone()),
        ];
        gpu_info
            .get_or_create(&with(
                with(
                    with(l.clone(), "name", &g.name),
                    "pci_bus_id",
                    &g.pci_bus_id,
                ),
                "driver_version",
                &g.driver_version,
            ))
            .set(1);
        total.get_or_create(&l).set(int(g.memory_total));
        used.get_or_create(&l).set(int(g.memory_used));
        xid.get_or_create(&l).inc_by(g.xid_errors);
    }
    r.register(
        "gpud_gpu_info",
        "GPUs and MIG devices NVML reports (value 1)",
        gpu_info,
    );
    r.register("gpud_gpu_memory_total_bytes", "GPU memory size", total);
    r.register(
        "gpud_gpu_memory_used_bytes",
        "GPU memory in use (all processes)",
        used,
    );
    r.register(
        "gpud_gpu_xid_errors",
        "Critical Xid errors seen since the daemon started",
        xid,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn one_snapshot_renders_every_family() {
        let snap = Scrape {
            cgroups: vec![CgroupRecord {
                id: 9,
                path: format!("/system.slice/docker-{ID}.scope"),
                pids: vec![1, 2],
                ioctls: [("alloc".to_owned(), 3)].into(),
                memory_current: [("0".to_owned(), 4096), ("all".to_owned(), 4096)].into(),
                memory_max: [("all".to_owned(), 8192)].into(),
                memory_events: 1,
                workload: BTreeMap::new(),
            }],
            workloads: std::sync::Arc::new(BTreeMap::from([(
                format!("/system.slice/docker-{ID}.scope"),
                [
                    ("namespace", "ml"),
                    ("pod", "train-0"),
                    ("container", "main"),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into(),
            )])),
            kernel_stats: [("events_lost".to_owned(), 0)].into(),
            guard_counts: [(
                (
                    format!("/system.slice/docker-{ID}.scope"),
                    "SET_TIMESLICE".to_owned(),
                    "clamped".to_owned(),
                ),
                5,
            )]
            .into(),
            notices: [("MemoryLimitExceeded", 2)].into(),
            ..Default::default()
        };
        let info = DaemonInfo {
            version: "1".into(),
            attach_mode: "tracepoint".into(),
            enforcement_tier: "react".into(),
            react_action: "kill".into(),
            kernel_capabilities: BTreeMap::new(),
            deny_hook: "none".into(),
            deny_hook_refusals: BTreeMap::new(),
            driver_limits: "none".into(),
            cgroup_root: "/".into(),
            probes_resumed: false,
            unseen_calls: BTreeMap::new(),
            probes_taken_over: BTreeMap::new(),
        };
        let mut out = String::new();
        encode(&mut out, &build(&snap, &info, std::time::SystemTime::now())).expect("encode");
        let labels = format!(
            "cgroup=\"/system.slice/docker-{ID}.scope\",container_id=\"{ID}\",namespace=\"ml\",\
             pod=\"train-0\",container=\"main\""
        );
        for line in [
            format!("gpud_cgroup_memory_bytes{{{labels},gpu=\"0\"}} 4096"),
            format!("gpud_cgroup_memory_limit_bytes{{{labels},gpu=\"all\"}} 8192"),
            format!("gpud_cgroup_ioctls_total{{{labels},class=\"alloc\"}} 3"),
            format!("gpud_cgroup_processes{{{labels}}} 2"),
            format!(
                "gpud_scheduler_guard_total{{{labels},control=\"SET_TIMESLICE\",action=\"clamped\"}} 5"
            ),
            "gpud_nvml_available 0".to_owned(),
            "gpud_notices_total{notice=\"MemoryLimitExceeded\"} 2".to_owned(),
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line} in\n{out}");
        }
        assert!(
            !out.contains("gpu=\"all\"} 4096"),
            "the sum is not exported"
        );
        assert!(out.ends_with("# EOF\n"));
    }
}
