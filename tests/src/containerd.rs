//! containerd 1.7 for the NRI plugin's end-to-end test: Debian's containerd 1.7 (from trixie;
//! Debian 12 has 1.6, without NRI), unpacked by `cargo xtask setup` into [`PREFIX`], started
//! by the test with its own configuration: root, state and sockets in the test's directory, NRI
//! enabled on the test's socket, the CRI plugin with the cgroupfs driver and the test's busybox
//! image as its sandbox image. The test calls the CRI as a kubelet does ([`cri`], a subset of
//! the CRI generated from `proto/cri.proto`): containerd 1.7 runs NRI for CRI containers only,
//! not for `ctr run`.
//!
//! Pods use the host's network namespace, so no CNI plugin is involved. The image is an OCI
//! layout of the busybox root filesystem, built on the spot and imported with `ctr`: no registry.
//! The one path outside the test's directory: the shims' sockets in `/run/containerd/s`, which
//! containerd 1.7 does not let a configuration move (empty again once the shims are gone).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    cgroup2_root,
    runtime::{busybox_rootfs, cgroup_v1_mounts, remove_v1_dirs, runc_path},
};

/// Where `cargo xtask setup` unpacks Debian's containerd 1.7 package (binaries in `usr/bin`).
pub const PREFIX: &str = "/opt/gpud-test/containerd";

/// The image the test's pods and containers run (imported, never pulled).
pub const IMAGE: &str = "gpud.test/busybox:1";

/// The CRI's `runtime.v1` messages and `RuntimeService` client (the subset the test uses).
pub mod cri {
    tonic::include_proto!("runtime.v1");
}

/// `PREFIX/usr/bin/NAME`.
fn bin(name: &str) -> PathBuf {
    Path::new(PREFIX).join("usr/bin").join(name)
}

/// Whether containerd 1.7 is unpacked at [`PREFIX`].
pub fn installed() -> bool {
    bin("containerd").exists() && bin("ctr").exists() && bin("containerd-shim-runc-v2").exists()
}

/// A running containerd of the test's own, stopped (with its shims) on drop.
pub struct Containerd {
    child: Child,
    dir: PathBuf,
    pub socket: PathBuf,
    pub nri_socket: PathBuf,
    pub log: PathBuf,
    cgroup_parent: String,
}

impl Containerd {
    /// Starts containerd in `dir/containerd` and imports [`IMAGE`]; pods are to go under
    /// `cgroup_parent` (relative to the cgroup v2 root), which [`Drop`] cleans up in cgroup v1.
    pub fn start(dir: &Path, cgroup_parent: &str) -> Self {
        assert!(
            installed(),
            "containerd 1.7 not found in {PREFIX}: `cargo xtask setup` installs it"
        );
        let dir = dir.join("containerd");
        std::fs::create_dir_all(&dir).expect("containerd dir");
        let socket = dir.join("containerd.sock");
        let nri_socket = dir.join("nri.sock");
        let config = dir.join("config.toml");
        std::fs::write(&config, config_toml(&dir, &socket, &nri_socket)).expect("config.toml");
        let log = dir.join("containerd.log");
        let log_file = std::fs::File::create(&log).expect("containerd log");
        let path = format!(
            "{}:{}",
            bin("").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let child = Command::new(bin("containerd"))
            .arg("--config")
            .arg(&config)
            // containerd finds its shim (containerd-shim-runc-v2) on PATH.
            .env("PATH", path)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start containerd");
        let c = Self {
            child,
            dir,
            socket,
            nri_socket,
            log,
            cgroup_parent: cgroup_parent.to_owned(),
        };
        c.wait_ready();
        c.import_image();
        c
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `ctr --address SOCKET --namespace k8s.io` (the CRI's namespace).
    pub fn ctr(&self) -> Command {
        let mut c = Command::new(bin("ctr"));
        c.arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io"]);
        c
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.nri_socket.exists()
                && self
                    .ctr()
                    .arg("version")
                    .output()
                    .is_ok_and(|o| o.status.success())
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("containerd did not start:\n{}", self.log_text());
    }

    /// Builds an OCI image layout of the busybox root filesystem (one uncompressed layer, `sleep`
    /// as its command, which the pod sandbox runs) and imports it as [`IMAGE`].
    fn import_image(&self) {
        let work = self.dir.join("image");
        let blobs = work.join("layout/blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("blobs dir");
        busybox_rootfs(&work.join("rootfs"));
        let layer = work.join("layer.tar");
        run(Command::new("tar")
            .arg("-C")
            .arg(work.join("rootfs"))
            .args(["--owner=0", "--group=0", "--numeric-owner", "-cf"])
            .arg(&layer)
            .arg("."));
        let (layer_digest, layer_size) = add_blob(&blobs, &std::fs::read(&layer).expect("layer"));
        let config = serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["sleep", "1000000"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        });
        let (config_digest, config_size) = add_blob(&blobs, config.to_string().as_bytes());
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }],
        });
        let (manifest_digest, manifest_size) = add_blob(&blobs, manifest.to_string().as_bytes());
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {"io.containerd.image.name": IMAGE},
            }],
        });
        std::fs::write(work.join("layout/index.json"), index.to_string()).expect("index.json");
        std::fs::write(
            work.join("layout/oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .expect("oci-layout");
        let archive = work.join("image.tar");
        run(Command::new("tar")
            .arg("-C")
            .arg(work.join("layout"))
            .arg("-cf")
            .arg(&archive)
            .arg("."));
        run(self
            .ctr()
            .args(["images", "import", "--snapshotter", "native"])
            .arg(&archive));
    }

    /// A CRI client on containerd's socket.
    pub fn cri(
        &self,
    ) -> cri::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel> {
        cri::runtime_service_client::RuntimeServiceClient::new(gpud_k8s::grpc::unix_channel(
            &self.socket,
        ))
    }

    /// Processes whose command line names this containerd's socket: its shims.
    fn shims(&self) -> Vec<u32> {
        let needle = self.socket.as_os_str().as_encoded_bytes().to_vec();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_slice()))
            })
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A shim killed here leaves its socket in /run/containerd/s; each task's `address` file
        // names it.
        let tasks = self.dir.join("state/io.containerd.runtime.v2.task");
        for ns in std::fs::read_dir(&tasks).into_iter().flatten().flatten() {
            for task in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
                if let Ok(address) = std::fs::read_to_string(task.path().join("address")) {
                    let socket = address.trim().trim_start_matches("unix://");
                    if socket.starts_with("/run/containerd/s/") {
                        let _ = std::fs::remove_file(socket);
                    }
                }
            }
        }
        // Shims outlive containerd by design.
        for pid in self.shims() {
            // SAFETY: kill(2) with a pid read from /proc; no memory is involved.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        // Mounts containerd made under its root and state (the native snapshotter's binds, the
        // sandbox's shm), innermost first.
        crate::paths::unmount_under(&self.dir, None);
        // What a failed test left running under the pods' parent goes now, so that its cgroups
        // can: runc (cgroupfs driver) makes `<parent>/<id>` in cgroup v2 and every v1 hierarchy,
        // removes those of the containers it deleted, and never the parent (in v2 the test's
        // `Cgroup` removes it).
        let parent = self.cgroup_parent.trim_start_matches('/');
        let _ = std::fs::write(cgroup2_root().join(parent).join("cgroup.kill"), "1");
        for _ in 0..50 {
            for mount in cgroup_v1_mounts().into_iter().chain([cgroup2_root()]) {
                let children = std::fs::read_dir(mount.join(parent)).into_iter().flatten();
                for child in children.flatten() {
                    if child.path().is_dir() {
                        let _ = std::fs::remove_dir(child.path());
                    }
                }
            }
            if remove_v1_dirs(&self.cgroup_parent) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs `cmd`, panicking with its output if it fails.
fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Stores `data` as a blob of an OCI layout: its digest (`sha256:…`) and size.
fn add_blob(blobs: &Path, data: &[u8]) -> (String, usize) {
    let tmp = blobs.join("incoming");
    std::fs::write(&tmp, data).expect("blob");
    let out = Command::new("sha256sum")
        .arg(&tmp)
        .output()
        .expect("sha256sum");
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text.split_whitespace().next().expect("a digest").to_owned();
    std::fs::rename(&tmp, blobs.join(&hex)).expect("name the blob");
    (format!("sha256:{hex}"), data.len())
}

/// containerd's configuration (version 2, containerd 1.7).
fn config_toml(dir: &Path, socket: &Path, nri_socket: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
# Snapshotters that need their own filesystems, and tracing: not wanted here.
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{socket}"

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "{nri}"
  plugin_path = "{d}/nri-plugins"
  plugin_config_path = "{d}/nri-conf.d"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"

[plugins."io.containerd.grpc.v1.cri"]
  # The sandbox's oom_score_adj of -998 needs CAP_SYS_RESOURCE, which sandboxed runners lack:
  # keep containers at or above containerd's own.
  restrict_oom_score_adj = true
  sandbox_image = "{IMAGE}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/cni-bin"
    conf_dir = "{d}/cni-conf"
"#,
        socket = socket.display(),
        nri = nri_socket.display(),
        runc = runc_path().display(),
    )
}
