//! Runs inside the Debian-kernel VM (`cargo xtask test` boots it under qemu), where BPF
//! trampolines and BPF-LSM load: checks attribution in **fentry** mode (and tracepoint mode on
//! the same kernel) through gpud's own probes and attribution code, with real cgroups and real
//! processes. D-Bus is covered by the host tests; this is about the kernel side.
//!
//! Prints `VMTEST RESULT: PASS` when every check holds.

use std::path::PathBuf;

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use gpud::{
    attribution::Attribution,
    cgroupfs::CgroupFs,
    config::{AttachPreference, ProbesConfig, ReactAction, TierPreference},
    probes::{AttachMode, DynamicMajors, Matcher, ProbeSetup, Probes, Tier, devices},
};
use gpud_api::CgroupRecord;
use gpud_common::nv;
use gpud_tests::{
    class_counts,
    inproc::{self, fork_held},
};

fn scenario(pref: AttachPreference, want: AttachMode) -> anyhow::Result<()> {
    let tag = want.as_str();
    let work = PathBuf::from(format!("/tmp/vmtest-{tag}"));
    std::fs::create_dir_all(&work)?;
    let standin = work.join("nvidiactl");
    std::fs::write(&standin, b"")?;

    let cgroups = CgroupFs::discover()?;
    let root = cgroups.root().to_owned();
    let majors = DynamicMajors::read()?;
    let extra = devices::resolve_extra_paths(std::slice::from_ref(&standin))?;
    let config = ProbesConfig {
        attach: pref,
        bpffs: PathBuf::from(format!("/sys/fs/bpf/{tag}")),
        keep_pinned: false,
        events_ring_kib: gpud_common::EVENTS_BYTES / 1024,
    };
    let probes = Probes::start(ProbeSetup {
        config: &config,
        majors,
        extra: &extra,
        cgroup2_root: &root,
        tier: TierPreference::React,
        react_action: ReactAction::Notify,
    })
    .context("starting probes")?;
    println!("[{tag}] capabilities: {:?}", probes.caps());
    ensure!(
        probes.mode() == want,
        "attached in {:?}, wanted {want:?}",
        probes.mode()
    );
    let matcher = Matcher { majors, extra };
    let mut attribution = Attribution::new(probes, cgroups, matcher)?;

    let cg_a = root.join(format!("vm-{tag}-a"));
    let cg_b = root.join(format!("vm-{tag}-b"));
    std::fs::create_dir_all(&cg_a)?;
    std::fs::create_dir_all(&cg_b)?;
    let rel = |p: &PathBuf| format!("/{}", p.file_name().unwrap_or_default().to_string_lossy());

    let s = standin.clone();
    let a = cg_a.clone();
    let held = fork_held(move || {
        if let Err(e) = inproc::join_cgroup(&a) {
            return format!("join: {e}");
        }
        let f = match std::fs::File::open(&s) {
            Ok(f) => f,
            Err(e) => return format!("open: {e}"),
        };
        let fd = inproc::fd(&f);
        inproc::issue(fd, 0xc030_462b, 5);
        inproc::issue(fd, 0xc010_4629, 3);
        inproc::issue(fd, 0xc020_462a, 2);
        inproc::issue(fd, 0xc0b8_464a, 1);
        inproc::issue(fd, nv::nv_iowr(nv::NV_ESC_RM_ALLOC, 36), 1);
        inproc::issue_xfer(fd, nv::NV_ESC_RM_ALLOC, 48, 2);
        if let Ok(null) = std::fs::File::open("/dev/null") {
            inproc::issue(inproc::fd(&null), 0xc030_462b, 4);
        }
        "ok".into()
    })?;
    ensure!(held.report == "ok", "child A: {}", held.report);
    let want_a = class_counts(&[
        ("alloc", 7),
        ("free", 3),
        ("control", 2),
        ("vid_heap", 1),
        ("other", 1),
    ]);
    let ra = CgroupRecord::from(attribution.get(&rel(&cg_a))?);
    ensure!(
        ra.ioctls == want_a,
        "A counts {:?} != {want_a:?}",
        ra.ioctls
    );
    ensure!(
        ra.pids == vec![held.pid],
        "A pids {:?} != [{}]",
        ra.pids,
        held.pid
    );

    let s = standin.clone();
    let b = cg_b.clone();
    let report = inproc::in_child(move || {
        if inproc::join_cgroup(&b).is_err() {
            return "join".into();
        }
        match std::fs::File::open(&s) {
            Ok(f) => inproc::issue(inproc::fd(&f), 0xc020_462b, 2),
            Err(e) => return format!("open: {e}"),
        }
        "ok".into()
    })?;
    ensure!(report == "ok", "child B: {report}");
    let rb = CgroupRecord::from(attribution.get(&rel(&cg_b))?);
    ensure!(
        rb.ioctls == class_counts(&[("alloc", 2)]),
        "B counts {:?}",
        rb.ioctls
    );
    ensure!(rb.pids.is_empty(), "B exited but pids {:?}", rb.pids);

    held.release();
    let ra = CgroupRecord::from(attribution.get(&rel(&cg_a))?);
    ensure!(ra.pids.is_empty(), "A exited but pids {:?}", ra.pids);
    ensure!(
        ra.ioctls == want_a,
        "A counts changed after exit: {:?}",
        ra.ioctls
    );
    let listed: Vec<String> = attribution.list().into_iter().map(|r| r.path).collect();
    ensure!(
        listed.contains(&rel(&cg_a)) && listed.contains(&rel(&cg_b)),
        "list {listed:?}"
    );

    attribution.shutdown(false);
    let _ = std::fs::remove_dir(&cg_a);
    let _ = std::fs::remove_dir(&cg_b);
    println!("[{tag}] attribution checks passed");
    Ok(())
}

/// Drains the probes' ring buffer into the attribution (the daemon's event loop does this).
fn pump(ring: &mut aya::maps::RingBuf<aya::maps::MapData>, attribution: &mut Attribution) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        if let Some(ev) = gpud::daemon::parse_event(&item) {
            attribution.on_kernel_event(&ev);
            n += 1;
        }
    }
    n
}

/// GPU memory in the fentry mode with the `deny` tier: a real BPF-LSM `file_ioctl` program
/// refuses, with ENOMEM and before the (fake) driver sees it, the allocation that would take a
/// cgroup over its limit; accounting follows allocations, and `security_file_free` releases a
/// closed file's clients. The fake NVIDIA control device (FUSE) answers the real RM ABI.
fn memory_deny() -> anyhow::Result<()> {
    const MIB: u64 = 1 << 20;
    // Orphans (the heir below) are re-parented here, so they can be reaped.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let fake = gpud_tests::fakenv::mount(
        std::path::Path::new("/tmp/vm-fake"),
        gpud_tests::fakenv::Options::default(),
    )
    .context("mounting the fake NVIDIA device")?;
    let ctl = fake.ctl();
    let cgroups = CgroupFs::discover()?;
    let root = cgroups.root().to_owned();
    let extra = devices::resolve_extra_paths(std::slice::from_ref(&ctl))?;
    let config = ProbesConfig {
        attach: AttachPreference::Auto,
        bpffs: PathBuf::from("/sys/fs/bpf/deny"),
        keep_pinned: false,
        events_ring_kib: gpud_common::EVENTS_BYTES / 1024,
    };
    let mut probes = Probes::start(ProbeSetup {
        config: &config,
        majors: DynamicMajors::read()?,
        extra: &extra,
        cgroup2_root: &root,
        tier: TierPreference::Deny,
        react_action: ReactAction::Notify,
    })
    .context("starting probes with enforcement.tier = deny")?;
    ensure!(probes.tier() == Tier::Deny, "tier {:?}", probes.tier());
    let mut ring = probes.take_events()?;
    let matcher = Matcher {
        majors: DynamicMajors::read()?,
        extra,
    };
    let mut attribution = Attribution::new(probes, cgroups, matcher)?;
    let cg = root.join("vm-deny");
    std::fs::create_dir_all(&cg)?;
    let (_, id) = attribution.id_of("/vm-deny")?;
    attribution.set_kernel_limit(id, gpud_common::GPU_ALL, 8 * MIB)?;

    let c = ctl.clone();
    let dir = cg.clone();
    let held = fork_held(move || {
        use gpud_tests::rm::{Ctl, Form};
        if let Err(e) = inproc::join_cgroup(&dir) {
            return format!("join: {e}");
        }
        let f = match std::fs::OpenOptions::new().read(true).write(true).open(&c) {
            Ok(f) => f,
            Err(e) => return format!("open: {e}"),
        };
        let rm = Ctl::new(&f);
        let client = rm.alloc_client().handle;
        let dev = rm.alloc_device(client, 0).handle;
        let first = rm.alloc_vidmem(client, dev, 4 * MIB, Form::Nvos64);
        let denied = rm.alloc_vidmem(client, dev, 6 * MIB, Form::Nvos21);
        let xfer_denied = rm.alloc_vidmem(client, dev, 6 * MIB, Form::Xfer64);
        let fits = rm.alloc_vidmem(client, dev, 2 * MIB, Form::VidHeap);
        let out = format!(
            "first={} denied={}/{} xfer={}/{} fits={}",
            first.ok(),
            denied.ret,
            denied.errno,
            xfer_denied.ret,
            xfer_denied.errno,
            fits.ok()
        );
        // A grandchild inherits the file and outlives its creator (a daemon's fork): the
        // driver keeps the client while it holds the file.
        // SAFETY: the grandchild only sleeps until it is killed.
        let keep = std::os::fd::AsRawFd::as_raw_fd(&f);
        let heir = unsafe { libc::fork() };
        if heir == 0 {
            // Only the control file: the report and release pipes must close with the child.
            for fd in 3..1024 {
                if fd != keep {
                    // SAFETY: closes descriptors this process does not use.
                    unsafe { libc::close(fd) };
                }
            }
            loop {
                // SAFETY: waits for a signal.
                unsafe { libc::pause() };
            }
        }
        // Keep the file open while the parent checks; it is closed when the child exits.
        std::mem::forget(f);
        format!("{out} heir={heir}")
    })?;
    let want = format!(
        "first=true denied=-1/{e} xfer=-1/{e} fits=true",
        e = libc::ENOMEM
    );
    let (report, heir) = held
        .report
        .rsplit_once(" heir=")
        .context("no heir in the child's report")?;
    let heir: i32 = heir.parse().context("heir pid")?;
    ensure!(report == want, "child: {report} (wanted {want})");
    ensure!(
        fake.snapshot().used_total() == 6 * MIB,
        "the driver saw a refused allocation: {:?}",
        fake.snapshot()
    );
    pump(&mut ring, &mut attribution);
    let m = attribution.memory_of(id);
    ensure!(
        m.current.get("all") == Some(&(6 * MIB)) && m.events == 2,
        "accounting after denials: {m:?}"
    );
    let stats = attribution.counters()?.stats();
    ensure!(
        stats.get("allocs_denied") == Some(&2),
        "kernel stats {stats:?}"
    );
    // The creator exits; the heir still holds the file, so the memory stays charged, and the
    // release rule's check of the file (`gpud_file_held`, this kernel's `f_count`) agrees.
    held.release();
    pump(&mut ring, &mut attribution);
    let released = attribution.release_closed_files();
    let m = attribution.memory_of(id);
    ensure!(
        released == 0 && m.current.get("all") == Some(&(6 * MIB)),
        "the creator's exit released memory the heir's file still holds: {released} released, {m:?}"
    );
    // The heir goes: the file's last reference with it. The check alone (before any event is
    // read) finds the file released.
    // SAFETY: kill(2) and waitpid(2) of our adopted grandchild (this process is a subreaper).
    unsafe {
        libc::kill(heir, libc::SIGKILL);
        libc::waitpid(heir, std::ptr::null_mut(), 0);
    }
    let released = attribution.release_closed_files();
    ensure!(
        released > 0 && attribution.memory_of(id).current.get("all") == Some(&0),
        "the check did not find the file released: {released} released, {:?}",
        attribution.memory_of(id)
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        pump(&mut ring, &mut attribution);
        if attribution.memory_of(id).current.get("all") == Some(&0) {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "memory not released after the file closed: {:?}",
            attribution.memory_of(id)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    attribution.shutdown(false);
    drop(fake);
    let _ = std::fs::remove_dir(&cg);
    println!("[deny] memory checks passed");
    Ok(())
}

/// The kernel-side checks, run inside the VM (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-vmtest")]
enum Cli {
    /// Runs every check; prints `VMTEST RESULT: PASS` when all hold.
    Test,
}

fn main() -> std::process::ExitCode {
    let Cli::Test = Cli::parse();
    let mut failed = Vec::new();
    let lsm = std::fs::read_to_string("/sys/kernel/security/lsm").unwrap_or_default();
    println!("kernel LSMs: {}", lsm.trim());
    for (pref, want) in [
        (AttachPreference::Fentry, AttachMode::Fentry),
        (AttachPreference::Tracepoint, AttachMode::Tracepoint),
    ] {
        if let Err(e) = scenario(pref, want) {
            println!("[{}] FAILED: {e:#}", want.as_str());
            failed.push(want.as_str());
        }
    }
    if gpud_tests::fakenv::available() {
        if let Err(e) = memory_deny() {
            println!("[deny] FAILED: {e:#}");
            failed.push("deny");
        }
    } else {
        println!("[deny] FAILED: /dev/fuse is absent in the VM");
        failed.push("deny");
    }
    // The capability report must see BPF-LSM on this kernel (booted with lsm=...,bpf).
    if let Err(e) = check_lsm_probe() {
        println!("[caps] FAILED: {e:#}");
        failed.push("caps");
    }
    if failed.is_empty() {
        println!("VMTEST RESULT: PASS");
        std::process::ExitCode::SUCCESS
    } else {
        println!("VMTEST RESULT: FAIL ({})", failed.join(", "));
        std::process::ExitCode::FAILURE
    }
}

fn check_lsm_probe() -> anyhow::Result<()> {
    let cgroups = CgroupFs::discover()?;
    let config = ProbesConfig {
        attach: AttachPreference::Auto,
        bpffs: PathBuf::from("/sys/fs/bpf/caps"),
        keep_pinned: false,
        events_ring_kib: gpud_common::EVENTS_BYTES / 1024,
    };
    let probes = Probes::start(ProbeSetup {
        config: &config,
        majors: DynamicMajors::default(),
        extra: &[],
        cgroup2_root: cgroups.root(),
        tier: TierPreference::React,
        react_action: ReactAction::Notify,
    })?;
    let caps = probes.caps().clone();
    let mode = probes.mode();
    probes.shutdown(false);
    if !(caps.fentry && caps.bpf_lsm && caps.tracepoint) {
        bail!("expected fentry, bpf_lsm and tracepoint on this kernel: {caps:?}");
    }
    ensure!(
        mode == AttachMode::Fentry,
        "auto chose {mode:?} although fentry loads"
    );
    Ok(())
}
