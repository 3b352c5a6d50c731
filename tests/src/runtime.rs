//! Fixtures of the container-runtime integration tests: real `runc` containers from a busybox
//! rootfs built on the spot, and a test NRI runtime that drives a plugin over the real NRI
//! protocol (multiplexed ttrpc on a unix socket), with gpud's own generated NRI code.//!
//! Here: runc, its bundles and cgroup v1 clean-up, a process in a cgroup and the OCI hook's
//! arguments; `nri` owns the test NRI runtime and the plugin process.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Duration,
};

use oci_spec::runtime::{Hook, HookBuilder, Mount, MountBuilder, Spec};

use crate::bin_dir;

pub use nri::{
    NriPlugin, Registration, Session, TestRuntime, configure_request, container, ctx, pod,
};

mod nri;

/// `runc` on PATH (the Debian package installs /usr/sbin/runc; `cargo xtask setup` installs it).
pub fn runc_path() -> PathBuf {
    for dir in [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
    ] {
        let p = Path::new(dir).join("runc");
        if p.exists() {
            return p;
        }
    }
    panic!("runc not found: `cargo xtask setup` installs the Debian package");
}

/// A runc with its own state directory (`--root`), so tests never see other containers.
pub struct Runc {
    root: PathBuf,
    ids: std::sync::Mutex<Vec<String>>,
    /// cgroups paths of the containers run, for the cleanup of cgroup v1 directories.
    cgroups: std::sync::Mutex<Vec<String>>,
}

impl Runc {
    pub fn new(dir: &Path) -> Self {
        let root = dir.join("runc-root");
        std::fs::create_dir_all(&root).expect("runc root");
        Self {
            root,
            ids: std::sync::Mutex::new(Vec::new()),
            cgroups: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub fn command(&self) -> Command {
        let mut c = Command::new(runc_path());
        c.arg("--root").arg(&self.root);
        c
    }

    /// `runc run --detach`, the container's stdio passed through as `stdin` and `stdout`
    /// (runc's detached pass-through mode). runc's stderr, which the container inherits too,
    /// goes to a file: its exit status and what it wrote there.
    pub fn run_detached(
        &self,
        bundle: &Bundle,
        id: &str,
        stdin: Stdio,
        stdout: Stdio,
    ) -> (std::process::ExitStatus, String) {
        self.ids.lock().expect("ids").push(id.to_owned());
        self.cgroups
            .lock()
            .expect("cgroups")
            .push(bundle.cgroups_path.clone());
        let err_path = bundle.dir.join(format!("runc-{id}.stderr"));
        let err = std::fs::File::create(&err_path).expect("runc stderr file");
        let status = self
            .command()
            .args(["run", "--detach", "--bundle"])
            .arg(&bundle.dir)
            .arg(id)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(err)
            .status()
            .expect("run runc");
        (
            status,
            std::fs::read_to_string(&err_path).unwrap_or_default(),
        )
    }

    /// `runc state ID`'s JSON, or `None` if runc knows no such container.
    pub fn state(&self, id: &str) -> Option<serde_json::Value> {
        let out = self.command().args(["state", id]).output().ok()?;
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    /// `runc kill ID KILL`, waits until stopped, then `runc delete ID` (which runs poststop).
    pub fn kill_and_delete(&self, id: &str) -> Output {
        let _ = self.command().args(["kill", id, "KILL"]).output();
        for _ in 0..200 {
            match self.state(id) {
                Some(s) if s["status"] == "stopped" => break,
                None => break,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        self.command()
            .args(["delete", id])
            .output()
            .expect("runc delete")
    }
}

impl Drop for Runc {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.ids.lock().unwrap_or_else(|e| e.into_inner()));
        for id in ids {
            let _ = self.command().args(["delete", "--force", &id]).output();
        }
        let cgroups = std::mem::take(&mut *self.cgroups.lock().unwrap_or_else(|e| e.into_inner()));
        for rel in cgroups {
            remove_v1_dirs(&rel);
        }
    }
}

/// Mount points of cgroup v1 hierarchies (hybrid hosts have them beside the v2 one).
pub fn cgroup_v1_mounts() -> Vec<PathBuf> {
    crate::paths::mount_points("cgroup")
}

/// runc (cgroupfs driver) also makes the container's path in every v1 hierarchy and, on delete,
/// removes only the leaf: removes the now empty directories of `rel` and its ancestors there.
/// Whether `rel` is gone from every v1 hierarchy.
pub fn remove_v1_dirs(rel: &str) -> bool {
    let mounts = cgroup_v1_mounts();
    for mount in &mounts {
        let mut path = Path::new(rel.trim_start_matches('/'));
        loop {
            if path.as_os_str().is_empty() {
                break;
            }
            match std::fs::remove_dir(mount.join(path)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) => break,
            }
            path = path.parent().unwrap_or(Path::new(""));
        }
    }
    let rel = Path::new(rel.trim_start_matches('/'));
    mounts.iter().all(|m| !m.join(rel).exists())
}

/// A container root filesystem at `rootfs`: the static busybox and a few of its applets.
pub fn busybox_rootfs(rootfs: &Path) {
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc"] {
        std::fs::create_dir_all(rootfs.join(d)).expect("rootfs dir");
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
        .expect("copy /bin/busybox (Debian busybox-static)");
    for applet in ["sh", "sleep", "cat", "ls"] {
        let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet));
    }
}

/// An OCI bundle: `config.json` from `runc spec` (the runtime's own defaults) and a busybox
/// rootfs.
pub struct Bundle {
    pub dir: PathBuf,
    /// `linux.cgroupsPath`.
    pub cgroups_path: String,
}

impl Bundle {
    /// A bundle in `dir` whose process runs `args`, in the cgroup `cgroups_path` (relative to the
    /// cgroup v2 root, cgroupfs driver).
    pub fn busybox(dir: &Path, args: &[&str], cgroups_path: &str) -> Self {
        busybox_rootfs(&dir.join("rootfs"));
        let status = Command::new(runc_path())
            .args(["spec", "--bundle"])
            .arg(dir)
            .status()
            .expect("runc spec");
        assert!(status.success(), "runc spec failed");
        let b = Self {
            dir: dir.to_owned(),
            cgroups_path: cgroups_path.to_owned(),
        };
        b.edit(|spec| {
            let mut process = spec.process().clone().unwrap_or_default();
            process.set_terminal(Some(false));
            process.set_args(Some(args.iter().map(|a| (*a).to_owned()).collect()));
            spec.set_process(Some(process));
            let mut linux = spec.linux().clone().unwrap_or_default();
            linux.set_cgroups_path(Some(PathBuf::from(cgroups_path)));
            spec.set_linux(Some(linux));
        });
        b
    }

    pub fn config(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// Loads `config.json`, lets `f` change it, saves it.
    pub fn edit(&self, f: impl FnOnce(&mut Spec)) {
        let mut spec = Spec::load(self.config()).expect("load config.json");
        f(&mut spec);
        spec.save(self.config()).expect("save config.json");
    }

    pub fn set_annotations(&self, pairs: &[(&str, &str)]) {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.edit(|spec| {
            spec.set_annotations(Some(map));
        });
    }

    /// `createRuntime` and `poststop` hooks running gpud-oci-hook with `args` (before the stage)
    /// and `env`.
    pub fn set_gpud_hooks(&self, args: &[&str], env: &[&str]) {
        let hook = |stage: &str| -> Hook {
            let mut argv = vec!["gpud-oci-hook".to_owned()];
            argv.extend(args.iter().map(|a| (*a).to_owned()));
            argv.push(stage.to_owned());
            HookBuilder::default()
                .path(bin_dir().join("gpud-oci-hook"))
                .args(argv)
                .env(env.iter().map(|e| (*e).to_owned()).collect::<Vec<_>>())
                .build()
                .expect("hook")
        };
        self.edit(|spec| {
            let mut hooks = spec.hooks().clone().unwrap_or_default();
            hooks.set_create_runtime(Some(vec![hook("createRuntime")]));
            hooks.set_poststop(Some(vec![hook("poststop")]));
            spec.set_hooks(Some(hooks));
        });
    }

    /// Adds a bind mount of the host's `source` at `destination`.
    pub fn bind(&self, source: &Path, destination: &str, read_only: bool) {
        let mut options = vec!["rbind".to_owned()];
        options.push(if read_only { "ro" } else { "rw" }.to_owned());
        let m: Mount = MountBuilder::default()
            .destination(destination)
            .typ("bind")
            .source(source)
            .options(options)
            .build()
            .expect("mount");
        self.edit(|spec| {
            let mut mounts = spec.mounts().clone().unwrap_or_default();
            mounts.push(m);
            spec.set_mounts(Some(mounts));
        });
    }

    /// Makes the host's dynamic libraries available in the container (read-only), so that
    /// dynamically linked test fixtures run there: `/usr` bound, `/lib` and `/lib64` bound or,
    /// where they are the merged-/usr symlinks, recreated as the same symlinks.
    pub fn with_host_libraries(&self) {
        let rootfs = self.dir.join("rootfs");
        self.bind(Path::new("/usr"), "/usr", true);
        for d in ["lib", "lib64"] {
            let host = Path::new("/").join(d);
            match std::fs::read_link(&host) {
                Ok(target) => {
                    let _ = std::os::unix::fs::symlink(target, rootfs.join(d));
                }
                Err(_) if host.is_dir() => self.bind(&host, &format!("/{d}"), true),
                Err(_) => {}
            }
        }
    }
}

/// A `sleep` process moved into the cgroup directory `dir`; killed on drop.
pub struct Sleeper {
    child: std::process::Child,
    pub pid: u32,
}

impl Sleeper {
    pub fn start_in(dir: &Path) -> Self {
        let child = Command::new("sleep")
            .arg("600")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("move into cgroup");
        Self { child, pid }
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `gpud-oci-hook` arguments for a test: its bus, record directory and log file.
pub fn hook_args(bus: &str, records: &Path, log: &Path) -> Vec<String> {
    vec![
        "--bus-address".into(),
        bus.into(),
        "--record-dir".into(),
        records.display().to_string(),
        "--log-file".into(),
        log.display().to_string(),
    ]
}
