//! The daemon's own cost of compute shares: gpud controlling 10 tenants on 2 GPUs, its CPU time
//! over a fixed window, with no compute policy (the baseline: sampling NVML and following the
//! tenants), with the shares set in hardware (channel-group windows), and with the freezer.
//! Run by `cargo xtask bench`, not by `cargo test` (it prints `BENCH JSON: {…}`).
//!
//! The tenants are `gpud-rm` processes with a channel group each that burn CPU as their GPU
//! work (the fake NVML reports their CPU share; the fake device stops a tenant while its group
//! is off the runlist): exclusive windows keep one tenant per GPU running, so two CPUs carry
//! them. What is measured is gpud's `utime + stime` (/proc/<pid>/stat) over the window, as a
//! percentage of one CPU, and its actuator's commands per second.
//!
//! `GPUD_BENCH_WINDOW_SECS` shortens the window (the smoke run of `cargo xtask test` uses 2 s:
//! it checks that the benchmark runs and reports every figure, not the figures).

use std::time::{Duration, Instant};

use gpud_tests::{Cgroup, Rig, RmProcess, eventually};
use serde_json::json;

const TENANTS: usize = 10;
const GPUS: u32 = 2;
/// The measured window: 20 s, or `GPUD_BENCH_WINDOW_SECS`.
fn window() -> Duration {
    let secs = std::env::var("GPUD_BENCH_WINDOW_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(secs)
}

fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let f: Vec<u64> = s
                .rsplit(')')
                .next()?
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            // utime and stime: fields 14 and 15, the 12th and 13th numbers after `)` (the
            // state letter is not a number).
            Some(f.get(10)? + f.get(11)?)
        })
        .unwrap_or(0)
}

/// gpud's CPU use (percent of one CPU) over [`window`], and the controls the fake received.
fn measure(rig: &Rig) -> (f64, u64) {
    let pid = rig.pid().expect("gpud runs");
    // SAFETY: sysconf with a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let schedules = |rig: &Rig| -> u64 {
        rig.fake()
            .snapshot()
            .channel_groups
            .iter()
            .map(|g| g.schedules)
            .sum()
    };
    let (t0, c0, s0) = (Instant::now(), cpu_ticks(pid), schedules(rig));
    std::thread::sleep(window());
    let (c1, s1) = (cpu_ticks(pid), schedules(rig));
    let secs = t0.elapsed().as_secs_f64();
    ((c1 - c0) as f64 / hz / secs * 100.0, s1 - s0)
}

async fn run(case: &str, hardware: bool, policies: bool) -> serde_json::Value {
    let Some(rig) = Rig::new(&format!("compute-bench-{case}")).fake_device(GPUS) else {
        return json!({ "skipped": "no /dev/fuse" });
    };
    let mut rig = rig.fake_gpus(GPUS);
    rig.fake().inject("runlist stop").expect("runlist mode");
    rig.start(rig.config().log("gpud=info").compute(hardware))
        .await;
    rig.wait_for_gpus(GPUS).await;
    let mut tenants = Vec::new();
    for i in 0..TENANTS {
        let cg = Cgroup::new(&format!("bench-{case}-{i}"));
        let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
        let gpu = i as u32 % GPUS;
        let (client, device) = p.client_device(gpu);
        p.handle(&format!("channel-group {client} {device}"));
        p.ok("burn");
        tenants.push((p, cg, gpu));
    }
    let procs: Vec<(u32, u32)> = tenants.iter().map(|(p, _, gpu)| (p.pid, *gpu)).collect();
    rig.nvml_scenario(&gpud_tests::gpus_with(GPUS, &procs));
    let (_c, proxy) = rig.proxy().await;
    let listed = eventually(Duration::from_secs(15), || async {
        let n: usize = proxy
            .list_nvml_usage()
            .await
            .ok()?
            .iter()
            .map(|u| u.pids.len())
            .sum();
        (n >= TENANTS).then_some(())
    })
    .await;
    assert!(listed.is_some(), "NVML never listed the tenants");
    if policies {
        for (i, (_, cg, _)) in tenants.iter().enumerate() {
            let m = std::collections::BTreeMap::from([(
                "compute_weight",
                zbus::Variant::from(1 + i as u32 / 2),
            )]);
            proxy
                .set_limits(&cg.rel, "all", m)
                .await
                .expect("SetLimits");
        }
        // The probe (a second), then a few plans.
        std::thread::sleep(Duration::from_secs(3));
    }
    let (cpu, schedules) = measure(&rig);
    json!({
        "gpud_cpu_pct_of_one_cpu": (cpu * 100.0).round() / 100.0,
        "schedule_controls_per_s": (schedules as f64 / window().as_secs_f64()).round(),
        "verdict": if rig.log_text().contains("the GPU stops queued work") { "honors" }
            else if rig.log_text().contains("no lever stops") { "ignores" } else { "none" },
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_compute_daemon_cost() {
    let baseline = run("none", true, false).await;
    let hardware = run("hw", true, true).await;
    let freezer = run("freezer", false, true).await;
    let result = json!({
        "tenants": TENANTS, "gpus": GPUS, "window_s": window().as_secs(),
        "nvml_sample_ms": 100, "period_ms": 100,
        "no_policy": baseline, "hardware": hardware, "freezer": freezer,
    });
    println!("BENCH JSON: {result}");
}
