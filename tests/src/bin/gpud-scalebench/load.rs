//! The load a run puts on gpud and what it reads back from the kernel: held `gpud-ioctl`
//! processes in cgroups ([`Holder`]), the forking event generator ([`forker`]), the open/close
//! flood ([`opener`]), and the pinned `LIMITS` map's value for a cgroup.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail};

use crate::{RM_ALLOC, exe_dir};

/// A held `gpud-ioctl` in a cgroup; each line written to it re-issues its ioctls.
pub(crate) struct Holder {
    child: Child,
    pub(crate) stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Holder {
    pub(crate) fn spawn(cg: &Path, file: &Path, per_line: u64) -> anyhow::Result<Self> {
        let mut child = Command::new(exe_dir().join("gpud-ioctl"))
            .arg("--cgroup")
            .arg(cg)
            .arg("--file")
            .arg(file)
            .args(["--ioctl", &format!("{RM_ALLOC}:{per_line}"), "--hold"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn gpud-ioctl")?;
        let stdin = child.stdin.take().context("stdin")?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut h = Self { child, stdin, out };
        h.done()?;
        Ok(h)
    }

    /// Waits for its `DONE` line.
    fn done(&mut self) -> anyhow::Result<()> {
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        if !line.starts_with("DONE") {
            bail!("gpud-ioctl said {line:?}");
        }
        Ok(())
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn pinned_limit(bpffs: &Path, cgroup_id: u64) -> Option<u64> {
    use libbpf_rs::MapCore as _;
    let path = bpffs
        .join("gpud")
        .join(format!("v{}", gpud_common::ABI_VERSION))
        .join(gpud_common::maps::LIMITS);
    let map = libbpf_rs::MapHandle::from_pinned_path(path).ok()?;
    let key = gpud_common::UsageKey::new(cgroup_id, gpud_common::GPU_ALL);
    // SAFETY: UsageKey is repr(C) plain data; the slice covers exactly its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&key as *const gpud_common::UsageKey).cast::<u8>(),
            size_of::<gpud_common::UsageKey>(),
        )
    };
    let v = map.lookup(bytes, libbpf_rs::MapFlags::ANY).ok()??;
    (v.len() >= size_of::<gpud_common::KernelLimit>()).then(|| {
        // SAFETY: the length was checked; KernelLimit is plain data.
        unsafe { std::ptr::read_unaligned(v.as_ptr().cast::<gpud_common::KernelLimit>()) }.max
    })
}

pub(crate) fn cgroup_id(dir: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(std::fs::metadata(dir)?.ino())
}

/// `forker FILE N`: opens FILE (a tracked device file), issues one ioctl, then forks N children
/// that exit at once (a PROC_NEW and a PROC_EXIT event each); prints the seconds it took.
pub(crate) fn forker(file: &str, n: u64) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)?;
    let mut buf = [0u8; 48];
    // SAFETY: ioctl on our own descriptor with a buffer of the size the command encodes.
    unsafe { libc::ioctl(f.as_raw_fd(), 0xc030462b_u32 as _, buf.as_mut_ptr()) };
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: the child only calls _exit, which is async-signal-safe.
        match unsafe { libc::fork() } {
            0 => unsafe { libc::_exit(0) },
            pid if pid > 0 => {
                let mut status = 0;
                // SAFETY: reaping our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
            }
            _ => bail!("fork failed: {}", std::io::Error::last_os_error()),
        }
    }
    println!("{}", t.elapsed().as_secs_f64());
    Ok(())
}

/// This binary with `args`, started in the cgroup `cg`.
fn in_cgroup(cg: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<Command> {
    let me = std::env::current_exe()?;
    let cg = cg.to_owned();
    let mut cmd = Command::new(me);
    cmd.args(args);
    // SAFETY: only writes its own pid into cgroup.procs between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt as _;
        cmd.pre_exec(move || std::fs::write(cg.join("cgroup.procs"), "0"));
    }
    Ok(cmd)
}

/// `opener FILE`: opens and closes FILE (a control device file) as fast as it can until its
/// standard input closes, then prints the opens per second. Each open of a control file and
/// each close of its last descriptor is an event for gpud (the file's objects are released).
pub(crate) fn opener(file: &str) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let t = Instant::now();
    let mut opens = 0u64;
    loop {
        for _ in 0..256 {
            drop(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(file)?,
            );
        }
        opens += 256;
        let mut pfd = libc::pollfd {
            fd: std::io::stdin().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one descriptor of ours without waiting.
        if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
            break;
        }
    }
    println!("{}", opens as f64 / t.elapsed().as_secs_f64());
    Ok(())
}

/// An [`opener`] flooding gpud from the cgroup `cg` until [`Flood::stop`].
pub(crate) struct Flood(Child);

impl Flood {
    pub(crate) fn start(cg: &Path, file: &Path) -> anyhow::Result<Self> {
        let child = in_cgroup(cg, &["opener".as_ref(), file.as_os_str()])?
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn the opener")?;
        Ok(Self(child))
    }

    /// Stops it; the opens per second it made.
    pub(crate) fn stop(mut self) -> anyhow::Result<f64> {
        drop(self.0.stdin.take());
        let mut line = String::new();
        BufReader::new(self.0.stdout.take().context("stdout")?).read_line(&mut line)?;
        let _ = self.0.wait();
        line.trim().parse().context("opener output")
    }
}

pub(crate) fn run_forker(cg: &Path, file: &Path, n: u64) -> anyhow::Result<f64> {
    let n = n.to_string();
    let out = in_cgroup(cg, &["forker".as_ref(), file.as_os_str(), n.as_ref()])?.output()?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("forker output")
}
