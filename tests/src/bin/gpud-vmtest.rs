//! Runs inside the Debian-kernel VM (`cargo xtask test` boots it under qemu), where BPF
//! trampolines and BPF-LSM load: checks attribution in **fentry** mode (and tracepoint mode on
//! the same kernel) through gpud's own probes and attribution code, with real cgroups and real
//! processes. D-Bus is covered by the host tests; this is about the kernel side.
//!
//! Prints `VMTEST RESULT: PASS` when every check holds.

use std::path::PathBuf;

use anyhow::{Context as _, bail, ensure};
use gpud::{
    attribution::{Attribution, CgroupFs},
    config::{AttachPreference, ProbesConfig, ReactAction, TierPreference},
    probes::{AttachMode, DynamicMajors, Matcher, ProbeSetup, Probes, devices},
};
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
    let ra = attribution.get(&rel(&cg_a))?;
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
    let rb = attribution.get(&rel(&cg_b))?;
    ensure!(
        rb.ioctls == class_counts(&[("alloc", 2)]),
        "B counts {:?}",
        rb.ioctls
    );
    ensure!(rb.pids.is_empty(), "B exited but pids {:?}", rb.pids);

    held.release();
    let ra = attribution.get(&rel(&cg_a))?;
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

fn main() -> std::process::ExitCode {
    let cmd = std::env::args().nth(1).unwrap_or_default();
    if cmd != "test" {
        eprintln!("usage: gpud-vmtest test");
        return std::process::ExitCode::from(2);
    }
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
