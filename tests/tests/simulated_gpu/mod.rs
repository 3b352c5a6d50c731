//! Shared by the compute-share tests and their benchmark: the simulated GPU (fake libnvidia-ml
//! with processes burning CPU in real cgroups), a gpud on it, and shares measured from the
//! processes' own CPU time.
#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Child,
    time::{Duration, Instant},
};

use gpud_tests::{Bus, Cgroup, Daemon, TempDir, TestConfig, eventually};
use serde_json::json;

pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub fn install_fake(lib_dir: &Path) -> PathBuf {
    gpud_tests::install_fake_nvml(lib_dir)
}

pub fn scenario(lib_dir: &Path, pids: &[u32]) {
    let processes: Vec<_> = pids
        .iter()
        .map(|p| json!({ "pid": p, "gpu": 0, "memory": 1u64 << 30 }))
        .collect();
    let v = json!({
        "driver_version": "580.159.04", "cuda_version": 13000,
        "gpus": [ { "uuid": "GPU-00000000-1111-2222-3333-444444444444", "name": "Simulated GPU",
                    "pci_bus_id": "00000000:00:06.0", "memory_total": 80u64 << 30 } ],
        "processes": processes,
    });
    gpud_tests::write_nvml_scenario(lib_dir, &v);
}

pub fn config(dir: &Path, lib: &Path) -> PathBuf {
    TestConfig::new(dir)
        .log("gpud=info")
        .nvml(lib)
        .set("nvml.sample_interval_ms", 100)
        .set("compute.period_ms", 100)
        .write()
}

/// A process burning one CPU in `cg`.
pub fn burner(cg: &Cgroup) -> Child {
    gpud_tests::spawn_in_cgroup(cg, "while :; do :; done")
}

pub fn runtime_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

/// Each process's share of one CPU (= of the simulated GPU) over `window`, in percent.
pub fn shares(pids: &[u32], window: Duration) -> Vec<f64> {
    let before: Vec<u64> = pids.iter().map(|p| runtime_ns(*p)).collect();
    let t = Instant::now();
    std::thread::sleep(window);
    let wall = t.elapsed().as_nanos() as f64;
    pids.iter()
        .zip(before)
        .map(|(p, b)| (runtime_ns(*p) - b) as f64 / wall * 100.0)
        .collect()
}

pub struct Procs(pub Vec<Child>);
impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub async fn set(d: &Daemon, cg: &Cgroup, limits: &[(&str, zbus::Variant<'_>)]) {
    let (_c, p) = d.proxy().await;
    let m: BTreeMap<&str, zbus::Variant<'_>> = limits
        .iter()
        .map(|(k, v)| (*k, v.try_clone().expect("clone")))
        .collect();
    p.set_limits(&cg.rel, "0", m).await.expect("SetLimits");
}

/// Whether this machine gives each burner (nearly) a whole CPU before gpud runs: the simulated
/// GPU's 100 % is one CPU, so a machine busy with other work cannot show the shares. Prints why
/// when it does not.
pub fn machine_is_quiet(pids: &[u32]) -> bool {
    let free = shares(pids, Duration::from_millis(1500));
    if free.iter().all(|s| *s >= 85.0) {
        return true;
    }
    eprintln!(
        "SKIPPED: the burners get only {free:.0?} % of a CPU each before any throttling (other \
         load on this machine); the closed-loop accuracy checks need a whole CPU per burner"
    );
    false
}

/// Starts gpud on the simulated GPU and waits until NVML reports the processes.
pub async fn start(dir: &TempDir, lib_dir: &Path, bus: &Bus, pids: &[u32]) -> Daemon {
    let lib = install_fake(lib_dir);
    scenario(lib_dir, pids);
    let d = Daemon::start(&config(dir.path(), &lib), &bus.address).await;
    let n = pids.len();
    let up = eventually(Duration::from_secs(10), || async {
        let (_c, p) = d.proxy().await;
        (p.list_nvml_usage().await.ok()?.len() >= n).then_some(())
    })
    .await;
    assert!(
        up.is_some(),
        "NVML never saw the processes:\n{}",
        d.log_text()
    );
    d
}
