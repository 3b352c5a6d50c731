//! GPU-memory accounting and limits end to end: real processes in real cgroups issue RM calls on
//! the fake NVIDIA control device (FUSE, answering the real RM ABI), the real gpud binary's eBPF
//! programs account them in the kernel, and the figures are read back over a real dbus-daemon and
//! compared with the fake driver's own ground truth.

use std::{collections::BTreeMap, path::Path, time::Duration};

use futures_util::StreamExt as _;
use gpud_api::CgroupRecord;
use gpud_tests::{Bus, Cgroup, Daemon, RmProcess, TempDir, eventually, fakenv::FakeNv};

const MIB: u64 = 1 << 20;

/// A daemon config counting on the fake device. `keep_pinned`: whether a restart resumes the
/// kernel maps (the default) or starts from nothing.
fn config(dir: &Path, ctl: &Path, react_action: &str, keep_pinned: bool) -> std::path::PathBuf {
    let text = format!(
        r#"[daemon]
state_dir = "{state}"
log = "gpud=debug"

[probes]
attach = "auto"
bpffs = "{bpffs}"
keep_pinned = {keep_pinned}

[devices]
extra_paths = [{ctl:?}]

[attribution]
sweep_interval_secs = 1
rescan_interval_secs = 0

[enforcement]
tier = "auto"
react_action = "{react_action}"
"#,
        state = dir.join("state").display(),
        bpffs = dir.join("bpffs").display(),
        ctl = ctl.display().to_string(),
    );
    let p = dir.join("gpud.toml");
    std::fs::write(&p, text).expect("write config");
    p
}

fn fake(dir: &TempDir) -> Option<FakeNv> {
    gpud_tests::fake_device(dir, 2)
}

async fn get(d: &Daemon, path: &str) -> CgroupRecord {
    let (_c, p) = d.proxy().await;
    p.get_cgroup(path).await.expect("GetCgroup")
}

fn mem(r: &CgroupRecord, gpu: &str) -> u64 {
    r.memory_current.get(gpu).copied().unwrap_or(0)
}

/// Waits until the cgroup's figures equal `want` (per GPU name) and returns the record.
async fn expect_memory(d: &Daemon, path: &str, want: &[(&str, u64)]) -> CgroupRecord {
    let want: BTreeMap<&str, u64> = want.iter().copied().collect();
    let got = eventually(Duration::from_secs(5), || async {
        let r = get(d, path).await;
        want.iter().all(|(g, b)| mem(&r, g) == *b).then_some(r)
    })
    .await;
    match got {
        Some(r) => r,
        None => {
            let have = get(d, path).await.memory_current;
            panic!("{path}: wanted {want:?}, have {have:?}\n{}", d.log_text())
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bytes_are_exact_per_cgroup_gpu_and_ancestor_across_the_object_lifecycle() {
    let dir = TempDir::new("mem-exact");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let daemon = Daemon::start(&config(dir.path(), &ctl, "notify", false), &bus.address).await;

    let parent = Cgroup::new("mem-parent");
    let a_dir = parent.dir.join("a");
    let b_dir = parent.dir.join("b");
    std::fs::create_dir_all(&a_dir).expect("cgroup a");
    std::fs::create_dir_all(&b_dir).expect("cgroup b");
    let (p, a, b) = (
        parent.rel.clone(),
        format!("{}/a", parent.rel),
        format!("{}/b", parent.rel),
    );

    // A: two GPUs, memory under a device, a subdevice and through every call form.
    let mut pa = RmProcess::spawn(Some(&a_dir), &ctl);
    let c = pa.handle("client");
    let d0 = pa.handle(&format!("device {c} 0"));
    let d1 = pa.handle(&format!("device {c} 1"));
    let s0 = pa.handle(&format!("subdevice {c} {d0}"));
    pa.ok(&format!("alloc {c} {d0} {} nvos64", 3 * MIB)); // rounded up to 4 MiB
    let vh = pa.handle(&format!("alloc {c} {s0} {} vidheap", 5 * MIB)); // 6 MiB
    pa.ok(&format!("alloc {c} {d1} {} xfer21", 2 * MIB));
    pa.ok(&format!("alloc {c} {d1} {} xfer64", MIB)); // 2 MiB
    // A failed allocation (RM status, ioctl returns 0) is not charged.
    fake.inject("fail-next-alloc 0x51").expect("inject");
    let failed = pa.cmd(&format!("alloc {c} {d0} {} nvos21", 64 * MIB));
    assert_eq!(failed["status"], 0x51, "{failed}");
    expect_memory(
        &daemon,
        &a,
        &[("0", 10 * MIB), ("1", 4 * MIB), ("all", 14 * MIB)],
    )
    .await;

    // B: a second cgroup under the same parent.
    let mut pb = RmProcess::spawn(Some(&b_dir), &ctl);
    let cb = pb.handle("client");
    let db = pb.handle(&format!("device {cb} 0"));
    pb.ok(&format!("alloc {cb} {db} {} nvos21", 8 * MIB));
    expect_memory(&daemon, &b, &[("0", 8 * MIB), ("all", 8 * MIB)]).await;
    // The parent holds what its descendants hold.
    expect_memory(
        &daemon,
        &p,
        &[("0", 18 * MIB), ("1", 4 * MIB), ("all", 22 * MIB)],
    )
    .await;
    assert_eq!(
        fake.snapshot().used_total(),
        22 * MIB,
        "the fake driver agrees"
    );

    // Free of one object, then of a device (its whole subtree).
    pa.ok(&format!("vidheap-free {c} {s0} {vh}"));
    expect_memory(
        &daemon,
        &a,
        &[("0", 4 * MIB), ("1", 4 * MIB), ("all", 8 * MIB)],
    )
    .await;
    pa.ok(&format!("free {c} {d1}"));
    expect_memory(&daemon, &a, &[("0", 4 * MIB), ("1", 0), ("all", 4 * MIB)]).await;

    // A forked child allocates on the shared file, in its own cgroup; it exits, its parent still
    // holds the file, so the memory stays (the client lives); the parent's exit releases all.
    let child = pb.cmd("fork");
    assert_eq!(child["ok"], true, "{child}");
    pb.ok(&format!("cgroup {}", a_dir.display()));
    pb.ok(&format!("alloc {cb} {db} {} nvos64", 2 * MIB));
    let reaped = pb.cmd("exit");
    assert_eq!(reaped["ok"], true, "{reaped}");
    let reaped_by_parent = pb.recv();
    assert_eq!(reaped_by_parent["ok"], true, "{reaped_by_parent}");
    expect_memory(&daemon, &a, &[("all", 6 * MIB)]).await;
    expect_memory(&daemon, &b, &[("all", 8 * MIB)]).await;
    let _ = pb.cmd("exit");
    pb.wait();
    expect_memory(&daemon, &b, &[("all", 0)]).await;
    expect_memory(&daemon, &a, &[("all", 4 * MIB)]).await;

    // Client free releases everything of the client.
    pa.ok(&format!("free {c} {c}"));
    expect_memory(&daemon, &a, &[("all", 0)]).await;

    // Closing the file (without frees) releases its clients, like the driver does.
    pa.ok("open");
    let c2 = pa.handle("client");
    let d2 = pa.handle(&format!("device {c2} 0"));
    pa.ok(&format!("alloc {c2} {d2} {} nvos64", 16 * MIB));
    expect_memory(&daemon, &a, &[("all", 16 * MIB)]).await;
    pa.ok("close");
    expect_memory(&daemon, &a, &[("all", 0)]).await;
    expect_memory(&daemon, &p, &[("all", 0)]).await;
    fake.wait(Duration::from_secs(5), |s| s.used_total() == 0)
        .expect("the fake driver freed everything too");
}

#[tokio::test(flavor = "multi_thread")]
async fn crossing_a_limit_kills_the_allocator_only_and_signals_and_limits_persist() {
    let dir = TempDir::new("mem-limit");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let cfg = config(dir.path(), &ctl, "kill", true);
    let mut daemon = Daemon::start(&cfg, &bus.address).await;
    let (conn, proxy) = daemon.proxy().await;
    let mut signals = proxy
        .receive_memory_limit_exceeded()
        .await
        .expect("subscribe to MemoryLimitExceeded");

    let parent = Cgroup::new("lim-parent");
    let a_dir = parent.dir.join("a");
    let b_dir = parent.dir.join("b");
    std::fs::create_dir_all(&a_dir).expect("cgroup a");
    std::fs::create_dir_all(&b_dir).expect("cgroup b");

    // Bad input: typed errors, nothing changes.
    let v = |b: u64| zbus::Variant::from(b);
    for (cg, gpu, limits, err) in [
        (
            "/no-such-cgroup",
            "all",
            vec![("memory_max", v(MIB))],
            "NotFound",
        ),
        (
            "/../etc",
            "all",
            vec![("memory_max", v(MIB))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "all",
            vec![("memory_max", v(0))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "all",
            vec![("memory_max", zbus::Variant::from(-1i64))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "all",
            vec![("memory_max", v(u64::MAX))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "gpu7x",
            vec![("memory_max", v(MIB))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "GPU-abc",
            vec![("memory_max", v(MIB))],
            "InvalidArgument",
        ),
        (
            parent.rel.as_str(),
            "all",
            vec![("memory_maximum", v(MIB))],
            "InvalidArgument",
        ),
        (parent.rel.as_str(), "all", vec![], "InvalidArgument"),
    ] {
        let limits: BTreeMap<&str, zbus::Variant<'_>> = limits.into_iter().collect();
        let e = proxy
            .set_limits(cg, gpu, limits)
            .await
            .expect_err("bad SetLimits must fail");
        assert!(e.to_string().contains(err), "{cg} {gpu}: {e}");
    }
    assert!(proxy.list_limits().await.expect("ListLimits").is_empty());

    // A limit on the parent: the allocation that takes the parent over it is killed, in the
    // cgroup that made it; the other process is untouched.
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from("16Mi"))]);
    proxy
        .set_limits(&parent.rel, "all", limits)
        .await
        .expect("SetLimits");
    let mut pa = RmProcess::spawn(Some(&a_dir), &ctl);
    let c = pa.handle("client");
    let d = pa.handle(&format!("device {c} 0"));
    pa.ok(&format!("alloc {c} {d} {} nvos64", 10 * MIB));
    let mut pb = RmProcess::spawn(Some(&b_dir), &ctl);
    let cb = pb.handle("client");
    let db = pb.handle(&format!("device {cb} 0"));
    let answer = pb.try_cmd(&format!("alloc {cb} {db} {} nvos64", 8 * MIB));
    assert!(
        answer.is_none(),
        "the crossing allocator must not survive its ioctl: {answer:?}"
    );
    let status = pb.wait();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let sig = tokio::time::timeout(Duration::from_secs(5), signals.next())
        .await
        .expect("MemoryLimitExceeded in time")
        .expect("signal");
    let args = sig.args().expect("signal args");
    assert_eq!(args.cgroup, parent.rel);
    assert_eq!(args.gpu, "all");
    assert_eq!(args.pid, pb.pid);
    assert_eq!(args.bytes, 8 * MIB);
    assert_eq!(args.max, 16 * MIB);
    assert_eq!(args.action, "killed");
    // A is alive and still allocates within the limit.
    pa.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    let r = expect_memory(&daemon, &parent.rel, &[("all", 12 * MIB)]).await;
    assert_eq!(r.memory_max.get("all"), Some(&(16 * MIB)));
    assert_eq!(r.memory_events, 1);

    // The limit survives a restart (persisted and re-applied) and stays enforced.
    drop(signals);
    drop(conn);
    daemon.stop();
    let daemon = Daemon::start(&cfg, &bus.address).await;
    let (_conn, proxy) = daemon.proxy().await;
    let listed = proxy.list_limits().await.expect("ListLimits");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].cgroup, parent.rel);
    assert_eq!(listed[0].limits.get("memory_max"), Some(&(16 * MIB)));
    // A max below what is held already kills nobody; the next allocation that crosses it kills
    // its allocator, and nothing else.
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from(4 * MIB))]);
    proxy
        .set_limits(&parent.rel, "all", limits)
        .await
        .expect("SetLimits below usage");
    let mut pc = RmProcess::spawn(Some(&b_dir), &ctl);
    let cc = pc.handle("client");
    let dc = pc.handle(&format!("device {cc} 0"));
    assert_eq!(
        pa.cmd("pid")["ok"],
        true,
        "the holder survived the lower limit"
    );
    let answer = pc.try_cmd(&format!("alloc {cc} {dc} {} nvos64", 2 * MIB));
    assert!(
        answer.is_none(),
        "the crossing allocator must die: {answer:?}"
    );
    assert_eq!(pa.cmd("pid")["ok"], true, "the holder is still alive");
    let answer = pa.try_cmd(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    assert!(answer.is_none(), "still enforced after restart: {answer:?}");
    proxy
        .clear_limits(&parent.rel, "all", &[])
        .await
        .expect("ClearLimits");
    assert!(proxy.list_limits().await.expect("ListLimits").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupted_rm_calls_never_charge_more_or_less_than_the_driver_allocated() {
    let dir = TempDir::new("mem-fuzz");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let daemon = Daemon::start(&config(dir.path(), &ctl, "notify", false), &bus.address).await;
    let cg = Cgroup::new("mem-fuzz");
    let mut p = RmProcess::spawn(Some(&cg.dir), &ctl);
    let c = p.handle("client");
    let d = p.handle(&format!("device {c} 0"));
    // `cargo xtask fuzz` runs more rounds of more calls: GPUD_FUZZ_RM_ROUNDS rounds (seeds) of
    // GPUD_FUZZ_RM_CALLS calls each.
    let env = |name: &str, default: u64| {
        std::env::var(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
    };
    let (rounds, calls) = (
        env("GPUD_FUZZ_RM_ROUNDS", 5),
        env("GPUD_FUZZ_RM_CALLS", 400),
    );
    let seeds = [1u64, 7, 42, 1234, 99991]
        .into_iter()
        .chain((0..).map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1)));
    for seed in seeds.take(rounds as usize) {
        let r = p.cmd(&format!("fuzz {c} {d} {seed} {calls}"));
        assert_eq!(r["ok"], true, "{r}");
        // Whatever the driver (the fake) holds now is exactly what gpud charges: nothing for
        // malformed, refused or failed calls, the written-back size for the rest.
        let truth = fake.snapshot().used_total();
        expect_memory(&daemon, &cg.rel, &[("all", truth)]).await;
    }
    assert!(fake.snapshot().used_total() > 0, "some calls allocated");
    p.ok("close");
    expect_memory(&daemon, &cg.rel, &[("all", 0)]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn freeze_action_freezes_the_cgroup_over_its_limit_until_the_limit_is_raised() {
    let dir = TempDir::new("mem-freeze");
    let Some(fake) = fake(&dir) else { return };
    let ctl = fake.ctl();
    let bus = Bus::start();
    let daemon = Daemon::start(&config(dir.path(), &ctl, "freeze", false), &bus.address).await;
    let (_conn, proxy) = daemon.proxy().await;
    assert_eq!(proxy.react_action().await.expect("ReactAction"), "freeze");
    let cg = Cgroup::new("mem-freeze");
    let frozen = || {
        std::fs::read_to_string(cg.dir.join("cgroup.events"))
            .map(|t| t.lines().any(|l| l == "frozen 1"))
            .unwrap_or(false)
    };
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from(4 * MIB))]);
    proxy
        .set_limits(&cg.rel, "all", limits)
        .await
        .expect("SetLimits");
    let mut p = RmProcess::spawn(Some(&cg.dir), &ctl);
    let c = p.handle("client");
    let d = p.handle(&format!("device {c} 0"));
    p.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    assert!(!frozen());
    let line = format!("alloc {c} {d} {} nvos64", 4 * MIB);
    p.send(&line);
    let became_frozen = eventually(Duration::from_secs(5), || async { frozen().then_some(()) })
        .await
        .is_some();
    assert!(became_frozen, "cgroup not frozen:\n{}", daemon.log_text());
    let r = get(&daemon, &cg.rel).await;
    assert_eq!(mem(&r, "all"), 6 * MIB);
    assert_eq!(r.memory_events, 1);
    // Raising the limit above the usage thaws it; the process goes on.
    let limits = BTreeMap::from([("memory_max", zbus::Variant::from(8 * MIB))]);
    proxy
        .set_limits(&cg.rel, "all", limits)
        .await
        .expect("SetLimits");
    assert!(!frozen(), "still frozen after the limit was raised");
    let a = p.recv();
    assert_eq!(a["ok"], true, "{a}");
    p.ok(&format!("alloc {c} {d} {} nvos64", MIB));
}
