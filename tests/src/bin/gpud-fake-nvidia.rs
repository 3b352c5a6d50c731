//! Test fixture: a fake NVIDIA control device on FUSE (the server is
//! [`gpud_tests::fakenv`]; this is its command line).
//!
//! `gpud-fake-nvidia MOUNTDIR [--gpus N] [--capacity BYTES] [--page-size BYTES] [--verbose]
//!                   [--no-stdin] [--self-test]`
//!
//! Mounts the fake at MOUNTDIR (created if missing): `MOUNTDIR/nvidiactl` answers the RM ioctl
//! ABI, `MOUNTDIR/state` shows the state as JSON, `MOUNTDIR/inject` takes fault injections (see
//! the module docs of `fakenv`). Prints `READY` on stdout once mounted and serves until SIGTERM,
//! SIGINT or end of standard input (unless `--no-stdin`), then unmounts and exits 0. Defaults:
//! 1 GPU of 80 GiB, 2 MiB pages; sizes take `K`/`M`/`G` suffixes or `0x` hex.
//!
//! `--self-test` mounts, drives the fake from this process, from a child process it runs and
//! from a forked child (the VM test's pattern: fake served on a thread, tenants forked), checks
//! the state, prints `SELF-TEST PASS` and exits (0 on success): a smoke test that needs nothing
//! but this binary, e.g. inside the VM: `cargo xtask vm -- target/debug/gpud-fake-nvidia
//! /tmp/fake --self-test`.

use std::{
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use gpud_common::rm::{class, status};
use gpud_tests::{
    fakenv::{self, Options},
    inproc,
    rm::{Ctl, Form, MemRequest},
};

/// A fake NVIDIA control device on FUSE (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-fake-nvidia")]
struct Cli {
    /// Where to mount the fake (created if missing).
    #[arg(required_unless_present = "self_test_child")]
    dir: Option<PathBuf>,
    /// Number of GPUs.
    #[arg(long, default_value = "1", value_parser = size)]
    gpus: u64,
    /// Video memory of each GPU (K/M/G suffixes or 0x hex).
    #[arg(long, default_value = "80G", value_parser = size)]
    capacity: u64,
    /// Allocation granularity.
    #[arg(long, default_value = "2M", value_parser = size)]
    page_size: u64,
    /// Logs every ioctl to stderr.
    #[arg(long)]
    verbose: bool,
    /// Serves until a signal only, not until standard input ends.
    #[arg(long)]
    no_stdin: bool,
    /// Mounts, drives the fake from this process and from children, checks, unmounts.
    #[arg(long)]
    self_test: bool,
    /// The self-test's child: allocates on CTL and exits without freeing.
    #[arg(long, value_name = "CTL", hide = true)]
    self_test_child: Option<PathBuf>,
}

fn size(v: &str) -> Result<u64, String> {
    fakenv::parse_size(v).ok_or_else(|| format!("{v:?} is not a number"))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(ctl) = &cli.self_test_child {
        return self_test_child(ctl).context("self-test child");
    }
    let dir = cli.dir.expect("required unless --self-test-child");
    let opts = Options {
        gpus: cli.gpus as u32,
        capacity: cli.capacity,
        page_size: cli.page_size.max(1),
        verbose: cli.verbose,
    };
    // Block the stop signals before any thread starts, so that only `sigwait` below takes them.
    // SAFETY: plain signal-mask calls on a local set.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let fake = fakenv::mount(&dir, opts.clone())
        .with_context(|| format!("mounting the fake at {}", dir.display()))?;
    if cli.self_test {
        let r = self_test(&fake, &opts);
        fake.unmount().context("unmounting")?;
        r?;
        println!("SELF-TEST PASS");
        return Ok(());
    }
    println!("READY");
    std::io::stdout().flush()?;
    if !cli.no_stdin {
        // End of input stops the fake like a signal does.
        std::thread::spawn(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
            // SAFETY: signals our own process.
            unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
        });
    }
    let mut sig = 0;
    // SAFETY: waits on the blocked set built above.
    unsafe { libc::sigwait(&set, &mut sig) };
    fake.unmount().context("unmounting")?;
    Ok(())
}

/// Drives the fake from this process (another thread than the server's) and from a child.
fn self_test(fake: &fakenv::FakeNv, opts: &Options) -> anyhow::Result<()> {
    let page = opts.page_size;
    let file = File::options().read(true).write(true).open(fake.ctl())?;
    let ctl = Ctl::new(&file);
    let client = ctl.alloc_client();
    ensure!(client.ok(), "client: {client:?}");
    let device = ctl.alloc_device(client.handle, 0);
    ensure!(device.ok(), "device: {device:?}");
    let sub = ctl.alloc_subdevice(client.handle, device.handle);
    ensure!(sub.ok(), "subdevice: {sub:?}");
    let mut handles = vec![client.handle, device.handle, sub.handle];
    for form in Form::ALL {
        let m = ctl.alloc_vidmem(client.handle, sub.handle, 1, form);
        ensure!(m.ok() && m.size == page, "{}: {m:?}", form.name());
        handles.push(m.handle);
    }
    handles.sort_unstable();
    handles.dedup();
    ensure!(handles.len() == 9, "handles not unique: {handles:?}");
    let s = fake.snapshot();
    ensure!(s.used(0) == 6 * page, "used {} after 6 pages", s.used(0));
    let me = std::process::id();
    ensure!(s.memory().all(|o| o.pid == me), "creator pid: {s:?}");

    let too_big = ctl.alloc_vidmem(client.handle, device.handle, opts.capacity, Form::Nvos64);
    ensure!(
        too_big.ret == 0 && too_big.status == status::NV_ERR_NO_MEMORY,
        "over capacity: {too_big:?}"
    );
    let virt = ctl.alloc_memory(&MemRequest {
        flags: gpud_common::rm::NVOS32_ALLOC_FLAGS_VIRTUAL,
        ..MemRequest::vidmem(client.handle, device.handle, page, Form::Nvos21)
    });
    ensure!(
        virt.status == status::NV_ERR_INVALID_ARGUMENT,
        "virtual flag: {virt:?}"
    );
    let freed = ctl.free(client.handle, device.handle);
    ensure!(freed.ok(), "free device: {freed:?}");
    let s = fake.snapshot();
    ensure!(
        s.used(0) == 0 && s.objects.is_empty(),
        "after the device's free: {s:?}"
    );

    // A child process allocates and exits without freeing: its file's release frees it.
    let out = Command::new(std::env::current_exe()?)
        .arg("--self-test-child")
        .arg(fake.ctl())
        .stderr(Stdio::inherit())
        .output()
        .context("running the self-test child")?;
    ensure!(out.status.success(), "child failed: {out:?}");
    let line = String::from_utf8_lossy(&out.stdout);
    let line = line.lines().next().unwrap_or_default();
    let mut words = line.split_whitespace().skip(1).map(|w| w.parse::<u32>());
    let (Some(Ok(pid)), Some(Ok(child_client))) = (words.next(), words.next()) else {
        bail!("child said {line:?}");
    };
    println!("self-test: child {pid} allocated under client {child_client:#x}");
    let s = fake
        .wait(Duration::from_secs(5), |s| !s.has_client(child_client))
        .map_err(|s| anyhow::anyhow!("child's client not released: {s:?}"))?;
    ensure!(s.used(0) == 0, "child's memory not released: {s:?}");
    ensure!(s.stats.released >= 1, "no release counted: {s:?}");

    // A forked child of this process (which serves the fake on a thread), as the VM test runs
    // its tenants: it allocates and is held; its exit releases the file it opened.
    let ctl_path = fake.ctl();
    let held = inproc::fork_held(move || {
        let Ok(file) = File::options().read(true).write(true).open(&ctl_path) else {
            return "open failed".into();
        };
        let ctl = Ctl::new(&file);
        let c = ctl.alloc_client();
        let d = ctl.alloc_device(c.handle, 0);
        let m = ctl.alloc_vidmem(c.handle, d.handle, 1, Form::VidHeap);
        std::mem::forget(file);
        format!("{} {} {}", c.handle, m.status, m.size)
    })?;
    let words: Vec<u64> = held
        .report
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    ensure!(
        words.len() == 3 && words[1] == 0 && words[2] == page,
        "forked child said {:?}",
        held.report
    );
    let forked_client = words[0] as u32;
    let s = fake.snapshot();
    ensure!(
        s.memory()
            .any(|o| o.client == forked_client && o.pid == held.pid),
        "forked child's memory: {s:?}"
    );
    held.release();
    fake.wait(Duration::from_secs(5), |s| {
        !s.has_client(forked_client) && s.used(0) == 0
    })
    .map_err(|s| anyhow::anyhow!("forked child's client not released: {s:?}"))?;

    // Client freed through RM_FREE takes everything with it.
    let m = ctl.alloc_vidmem(client.handle, client.handle, page, Form::VidHeap);
    ensure!(
        m.status == status::NV_ERR_INVALID_OBJECT_PARENT,
        "memory under a client: {m:?}"
    );
    ensure!(ctl.free(client.handle, client.handle).ok(), "free client");
    ensure!(!fake.snapshot().has_client(client.handle), "client left");
    Ok(())
}

/// The child of `--self-test`: one client, device and 3 MiB of video memory, left allocated.
fn self_test_child(ctl_path: &Path) -> anyhow::Result<()> {
    let file = File::options().read(true).write(true).open(ctl_path)?;
    let ctl = Ctl::new(&file);
    let client = ctl.alloc_client();
    ensure!(client.ok(), "client: {client:?}");
    let device = ctl.alloc_device(client.handle, 0);
    ensure!(device.ok(), "device: {device:?}");
    let m = ctl.alloc_vidmem(client.handle, device.handle, 3 << 20, Form::Xfer64);
    ensure!(m.ok(), "memory: {m:?}");
    let s = fakenv::read_state(ctl_path.parent().unwrap_or(Path::new(".")))?;
    let o = s
        .object(client.handle, m.handle)
        .context("own allocation not in the state file")?;
    ensure!(
        o.pid == std::process::id() && o.class == class::MEMORY_LOCAL_USER && o.bytes == m.size,
        "state shows {o:?} for {m:?}"
    );
    let mut out = std::io::stdout().lock();
    writeln!(out, "CHILD {} {}", std::process::id(), client.handle)?;
    out.flush()?;
    // Exit with the file open and everything allocated.
    std::mem::forget(file);
    Ok(())
}
