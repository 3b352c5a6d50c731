//! Runs inside the Debian-kernel VM (`cargo xtask test` boots it under qemu), where BPF
//! trampolines and BPF-LSM load: checks attribution in **fentry** mode (and tracepoint mode on
//! the same kernel) through gpud's own probes and attribution code, with real cgroups and real
//! processes. D-Bus is covered by the host tests; this is about the kernel side.
//!
//! Prints `VMTEST RESULT: PASS` when every check holds.

mod attribution;
mod guard;
mod guard_calls;
mod matrix;
mod memory;
mod view;

use std::path::PathBuf;

// The checks' entry points and the helpers they share, for `main` and for each other.
use {attribution::*, guard::*, guard_calls::*, matrix::*, memory::*, view::*};

use anyhow::{Context as _, anyhow, bail, ensure};
use clap::Parser;
use gpud::{
    attribution::Attribution,
    config::{AttachPreference, DenyHookPreference, TierPreference},
    daemon::core::Opened,
    probes::{
        AttachMode, MemoryInfoState, Probes, Tier,
        events::{KernelEvent, Record},
    },
    report::Chain,
};
use gpud_api::CgroupRecord;
use gpud_common::{nv, rm::fb};
use gpud_tests::{
    TestConfig, class_counts,
    inproc::{self, fork_held},
};

/// gpud's kernel stack as the daemon opens it (`gpud::daemon::core::open`: the one rig), from
/// the tests' configuration: its state and bpffs under `/tmp/vmtest-stack-<tag>` (an earlier
/// run's pins and limits removed first; pins removed at the end), `device` as its extra device
/// file, NVML off, the shipped defaults (memory view on, guard enforcing, guard reaction `kill`)
/// and `keys` on top.
fn open_stack(
    tag: &str,
    device: &std::path::Path,
    keys: &[(&str, &str)],
) -> anyhow::Result<Opened> {
    let dir = stack_dir(tag);
    std::fs::create_dir_all(&dir)?;
    let _ = std::fs::remove_dir_all(Probes::pin_base(&dir.join("bpffs")));
    let _ = std::fs::remove_dir_all(dir.join("state"));
    let mut config = TestConfig::new(&dir)
        .extra_paths([device])
        .nvml_off()
        .react_action("notify");
    for (k, v) in keys {
        config = config.set(k, *v);
    }
    gpud::daemon::core::open(&config.parsed()).map_err(|e| anyhow!("{}", Chain(&e)))
}

/// Where [`open_stack`] keeps the stack `tag`'s state and mounts its bpffs.
fn stack_dir(tag: &str) -> PathBuf {
    PathBuf::from(format!("/tmp/vmtest-stack-{tag}"))
}

/// An opened core as the checks use it: the attribution, the settings' one writer and the cgroup
/// root; fails unless the probes attached in `want` (where one is wanted).
fn parts(
    core: gpud::daemon::core::Core,
    want: Option<AttachMode>,
) -> anyhow::Result<(
    gpud::probes::Probes,
    Attribution,
    gpud::probes::KernelSettings,
    PathBuf,
)> {
    let mode = core.probes.mode();
    if let Some(want) = want {
        ensure!(mode == want, "attached in {mode:?}, wanted {want:?}");
    }
    let root = core.attribution.cgroup_root().to_owned();
    Ok((core.probes, core.attribution, core.settings, root))
}

/// Waits (10 s at most) until the cgroup `id` holds no GPU memory, running `pump` (the ring's
/// records handed to the attribution) between looks; `what` names the wait in the error.
fn wait_uncharged(
    attribution: &mut Attribution,
    id: u64,
    what: &str,
    mut pump: impl FnMut(&mut Attribution) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        pump(attribution)?;
        if attribution.memory_of(id).current.get("all") == Some(&0) {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{what}: {:?}",
            attribution.memory_of(id)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The fake NVIDIA device mounted at `at`, and its control file.
fn stage(at: &str) -> anyhow::Result<(gpud_tests::fakenv::FakeNv, PathBuf)> {
    let fake = gpud_tests::fakenv::mount(
        std::path::Path::new(at),
        gpud_tests::fakenv::Options::default(),
    )
    .context("mounting the fake NVIDIA device")?;
    let ctl = fake.ctl();
    Ok((fake, ctl))
}

/// In a forked child: [`device_in`], then each allocation of `steps` (bytes, form) in turn on
/// device 0; the file (the caller decides how long it lives) and each call's reply.
fn allocs_in(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
    steps: &[(u64, gpud_tests::rm::Form)],
) -> Result<(std::fs::File, Vec<gpud_tests::rm::Reply>), String> {
    let (f, client, dev) = device_in(ctl, cgroup)?;
    let rm = gpud_tests::rm::Ctl::new(&f);
    let replies = steps
        .iter()
        .map(|&(size, form)| rm.alloc_vidmem(client, dev, size, form))
        .collect();
    Ok((f, replies))
}

/// In a forked child: joins `cgroup`, opens the control device `ctl` and makes a client and
/// device 0 there (file, client, device); what failed, as the child's report, otherwise.
fn device_in(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
) -> Result<(std::fs::File, u32, u32), String> {
    inproc::join_cgroup(cgroup).map_err(|e| format!("join: {e}"))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(ctl)
        .map_err(|e| format!("open: {e}"))?;
    let rm = gpud_tests::rm::Ctl::new(&f);
    let client = rm.alloc_client().handle;
    let dev = rm.alloc_device(client, 0).handle;
    Ok((f, client, dev))
}

/// Drains the probes' ring buffer into the attribution (the daemon's event loop does this).
fn pump(ring: &mut aya::maps::RingBuf<aya::maps::MapData>, attribution: &mut Attribution) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        if let Ok(Record::Event(ev)) = Record::decode(&item) {
            attribution.on_kernel_event(&ev);
            n += 1;
        }
    }
    n
}

/// The kernel-side checks, run inside the VM (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-vmtest")]
enum Cli {
    /// Runs every check; prints `VMTEST RESULT: PASS` when all hold, and the kernel matrix's
    /// row of a kernel booted as Debian does (`debian`, or `sid-debian` on sid's kernel).
    Test {
        #[arg(long, default_value = "debian")]
        row: String,
    },
    /// Runs one row of the kernel matrix on the running kernel (`debian`, `ubuntu`,
    /// `ubuntu-secure-boot`, `tracepoint-only`, `sid-debian`, `sid-ubuntu`, `host`); prints its `kernel-matrix:` line and
    /// `VMTEST RESULT: PASS` when the row's expectation holds.
    Row { name: String },
}

fn main() -> std::process::ExitCode {
    let (row, debian_row) = match Cli::parse() {
        Cli::Test { row } => (None, row),
        Cli::Row { name } => (Some(name), String::new()),
    };
    if let Some(name) = row {
        let lsm = std::fs::read_to_string("/sys/kernel/security/lsm").unwrap_or_default();
        let lockdown = std::fs::read_to_string("/sys/kernel/security/lockdown").unwrap_or_default();
        println!("kernel LSMs: {}; lockdown: {}", lsm.trim(), lockdown.trim());
        return match matrix_row(&name) {
            Ok(line) => {
                println!("{line}");
                println!("VMTEST RESULT: PASS");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                println!("kernel-matrix: {name}: FAILED: {e:#}");
                println!("VMTEST RESULT: FAIL ({name})");
                std::process::ExitCode::FAILURE
            }
        };
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
    if gpud_tests::fakenv::available() {
        for hook in [DenyHookPreference::Lsm, DenyHookPreference::FmodRet] {
            if let Err(e) = memory_deny(hook) {
                println!("[deny-{}] FAILED: {e:#}", hook.as_str());
                failed.push("deny");
            }
        }
        for (pref, want, name) in [
            (AttachPreference::Auto, AttachMode::Fentry, "view-fentry"),
            (
                AttachPreference::Tracepoint,
                AttachMode::Tracepoint,
                "view-tracepoint",
            ),
        ] {
            if let Err(e) = memory_view(pref, want) {
                println!("[{name}] FAILED: {e:#}");
                failed.push(name);
            }
        }
        for (pref, tier, hook, want, name) in [
            (
                AttachPreference::Auto,
                TierPreference::Deny,
                DenyHookPreference::Lsm,
                AttachMode::Fentry,
                "guard-deny-lsm",
            ),
            (
                AttachPreference::Auto,
                TierPreference::Deny,
                DenyHookPreference::FmodRet,
                AttachMode::Fentry,
                "guard-deny-fmod_ret",
            ),
            (
                AttachPreference::Tracepoint,
                TierPreference::React,
                DenyHookPreference::Auto,
                AttachMode::Tracepoint,
                "guard-tracepoint",
            ),
        ] {
            if let Err(e) = scheduler_guard(pref, tier, hook, want) {
                println!("[{name}] FAILED: {e:#}");
                failed.push(name);
            }
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
    if gpud_tests::fakenv::available() {
        match matrix_row(&debian_row) {
            Ok(line) => println!("{line}"),
            Err(e) => {
                println!("kernel-matrix: {debian_row}: FAILED: {e:#}");
                failed.push("matrix");
            }
        }
    }
    if failed.is_empty() {
        println!("VMTEST RESULT: PASS");
        std::process::ExitCode::SUCCESS
    } else {
        println!("VMTEST RESULT: FAIL ({})", failed.join(", "));
        std::process::ExitCode::FAILURE
    }
}
