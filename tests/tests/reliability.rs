//! Faults: the daemon killed while processes allocate, unusable state directories and bpffs,
//! corrupted stored limits, a cgroup removed while tracked, processes forking and exiting in the
//! middle of allocating. Real gpud, real kernel programs, the FUSE fake NVIDIA device (its own
//! bookkeeping is the ground truth), real cgroups.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use gpud_api::CgroupRecord;
use gpud_tests::{Bus, Cgroup, Daemon, RmProcess, TempDir, eventually, fakenv::FakeNv, gpud_bin};

const MIB: u64 = 1 << 20;

/// The harness's daemon config on `ctl`, kept pinned across restarts, killing at a crossing,
/// NVML off, then `extra`.
fn config(dir: &Path, ctl: &Path, extra: &str) -> PathBuf {
    let p = gpud_tests::write_config(dir, &[ctl], "auto");
    let text = std::fs::read_to_string(&p).expect("read config")
        + "\n[enforcement]\nreact_action = \"kill\"\n\n[nvml]\nenabled = false\n"
        + extra;
    std::fs::write(&p, text).expect("write config");
    p
}

fn fake(dir: &TempDir) -> Option<FakeNv> {
    gpud_tests::fake_device(dir, 1)
}

/// Bytes of video memory the fake driver holds for these processes.
fn truth(fake: &FakeNv, pids: &[u32]) -> u64 {
    fake.snapshot()
        .memory()
        .filter(|o| pids.contains(&o.pid))
        .map(|o| o.bytes)
        .sum()
}

async fn record(d: &Daemon, path: &str) -> Option<CgroupRecord> {
    let (_c, p) = d.proxy().await;
    p.get_cgroup(path).await.ok()
}

/// Waits until gpud's figure for `path` equals `want`; panics with both otherwise.
async fn expect_bytes(d: &Daemon, path: &str, want: u64) {
    let ok = eventually(Duration::from_secs(8), || async {
        let r = record(d, path).await?;
        (r.memory_current.get("all").copied().unwrap_or(0) == want).then_some(())
    })
    .await;
    if ok.is_none() {
        let have = record(d, path).await.map(|r| r.memory_current);
        panic!(
            "{path}: gpud says {have:?}, the driver holds {want}\n{}",
            d.log_text()
        );
    }
}

/// Entries of a map gpud pinned under `<bpffs>/gpud/v<ABI>/`.
fn pinned_entries(bpffs: &Path, map: &str) -> usize {
    let path = bpffs
        .join("gpud")
        .join(format!("v{}", gpud_common::ABI_VERSION))
        .join(map);
    let m = libbpf_rs::MapHandle::from_pinned_path(&path)
        .unwrap_or_else(|e| panic!("open pinned {}: {e}", path.display()));
    libbpf_rs::MapCore::keys(&m).count()
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_of_the_daemon_loses_no_limit_and_no_byte() {
    let dir = TempDir::new("rel-sigkill");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let cfg = config(dir.path(), &ctl, "");
    let mut daemon = Daemon::start(&cfg, &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;

    let limited = Cgroup::new("rel-limited");
    let free = Cgroup::new("rel-free");
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from("16Mi"))]);
    proxy
        .set_limits(&limited.rel, "all", limits)
        .await
        .expect("SetLimits");
    let before = proxy.list_limits().await.expect("ListLimits");

    let mut pa = RmProcess::spawn(Some(&limited.dir), &ctl);
    let ca = pa.handle("client");
    let da = pa.handle(&format!("device {ca} 0"));
    pa.ok(&format!("alloc {ca} {da} {} nvos64", 8 * MIB));
    let mut pb = RmProcess::spawn(Some(&free.dir), &ctl);
    let cb = pb.handle("client");
    let db = pb.handle(&format!("device {cb} 0"));
    pb.ok(&format!("alloc {cb} {db} {} nvos64", 4 * MIB));
    let big = pb.handle(&format!("alloc {cb} {db} {} nvos64", 6 * MIB));
    expect_bytes(&daemon, &limited.rel, 8 * MIB).await;
    expect_bytes(&daemon, &free.rel, 10 * MIB).await;

    // The daemon dies mid-burst: pb keeps allocating while it is killed.
    for _ in 0..5 {
        pb.ok(&format!("alloc {cb} {db} {} nvos64", MIB));
    }
    daemon.signal(libc::SIGKILL);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while daemon.running() {
        assert!(
            std::time::Instant::now() < deadline,
            "gpud survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // While it is down the pinned programs go on: frees, a whole process's exit, and the
    // limit, enforced in the kernel (the crossing allocator dies before its ioctl returns).
    pb.ok(&format!("free {cb} {big}"));
    pb.ok(&format!("alloc {cb} {db} {} nvos64", 2 * MIB));
    let mut pc = RmProcess::spawn(Some(&free.dir), &ctl);
    let cc = pc.handle("client");
    let dc = pc.handle(&format!("device {cc} 0"));
    pc.ok(&format!("alloc {cc} {dc} {} nvos64", 4 * MIB));
    let pc_pid = pc.pid;
    assert_eq!(pc.finish(), Some(0));
    let answer = pa.try_cmd(&format!("alloc {ca} {da} {} nvos64", 10 * MIB));
    assert!(
        answer.is_none(),
        "the limit must hold while gpud is down: {answer:?}"
    );
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(pa.wait().signal(), Some(libc::SIGKILL));
    // The fake releases what the dead processes held once their files are closed.
    let released = fake.wait(Duration::from_secs(5), |s| {
        !s.memory().any(|o| o.pid == pa.pid || o.pid == pc_pid)
    });
    assert!(released.is_ok(), "the fake kept memory of dead processes");

    // Restarted on the same bpffs and state: the limit is there, and the figures are the
    // driver's, to the byte.
    let daemon = Daemon::start(&cfg, &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;
    assert_eq!(proxy.list_limits().await.expect("ListLimits"), before);
    expect_bytes(&daemon, &limited.rel, truth(&fake, &[pa.pid])).await;
    expect_bytes(&daemon, &free.rel, truth(&fake, &[pb.pid])).await;
    // 1 MiB allocations round up to the fake's 2 MiB pages.
    assert_eq!(truth(&fake, &[pb.pid]), (4 + 5 * 2 + 2) * MIB);
    let stats = proxy.get_kernel_stats().await.expect("stats");
    assert!(stats["limit_crossings"] >= 1, "{stats:?}");

    // Still enforced after the restart, by the same kernel state.
    let mut pd = RmProcess::spawn(Some(&limited.dir), &ctl);
    let cd = pd.handle("client");
    let dd = pd.handle(&format!("device {cd} 0"));
    let answer = pd.try_cmd(&format!("alloc {cd} {dd} {} nvos64", 20 * MIB));
    assert!(answer.is_none(), "enforced after restart: {answer:?}");
    assert_eq!(pd.wait().signal(), Some(libc::SIGKILL));

    // Nothing of the dead processes is left in the kernel's object table.
    assert_eq!(pb.finish(), Some(0));
    let bpffs = dir.path().join("bpffs");
    let clean = eventually(Duration::from_secs(8), || async {
        (pinned_entries(&bpffs, gpud_common::maps::OBJECTS) == 0).then_some(())
    })
    .await;
    assert!(
        clean.is_some(),
        "{} OBJECTS entries left\n{}",
        pinned_entries(&bpffs, gpud_common::maps::OBJECTS),
        daemon.log_text()
    );
    expect_bytes(&daemon, &free.rel, 0).await;
}

/// `gpud --config CFG` run until it exits (it must not start): (exit code, stderr).
fn run_to_exit(cfg: &Path) -> (Option<i32>, String) {
    let out = Command::new(gpud_bin())
        .arg("--config")
        .arg(cfg)
        .args(["--bus-address", "unix:path=/nonexistent/bus"])
        .output()
        .expect("run gpud");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_stored_limits_are_refused_or_set_aside_as_configured() {
    let dir = TempDir::new("rel-corrupt");
    let standin = dir.path().join("standin");
    std::fs::write(&standin, "").expect("stand-in");
    let state = dir.path().join("state");
    let stored = state.join("limits.json");
    let refuse = dir.path().join("refuse.toml");
    std::fs::write(
        &refuse,
        std::fs::read_to_string(config(dir.path(), &standin, ""))
            .expect("config")
            .replace(
                "log = \"gpud=debug\"",
                "log = \"gpud=debug\"\non_corrupt_state = \"refuse\"",
            ),
    )
    .expect("write refuse config");
    for (what, content) in [
        (
            "truncated",
            "{\"version\": 1, \"limits\": [{\"cgroup\": \"/a\"",
        ),
        ("garbage", "\u{0}\u{1}not json at all\u{ff}"),
        ("wrong schema", "{\"limits\": {\"/a\": 5}}"),
    ] {
        std::fs::create_dir_all(&state).expect("state dir");
        std::fs::write(&stored, content).expect("corrupt file");
        let (code, err) = run_to_exit(&refuse);
        assert_eq!(code, Some(78), "{what}: {err}");
        assert!(
            err.contains(&stored.display().to_string()) && err.contains("on_corrupt_state"),
            "{what}: {err}"
        );
        assert_eq!(
            std::fs::read_to_string(&stored).expect("left in place"),
            content,
            "{what}"
        );
    }

    // start-empty (the default): set aside, no limits, both names in the log.
    let bus = Bus::start();
    let daemon = Daemon::start(&config(dir.path(), &standin, ""), &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;
    assert!(proxy.list_limits().await.expect("ListLimits").is_empty());
    assert!(!stored.exists(), "moved aside");
    let aside: Vec<String> = std::fs::read_dir(&state)
        .expect("state dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("limits.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let log = daemon.log_text();
    assert!(
        log.contains("kept aside") && log.contains(&aside[0]),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unusable_state_directory_or_bpffs_is_a_clear_error() {
    let dir = TempDir::new("rel-dirs");
    let standin = dir.path().join("standin");
    std::fs::write(&standin, "").expect("stand-in");
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, "").expect("file");

    // State directory where a regular file is: refused before anything is attached.
    let cfg = config(dir.path(), &standin, "");
    let text = std::fs::read_to_string(&cfg).expect("config");
    let bad_state = dir.path().join("bad-state.toml");
    std::fs::write(
        &bad_state,
        text.replace(
            &format!("state_dir = \"{}\"", dir.path().join("state").display()),
            &format!("state_dir = \"{}\"", blocker.join("state").display()),
        ),
    )
    .expect("config");
    let (code, err) = run_to_exit(&bad_state);
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("state directory") && err.contains(&blocker.display().to_string()),
        "{err}"
    );

    // bpffs under a regular file: a clear error naming it.
    let bad_bpffs = dir.path().join("bad-bpffs.toml");
    std::fs::write(
        &bad_bpffs,
        text.replace(
            &format!("bpffs = \"{}\"", dir.path().join("bpffs").display()),
            &format!("bpffs = \"{}\"", blocker.join("bpf").display()),
        ),
    )
    .expect("config");
    let (code, err) = run_to_exit(&bad_bpffs);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains(&blocker.display().to_string()), "{err}");

    // A state directory that turns read-only while running: SetLimits fails with a typed
    // error and nothing changes, in the store or in the kernel.
    let bus = Bus::start();
    let daemon = Daemon::start(&cfg, &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;
    let cg = Cgroup::new("rel-ro");
    let state = dir.path().join("state");
    let mount = |args: &[&str]| {
        let ok = Command::new("mount")
            .args(args)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mount {args:?}");
    };
    let s = state.display().to_string();
    mount(&["--bind", &s, &s]);
    mount(&["-o", "remount,bind,ro", &s]);
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from("8Mi"))]);
    let e = proxy
        .set_limits(&cg.rel, "all", limits)
        .await
        .expect_err("a read-only state directory must fail SetLimits");
    let _ = Command::new("umount").arg(&s).status();
    assert!(
        e.to_string().contains("dev.gpud.Error") && e.to_string().contains("limits.json"),
        "{e}"
    );
    assert!(proxy.list_limits().await.expect("ListLimits").is_empty());
    let rec = proxy.get_cgroup(&cg.rel).await.expect("GetCgroup");
    assert!(rec.memory_max.is_empty(), "kernel limit applied: {rec:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn removed_cgroups_and_mid_allocation_forks_and_exits_leave_nothing_behind() {
    let dir = TempDir::new("rel-churn");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let daemon = Daemon::start(&config(dir.path(), &ctl, ""), &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;
    let bpffs = dir.path().join("bpffs");

    // A cgroup with a limit and memory is emptied and removed while tracked.
    let doomed = Cgroup::new("rel-doomed");
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from("64Mi"))]);
    proxy
        .set_limits(&doomed.rel, "all", limits)
        .await
        .expect("SetLimits");
    let mut p = RmProcess::spawn(Some(&doomed.dir), &ctl);
    let c = p.handle("client");
    let d = p.handle(&format!("device {c} 0"));
    p.ok(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    expect_bytes(&daemon, &doomed.rel, 4 * MIB).await;
    let _ = p.finish();
    let rel = doomed.rel.clone();
    drop(doomed);
    let forgotten = eventually(Duration::from_secs(8), || async {
        let listed = proxy.list_cgroups().await.ok()?;
        let limits = proxy.list_limits().await.ok()?;
        (!listed.iter().any(|c| c.path == rel) && limits.is_empty()).then_some(())
    })
    .await;
    assert!(
        forgotten.is_some(),
        "removed cgroup still listed\n{}",
        daemon.log_text()
    );

    // Fork mid-allocation: the child allocates on the shared file while the parent has
    // allocated and freed; the child exits in the middle of a parallel burst.
    let cg = Cgroup::new("rel-fork");
    let mut p = RmProcess::spawn(Some(&cg.dir), &ctl);
    let c = p.handle("client");
    let d = p.handle(&format!("device {c} 0"));
    let h = p.handle(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    let child = p.cmd("fork");
    assert_eq!(child["ok"], true, "{child}");
    p.ok(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    let burst = p.cmd(&format!("parallel 8 {c} {d} {}", MIB));
    assert_eq!(burst["ok"], true, "{burst}");
    p.ok(&format!("free {c} {h}"));
    let exit = p.cmd("exit 0");
    assert_eq!(exit["ok"], true, "{exit}");
    let reaped = p.recv();
    assert!(reaped.get("reaped").is_some(), "{reaped}");
    // The parent still holds the file: what the child allocated stays (it belongs to the
    // client), exactly as the driver says.
    let held = truth(&fake, &[p.pid, child["pid"].as_u64().unwrap_or(0) as u32]);
    expect_bytes(&daemon, &cg.rel, held).await;
    // 1 MiB allocations round up to the fake's 2 MiB pages.
    assert_eq!(held, (4 + 8 * 2) * MIB);
    let _ = p.finish();
    expect_bytes(&daemon, &cg.rel, 0).await;

    let clean = eventually(Duration::from_secs(8), || async {
        (pinned_entries(&bpffs, gpud_common::maps::OBJECTS) == 0
            && pinned_entries(&bpffs, gpud_common::maps::PENDING) == 0)
            .then_some(())
    })
    .await;
    assert!(
        clean.is_some(),
        "leftovers: OBJECTS {} PENDING {}",
        pinned_entries(&bpffs, gpud_common::maps::OBJECTS),
        pinned_entries(&bpffs, gpud_common::maps::PENDING)
    );
    assert!(
        proxy
            .list_processes()
            .await
            .expect("ListProcesses")
            .is_empty(),
        "no tracked process is left"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nvml_failing_mid_run_stops_compute_control_cleanly_and_memory_limits_stay() {
    let dir = TempDir::new("rel-nvml");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let lib_dir = dir.path().join("nvml");
    let lib = gpud_tests::install_fake_nvml(&lib_dir);
    let throttled_cg = Cgroup::new("rel-nvml-burn");
    let mut burner = gpud_tests::spawn_in_cgroup(&throttled_cg, "while :; do :; done");
    let scenario = |fail: bool| {
        let mut v = serde_json::json!({
            "driver_version": "580.159.04", "cuda_version": 13000,
            "gpus": [ { "uuid": "GPU-00000000-1111-2222-3333-444444444444",
                        "name": "Simulated GPU", "pci_bus_id": "00000000:00:06.0",
                        "memory_total": 80u64 << 30 } ],
            "processes": [ { "pid": burner.id(), "gpu": 0, "memory": 1u64 << 30 } ],
        });
        if fail {
            // GPU lost (NVML_ERROR_GPU_IS_LOST) on every process query.
            v["fail"] = serde_json::json!({ "nvmlDeviceGetComputeRunningProcesses_v3": 15 });
        }
        gpud_tests::write_nvml_scenario(&lib_dir, &v);
    };
    scenario(false);
    let extra = format!(
        "\n[nvml]\nenabled = true\nlibrary_path = \"{}\"\nsample_interval_ms = 100\nretry_interval_secs = 1\n",
        lib.display()
    );
    let cfg = config(dir.path(), &ctl, "").with_file_name("nvml.toml");
    std::fs::write(
        &cfg,
        std::fs::read_to_string(config(dir.path(), &ctl, ""))
            .expect("config")
            .replace("[nvml]\nenabled = false\n", &extra),
    )
    .expect("config");
    let bus = Bus::start();
    let daemon = Daemon::start(&cfg, &bus.address).await;
    let (_c, proxy) = daemon.proxy().await;

    let cap = BTreeMap::from([("compute_max", zbus::Variant::from(20u32))]);
    proxy
        .set_limits(&throttled_cg.rel, "0", cap)
        .await
        .expect("SetLimits compute_max");
    let throttling = eventually(Duration::from_secs(10), || async {
        let c = proxy.list_compute().await.ok()?;
        c.iter()
            .any(|r| r.cgroup == throttled_cg.rel && r.throttled_usec > 0)
            .then_some(())
    })
    .await;
    assert!(
        throttling.is_some(),
        "never throttled:\n{}",
        daemon.log_text()
    );
    let mem_cg = Cgroup::new("rel-nvml-mem");
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from("8Mi"))]);
    proxy
        .set_limits(&mem_cg.rel, "all", limits)
        .await
        .expect("SetLimits memory_max");

    // NVML fails: reported, and the controller lets go of the cgroup (no frozen leftovers).
    scenario(true);
    let down = eventually(Duration::from_secs(10), || async {
        let available = proxy.nvml_available().await.ok()?;
        (!available).then_some(())
    })
    .await;
    assert!(
        down.is_some(),
        "failure not reported:\n{}",
        daemon.log_text()
    );
    let freeze = throttled_cg.dir.join("cgroup.freeze");
    let thawed = eventually(Duration::from_secs(5), || async {
        (std::fs::read_to_string(&freeze).ok()?.trim() == "0").then_some(())
    })
    .await;
    assert!(thawed.is_some(), "left frozen:\n{}", daemon.log_text());
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            std::fs::read_to_string(&freeze)
                .expect("cgroup.freeze")
                .trim(),
            "0",
            "frozen again while NVML is down"
        );
    }

    // Memory accounting and limits do not depend on NVML.
    let mut p = RmProcess::spawn(Some(&mem_cg.dir), &ctl);
    let c = p.handle("client");
    let d = p.handle(&format!("device {c} 0"));
    p.ok(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    expect_bytes(&daemon, &mem_cg.rel, truth(&fake, &[p.pid])).await;
    let answer = p.try_cmd(&format!("alloc {c} {d} {} nvos64", 8 * MIB));
    assert!(answer.is_none(), "limit enforced without NVML: {answer:?}");

    // NVML is back: control resumes.
    let before = proxy
        .list_compute()
        .await
        .expect("ListCompute")
        .iter()
        .find(|r| r.cgroup == throttled_cg.rel)
        .map_or(0, |r| r.throttled_usec);
    scenario(false);
    let resumed = eventually(Duration::from_secs(15), || async {
        let c = proxy.list_compute().await.ok()?;
        c.iter()
            .any(|r| r.cgroup == throttled_cg.rel && r.throttled_usec > before)
            .then_some(())
    })
    .await;
    assert!(
        resumed.is_some(),
        "control did not resume:\n{}",
        daemon.log_text()
    );
    let _ = burner.kill();
    let _ = burner.wait();
}

/// `probes.events_ring_kib` sizes the pinned event ring; a restart with another size adopts the
/// pinned ring as it is and says so.
#[tokio::test(flavor = "multi_thread")]
async fn event_ring_size_follows_the_configuration() {
    let dir = TempDir::new("rel-ring");
    let standin = dir.path().join("standin");
    std::fs::write(&standin, "").expect("stand-in");
    let with_ring = |kib: u32| {
        let p = config(dir.path(), &standin, "");
        let text = std::fs::read_to_string(&p).expect("read config").replace(
            "[probes]\n",
            &format!("[probes]\nevents_ring_kib = {kib}\n"),
        );
        std::fs::write(&p, text).expect("write config");
        p
    };
    let ring = dir
        .path()
        .join("bpffs/gpud")
        .join(format!("v{}", gpud_common::ABI_VERSION))
        .join(gpud_common::maps::EVENTS);
    let ring_bytes = || {
        let m = libbpf_rs::MapHandle::from_pinned_path(&ring)
            .unwrap_or_else(|e| panic!("open pinned {}: {e}", ring.display()));
        libbpf_rs::MapCore::max_entries(&m)
    };
    let bus = Bus::start();
    let mut daemon = Daemon::start(&with_ring(2048), &bus.address).await;
    assert_eq!(ring_bytes(), 2048 * 1024, "{}", daemon.log_text());
    assert_eq!(daemon.stop(), Some(0));

    let daemon = Daemon::start(&with_ring(256), &bus.address).await;
    assert_eq!(ring_bytes(), 2048 * 1024, "the pinned ring is adopted");
    let log = daemon.log_text();
    assert!(
        log.contains("keeps its size") && log.contains("pinned_kib=2048"),
        "{log}"
    );
}
