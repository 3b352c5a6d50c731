//! What operators watch: the Prometheus endpoint (scraped over TCP and parsed with a Prometheus
//! text parser), the idle/hoarding report on the simulated GPU (ListIdle, IdleChanged, metrics),
//! and `gpudctl idle`, `top` and `events` against the real daemon.
//!
//! Real parts: the gpud binary with its eBPF probes, a private dbus-daemon, the FUSE fake NVIDIA
//! control device for byte-exact memory, the fake libnvidia-ml loaded by nvml-wrapper (a
//! process's SM utilization there is its share of one CPU), real cgroups and processes.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use gpud_tests::{
    Cgroup, Rig, RmProcess, TestConfig, eventually, gpudctl_bin, one_gpu, scenario::Process,
    spawn_in_cgroup,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const ID: &str = "4f2c1e9d8b7a65432100fedcba98765432100123456789abcdef0123456789ab";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The rig's config with the metrics endpoint on `port`, NVML sampled every 100 ms, and a
/// cgroup reported idle after `min_idle_secs` under 5 %.
fn config(rig: &Rig, port: u16, min_idle_secs: i64) -> TestConfig {
    rig.config()
        .react_action("notify")
        .set("nvml.sample_interval_ms", 100)
        .set("idle.threshold_percent", 5)
        .set("idle.min_duration_secs", min_idle_secs)
        .set("metrics.listen", format!("127.0.0.1:{port}"))
}

/// NVML's view: these processes on one 80 GiB GPU, each with its memory.
fn scenario(rig: &Rig, procs: &[(u32, u64)]) {
    let processes = procs.iter().map(|&(pid, mem)| Process::on(pid, 0, mem));
    rig.nvml_scenario(&one_gpu("Simulated GPU", processes));
}

struct Scrape {
    content_type: String,
    text: String,
    samples: Vec<prometheus_parse::Sample>,
}

fn scrape(port: u16) -> Scrape {
    let mut resp = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape /metrics");
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = resp.body_mut().read_to_string().expect("metrics body");
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).expect("parse the exposition");
    Scrape {
        content_type,
        text,
        samples: parsed.samples,
    }
}

impl Scrape {
    /// The value of `name` with exactly these labels among its labels.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .filter(|s| s.metric == name)
            .find(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
    }
}

/// `gpudctl ARGS --bus-address BUS` run to completion: (exit code, stdout).
fn gpudctl(bus: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(gpudctl_bin())
        .args(args)
        .args(["--bus-address", bus])
        .output()
        .expect("run gpudctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A `gpudctl events` follower; its stdout lines arrive on a channel.
struct Follower {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Follower {
    fn start(bus: &str, args: &[&str]) -> Self {
        let mut child = Command::new(gpudctl_bin())
            .arg("events")
            .args(args)
            .args(["--bus-address", bus])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start gpudctl events");
        // It says so on stderr once its match rule is in place.
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let mut line = String::new();
        err.read_line(&mut line).expect("gpudctl events stderr");
        assert!(line.contains("following"), "gpudctl events said {line:?}");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in stdout.lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    fn next(&self, timeout: Duration) -> Option<Value> {
        let l = self.lines.recv_timeout(timeout).ok()?;
        Some(serde_json::from_str(&l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_endpoint_reports_what_dbus_reports() {
    let Some(mut rig) = Rig::new("ops-metrics").fake_device(1).map(Rig::fake_nvml) else {
        return;
    };

    // A container's cgroup as docker's systemd driver names it.
    let parent = Cgroup::new("ops-metrics");
    let ctr_cg = parent.child(&format!("docker-{ID}.scope"));
    let ctr = ctr_cg.rel.clone();
    let mut rm = RmProcess::spawn(Some(&ctr_cg.dir), &rig.ctl());
    scenario(&rig, &[(rm.pid, 3 * GIB)]);

    let port = free_port();
    rig.start(config(&rig, port, 300)).await;
    let (_c, proxy) = rig.proxy().await;

    let (c, d0) = rm.client_device(0);
    rm.ok(&format!("alloc {c} {d0} {} nvos64", 6 * MIB));
    rig.set_limit(&ctr, "all", "memory_max", "64Mi").await;

    // NVML sampled it and the probes charged it.
    let rec = eventually(Duration::from_secs(10), || async {
        let r = proxy.get_cgroup(&ctr).await.ok()?;
        let nvml = proxy.list_nvml_usage().await.ok()?;
        (r.memory_current.get("0") == Some(&(6 * MIB)) && nvml.iter().any(|u| u.cgroup == ctr))
            .then_some(r)
    })
    .await
    .unwrap_or_else(|| panic!("never attributed:\n{}", rig.log_text()));

    let s = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .expect("scrape task");
    // Shown with --nocapture (docs/metrics.md's sample comes from here).
    println!("{}", s.text);
    assert!(
        s.content_type.starts_with("application/openmetrics-text"),
        "{}",
        s.content_type
    );
    let cg = [("cgroup", ctr.as_str()), ("container_id", ID)];
    let with = |extra: (&'static str, &'static str)| {
        let mut v = cg.to_vec();
        v.push(extra);
        v
    };
    assert_eq!(
        s.value("gpud_cgroup_memory_bytes", &with(("gpu", "0"))),
        Some(rec.memory_current["0"] as f64)
    );
    assert_eq!(
        s.value("gpud_cgroup_memory_limit_bytes", &with(("gpu", "all"))),
        Some((64 * MIB) as f64)
    );
    assert_eq!(
        s.value("gpud_cgroup_nvml_memory_bytes", &with(("gpu", "0"))),
        Some((3 * GIB) as f64)
    );
    assert_eq!(
        s.value("gpud_cgroup_ioctls_total", &with(("class", "alloc"))),
        Some(rec.ioctls["alloc"] as f64)
    );
    assert_eq!(s.value("gpud_cgroup_processes", &cg), Some(1.0));
    assert_eq!(s.value("gpud_nvml_available", &[]), Some(1.0));
    assert_eq!(
        s.value("gpud_gpu_memory_total_bytes", &[("gpu", "0")]),
        Some((80 * GIB) as f64)
    );
    assert_eq!(
        s.value("gpud_gpu_info", &[("gpu", "0"), ("name", "Simulated GPU")]),
        Some(1.0)
    );
    let stats = proxy.get_kernel_stats().await.expect("stats");
    assert_eq!(
        s.value("gpud_kernel_events_total", &[("event", "memory_charges")]),
        Some(stats["memory_charges"] as f64)
    );
    assert_eq!(
        s.value(
            "gpud_build_info",
            &[("react_action", "notify"), ("enforcement_tier", "react")]
        ),
        Some(1.0)
    );

    // Anything but /metrics is not found.
    let err = ureq::get(&format!("http://127.0.0.1:{port}/"))
        .call()
        .expect_err("/ is not served");
    assert!(
        matches!(err, ureq::Error::StatusCode(404)),
        "unexpected {err:?}"
    );
    rm.finish();
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_cgroups_holding_memory_are_reported_and_followed() {
    let mut rig = Rig::new("ops-idle").fake_nvml();
    let idle_cg = Cgroup::new("ops-idle");
    let busy_cg = Cgroup::new("ops-busy");
    let nomem_cg = Cgroup::new("ops-nomem");
    let flag = rig.path().join("wake");
    let c_flag = std::ffi::CString::new(flag.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_flag.as_ptr(), 0o600) }, 0, "mkfifo");
    // Blocks in the FIFO's open until the test writes to it, then burns a CPU (= the simulated
    // GPU). Blocked, not polling: the fake NVML counts time runnable (waiting for a CPU
    // included), and a loop waking every 0.2 s reads as active on a busy machine.
    let mut idle_p = spawn_in_cgroup(
        &idle_cg,
        &format!("read _ < {}; while :; do :; done", flag.display()),
    );
    let mut busy_p = spawn_in_cgroup(&busy_cg, "while :; do :; done");
    let mut nomem_p = spawn_in_cgroup(&nomem_cg, "sleep 600");
    scenario(
        &rig,
        &[
            (idle_p.id(), 2 * GIB),
            (busy_p.id(), GIB),
            (nomem_p.id(), 0),
        ],
    );

    let port = free_port();
    rig.start(config(&rig, port, 2)).await;
    let (_c, proxy) = rig.proxy().await;
    let bus = rig.bus.address.clone();
    let follower = Follower::start(&bus, &["--json", "--type", "IdleChanged"]);

    let listed = eventually(Duration::from_secs(15), || async {
        let l = proxy.list_idle().await.ok()?;
        l.iter().any(|i| i.cgroup == idle_cg.rel).then_some(l)
    })
    .await
    .unwrap_or_else(|| panic!("the idle cgroup was never reported:\n{}", rig.log_text()));
    assert_eq!(listed.len(), 1, "only the idle cgroup: {listed:?}");
    let rec = &listed[0];
    assert_eq!(rec.gpu, 0);
    assert_eq!(rec.memory_bytes, 2 * GIB);
    assert!(rec.idle_secs >= 2, "{rec:?}");
    assert_eq!(rec.last_active, 0, "never active since gpud started");
    assert!(rec.util < 5, "{rec:?}");

    let ev = follower
        .next(Duration::from_secs(10))
        .expect("an IdleChanged event");
    assert_eq!(ev["signal"], "IdleChanged");
    assert_eq!(ev["cgroup"], idle_cg.rel.as_str());
    assert_eq!(ev["idle"], true);
    assert_eq!(ev["memory_bytes"], 2 * GIB);

    // gpudctl idle, the metric and a top frame say the same.
    let (code, out) = gpudctl(&bus, &["idle", "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).expect("idle JSON");
    assert_eq!(v[0]["cgroup"], idle_cg.rel.as_str());
    let s = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .expect("scrape task");
    let idle_secs = s
        .value(
            "gpud_cgroup_idle_seconds",
            &[("cgroup", idle_cg.rel.as_str()), ("gpu", "0")],
        )
        .expect("idle metric");
    assert!(idle_secs >= 2.0);
    assert_eq!(
        s.value(
            "gpud_cgroup_idle_memory_bytes",
            &[("cgroup", idle_cg.rel.as_str()), ("gpu", "0")]
        ),
        Some((2 * GIB) as f64)
    );
    assert!(
        s.value(
            "gpud_cgroup_idle_seconds",
            &[("cgroup", busy_cg.rel.as_str())]
        )
        .is_none()
    );

    let (code, out) = gpudctl(
        &bus,
        &[
            "top",
            "--json",
            "-n",
            "2",
            "--interval",
            "0.3",
            "--sort",
            "util",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let frames: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("frame JSON"))
        .collect();
    assert_eq!(frames.len(), 2, "{out}");
    let rows = frames[1]["cgroups"].as_array().expect("rows");
    assert_eq!(
        rows[0]["cgroup"],
        busy_cg.rel.as_str(),
        "sorted by util: {out}"
    );
    assert!(rows[0]["sm_util"].as_u64().unwrap_or(0) >= 5, "{out}");
    let idle_row = rows
        .iter()
        .find(|r| r["cgroup"] == idle_cg.rel.as_str())
        .expect("idle row");
    assert!(idle_row["idle_secs"].as_u64().unwrap_or(0) >= 2, "{out}");
    assert_eq!(idle_row["nvml_memory_bytes"], 2 * GIB);
    assert_eq!(frames[1]["gpus"][0]["name"], "Simulated GPU");
    let (code, text) = gpudctl(&bus, &["top", "-n", "1"]);
    assert_eq!(code, 0);
    assert!(
        text.contains("CGROUP") && text.contains(&idle_cg.rel),
        "{text}"
    );

    // It wakes up: no longer idle, and the signal says so.
    // Opening the FIFO for writing meets the reader blocked in its open.
    std::fs::write(&flag, "\n").expect("wake");
    let ev = follower
        .next(Duration::from_secs(10))
        .expect("IdleChanged(idle=false)");
    assert_eq!(ev["cgroup"], idle_cg.rel.as_str());
    assert_eq!(ev["idle"], false);
    assert!(proxy.list_idle().await.expect("ListIdle").is_empty());

    for p in [&mut idle_p, &mut busy_p, &mut nomem_p] {
        let _ = p.kill();
        let _ = p.wait();
    }
    drop(follower);
    // gpudctl's exit code when the daemon is gone.
    rig.stop();
    let (code, _) = gpudctl(&bus, &["idle"]);
    assert_eq!(code, 3, "unreachable daemon");
}

/// Per-pod figures: the names a runtime integration reports for a container's cgroup
/// (`SetWorkload`) label its record (`GetCgroup`, `ListCgroups`, `gpudctl list --json`) and every
/// per-cgroup metric; names the daemon cannot take are refused and change nothing; they outlive a
/// restart of gpud and go when the cgroup is removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_workloads_names_label_its_cgroup_everywhere_and_outlive_a_restart() {
    use std::collections::BTreeMap;
    let Some(rig) = Rig::new("ops-workload").fake_device(1) else {
        return;
    };
    let mut rig = rig.fake_nvml();
    scenario(&rig, &[]);
    let port = free_port();
    // Pins kept at exit, as in production: the restart keeps the kernel's counts.
    rig.start(config(&rig, port, 3600).keep_pinned(true)).await;
    let cg = Cgroup::new("ops-workload");
    let mut t = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = t.client_device(0);
    t.ok(&format!("alloc {client} {device} {}", 8 * MIB));
    rig.expect_memory(&cg.rel, &[("0", 8 * MIB)]).await;

    let names: BTreeMap<String, String> = [
        ("namespace", "ml"),
        ("pod", "train-0"),
        ("container", "main"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .into();
    let (_c, p) = rig.proxy().await;
    p.set_workload(&cg.rel, &names).await.expect("SetWorkload");
    for bad in [("node", "n1"), ("pod", ""), ("pod", "a\nb")] {
        let bad: BTreeMap<String, String> = [(bad.0.to_owned(), bad.1.to_owned())].into();
        match p.set_workload(&cg.rel, &bad).await {
            Err(zbus::Error::MethodError(name, _, _)) => {
                assert_eq!(name.as_str(), "dev.gpud.Error.InvalidArgument", "{bad:?}");
            }
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(rig.get_cgroup(&cg.rel).await.workload, names);

    let labelled = |s: &Scrape| {
        s.value(
            "gpud_cgroup_memory_bytes",
            &[
                ("cgroup", cg.rel.as_str()),
                ("namespace", "ml"),
                ("pod", "train-0"),
                ("container", "main"),
                ("gpu", "0"),
            ],
        )
    };
    let s = scrape(port);
    assert_eq!(labelled(&s), Some((8 * MIB) as f64), "{}", s.text);
    let (code, out) = gpudctl(&rig.bus.address, &["list", "--json"]);
    assert_eq!(code, 0, "{out}");
    let rows: Value = serde_json::from_str(&out).expect("gpudctl list --json");
    let row = rows
        .as_array()
        .and_then(|r| r.iter().find(|r| r["path"] == cg.rel.as_str()))
        .unwrap_or_else(|| panic!("{} not listed: {out}", cg.rel));
    assert_eq!(row["workload"]["pod"], "train-0", "{row}");
    let (code, table) = gpudctl(&rig.bus.address, &["list"]);
    assert_eq!(code, 0, "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(cg.rel.as_str()) && l.contains("ml/train-0")),
        "{table}"
    );

    // A restart keeps them (the integrations do not name running containers again).
    rig.restart().await;
    assert_eq!(rig.get_cgroup(&cg.rel).await.workload, names);
    let s = scrape(port);
    assert_eq!(labelled(&s), Some((8 * MIB) as f64), "{}", s.text);

    // The container goes: so do its names, from memory and from the state directory.
    t.finish();
    let (state, rel) = (rig.path().join("state/workloads.json"), cg.rel.clone());
    drop(cg);
    let gone = eventually(Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&state).unwrap_or_default();
        (!text.contains(&rel)).then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "{rel}'s names outlived it:\n{}",
        rig.log_text()
    );
}
