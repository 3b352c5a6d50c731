//! `cargo xtask install` and `cargo xtask uninstall`: gpud as a system service.
//!
//! Install builds the release binaries ([`PACKAGES`]: the daemon's crate, gpud-runtime, gpud-k8s)
//! and puts, under `DESTDIR` (default: none, the real root):
//!
//! | what | where |
//! | --- | --- |
//! | `gpud`, `gpudctl`, `gpud-oci-hook`, `gpud-nri`, `gpud-k8s` | `PREFIX/bin/` (0755) |
//! | the unit, `ExecStart` pointing at `PREFIX/bin/gpud` | `/etc/systemd/system/gpud.service` |
//! | the D-Bus system policy | `/usr/share/dbus-1/system.d/dev.gpud.Daemon1.conf` |
//! | the default configuration, only if none is there (else beside it as `gpud.toml.dist`) | `/etc/gpud/gpud.toml` |
//! | the OCI hook definitions, `hook.path` pointing at `PREFIX/bin/gpud-oci-hook` | `/usr/share/containers/oci/hooks.d/` |
//! | README and operations guide | `PREFIX/share/doc/gpud/` |
//! | the manifest: every file above with its SHA-256 | `PREFIX/share/gpud/install-manifest.json` |
//!
//! On the real root it also creates the system group `gpud-admin` (the D-Bus policy's admin
//! group) if missing, and reloads systemd and the system bus where they run. Uninstall removes
//! what the manifest lists, except files changed since (a configuration the user edited); never
//! the state directory. Both are idempotent.

use std::{
    collections::BTreeMap,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

use crate::util::{cargo, root, run as run_cmd};

/// The installed binaries, each with the package that builds it: the daemon and its CLI (`gpud`),
/// the container-runtime side (`gpud-runtime`), the Kubernetes plugins (`gpud-k8s`).
const PACKAGES: &[(&str, &[&str])] = &[
    ("gpud", &["gpud", "gpudctl"]),
    ("gpud-runtime", &["gpud-oci-hook", "gpud-nri"]),
    ("gpud-k8s", &["gpud-k8s"]),
];

/// Every installed binary.
fn binaries() -> impl Iterator<Item = &'static str> {
    PACKAGES.iter().flat_map(|(_, bins)| bins.iter().copied())
}
const UNIT_PATH: &str = "etc/systemd/system/gpud.service";
const DBUS_POLICY_PATH: &str = "usr/share/dbus-1/system.d/dev.gpud.Daemon1.conf";
const CONFIG_PATH: &str = "etc/gpud/gpud.toml";
const HOOKS_DIR: &str = "usr/share/containers/oci/hooks.d";
const ADMIN_GROUP: &str = "gpud-admin";

/// Where to install.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Absolute, e.g. `/usr/local`.
    pub prefix: PathBuf,
    /// Staging root; `None` installs into the real `/`.
    pub destdir: Option<PathBuf>,
}

impl Layout {
    /// `path` (absolute on the target system) under the destdir.
    fn staged(&self, path: &Path) -> PathBuf {
        let rel = path.strip_prefix("/").unwrap_or(path);
        match &self.destdir {
            Some(d) => d.join(rel),
            None => Path::new("/").join(rel),
        }
    }

    /// The target-system path of a staged one.
    fn unstaged(&self, staged: &Path) -> Option<PathBuf> {
        let base = self.staged(Path::new("/"));
        staged
            .strip_prefix(&base)
            .ok()
            .map(|r| Path::new("/").join(r))
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.prefix.join("bin").join(name)
    }

    fn manifest(&self) -> PathBuf {
        self.staged(&self.prefix.join("share/gpud/install-manifest.json"))
    }
}

/// What install put there (paths on the target system): each file with the SHA-256 of what was
/// written, and the directories it had to create.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Manifest {
    files: BTreeMap<PathBuf, String>,
    dirs: std::collections::BTreeSet<PathBuf>,
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn read_manifest(layout: &Layout) -> anyhow::Result<Manifest> {
    let path = layout.manifest();
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("reading the manifest {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Writes `bytes` to `target` (a path on the target system) with `mode`, records it.
fn put(
    layout: &Layout,
    manifest: &mut Manifest,
    target: &Path,
    bytes: &[u8],
    mode: u32,
) -> anyhow::Result<()> {
    let staged = layout.staged(target);
    // Record the directories this creates, so that uninstall removes them (and no others).
    let mut missing = target.parent();
    while let Some(d) = missing.filter(|d| !layout.staged(d).exists()) {
        manifest.dirs.insert(d.to_owned());
        missing = d.parent();
    }
    if let Some(dir) = staged.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // Write beside, then rename: a running binary is replaced, not overwritten in place.
    let tmp = staged.with_extension("gpud-install-tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, &staged).with_context(|| format!("installing {}", staged.display()))?;
    println!("installed {}", staged.display());
    manifest.files.insert(target.to_owned(), sha256(bytes));
    Ok(())
}

/// The unit with its paths on this prefix.
fn unit_text(layout: &Layout) -> String {
    let gpud = layout.bin("gpud").display().to_string();
    let doc = layout.prefix.join("share/doc/gpud/README.md");
    include_str!("../../systemd/gpud.service")
        .replace("ExecStart=/usr/bin/gpud ", &format!("ExecStart={gpud} "))
        .replace(
            "Documentation=file:///usr/share/doc/gpud/README.md",
            &format!("Documentation=file://{}", doc.display()),
        )
}

/// An OCI hook definition with `hook.path` on this prefix.
fn hook_text(layout: &Layout, text: &str) -> anyhow::Result<String> {
    let mut v: serde_json::Value = serde_json::from_str(text).context("parsing a hook file")?;
    let path = v
        .get_mut("hook")
        .and_then(|h| h.get_mut("path"))
        .context("hook file without hook.path")?;
    *path = serde_json::Value::String(layout.bin("gpud-oci-hook").display().to_string());
    Ok(serde_json::to_string_pretty(&v)? + "\n")
}

/// Builds the release binaries and returns their directory.
pub fn build_release() -> anyhow::Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args(["build", "--release"]);
    for (package, bins) in PACKAGES {
        cmd.args(["-p", package]);
        for b in *bins {
            cmd.args(["--bin", b]);
        }
    }
    run_cmd("cargo build --release (gpud binaries)", &mut cmd)?;
    Ok(root().join("target/release"))
}

fn pid1_is_systemd() -> bool {
    std::fs::read_to_string("/proc/1/comm").is_ok_and(|c| c.trim() == "systemd")
}

fn system_bus_runs() -> bool {
    Path::new("/run/dbus/system_bus_socket").exists()
}

/// Runs a system tool; its failure is reported, not fatal (the files are in place).
fn try_run(what: &str, cmd: &mut Command) {
    match cmd.status() {
        Ok(s) if s.success() => println!("{what}: done"),
        Ok(s) => println!("{what}: failed ({s}); do it by hand"),
        Err(e) => println!("{what}: cannot run ({e}); do it by hand"),
    }
}

fn group_exists(name: &str) -> bool {
    Command::new("getent")
        .args(["group", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs from `bin_dir` (the release build when `None`).
pub fn install(layout: &Layout, bin_dir: Option<&Path>) -> anyhow::Result<()> {
    check_layout(layout)?;
    let bin_dir = match bin_dir {
        Some(d) => d.to_owned(),
        None => build_release()?,
    };
    let previous = read_manifest(layout)?;
    let mut manifest = Manifest {
        dirs: previous.dirs.clone(),
        ..Manifest::default()
    };
    for b in binaries() {
        let src = bin_dir.join(b);
        let bytes = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        put(layout, &mut manifest, &layout.bin(b), &bytes, 0o755)?;
    }
    put(
        layout,
        &mut manifest,
        &Path::new("/").join(UNIT_PATH),
        unit_text(layout).as_bytes(),
        0o644,
    )?;
    put(
        layout,
        &mut manifest,
        &Path::new("/").join(DBUS_POLICY_PATH),
        include_bytes!("../../systemd/dev.gpud.Daemon1.conf"),
        0o644,
    )?;
    install_config(layout, &previous, &mut manifest)?;
    for (name, text) in [
        (
            "50-gpud-create.json",
            include_str!("../../config/oci-hooks.d/50-gpud-create.json"),
        ),
        (
            "50-gpud-poststop.json",
            include_str!("../../config/oci-hooks.d/50-gpud-poststop.json"),
        ),
    ] {
        let target = Path::new("/").join(HOOKS_DIR).join(name);
        put(
            layout,
            &mut manifest,
            &target,
            hook_text(layout, text)?.as_bytes(),
            0o644,
        )?;
    }
    let doc = layout.prefix.join("share/doc/gpud");
    for (name, text) in [
        ("README.md", include_str!("../../README.md")),
        ("operations.md", include_str!("../../docs/operations.md")),
    ] {
        put(
            layout,
            &mut manifest,
            &doc.join(name),
            text.as_bytes(),
            0o644,
        )?;
    }
    // Files a previous install put there that this one no longer does.
    for (old, hash) in previous
        .files
        .iter()
        .filter(|(p, _)| !manifest.files.contains_key(*p))
    {
        remove_if_unchanged(layout, old, hash)?;
    }
    let mpath = layout.manifest();
    let mut missing = mpath.parent();
    while let Some(d) = missing.filter(|d| !d.exists()) {
        if let Some(target) = layout.unstaged(d) {
            manifest.dirs.insert(target);
        }
        missing = d.parent();
    }
    if let Some(dir) = mpath.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&mpath, serde_json::to_string_pretty(&manifest)? + "\n")
        .with_context(|| format!("writing {}", mpath.display()))?;
    std::fs::set_permissions(&mpath, std::fs::Permissions::from_mode(0o644))?;
    println!("manifest {}", mpath.display());

    if layout.destdir.is_none() {
        if group_exists(ADMIN_GROUP) {
            println!("group {ADMIN_GROUP} exists");
        } else {
            try_run(
                &format!("groupadd --system {ADMIN_GROUP}"),
                Command::new("groupadd").args(["--system", ADMIN_GROUP]),
            );
        }
        reload_managers();
        println!(
            "next: systemctl enable --now gpud   (check the config first: gpud --check-config)"
        );
    }
    Ok(())
}

/// The default configuration, only where none is: an existing one (the user's) stays, and the
/// shipped one goes beside it as `gpud.toml.dist`.
fn install_config(
    layout: &Layout,
    previous: &Manifest,
    manifest: &mut Manifest,
) -> anyhow::Result<()> {
    let target = Path::new("/").join(CONFIG_PATH);
    let shipped = include_bytes!("../../config/gpud.toml");
    let staged = layout.staged(&target);
    match std::fs::read(&staged) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            put(layout, manifest, &target, shipped, 0o644)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", staged.display())),
        // Ours, unchanged since a previous install: still ours, and up to date.
        Ok(bytes) if previous.files.get(&target) == Some(&sha256(&bytes)) => {
            put(layout, manifest, &target, shipped, 0o644)
        }
        Ok(_) => {
            let dist = target.with_extension("toml.dist");
            put(layout, manifest, &dist, shipped, 0o644)?;
            println!(
                "kept the existing {}; the shipped defaults are in {}",
                staged.display(),
                layout.staged(&dist).display()
            );
            Ok(())
        }
    }
}

fn reload_managers() {
    if pid1_is_systemd() {
        try_run(
            "systemctl daemon-reload",
            Command::new("systemctl").arg("daemon-reload"),
        );
    } else {
        println!("systemd is not PID 1: no daemon-reload");
    }
    if system_bus_runs() {
        try_run(
            "reloading the system bus's policy",
            Command::new("dbus-send").args([
                "--system",
                "--type=method_call",
                "--dest=org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus.ReloadConfig",
            ]),
        );
    } else {
        println!("no system bus runs: no policy reload");
    }
}

/// Removes `target` if it still holds what install wrote.
fn remove_if_unchanged(layout: &Layout, target: &Path, hash: &str) -> anyhow::Result<()> {
    let staged = layout.staged(target);
    match std::fs::read(&staged) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("reading {}", staged.display())),
        Ok(bytes) if sha256(&bytes) != hash => {
            println!("kept {} (changed since it was installed)", staged.display());
            Ok(())
        }
        Ok(_) => {
            std::fs::remove_file(&staged)
                .with_context(|| format!("removing {}", staged.display()))?;
            println!("removed {}", staged.display());
            Ok(())
        }
    }
}

/// Removes the directories install created, deepest first, where empty.
fn remove_dirs(layout: &Layout, dirs: &std::collections::BTreeSet<PathBuf>) {
    for d in dirs.iter().rev() {
        let staged = layout.staged(d);
        if std::fs::remove_dir(&staged).is_ok() {
            println!("removed {}/", staged.display());
        }
    }
}

pub fn uninstall(layout: &Layout) -> anyhow::Result<()> {
    check_layout(layout)?;
    let manifest = read_manifest(layout)?;
    if manifest.files.is_empty() {
        println!(
            "nothing to uninstall: no manifest at {}",
            layout.manifest().display()
        );
        return Ok(());
    }
    for (target, hash) in &manifest.files {
        remove_if_unchanged(layout, target, hash)?;
    }
    let mpath = layout.manifest();
    std::fs::remove_file(&mpath).with_context(|| format!("removing {}", mpath.display()))?;
    println!("removed {}", mpath.display());
    remove_dirs(layout, &manifest.dirs);
    if layout.destdir.is_none() {
        // The admin group may have members and other uses; it stays (groupdel gpud-admin).
        println!("kept the group {ADMIN_GROUP} and the state directory /var/lib/gpud");
        reload_managers();
    }
    Ok(())
}

fn check_layout(layout: &Layout) -> anyhow::Result<()> {
    if !layout.prefix.is_absolute() {
        bail!("--prefix must be absolute, not {}", layout.prefix.display());
    }
    if let Some(d) = &layout.destdir
        && !d.is_absolute()
    {
        bail!("--destdir must be absolute, not {}", d.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file under `dir`, relative, with its mode.
    fn tree(dir: &Path) -> BTreeMap<PathBuf, u32> {
        let mut out = BTreeMap::new();
        let mut stack = vec![dir.to_owned()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).expect("read_dir") {
                let e = e.expect("entry");
                let meta = e.metadata().expect("metadata");
                if meta.is_dir() {
                    stack.push(e.path());
                } else {
                    out.insert(
                        e.path().strip_prefix(dir).expect("under").to_owned(),
                        meta.permissions().mode() & 0o7777,
                    );
                }
            }
        }
        out
    }

    /// The workspace's built binaries (debug: `cargo xtask test` builds them first).
    fn built() -> PathBuf {
        let dir = root().join("target/debug");
        for b in binaries() {
            assert!(
                dir.join(b).is_file(),
                "{} missing: cargo build -p gpud -p gpud-runtime -p gpud-k8s --bins first",
                dir.join(b).display()
            );
        }
        dir
    }

    #[test]
    fn install_reinstall_and_uninstall_into_a_destdir() {
        let dest = std::env::temp_dir().join(format!("gpud-xtask-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::create_dir_all(&dest).expect("destdir");
        let layout = Layout {
            prefix: PathBuf::from("/opt/gpud-test"),
            destdir: Some(dest.clone()),
        };
        install(&layout, Some(&built())).expect("install");
        let files = tree(&dest);
        let want: BTreeMap<PathBuf, u32> = [
            ("opt/gpud-test/bin/gpud", 0o755),
            ("opt/gpud-test/bin/gpudctl", 0o755),
            ("opt/gpud-test/bin/gpud-oci-hook", 0o755),
            ("opt/gpud-test/bin/gpud-nri", 0o755),
            ("opt/gpud-test/bin/gpud-k8s", 0o755),
            ("etc/systemd/system/gpud.service", 0o644),
            ("usr/share/dbus-1/system.d/dev.gpud.Daemon1.conf", 0o644),
            ("etc/gpud/gpud.toml", 0o644),
            (
                "usr/share/containers/oci/hooks.d/50-gpud-create.json",
                0o644,
            ),
            (
                "usr/share/containers/oci/hooks.d/50-gpud-poststop.json",
                0o644,
            ),
            ("opt/gpud-test/share/doc/gpud/README.md", 0o644),
            ("opt/gpud-test/share/doc/gpud/operations.md", 0o644),
            ("opt/gpud-test/share/gpud/install-manifest.json", 0o644),
        ]
        .into_iter()
        .map(|(p, m)| (PathBuf::from(p), m))
        .collect();
        assert_eq!(files, want);

        // Paths rewritten to the prefix.
        let unit = std::fs::read_to_string(dest.join(UNIT_PATH)).expect("unit");
        assert!(
            unit.contains("\nExecStart=/opt/gpud-test/bin/gpud --config /etc/gpud/gpud.toml\n"),
            "{unit}"
        );
        assert!(!unit.contains("/usr/bin/gpud"), "{unit}");
        for hook in ["50-gpud-create.json", "50-gpud-poststop.json"] {
            let v: serde_json::Value = serde_json::from_slice(
                &std::fs::read(dest.join(HOOKS_DIR).join(hook)).expect("hook"),
            )
            .expect("hook JSON");
            assert_eq!(v["hook"]["path"], "/opt/gpud-test/bin/gpud-oci-hook");
        }
        assert_eq!(
            std::fs::read(dest.join("opt/gpud-test/bin/gpud")).expect("gpud"),
            std::fs::read(built().join("gpud")).expect("built gpud")
        );
        // The installed unit verifies with its binary where ExecStart says.
        let staged_unit = dest.join("verify.service");
        std::fs::write(
            &staged_unit,
            unit.replace(
                "/opt/gpud-test/bin/gpud",
                &dest.join("opt/gpud-test/bin/gpud").display().to_string(),
            ),
        )
        .expect("unit copy");
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&staged_unit)
            .output()
            .expect("systemd-analyze");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::remove_file(&staged_unit).expect("remove copy");

        // Re-install: the same files, the unchanged config still ours.
        install(&layout, Some(&built())).expect("re-install");
        assert_eq!(tree(&dest), want);

        // A config the user changed stays, the defaults go beside it; uninstall keeps it.
        let config = dest.join(CONFIG_PATH);
        std::fs::write(&config, "[daemon]\nlog = \"debug\"\n").expect("edit config");
        install(&layout, Some(&built())).expect("install over an edited config");
        assert!(dest.join("etc/gpud/gpud.toml.dist").is_file());
        uninstall(&layout).expect("uninstall");
        assert_eq!(
            tree(&dest),
            BTreeMap::from([(PathBuf::from("etc/gpud/gpud.toml"), 0o644)]),
            "only the user's config remains"
        );
        // The user removes it (and its directory) by hand.
        std::fs::remove_dir_all(dest.join("etc")).expect("remove config");
        // Idempotent: nothing left to do.
        uninstall(&layout).expect("uninstall again");

        // Install then uninstall leaves nothing at all (no empty directories either).
        install(&layout, Some(&built())).expect("install");
        uninstall(&layout).expect("uninstall");
        assert!(
            std::fs::read_dir(&dest).expect("destdir").next().is_none(),
            "left behind: {:?}",
            tree(&dest)
        );
        std::fs::remove_dir_all(&dest).expect("cleanup");
    }

    #[test]
    fn relative_paths_are_refused() {
        let layout = Layout {
            prefix: PathBuf::from("usr/local"),
            destdir: None,
        };
        assert!(install(&layout, Some(Path::new("/nonexistent"))).is_err());
        let layout = Layout {
            prefix: PathBuf::from("/usr/local"),
            destdir: Some(PathBuf::from("stage")),
        };
        assert!(uninstall(&layout).is_err());
    }
}
