//! A tenant against its memory limit, as an adversary: each test performs one route around the
//! limit with raw RM calls on the fake NVIDIA control device (`gpud-rm`, through
//! [`RmProcess`]), under a 64 MiB limit, and judges by the fake driver's ledger of the bytes
//! really held, not by gpud's own figures. docs/design.md ("Threat model") lists the routes,
//! what closes each and what remains.

use std::{os::unix::process::ExitStatusExt as _, time::Duration};

use gpud_tests::{Cgroup, Rig, RmProcess, TestConfig, eventually};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 64 * MIB;

/// gpud in the react tier with `kill`, its pins kept at exit (as in production), over the fake
/// device with one GPU and the fake NVML naming it; `max_objects` entries in its object map.
async fn started(tag: &str, max_objects: u32) -> Option<Rig> {
    started_with(tag, |c| {
        c.react_action("kill")
            .keep_pinned(true)
            .set("probes.max_objects", max_objects)
    })
    .await
}

/// gpud with the configuration `config` makes of the rig's, over the fake device with one GPU
/// and the fake NVML naming it, once NVML has answered.
async fn started_with(tag: &str, config: impl FnOnce(TestConfig) -> TestConfig) -> Option<Rig> {
    let mut rig = Rig::new(tag).fake_device(1)?.fake_gpus(1);
    rig.start(config(rig.config())).await;
    rig.wait_for_gpus(1).await;
    Some(rig)
}

/// `tenant` allocates `bytes` past its limit: it must not survive the call, and what it held
/// goes with it (the fake driver frees everything made through its file): the ledger is empty
/// right after.
async fn crosses_and_dies(rig: &Rig, tenant: &mut RmProcess, client: u32, device: u32, bytes: u64) {
    tenant.killed_in(
        &format!("alloc {client} {device} {bytes}"),
        &format!("the crossing allocation\n{}", rig.log_text()),
    );
    ledger_empties(rig).await;
}

/// The forked child `child` of `tenant` (sharing its file) allocates `bytes` past its limit: it
/// is killed in the call, and its parent, which reaps it, answers for it.
fn child_dies_crossing(
    rig: &Rig,
    tenant: &mut RmProcess,
    child: &impl std::fmt::Display,
    client: u32,
    device: u32,
    bytes: u64,
) {
    let answer = tenant.try_cmd(&format!("alloc {client} {device} {bytes}"));
    let reaped = match answer {
        Some(v) if v.get("reaped").is_some() => v,
        other => panic!(
            "the child {child} survived its crossing allocation: {other:?}\n{}",
            rig.log_text()
        ),
    };
    assert_eq!(reaped["code"], 128 + libc::SIGKILL, "{reaped}");
}

/// The fake driver holds no memory for anyone within 5 s.
async fn ledger_empties(rig: &Rig) {
    let freed = eventually(Duration::from_secs(5), || async {
        (rig.fake().snapshot().used_total() == 0).then_some(())
    })
    .await;
    assert!(
        freed.is_some(),
        "memory still held: {} bytes",
        rig.fake().snapshot().used_total()
    );
}

/// `tenant` in `cg` allocates 48 MiB, which its cgroup is charged, and closes its file, which
/// releases it: the driver holds nothing and the cgroup nothing.
async fn charged_then_released_by_close(rig: &Rig, cg: &Cgroup, tenant: &mut RmProcess) {
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    rig.expect_memory(&cg.rel, &[("all", 48 * MIB)]).await;
    tenant.ok("close");
    ledger_empties(rig).await;
    rig.expect_memory(&cg.rel, &[("all", 0)]).await;
}

/// An attack run as one `gpud-rm` command by a tenant under a 64 MiB limit must end with the
/// tenant killed in the call that took it over (the react tier with `kill`) and the fake driver
/// holding nothing; a tenant that answers got through, with what the ledger shows it holding.
async fn attack_dies(tag: &str, attack: impl FnOnce(u32, u32) -> String) {
    let Some(rig) = started(tag, gpud_common::MAX_OBJECTS).await else {
        return;
    };
    let cg = Cgroup::new(tag);
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    let line = attack(client, device);
    if let Some(answer) = tenant.try_cmd(&line) {
        let held = rig.fake().snapshot().used_total();
        panic!(
            "`{line}` got through under a {} MiB limit: the driver holds {} MiB for it, gpud \
             charged {:?}; it answered {answer}\n{}",
            LIMIT / MIB,
            held / MIB,
            rig.get_cgroup(&cg.rel).await.memory_current,
            rig.log_text()
        );
    }
    let status = tenant.wait();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    ledger_empties(&rig).await;
}

/// A device made before gpud first ran (no pinned maps to remember it) is not recorded: what is
/// allocated under it is on a GPU the probes cannot name, charged to `unknown`, where a limit on
/// GPU 0 alone would not apply. Such memory meets every per-GPU limit of its caller (fail
/// closed): the tenant is killed in its first allocation there, and nothing is held. That rule
/// is the kernel's, not a limit anyone set: it is not listed, and it goes with the last
/// per-GPU limit (a second such tenant allocates there once the limit is cleared).
#[tokio::test(flavor = "multi_thread")]
async fn memory_on_a_gpu_the_probes_cannot_name_meets_a_per_gpu_limit() {
    let tag = "rt-unknowngpu";
    let Some(rig) = Rig::new(tag).fake_device(1) else {
        return;
    };
    let mut rig = rig.fake_gpus(1);
    let cg = Cgroup::new(tag);
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    let mut later = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client2, device2) = later.client_device(0);
    rig.start(rig.config().react_action("kill")).await;
    rig.wait_for_gpus(1).await;
    rig.set_limit(&cg.rel, "0", "memory_max", LIMIT).await;
    rig.expect_in_force(&cg.rel, &[("0", LIMIT)]).await;
    tenant.killed_in(
        &format!("alloc {client} {device} {}", 16 * MIB),
        &format!(
            "an allocation under a device gpud never saw made\n{}",
            rig.log_text()
        ),
    );
    ledger_empties(&rig).await;
    let (_c, p) = rig.proxy().await;
    p.clear_limits(&cg.rel, "0", &[])
        .await
        .expect("ClearLimits");
    rig.expect_in_force(&cg.rel, &[]).await;
    later.ok(&format!("alloc {client2} {device2} {}", 16 * MIB));
    rig.expect_memory(&cg.rel, &[("unknown", 16 * MIB)]).await;
}

/// Duplicate, then free the original: the driver keeps memory while a duplicate lives, so each
/// round holds 16 MiB more. A duplicate is a reference to the original's charge: the bytes stay
/// charged until the last handle goes, and the fifth round crosses the limit.
#[tokio::test(flavor = "multi_thread")]
async fn dup_then_free_keeps_the_charge() {
    attack_dies("rt-dupfree", |c, d| {
        format!("dup-free {c} {d} {} 12", 16 * MIB)
    })
    .await;
}

/// A second thread rewrites `status` to a failure the moment the driver has answered: the
/// allocation looks refused to anything that reads it back, but the driver made it.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_status_still_charges() {
    attack_dies("rt-racestatus", |c, d| {
        format!("race-status {c} {d} {} 12", 16 * MIB)
    })
    .await;
}

/// A second thread rewrites the allocation's `size` to 4 KiB the moment the driver has written
/// the allocated size back: the charge never goes below what the call asked for.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_size_still_charges_the_request() {
    attack_dies("rt-racesize", |c, d| {
        format!("race-size {c} {d} {} 4096 12", 16 * MIB)
    })
    .await;
}

/// A failed allocation never takes an object's place: the tenant holds 48 MiB under a handle of
/// its choosing, then asks for 4 KiB under the same handle. The driver refuses the duplicate name
/// and writes a failure status, which under a limit may be a status rewritten by another thread
/// and so does not erase a charge; but it must not replace the live object's entry either (which
/// would leave 48 MiB held for a 4 KiB charge). Its next 32 MiB cross the limit.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_duplicate_handle_leaves_the_charge() {
    let Some(rig) = started("rt-dupname", gpud_common::MAX_OBJECTS).await else {
        return;
    };
    let cg = Cgroup::new("rt-dupname");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!(
        "alloc {client} {device} {} nvos21 handle=0x1000",
        48 * MIB
    ));
    let refused = tenant.cmd(&format!(
        "alloc {client} {device} 4096 nvos21 handle=0x1000"
    ));
    assert_eq!(refused["ok"], false, "{refused}");
    rig.expect_memory(&cg.rel, &[("all", 48 * MIB)]).await;
    crosses_and_dies(&rig, &mut tenant, client, device, 32 * MIB).await;
}

/// The restart window: a limit set by GPU UUID (as every Kubernetes plugin sets them) stays in
/// the kernel across a restart of gpud while NVML answers 10 s late, so the tenant that tries to
/// cross right after the restart is killed at its crossing call; the ledger never shows it over.
#[tokio::test(flavor = "multi_thread")]
async fn restart_window_a_uuid_limit_holds_while_nvml_answers_late() {
    let Some(mut rig) = started("rt-restart", gpud_common::MAX_OBJECTS).await else {
        return;
    };
    let cg = Cgroup::new("rt-restart");
    let uuid = gpud_tests::scenario::uuid(0);
    rig.set_limit(&cg.rel, &uuid, "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    rig.expect_memory(&cg.rel, &[("0", 48 * MIB), ("all", 48 * MIB)])
        .await;

    // gpud restarts (an upgrade, a crash) and NVML does not answer for 10 s.
    let lib = rig.nvml_dir().join("libnvidia-ml.so.1");
    let aside = rig.nvml_dir().join("libnvidia-ml.so.1.aside");
    std::fs::rename(&lib, &aside).expect("take the library away");
    rig.restart().await;
    let late = std::time::Instant::now();
    let (_c, p) = rig.proxy().await;
    assert!(!p.nvml_available().await.expect("NvmlAvailable"));
    crosses_and_dies(&rig, &mut tenant, client, device, 32 * MIB).await;

    // NVML answers 10 s after the restart: the limit is where it was.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(late.elapsed())).await;
    std::fs::rename(&aside, &lib).expect("put the library back");
    rig.wait_for_gpus(1).await;
    let mut again = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = again.client_device(0);
    again.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    crosses_and_dies(&rig, &mut again, client, device, 32 * MIB).await;
}

/// Full maps: a neighbour fills the host's object map with RM clients (they cost no GPU
/// memory; the map is 4,096 entries here, 262,144 by default, to keep the test short); the
/// limited tenant's next allocation, which the map cannot record (so no free of it could ever
/// be seen), fails closed: killed at the call (react `kill`), counted and signalled, rather than
/// uncharged and forgotten.
#[tokio::test(flavor = "multi_thread")]
async fn full_object_map_a_limited_tenant_fails_closed() {
    let Some(rig) = started("rt-fullmap", 4096).await else {
        return;
    };
    let cg = Cgroup::new("rt-fullmap");
    let other = Cgroup::new("rt-filler");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    let mut filler = RmProcess::spawn(Some(&other.dir), &rig.ctl());
    let started = std::time::Instant::now();
    let filled = filler.cmd("clients 4096");
    println!("{filled} in {:?}", started.elapsed());
    let (_c, p) = rig.proxy().await;
    let full = eventually(Duration::from_secs(10), || async {
        let stats = p.get_kernel_stats().await.ok()?;
        (stats.get("objects_map_full").copied().unwrap_or(0) > 0).then_some(())
    })
    .await;
    assert!(full.is_some(), "the object map never filled: {filled}");
    crosses_and_dies(&rig, &mut tenant, client, device, 16 * MIB).await;
    filler.finish();
}

/// A crossing allocation kept by another holder of the file: the caller, a forked child sharing
/// its parent's control file, is killed in its crossing call, but the parent keeps the file and
/// with it everything made through it. gpud frees the crossing allocation itself through the
/// parent's file, so the cgroup is back to what it held within its limit (the parent's and the
/// child's allocations before the crossing stay, as the tenant made them).
#[tokio::test(flavor = "multi_thread")]
async fn a_crossing_allocation_kept_by_another_holder_is_freed() {
    let Some(rig) = started("rt-keptfile", gpud_common::MAX_OBJECTS).await else {
        return;
    };
    let cg = Cgroup::new("rt-keptfile");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!("alloc {client} {device} {}", 16 * MIB));
    let child = tenant.ok("fork");
    tenant.ok(&format!("alloc {client} {device} {}", 32 * MIB));
    child_dies_crossing(&rig, &mut tenant, &child, client, device, 32 * MIB);
    let within = eventually(Duration::from_secs(5), || async {
        (rig.fake().snapshot().used_total() == 48 * MIB).then_some(())
    })
    .await;
    assert!(
        within.is_some(),
        "the driver holds {} MiB for the tenant under its {} MiB limit (the crossing 32 MiB kept \
         by the parent's file)\n{}",
        rig.fake().snapshot().used_total() / MIB,
        LIMIT / MIB,
        rig.log_text()
    );
    let charged = eventually(Duration::from_secs(5), || async {
        let r = rig.get_cgroup(&cg.rel).await;
        (r.memory_current.get("all").copied() == Some(48 * MIB)).then_some(())
    })
    .await;
    assert!(
        charged.is_some(),
        "gpud charges {:?}, the driver holds 48 MiB",
        rig.get_cgroup(&cg.rel).await.memory_current
    );
    tenant.ok(&format!("free {client} {client}"));
    ledger_empties(&rig).await;
}

/// Per-cgroup caps: a neighbour making RM clients in a loop (they cost no GPU memory) stops at
/// its cgroup's cap (`probes.max_objects_per_cgroup`, 1,024 here, in a map of 4,096), so the map
/// the host shares keeps room: the limited tenant beside it allocates within its limit, charged
/// to the byte, and is still stopped at its crossing. Without the cap the neighbour fills the map
/// and the tenant's allocation within its limit, which the map cannot record, counts as crossing.
#[tokio::test(flavor = "multi_thread")]
async fn a_neighbour_filling_the_object_map_stops_at_its_cgroup_cap() {
    let Some(rig) = started_with("rt-objcap", |c| {
        c.react_action("kill")
            .keep_pinned(true)
            .set("probes.max_objects", 4096)
            .set("probes.max_objects_per_cgroup", 1024)
    })
    .await
    else {
        return;
    };
    let cg = Cgroup::new("rt-objcap");
    let other = Cgroup::new("rt-objcap-filler");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    let mut filler = RmProcess::spawn(Some(&other.dir), &rig.ctl());
    let filled = filler.cmd("clients 4096");
    let line = format!("alloc {client} {device} {}", 48 * MIB);
    if tenant.try_cmd(&line).is_none() {
        panic!(
            "the tenant died in an allocation within its limit after its neighbour made \
             clients ({filled}): {:?}\n{}",
            tenant.wait(),
            rig.log_text()
        );
    }
    let (_c, p) = rig.proxy().await;
    let stats = eventually(Duration::from_secs(10), || async {
        let stats = p.get_kernel_stats().await.ok()?;
        (stats.get("objects_cgroup_cap").copied().unwrap_or(0) > 0).then_some(stats)
    })
    .await
    .unwrap_or_else(|| panic!("the filler never met its cgroup's cap: {filled}"));
    assert_eq!(
        stats.get("objects_map_full").copied(),
        Some(0),
        "the host's map filled: {stats:?}"
    );
    let r = rig.get_cgroup(&cg.rel).await;
    assert_eq!(
        r.memory_current.get("all").copied(),
        Some(48 * MIB),
        "the tenant's allocation within its limit is charged\n{}",
        rig.log_text()
    );
    crosses_and_dies(&rig, &mut tenant, client, device, 32 * MIB).await;
    filler.finish();
}

/// A full process map: a neighbour's process holding an NVIDIA file forks children until the
/// host's process map is full (1,024 entries here, 65,536 by default); the limited tenant then
/// forks, and its child, which the map cannot record, allocates past the limit on the inherited
/// file. The child is still followed to its calls' returns, so its crossing allocation is charged
/// and it is killed.
#[tokio::test(flavor = "multi_thread")]
async fn full_process_map_a_forked_child_is_still_followed() {
    let Some(rig) = started_with("rt-fullprocs", |c| {
        c.react_action("kill").set("probes.max_procs", 1024)
    })
    .await
    else {
        return;
    };
    let cg = Cgroup::new("rt-fullprocs");
    let other = Cgroup::new("rt-forker");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    let mut filler = RmProcess::spawn(Some(&other.dir), &rig.ctl());
    filler.client_device(0);
    filler.ok("forks 1100");
    let (_c, p) = rig.proxy().await;
    let full = eventually(Duration::from_secs(10), || async {
        let stats = p.get_kernel_stats().await.ok()?;
        (stats.get("procs_map_full").copied().unwrap_or(0) > 0).then_some(())
    })
    .await;
    assert!(full.is_some(), "the process map never filled");

    let child = tenant.ok("fork");
    tenant.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    child_dies_crossing(&rig, &mut tenant, &child, client, device, 32 * MIB);
    tenant.ok(&format!("free {client} {client}"));
    ledger_empties(&rig).await;
    filler.finish();
}

/// A 32-bit tenant: its open, RM calls and close go through the i386 system-call entry, as an
/// `-m32` build's do, which the `syscalls:*` tracepoints skip. Every mode sees it (tracepoint
/// mode on the raw `sys_enter`/`sys_exit` tracepoints, fentry on the compat hooks): its
/// allocations are charged, a close releases them, and crossing the limit kills it in the
/// call. Nothing is reported unseen.
#[cfg(target_arch = "x86_64")]
#[tokio::test(flavor = "multi_thread")]
async fn a_32_bit_tenant_is_charged_and_held_to_its_limit() {
    let tag = "rt-compat32";
    let Some(rig) = started(tag, gpud_common::MAX_OBJECTS).await else {
        return;
    };
    let cg = Cgroup::new(tag);
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let Some(mut tenant) = RmProcess::spawn_32bit(Some(&cg.dir), &rig.ctl()) else {
        println!("SKIPPED: this kernel has no IA32 emulation, so no 32-bit callers");
        return;
    };
    let (_c, p) = rig.proxy().await;
    let unseen = p.unseen_calls().await.expect("UnseenCalls");
    assert!(unseen.is_empty(), "reported unseen: {unseen:?}");

    // Charged, and released with the file by a 32-bit close.
    charged_then_released_by_close(&rig, &cg, &mut tenant).await;

    // Opened again through the i386 entry; crossing the limit is stopped in the call.
    tenant.ok("open");
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    rig.expect_memory(&cg.rel, &[("all", 48 * MIB)]).await;
    crosses_and_dies(&rig, &mut tenant, client, device, 32 * MIB).await;
}

/// Where 32-bit callers are not followed (`probes.follow_32bit = false`, for hosts with no 32-bit
/// entry) their RM calls go unseen in tracepoint mode, and the daemon says so rather than leave
/// it to a debug line: `UnseenCalls` on D-Bus, a warning at start and in `gpudctl status`. The
/// 64-bit calls, then on the `syscalls:*` tracepoints instead of the raw ones, are charged and
/// released with their file's close.
#[tokio::test(flavor = "multi_thread")]
async fn unfollowed_32_bit_calls_are_reported() {
    let Some(mut rig) = Rig::new("rt-no32").fake_device(1) else {
        return;
    };
    rig = rig.fake_gpus(1);
    rig.start(rig.config().set("probes.follow_32bit", false))
        .await;
    let (_c, p) = rig.proxy().await;
    if p.attach_mode().await.expect("AttachMode") != "tracepoint" {
        println!("SKIPPED: fentry mode follows 32-bit callers on the ioctl hooks");
        return;
    }
    let unseen = p.unseen_calls().await.expect("UnseenCalls");
    let why = unseen.get("32-bit ioctls").expect("32-bit ioctls reported");
    assert!(why.contains("probes.follow_32bit = false"), "{why}");
    assert!(
        rig.log_text()
            .contains("the probes do not see 32-bit ioctls"),
        "{}",
        rig.log_text()
    );
    let out = std::process::Command::new(gpud_tests::gpudctl_bin())
        .args(["--bus-address", &rig.bus.address, "status"])
        .output()
        .expect("gpudctl status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("WARNING: unseen:  32-bit ioctls"), "{text}");

    let cg = Cgroup::new("rt-no32");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    charged_then_released_by_close(&rig, &cg, &mut tenant).await;
}

/// Params the probes cannot read: the tenant puts each allocation's params on a page it mapped
/// and never touched (a fresh shared mapping of a memfd). The driver's copy faults the page in;
/// a probe's read of user memory may not fault, so the entry side sees no size. An allocation
/// the probes cannot size meets its caller's limit: killed in its first call, nothing held.
#[tokio::test(flavor = "multi_thread")]
async fn unsized_params_meet_the_limit() {
    attack_dies("rt-unsized", |c, d| {
        format!("unsized {c} {d} {} 12", 16 * MIB)
    })
    .await;
}

/// A route the probes cannot see at the call, performed so that it always succeeds: a second
/// thread changes what the driver reads after the probes read it and puts it back once the
/// driver answered. The fake driver answers 50 ms late (`delay-ioctl-ms`) so the racer's writes
/// land inside the window every time; on a real driver the window is microseconds and a racer
/// hits it by chance. The probes charge what they read; the driver made something else. What
/// catches it is what gpud reads back from the driver right after the call (NVML off): the
/// tenant dies, its memory goes with its file, and gpud says why (`said`).
async fn caught_after_the_call(
    tag: &str,
    gpus: u32,
    limit_on: &str,
    said: &str,
    attack: impl FnOnce(&mut RmProcess) -> String,
) {
    let Some(mut rig) = Rig::new(tag).fake_device(gpus) else {
        return;
    };
    rig = rig.fake_gpus(gpus);
    rig.start(
        rig.config()
            .react_action("kill")
            .set("enforcement.nvml_backstop_secs", 0),
    )
    .await;
    rig.wait_for_gpus(gpus).await;
    let cg = Cgroup::new(tag);
    rig.set_limit(&cg.rel, limit_on, "memory_max", LIMIT).await;
    rig.fake()
        .inject("delay-ioctl-ms 50")
        .expect("delay the fake");
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let line = attack(&mut tenant);
    let started = std::time::Instant::now();
    match tenant.try_cmd(&line) {
        // Killed before its last call returned.
        None => println!("`{line}`: killed in the attack"),
        Some(answer) => {
            let held = rig.fake().snapshot().used_total();
            let charged = rig.get_cgroup(&cg.rel).await.memory_current;
            println!(
                "`{line}` got past the probes: the driver holds {} MiB, gpud charged {charged:?}; \
                 {answer}",
                held / MIB
            );
            panic!(
                "the whole attack ran ({}): the read-back never acted\n{}",
                if held > LIMIT {
                    "crossing"
                } else {
                    "not even crossing"
                },
                rig.log_text()
            );
        }
    }
    let freed = eventually(Duration::from_secs(15), || async {
        (rig.fake().snapshot().used_total() == 0).then_some(())
    })
    .await;
    assert!(
        freed.is_some(),
        "never acted on: the driver holds {} MiB under a {} MiB limit\n{}",
        rig.fake().snapshot().used_total() / MIB,
        LIMIT / MIB,
        rig.log_text()
    );
    println!(
        "the driver's ledger empty {} ms after the attack began",
        started.elapsed().as_millis()
    );
    let status = tenant.wait();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    // Logged once the object is freed, which may be after the kill emptied the ledger.
    let logged = eventually(Duration::from_secs(5), || async {
        rig.log_text().contains(said).then_some(())
    })
    .await;
    assert!(
        logged.is_some(),
        "killed, but not by the read-back:\n{}",
        rig.log_text()
    );
}

/// What gpud logs when the size read back takes a tenant over its limit.
const SIZE_READ_BACK: &str =
    "the driver holds more for a limited tenant's allocations than the probes charged";
/// What gpud logs when an object a limited tenant freed is still there.
const FREE_READ_BACK: &str = "a limited tenant's freed object is still held by the driver";
/// What gpud logs when a device read back is on a GPU where the tenant's limit applies.
const DEVICE_READ_BACK: &str =
    "a limited tenant's device is on another GPU than the probes recorded";

/// Racing the driver's copy of a wrapped call: the tenant's XFER'd allocations read as 4 KiB
/// at the entry, and a second thread points their `pAllocParms` at 16 MiB params while the
/// driver has yet to copy them (and back once it answered). The driver's size of each, read
/// back after the call, takes the cgroup over its limit at the fifth.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_drivers_copy_of_an_xfer_is_caught_by_the_size_read_back() {
    caught_after_the_call("rt-racexfer", 1, "all", SIZE_READ_BACK, |t| {
        let (c, d) = t.client_device(0);
        format!("race-xfer {c} {d} {} 4096 12 10", 16 * MIB)
    })
    .await;
}

/// Racing the driver's copy of a duplicate's source: each round, an XFER'd duplicate the
/// probes read as one of a 4 KiB allocation is made by the driver of a 16 MiB one (a second
/// thread changes the wrapped NVOS55's `hObjectSrc` while the driver has yet to copy it), and
/// the 16 MiB original is freed: the driver keeps it for the duplicate, the probes uncharge it.
/// The duplicate's size, read back after the call, counts against the limit.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_drivers_copy_of_a_duplicates_source_is_caught_by_the_size_read_back() {
    caught_after_the_call("rt-racedup", 1, "all", SIZE_READ_BACK, |t| {
        let (c, d) = t.client_device(0);
        format!("race-dup {c} {d} {} 4096 12 10", 16 * MIB)
    })
    .await;
}

/// Racing the driver's copy of a free's handle: each round, 16 MiB and 4 KiB are allocated and
/// a wrapped free the probes read as one of the 16 MiB allocation reaches the driver as one of the 4 KiB
/// one (a second thread changes `hObjectOld` while the driver has yet to copy it). The probes
/// release 16 MiB the driver keeps; read back after the call, the object is still there.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_drivers_copy_of_a_free_is_caught_by_the_free_read_back() {
    caught_after_the_call("rt-racefree", 1, "all", FREE_READ_BACK, |t| {
        let (c, d) = t.client_device(0);
        format!("race-free {c} {d} {} 4096 12 10", 16 * MIB)
    })
    .await;
}

/// The same race on a whole client: each round a new client with a device, 16 MiB and 4 KiB;
/// the free the probes read as one of the client (everything in it released, by the daemon on
/// the kernel's event) reaches the driver as one of the 4 KiB allocation. The client is still
/// there when read back.
#[tokio::test(flavor = "multi_thread")]
async fn racing_the_drivers_copy_of_a_clients_free_is_caught_by_the_free_read_back() {
    caught_after_the_call("rt-racefreeclient", 1, "all", FREE_READ_BACK, |_| {
        format!("race-free-client {} 4096 12 10", 16 * MIB)
    })
    .await;
}

/// Racing the driver's copy of a device's `deviceId`: the probes record a device of GPU 1 that
/// the driver made on GPU 0, so what the tenant allocates under it is charged to GPU 1, where
/// its limit (on GPU 0) does not apply. The device's GPU, read back after the call, is GPU 0:
/// the tenant is killed and the device freed with what it made below it.
#[tokio::test(flavor = "multi_thread")]
async fn a_device_raced_to_another_gpu_is_caught_by_the_device_read_back() {
    caught_after_the_call("rt-racedevice", 2, "0", DEVICE_READ_BACK, |t| {
        let client = t.handle("client");
        format!("race-device {client} 0 1 {} 12 10", 16 * MIB)
    })
    .await;
}

/// The same race to a device instance the driver cannot have (40; it has 32 at most): the probes
/// record that instance, and what is allocated under the device is charged to `unknown`, never
/// to a GPU 40 that no limit names. Unlimited here, so that no read-back moves it: the view
/// shows where the programs charged it.
#[tokio::test(flavor = "multi_thread")]
async fn a_device_raced_to_an_impossible_instance_is_charged_to_unknown() {
    let tag = "rt-device40";
    let Some(rig) = Rig::new(tag).fake_device(1) else {
        return;
    };
    let mut rig = rig.fake_gpus(1);
    rig.start(rig.config()).await;
    rig.wait_for_gpus(1).await;
    let cg = Cgroup::new(tag);
    rig.fake()
        .inject("delay-ioctl-ms 50")
        .expect("delay the fake");
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let client = tenant.handle("client");
    tenant.ok(&format!("race-device {client} 0 40 {} 2 10", 16 * MIB));
    let r = rig
        .expect_memory(&cg.rel, &[("unknown", 32 * MIB), ("all", 32 * MIB)])
        .await;
    assert!(
        !r.memory_current.contains_key("40"),
        "{:?}",
        r.memory_current
    );
}
