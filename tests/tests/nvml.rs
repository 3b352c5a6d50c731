//! NVML through the real nvml-wrapper code path: the real gpud binary loads the fake
//! libnvidia-ml (tests/fake-nvml, NVML's C ABI) by `nvml.library_path`; real processes in real
//! cgroups are the GPU users, with the simulated GPU measuring their real CPU use.

use std::{
    process::{Child, Command},
    time::Duration,
};

use gpud_tests::{
    Cgroup, Daemon, Gpu1Proxy, LimitState, NvmlUsageRecord, Rig, eventually, gpudctl_bin,
    install_fake_nvml,
    scenario::{Event, Fail, Gpu, Kind, Mig, Process, Scenario},
    write_nvml_scenario,
};

const MIB: u64 = 1 << 20;

/// Test GPU 0, and an A100 in MIG mode with two MIG devices as GPU 1; with `processes`.
fn two_gpus(processes: impl IntoIterator<Item = Process>) -> Scenario {
    let mig = |n: u32| Mig {
        uuid: format!("MIG-aaaaaaaa-0000-0000-0000-00000000000{n}"),
        name: "Fake A100 MIG 3g.20gb".to_owned(),
        memory_total: 20 << 30,
    };
    let mut s = Scenario::gpus(2).with(processes);
    s.gpus[1] = Gpu {
        name: "Fake A100".to_owned(),
        memory_total: 40 << 30,
        compute_mode: 3,
        mig: Some(vec![mig(1), mig(2)]),
        ..Gpu::test(1)
    };
    s
}

/// A process in `cg` running `script` under sh.
fn spawn_in(cg: &Cgroup, script: &str) -> Child {
    gpud_tests::spawn_in_cgroup(cg, script)
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
    let mut rig = Rig::new("nvml-usage").fake_nvml();
    let (busy_cg, idle_cg, fixed_cg, mig_cg) = (
        Cgroup::new("nvml-busy"),
        Cgroup::new("nvml-idle"),
        Cgroup::new("nvml-fixed"),
        Cgroup::new("nvml-mig"),
    );
    let busy = spawn_in(&busy_cg, "while :; do :; done");
    let idle = spawn_in(&idle_cg, "sleep 600");
    let fixed = spawn_in(&fixed_cg, "sleep 600");
    let on_mig = spawn_in(&mig_cg, "sleep 600");
    // `both`: listed as a compute and as a graphics process, with its whole usage in each list.
    // On the MIG device NVML samples no per-process utilization.
    let procs = [
        Process::on(busy.id(), 0, 1024 * MIB),
        Process::on(idle.id(), 0, 512 * MIB),
        Process {
            sm_util: Some(40),
            enc_util: 7,
            kind: Kind::Both,
            ..Process::on(fixed.id(), 0, 256 * MIB)
        },
        Process {
            mig: Some(1),
            ..Process::on(on_mig.id(), 1, 3 * 1024 * MIB)
        },
    ];
    let _kill = Kill(vec![busy, idle, fixed, on_mig]);
    rig.nvml_scenario(&two_gpus(procs));
    rig.start(rig.config()).await;

    let ready = eventually(Duration::from_secs(10), || async {
        nvml_status(&rig).await.0.then_some(())
    })
    .await;
    assert!(ready.is_some(), "NVML never available:\n{}", rig.log_text());

    // Inventory, MIG devices as devices of their own, on D-Bus and in gpudctl.
    let (_c, p) = rig.proxy().await;
    let gpus = p.list_gpus().await.expect("ListGpus");
    let ids: Vec<(u32, u32, &str)> = gpus
        .iter()
        .map(|g| (g.index, g.mig, g.uuid.as_str()))
        .collect();
    assert_eq!(ids.len(), 4, "{gpus:?}");
    assert_eq!(gpus[0].name, "Fake H100");
    assert_eq!(gpus[0].memory_total, 80 << 30);
    assert_eq!(gpus[0].memory_used, 1792 * MIB);
    assert_eq!(gpus[2].memory_used, 0, "MIG device 0 has no process");
    assert_eq!(gpus[3].memory_used, 3 * 1024 * MIB);
    assert_eq!(gpus[0].driver_version, "580.159.04");
    assert_eq!(gpus[0].cuda_version, "13.0");
    assert_eq!(gpus[0].pci_bus_id, "00000000:00:06.0");
    assert_eq!(
        (gpus[0].mig_mode.as_str(), gpus[1].mig_mode.as_str()),
        ("disabled", "enabled")
    );
    assert_eq!(
        (gpus[0].compute_mode.as_str(), gpus[1].compute_mode.as_str()),
        ("default", "exclusive_process")
    );
    assert_eq!((gpus[2].index, gpus[2].mig), (1, 0));
    assert_eq!(gpus[3].uuid, "MIG-aaaaaaaa-0000-0000-0000-000000000002");
    let status = gpudctl(&rig.bus.address, &["status"]);
    for needle in [
        "NVML:             available",
        "Fake H100",
        "Fake A100 MIG 3g.20gb",
        "MIG 1/1",
    ] {
        assert!(status.contains(needle), "{needle:?} not in:\n{status}");
    }
    let intro = Command::new("busctl")
        .args([
            "--address",
            &rig.bus.address,
            "introspect",
            "dev.gpud.Daemon1",
        ])
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
        let u = usage(&rig).await;
        let (b, i, f) = (
            find(&u, &busy_cg, 0)?,
            find(&u, &idle_cg, 0)?,
            find(&u, &fixed_cg, 0)?,
        );
        (b.sm_util >= 50 && i.sm_util <= 10 && f.sm_util == 40).then(|| u.clone())
    })
    .await;
    let Some(u) = seen else {
        panic!(
            "usage never matched: {:?}\n{}",
            usage(&rig).await,
            rig.log_text()
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
        find(&u, &fixed_cg, 0).map(|r| (r.nvml_memory_bytes, r.enc_util)),
        Some((256 * MIB, 7)),
        "a process with compute and graphics contexts counts once"
    );
    // A GPU that does not sample per process (MIG) still reports memory, and NVML stays
    // available.
    assert_eq!(
        find(&u, &mig_cg, 1).map(|r| (r.nvml_memory_bytes, r.sm_util)),
        Some((3 * 1024 * MIB, 0))
    );
    assert_eq!(nvml_status(&rig).await, (true, "available".to_owned()));
    assert_eq!(find(&u, &busy_cg, 0).map(|r| r.cgroup_id != 0), Some(true));

    // gpudctl list --json joins NVML's figures to each cgroup.
    let list: serde_json::Value =
        serde_json::from_str(&gpudctl(&rig.bus.address, &["list", "--json"])).expect("list JSON");
    let entry = list
        .as_array()
        .and_then(|a| a.iter().find(|e| e["path"] == idle_cg.rel.as_str()))
        .unwrap_or_else(|| panic!("{} not listed: {list}", idle_cg.rel));
    assert_eq!(entry["nvml"]["0"]["memory_bytes"], 512 * MIB, "{entry}");
    // Known only to NVML (its process never used an NVIDIA file): listed with its cgroup id.
    assert_eq!(entry["id"], idle_cg.id(), "{entry}");
    let busy_entry = list
        .as_array()
        .and_then(|a| a.iter().find(|e| e["path"] == busy_cg.rel.as_str()))
        .unwrap_or_else(|| panic!("{} not listed: {list}", busy_cg.rel));
    assert!(
        busy_entry["nvml"]["0"]["sm_util"].as_u64() > Some(0),
        "{busy_entry}"
    );

    // Closed loop: freezing the busy cgroup stops its CPU, so its GPU utilization drops.
    std::fs::write(busy_cg.dir.join("cgroup.freeze"), "1").expect("freeze");
    let dropped = eventually(Duration::from_secs(10), || async {
        let u = usage(&rig).await;
        find(&u, &busy_cg, 0).filter(|r| r.sm_util <= 5).map(|_| ())
    })
    .await;
    std::fs::write(busy_cg.dir.join("cgroup.freeze"), "0").expect("thaw");
    assert!(
        dropped.is_some(),
        "frozen process still used the simulated GPU"
    );

    // No sample is counted twice: every call asked for samples newer than it had seen.
    let log =
        std::fs::read_to_string(rig.nvml_dir().join("fake-nvml-samples.log")).expect("sample log");
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
    // NVML configured, its library not there yet.
    let mut rig = Rig::new("nvml-recover");
    let lib_dir = rig.path().join("lib");
    rig.start(rig.config().nvml(&lib_dir.join("libnvidia-ml.so.1")))
        .await;
    let scenario = |v: &Scenario| write_nvml_scenario(&lib_dir, v);

    // No library: the daemon serves D-Bus and says why.
    let (avail, why) = nvml_status(&rig).await;
    assert!(!avail);
    let said = eventually(Duration::from_secs(5), || async {
        let (_, why) = nvml_status(&rig).await;
        why.contains("cannot load NVML").then_some(why)
    })
    .await;
    assert!(said.is_some(), "status: {why}");
    let status = gpudctl(&rig.bus.address, &["status"]);
    assert!(status.contains("cannot load NVML"), "{status}");
    // The version line names the ABI and the source revision, as `gpud --version` does.
    let abi = format!("(ABI {}, revision ", gpud_common::ABI_VERSION);
    assert!(status.contains(&abi), "{status}");
    let out = Command::new(gpud_tests::gpud_bin())
        .arg("--version")
        .output()
        .expect("gpud --version");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.starts_with("gpud ") && said.contains(&abi), "{said}");

    // The library appears: recovered within the retry interval.
    scenario(&two_gpus([]));
    install_fake_nvml(&lib_dir);
    let up = eventually(Duration::from_secs(10), || async {
        nvml_status(&rig).await.0.then_some(())
    })
    .await;
    assert!(up.is_some(), "not recovered:\n{}", rig.log_text());
    let (_c, p) = rig.proxy().await;
    assert_eq!(p.list_gpus().await.expect("ListGpus").len(), 4);

    // An NVML call fails (GPU lost): unavailable with the reason, and back once it answers.
    let s = two_gpus([]).failing("nvmlDeviceGetComputeRunningProcesses_v3", Fail::Always(15));
    scenario(&s);
    let down = eventually(Duration::from_secs(10), || async {
        let (a, why) = nvml_status(&rig).await;
        (!a && why.contains("compute processes")).then_some(why)
    })
    .await;
    assert!(down.is_some(), "failure not reported:\n{}", rig.log_text());
    assert!(p.list_gpus().await.is_ok(), "the daemon still answers");
    scenario(&two_gpus([]));
    let back = eventually(Duration::from_secs(10), || async {
        nvml_status(&rig).await.0.then_some(())
    })
    .await;
    assert!(back.is_some(), "not recovered after the failure");

    // A critical Xid error on GPU 1 is counted there.
    let mut s = two_gpus([]);
    s.events = vec![Event::xid(1, 79)];
    scenario(&s);
    let xid = eventually(Duration::from_secs(10), || async {
        let gpus = p.list_gpus().await.ok()?;
        gpus.iter()
            .find(|g| g.index == 1 && g.mig == u32::MAX && g.xid_errors == 1)
            .map(|_| ())
    })
    .await;
    assert!(xid.is_some(), "Xid not counted:\n{}", rig.log_text());
    assert!(rig.log_text().contains("critical Xid error"));

    // A transient failure (the 3rd device count after this scenario fails, once): NVML is
    // reported unavailable with the failing call, then re-initialized and back by itself.
    let s = two_gpus([]).failing(
        "nvmlDeviceGetCount_v2",
        Fail::Counted {
            code: 15,
            after: 2,
            times: Some(1),
        },
    );
    scenario(&s);
    let lost = eventually(Duration::from_secs(10), || async {
        let (a, why) = nvml_status(&rig).await;
        (!a && why.contains("device count") && why.contains("fell off the bus")).then_some(why)
    })
    .await;
    assert!(
        lost.is_some(),
        "transient failure not reported:\n{}",
        rig.log_text()
    );
    let back = eventually(Duration::from_secs(10), || async {
        nvml_status(&rig).await.0.then_some(())
    })
    .await;
    assert!(back.is_some(), "not recovered from a transient failure");
}

#[tokio::test(flavor = "multi_thread")]
async fn driver_not_loaded_at_start_is_reported_until_initialization_succeeds() {
    let mut rig = Rig::new("nvml-init").fake_nvml();
    // The first three initializations fail as without a loaded driver; the fourth succeeds.
    let s = two_gpus([]).failing(
        "nvmlInit_v2",
        Fail::Counted {
            code: 9,
            after: 0,
            times: Some(3),
        },
    );
    rig.nvml_scenario(&s);
    rig.start(rig.config()).await;
    let said = eventually(Duration::from_secs(5), || async {
        let (a, why) = nvml_status(&rig).await;
        (!a && why.contains("driver is not loaded")).then_some(())
    })
    .await;
    assert!(said.is_some(), "status: {:?}", nvml_status(&rig).await);
    let (_c, p) = rig.proxy().await;
    assert!(p.list_gpus().await.expect("ListGpus").is_empty());
    let intro = Command::new("busctl")
        .args(["--address", &rig.bus.address, "tree", "dev.gpud.Daemon1"])
        .output()
        .expect("busctl");
    assert!(
        !String::from_utf8_lossy(&intro.stdout).contains("/gpu/"),
        "GPU objects while NVML is unavailable"
    );
    let up = eventually(Duration::from_secs(10), || async {
        nvml_status(&rig).await.0.then_some(())
    })
    .await;
    assert!(up.is_some(), "never initialized:\n{}", rig.log_text());
    assert_eq!(p.list_gpus().await.expect("ListGpus").len(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn xid_events_are_signalled_and_attributed_to_the_gpus_only_process() {
    use futures_util::StreamExt as _;

    let mut rig = Rig::new("nvml-xid").fake_nvml();
    let (solo_cg, a_cg, b_cg) = (
        Cgroup::new("nvml-xid-solo"),
        Cgroup::new("nvml-xid-a"),
        Cgroup::new("nvml-xid-b"),
    );
    let solo = spawn_in(&solo_cg, "sleep 600");
    let a = spawn_in(&a_cg, "sleep 600");
    let b = spawn_in(&b_cg, "sleep 600");
    let (solo_pid, a_pid, b_pid) = (solo.id(), a.id(), b.id());
    let _kill = Kill(vec![solo, a, b]);
    let on_mig = |pid, mig| Process {
        mig: Some(mig),
        ..Process::on(pid, 1, 64 * MIB)
    };
    let procs = [
        Process::on(solo_pid, 0, 64 * MIB),
        on_mig(a_pid, 0),
        on_mig(b_pid, 1),
    ];
    rig.nvml_scenario(&two_gpus(procs.clone()));
    rig.start(rig.config()).await;
    let (conn, p) = rig.proxy().await;
    // The first sample has been taken once the processes are listed.
    let sampled = eventually(Duration::from_secs(10), || async {
        let u = usage(&rig).await;
        (find(&u, &solo_cg, 0).is_some() && find(&u, &b_cg, 1).is_some()).then_some(())
    })
    .await;
    assert!(sampled.is_some(), "never sampled:\n{}", rig.log_text());
    assert!(p.list_nvml_events().await.expect("events").is_empty());

    let gpu0 = Gpu1Proxy::builder(&conn)
        .path("/dev/gpud/Daemon1/gpu/0")
        .build()
        .await
        .expect("Gpu1 proxy");
    let mut signals = gpu0.receive_xid().await.expect("subscribe to Xid");

    let mut s = two_gpus(procs.clone());
    s.events = vec![Event {
        id: Some(1),
        ..Event::xid(0, 79)
    }];
    rig.nvml_scenario(&s);
    let sig = tokio::time::timeout(Duration::from_secs(10), signals.next())
        .await
        .expect("no Xid signal within 10 s")
        .expect("signal stream ended");
    let args = sig.args().expect("Xid args");
    let solo_id = solo_cg.id();
    assert_eq!(
        (args.xid, args.pid, args.cgroup_id, args.cgroup.as_str()),
        (79, solo_pid, solo_id, solo_cg.rel.as_str())
    );

    // On a GPU with two processes (one per MIG device) the event names neither.
    s.events.push(Event {
        id: Some(2),
        ..Event::xid(1, 43)
    });
    rig.nvml_scenario(&s);
    let both = eventually(Duration::from_secs(10), || async {
        let ev = p.list_nvml_events().await.ok()?;
        (ev.len() == 2).then_some(ev)
    })
    .await
    .unwrap_or_else(|| panic!("second event missing:\n{}", rig.log_text()));
    let first = &both[0];
    assert_eq!(
        (
            first.gpu,
            first.xid,
            first.pid,
            first.cgroup.as_str(),
            first.kind.as_str()
        ),
        (0, 79, solo_pid, solo_cg.rel.as_str(), "xid")
    );
    assert_eq!(first.uuid, "GPU-00000000-1111-2222-3333-444444444444");
    let second = &both[1];
    let mut pair = vec![a_pid, b_pid];
    pair.sort_unstable();
    assert_eq!(
        (
            second.gpu,
            second.xid,
            second.pid,
            second.cgroup_id,
            second.pids.clone()
        ),
        (1, 43, 0, 0, pair)
    );
    // Each event is delivered once: still two after more samples.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(p.list_nvml_events().await.expect("events").len(), 2);
    let status = gpudctl(&rig.bus.address, &["status"]);
    assert!(
        status.contains("Xid 79") && status.contains(&format!("pid {solo_pid} in {}", solo_cg.rel)),
        "{status}"
    );
}

/// `ListLimits`' state of (cg, gpu): `in-force`, or `pending` and why.
async fn state_of(d: &Daemon, cg: &Cgroup, gpu: &str) -> Option<LimitState> {
    let (_c, p) = d.proxy().await;
    p.list_limits()
        .await
        .expect("ListLimits")
        .into_iter()
        .find(|l| l.cgroup == cg.rel && l.gpu == gpu)
        .map(|l| l.limit_state())
}

/// Limits set while NVML does not answer: by index (GPU 0, and GPU 3 that turns out not to
/// exist) in force at once, by UUID stored and pending with why; NVML answering puts the UUID
/// in force on the GPU it names and takes GPU 3 out of force (kept aside, never moved onto
/// another GPU); NVML failing again changes nothing in force; a restart of gpud with NVML
/// answering late keeps the UUID's limit in the kernel the whole time.
#[tokio::test(flavor = "multi_thread")]
async fn limits_set_while_nvml_is_down_are_in_force_or_pending_and_follow_nvml() {
    let mut rig = Rig::new("nvml-pending");
    let lib_dir = rig.path().join("lib");
    let lib = lib_dir.join("libnvidia-ml.so.1");
    // Pins kept at exit, as in production: a restarted daemon resumes the kernel's state.
    rig.start(rig.config().nvml(&lib).keep_pinned(true)).await;
    let cg = Cgroup::new("nvml-pending");
    let uuid1 = gpud_tests::scenario::uuid(1);
    let (_c, p) = rig.proxy().await;
    let set = |gpu: &str, v: &str| {
        let p = p.clone();
        let (cg, gpu, v) = (cg.rel.clone(), gpu.to_owned(), v.to_owned());
        async move {
            p.set_limits(
                &cg,
                &gpu,
                std::collections::BTreeMap::from([("memory_max", zbus::Variant::from(v.as_str()))]),
            )
            .await
            .map(|(s, n)| LimitState::from_wire(&s, &n))
        }
    };
    let in_force_now = |pairs: &[(&str, u64)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v * MIB))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let both = [("0", 512 * MIB), ("1", 256 * MIB)];

    assert_eq!(
        set("0", "512Mi").await.expect("by index"),
        LimitState::InForce
    );
    assert_eq!(
        set("3", "64Mi")
            .await
            .expect("an index NVML will not report"),
        LimitState::InForce
    );
    let pending = set(&uuid1, "256Mi").await.expect("by UUID: stored");
    assert!(
        matches!(&pending, LimitState::Pending(why) if why.contains("NVML is unavailable")),
        "{pending:?}"
    );
    assert_eq!(
        rig.in_force(&cg.rel).await,
        in_force_now(&[("0", 512), ("3", 64)])
    );
    assert_eq!(state_of(&rig, &cg, &uuid1).await, Some(pending.clone()));
    let listed = gpudctl(&rig.bus.address, &["limits"]);
    assert!(
        listed.contains("pending") && listed.contains("NVML is unavailable"),
        "{listed}"
    );

    // NVML answers with two GPUs: the UUID is GPU 1, in force there; GPU 3 does not exist.
    write_nvml_scenario(&lib_dir, &Scenario::gpus(2));
    install_fake_nvml(&lib_dir);
    rig.wait_for_gpus(2).await;
    rig.expect_in_force(&cg.rel, &both).await;
    assert_eq!(state_of(&rig, &cg, &uuid1).await, Some(LimitState::InForce));
    let aside = state_of(&rig, &cg, "3").await;
    assert!(
        matches!(&aside, Some(LimitState::Pending(why)) if why.contains("no GPU 3")),
        "{aside:?}"
    );
    assert!(rig.log_text().contains("kept aside"), "{}", rig.log_text());
    // With NVML answering, an unknown GPU is refused outright.
    let refused = set("5", "1Gi").await.expect_err("GPU 5 does not exist");
    assert!(
        refused.to_string().contains("no GPU with this index"),
        "{refused}"
    );

    // NVML fails: nothing in force changes.
    write_nvml_scenario(
        &lib_dir,
        &Scenario::gpus(2).failing("nvmlDeviceGetComputeRunningProcesses_v3", Fail::Always(15)),
    );
    let down = eventually(Duration::from_secs(10), || async {
        (!nvml_status(&rig).await.0).then_some(())
    })
    .await;
    assert!(down.is_some(), "NVML never failed:\n{}", rig.log_text());
    assert_eq!(
        rig.in_force(&cg.rel).await,
        in_force_now(&[("0", 512), ("1", 256)])
    );
    assert_eq!(state_of(&rig, &cg, &uuid1).await, Some(LimitState::InForce));

    // A restart with the library gone: the UUID's limit stays in the kernel, where the previous
    // daemon put it, before NVML answers; then NVML answers 3 s late and it is still there.
    std::fs::remove_file(&lib).expect("remove the library");
    write_nvml_scenario(&lib_dir, &Scenario::gpus(2));
    drop(p);
    rig.restart().await;
    assert!(!nvml_status(&rig).await.0, "NVML must not answer yet");
    let restarted = rig.in_force(&cg.rel).await;
    assert_eq!(
        restarted.get("1"),
        Some(&(256 * MIB)),
        "the UUID's limit left the kernel at the restart: {restarted:?}\n{}",
        rig.log_text()
    );
    assert_eq!(state_of(&rig, &cg, &uuid1).await, Some(LimitState::InForce));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rig.in_force(&cg.rel).await.get("1"), Some(&(256 * MIB)));
    install_fake_nvml(&lib_dir);
    rig.wait_for_gpus(2).await;
    rig.expect_in_force(&cg.rel, &both).await;
}

/// The NVML backstop: NVML reports a process of a limited cgroup holding 256 MiB on GPU 0 while
/// the probes see nothing of it (no RM allocation gpud sizes: managed memory paged in, say).
/// Under a 64 MiB limit it is killed once the figure stays over for the hold time (1 s here, no
/// margin), with `MemoryLimitExceeded` saying `source` nvml; a neighbour under a 512 MiB limit
/// holding the same is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn nvml_backstop_kills_a_cgroup_nvml_shows_over_its_limit_while_the_probes_see_nothing() {
    use futures_util::StreamExt as _;
    let mut rig = Rig::new("nvml-backstop").fake_nvml();
    let over = Cgroup::new("backstop-over");
    let under = Cgroup::new("backstop-under");
    let mut kids = Kill(vec![
        spawn_in(&over, "sleep 600"),
        spawn_in(&under, "sleep 600"),
    ]);
    let (pid_over, pid_under) = (kids.0[0].id(), kids.0[1].id());
    rig.nvml_scenario(&Scenario::gpus(1).with([
        Process::on(pid_over, 0, 256 * MIB),
        Process::on(pid_under, 0, 256 * MIB),
    ]));
    rig.start(
        rig.config()
            .react_action("kill")
            .set("enforcement.nvml_backstop_secs", 1)
            .set("enforcement.nvml_backstop_margin_bytes", 0),
    )
    .await;
    rig.wait_for_gpus(1).await;
    let (_conn, p) = rig.proxy().await;
    let mut signals = p
        .receive_memory_limit_exceeded()
        .await
        .expect("subscribe to MemoryLimitExceeded");
    rig.set_limit(&over.rel, "0", "memory_max", "64Mi").await;
    rig.set_limit(&under.rel, "0", "memory_max", "512Mi").await;

    let sig = tokio::time::timeout(Duration::from_secs(10), signals.next())
        .await
        .unwrap_or_else(|_| panic!("no MemoryLimitExceeded:\n{}", rig.log_text()))
        .expect("signal");
    let args = sig.args().expect("signal args");
    assert_eq!(
        (
            args.cgroup.as_str(),
            args.gpu.as_str(),
            args.source.as_str()
        ),
        (over.rel.as_str(), "0", "nvml")
    );
    assert_eq!(args.action, "killed");
    assert_eq!(args.pid, pid_over);
    assert_eq!(
        (args.usage, args.max, args.bytes),
        (256 * MIB, 64 * MIB, 192 * MIB)
    );
    let status = kids.0[0].wait().expect("wait");
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    // The neighbour within its limit runs on, and nothing else is signalled.
    let more = tokio::time::timeout(Duration::from_secs(2), signals.next()).await;
    assert!(more.is_err(), "unexpected signal: {more:?}");
    assert_eq!(
        kids.0[1].try_wait().expect("try_wait"),
        None,
        "killed a cgroup within its limit"
    );
    assert!(
        rig.log_text().contains("source=\"nvml\""),
        "{}",
        rig.log_text()
    );
}
