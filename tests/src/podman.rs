//! Podman for the OCI hook's end-to-end tests: Debian's `podman` (4.3 on Debian 12) runs
//! containers from a busybox root filesystem directory (`--rootfs`, no image, no registry) and
//! finds gpud's hook through a hooks.d directory, as on a real host.
//!
//! Everything Podman keeps lives in the test's directory: storage (`--root`, driver `vfs`),
//! run state (`--runroot`), its own tmp directory (`--tmpdir`), network definitions
//! (`--network-config-dir`), no events log, hooks from the test's `--hooks-dir` only; no
//! configuration file is read or written beyond Debian's defaults. What Podman 4.3 cannot be
//! pointed elsewhere: the shared-memory lock segment (`/dev/shm/libpod_lock`, a lock allocated
//! and freed per container), netavark's run directory `/run/containers/networks` (created,
//! empty, even with `--network none`) and, on a cgroup v1/v2 hybrid host, the cgroup v1
//! directories under the `--cgroup-parent`, which [`Podman`]'s drop removes.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use crate::{
    bin_dir, cgroup2_root,
    runtime::{busybox_rootfs, remove_v1_dirs, runc_path},
};

/// `podman` on PATH (`cargo xtask setup` installs Debian's package).
pub fn podman_path() -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join("podman");
        if p.exists() {
            return p;
        }
    }
    panic!("podman not found: `cargo xtask setup` installs the Debian package");
}

/// Open files and processes of the containers. Podman as root asks for 1048576 open files
/// (and its own process limit) unless told: more than a host without `CAP_SYS_RESOURCE` (a
/// container, a sandboxed CI runner) may raise to, where runc fails with `error setting
/// rlimits`. Lower limits can always be set.
const ULIMITS: [&str; 2] = ["nofile=1024:1024", "nproc=1024:1024"];

/// A Podman whose storage, state and hooks are the test's own, with containers in the cgroup
/// `cgroup_parent` (cgroupfs driver).
pub struct Podman {
    dir: PathBuf,
    pub hooks_dir: PathBuf,
    pub rootfs: PathBuf,
    cgroup_parent: String,
}

impl Podman {
    /// A Podman in `dir/podman` whose containers go under `cgroup_parent` (a path relative to the
    /// cgroup v2 root, e.g. a test [`crate::Cgroup`]'s `rel`).
    pub fn new(dir: &Path, cgroup_parent: &str) -> Self {
        let dir = dir.join("podman");
        let hooks_dir = dir.join("hooks.d");
        let rootfs = dir.join("rootfs");
        std::fs::create_dir_all(&hooks_dir).expect("hooks.d");
        busybox_rootfs(&rootfs);
        Self {
            dir,
            hooks_dir,
            rootfs,
            cgroup_parent: cgroup_parent.to_owned(),
        }
    }

    /// `podman` with the global options that keep it inside the test's directory. The first
    /// command of this process runs alone: Podman creates its shared-memory lock segment
    /// (`/dev/shm/libpod_lock`) the first time any Podman runs on a host, and two doing it at
    /// once fail (`failed to create 2048 locks in /libpod_lock: file exists`).
    pub fn command(&self) -> Command {
        static FIRST: std::sync::Once = std::sync::Once::new();
        FIRST.call_once(|| {
            let _ = self.bare_command().arg("info").output();
        });
        self.bare_command()
    }

    fn bare_command(&self) -> Command {
        let mut c = Command::new(podman_path());
        c.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .arg("--network-config-dir")
            .arg(self.dir.join("networks"))
            .args(["--storage-driver", "vfs", "--events-backend", "none"])
            // Not systemd: gpud's tests own their cgroups; cgroupfs puts the container at
            // `<cgroup parent>/libpod-<id>`, in cgroup v2 too on a hybrid host (runc does).
            .args(["--cgroup-manager", "cgroupfs"])
            .arg("--runtime")
            .arg(runc_path())
            .arg("--hooks-dir")
            .arg(&self.hooks_dir);
        c
    }

    /// `podman run --detach --name NAME` of the busybox root filesystem running `args`, with
    /// `annotations` and `extra` options (e.g. `--rm`).
    pub fn run(
        &self,
        name: &str,
        annotations: &[(&str, &str)],
        extra: &[&str],
        args: &[&str],
    ) -> Output {
        let mut c = self.command();
        c.args(["run", "--detach", "--network", "none", "--name", name])
            .arg("--cgroup-parent")
            .arg(&self.cgroup_parent);
        for u in ULIMITS {
            c.args(["--ulimit", u]);
        }
        for (k, v) in annotations {
            c.arg("--annotation").arg(format!("{k}={v}"));
        }
        // `--rootfs` is a switch: the first argument after the options is the directory.
        c.args(extra).arg("--rootfs").arg(&self.rootfs).args(args);
        c.output().expect("run podman")
    }

    /// `podman rm --force --time 0 NAME`: kills the container at once and removes it.
    pub fn rm(&self, name: &str) -> Output {
        self.command()
            .args(["rm", "--force", "--time", "0", name])
            .output()
            .expect("podman rm")
    }

    /// `podman inspect --format FORMAT NAME`, trimmed; `None` if Podman has no such container.
    pub fn inspect(&self, name: &str, format: &str) -> Option<String> {
        let out = self
            .command()
            .args(["inspect", "--format", format, name])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// The ids of every container Podman has, in any state.
    pub fn all_ids(&self) -> Vec<String> {
        let out = self
            .command()
            .args(["ps", "--all", "--quiet", "--no-trunc"])
            .output()
            .expect("podman ps");
        assert!(
            out.status.success(),
            "podman ps: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Writes the shipped hooks.d files (`config/oci-hooks.d`) into the hooks directory with
    /// this build's hook and `args` before the stage: the shipped `when` condition and stages,
    /// read by the real Podman.
    pub fn install_gpud_hooks(&self, args: &[&str]) {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/oci-hooks.d");
        for entry in std::fs::read_dir(&shipped).expect("config/oci-hooks.d") {
            let path = entry.expect("hooks.d entry").path();
            let text = std::fs::read_to_string(&path).expect("hooks.d file");
            let mut v: serde_json::Value = serde_json::from_str(&text).expect("hooks.d JSON");
            let stage = v["stages"][0].as_str().expect("a stage").to_owned();
            let mut argv = vec!["gpud-oci-hook".to_owned()];
            argv.extend(args.iter().map(|a| (*a).to_owned()));
            argv.push(stage);
            v["hook"]["path"] = bin_dir().join("gpud-oci-hook").display().to_string().into();
            v["hook"]["args"] = argv.into();
            let name = path.file_name().expect("file name");
            std::fs::write(self.hooks_dir.join(name), v.to_string()).expect("write hooks.d file");
        }
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self
            .command()
            .args(["rm", "--all", "--force", "--time", "0"])
            .output();
        // Podman's cgroupfs manager puts conmon into `<parent>/conmon` (of every v1 hierarchy in
        // its cgroup v1 mode on a hybrid host, of cgroup v2 on a unified one) and leaves it
        // there; conmon exits shortly after its container.
        let conmon = format!("{}/conmon", self.cgroup_parent);
        let v2 = cgroup2_root().join(conmon.trim_start_matches('/'));
        for _ in 0..100 {
            let v2_gone = match std::fs::remove_dir(&v2) {
                Ok(()) => true,
                Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            };
            if remove_v1_dirs(&conmon) && v2_gone {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // vfs layers and container files: the test directory goes with its TempDir.
    }
}
