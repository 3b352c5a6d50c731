//! Harness for gpud's integration tests: real parts only. A private `dbus-daemon`, the real
//! `gpud` binary on its own bpffs instance, real cgroup v2 children, and real processes
//! (`gpud-ioctl`, `gpud-rm`) issuing ioctls on stand-in device files or on the fake NVIDIA
//! control device ([`fakenv`]).
//!
//! A test starts from a [`Rig`] (directory, bus, fakes, daemon) and a [`TestConfig`]; the
//! pieces below are what the rig is made of, for tests that need one alone. tests/README.md says
//! how to write a test.
//!
//! Tests need root, a kernel that loads BPF tracepoint programs, and `dbus-daemon`.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

// gpud's D-Bus client side (the gpud-api crate), named here once: the tests import these from
// the harness.
pub use gpud_api::{
    BUS_NAME, CgroupRecord, Gpu1Proxy, MANAGER_INTERFACE, MUTATING_METHODS, Manager1Proxy,
    NvmlUsageRecord, OBJECT_PATH, connect_builder,
};

pub use config::TestConfig;
/// The fake NVML's scenario types, for typed scenarios ([`write_nvml_scenario`]).
pub use nvidia_ml_fake::scenario;
pub use rig::Rig;
use scenario::{Process, Scenario};

mod config;
pub mod containerd;
pub mod fakenv;
pub mod hwcontrols;
pub mod inproc;
pub mod kubelet;
pub mod podman;
mod rig;
pub mod rm;
pub mod runtime;

/// Per-class counts as gpud reports them (every class present), from the non-zero ones.
pub fn class_counts(pairs: &[(&str, u64)]) -> std::collections::BTreeMap<String, u64> {
    let mut m: std::collections::BTreeMap<String, u64> = gpud_common::IOCTL_CLASS_NAMES
        .iter()
        .map(|n| ((*n).to_owned(), 0))
        .collect();
    for (k, v) in pairs {
        m.insert((*k).to_owned(), *v);
    }
    m
}

/// A scratch directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("gpud-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // A bpffs may be mounted inside (the daemon's own instance).
        let bpffs = self.0.join("bpffs");
        if let Ok(c) = std::ffi::CString::new(bpffs.as_os_str().as_encoded_bytes()) {
            // SAFETY: valid NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Directory of the workspace's built binaries (`target/debug`), next to this test executable.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/debug/deps/<test> → target/debug
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

pub fn gpud_bin() -> PathBuf {
    std::env::var_os("GPUD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("gpud"))
}

pub fn gpudctl_bin() -> PathBuf {
    std::env::var_os("GPUDCTL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("gpudctl"))
}

/// A private `dbus-daemon` with its own configuration.
pub struct Bus {
    child: Child,
    pub address: String,
    _dir: TempDir,
}

impl Bus {
    /// The bus daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts a bus whose policy lets anyone own names and call anything (the shipped system
    /// policy is tested separately).
    pub fn start() -> Self {
        let dir = TempDir::new("bus");
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            include_str!("../fixtures/private-bus.conf")
                .replace("@SOCKET@", &socket.display().to_string()),
        )
        .expect("write bus config");
        Self::spawn(dir, &conf)
    }

    /// Starts a bus with the system bus's default policy (deny owning names and calling methods
    /// unless allowed) and the shipped policy systemd/dev.gpud.Daemon1.conf, its admin group
    /// `gpud-admin` renamed to `admin_group`. Its socket is reachable by unprivileged users.
    pub fn start_system_like(admin_group: &str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("sysbus");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod bus dir");
        let policy = dir.path().join("dev.gpud.Daemon1.conf");
        let shipped = std::fs::read_to_string(shipped_bus_policy()).expect("read shipped policy");
        assert!(
            shipped.contains(r#"group="gpud-admin""#),
            "policy names no admin group"
        );
        std::fs::write(
            &policy,
            shipped.replace(
                r#"group="gpud-admin""#,
                &format!(r#"group="{admin_group}""#),
            ),
        )
        .expect("write policy");
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            include_str!("../fixtures/system-bus.conf")
                .replace("@SOCKET@", &socket.display().to_string())
                .replace("@POLICY@", &policy.display().to_string()),
        )
        .expect("write bus config");
        Self::spawn(dir, &conf)
    }

    fn spawn(dir: TempDir, conf: &Path) -> Self {
        let mut child = Command::new("dbus-daemon")
            .arg("--config-file")
            .arg(conf)
            .args(["--nofork", "--print-address"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start dbus-daemon (is the `dbus` package installed?)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read bus address");
        Self {
            child,
            address: line.trim().to_owned(),
            _dir: dir,
        }
    }
}

/// The shipped system bus policy, systemd/dev.gpud.Daemon1.conf.
pub fn shipped_bus_policy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/dev.gpud.Daemon1.conf")
}

/// A system group that exists for the life of the value (`groupadd --system`, `groupdel` on
/// drop, also when a test fails), named uniquely per test process.
pub struct TestGroup {
    pub name: String,
    pub gid: u32,
}

impl TestGroup {
    pub fn create(tag: &str) -> Self {
        let name = format!("gpudt{}{tag}", std::process::id());
        assert!(name.len() <= 32, "group name {name} too long");
        let st = Command::new("groupadd")
            .args(["--system", &name])
            .status()
            .expect("run groupadd");
        assert!(st.success(), "groupadd {name}: {st}");
        let gid = nix::unistd::Group::from_name(&name)
            .ok()
            .flatten()
            .map(|g| g.gid.as_raw());
        // Built before the check, so that a failed check still removes the group.
        let group = Self {
            name,
            gid: gid.unwrap_or(u32::MAX),
        };
        assert!(
            gid.is_some(),
            "group {} not found after groupadd",
            group.name
        );
        group
    }
}

impl Drop for TestGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).status();
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cgroup v2 mount point, from mountinfo (hybrid hosts have it at /sys/fs/cgroup/unified).
pub fn cgroup2_root() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    gpud::cgroupfs::cgroup2_mount_from(&mi).expect("a cgroup2 mount")
}

/// A process's state letter from `/proc/<pid>/stat` (`T`: stopped, `R`: running); `?` when gone.
pub fn process_state(pid: u32) -> char {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()?
                .split_whitespace()
                .next()?
                .chars()
                .next()
        })
        .unwrap_or('?')
}

/// A process running `script` under sh inside `cg`, returned once it is in the cgroup.
pub fn spawn_in_cgroup(cg: &Cgroup, script: &str) -> Child {
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec sh -c '{script}'",
            cg.dir.display()
        ))
        .spawn()
        .expect("spawn");
    for _ in 0..200 {
        let procs = std::fs::read_to_string(cg.dir.join("cgroup.procs")).unwrap_or_default();
        if procs.lines().any(|l| l.trim() == child.id().to_string()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child
}

/// A child cgroup, removed (after killing its processes) on drop.
pub struct Cgroup {
    pub dir: PathBuf,
    /// Path relative to the cgroup v2 root, as gpud reports it.
    pub rel: String,
}

impl Cgroup {
    pub fn new(name: &str) -> Self {
        let rel = format!("/gpud-test-{}-{name}", std::process::id());
        let dir = cgroup2_root().join(rel.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).expect("create cgroup");
        Self { dir, rel }
    }

    /// A child cgroup `name`. Declared after its parent, it is removed before it (a cgroup with
    /// children cannot be removed).
    pub fn child(&self, name: &str) -> Self {
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).expect("create child cgroup");
        Self {
            dir,
            rel: format!("{}/{name}", self.rel),
        }
    }

    /// The cgroup's id as gpud reports it: its directory's inode number.
    pub fn id(&self) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(&self.dir).expect("stat cgroup").ino()
    }

    /// Whether `cgroup.events` says the cgroup is frozen.
    pub fn frozen(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events"))
            .is_ok_and(|t| t.lines().any(|l| l == "frozen 1"))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if !self.dir.exists() {
            // The test removed it itself.
            return;
        }
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A running `gpud` on a private bus and its own bpffs instance.
pub struct Daemon {
    child: Option<Child>,
    pub config: PathBuf,
    pub bus: String,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts gpud and waits until it answers on the bus.
    pub async fn start(config: &Path, bus: &str) -> Self {
        Self::start_with_env(config, bus, &[]).await
    }

    /// Like [`Daemon::start`], with environment changes: `(name, Some(value))` sets a variable,
    /// `(name, None)` removes it (e.g. `NOTIFY_SOCKET`, `WATCHDOG_USEC`, `RUST_LOG`).
    pub async fn start_with_env(config: &Path, bus: &str, env: &[(&str, Option<&str>)]) -> Self {
        Self::start_wrapped(config, bus, env, &[]).await
    }

    /// Like [`Daemon::start_with_env`], run through `wrapper` (a command that ends by exec'ing
    /// its arguments, e.g. `setpriv ... --`): the daemon's pid is the wrapper's.
    pub async fn start_wrapped(
        config: &Path,
        bus: &str,
        env: &[(&str, Option<&str>)],
        wrapper: &[String],
    ) -> Self {
        static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = config.with_file_name(format!("gpud-{n}.log"));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(gpud_bin());
                c
            }
            None => Command::new(gpud_bin()),
        };
        for (name, value) in env {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
        let child = cmd
            .arg("--config")
            .arg(config)
            .arg("--bus-address")
            .arg(bus)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", gpud_bin().display()));
        let mut d = Self {
            child: Some(child),
            config: config.to_owned(),
            bus: bus.to_owned(),
            log,
        };
        d.wait_ready().await;
        d
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("gpud exited early ({status}):\n{}", self.log_text());
            }
            if let Ok(conn) = connect_builder(&self.bus).build().await
                && let Ok(p) = Manager1Proxy::new(&conn).await
                && p.version().await.is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "gpud not ready:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls `f` until it returns `Some` (for at most `timeout`); panics naming `what`, with the
    /// daemon's log, if it never does.
    pub async fn expect_eventually<T, F, Fut>(&self, what: &str, timeout: Duration, f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        match eventually(timeout, f).await {
            Some(v) => v,
            None => panic!("{what}: not within {timeout:?}:\n{}", self.log_text()),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`) to the daemon.
    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: plain kill(2) on our own (unreaped) child.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    /// Whether the daemon is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM and wait; returns the exit status code.
    pub fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().ok().and_then(|s| s.code())
    }

    pub async fn proxy(&self) -> (zbus::Connection, Manager1Proxy<'static>) {
        let conn = connect_builder(&self.bus).build().await.expect("connect");
        let proxy = Manager1Proxy::new(&conn).await.expect("proxy");
        (conn, proxy)
    }

    /// `GetCgroup(path)`, which must succeed.
    pub async fn get_cgroup(&self, path: &str) -> CgroupRecord {
        let (_c, p) = self.proxy().await;
        p.get_cgroup(path).await.expect("GetCgroup")
    }

    /// Waits until gpud's `memory_current` of `path` holds `want` (bytes by GPU name, `"all"`
    /// for the sum) and returns the record; panics with what it holds instead.
    pub async fn expect_memory(&self, path: &str, want: &[(&str, u64)]) -> CgroupRecord {
        let bytes = |r: &CgroupRecord, gpu: &str| r.memory_current.get(gpu).copied().unwrap_or(0);
        let got = eventually(Duration::from_secs(10), || async {
            let (_c, p) = self.proxy().await;
            let r = p.get_cgroup(path).await.ok()?;
            want.iter().all(|(g, b)| bytes(&r, g) == *b).then_some(r)
        })
        .await;
        if let Some(r) = got {
            return r;
        }
        let (_c, p) = self.proxy().await;
        let have = p.get_cgroup(path).await.map(|r| r.memory_current);
        panic!(
            "{path}: gpud says {have:?}, wanted {want:?}\n{}",
            self.log_text()
        )
    }

    /// `SetLimits(cgroup, gpu, {name: value})`, which must succeed.
    pub async fn set_limit<'a>(
        &self,
        cgroup: &str,
        gpu: &str,
        name: &str,
        value: impl Into<zbus::Variant<'a>>,
    ) {
        let (_c, p) = self.proxy().await;
        p.set_limits(cgroup, gpu, BTreeMap::from([(name, value.into())]))
            .await
            .unwrap_or_else(|e| panic!("SetLimits {cgroup} {gpu} {name}: {e}"));
    }

    /// The limits gpud lists for `cgroup`: by GPU selector, by limit name.
    pub async fn limits(&self, cgroup: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
        let (_c, p) = self.proxy().await;
        p.list_limits()
            .await
            .expect("ListLimits")
            .into_iter()
            .filter(|l| l.cgroup == cgroup)
            .map(|l| (l.gpu, l.limits))
            .collect()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

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

    fn spawn_with(cgroup: Option<&Path>, file: Option<&Path>) -> Self {
        let mut cmd = Command::new(bin_dir().join("gpud-rm"));
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

/// Polls `f` until it returns `Some`, for at most `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Copies the fake NVML library (tests/fake-nvml) to `lib_dir/libnvidia-ml.so.1`, where a test
/// points `nvml.library_path`; its scenario goes beside it ([`write_nvml_scenario`]).
pub fn install_fake_nvml(lib_dir: &Path) -> PathBuf {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    let dst = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(bin_dir().join("libnvidia_ml_fake.so"), &dst)
        .expect("copy the fake NVML library (is fake-nvml built?)");
    dst
}

/// A fake-NVML scenario of one test GPU (`scenario::Gpu::test(0)`) named `name`, with
/// `processes`.
pub fn one_gpu(name: &str, processes: impl IntoIterator<Item = Process>) -> Scenario {
    let mut s = Scenario::gpus(1).with(processes);
    s.gpus[0].name = name.to_owned();
    s
}

/// [`Scenario::gpus`] with these processes, (pid, GPU index), each holding 1 GiB; with no
/// `sm_util` given, each reports its CPU share as its SM utilization (the fake NVML's simulated
/// GPU users).
pub fn gpus_with(n: u32, processes: &[(u32, u32)]) -> Scenario {
    Scenario::gpus(n).with(
        processes
            .iter()
            .map(|&(pid, gpu)| Process::on(pid, gpu, 1 << 30)),
    )
}

/// Writes the fake NVML's scenario beside it (write then rename: never read half-written).
pub fn write_nvml_scenario(lib_dir: &Path, scenario: &Scenario) {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    let tmp = lib_dir.join("fake-nvml.json.tmp");
    let text = serde_json::to_string(scenario).expect("a scenario serializes");
    std::fs::write(&tmp, text).expect("scenario");
    std::fs::rename(&tmp, lib_dir.join("fake-nvml.json")).expect("scenario");
}
