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
    fs::Permissions,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

use crate::util::{cargo, output, root, run as run_cmd};

mod check_deb;
mod check_image;
mod upgrade;

pub use check_deb::test_deb;
pub use check_image::test_image;
pub use upgrade::{previous_deb, test_upgrade};

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
/// The package's host files as the image carries them for `gpud-k8s node install`
/// (gpud_k8s::node::IMAGE_SHARE): repository path, path in the image.
const NODE_FILES: [(&str, &str); 3] = [
    (
        "systemd/dev.gpud.Daemon1.conf",
        "usr/share/gpud/node/dev.gpud.Daemon1.conf",
    ),
    (
        "config/oci-hooks.d/50-gpud-create.json",
        "usr/share/gpud/node/hooks.d/50-gpud-create.json",
    ),
    (
        "config/oci-hooks.d/50-gpud-poststop.json",
        "usr/share/gpud/node/hooks.d/50-gpud-poststop.json",
    ),
];
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
    let mut added = Vec::new();
    for b in BINARIES {
        let to = format!("usr/bin/{b}");
        std::fs::copy(bin.join(b), stage.join(&to)).with_context(|| format!("copying {b}"))?;
        std::fs::set_permissions(stage.join(&to), Permissions::from_mode(0o755))?;
        added.push(to);
    }
    // What the gpud DaemonSet's `gpud-k8s node install` puts on the host: the package's files.
    for (from, to) in NODE_FILES {
        let to = stage.join(to);
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::copy(root().join(from), &to).with_context(|| format!("copying {from}"))?;
        std::fs::set_permissions(&to, Permissions::from_mode(0o644))?;
    }
    added.extend(NODE_FILES.map(|(_, to)| to.to_owned()));
    run_cmd(
        "tar --append (binaries and host files into the root filesystem)",
        Command::new("tar")
            .arg("--append")
            .arg("--file")
            .arg(&tar)
            .args(["--owner=0", "--group=0", "--directory"])
            .arg(&stage)
            .args(added.iter().map(|p| format!("./{p}"))),
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

/// Podman with all of its state in one directory (nothing in the host's image store) and its
/// run root, removed on drop.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    fn new(dir: &Path) -> anyhow::Result<Self> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        let podman = Self {
            dir: dir.to_owned(),
        };
        let _ = std::fs::remove_dir_all(podman.runroot());
        Ok(podman)
    }

    /// Its run root: podman refuses one longer than 50 characters, which a checkout's
    /// `target/package/…` is at a deep enough path, so it lives under `/run` by the state
    /// directory's name.
    fn runroot(&self) -> PathBuf {
        Path::new("/run/gpud-xtask").join(self.dir.file_name().unwrap_or_default())
    }

    fn command(&self) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.runroot())
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
        let _ = std::fs::remove_dir_all(self.runroot());
    }
}

fn human(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}
