//! gpud as a node agent: what the Debian package puts on a host, installed from gpud's image
//! onto the node by the gpud DaemonSet (deploy/kubernetes/gpud), and taken away again.
//!
//! gpud itself runs in the DaemonSet's pod; what must live on the host is what the host's own
//! processes read: the system bus's policy for `dev.gpud.Daemon1` (read by the host's
//! `dbus-daemon`), gpud's OCI hook (run by the runtime from CDI specs and hooks.d, in the host's
//! mount namespace) with its hooks.d files, and `gpudctl` for operators on the node. [`install`]
//! copies them from the image under `--host-root` (the host's `/` mounted into the pod), writes
//! what it put where into a manifest, and asks the host's bus to reload its configuration;
//! [`uninstall`] removes exactly what the manifest names. [`wait_ready`] is the readiness
//! contract the plugin DaemonSets wait on: gpud's ready file on the host and an answer on the
//! host's bus.
//!
//! A host that has the package is refused: two owners of one policy file would undo each other.

use std::{
    ffi::OsString,
    io::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// Where the image keeps the host files (the package's copies, same contents).
pub const IMAGE_SHARE: &str = "/usr/share/gpud/node";
/// Where on the host the binaries go: writable on every node OS we know of (`/usr` is read-only
/// on Container-Optimized OS, Bottlerocket and Flatcar).
pub const HOST_BIN_DIR: &str = "/opt/gpud/bin";
/// The manifest of what [`install`] put on the host (host paths).
pub const MANIFEST: &str = "/opt/gpud/installed.json";
/// The bus policy's place on the host: the administrator's directory, which every node OS can
/// write and every `dbus-daemon` reads (the package uses the vendor directory under /usr).
pub const POLICY: &str = "/etc/dbus-1/system.d/dev.gpud.Daemon1.conf";
/// Where the package puts the same policy: present means the package owns gpud on this host.
pub const PACKAGE_POLICY: &str = "/usr/share/dbus-1/system.d/dev.gpud.Daemon1.conf";
/// hooks.d for runtimes that read OCI hooks from files (CRI-O, Podman).
pub const HOOKS_DIR: &str = "/etc/containers/oci/hooks.d";
/// The hooks.d files (in the image's [`IMAGE_SHARE`]/hooks.d and on the host in [`HOOKS_DIR`]).
const HOOK_FILES: [&str; 2] = ["50-gpud-create.json", "50-gpud-poststop.json"];
/// The binaries put on the host (from the image's `/usr/bin`).
const BINARIES: [&str; 2] = ["gpud-oci-hook", "gpudctl"];

/// Why a node operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(
        "gpud's Debian package is installed on this node ({0} exists): use the package or the \
         DaemonSet, not both (remove the package, or the DaemonSet from this node)"
    )]
    PackageInstalled(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a hooks.d file gpud can rewrite: {reason}")]
    HookFile { path: PathBuf, reason: String },
    #[error("{path}: the install manifest cannot be read: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("the host's system bus: {0}")]
    Bus(#[from] zbus::Error),
    #[error("gpud was not ready within {waited:?}: {last}")]
    NotReady { waited: Duration, last: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> NodeError + '_ {
    move |source| NodeError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where things are: the host's root as this process sees it, the image's files.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The host's `/`, as mounted into the pod (`/host`); `/` when run on the host itself.
    pub host_root: PathBuf,
    /// The image's host files ([`IMAGE_SHARE`]).
    pub share: PathBuf,
    /// The image's binaries (`/usr/bin`).
    pub bin: PathBuf,
}

impl Layout {
    /// `host_path` (absolute, as the host names it) under the host root.
    fn on_host(&self, host_path: &Path) -> PathBuf {
        self.host_root
            .join(host_path.strip_prefix("/").unwrap_or(host_path))
    }
}

/// What [`install`] put on the host, as the host names it; written to [`MANIFEST`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The gpud version that installed them.
    pub version: String,
    /// Every file, host paths.
    pub files: Vec<PathBuf>,
    /// The directories install made (they did not exist), host paths, parents first.
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
}

/// Writes `bytes` to `path` through a temporary file and a rename, so the host never reads half
/// a file (the bus reloads on inotify; the runtime may run the hook at any moment).
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), NodeError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut name = OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(".gpud-new");
    let tmp = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Makes the host directory `host_dir` and its missing parents; records those it made in
/// `made` (host paths, parents first) for [`uninstall`].
fn make_dirs(layout: &Layout, host_dir: &Path, made: &mut Vec<PathBuf>) -> Result<(), NodeError> {
    let missing: Vec<&Path> = host_dir
        .ancestors()
        .take_while(|d| !layout.on_host(d).exists())
        .collect();
    for d in missing.into_iter().rev() {
        let p = layout.on_host(d);
        std::fs::create_dir(&p).map_err(io(&p))?;
        if !made.iter().any(|m| m == d) {
            made.push(d.to_owned());
        }
    }
    Ok(())
}

/// A hooks.d file with its hook's `path` pointed at `hook`.
fn rewrite_hook(src: &Path, hook: &Path) -> Result<Vec<u8>, NodeError> {
    let text = std::fs::read(src).map_err(io(src))?;
    let bad = |reason: String| NodeError::HookFile {
        path: src.to_owned(),
        reason,
    };
    let mut v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let slot = v
        .get_mut("hook")
        .and_then(|h| h.get_mut("path"))
        .ok_or_else(|| bad("no hook.path".into()))?;
    *slot = serde_json::Value::String(hook.to_string_lossy().into_owned());
    let mut out = serde_json::to_vec_pretty(&v).map_err(|e| bad(e.to_string()))?;
    out.push(b'\n');
    Ok(out)
}

/// Installs gpud's host files; returns the manifest written. Idempotent: a second run rewrites
/// the same files (an upgrade of the image replaces them).
pub fn install(layout: &Layout) -> Result<Manifest, NodeError> {
    let package = layout.on_host(Path::new(PACKAGE_POLICY));
    if package.exists() {
        return Err(NodeError::PackageInstalled(PACKAGE_POLICY.into()));
    }
    // A second install keeps what the first made as made by gpud.
    let mut dirs = installed(layout)?.map(|m| m.dirs).unwrap_or_default();
    for d in [HOST_BIN_DIR, HOOKS_DIR, "/etc/dbus-1/system.d"] {
        make_dirs(layout, Path::new(d), &mut dirs)?;
    }
    let mut files = Vec::new();
    let bin_dir = Path::new(HOST_BIN_DIR);
    for b in BINARIES {
        let src = layout.bin.join(b);
        let bytes = std::fs::read(&src).map_err(io(&src))?;
        let dst = bin_dir.join(b);
        write_atomic(&layout.on_host(&dst), &bytes, 0o755)?;
        files.push(dst);
    }
    let hook = bin_dir.join("gpud-oci-hook");
    for h in HOOK_FILES {
        let bytes = rewrite_hook(&layout.share.join("hooks.d").join(h), &hook)?;
        let dst = Path::new(HOOKS_DIR).join(h);
        write_atomic(&layout.on_host(&dst), &bytes, 0o644)?;
        files.push(dst);
    }
    let src = layout.share.join("dev.gpud.Daemon1.conf");
    let policy = std::fs::read(&src).map_err(io(&src))?;
    write_atomic(&layout.on_host(Path::new(POLICY)), &policy, 0o644)?;
    files.push(POLICY.into());
    let manifest = Manifest {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        files,
        dirs,
    };
    let mut json = serde_json::to_vec_pretty(&manifest).map_err(|e| NodeError::Manifest {
        path: MANIFEST.into(),
        reason: e.to_string(),
    })?;
    json.push(b'\n');
    write_atomic(&layout.on_host(Path::new(MANIFEST)), &json, 0o644)?;
    Ok(manifest)
}

/// Reads the manifest; `None` when nothing is installed.
pub fn installed(layout: &Layout) -> Result<Option<Manifest>, NodeError> {
    let path = layout.on_host(Path::new(MANIFEST));
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| NodeError::Manifest {
                path,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(NodeError::Io { path, source: e }),
    }
}

/// Removes what the manifest names, the manifest, and the directories [`install`] made when
/// they are left empty; returns the host paths removed (files, then directories). Nothing installed: nothing to do.
pub fn uninstall(layout: &Layout) -> Result<Vec<PathBuf>, NodeError> {
    let Some(manifest) = installed(layout)? else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for f in manifest
        .files
        .iter()
        .map(PathBuf::as_path)
        .chain([Path::new(MANIFEST)])
    {
        let p = layout.on_host(f);
        match std::fs::remove_file(&p) {
            Ok(()) => removed.push(f.to_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(NodeError::Io { path: p, source: e }),
        }
    }
    // Only the directories install made, children first; one someone else put files in stays.
    for d in manifest.dirs.iter().rev() {
        if std::fs::remove_dir(layout.on_host(d)).is_ok() {
            removed.push(d.clone());
        }
    }
    Ok(removed)
}

/// Removes a directory tree on the host (gpud's pins, its state) when a node is given up.
pub fn remove_tree(layout: &Layout, host_path: &Path) -> Result<bool, NodeError> {
    let p = layout.on_host(host_path);
    match std::fs::remove_dir_all(&p) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(NodeError::Io { path: p, source: e }),
    }
}

/// Asks the bus at `bus` (`system` or an address) to read its configuration again, so the
/// policy just written or removed takes effect now rather than at the daemon's next inotify
/// pass.
pub async fn reload_bus(bus: &str) -> Result<(), NodeError> {
    let conn = gpud_api::connect_builder(bus).build().await?;
    zbus::fdo::DBusProxy::new(&conn)
        .await?
        .reload_config()
        .await
        .map_err(zbus::Error::from)?;
    Ok(())
}

/// Waits until gpud answers on `bus` (a `Ping` of `dev.gpud.Daemon1`: gpud takes its name only
/// once its probes are attached and its state restored) and, when given, its `ready_file` (as
/// this process sees it) exists; each try bounded, giving up after `timeout`.
pub async fn wait_ready(
    ready_file: Option<&Path>,
    bus: &str,
    timeout: Duration,
) -> Result<(), NodeError> {
    let started = std::time::Instant::now();
    loop {
        let last = match ready_file {
            Some(f) if !f.exists() => format!("{} does not exist", f.display()),
            _ => match tokio::time::timeout(Duration::from_secs(5), ping(bus)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => format!("gpud does not answer on the bus: {e}"),
                Err(_) => "gpud does not answer on the bus within 5 s".to_owned(),
            },
        };
        if started.elapsed() >= timeout {
            return Err(NodeError::NotReady {
                waited: timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn ping(bus: &str) -> Result<(), zbus::Error> {
    let conn = gpud_api::connect_builder(bus).build().await?;
    zbus::fdo::PeerProxy::builder(&conn)
        .destination(gpud_api::BUS_NAME)
        .path(gpud_api::OBJECT_PATH)
        .build()
        .await?
        .ping()
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own per test, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let p =
                std::env::temp_dir().join(format!("gpud-k8s-node-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn layout(dir: &Path) -> Layout {
        let share = dir.join("image/share");
        let bin = dir.join("image/bin");
        std::fs::create_dir_all(share.join("hooks.d")).unwrap();
        std::fs::create_dir_all(&bin).unwrap();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::copy(
            repo.join("systemd/dev.gpud.Daemon1.conf"),
            share.join("dev.gpud.Daemon1.conf"),
        )
        .unwrap();
        for h in HOOK_FILES {
            std::fs::copy(
                repo.join("config/oci-hooks.d").join(h),
                share.join("hooks.d").join(h),
            )
            .unwrap();
        }
        for b in BINARIES {
            std::fs::write(bin.join(b), b"#!/bin/sh\n").unwrap();
        }
        let host_root = dir.join("host");
        std::fs::create_dir_all(host_root.join("etc")).unwrap();
        Layout {
            host_root,
            share,
            bin,
        }
    }

    fn tree(root: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_owned()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                out.push(p.strip_prefix(root).unwrap().to_owned());
                if p.is_dir() {
                    stack.push(p);
                }
            }
        }
        out.sort();
        out
    }

    /// Install puts the policy, the hook (with hooks.d pointing at it) and gpudctl on the host;
    /// uninstall leaves the host's tree as it was before.
    #[test]
    fn install_then_uninstall_leaves_the_host_as_it_was() {
        let dir = TempDir::new("cycle");
        let l = layout(dir.path());
        let before = tree(&l.host_root);
        let m = install(&l).unwrap();
        assert_eq!(m.files.len(), 5, "{m:?}");
        let hook: serde_json::Value = serde_json::from_slice(
            &std::fs::read(l.on_host(&Path::new(HOOKS_DIR).join("50-gpud-create.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(hook["hook"]["path"], "/opt/gpud/bin/gpud-oci-hook");
        assert!(l.on_host(Path::new(POLICY)).is_file());
        assert_eq!(installed(&l).unwrap(), Some(m.clone()));
        // Twice is the same as once.
        assert_eq!(install(&l).unwrap(), m);
        let removed = uninstall(&l).unwrap();
        // Five files, the manifest, and opt, opt/gpud, opt/gpud/bin, etc/containers,
        // etc/containers/oci, its hooks.d, etc/dbus-1, etc/dbus-1/system.d.
        assert_eq!(removed.len(), 14, "{removed:?}");
        assert_eq!(tree(&l.host_root), before);
        assert!(uninstall(&l).unwrap().is_empty());
    }

    /// A host with the package's policy is refused, and nothing is written.
    #[test]
    fn a_host_with_the_package_is_refused() {
        let dir = TempDir::new("package");
        let l = layout(dir.path());
        let pkg = l.on_host(Path::new(PACKAGE_POLICY));
        std::fs::create_dir_all(pkg.parent().unwrap()).unwrap();
        std::fs::write(&pkg, b"<busconfig/>").unwrap();
        let before = tree(&l.host_root);
        assert!(matches!(install(&l), Err(NodeError::PackageInstalled(_))));
        assert_eq!(tree(&l.host_root), before);
    }

    /// A directory someone else also uses keeps their files.
    #[test]
    fn uninstall_keeps_what_others_put_beside_gpuds_files() {
        let dir = TempDir::new("others");
        let l = layout(dir.path());
        install(&l).unwrap();
        let theirs = l.on_host(&Path::new(HOOKS_DIR).join("10-other.json"));
        std::fs::write(&theirs, b"{}").unwrap();
        uninstall(&l).unwrap();
        assert!(theirs.is_file());
        assert!(!l.on_host(Path::new(HOST_BIN_DIR)).exists());
    }
}
