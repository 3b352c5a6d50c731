//! Faults: the daemon killed while processes allocate, unusable state directories and bpffs,
//! corrupted stored limits, a cgroup removed while tracked, processes forking and exiting in the
//! middle of allocating. Real gpud, real kernel programs, the FUSE fake NVIDIA device (its own
//! bookkeeping is the ground truth), real cgroups.

use std::{collections::BTreeMap, path::Path, process::Command, time::Duration};

use gpud_tests::{
    Cgroup, Rig, RmProcess, TestConfig, eventually, gpud_bin, gpudctl_bin, one_gpu,
    scenario::{Fail, Process},
};

const MIB: u64 = 1 << 20;

/// These tests' daemon config: kept pinned across restarts, killing at a crossing, NVML off.
fn config(rig: &Rig) -> TestConfig {
    rig.config()
        .keep_pinned(true)
        .react_action("kill")
        .nvml_off()
}

/// Entries of a map gpud pinned in `pins` (`<bpffs>/gpud/v<ABI>/`).
fn pinned_entries(pins: &Path, map: &str) -> usize {
    let path = pins.join(map);
    let m = libbpf_rs::MapHandle::from_pinned_path(&path)
        .unwrap_or_else(|e| panic!("open pinned {}: {e}", path.display()));
    libbpf_rs::MapCore::keys(&m).count()
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_of_the_daemon_loses_no_limit_and_no_byte() {
    let Some(mut rig) = Rig::new("rel-sigkill").fake_device(1) else {
        return;
    };
    rig.start(config(&rig)).await;
    let ctl = rig.ctl();
    let (_c, proxy) = rig.proxy().await;

    let limited = Cgroup::new("rel-limited");
    let free = Cgroup::new("rel-free");
    rig.set_limit(&limited.rel, "all", "memory_max", "16Mi")
        .await;
    let before = proxy.list_limits().await.expect("ListLimits");

    let mut pa = RmProcess::spawn(Some(&limited.dir), &ctl);
    let (ca, da) = pa.client_device(0);
    pa.ok(&format!("alloc {ca} {da} {} nvos64", 8 * MIB));
    let mut pb = RmProcess::spawn(Some(&free.dir), &ctl);
    let (cb, db) = pb.client_device(0);
    pb.ok(&format!("alloc {cb} {db} {} nvos64", 4 * MIB));
    let big = pb.handle(&format!("alloc {cb} {db} {} nvos64", 6 * MIB));
    rig.expect_memory(&limited.rel, &[("all", 8 * MIB)]).await;
    rig.expect_memory(&free.rel, &[("all", 10 * MIB)]).await;

    // The daemon dies mid-burst: pb keeps allocating while it is killed.
    for _ in 0..5 {
        pb.ok(&format!("alloc {cb} {db} {} nvos64", MIB));
    }
    rig.signal(libc::SIGKILL);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while rig.running() {
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
    let (cc, dc) = pc.client_device(0);
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
    let released = rig.fake().wait(Duration::from_secs(5), |s| {
        !s.memory().any(|o| o.pid == pa.pid || o.pid == pc_pid)
    });
    assert!(released.is_ok(), "the fake kept memory of dead processes");

    // Restarted on the same bpffs and state: the limit is there, and the figures are the
    // driver's, to the byte.
    rig.restart().await;
    let (_c, proxy) = rig.proxy().await;
    assert_eq!(proxy.list_limits().await.expect("ListLimits"), before);
    let truth = |pids: &[u32]| rig.fake().snapshot().held_by(pids);
    rig.expect_memory(&limited.rel, &[("all", truth(&[pa.pid]))])
        .await;
    rig.expect_memory(&free.rel, &[("all", truth(&[pb.pid]))])
        .await;
    // 1 MiB allocations round up to the fake's 2 MiB pages.
    assert_eq!(truth(&[pb.pid]), (4 + 5 * 2 + 2) * MIB);
    let stats = proxy.get_kernel_stats().await.expect("stats");
    assert!(stats["limit_crossings"] >= 1, "{stats:?}");

    // Still enforced after the restart, by the same kernel state.
    let mut pd = RmProcess::spawn(Some(&limited.dir), &ctl);
    let (cd, dd) = pd.client_device(0);
    let answer = pd.try_cmd(&format!("alloc {cd} {dd} {} nvos64", 20 * MIB));
    assert!(answer.is_none(), "enforced after restart: {answer:?}");
    assert_eq!(pd.wait().signal(), Some(libc::SIGKILL));

    // Nothing of the dead processes is left in the kernel's object table.
    assert_eq!(pb.finish(), Some(0));
    let pins = rig.pins();
    let clean = eventually(Duration::from_secs(8), || async {
        (pinned_entries(&pins, gpud_common::maps::OBJECTS) == 0).then_some(())
    })
    .await;
    assert!(
        clean.is_some(),
        "{} OBJECTS entries left\n{}",
        pinned_entries(&pins, gpud_common::maps::OBJECTS),
        rig.log_text()
    );
    rig.expect_memory(&free.rel, &[("all", 0)]).await;
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
    let mut rig = Rig::new("rel-corrupt");
    let standin = rig.stand_in("standin");
    let state = rig.path().join("state");
    let stored = state.join("limits.json");
    let refuse = config(&rig)
        .extra_paths([&standin])
        .set("daemon.on_corrupt_state", "refuse")
        .write_as("refuse.toml");
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
    rig.start(config(&rig).extra_paths([&standin])).await;
    let (_c, proxy) = rig.proxy().await;
    assert!(proxy.list_limits().await.expect("ListLimits").is_empty());
    assert!(!stored.exists(), "moved aside");
    let aside: Vec<String> = std::fs::read_dir(&state)
        .expect("state dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("limits.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let log = rig.log_text();
    assert!(
        log.contains("kept aside") && log.contains(&aside[0]),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unusable_state_directory_or_bpffs_is_a_clear_error() {
    let mut rig = Rig::new("rel-dirs");
    let standin = rig.stand_in("standin");
    let blocker = rig.stand_in("a-file");

    // State directory where a regular file is: refused before anything is attached.
    let cfg = config(&rig).extra_paths([&standin]);
    let bad_state = cfg
        .clone()
        .set_path("daemon.state_dir", blocker.join("state"))
        .write_as("bad-state.toml");
    let (code, err) = run_to_exit(&bad_state);
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("state directory") && err.contains(&blocker.display().to_string()),
        "{err}"
    );

    // bpffs under a regular file: a clear error naming it.
    let bad_bpffs = cfg
        .clone()
        .set_path("probes.bpffs", blocker.join("bpf"))
        .write_as("bad-bpffs.toml");
    let (code, err) = run_to_exit(&bad_bpffs);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains(&blocker.display().to_string()), "{err}");

    // A state directory that turns read-only while running: SetLimits fails with a typed
    // error and nothing changes, in the store or in the kernel.
    rig.start(cfg).await;
    let (_c, proxy) = rig.proxy().await;
    let cg = Cgroup::new("rel-ro");
    let state = rig.path().join("state");
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
    let Some(mut rig) = Rig::new("rel-churn").fake_device(1) else {
        return;
    };
    rig.start(config(&rig)).await;
    let (fake, ctl) = (rig.fake(), rig.ctl());
    let (_c, proxy) = rig.proxy().await;
    let pins = rig.pins();

    // A cgroup with a limit and memory is emptied and removed while tracked.
    let doomed = Cgroup::new("rel-doomed");
    rig.set_limit(&doomed.rel, "all", "memory_max", "64Mi")
        .await;
    let mut p = RmProcess::spawn(Some(&doomed.dir), &ctl);
    let (c, d) = p.client_device(0);
    p.ok(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    rig.expect_memory(&doomed.rel, &[("all", 4 * MIB)]).await;
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
        rig.log_text()
    );

    // Fork mid-allocation: the child allocates on the shared file while the parent has
    // allocated and freed; the child exits in the middle of a parallel burst.
    let cg = Cgroup::new("rel-fork");
    let mut p = RmProcess::spawn(Some(&cg.dir), &ctl);
    let (c, d) = p.client_device(0);
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
    let held = fake
        .snapshot()
        .held_by(&[p.pid, child["pid"].as_u64().unwrap_or(0) as u32]);
    rig.expect_memory(&cg.rel, &[("all", held)]).await;
    // 1 MiB allocations round up to the fake's 2 MiB pages.
    assert_eq!(held, (4 + 8 * 2) * MIB);
    let _ = p.finish();
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;

    let clean = eventually(Duration::from_secs(8), || async {
        (pinned_entries(&pins, gpud_common::maps::OBJECTS) == 0).then_some(())
    })
    .await;
    assert!(
        clean.is_some(),
        "leftovers: OBJECTS {}",
        pinned_entries(&pins, gpud_common::maps::OBJECTS)
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
    let Some(mut rig) = Rig::new("rel-nvml").fake_device(1).map(Rig::fake_nvml) else {
        return;
    };
    let ctl = rig.ctl();
    let throttled_cg = Cgroup::new("rel-nvml-burn");
    let mut burner = gpud_tests::spawn_in_cgroup(&throttled_cg, "while :; do :; done");
    let scenario = |fail: bool| {
        let v = one_gpu("Simulated GPU", [Process::on(burner.id(), 0, 1 << 30)]);
        if fail {
            // GPU lost (NVML_ERROR_GPU_IS_LOST) on every process query.
            v.failing("nvmlDeviceGetComputeRunningProcesses_v3", Fail::Always(15))
        } else {
            v
        }
    };
    rig.nvml_scenario(&scenario(false));
    let config = config(&rig)
        .set("nvml.enabled", true)
        .set("nvml.sample_interval_ms", 100);
    rig.start(config).await;
    let (_c, proxy) = rig.proxy().await;

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
    assert!(throttling.is_some(), "never throttled:\n{}", rig.log_text());
    let mem_cg = Cgroup::new("rel-nvml-mem");
    rig.set_limit(&mem_cg.rel, "all", "memory_max", "8Mi").await;

    // NVML fails: reported, and the controller lets go of the cgroup (no frozen leftovers).
    rig.nvml_scenario(&scenario(true));
    let down = eventually(Duration::from_secs(10), || async {
        let available = proxy.nvml_available().await.ok()?;
        (!available).then_some(())
    })
    .await;
    assert!(down.is_some(), "failure not reported:\n{}", rig.log_text());
    let freeze = throttled_cg.dir.join("cgroup.freeze");
    let thawed = eventually(Duration::from_secs(5), || async {
        (std::fs::read_to_string(&freeze).ok()?.trim() == "0").then_some(())
    })
    .await;
    assert!(thawed.is_some(), "left frozen:\n{}", rig.log_text());
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
    let (c, d) = p.client_device(0);
    p.ok(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    let held = rig.fake().snapshot().held_by(&[p.pid]);
    rig.expect_memory(&mem_cg.rel, &[("all", held)]).await;
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
    rig.nvml_scenario(&scenario(false));
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
        rig.log_text()
    );
    let _ = burner.kill();
    let _ = burner.wait();
}

/// `probes.events_ring_kib` sizes the pinned event ring; a restart with another size adopts the
/// pinned ring as it is and says so.
#[tokio::test(flavor = "multi_thread")]
async fn event_ring_size_follows_the_configuration() {
    let mut rig = Rig::new("rel-ring");
    let standin = rig.stand_in("standin");
    let ring = rig.pins().join(gpud_common::maps::EVENTS);
    let ring_bytes = || {
        let m = libbpf_rs::MapHandle::from_pinned_path(&ring)
            .unwrap_or_else(|e| panic!("open pinned {}: {e}", ring.display()));
        libbpf_rs::MapCore::max_entries(&m)
    };
    let cfg = config(&rig).extra_paths([&standin]);
    rig.start(cfg.clone().set("probes.events_ring_kib", 2048))
        .await;
    assert_eq!(ring_bytes(), 2048 * 1024, "{}", rig.log_text());
    assert_eq!(rig.stop(), Some(0));

    rig.start(cfg.set("probes.events_ring_kib", 256)).await;
    assert_eq!(ring_bytes(), 2048 * 1024, "the pinned ring is adopted");
    let log = rig.log_text();
    assert!(
        log.contains("keeps its size") && log.contains("pinned_kib=2048"),
        "{log}"
    );
}

/// A daemon that falls behind its event ring (stopped while a tracked shell forks a thousand
/// children: two events each, more than a 64 KiB ring holds) says how many events it lost, at its
/// next sweep, as a `KernelEventsLost` signal (here through `gpudctl events`, which shows the
/// arguments of signals it has no line for) and in `events_lost`; nothing stays attributed to
/// the children.
#[tokio::test(flavor = "multi_thread")]
async fn events_lost_while_the_daemon_is_stopped_are_signalled() {
    let mut rig = Rig::new("rel-lost");
    let standin = rig.stand_in("standin");
    rig.start(
        config(&rig)
            .extra_paths([&standin])
            .set("probes.events_ring_kib", 64),
    )
    .await;
    let (_c, proxy) = rig.proxy().await;
    let mut follower = Command::new(gpudctl_bin())
        .args(["events", "--json", "-n", "1", "--type", "KernelEventsLost"])
        .args(["--bus-address", &rig.bus.address])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start gpudctl events");
    let mut said = String::new();
    let mut stderr = std::io::BufReader::new(follower.stderr.take().expect("stderr"));
    std::io::BufRead::read_line(&mut stderr, &mut said).expect("gpudctl events stderr");
    assert!(said.contains("following"), "gpudctl events said {said:?}");

    rig.signal(libc::SIGSTOP);
    let forks = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "exec 3<{}; i=0; while [ $i -lt 1000 ]; do /bin/true; i=$((i+1)); done",
            standin.display()
        ))
        .status()
        .expect("run the forking shell");
    rig.signal(libc::SIGCONT);
    assert!(forks.success());

    let out = tokio::task::spawn_blocking(move || follower.wait_with_output())
        .await
        .expect("join")
        .expect("gpudctl events output");
    let line = String::from_utf8_lossy(&out.stdout);
    let ev: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
        panic!(
            "bad line {line:?} ({e}; {}): {said}{rest}\n{}",
            out.status,
            rig.log_text()
        )
    });
    assert_eq!(ev["signal"], "KernelEventsLost", "{ev}");
    let lost = ev["lost"]
        .as_u64()
        .unwrap_or_else(|| panic!("no count in {ev}"));
    let stats = proxy.get_kernel_stats().await.expect("GetKernelStats");
    assert!(
        lost > 0 && lost <= stats["events_lost"],
        "signalled {lost}, counted {}",
        stats["events_lost"]
    );
    assert!(rig.log_text().contains("kernel events lost"));
    // The sweeps reconcile what the lost exits would have said.
    let left = eventually(Duration::from_secs(10), || async {
        let p = proxy.list_processes().await.ok()?;
        (p.len() <= 1).then_some(())
    })
    .await;
    assert!(
        left.is_some(),
        "children stayed attributed:\n{}",
        rig.log_text()
    );
}

/// `gpud-scalebench opener FILE` in `cg`: opens and closes FILE as fast as it can until its
/// standard input closes.
fn opener_in(cg: &Cgroup, file: &Path) -> std::process::Child {
    use std::os::unix::process::CommandExt as _;
    let procs = cg.dir.join("cgroup.procs");
    let mut cmd = Command::new(gpud_tests::bin_dir().join("gpud-scalebench"));
    cmd.arg("opener")
        .arg(file)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    // SAFETY: only writes its own pid into cgroup.procs between fork and exec.
    unsafe {
        cmd.pre_exec(move || std::fs::write(&procs, "0"));
    }
    cmd.spawn().expect("start gpud-scalebench opener")
}

/// A tenant floods gpud with kernel events (two processes opening and closing a control file as
/// fast as they can: an event at each open and each last close, and each asks gpud to release
/// what was made through the file) while the node holds thousands of RM objects (a walk of the
/// object map per release) and limits are set elsewhere: every `SetLimits` is answered well
/// before the NRI plugin's default timeout (1 s), which an unanswered call turns into a
/// container started without its shares. The API's changes are taken ahead of the kernel's
/// backlog, a batch of releases shares one walk, and the releases of files through which
/// nothing was made are not sent at all; gpud-scalebench's `limit_change_flood_us` measures it.
#[tokio::test(flavor = "multi_thread")]
async fn set_limits_is_answered_in_time_while_a_tenant_floods_opens_and_closes() {
    let Some(mut rig) = Rig::new("rel-flood").fake_device(1) else {
        return;
    };
    let standin = rig.stand_in("standin");
    rig.start(
        config(&rig)
            .extra_paths([&standin])
            .set("probes.max_objects", 16_384),
    )
    .await;
    let (_c, proxy) = rig.proxy().await;
    let holder_cg = Cgroup::new("rel-flood-holder");
    let mut holder = RmProcess::spawn(Some(&holder_cg.dir), &rig.ctl());
    let made = holder.ok("clients 4000");
    assert_eq!(made["made"], 4000, "{made}");

    let flood_cg = Cgroup::new("rel-flood-tenant");
    let floods: Vec<_> = (0..2).map(|_| opener_in(&flood_cg, &standin)).collect();
    // The tenant's events are seen (its cgroup is attributed), then the backlog builds up.
    let seen = eventually(Duration::from_secs(10), || async {
        proxy.get_cgroup(&flood_cg.rel).await.ok().map(|_| ())
    })
    .await;
    assert!(seen.is_some(), "the flood is not seen:\n{}", rig.log_text());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let target = Cgroup::new("rel-flood-limited");
    let mut slowest = Duration::ZERO;
    for i in 1..=20u64 {
        let limits = BTreeMap::from([("memory_max", zbus::Variant::from(i * MIB))]);
        let t = std::time::Instant::now();
        proxy
            .set_limits(&target.rel, "all", limits)
            .await
            .expect("SetLimits under the flood");
        slowest = slowest.max(t.elapsed());
    }
    // Each opener, told to stop, says how fast it went: the flood lasted the whole loop.
    let rates: Vec<f64> = floods
        .into_iter()
        .map(|mut f| {
            drop(f.stdin.take());
            let out = f.wait_with_output().expect("opener output");
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .unwrap_or(0.0)
        })
        .collect();
    assert!(
        rates.iter().all(|r| *r > 1000.0),
        "the openers stopped early: {rates:?} opens/s"
    );
    eprintln!("slowest SetLimits under the flood: {slowest:?} ({rates:?} opens/s)");
    assert!(
        slowest < Duration::from_secs(1),
        "SetLimits took {slowest:?} under a flood of {rates:?} opens/s, past the NRI plugin's \
         timeout"
    );
    // The files the flood opens make nothing: the kernel side does not send their releases.
    let stats = proxy.get_kernel_stats().await.expect("GetKernelStats");
    assert!(
        stats["file_releases_skipped"] > 1000,
        "the flood's releases were sent: {stats:?}"
    );
    drop(holder);
}
