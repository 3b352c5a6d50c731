//! In-process fixtures for the VM test and the benchmark, which run where no second binary or
//! D-Bus is at hand: forked children that join a cgroup and issue ioctls, held until released.

use std::{
    fs::File,
    io::{Read, Write},
    os::fd::{AsRawFd, FromRawFd},
    path::Path,
};

/// This process's pid, for [`on_interrupt`]'s handler (a forked child has another).
static MAIN_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// The write end of [`on_interrupt`]'s pipe (-1: none).
static WAKE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn interrupted(sig: libc::c_int) {
    use std::sync::atomic::Ordering::Relaxed;
    // SAFETY: getpid(2), write(2) and _exit(2) are async-signal-safe.
    unsafe {
        if libc::getpid() != MAIN_PID.load(Relaxed) {
            // A child forked to issue calls: the benchmark it served is ending.
            libc::_exit(128 + sig);
        }
        let b = sig as u8;
        libc::write(WAKE.load(Relaxed), (&raw const b).cast(), 1);
    }
}

/// Runs `cleanup`, then exits with 128 + the signal, when this process is interrupted
/// (SIGINT, SIGTERM, SIGHUP): what a benchmark made on the host would otherwise outlive it, its
/// bpffs with gpud's probes pinned above all (attached to every process on the host until
/// someone unmounts it). A second signal during the cleanup ends the process at once; children
/// forked without exec end on such a signal; exec'd ones get the default action back.
pub fn on_interrupt(cleanup: impl FnOnce() + Send + 'static) -> anyhow::Result<()> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    use std::sync::atomic::Ordering::Relaxed;
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) fills the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: the read end is ours alone; the write end stays open as long as the process (the
    // handler may run at any time).
    let mut read = unsafe { File::from_raw_fd(fds[0]) };
    MAIN_PID.store(std::process::id() as i32, Relaxed);
    WAKE.store(fds[1], Relaxed);
    std::thread::Builder::new()
        .name("on-interrupt".into())
        .spawn(move || {
            let mut sig = [0u8];
            if read.read_exact(&mut sig).is_ok() {
                cleanup();
                std::process::exit(128 + i32::from(sig[0]));
            }
        })?;
    let action = SigAction::new(
        SigHandler::Handler(interrupted),
        SaFlags::SA_RESTART | SaFlags::SA_RESETHAND,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler does only async-signal-safe calls.
        unsafe { sigaction(sig, &action) }?;
    }
    Ok(())
}

/// The benchmarks' `--mode`: how gpud's probes attach (`tracepoint` or `fentry`).
pub fn attach_mode(s: &str) -> Result<gpud::probes::AttachMode, String> {
    match s {
        "tracepoint" => Ok(gpud::probes::AttachMode::Tracepoint),
        "fentry" => Ok(gpud::probes::AttachMode::Fentry),
        _ => Err("tracepoint or fentry".to_owned()),
    }
}

/// gpud's eBPF object loaded for a benchmark's empty reference programs, its maps pinned under
/// `pins` (a bpffs directory), with the kernel's BTF; nothing attached yet.
pub fn reference_object(pins: &Path) -> anyhow::Result<(aya::Ebpf, aya::Btf)> {
    let btf = aya::Btf::from_sys_fs()?;
    let ebpf = aya::EbpfLoader::new()
        .btf(Some(&btf))
        .allow_unsupported_maps()
        .default_map_pin_directory(pins)
        .load(gpud::probes::ebpf_object())?;
    Ok((ebpf, btf))
}

/// Attaches the empty reference program of `mode`'s ioctl entry: `gpud_noop_raw_tp` on the raw
/// tracepoints `raw` (tracepoint mode), or `gpud_noop_fentry` on `security_file_ioctl`. Returns
/// its name.
pub fn attach_noop_entry(
    ebpf: &mut aya::Ebpf,
    btf: &aya::Btf,
    mode: gpud::probes::AttachMode,
    raw: &[&str],
) -> anyhow::Result<&'static str> {
    use anyhow::Context as _;
    use aya::programs::{FEntry, RawTracePoint};
    use gpud_common::programs::{NOOP_FENTRY, NOOP_RAW_TP};
    Ok(match mode {
        gpud::probes::AttachMode::Tracepoint => {
            let p: &mut RawTracePoint = ebpf
                .program_mut(NOOP_RAW_TP)
                .context(NOOP_RAW_TP)?
                .try_into()?;
            p.load()?;
            for tp in raw {
                p.attach(tp)?;
            }
            NOOP_RAW_TP
        }
        gpud::probes::AttachMode::Fentry => {
            let p: &mut FEntry = ebpf
                .program_mut(NOOP_FENTRY)
                .context(NOOP_FENTRY)?
                .try_into()?;
            p.load("security_file_ioctl", btf)?;
            p.attach()?;
            NOOP_FENTRY
        }
    })
}

/// The names of gpud's programs already loaded in the kernel, and the pin directories of gpud's
/// probes (`…/gpud/v<ABI>`) in every bpffs mounted: a benchmark that finds any would measure a
/// host where gpud's probes already run (a daemon, probes a stopped one left pinned with
/// `probes.keep_pinned`, or a benchmark or test killed before it could unmount its own bpffs),
/// so that "detached" is not detached.
pub fn foreign_probes() -> (Vec<String>, Vec<std::path::PathBuf>) {
    let mut names: Vec<String> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| p.name_as_str().map(str::to_owned))
        .filter(|n| n.starts_with("gpud_"))
        .collect();
    names.sort();
    names.dedup();
    let mut pins = Vec::new();
    let mut dirs: Vec<(std::path::PathBuf, u32)> = crate::paths::mount_points("bpf")
        .into_iter()
        .map(|m| (m, 0))
        .collect();
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name() == "gpud" {
                pins.push(path);
            } else if depth < 3 {
                dirs.push((path, depth + 1));
            }
        }
    }
    pins.sort();
    (names, pins)
}

/// Refuses to measure where gpud's probes already run (see [`foreign_probes`]).
pub fn refuse_foreign_probes() -> anyhow::Result<()> {
    // The kernel frees a program some time after its last holder went (a bench run just before
    // this one, a test's daemon): give that time before calling them someone else's.
    let waited = std::time::Instant::now();
    let (names, pins) = loop {
        let (names, pins) = foreign_probes();
        if names.is_empty() {
            return Ok(());
        }
        if waited.elapsed() > std::time::Duration::from_secs(10) {
            break (names, pins);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let pins: Vec<String> = pins.iter().map(|p| p.display().to_string()).collect();
    anyhow::bail!(
        "gpud's programs are still loaded after 10 s ({}): a gpud daemon is running, or a stopped one \
         or a killed benchmark or test left its probes pinned ({}); stop the daemon, or remove \
         those pin directories (unmount a bpffs of a benchmark's or test's own directory), and \
         run again",
        names.join(", "),
        if pins.is_empty() {
            "no pin directory found in any bpffs mounted".to_owned()
        } else {
            pins.join(", ")
        }
    )
}

/// Joins the cgroup v2 directory `dir` (the calling process only).
pub fn join_cgroup(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
}

/// Issues `cmd` `n` times on `fd` with a scratch buffer as argument.
pub fn issue(fd: i32, cmd: u32, n: u64) {
    let mut buf = [0u8; 16384];
    for _ in 0..n {
        // SAFETY: the buffer is large enough for any encoded size; results are ignored.
        unsafe { libc::ioctl(fd, cmd as _, buf.as_mut_ptr()) };
    }
}

/// Issues `cmd` on a zeroed buffer `n` times through the i386 entry, as a 32-bit process does
/// ([`crate::ia32`]); false (nothing issued) where the kernel has no such entry.
pub fn issue_32(fd: i32, cmd: u32, n: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !crate::ia32::available() {
            return false;
        }
        let Ok(page) = crate::ia32::LowPage::new() else {
            return false;
        };
        for _ in 0..n {
            // SAFETY: our descriptor and page (a page covers any encoded size the tests use).
            unsafe { crate::ia32::syscall3(crate::ia32::NR_IOCTL, fd as u32, cmd, page.addr()) };
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (fd, cmd, n);
        false
    }
}

/// Issues `cmd` on a zeroed buffer `n` times through the x32 entry ([`crate::ia32::x32`]); false
/// (nothing issued) where the kernel serves no x32 calls.
pub fn issue_x32(fd: i32, cmd: u32, n: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ia32::{LowPage, x32};
        if !x32::available() {
            return false;
        }
        let Ok(page) = LowPage::new() else {
            return false;
        };
        for _ in 0..n {
            // SAFETY: our descriptor and page.
            unsafe { x32::ioctl(fd, cmd, page.addr()) };
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (fd, cmd, n);
        false
    }
}

/// Issues an `NV_ESC_IOCTL_XFER_CMD` wrapping escape `nr` of `size` bytes, `n` times.
pub fn issue_xfer(fd: i32, nr: u32, size: u32, n: u64) {
    let mut inner = [0u8; 16384];
    let mut xfer = [0u8; 16];
    xfer[0..4].copy_from_slice(&nr.to_ne_bytes());
    xfer[4..8].copy_from_slice(&size.to_ne_bytes());
    xfer[8..16].copy_from_slice(&(inner.as_mut_ptr() as u64).to_ne_bytes());
    let cmd = gpud_common::nv::nv_iowr(gpud_common::nv::NV_ESC_IOCTL_XFER_CMD, 16);
    for _ in 0..n {
        // SAFETY: as in `issue`.
        unsafe { libc::ioctl(fd, cmd as _, xfer.as_mut_ptr()) };
    }
}

fn pipe() -> std::io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// A forked child that ran its work and now waits to be released.
pub struct Held {
    pub pid: u32,
    /// The child's report (what `work` returned, as text).
    pub report: String,
    release: Option<File>,
}

impl Held {
    /// Lets the child exit and reaps it; returns its exit code.
    pub fn release(mut self) -> i32 {
        self.release.take();
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(self.pid as i32, &mut status, 0) };
        libc::WEXITSTATUS(status)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.release.take().is_some() {
            let mut status = 0;
            // SAFETY: as above.
            unsafe { libc::waitpid(self.pid as i32, &mut status, 0) };
        }
    }
}

/// Forks; the child runs `work`, sends back its report, waits to be released and exits 0.
/// The caller must be single-threaded (no runtime threads), as after any fork.
pub fn fork_held(work: impl FnOnce() -> String) -> std::io::Result<Held> {
    let (mut report_r, mut report_w) = pipe()?;
    let (mut release_r, release_w) = pipe()?;
    // SAFETY: the child only runs `work`, writes to a pipe and exits.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => {
            drop(report_r);
            drop(release_w);
            let report = work();
            let _ = report_w.write_all(report.as_bytes());
            drop(report_w);
            let mut sink = [0u8; 1];
            let _ = release_r.read(&mut sink);
            // SAFETY: leave without running the parent's destructors or atexit handlers.
            unsafe { libc::_exit(0) }
        }
        pid => {
            drop(report_w);
            drop(release_r);
            let mut report = String::new();
            report_r.read_to_string(&mut report)?;
            Ok(Held {
                pid: pid as u32,
                report,
                release: Some(release_w),
            })
        }
    }
}

/// In a forked child: joins `cgroup`, opens the control device `ctl` and makes a client, device
/// 0 and its subdevice there (see [`crate::rm::Ctl::alloc_subdevice_tree`]), as a tenant's CUDA
/// context would; the [`fork_serving`] set-up of the tests' tenants.
pub fn rm_tenant(ctl: &Path, cgroup: &Path) -> Result<(File, [u32; 3]), String> {
    join_cgroup(cgroup).map_err(|e| format!("join: {e}"))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(ctl)
        .map_err(|e| format!("open: {e}"))?;
    let handles = crate::rm::Ctl::new(&f)
        .alloc_subdevice_tree(0)
        .map_err(|r| format!("client, device and subdevice: {r:?}"))?;
    Ok((f, handles))
}

/// How long [`Serving::ask`] waits for a reply.
const ASK_TIMEOUT_MS: i32 = 60_000;

/// A forked child that answers requests, one line each, until released.
pub struct Serving {
    pub pid: u32,
    requests: Option<File>,
    replies: std::io::BufReader<File>,
}

impl Serving {
    /// Sends one request line and returns the child's one-line reply.
    pub fn ask(&mut self, request: &str) -> std::io::Result<String> {
        use std::io::BufRead as _;
        let to = self
            .requests
            .as_mut()
            .ok_or_else(|| std::io::Error::other("released"))?;
        to.write_all(format!("{request}\n").as_bytes())?;
        if self.replies.buffer().is_empty() {
            let mut pfd = libc::pollfd {
                fd: self.replies.get_ref().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut pfd, 1, ASK_TIMEOUT_MS) } == 0 {
                // Where the child waits, for the report.
                let stack = std::fs::read_to_string(format!("/proc/{}/stack", self.pid))
                    .unwrap_or_default();
                return Err(std::io::Error::other(format!(
                    "child {} gave no answer to {request:?} in {} s; kernel stack:\n{stack}",
                    self.pid,
                    ASK_TIMEOUT_MS / 1000
                )));
            }
        }
        let mut line = String::new();
        if self.replies.read_line(&mut line)? == 0 {
            return Err(std::io::Error::other(format!(
                "child {} exited before answering {request:?}",
                self.pid
            )));
        }
        Ok(line.trim_end().to_owned())
    }

    /// Closes the requests (the child exits) and reaps it; returns its exit code.
    pub fn release(mut self) -> i32 {
        self.requests.take();
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(self.pid as i32, &mut status, 0) };
        libc::WEXITSTATUS(status)
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.requests.take().is_some() {
            let mut status = 0;
            // SAFETY: as above.
            unsafe { libc::waitpid(self.pid as i32, &mut status, 0) };
        }
    }
}

/// Forks; the child runs `setup` once, then answers each request line with `serve` until the
/// requests are closed, and exits 0. A failed `setup` is the error of this call. The caller
/// must be single-threaded in the sense of [`fork_held`].
pub fn fork_serving<S>(
    setup: impl FnOnce() -> Result<S, String>,
    mut serve: impl FnMut(&mut S, &str) -> String,
) -> std::io::Result<Serving> {
    use std::io::BufRead as _;
    let (req_r, req_w) = pipe()?;
    let (rep_r, mut rep_w) = pipe()?;
    // SAFETY: the child only runs the closures, reads and writes its pipes and exits.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => {
            drop(req_w);
            drop(rep_r);
            // Only these pipes: a sibling forked earlier must not keep another child's request
            // pipe open (its child would never see the end of its requests).
            let keep = [req_r.as_raw_fd(), rep_w.as_raw_fd()];
            for fd in 3..1024 {
                if !keep.contains(&fd) {
                    // SAFETY: closes descriptors this child does not use.
                    unsafe { libc::close(fd) };
                }
            }
            let mut state = match setup() {
                Ok(s) => {
                    let _ = rep_w.write_all(b"ready\n");
                    s
                }
                Err(e) => {
                    let _ = rep_w.write_all(format!("setup failed: {e}\n").as_bytes());
                    // SAFETY: leave without running the parent's destructors.
                    unsafe { libc::_exit(1) }
                }
            };
            let mut lines = std::io::BufReader::new(req_r);
            let mut line = String::new();
            while matches!(lines.read_line(&mut line), Ok(n) if n > 0) {
                let reply = serve(&mut state, line.trim_end()).replace('\n', " ");
                if rep_w.write_all(format!("{reply}\n").as_bytes()).is_err() {
                    break;
                }
                line.clear();
            }
            // SAFETY: as above.
            unsafe { libc::_exit(0) }
        }
        pid => {
            drop(req_r);
            drop(rep_w);
            let mut replies = std::io::BufReader::new(rep_r);
            let mut first = String::new();
            replies.read_line(&mut first)?;
            let serving = Serving {
                pid: pid as u32,
                requests: Some(req_w),
                replies,
            };
            if first.trim_end() != "ready" {
                drop(serving);
                return Err(std::io::Error::other(format!(
                    "child {pid}: {}",
                    first.trim_end()
                )));
            }
            Ok(serving)
        }
    }
}

/// Runs `work` in a forked child and returns its report once it has exited.
pub fn in_child(work: impl FnOnce() -> String) -> std::io::Result<String> {
    let held = fork_held(work)?;
    let report = held.report.clone();
    held.release();
    Ok(report)
}

/// Until dropped, a thread that after `after` prints the kernel stacks of this process's
/// threads and children and exits with status 3: a stuck check in the VM then says where it
/// waits.
pub struct Watchdog(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    pub fn arm(after: std::time::Duration) -> Self {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watch = done.clone();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            if watch.load(Ordering::Relaxed) {
                return;
            }
            let stack = |dir: &Path| std::fs::read_to_string(dir.join("stack")).unwrap_or_default();
            println!("WATCHDOG: stuck after {after:?}; kernel stacks:");
            for t in std::fs::read_dir("/proc/self/task")
                .into_iter()
                .flatten()
                .flatten()
            {
                println!("thread {:?}:\n{}", t.file_name(), stack(&t.path()));
            }
            let me = format!(" {} ", std::process::id());
            for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                // `pid (comm) state ppid ...`: children name this process as their parent.
                let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
                if stat
                    .split(") ")
                    .nth(1)
                    .is_some_and(|rest| rest[1..].starts_with(&me))
                {
                    println!("child {:?}:\n{}", p.file_name(), stack(&p.path()));
                }
            }
            std::process::exit(3);
        });
        Self(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Raw fd of an open file, for the helpers above.
pub fn fd(f: &File) -> i32 {
    f.as_raw_fd()
}
