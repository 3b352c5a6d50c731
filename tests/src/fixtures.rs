//! The fixture processes a test drives: [`Issuer`] (`gpud-ioctl`: raw ioctls from a cgroup)
//! and [`RmProcess`] (`gpud-rm`: a scripted RM caller answering one JSON line per command).

use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    time::Duration,
};

use crate::{Cgroup, bin_dir};

/// A running `gpud-ioctl` process, held alive until [`Issuer::finish`] or drop.
pub struct Issuer {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<std::process::ChildStdout>,
    pub pid: u32,
    pub child_pid: Option<u32>,
}

impl Issuer {
    /// Spawns `gpud-ioctl --hold ARGS` and waits until it has issued everything.
    pub fn run(args: &[String]) -> Self {
        let fork = args.iter().any(|a| a == "--fork-child");
        let mut child = Command::new(bin_dir().join("gpud-ioctl"))
            .arg("--hold")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpud-ioctl");
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let pid = read_pid(&mut stdout, "DONE");
        let child_pid = fork.then(|| read_pid(&mut stdout, "CHILD"));
        Self {
            child,
            stdin,
            stdout,
            pid,
            child_pid,
        }
    }

    /// `gpud-ioctl --hold --cgroup CG --file FILE ARGS`: a process in `cg` that opened `file`
    /// and issued what `args` say (`--ioctl CMD:COUNT`, `--xfer`, `--unmatched`, `--fork-child`).
    pub fn in_cgroup(cg: &Cgroup, file: &Path, args: &[&str]) -> Self {
        let mut all = vec![
            "--cgroup".to_owned(),
            cg.dir.display().to_string(),
            "--file".to_owned(),
            file.display().to_string(),
        ];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        Self::run(&all)
    }

    /// Makes the (non-forking) issuer issue its ioctls once more, and waits until it has.
    pub fn again(&mut self) {
        let stdin = self.stdin.as_mut().expect("issuer stdin");
        stdin.write_all(b"go\n").expect("write to issuer");
        stdin.flush().expect("flush issuer stdin");
        read_pid(&mut self.stdout, "DONE");
    }

    /// Lets the process exit and reaps it.
    pub fn finish(mut self) {
        self.stdin.take();
        let _ = self.child.wait();
    }
}

impl Drop for Issuer {
    fn drop(&mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = s.flush();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_pid(out: &mut impl BufRead, prefix: &str) -> u32 {
    let mut line = String::new();
    out.read_line(&mut line).expect("read issuer output");
    line.trim()
        .strip_prefix(prefix)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("issuer said {line:?}, expected {prefix}"))
}

/// A running `gpud-rm` (a scripted RM caller), answering one JSON line per command.
pub struct RmProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    /// The process running the script: the one spawned, or the last [`RmProcess::handoff`]
    /// child (`fork` children report their own pids).
    pub pid: u32,
    /// Whether `pid` is a handed-off descendant rather than `child`.
    handed_off: bool,
}

impl RmProcess {
    /// Spawns `gpud-rm [--cgroup DIR] --file FILE` (see its module docs for the commands).
    pub fn spawn(cgroup: Option<&Path>, file: &Path) -> Self {
        Self::spawn_with(cgroup, Some(file))
    }

    /// Spawns `gpud-rm [--cgroup DIR]` with no file open (one to be received, or opened later).
    pub fn spawn_without_file(cgroup: Option<&Path>) -> Self {
        Self::spawn_with(cgroup, None)
    }

    /// Spawns `gpud-rm --entry 32`: a 32-bit tenant, whose open, close and RM calls go through
    /// the i386 system-call entry. `None` where the kernel has none (no IA32 emulation).
    #[cfg(target_arch = "x86_64")]
    pub fn spawn_32bit(cgroup: Option<&Path>, file: &Path) -> Option<Self> {
        crate::ia32::available().then(|| Self::spawn_args(cgroup, Some(file), &["--entry", "32"]))
    }

    fn spawn_with(cgroup: Option<&Path>, file: Option<&Path>) -> Self {
        Self::spawn_args(cgroup, file, &[])
    }

    fn spawn_args(cgroup: Option<&Path>, file: Option<&Path>, args: &[&str]) -> Self {
        let mut cmd = Command::new(bin_dir().join("gpud-rm"));
        cmd.args(args);
        if let Some(cg) = cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
        if let Some(file) = file {
            cmd.arg("--file").arg(file);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpud-rm");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("gpud-rm stdout"));
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Self {
            child,
            stdin,
            lines,
            pid: 0,
            handed_off: false,
        };
        p.pid = p.cmd("pid")["pid"].as_u64().expect("gpud-rm pid") as u32;
        p
    }

    /// Writes one command line.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("gpud-rm stdin");
        writeln!(stdin, "{line}").expect("write to gpud-rm");
        stdin.flush().expect("flush gpud-rm stdin");
    }

    /// The next answer (within 10 s).
    pub fn recv(&mut self) -> serde_json::Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(10))
            .expect("no answer from gpud-rm within 10 s");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("gpud-rm said {line:?}: {e}"))
    }

    /// Sends a command and returns its answer.
    pub fn cmd(&mut self, line: &str) -> serde_json::Value {
        self.send(line);
        self.recv()
    }

    /// Like [`RmProcess::cmd`], asserting `"ok": true`.
    pub fn ok(&mut self, line: &str) -> serde_json::Value {
        let v = self.cmd(line);
        assert_eq!(v["ok"], true, "{line:?} answered {v}");
        v
    }

    /// `handle` of an answer that must be ok.
    pub fn handle(&mut self, line: &str) -> u32 {
        self.ok(line)["handle"].as_u64().expect("handle") as u32
    }

    /// A new client and its device for GPU `gpu`: (client, device), where memory is allocated.
    pub fn client_device(&mut self, gpu: u32) -> (u32, u32) {
        let client = self.handle("client");
        let device = self.handle(&format!("device {client} {gpu}"));
        (client, device)
    }

    /// The next answer, or `None` if the process ended (or said nothing within 10 s) first.
    pub fn try_recv(&mut self) -> Option<serde_json::Value> {
        let line = self.lines.recv_timeout(Duration::from_secs(10)).ok()?;
        serde_json::from_str(&line).ok()
    }

    /// Sends a command; its answer, or `None` if the process ended first (e.g. killed in it).
    pub fn try_cmd(&mut self, line: &str) -> Option<serde_json::Value> {
        let stdin = self.stdin.as_mut()?;
        if writeln!(stdin, "{line}").is_err() || stdin.flush().is_err() {
            return None;
        }
        self.try_recv()
    }

    /// Sends `line`, which must kill this process in its call: no answer, then reaped with
    /// `SIGKILL`. Panics with `what` and what happened otherwise.
    pub fn killed_in(&mut self, line: &str, what: &str) {
        let answer = self.try_cmd(line);
        assert!(answer.is_none(), "{what}: `{line}` answered {answer:?}");
        let status = self.wait();
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{what}: {status:?}");
    }

    /// `handoff`: the script's process forks, the child takes over and the parent exits (one
    /// half of a daemon's double fork). Returns the new pid; the spawned process is reaped once
    /// it has left.
    pub fn handoff(&mut self) -> u32 {
        // Orphans are re-parented to this process rather than to init, so a handed-off process
        // can be waited for like a child (and leaves no zombie that gpud would see as alive).
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let before = self.pid;
        let v = self.ok("handoff");
        let pid = v["pid"].as_u64().expect("handoff pid") as u32;
        if self.handed_off {
            reap(before);
        } else {
            let _ = self.child.wait();
        }
        self.pid = pid;
        self.handed_off = true;
        pid
    }

    /// Closes standard input and reaps the process; its exit status (signals included).
    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.stdin.take();
        if self.handed_off {
            // Reaped: nothing left for `Drop` to kill.
            self.handed_off = false;
            return reap(self.pid);
        }
        self.child.wait().expect("reap gpud-rm")
    }

    /// Closes standard input and reaps the process; returns its exit code.
    pub fn finish(mut self) -> Option<i32> {
        self.wait().code()
    }
}

/// Waits for `pid`, a child or (with this process a subreaper) an adopted descendant.
fn reap(pid: u32) -> std::process::ExitStatus {
    use std::os::unix::process::ExitStatusExt as _;
    let mut status = 0;
    // SAFETY: waits for one process of ours; `status` is written by the kernel.
    unsafe { libc::waitpid(pid as i32, &mut status, 0) };
    std::process::ExitStatus::from_raw(status)
}

impl Drop for RmProcess {
    fn drop(&mut self) {
        self.stdin.take();
        if self.handed_off {
            // An adopted descendant: it leaves on end of input; make sure, and reap it.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            reap(self.pid);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
