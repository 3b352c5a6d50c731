//! NVML through the real nvml-wrapper code path: the real gpud binary loads the fake
//! libnvidia-ml (tests/fake-nvml, NVML's C ABI) by `nvml.library_path`; real processes in real
//! cgroups are the GPU users, with the simulated GPU measuring their real CPU use.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use gpud::api::model::NvmlUsageRecord;
use gpud_tests::{Bus, Cgroup, Daemon, TempDir, bin_dir, eventually, gpudctl_bin};
use serde_json::json;

const MIB: u64 = 1 << 20;

/// The fake library, copied to `dir/lib/libnvidia-ml.so.1` (its scenario lives beside it).
fn install_fake(lib_dir: &Path) -> PathBuf {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    let dst = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(bin_dir().join("libnvidia_ml_fake.so"), &dst)
        .expect("copy the fake NVML library (is fake-nvml built?)");
    dst
}

fn scenario(lib_dir: &Path, v: &serde_json::Value) {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    // Write then rename, so the fake never reads half a file.
    let tmp = lib_dir.join("fake-nvml.json.tmp");
    std::fs::write(&tmp, v.to_string()).expect("scenario");
    std::fs::rename(&tmp, lib_dir.join("fake-nvml.json")).expect("scenario");
}

fn config(dir: &Path, lib: &Path) -> PathBuf {
    let text = format!(
        r#"[daemon]
state_dir = "{state}"
log = "gpud=debug"

[probes]
bpffs = "{bpffs}"
keep_pinned = false

[attribution]
sweep_interval_secs = 1
rescan_interval_secs = 0

[nvml]
library_path = "{lib}"
sample_interval_ms = 200
retry_interval_secs = 1
"#,
        state = dir.join("state").display(),
        bpffs = dir.join("bpffs").display(),
        lib = lib.display(),
    );
    let p = dir.join("gpud.toml");
    std::fs::write(&p, text).expect("config");
    p
}

fn two_gpus(processes: serde_json::Value) -> serde_json::Value {
    json!({
        "driver_version": "580.159.04",
        "cuda_version": 13000,
        "gpus": [
            { "uuid": "GPU-00000000-1111-2222-3333-444444444444", "name": "Fake H100",
              "pci_bus_id": "00000000:00:06.0", "memory_total": 80u64 << 30 },
            { "uuid": "GPU-55555555-6666-7777-8888-999999999999", "name": "Fake A100",
              "pci_bus_id": "00000000:00:07.0", "memory_total": 40u64 << 30,
              "mig": [
                { "uuid": "MIG-aaaaaaaa-0000-0000-0000-000000000001", "name": "Fake A100 MIG 3g.20gb",
                  "memory_total": 20u64 << 30 },
                { "uuid": "MIG-aaaaaaaa-0000-0000-0000-000000000002", "name": "Fake A100 MIG 3g.20gb",
                  "memory_total": 20u64 << 30 }
              ] }
        ],
        "processes": processes,
    })
}

/// A process in `cg` running `script` under sh.
fn spawn_in(cg: &Cgroup, script: &str) -> Child {
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec sh -c '{script}'",
            cg.dir.display()
        ))
        .spawn()
        .expect("spawn");
    // Wait until it is in its cgroup.
    for _ in 0..100 {
        let procs = std::fs::read_to_string(cg.dir.join("cgroup.procs")).unwrap_or_default();
        if procs.lines().any(|l| l.trim() == child.id().to_string()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

async fn usage(d: &Daemon) -> Vec<NvmlUsageRecord> {
    let (_c, p) = d.proxy().await;
    p.list_nvml_usage().await.expect("ListNvmlUsage")
}

fn find<'a>(u: &'a [NvmlUsageRecord], cg: &Cgroup, gpu: u32) -> Option<&'a NvmlUsageRecord> {
    u.iter().find(|r| r.cgroup == cg.rel && r.gpu == gpu)
}

async fn nvml_status(d: &Daemon) -> (bool, String) {
    // A fresh proxy each time: these properties change without a signal.
    let (_c, p) = d.proxy().await;
    (
        p.nvml_available().await.expect("NvmlAvailable"),
        p.nvml_status().await.expect("NvmlStatus"),
    )
}

fn gpudctl(bus: &str, args: &[&str]) -> String {
    let out = Command::new(gpudctl_bin())
        .args(["--bus-address", bus])
        .args(args)
        .output()
        .expect("gpudctl");
    assert!(out.status.success(), "gpudctl {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Kill(Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn inventory_and_per_cgroup_usage_follow_real_processes_and_freezing() {
    let dir = TempDir::new("nvml-usage");
    let lib_dir = dir.path().join("lib");
    let lib = install_fake(&lib_dir);
    let (busy_cg, idle_cg, fixed_cg) = (
        Cgroup::new("nvml-busy"),
        Cgroup::new("nvml-idle"),
        Cgroup::new("nvml-fixed"),
    );
    let busy = spawn_in(&busy_cg, "while :; do :; done");
    let idle = spawn_in(&idle_cg, "sleep 600");
    let fixed = spawn_in(&fixed_cg, "sleep 600");
    let procs = json!([
        { "pid": busy.id(), "gpu": 0, "memory": 1024 * MIB },
        { "pid": idle.id(), "gpu": 0, "memory": 512 * MIB },
        { "pid": fixed.id(), "gpu": 1, "memory": 256 * MIB, "sm_util": 40, "enc_util": 7,
          "kind": "graphics" },
    ]);
    let _kill = Kill(vec![busy, idle, fixed]);
    scenario(&lib_dir, &two_gpus(procs));
    let bus = Bus::start();
    let d = Daemon::start(&config(dir.path(), &lib), &bus.address).await;

    let ready = eventually(Duration::from_secs(10), || async {
        nvml_status(&d).await.0.then_some(())
    })
    .await;
    assert!(ready.is_some(), "NVML never available:\n{}", d.log_text());

    // Inventory, MIG devices as devices of their own, on D-Bus and in gpudctl.
    let (_c, p) = d.proxy().await;
    let gpus = p.list_gpus().await.expect("ListGpus");
    let ids: Vec<(u32, u32, &str)> = gpus
        .iter()
        .map(|g| (g.index, g.mig, g.uuid.as_str()))
        .collect();
    assert_eq!(ids.len(), 4, "{gpus:?}");
    assert_eq!(gpus[0].name, "Fake H100");
    assert_eq!(gpus[0].memory_total, 80 << 30);
    assert_eq!(gpus[0].memory_used, 1536 * MIB);
    assert_eq!(gpus[0].driver_version, "580.159.04");
    assert_eq!(gpus[0].cuda_version, "13.0");
    assert_eq!(gpus[0].pci_bus_id, "00000000:00:06.0");
    assert_eq!(
        (gpus[0].mig_mode.as_str(), gpus[1].mig_mode.as_str()),
        ("disabled", "enabled")
    );
    assert_eq!((gpus[2].index, gpus[2].mig), (1, 0));
    assert_eq!(gpus[3].uuid, "MIG-aaaaaaaa-0000-0000-0000-000000000002");
    let status = gpudctl(&bus.address, &["status"]);
    for needle in [
        "NVML:             available",
        "Fake H100",
        "Fake A100 MIG 3g.20gb",
        "MIG 1/1",
    ] {
        assert!(status.contains(needle), "{needle:?} not in:\n{status}");
    }
    let intro = Command::new("busctl")
        .args(["--address", &bus.address, "introspect", "dev.gpud.Daemon1"])
        .arg("/dev/gpud/Daemon1/gpu/1/mig/1")
        .output()
        .expect("busctl");
    let intro = String::from_utf8_lossy(&intro.stdout);
    assert!(
        intro.contains("dev.gpud.Gpu1")
            && intro.contains("MIG-aaaaaaaa-0000-0000-0000-000000000002"),
        "{intro}"
    );

    // Per cgroup: memory as declared; utilization from real CPU use.
    let seen = eventually(Duration::from_secs(10), || async {
        let u = usage(&d).await;
        let (b, i, f) = (
            find(&u, &busy_cg, 0)?,
            find(&u, &idle_cg, 0)?,
            find(&u, &fixed_cg, 1)?,
        );
        (b.sm_util >= 50 && i.sm_util <= 10 && f.sm_util == 40).then(|| u.clone())
    })
    .await;
    let Some(u) = seen else {
        panic!(
            "usage never matched: {:?}\n{}",
            usage(&d).await,
            d.log_text()
        );
    };
    assert_eq!(
        find(&u, &busy_cg, 0).map(|r| r.nvml_memory_bytes),
        Some(1024 * MIB)
    );
    assert_eq!(
        find(&u, &idle_cg, 0).map(|r| r.nvml_memory_bytes),
        Some(512 * MIB)
    );
    assert_eq!(
        find(&u, &fixed_cg, 1).map(|r| (r.nvml_memory_bytes, r.enc_util)),
        Some((256 * MIB, 7))
    );
    assert_eq!(find(&u, &busy_cg, 0).map(|r| r.cgroup_id != 0), Some(true));

    // gpudctl list --json joins NVML's figures to each cgroup.
    let list: serde_json::Value =
        serde_json::from_str(&gpudctl(&bus.address, &["list", "--json"])).expect("list JSON");
    let entry = list
        .as_array()
        .and_then(|a| a.iter().find(|e| e["path"] == idle_cg.rel.as_str()))
        .unwrap_or_else(|| panic!("{} not listed: {list}", idle_cg.rel));
    assert_eq!(entry["nvml"]["0"]["memory_bytes"], 512 * MIB, "{entry}");

    // Closed loop: freezing the busy cgroup stops its CPU, so its GPU utilization drops.
    std::fs::write(busy_cg.dir.join("cgroup.freeze"), "1").expect("freeze");
    let dropped = eventually(Duration::from_secs(10), || async {
        let u = usage(&d).await;
        find(&u, &busy_cg, 0).filter(|r| r.sm_util <= 5).map(|_| ())
    })
    .await;
    std::fs::write(busy_cg.dir.join("cgroup.freeze"), "0").expect("thaw");
    assert!(
        dropped.is_some(),
        "frozen process still used the simulated GPU"
    );

    // No sample is counted twice: every call asked for samples newer than it had seen.
    let log = std::fs::read_to_string(lib_dir.join("fake-nvml-samples.log")).expect("sample log");
    let mut newest: std::collections::HashMap<u64, u64> = Default::default();
    let mut calls = 0;
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("log line");
        let gpu = v["gpu"].as_u64().unwrap_or(0);
        let last_seen = v["last_seen"].as_u64().unwrap_or(0);
        if let Some(prev) = newest.get(&gpu) {
            assert!(
                last_seen >= *prev,
                "asked again for samples up to {prev}: {line}"
            );
        }
        if let Some(max) = v["returned"]
            .as_array()
            .and_then(|r| r.iter().filter_map(|t| t.as_u64()).max())
        {
            newest.insert(gpu, max);
        }
        calls += 1;
    }
    assert!(calls >= 3, "only {calls} sampling calls");
}

#[tokio::test(flavor = "multi_thread")]
async fn unavailable_library_is_reported_then_recovered_and_errors_degrade_and_recover() {
    let dir = TempDir::new("nvml-recover");
    let lib_dir = dir.path().join("lib");
    let lib = lib_dir.join("libnvidia-ml.so.1");
    let bus = Bus::start();
    let d = Daemon::start(&config(dir.path(), &lib), &bus.address).await;

    // No library: the daemon serves D-Bus and says why.
    let (avail, why) = nvml_status(&d).await;
    assert!(!avail);
    let said = eventually(Duration::from_secs(5), || async {
        let (_, why) = nvml_status(&d).await;
        why.contains("cannot load NVML").then_some(why)
    })
    .await;
    assert!(said.is_some(), "status: {why}");
    let status = gpudctl(&bus.address, &["status"]);
    assert!(status.contains("cannot load NVML"), "{status}");

    // The library appears: recovered within the retry interval.
    scenario(&lib_dir, &two_gpus(json!([])));
    install_fake(&lib_dir);
    let up = eventually(Duration::from_secs(10), || async {
        nvml_status(&d).await.0.then_some(())
    })
    .await;
    assert!(up.is_some(), "not recovered:\n{}", d.log_text());
    let (_c, p) = d.proxy().await;
    assert_eq!(p.list_gpus().await.expect("ListGpus").len(), 4);

    // An NVML call fails (GPU lost): unavailable with the reason, and back once it answers.
    let mut s = two_gpus(json!([]));
    s["fail"] = json!({ "nvmlDeviceGetComputeRunningProcesses_v3": 15 });
    scenario(&lib_dir, &s);
    let down = eventually(Duration::from_secs(10), || async {
        let (a, why) = nvml_status(&d).await;
        (!a && why.contains("compute processes")).then_some(why)
    })
    .await;
    assert!(down.is_some(), "failure not reported:\n{}", d.log_text());
    assert!(p.list_gpus().await.is_ok(), "the daemon still answers");
    scenario(&lib_dir, &two_gpus(json!([])));
    let back = eventually(Duration::from_secs(10), || async {
        nvml_status(&d).await.0.then_some(())
    })
    .await;
    assert!(back.is_some(), "not recovered after the failure");

    // Initialization failing (driver not loaded) is reported the same way.
    // A critical Xid error on GPU 1 is counted there.
    let mut s = two_gpus(json!([]));
    s["xid"] = json!([{ "gpu": 1, "xid": 79 }]);
    scenario(&lib_dir, &s);
    let xid = eventually(Duration::from_secs(10), || async {
        let gpus = p.list_gpus().await.ok()?;
        gpus.iter()
            .find(|g| g.index == 1 && g.mig == u32::MAX && g.xid_errors == 1)
            .map(|_| ())
    })
    .await;
    assert!(xid.is_some(), "Xid not counted:\n{}", d.log_text());
    assert!(d.log_text().contains("critical Xid error"));

    // Force a re-init: make the current handle fail first.
    let mut f = two_gpus(json!([]));
    f["fail"] = json!({ "nvmlDeviceGetCount_v2": 9 });
    f["init_error"] = json!(9);
    scenario(&lib_dir, &f);
    let driver = eventually(Duration::from_secs(10), || async {
        let (a, why) = nvml_status(&d).await;
        (!a && why.to_lowercase().contains("driver")).then_some(why)
    })
    .await;
    assert!(
        driver.is_some(),
        "driver-not-loaded not reported:\n{}",
        d.log_text()
    );
}
