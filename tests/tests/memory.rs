//! GPU-memory accounting and limits end to end: real processes in real cgroups issue RM calls on
//! the fake NVIDIA control device (FUSE, answering the real RM ABI), the real gpud binary's eBPF
//! programs account them in the kernel, and the figures are read back over a real dbus-daemon and
//! compared with the fake driver's own ground truth.

use std::{collections::BTreeMap, time::Duration};

use futures_util::StreamExt as _;
use gpud_tests::{Cgroup, Rig, RmProcess, eventually, rm::Form};
use rstest::rstest;

const MIB: u64 = 1 << 20;

/// A daemon on the fake device (2 GPUs) acting on limit crossings with `react_action`.
/// `keep_pinned`: whether a restart resumes the kernel maps or starts from nothing.
async fn started(tag: &str, react_action: &str, keep_pinned: bool) -> Option<Rig> {
    let mut rig = Rig::new(tag).fake_device(2)?;
    let config = rig
        .config()
        .react_action(react_action)
        .keep_pinned(keep_pinned);
    rig.start(config).await;
    Some(rig)
}

#[tokio::test(flavor = "multi_thread")]
async fn bytes_are_exact_per_cgroup_gpu_and_ancestor_across_the_object_lifecycle() {
    let Some(rig) = started("mem-exact", "notify", false).await else {
        return;
    };
    let (fake, ctl) = (rig.fake(), rig.ctl());
    let parent = Cgroup::new("mem-parent");
    let (cg_a, cg_b) = (parent.child("a"), parent.child("b"));
    let (a_dir, b_dir) = (&cg_a.dir, &cg_b.dir);
    let (p, a, b) = (&parent.rel, &cg_a.rel, &cg_b.rel);

    // A: two GPUs, memory under a device, a subdevice and through every call form.
    let mut pa = RmProcess::spawn(Some(a_dir), &ctl);
    let (c, d0) = pa.client_device(0);
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
    rig.expect_memory(a, &[("0", 10 * MIB), ("1", 4 * MIB), ("all", 14 * MIB)])
        .await;

    // B: a second cgroup under the same parent.
    let mut pb = RmProcess::spawn(Some(b_dir), &ctl);
    let (cb, db) = pb.client_device(0);
    pb.ok(&format!("alloc {cb} {db} {} nvos21", 8 * MIB));
    rig.expect_memory(b, &[("0", 8 * MIB), ("all", 8 * MIB)])
        .await;
    // The parent holds what its descendants hold.
    rig.expect_memory(p, &[("0", 18 * MIB), ("1", 4 * MIB), ("all", 22 * MIB)])
        .await;
    assert_eq!(
        fake.snapshot().used_total(),
        22 * MIB,
        "the fake driver agrees"
    );

    // Free of one object, then of a device (its whole subtree).
    pa.ok(&format!("vidheap-free {c} {s0} {vh}"));
    rig.expect_memory(a, &[("0", 4 * MIB), ("1", 4 * MIB), ("all", 8 * MIB)])
        .await;
    pa.ok(&format!("free {c} {d1}"));
    rig.expect_memory(a, &[("0", 4 * MIB), ("1", 0), ("all", 4 * MIB)])
        .await;

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
    rig.expect_memory(a, &[("all", 6 * MIB)]).await;
    rig.expect_memory(b, &[("all", 8 * MIB)]).await;
    let _ = pb.cmd("exit");
    pb.wait();
    rig.expect_memory(b, &[("all", 0)]).await;
    rig.expect_memory(a, &[("all", 4 * MIB)]).await;

    // Client free releases everything of the client.
    pa.ok(&format!("free {c} {c}"));
    rig.expect_memory(a, &[("all", 0)]).await;

    // Closing the file (without frees) releases its clients, like the driver does.
    pa.ok("open");
    let (c2, d2) = pa.client_device(0);
    pa.ok(&format!("alloc {c2} {d2} {} nvos64", 16 * MIB));
    rig.expect_memory(a, &[("all", 16 * MIB)]).await;
    pa.ok("close");
    rig.expect_memory(a, &[("all", 0)]).await;
    rig.expect_memory(p, &[("all", 0)]).await;
    fake.wait(Duration::from_secs(5), |s| s.used_total() == 0)
        .expect("the fake driver freed everything too");
}

/// A duplicate (`RM_DUP_OBJECT`) is one more handle on its allocation's pages: one charge, held
/// until the last handle goes, whichever that is, and given back by a duplicate the driver
/// refuses. The kernel side looks a free's other holders up only where a duplicate was made, so
/// each order of frees is taken here.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicated_allocation_is_charged_once_until_its_last_handle_goes() {
    let Some(rig) = started("mem-dup", "notify", false).await else {
        return;
    };
    let (fake, ctl) = (rig.fake(), rig.ctl());
    let cg = Cgroup::new("mem-dup");
    let mut t = RmProcess::spawn(Some(&cg.dir), &ctl);
    let (c, d) = t.client_device(0);
    let held = |bytes: u64| {
        fake.wait(Duration::from_secs(5), |s| s.used_total() == bytes)
            .unwrap_or_else(|s| panic!("the fake driver holds {}, not {bytes}", s.used_total()));
    };

    // The duplicate goes first: the allocation still holds the pages.
    let a = t.handle(&format!("alloc {c} {d} {} nvos21", 16 * MIB));
    let dup = t.handle(&format!("dup {c} {d} {c} {a}"));
    rig.expect_memory(&cg.rel, &[("all", 16 * MIB)]).await;
    t.ok(&format!("free {c} {dup}"));
    held(16 * MIB);
    rig.expect_memory(&cg.rel, &[("all", 16 * MIB)]).await;

    // The allocation goes first: a duplicate holds the pages, then a duplicate of it.
    let dup = t.handle(&format!("dup {c} {d} {c} {a}"));
    t.ok(&format!("free {c} {a}"));
    held(16 * MIB);
    rig.expect_memory(&cg.rel, &[("all", 16 * MIB)]).await;
    let dup_of_dup = t.handle(&format!("dup {c} {d} {c} {dup}"));
    t.ok(&format!("free {c} {dup}"));
    held(16 * MIB);
    rig.expect_memory(&cg.rel, &[("all", 16 * MIB)]).await;
    t.ok(&format!("free {c} {dup_of_dup}"));
    held(0);
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;

    // A duplicate under a name in use is refused after its entry side took its reference: the
    // reference is given back, so the allocation's own free uncharges it.
    let b = t.handle(&format!("alloc {c} {d} {} nvos21", 8 * MIB));
    let taken = t.handle(&format!("alloc {c} {d} {} nvos21", 4 * MIB));
    let refused = t.cmd(&format!("dup {c} {d} {c} {b} {taken}"));
    assert_eq!(refused["ok"], false, "{refused}");
    rig.expect_memory(&cg.rel, &[("all", 12 * MIB)]).await;
    t.ok(&format!("free {c} {b}"));
    held(4 * MIB);
    rig.expect_memory(&cg.rel, &[("all", 4 * MIB)]).await;
    t.ok(&format!("free {c} {taken}"));
    held(0);
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;
}

/// Each path by which CUDA allocates video memory is charged to the byte (the size the driver
/// wrote back, as its own ledger holds it) and uncharged by the free that path pairs with; an
/// allocation the driver refuses charges nothing.
#[rstest]
#[case::nvos21(Form::Nvos21)]
#[case::nvos64(Form::Nvos64)]
#[case::vid_heap_control(Form::VidHeap)]
#[case::xfer_nvos21(Form::Xfer21)]
#[case::xfer_nvos64(Form::Xfer64)]
#[case::xfer_vid_heap_control(Form::XferVidHeap)]
#[tokio::test(flavor = "multi_thread")]
async fn each_allocation_form_is_charged_to_the_byte_and_uncharged_by_its_free(#[case] form: Form) {
    let name = form.name();
    let Some(rig) = started(&format!("mem-{name}"), "notify", false).await else {
        return;
    };
    let cg = Cgroup::new(&format!("mem-form-{name}"));
    let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (c, d) = p.client_device(1);
    rig.fake().inject("fail-next-alloc 0x51").expect("inject");
    let refused = p.cmd(&format!("alloc {c} {d} {} {name}", 3 * MIB));
    assert_eq!(refused["status"], 0x51, "{refused}");
    let h = p.handle(&format!("alloc {c} {d} {} {name}", 3 * MIB));
    let held = rig.fake().snapshot().held_by(&[p.pid]);
    assert_eq!(held, 4 * MIB, "3 MiB in the fake's 2 MiB pages");
    rig.expect_memory(&cg.rel, &[("1", held), ("all", held)])
        .await;
    let free = if name.contains("vidheap") {
        format!("vidheap-free {c} {d} {h}")
    } else {
        format!("free {c} {h}")
    };
    p.ok(&free);
    rig.expect_memory(&cg.rel, &[("1", 0), ("all", 0)]).await;
    assert_eq!(rig.fake().snapshot().used_total(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn crossing_a_limit_kills_the_allocator_only_and_signals_and_limits_persist() {
    let Some(mut rig) = started("mem-limit", "kill", true).await else {
        return;
    };
    let ctl = rig.ctl();
    let (conn, proxy) = rig.proxy().await;
    let mut signals = proxy
        .receive_memory_limit_exceeded()
        .await
        .expect("subscribe to MemoryLimitExceeded");

    let parent = Cgroup::new("lim-parent");
    let (cg_a, cg_b) = (parent.child("a"), parent.child("b"));

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
    rig.set_limit(&parent.rel, "all", "memory_max", "16Mi")
        .await;
    let mut pa = RmProcess::spawn(Some(&cg_a.dir), &ctl);
    let (c, d) = pa.client_device(0);
    pa.ok(&format!("alloc {c} {d} {} nvos64", 10 * MIB));
    let mut pb = RmProcess::spawn(Some(&cg_b.dir), &ctl);
    let (cb, db) = pb.client_device(0);
    pb.killed_in(
        &format!("alloc {cb} {db} {} nvos64", 8 * MIB),
        "the crossing allocator must not survive its ioctl",
    );
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
    assert_eq!(args.source, "kernel");
    // B's charge goes when its file is released (the kernel reports the release, the daemon
    // walks the objects): the signal comes at the crossing, before that, so A's next allocation
    // waits for the uncharge (on a busy machine it lags the signal).
    rig.expect_memory(&parent.rel, &[("all", 10 * MIB)]).await;
    // A is alive and still allocates within the limit.
    pa.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    let r = rig.expect_memory(&parent.rel, &[("all", 12 * MIB)]).await;
    assert_eq!(r.memory_max.get("all"), Some(&(16 * MIB)));
    assert_eq!(r.memory_events, 1);

    // The limit survives a restart (persisted and re-applied) and stays enforced.
    drop(signals);
    drop(conn);
    rig.restart().await;
    let (_conn, proxy) = rig.proxy().await;
    let listed = proxy.list_limits().await.expect("ListLimits");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].cgroup, parent.rel);
    assert_eq!(listed[0].limits.get("memory_max"), Some(&(16 * MIB)));
    // A max below what is held already kills nobody; the next allocation that crosses it kills
    // its allocator, and nothing else.
    rig.set_limit(&parent.rel, "all", "memory_max", 4 * MIB)
        .await;
    let mut pc = RmProcess::spawn(Some(&cg_b.dir), &ctl);
    let (cc, dc) = pc.client_device(0);
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

/// The kernel side skips the lookups of ancestry levels it found without any limit until the
/// daemon writes a limit: a level that gains its first limit after charges walked it unlimited
/// holds the next allocation at once, whether the limit is on another GPU than the walks were
/// on (found through the `unknown` entry that comes with it) or on every GPU, and after a limit
/// went and came back.
#[tokio::test(flavor = "multi_thread")]
async fn a_level_limited_after_charges_walked_it_unlimited_holds_the_next_allocation() {
    let Some(rig) = started("mem-learnt", "kill", false).await else {
        return;
    };
    let ctl = rig.ctl();
    let (_conn, proxy) = rig.proxy().await;
    let parent = Cgroup::new("learnt-parent");
    let leaf = parent.child("a");
    // Charges through the root, the parent and the leaf, none of them limited.
    let mut holder = RmProcess::spawn(Some(&leaf.dir), &ctl);
    let (c, d) = holder.client_device(0);
    // 2 MiB each: the fake driver rounds sizes up to its pages, as the real one does.
    let alloc = format!("alloc {c} {d} {} nvos64", 2 * MIB);
    for _ in 0..3 {
        holder.ok(&alloc);
    }
    rig.expect_memory(&leaf.rel, &[("all", 6 * MIB)]).await;

    // The parent gains a limit on GPU 1; the holder's next allocation (GPU 0) walks again.
    rig.set_limit(&parent.rel, "1", "memory_max", 4 * MIB).await;
    holder.ok(&alloc);
    let mut other = RmProcess::spawn(Some(&leaf.dir), &ctl);
    let (oc, od) = other.client_device(1);
    other.killed_in(
        &format!("alloc {oc} {od} {} nvos64", 6 * MIB),
        "over the parent's new limit on GPU 1",
    );
    // Its charge goes with its file.
    rig.expect_memory(&leaf.rel, &[("all", 8 * MIB)]).await;

    // That limit goes (the holder allocates with none), then the leaf gains one on every GPU.
    proxy
        .clear_limits(&parent.rel, "1", &[])
        .await
        .expect("ClearLimits");
    holder.ok(&alloc);
    rig.set_limit(&leaf.rel, "all", "memory_max", 12 * MIB)
        .await;
    holder.killed_in(
        &format!("alloc {c} {d} {} nvos64", 4 * MIB),
        "over the leaf's new limit",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupted_rm_calls_never_charge_more_or_less_than_the_driver_allocated() {
    let Some(rig) = started("mem-fuzz", "notify", false).await else {
        return;
    };
    let fake = rig.fake();
    let cg = Cgroup::new("mem-fuzz");
    let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (c, d) = p.client_device(0);
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
        rig.expect_memory(&cg.rel, &[("all", truth)]).await;
    }
    assert!(fake.snapshot().used_total() > 0, "some calls allocated");
    p.ok("close");
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn freeze_action_freezes_the_cgroup_over_its_limit_until_the_limit_is_raised() {
    let Some(rig) = started("mem-freeze", "freeze", false).await else {
        return;
    };
    let (_conn, proxy) = rig.proxy().await;
    assert_eq!(proxy.react_action().await.expect("ReactAction"), "freeze");
    let cg = Cgroup::new("mem-freeze");
    rig.set_limit(&cg.rel, "all", "memory_max", 4 * MIB).await;
    let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (c, d) = p.client_device(0);
    p.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    assert!(!cg.frozen());
    let line = format!("alloc {c} {d} {} nvos64", 4 * MIB);
    p.send(&line);
    let became_frozen = eventually(Duration::from_secs(5), || async {
        cg.frozen().then_some(())
    })
    .await
    .is_some();
    assert!(became_frozen, "cgroup not frozen:\n{}", rig.log_text());
    let r = rig.get_cgroup(&cg.rel).await;
    assert_eq!(r.memory_current.get("all").copied().unwrap_or(0), 6 * MIB);
    assert_eq!(r.memory_events, 1);
    // Raising the limit above the usage thaws it; the process goes on.
    rig.set_limit(&cg.rel, "all", "memory_max", 8 * MIB).await;
    assert!(!cg.frozen(), "still frozen after the limit was raised");
    let a = p.recv();
    assert_eq!(a["ok"], true, "{a}");
    p.ok(&format!("alloc {c} {d} {} nvos64", MIB));
}

/// A cgroup removed while it has limits loses them at once (a container that failed after its
/// runtime's hook set them, a clear that went unanswered), not at the next sweep, which this
/// daemon runs once an hour; other cgroups keep theirs.
#[tokio::test(flavor = "multi_thread")]
async fn limits_of_a_removed_cgroup_go_at_once() {
    let mut rig = Rig::new("mem-rmdir");
    let config = rig.config().set("attribution.sweep_interval_secs", 3600);
    rig.start(config).await;
    let (gone, kept) = (Cgroup::new("mem-rmdir-gone"), Cgroup::new("mem-rmdir-kept"));
    rig.set_limit(&gone.rel, "all", "memory_max", "1Gi").await;
    rig.set_limit(&kept.rel, "all", "memory_max", "2Gi").await;
    let rel = gone.rel.clone();
    assert!(!rig.limits(&rel).await.is_empty());
    drop(gone);
    let dropped = eventually(Duration::from_secs(3), || async {
        rig.limits(&rel).await.is_empty().then_some(())
    })
    .await;
    assert!(dropped.is_some(), "still limited:\n{}", rig.log_text());
    assert_eq!(
        rig.limits(&kept.rel).await["all"]["memory_max"],
        2 << 30,
        "the other cgroup keeps its limit"
    );
    assert!(
        rig.log_text()
            .contains("cgroup removed; dropping its limit")
    );
}

/// `ShareCharges`: two cgroups in different subtrees (the containers of two pods sharing one
/// grant) have their memory also charged to a third, whose `memory_max` then holds them
/// together, to the byte; what frees it uncharges it. Bad requests are refused with a clear
/// error and change nothing: the group below the cgroup or the other way round, a cgroup that
/// does not exist, and a cgroup charged already (whose charges would be uncharged along another
/// ancestry than they were charged along).
#[tokio::test(flavor = "multi_thread")]
async fn cgroups_sharing_charges_are_held_together_by_the_groups_limit() {
    let Some(rig) = started("mem-share", "kill", false).await else {
        return;
    };
    let (p1, p2) = (Cgroup::new("mem-share-pod1"), Cgroup::new("mem-share-pod2"));
    let (a, b) = (p1.child("a"), p2.child("b"));
    let group = Cgroup::new("mem-share-claim");
    let (_c, p) = rig.proxy().await;
    let refused = |r: zbus::Result<()>| match r {
        Err(zbus::Error::MethodError(name, msg, _)) => {
            format!("{name}: {}", msg.unwrap_or_default())
        }
        other => panic!("not refused: {other:?}"),
    };
    let below = refused(p.share_charges(&a.rel, &p1.rel).await);
    assert!(
        below.starts_with("dev.gpud.Error.InvalidArgument") && below.contains("below it"),
        "{below}"
    );
    let missing = refused(p.share_charges(&a.rel, "/mem-share-no-such").await);
    assert!(missing.starts_with("dev.gpud.Error.NotFound"), "{missing}");
    for c in [&a, &b] {
        p.share_charges(&c.rel, &group.rel)
            .await
            .expect("ShareCharges");
        // Again: nothing changes.
        p.share_charges(&c.rel, &group.rel)
            .await
            .expect("ShareCharges again");
    }
    rig.set_limit(&group.rel, "all", "memory_max", "64Mi").await;
    let mut in_a = RmProcess::spawn(Some(&a.dir), &rig.ctl());
    let (ca, da) = in_a.client_device(0);
    let first = in_a.handle(&format!("alloc {ca} {da} {}", 40 * MIB));
    let mut in_b = RmProcess::spawn(Some(&b.dir), &rig.ctl());
    let (cb, db) = in_b.client_device(0);
    let g = rig.get_cgroup(&group.rel).await;
    assert_eq!(g.memory_current.get("all"), Some(&(40 * MIB)), "{g:?}");
    // 40 + 30 MiB: the second pod's allocation crosses the group's limit and is killed.
    assert!(
        in_b.try_cmd(&format!("alloc {cb} {db} {}", 30 * MIB))
            .is_none(),
        "the second cgroup took the group past its limit:\n{}",
        rig.log_text()
    );
    // A charged cgroup cannot join a group any more.
    let charged = refused(
        p.share_charges(&a.rel, &Cgroup::new("mem-share-other").rel)
            .await,
    );
    assert!(charged.contains("charged to it already"), "{charged}");
    // What is freed leaves the group too.
    in_a.ok(&format!("free {ca} {first}"));
    let freed = eventually(Duration::from_secs(5), || async {
        let g = rig.get_cgroup(&group.rel).await;
        (g.memory_current.get("all").copied().unwrap_or(0) == 0).then_some(())
    })
    .await;
    assert!(freed.is_some(), "{:?}", rig.get_cgroup(&group.rel).await);
    // Each pod's own cgroup saw only its own container's memory.
    assert_eq!(
        rig.get_cgroup(&p2.rel)
            .await
            .memory_current
            .get("all")
            .copied()
            .unwrap_or(0),
        0
    );
}

/// Where the kernel refuses `bpf_probe_write_user` (this machine's lockdown; the VM test covers
/// a kernel that allows it), gpud runs without the in-container memory view and says why: on
/// D-Bus, in `gpudctl status` and in its log; a limited cgroup reads the driver's own figures;
/// a reload of `virtualize_memory_info` is applied and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn the_memory_view_says_why_it_is_unavailable_and_limited_cgroups_read_the_real_figures() {
    use gpud_common::rm::fb;
    let Some(rig) = started("mem-view", "notify", false).await else {
        return;
    };
    let (_c, p) = rig.proxy().await;
    let caps = p.kernel_capabilities().await.expect("KernelCapabilities");
    let view = p.memory_info_view().await.expect("MemoryInfoView");
    if caps.get("probe_write_user") == Some(&true) {
        assert_eq!(view, "on", "the kernel allows the rewrite");
        eprintln!("SKIPPED: this kernel allows bpf_probe_write_user (the VM test covers the view)");
        return;
    }
    assert_eq!(caps.get("probe_write_user"), Some(&false), "{caps:?}");
    assert!(
        view.starts_with("unavailable: the kernel refuses bpf_probe_write_user ("),
        "{view}"
    );
    assert!(
        rig.log_text().contains("memory view unavailable"),
        "no start-up warning:\n{}",
        rig.log_text()
    );
    let status = |json: bool| {
        let mut cmd = std::process::Command::new(gpud_tests::gpudctl_bin());
        cmd.args(["--bus-address", &rig.bus.address, "status"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("run gpudctl");
        assert!(out.status.success(), "gpudctl status: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = status(false);
    assert!(
        text.contains(&format!("memory view:      {view}")),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(&status(true)).expect("status JSON");
    assert_eq!(json["memory_info_view"], view.as_str(), "{json}");

    let cg = Cgroup::new("mem-view");
    rig.set_limit(&cg.rel, "all", "memory_max", 8 * MIB).await;
    let mut pr = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (c, d) = pr.client_device(0);
    let s = pr.handle(&format!("subdevice {c} {d}"));
    pr.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    let v = pr.cmd(&format!(
        "fbinfo {c} {s} {:#x} {:#x}",
        fb::HEAP_SIZE,
        fb::HEAP_FREE
    ));
    let snap = rig.fake().snapshot();
    let gpu = &snap.gpus[0];
    assert_eq!(
        v["info"],
        serde_json::json!([
            [fb::HEAP_SIZE, gpu.capacity >> 10],
            [fb::HEAP_FREE, (gpu.capacity - gpu.used) >> 10]
        ]),
        "a limited cgroup reads the driver's figures where the view is unavailable: {v}"
    );
    let stats = p.get_kernel_stats().await.expect("GetKernelStats");
    assert_eq!(stats.get("memory_info_rewritten"), Some(&0), "{stats:?}");

    rig.config()
        .react_action("notify")
        .set("enforcement.virtualize_memory_info", false)
        .write();
    rig.signal(libc::SIGHUP);
    let log = eventually(Duration::from_secs(10), || async {
        let log = rig.log_text();
        log.lines()
            .any(|l| l.contains("live settings applied") && l.contains("memory_view"))
            .then_some(log)
    })
    .await
    .unwrap_or_else(|| panic!("reload not applied:\n{}", rig.log_text()));
    assert!(log.contains("enforcement.virtualize_memory_info"), "{log}");
    assert_eq!(
        p.memory_info_view().await.expect("MemoryInfoView"),
        view,
        "nothing to turn off"
    );
}

/// The guard rail behind the release rules: an object charged to a cgroup with neither a client
/// record nor a known control file (what a race of the rules would leave, and what the soak
/// found before the rules were fixed) is released by the next sweep, counted in the kernel's
/// `orphans_released` and logged at warn with its cgroup, bytes and age. It is stranded here by
/// writing it into the daemon's pinned maps, charge and all, as the probes would have.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_is_released_within_one_sweep_counted_and_logged() {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use gpud_common::{CgroupUsage, GPU_ALL, OBJ_MEMORY, ObjEntry, ObjKey, maps};
    use std::os::unix::fs::MetadataExt as _;

    let Some(rig) = started("mem-orphan", "notify", false).await else {
        return;
    };
    let cg = Cgroup::new("mem-orphan");
    let id = std::fs::metadata(&cg.dir).expect("stat cgroup").ino();
    let (_c, p) = rig.proxy().await;
    // A real allocation beside it, whose client and file are known: it must stay.
    let mut pr = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (c, d) = pr.client_device(0);
    pr.ok(&format!("alloc {c} {d} {} nvos21", 2 * MIB));
    rig.expect_memory(&cg.rel, &[("0", 2 * MIB), ("all", 2 * MIB)])
        .await;

    let pin = |name: &str| MapData::from_pin(rig.pins().join(name)).expect("pinned map");
    let mut usage: BpfHashMap<_, u64, CgroupUsage> =
        BpfHashMap::try_from(Map::HashMap(pin(maps::USAGE))).expect("USAGE");
    let mut objects: BpfHashMap<_, ObjKey, ObjEntry> =
        BpfHashMap::try_from(Map::HashMap(pin(maps::OBJECTS))).expect("OBJECTS");
    let bytes = 6 * MIB;
    let mut record = usage.get(&id, 0).expect("the cgroup's usage");
    for gpu in [0, GPU_ALL] {
        record.bytes[CgroupUsage::slot(gpu)] += bytes;
    }
    usage.insert(id, record, 0).expect("charge");
    // The probes' serials are CLOCK_MONOTONIC nanoseconds; the sweep judges objects older than
    // its own start.
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    let serial = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let orphan = ObjKey {
        client: 0xdead_0001,
        object: 0xdead_0002,
    };
    let entry = ObjEntry {
        kind: OBJ_MEMORY,
        parent: 0xdead_0003,
        gpu: 0,
        tgid: pr.pid,
        cgroup_id: id,
        bytes,
        file: 0,
        serial,
        charge: serial,
        ..ObjEntry::default()
    };
    objects.insert(orphan, entry, 0).expect("strand the object");
    let stranded = std::time::Instant::now();
    // It is charged (the sweep may already have taken it: then the wait below sees it gone).
    let r = p.get_cgroup(&cg.rel).await.expect("GetCgroup");
    assert!(
        [2 * MIB, 8 * MIB].contains(&r.memory_current["all"]),
        "{:?}",
        r.memory_current
    );

    // Within one sweep (1 s here) and the read path's refresh: only the real allocation is left.
    rig.expect_memory(&cg.rel, &[("0", 2 * MIB), ("all", 2 * MIB)])
        .await;
    let took = stranded.elapsed();
    assert!(took < Duration::from_secs(3), "released after {took:?}");
    assert!(
        objects.get(&orphan, 0).is_err(),
        "the orphan is still in OBJECTS"
    );
    let stats = p.get_kernel_stats().await.expect("GetKernelStats");
    assert_eq!(stats.get("orphans_released"), Some(&1), "{stats:?}");
    let log = rig.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("orphan released"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    for want in [
        "WARN",
        &format!("cgroup={}", cg.rel),
        &format!("bytes={bytes}"),
        "age_ms=",
        "client=3735879681",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }

    // The known allocation still goes the ordinary way, not as an orphan.
    let _ = pr.try_cmd("exit");
    pr.wait();
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;
    let stats = p.get_kernel_stats().await.expect("GetKernelStats");
    assert_eq!(stats.get("orphans_released"), Some(&1), "{stats:?}");
}
