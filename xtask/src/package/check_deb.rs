//! The .deb stage of `cargo xtask test`: install, verify, run, reinstall, remove and purge the
//! package on this machine.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::*;
use crate::util::{describe, output, run as run_cmd, stdout_and_stderr};

/// `cargo xtask test`'s .deb stage: build it, then on this machine `dpkg -i`,
/// `systemd-analyze verify` the installed unit, `gpud --check-config` the installed config, run
/// the installed gpud on a private bus and `gpudctl status` through it, reinstall over itself,
/// `dpkg -r`, `dpkg -P`: no file of the package is left, and the file system outside the
/// package's own paths is as before.
pub fn test_deb() -> anyhow::Result<()> {
    if dpkg_status("gpud").is_some() {
        println!("package test: gpud is installed already: purging it first");
        dpkg(&["--purge", "gpud"])?;
    }
    let deb = deb()?;
    let listing = output("dpkg -c", Command::new("dpkg").arg("-c").arg(&deb))?;
    println!(
        "package test: dpkg -c {}:\n{}",
        deb.display(),
        listing.trim_end()
    );
    let info = output("dpkg -I", Command::new("dpkg").arg("-I").arg(&deb))?;
    println!("package test: dpkg -I:\n{}", info.trim_end());
    let shipped = package_files(&deb)?;
    for want in [
        "/usr/bin/gpud",
        "/usr/bin/gpudctl",
        "/usr/bin/gpud-oci-hook",
        "/usr/bin/gpud-nri",
        "/usr/bin/gpud-k8s",
        "/usr/lib/systemd/system/gpud.service",
        "/usr/lib/systemd/system/gpud-nri.service",
        "/usr/share/dbus-1/system.d/dev.gpud.Daemon1.conf",
        "/etc/gpud/gpud.toml",
        "/usr/share/containers/oci/hooks.d/50-gpud-create.json",
        "/usr/share/containers/oci/hooks.d/50-gpud-poststop.json",
        "/usr/lib/sysusers.d/gpud.conf",
        "/usr/share/doc/gpud/examples/nri/50-gpud.conf",
    ] {
        if !shipped.contains(Path::new(want)) {
            bail!("the package lacks {want}");
        }
    }
    if !info.contains("Depends:") || !info.contains("dbus") {
        bail!("the package does not depend on dbus:\n{info}");
    }

    // A host where gpud was never installed: what a from-source install or a test run left in
    // the package's own paths is set aside (and put back at the end), so that the purge's
    // removal of gpud's state is checked against a clean start and touches nothing that was
    // there before.
    let _aside = Aside::new(&["/etc/gpud", "/var/lib/gpud", "/var/log/gpud-oci-hook.log"])?;
    let before = snapshot()?;
    let installed = dpkg(&["--install", &deb.display().to_string()])?;
    println!("package test: dpkg -i:\n{}", installed.trim_end());
    let conffiles = output(
        "dpkg-query conffiles",
        Command::new("dpkg-query").args(["--showformat=${Conffiles}\\n", "--show", "gpud"]),
    )?;
    if !conffiles.contains("/etc/gpud/gpud.toml") {
        bail!("/etc/gpud/gpud.toml is not a conffile: {conffiles:?}");
    }
    for f in &shipped {
        if !f.exists() {
            bail!("{} is in the package but not installed", f.display());
        }
    }
    // Enabled on install: the symlink deb-systemd-helper makes (it needs no running systemd).
    let wants = Path::new("/etc/systemd/system/multi-user.target.wants/gpud.service");
    if !wants.is_symlink() {
        bail!("gpud.service is not enabled ({} missing)", wants.display());
    }
    if Path::new("/etc/systemd/system/multi-user.target.wants/gpud-nri.service").exists() {
        bail!("gpud-nri.service is enabled; it ships disabled");
    }
    if !group_exists("gpud-admin") {
        bail!("the group gpud-admin was not created (sysusers)");
    }
    verify_unit()?;
    let check = output(
        "gpud --check-config",
        Command::new("/usr/bin/gpud").args(["--check-config", "--config", "/etc/gpud/gpud.toml"]),
    )?;
    println!("package test: gpud --check-config: {}", check.trim());
    let status = run_installed_gpud()?;
    println!(
        "package test: gpudctl status (installed gpud, private bus):\n{}",
        status.trim_end()
    );

    // Reinstalled over itself: the same files, still enabled, the config untouched.
    let files_installed = snapshot()?;
    let again = dpkg(&["--install", &deb.display().to_string()])?;
    println!("package test: dpkg -i again:\n{}", again.trim_end());
    let files_again = snapshot()?;
    if files_again != files_installed {
        bail!(
            "reinstalling changed the files: {}",
            diff(&files_installed, &files_again)
        );
    }

    let removed = dpkg(&["--remove", "gpud"])?;
    println!("package test: dpkg -r:\n{}", removed.trim_end());
    // Removed, not purged: the conffile (and its directory) stays, and what debhelper's
    // snippets keep until the purge: the units masked (so that nothing starts them while their
    // files are gone) and the admin's enablement with its record.
    let after_remove = snapshot()?;
    let left: BTreeSet<&PathBuf> = after_remove.difference(&before).collect();
    let want_left: BTreeSet<PathBuf> = [
        "/etc/gpud",
        "/etc/gpud/gpud.toml",
        "/etc/systemd/system/gpud.service",
        "/etc/systemd/system/gpud-nri.service",
        "/etc/systemd/system/multi-user.target.wants/gpud.service",
        // deb-systemd-helper's record that the admin enabled it, kept until purge.
        "/var/lib/systemd/deb-systemd-helper-enabled",
        "/var/lib/systemd/deb-systemd-helper-enabled/gpud.service.dsh-also",
        "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants",
        "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/gpud.service",
        "/var/lib/systemd/deb-systemd-helper-masked",
        "/var/lib/gpud",
    ]
    .into_iter()
    .map(PathBuf::from)
    .collect();
    let unexpected: Vec<&&PathBuf> = left
        .iter()
        .filter(|p| !want_left.iter().any(|w| p.starts_with(w)))
        .collect();
    if !unexpected.is_empty() {
        bail!("dpkg -r left {unexpected:?}");
    }
    if !Path::new("/etc/gpud/gpud.toml").is_file() {
        bail!("dpkg -r removed the conffile");
    }
    for unit in ["gpud.service", "gpud-nri.service"] {
        let mask = Path::new("/etc/systemd/system").join(unit);
        if std::fs::read_link(&mask).ok().as_deref() != Some(Path::new("/dev/null")) {
            bail!("dpkg -r did not mask {unit}");
        }
    }
    let purged = dpkg(&["--purge", "gpud"])?;
    println!("package test: dpkg -P:\n{}", purged.trim_end());
    let after = snapshot()?;
    if after != before {
        bail!(
            "dpkg -P left the file system changed: {}",
            diff(&before, &after)
        );
    }
    for f in &shipped {
        if f.exists() {
            bail!("{} is still there after the purge", f.display());
        }
    }
    println!(
        "package test: install, verify, run, reinstall, remove, purge: ok ({} files, nothing left)",
        shipped.len()
    );
    Ok(())
}

/// `dpkg ARGS` with its output (stdout and stderr) returned; fails on a non-zero exit.
pub(super) fn dpkg(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("dpkg")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .context("cannot run dpkg")?;
    let text = stdout_and_stderr(&out);
    if !out.status.success() {
        bail!(
            "dpkg {} failed ({}):\n{text}",
            args.join(" "),
            describe(out.status)
        );
    }
    Ok(text)
}

pub(super) fn dpkg_status(package: &str) -> Option<String> {
    Command::new("dpkg-query")
        .args(["--showformat=${Status}", "--show", package])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .filter(|s| !s.contains("not-installed"))
}

fn group_exists(name: &str) -> bool {
    Command::new("getent")
        .args(["group", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The regular files and symlinks of a .deb, as absolute paths.
fn package_files(deb: &Path) -> anyhow::Result<BTreeSet<PathBuf>> {
    let listing = output(
        "dpkg-deb --fsys-tarfile",
        Command::new("sh").arg("-c").arg(format!(
            "dpkg-deb --fsys-tarfile {} | tar --list --verbose",
            crate::util::sh_quote(&deb.display().to_string())
        )),
    )?;
    Ok(listing
        .lines()
        .filter(|l| !l.starts_with('d'))
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(|p| Path::new("/").join(p.trim_start_matches("./")))
        .collect())
}

/// Every path under the places a package and its scripts write (not /proc, /sys, /tmp, the
/// work tree), with what dpkg itself keeps about packages left out.
fn snapshot() -> anyhow::Result<BTreeSet<PathBuf>> {
    const ROOTS: [&str; 7] = [
        "/etc",
        "/usr",
        "/lib",
        "/var/lib",
        "/var/log",
        "/var/cache",
        "/opt",
    ];
    const SKIP: [&str; 5] = [
        // dpkg's own database and logs: they record the install and removal, as they should.
        "/var/lib/dpkg",
        "/var/log/dpkg.log",
        "/var/log/apt",
        "/var/cache/debconf",
        // Caches and test state other tools keep meanwhile.
        CACHE_DIR,
    ];
    let mut out = BTreeSet::new();
    let mut stack: Vec<PathBuf> = ROOTS.iter().map(PathBuf::from).collect();
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.filter_map(Result::ok) {
            let p = e.path();
            if SKIP.iter().any(|s| p.starts_with(s)) {
                continue;
            }
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                stack.push(p.clone());
            }
            out.insert(p);
        }
    }
    Ok(out)
}

fn diff(a: &BTreeSet<PathBuf>, b: &BTreeSet<PathBuf>) -> String {
    let gone: Vec<&PathBuf> = a.difference(b).collect();
    let new: Vec<&PathBuf> = b.difference(a).collect();
    format!("gone {gone:?}, new {new:?}")
}

/// `systemd-analyze verify` on the installed unit (its binary is where ExecStart says).
fn verify_unit() -> anyhow::Result<()> {
    let out = Command::new("systemd-analyze")
        .args(["verify", "/usr/lib/systemd/system/gpud.service"])
        .output()
        .context("cannot run systemd-analyze")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || stderr.contains("gpud.service") {
        bail!("systemd-analyze verify gpud.service: {stderr}");
    }
    println!("package test: systemd-analyze verify /usr/lib/systemd/system/gpud.service: ok");
    Ok(())
}

/// Starts the installed /usr/bin/gpud on the installed configuration on a private bus (with
/// the probes on a private bpffs that they leave when gpud stops: this host's /sys/fs/bpf is
/// not mounted), runs the installed `gpudctl status` through it, stops it.
fn run_installed_gpud() -> anyhow::Result<String> {
    let dir = out_dir().join("deb-run");
    let _ = Command::new("umount").arg(dir.join("bpffs")).output();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bpffs"))?;
    run_cmd(
        "mount bpffs",
        Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir.join("bpffs")),
    )?;
    let result = (|| {
        let mut config: toml::Table = toml::from_str(
            &std::fs::read_to_string("/etc/gpud/gpud.toml").context("the installed config")?,
        )?;
        let probes = config
            .get_mut("probes")
            .and_then(|p| p.as_table_mut())
            .context("[probes] in the installed config")?;
        probes.insert(
            "bpffs".into(),
            toml::Value::String(dir.join("bpffs").display().to_string()),
        );
        probes.insert("keep_pinned".into(), toml::Value::Boolean(false));
        let conf = dir.join("gpud.toml");
        std::fs::write(&conf, toml::to_string(&config)?)?;
        let socket = dir.join("bus");
        let bus_conf = dir.join("bus.conf");
        std::fs::write(
            &bus_conf,
            include_str!("../../../tests/fixtures/private-bus.conf")
                .replace("@SOCKET@", &socket.display().to_string()),
        )?;
        let mut bus = Command::new("dbus-daemon")
            .arg("--config-file")
            .arg(&bus_conf)
            .args(["--print-address", "--nofork"])
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start dbus-daemon")?;
        let _bus_guard = KillOnDrop(&mut bus);
        let address = format!("unix:path={}", socket.display());
        for _ in 0..100 {
            if socket.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::File::create(dir.join("gpud.log"))?;
        let mut gpud = Command::new("/usr/bin/gpud")
            .arg("--config")
            .arg(&conf)
            .arg("--bus-address")
            .arg(&address)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("cannot start /usr/bin/gpud")?;
        let status = {
            let _gpud_guard = TermOnDrop(&mut gpud);
            let mut last = String::new();
            let mut status = Err(());
            for _ in 0..120 {
                let out = Command::new("/usr/bin/gpudctl")
                    .args(["--bus-address", &address, "status"])
                    .output()?;
                if out.status.success() {
                    status = Ok(String::from_utf8_lossy(&out.stdout).into_owned());
                    break;
                }
                last = String::from_utf8_lossy(&out.stderr).into_owned();
                std::thread::sleep(Duration::from_millis(250));
            }
            status.map_err(|()| last)
        };
        let gpud_log = std::fs::read_to_string(dir.join("gpud.log")).unwrap_or_default();
        match status {
            Ok(s) if s.contains("attach") => Ok(s),
            Ok(s) => bail!("gpudctl status said:\n{s}\ngpud's log:\n{gpud_log}"),
            Err(last) => bail!(
                "the installed gpud never answered gpudctl status ({}); its log:\n{gpud_log}",
                last.trim()
            ),
        }
    })();
    let _ = Command::new("umount").arg(dir.join("bpffs")).output();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Kills a child (SIGKILL) and reaps it when dropped.
struct KillOnDrop<'a>(&'a mut std::process::Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Stops a child with SIGTERM (gpud's orderly stop) and reaps it when dropped; SIGKILL after 10 s.
struct TermOnDrop<'a>(&'a mut std::process::Child);

impl Drop for TermOnDrop<'_> {
    fn drop(&mut self) {
        // SAFETY: kill with a pid we spawned and have not reaped.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        for _ in 0..100 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Paths moved out of the way for the test and moved back when dropped.
pub(super) struct Aside {
    dir: PathBuf,
    moved: Vec<(PathBuf, PathBuf)>,
}

impl Aside {
    pub(super) fn new(paths: &[&str]) -> anyhow::Result<Self> {
        let dir = PathBuf::from(format!("/var/tmp/gpud-xtask-aside-{}", std::process::id()));
        let mut aside = Self {
            dir: dir.clone(),
            moved: Vec::new(),
        };
        for p in paths.iter().map(Path::new) {
            if p.symlink_metadata().is_err() {
                continue;
            }
            let to = dir.join(p.strip_prefix("/").unwrap_or(p));
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            std::fs::rename(p, &to)
                .with_context(|| format!("moving {} aside to {}", p.display(), to.display()))?;
            println!("package test: {} set aside for the test", p.display());
            aside.moved.push((p.to_owned(), to));
        }
        Ok(aside)
    }
}

impl Drop for Aside {
    fn drop(&mut self) {
        let mut all_back = true;
        for (p, to) in self.moved.drain(..).rev() {
            // What the test left there (a failed purge) makes way for what was there before.
            let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            if let Err(e) = std::fs::rename(&to, &p) {
                all_back = false;
                eprintln!(
                    "package test: could not put {} back from {}: {e}",
                    p.display(),
                    to.display()
                );
            }
        }
        if all_back {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
