//! `cargo xtask package deb` and `cargo xtask package image`: gpud as operators install it.
//!
//! - **deb**: the release binaries, the unit, the D-Bus policy, the default configuration (a
//!   conffile), the OCI hooks.d files, the sysusers snippet for `gpud-admin`, the NRI plugin's
//!   unit (disabled) and configuration example, the documentation and the Grafana dashboard, put
//!   together by `cargo-deb` from `[package.metadata.deb]` in gpud/Cargo.toml, with debhelper's
//!   systemd and sysusers maintainer-script snippets (`debian/` adds the purge of gpud's state
//!   and log). Written to `target/package/`.
//! - **image**: a minimal Debian root filesystem (`debootstrap --variant=minbase`, cached under
//!   [`CACHE_DIR`] between runs) plus the release binaries in `/usr/bin`, imported with
//!   `podman import` (labels: version, source revision) into a private Podman store and saved as
//!   an OCI archive `target/package/gpud-image-<version>.oci.tar`, named [`IMAGE_REPOSITORY`]`:<version>`
//!   as deploy/kubernetes's manifests run it. No registry is involved: load it with
//!   `podman load -i` or `ctr -n k8s.io images import`, or push it where the cluster pulls from
//!   (and set `images:` in a kustomize overlay).
//!
//! `cargo xtask test` runs both and checks them ([`test_deb`], [`test_image`]).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::util::{cargo, describe, output, root, run as run_cmd};

/// The image's name without its tag (the tag is the version); the manifests in
/// deploy/kubernetes run `IMAGE_REPOSITORY:<version>`.
pub const IMAGE_REPOSITORY: &str = "localhost/gpud";
/// The workspace version: the package's and the image tag.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The Debian release the image's root filesystem is, and the packages it adds to `minbase`:
/// libelf1 for gpud (libbpf), ca-certificates for the DRA driver's API-server connections.
const SUITE: &str = "bookworm";
const IMAGE_PACKAGES: &str = "libelf1,ca-certificates";
/// Where the debootstrapped root filesystem is kept between runs on one machine (a fresh clone's
/// `target/` would lose it).
const CACHE_DIR: &str = "/var/cache/gpud-xtask";
/// The binaries of the package and the image.
const BINARIES: [&str; 5] = ["gpud", "gpudctl", "gpud-oci-hook", "gpud-nri", "gpud-k8s"];

fn out_dir() -> PathBuf {
    root().join("target/package")
}

/// The .deb `deb` writes.
pub fn deb_path() -> PathBuf {
    let arch = output(
        "dpkg --print-architecture",
        Command::new("dpkg").arg("--print-architecture"),
    )
    .map(|s| s.trim().to_owned())
    .unwrap_or_else(|_| "amd64".to_owned());
    out_dir().join(format!("gpud_{VERSION}-1_{arch}.deb"))
}

/// The OCI archive `image` writes.
pub fn image_path() -> PathBuf {
    out_dir().join(format!("gpud-image-{VERSION}.oci.tar"))
}

/// `IMAGE_REPOSITORY:VERSION`.
pub fn image_name() -> String {
    format!("{IMAGE_REPOSITORY}:{VERSION}")
}

/// Builds the .deb (release binaries first); returns its path.
pub fn deb() -> anyhow::Result<PathBuf> {
    crate::install::build_release()?;
    std::fs::create_dir_all(out_dir())?;
    let path = deb_path();
    run_cmd(
        "cargo deb -p gpud",
        cargo()
            .args(["deb", "-p", "gpud", "--no-build", "--output"])
            .arg(&path),
    )?;
    println!(
        "package: {} ({})",
        path.display(),
        human(std::fs::metadata(&path)?.len())
    );
    Ok(path)
}

/// Builds the image archive (release binaries first); returns its path.
pub fn image() -> anyhow::Result<PathBuf> {
    let bin = crate::install::build_release()?;
    std::fs::create_dir_all(out_dir())?;
    let base = rootfs()?;
    // The root filesystem with the binaries appended in usr/bin.
    let tar = out_dir().join("image-rootfs.tar");
    std::fs::copy(&base, &tar).with_context(|| format!("copying {}", base.display()))?;
    let stage = out_dir().join("image-stage");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(stage.join("usr/bin"))?;
    for b in BINARIES {
        std::fs::copy(bin.join(b), stage.join("usr/bin").join(b))
            .with_context(|| format!("copying {b}"))?;
    }
    run_cmd(
        "tar --append (binaries into the root filesystem)",
        Command::new("tar")
            .arg("--append")
            .arg("--file")
            .arg(&tar)
            .args(["--owner=0", "--group=0", "--mode=0755", "--directory"])
            .arg(&stage)
            .args(BINARIES.map(|b| format!("./usr/bin/{b}"))),
    )?;
    let revision = output(
        "git rev-parse HEAD",
        Command::new("git").args(["rev-parse", "HEAD"]),
    )
    .map(|s| s.trim().to_owned())
    .unwrap_or_else(|_| "unknown".to_owned());
    let podman = Podman::new(&out_dir().join("podman-build"))?;
    let name = image_name();
    let changes = [
        "LABEL org.opencontainers.image.title=gpud".to_owned(),
        format!("LABEL org.opencontainers.image.version={VERSION}"),
        format!("LABEL org.opencontainers.image.revision={revision}"),
        "LABEL org.opencontainers.image.description=gpud, gpudctl, gpud-k8s, gpud-nri and gpud-oci-hook on Debian minbase".to_owned(),
        "LABEL org.opencontainers.image.licenses=Apache-2.0".to_owned(),
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        "CMD [\"gpud-k8s\", \"--help\"]".to_owned(),
    ];
    let mut import = podman.command();
    import.arg("import");
    for c in &changes {
        import.arg("--change").arg(c);
    }
    import.arg(&tar).arg(&name);
    output("podman import", &mut import)?;
    let path = image_path();
    let _ = std::fs::remove_file(&path);
    output(
        "podman save",
        podman
            .command()
            .args(["save", "--format", "oci-archive", "--output"])
            .arg(&path)
            .arg(&name),
    )?;
    drop(podman);
    std::fs::remove_file(&tar)?;
    std::fs::remove_dir_all(&stage)?;
    println!(
        "package: {} ({name}, revision {revision}, {})",
        path.display(),
        human(std::fs::metadata(&path)?.len())
    );
    Ok(path)
}

/// The minbase root filesystem as a tar, debootstrapped once and kept in [`CACHE_DIR`].
fn rootfs() -> anyhow::Result<PathBuf> {
    let key = format!("{SUITE}-minbase-{}", IMAGE_PACKAGES.replace(',', "+"));
    let cached = Path::new(CACHE_DIR).join(format!("rootfs-{key}.tar"));
    if cached.is_file() {
        println!("package: root filesystem from {}", cached.display());
        return Ok(cached);
    }
    std::fs::create_dir_all(CACHE_DIR).with_context(|| format!("creating {CACHE_DIR}"))?;
    let dir = Path::new(CACHE_DIR).join(format!("rootfs-{key}.tmp"));
    let _ = std::fs::remove_dir_all(&dir);
    let log = Path::new(CACHE_DIR).join("debootstrap.log");
    println!(
        "package: debootstrap {SUITE} (minbase + {IMAGE_PACKAGES}) into {}; log in {}",
        dir.display(),
        log.display()
    );
    crate::util::run_logged(
        "debootstrap",
        Command::new("debootstrap")
            .args(["--variant=minbase", &format!("--include={IMAGE_PACKAGES}")])
            .arg(SUITE)
            .arg(&dir)
            .arg(crate::setup::DEBIAN_MIRROR),
        &log,
        "can the Debian archive be reached (the same as `apt-get update`)?",
    )?;
    // What a container never needs: package caches and lists, documentation, manuals, locales.
    for d in [
        "var/cache/apt",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
        "var/log",
    ] {
        let p = dir.join(d);
        if p.is_dir() {
            for e in std::fs::read_dir(&p)?.filter_map(Result::ok) {
                let path = e.path();
                if path.is_dir() {
                    std::fs::remove_dir_all(&path)?;
                } else {
                    std::fs::remove_file(&path)?;
                }
            }
        }
    }
    let tmp_tar = cached.with_extension("tar.tmp");
    run_cmd(
        "tar (the root filesystem)",
        Command::new("tar")
            .args(["--create", "--numeric-owner", "--xattrs", "--file"])
            .arg(&tmp_tar)
            .arg("--directory")
            .arg(&dir)
            .arg("."),
    )?;
    std::fs::rename(&tmp_tar, &cached)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(cached)
}

/// Podman with all of its state in one directory (nothing in the host's image store), removed
/// on drop.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    fn new(dir: &Path) -> anyhow::Result<Self> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    fn command(&self) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .arg("--network-config-dir")
            .arg(self.dir.join("networks"))
            .args(["--storage-driver", "vfs", "--events-backend", "none"])
            .args(["--cgroup-manager", "cgroupfs"]);
        c
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.command().args(["rm", "--all", "--force"]).output();
        let _ = self.command().args(["rmi", "--all", "--force"]).output();
        // vfs layers are plain directories.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn human(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

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
fn dpkg(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("dpkg")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .context("cannot run dpkg")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!(
            "dpkg {} failed ({}):\n{text}",
            args.join(" "),
            describe(out.status)
        );
    }
    Ok(text)
}

fn dpkg_status(package: &str) -> Option<String> {
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
            include_str!("../../tests/fixtures/private-bus.conf")
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

/// `cargo xtask test`'s image stage: build it, `podman load` it into a private store, run
/// `gpud-k8s --version`, `gpud-nri --help` and `gpud --version` in it, check its labels, and
/// that every container image in deploy/kubernetes is the name it loads as.
pub fn test_image() -> anyhow::Result<()> {
    let archive = image()?;
    let podman = Podman::new(&out_dir().join("podman-test"))?;
    let loaded = output(
        "podman load",
        podman.command().arg("load").arg("--input").arg(&archive),
    )?;
    let name = image_name();
    if !loaded.contains(&name) {
        bail!("podman load did not load {name}: {loaded}");
    }
    println!("package test: podman load: {}", loaded.trim());
    let labels = output(
        "podman image inspect",
        podman
            .command()
            .args(["image", "inspect", "--format", "{{json .Labels}} {{.Size}}"])
            .arg(&name),
    )?;
    let (labels_json, size) = labels.trim().rsplit_once(' ').unwrap_or((&labels, "0"));
    let labels: serde_json::Value = serde_json::from_str(labels_json)?;
    if labels["org.opencontainers.image.version"] != VERSION {
        bail!("image version label: {labels}");
    }
    let revision = labels["org.opencontainers.image.revision"]
        .as_str()
        .unwrap_or("");
    if revision.len() != 40 {
        bail!("image revision label: {labels}");
    }
    let run = |args: &[&str]| -> anyhow::Result<String> {
        output(
            &format!("podman run {}", args.join(" ")),
            podman
                .command()
                .args(["run", "--rm", "--network", "none"])
                .args(["--runtime", "runc", "--cgroup-parent", TEST_CGROUP_PARENT])
                .args([
                    "--ulimit",
                    "nofile=1024:1024",
                    "--ulimit",
                    "nproc=1024:1024",
                ])
                .arg(&name)
                .args(args),
        )
    };
    let ran = (|| {
        let version = run(&["gpud-k8s", "--version"])?;
        if version.trim() != format!("gpud-k8s {VERSION}") {
            bail!("gpud-k8s --version in the image: {version:?}");
        }
        let help = run(&["gpud-nri", "--help"])?;
        if !help.contains("NRI plugin") {
            bail!("gpud-nri --help in the image: {help}");
        }
        let gpud = run(&["gpud", "--version"])?;
        if gpud.trim() != format!("gpud {VERSION}") {
            bail!("gpud --version in the image: {gpud:?}");
        }
        Ok(())
    })();
    remove_cgroups(TEST_CGROUP_PARENT);
    ran?;
    let images = manifest_images()?;
    if images.is_empty() || images.iter().any(|(_, i)| *i != name) {
        bail!("the manifests run other images than {name}: {images:?}");
    }
    println!(
        "package test: image {name}: gpud-k8s --version, gpud-nri --help, gpud --version ok; \
         labels version {VERSION}, revision {revision}; {} containers in deploy/kubernetes run it; \
         archive {}, image {}",
        images.len(),
        human(std::fs::metadata(&archive)?.len()),
        human(size.parse().unwrap_or(0))
    );
    Ok(())
}

/// The cgroup the image test's containers run under (runc and Podman's cgroupfs manager leave
/// its directories behind; [`remove_cgroups`] removes them).
const TEST_CGROUP_PARENT: &str = "/gpud-xtask-image";

/// Removes the cgroup directories under `parent` in every hierarchy mounted under /sys/fs/cgroup
/// (v1 controllers and the v2 tree of a hybrid host, or a pure v2 host's), waiting up to 10 s for
/// the last processes in them (conmon) to exit.
fn remove_cgroups(parent: &str) {
    for _ in 0..100 {
        if !try_remove_cgroups(parent) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("package test: cgroup directories under {parent} are still in use; left them");
}

/// One round of [`remove_cgroups`]; whether any directory is left.
fn try_remove_cgroups(parent: &str) -> bool {
    let mut left = false;
    let rel = parent.trim_start_matches('/');
    let mut tops = vec![Path::new("/sys/fs/cgroup").join(rel)];
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        tops.extend(entries.filter_map(Result::ok).map(|e| e.path().join(rel)));
    }
    for top in tops.into_iter().filter(|t| t.is_dir()) {
        // Deepest first: a cgroup directory can only be removed once it has no children.
        let mut dirs = vec![top.clone()];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
                dirs.extend(
                    entries
                        .filter_map(Result::ok)
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
            i += 1;
        }
        for d in dirs.iter().rev() {
            left |= std::fs::remove_dir(d).is_err();
        }
    }
    left
}

/// (file, image) of every container of every workload in deploy/kubernetes (examples apart:
/// they run the user's image).
fn manifest_images() -> anyhow::Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    let mut stack = vec![root().join("deploy/kubernetes")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)?.filter_map(Result::ok) {
            let p = e.path();
            if p.is_dir() {
                if !p.ends_with("examples") {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&p)?;
            let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
                .with_context(|| format!("{}: not YAML", p.display()))?;
            for doc in docs {
                let spec = &doc["spec"]["template"]["spec"];
                for key in ["initContainers", "containers"] {
                    for c in spec[key].as_array().into_iter().flatten() {
                        out.push((p.clone(), c["image"].as_str().unwrap_or("").to_owned()));
                    }
                }
            }
        }
    }
    Ok(out)
}
