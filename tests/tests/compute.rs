//! Compute shares in a real closed loop: real processes burning CPU in real cgroups are the GPU
//! users of the simulated GPU (the fake libnvidia-ml reports each one's CPU share as its SM
//! utilization), the real gpud measures them through nvml-wrapper and throttles them with real
//! `cgroup.freeze`. Achieved shares are measured independently, from the processes' own CPU time
//! (`/proc/<pid>/task/*/schedstat`) over the window. The tests run one at a time: they compete
//! for the same CPUs.

use std::{
    process::Child,
    time::{Duration, Instant},
};

use gpud_tests::{Bus, Cgroup, TempDir};

mod simulated_gpu;
use simulated_gpu::{Procs, SERIAL, burner, machine_is_quiet, scenario, set, shares, start};

#[tokio::test(flavor = "multi_thread")]
async fn a_cap_of_30_holds_alone_and_throttling_is_reported() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("compute-cap");
    let lib_dir = dir.path().join("lib");
    let cg = Cgroup::new("cap");
    let procs = Procs(vec![burner(&cg)]);
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    if !machine_is_quiet(&pids) {
        return;
    }
    let bus = Bus::start();
    let d = start(&dir, &lib_dir, &bus, &pids).await;
    set(&d, &cg, &[("compute_max", zbus::Variant::from(30u32))]).await;
    std::thread::sleep(Duration::from_secs(3));
    let s = shares(&pids, Duration::from_secs(10))[0];
    println!("compute_max=30 alone: achieved {s:.1} % over 10 s");
    assert!(
        (27.0..=33.0).contains(&s),
        "achieved {s:.1} % instead of 30 ± 3"
    );
    let (_c, p) = d.proxy().await;
    let stats = p.list_compute().await.expect("ListCompute");
    let st = stats
        .iter()
        .find(|r| r.cgroup == cg.rel)
        .expect("controlled");
    assert!(
        st.nr_throttled > 50 && st.throttled_usec > 5_000_000,
        "{st:?}"
    );
    // Removing the cap lets it run freely again.
    let (_c, p) = d.proxy().await;
    p.clear_limits(&cg.rel, "0", &["compute_max"])
        .await
        .expect("ClearLimits");
    std::thread::sleep(Duration::from_secs(2));
    let s = shares(&pids, Duration::from_secs(2))[0];
    assert!(
        s > 60.0,
        "still throttled after the cap was cleared: {s:.1} %"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn weights_1_to_3_share_a_contended_gpu_and_an_idle_neighbour_leaves_it_all() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("compute-weights");
    let lib_dir = dir.path().join("lib");
    let (a, b) = (Cgroup::new("w1"), Cgroup::new("w3"));
    let mut procs = Procs(vec![burner(&a), burner(&b)]);
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    if !machine_is_quiet(&pids) {
        return;
    }
    let bus = Bus::start();
    let d = start(&dir, &lib_dir, &bus, &pids).await;
    set(&d, &a, &[("compute_weight", zbus::Variant::from(1u32))]).await;
    set(&d, &b, &[("compute_weight", zbus::Variant::from(3u32))]).await;
    std::thread::sleep(Duration::from_secs(3));
    let s = shares(&pids, Duration::from_secs(10));
    println!(
        "weights 1:3: achieved {:.1} % / {:.1} % over 10 s",
        s[0], s[1]
    );
    assert!((20.0..=30.0).contains(&s[0]), "weight 1 got {:.1} %", s[0]);
    assert!((70.0..=80.0).contains(&s[1]), "weight 3 got {:.1} %", s[1]);
    // The weight-3 cgroup goes idle: the other gets the whole GPU.
    let mut idle = procs.0.remove(1);
    let _ = idle.kill();
    let _ = idle.wait();
    std::thread::sleep(Duration::from_secs(3));
    let s = shares(&pids[..1], Duration::from_secs(3))[0];
    println!("weight 1 alone: {s:.1} %");
    assert!(s >= 80.0, "not work-conserving: {s:.1} %");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guarantee_of_60_is_honoured_beside_a_busy_neighbour() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("compute-min");
    let lib_dir = dir.path().join("lib");
    let (a, b) = (Cgroup::new("min60"), Cgroup::new("other"));
    let procs = Procs(vec![burner(&a), burner(&b)]);
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    if !machine_is_quiet(&pids) {
        return;
    }
    let bus = Bus::start();
    let d = start(&dir, &lib_dir, &bus, &pids).await;
    set(&d, &a, &[("compute_min", zbus::Variant::from(60u32))]).await;
    std::thread::sleep(Duration::from_secs(3));
    let s = shares(&pids, Duration::from_secs(10));
    println!(
        "compute_min=60: achieved {:.1} % (neighbour {:.1} %) over 10 s",
        s[0], s[1]
    );
    assert!(s[0] >= 57.0, "guaranteed cgroup got {:.1} %", s[0]);
    assert!(s[0] + s[1] <= 105.0, "the GPU was oversubscribed: {s:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn best_effort_is_throttled_as_soon_as_latency_critical_wakes_up() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("compute-prio");
    let lib_dir = dir.path().join("lib");
    let (lc, be) = (Cgroup::new("lc"), Cgroup::new("be"));
    let mut procs = Procs(vec![burner(&be)]);
    // Two burners will run: check that the machine has a CPU for each.
    let probe = Procs(vec![burner(&lc)]);
    let quiet = machine_is_quiet(&[procs.0[0].id(), probe.0[0].id()]);
    drop(probe);
    if !quiet {
        return;
    }
    let bus = Bus::start();
    let d = start(&dir, &lib_dir, &bus, &[procs.0[0].id()]).await;
    set(&d, &be, &[("priority", zbus::Variant::from("best-effort"))]).await;
    set(
        &d,
        &lc,
        &[("priority", zbus::Variant::from("latency-critical"))],
    )
    .await;
    std::thread::sleep(Duration::from_secs(2));
    let alone = shares(&[procs.0[0].id()], Duration::from_secs(2))[0];
    assert!(
        alone > 60.0,
        "best-effort alone was throttled: {alone:.1} %"
    );
    // The latency-critical cgroup wakes up.
    let woke = Instant::now();
    procs.0.push(burner(&lc));
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    scenario(&lib_dir, &pids);
    let frozen = || {
        std::fs::read_to_string(be.dir.join("cgroup.events"))
            .map(|t| t.lines().any(|l| l == "frozen 1"))
            .unwrap_or(false)
    };
    let mut reaction = None;
    while woke.elapsed() < Duration::from_secs(5) {
        if frozen() {
            reaction = Some(woke.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let reaction =
        reaction.unwrap_or_else(|| panic!("best-effort never frozen:\n{}", d.log_text()));
    println!(
        "best-effort frozen {:.0} ms after the latency-critical process started (NVML sample 100 ms, period 100 ms)",
        reaction.as_secs_f64() * 1000.0
    );
    // One sample to see it (the new scenario is read at the next sample) plus one period.
    assert!(reaction <= Duration::from_millis(600), "took {reaction:?}");
    std::thread::sleep(Duration::from_secs(2));
    let s = shares(&pids, Duration::from_secs(3));
    println!(
        "while latency-critical runs: best-effort {:.1} %, latency-critical {:.1} %",
        s[0], s[1]
    );
    assert!(s[0] <= 5.0, "best-effort still ran {:.1} %", s[0]);
    assert!(s[1] >= 80.0, "latency-critical got only {:.1} %", s[1]);
}
