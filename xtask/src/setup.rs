//! `cargo xtask setup`: idempotent bootstrap of a fresh machine of the project's kind (Debian 12,
//! rustup, root): Debian packages, containerd 1.7 from Debian trixie and Debian sid's newest
//! kernel unpacked under `/opt/gpud-test` for the NRI test and the kernel matrix, etcd and kubectl
//! from Debian sid for `cargo xtask cluster`, nightly `rust-src`, `bpf-linker` 0.13 against LLVM 22,
//! stable rustfmt and clippy.
//!
//! Each step checks first and acts only when something is missing, so a machine that has
//! everything is done in well under a second. A failing step is reported as one line naming the
//! step, the command's exit status and, for long installs, the log to read.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use crate::util::{cargo, output, run_logged, which};

/// How to tell whether a package is present.
enum Probe {
    /// `dpkg-query` reports the package installed.
    Dpkg,
    /// This command is on PATH (for packages installed only for one of their tools).
    Command(&'static str),
}

/// Debian packages the build and the tests need: name, how to check for it, and why.
const PACKAGES: &[(&str, Probe, &str)] = &[
    (
        "llvm-22-dev",
        Probe::Dpkg,
        "bpf-linker links LLVM 22, the nightly's LLVM",
    ),
    (
        "libpolly-22-dev",
        Probe::Dpkg,
        "LLVM 22's link dependencies (bpf-linker)",
    ),
    (
        "libzstd-dev",
        Probe::Dpkg,
        "LLVM 22's link dependencies (bpf-linker)",
    ),
    ("libelf-dev", Probe::Dpkg, "libbpf-sys"),
    ("zlib1g-dev", Probe::Dpkg, "libbpf-sys"),
    (
        "pkg-config",
        Probe::Dpkg,
        "libbpf-sys finds libelf and zlib",
    ),
    (
        "dbus",
        Probe::Dpkg,
        "dbus-daemon for the D-Bus tests and `xtask run`",
    ),
    (
        "systemd",
        Probe::Command("busctl"),
        "busctl for the D-Bus tests; systemd-analyze verifies the unit",
    ),
    (
        "libcap2-bin",
        Probe::Command("capsh"),
        "capsh decodes capability sets in the unit's capability test",
    ),
    (
        "qemu-system-x86",
        Probe::Dpkg,
        "VM tests: fentry and BPF-LSM",
    ),
    (
        "linux-image-amd64",
        Probe::Dpkg,
        "the Debian kernel the VM tests boot",
    ),
    (
        "busybox-static",
        Probe::Dpkg,
        "the VM's init and tools; the rootfs of the runc containers",
    ),
    (
        "runc",
        Probe::Dpkg,
        "the OCI hook's end-to-end tests run real containers",
    ),
    (
        "podman",
        Probe::Dpkg,
        "the OCI hook's tests under the real Podman (hooks.d)",
    ),
    (
        "containernetworking-plugins",
        Probe::Dpkg,
        "bridge and host-local CNI plugins for `cargo xtask cluster` pods",
    ),
    (
        "iptables",
        Probe::Dpkg,
        "kube-proxy and the CNI's masquerading (`cargo xtask cluster`)",
    ),
    (
        "conntrack",
        Probe::Dpkg,
        "kube-proxy clears stale UDP flows with it (`cargo xtask cluster`)",
    ),
    (
        "openssl",
        Probe::Dpkg,
        "the certificates of `cargo xtask cluster`",
    ),
    (
        "xz-utils",
        Probe::Command("xz"),
        "unpacking the Kubernetes binaries (`cargo xtask cluster`)",
    ),
    ("cpio", Probe::Dpkg, "packing the VM's initramfs"),
    (
        "dpkg-dev",
        Probe::Command("dpkg-shlibdeps"),
        "cargo-deb computes the package's library dependencies with dpkg-shlibdeps",
    ),
    (
        "debootstrap",
        Probe::Dpkg,
        "the image's Debian root filesystem (`cargo xtask package image`)",
    ),
    (
        "init-system-helpers",
        Probe::Command("deb-systemd-helper"),
        "the package's maintainer scripts enable and stop the unit with it",
    ),
];

/// The bpf-linker release the eBPF build uses; its LLVM major must be the nightly's (22).
const BPF_LINKER: &str = "bpf-linker@0.13.0";
const BPF_LINKER_VERSION_PREFIX: &str = "bpf-linker 0.13.";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// Rust components: toolchain, component, why.
const COMPONENTS: &[(&str, &str, &str)] = &[
    (
        "nightly",
        "rust-src",
        "building core for bpfel-unknown-none",
    ),
    ("nightly", "clippy", "linting the eBPF crate"),
    ("stable", "rustfmt", "cargo fmt --check"),
    ("stable", "clippy", "cargo clippy"),
];

/// Where a step's long-running install writes its output.
fn log_path(step: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpud-setup-{step}.log"))
}

/// Packages whose status line from `dpkg-query` says "install ok installed", in one call.
fn dpkg_installed(names: &[&str]) -> Vec<String> {
    // dpkg-query exits 1 when some package is unknown but still prints the known ones.
    Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${Status}\\n"])
        .args(names)
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.ends_with(" install ok installed"))
                .filter_map(|l| l.split_whitespace().next())
                // Multi-arch packages print as `name:arch`.
                .map(|p| p.split(':').next().unwrap_or(p).to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Installs the missing Debian packages (one `apt-get update`, one `apt-get install`).
fn packages(installed: &mut Vec<String>) -> anyhow::Result<()> {
    let dpkg_names: Vec<&str> = PACKAGES
        .iter()
        .filter(|(_, probe, _)| matches!(probe, Probe::Dpkg))
        .map(|(name, _, _)| *name)
        .collect();
    let present = dpkg_installed(&dpkg_names);
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(name, probe, _)| match probe {
            Probe::Dpkg => !present.iter().any(|p| p == name),
            Probe::Command(cmd) => which(cmd).is_none(),
        })
        .map(|(name, _, _)| *name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "setup: packages: {} missing and apt-get needs root; run as root",
            missing.join(" ")
        );
    }
    let log = log_path("apt");
    for (name, _, why) in PACKAGES.iter().filter(|(n, _, _)| missing.contains(n)) {
        println!("setup: installing {name} ({why})");
    }
    println!("setup: apt-get output goes to {}", log.display());
    run_logged(
        "setup: packages: `apt-get update`",
        Command::new("apt-get").args(["update", "-q"]),
        &log,
        "no package lists, so nothing can be installed",
    )?;
    let apt_log = log_path("apt-install");
    run_logged(
        &format!("setup: packages: `apt-get install {}`", missing.join(" ")),
        Command::new("apt-get")
            .args(["install", "-y", "-q"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &apt_log,
        "are Debian 12 and its security updates (LLVM 22) in the sources?",
    )?;
    installed.extend(missing.iter().map(|p| (*p).to_owned()));
    Ok(())
}

/// Adds the missing rustup components; needs the `nightly` toolchain to be installed already.
fn rustup_components(installed: &mut Vec<String>) -> anyhow::Result<()> {
    let toolchains = output(
        "setup: rust: `rustup toolchain list`",
        Command::new("rustup").args(["toolchain", "list"]),
    )?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        bail!(
            "setup: rust: no `nightly` toolchain: the eBPF crate needs nightly (-Z build-std); \
             install one with `rustup toolchain install nightly`"
        );
    }
    for toolchain in ["nightly", "stable"] {
        let listed = output(
            &format!("setup: rust: `rustup component list --toolchain {toolchain}`"),
            Command::new("rustup").args([
                "component",
                "list",
                "--installed",
                "--toolchain",
                toolchain,
            ]),
        )?;
        // Lines are `rust-src` or `clippy-x86_64-unknown-linux-gnu`.
        let has = |component: &str| {
            listed
                .lines()
                .any(|l| l == component || l.starts_with(&format!("{component}-")))
        };
        for (_, component, why) in COMPONENTS.iter().filter(|(t, _, _)| *t == toolchain) {
            if has(component) {
                continue;
            }
            println!("setup: adding {component} to {toolchain} ({why})");
            output(
                &format!("setup: rust: `rustup component add {component} --toolchain {toolchain}`"),
                Command::new("rustup").args([
                    "component",
                    "add",
                    component,
                    "--toolchain",
                    toolchain,
                ]),
            )?;
            installed.push(format!("{component} ({toolchain})"));
        }
    }
    Ok(())
}

/// What `bpf-linker --version` prints, if it runs.
fn bpf_linker_version() -> Option<String> {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Builds bpf-linker 0.13 against Debian's LLVM 22 unless it is already installed.
fn bpf_linker(installed: &mut Vec<String>) -> anyhow::Result<()> {
    let found = bpf_linker_version();
    if found
        .as_deref()
        .is_some_and(|v| v.starts_with(BPF_LINKER_VERSION_PREFIX))
    {
        return Ok(());
    }
    let log = log_path("bpf-linker");
    println!(
        "setup: building {BPF_LINKER} against LLVM 22 (found: {}; takes a few minutes, log in {})",
        found.as_deref().unwrap_or("none"),
        log.display()
    );
    run_logged(
        &format!("setup: bpf-linker: `cargo install {BPF_LINKER}`"),
        cargo()
            .args(["install", BPF_LINKER, "--locked", "--no-default-features"])
            .args(["--features", "llvm-22"])
            .env("LLVM_PREFIX", LLVM_PREFIX),
        &log,
        "are LLVM 22's dev libraries installed (llvm-22-dev, libpolly-22-dev, libzstd-dev)?",
    )?;
    match bpf_linker_version() {
        Some(v) if v.starts_with(BPF_LINKER_VERSION_PREFIX) => {}
        other => bail!(
            "setup: bpf-linker: installed, but `bpf-linker --version` gives {:?}: is ~/.cargo/bin \
             on PATH, before any other bpf-linker?",
            other.unwrap_or_default()
        ),
    }
    installed.push(BPF_LINKER.to_owned());
    Ok(())
}

/// The Debian archive: containerd's trixie packages, the image's root filesystem
/// (`package image`).
pub const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

/// Where containerd 1.7 is unpacked for the NRI test (tests/src/containerd.rs reads it there).
pub const CONTAINERD_PREFIX: &str = "/opt/gpud-test/containerd";
/// The Debian suite with containerd 1.7 (Debian 12 has 1.6, whose NRI the plugin does not
/// speak).
const CONTAINERD_SUITE: &str = "trixie";

/// Where Debian sid's newest kernel is unpacked for the kernel matrix (`usr/lib/modules/<release>/`
/// holds `vmlinuz`, `config` and the modules; xtask/src/vm.rs boots it from there).
pub const SID_KERNEL_PREFIX: &str = "/opt/gpud-test/kernels/sid";

/// Where etcd and kubectl from Debian sid are unpacked for `cargo xtask cluster` (binaries in
/// `usr/bin`).
pub const KUBE_TOOLS_PREFIX: &str = "/opt/gpud-test/kube-tools";

/// apt on a private sources list, lists and cache under `/opt/gpud-test/apt/<suite>`, for one
/// Debian suite: packages are downloaded and unpacked with `dpkg -x`, never installed, and the
/// host's apt sources, lists and dpkg database stay untouched.
struct PrivateApt {
    suite: &'static str,
    dir: PathBuf,
    /// The step's name in messages.
    step: &'static str,
}

impl PrivateApt {
    fn new(step: &'static str, suite: &'static str) -> anyhow::Result<Self> {
        let dir = PathBuf::from("/opt/gpud-test/apt").join(suite);
        for d in [
            dir.join("sources.list.d"),
            dir.join("lists/partial"),
            dir.join("cache/archives/partial"),
            dir.join("debs"),
        ] {
            std::fs::create_dir_all(&d)
                .with_context(|| format!("setup: {step}: creating {}", d.display()))?;
        }
        let sources = dir.join(format!("sources.list.d/{suite}.sources"));
        std::fs::write(
            &sources,
            format!(
                "Types: deb\nURIs: {DEBIAN_MIRROR}\nSuites: {suite}\n\
                 Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            ),
        )
        .with_context(|| format!("setup: {step}: writing {}", sources.display()))?;
        Ok(Self { suite, dir, step })
    }

    fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        c.arg("-o")
            .arg("Dir::Etc::SourceList=/dev/null")
            .arg("-o")
            .arg(format!(
                "Dir::Etc::SourceParts={}",
                self.dir.join("sources.list.d").display()
            ))
            .arg("-o")
            .arg(format!(
                "Dir::State::Lists={}",
                self.dir.join("lists").display()
            ))
            .arg("-o")
            .arg(format!("Dir::Cache={}", self.dir.join("cache").display()))
            // The download lands in a root-only directory.
            .arg("-o")
            .arg("APT::Sandbox::User=root");
        c
    }

    fn update(&self) -> anyhow::Result<()> {
        let (step, suite) = (self.step, self.suite);
        run_logged(
            &format!("setup: {step}: `apt-get update` ({suite}, private lists)"),
            self.command("apt-get").args(["update", "-q"]),
            &log_path(step),
            &format!(
                "can deb.debian.org be reached, and does debian-archive-keyring know {suite}'s key?"
            ),
        )
    }

    /// What `apt-cache depends` lists as `package`'s plain dependencies.
    fn depends(&self, package: &str) -> anyhow::Result<Vec<String>> {
        let out = output(
            &format!("setup: {}: `apt-cache depends {package}`", self.step),
            self.command("apt-cache").args(["depends", package]),
        )?;
        Ok(out
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .filter(|d| !d.starts_with('<'))
            .map(str::to_owned)
            .collect())
    }

    /// Downloads `packages` and unpacks each into `prefix` (emptied first).
    fn unpack(&self, packages: &[&str], prefix: &str) -> anyhow::Result<()> {
        let step = self.step;
        let debs = self.dir.join("debs");
        // A .deb of an earlier run would be picked as well as today's.
        for old in std::fs::read_dir(&debs)?.filter_map(Result::ok) {
            std::fs::remove_file(old.path())
                .with_context(|| format!("setup: {step}: removing {}", old.path().display()))?;
        }
        // `apt-get download` writes into its working directory.
        let out = self
            .command("apt-get")
            .args(["download", "-q"])
            .args(packages)
            .current_dir(&debs)
            .output()
            .with_context(|| format!("setup: {step}: cannot start apt-get"))?;
        if !out.status.success() {
            bail!(
                "setup: {step}: `apt-get download {}` failed: {}",
                packages.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let _ = std::fs::remove_dir_all(prefix);
        std::fs::create_dir_all(prefix)
            .with_context(|| format!("setup: {step}: creating {prefix}"))?;
        for deb in std::fs::read_dir(&debs)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        {
            output(
                &format!("setup: {step}: `dpkg -x {}`", deb.display()),
                Command::new("dpkg").arg("-x").arg(&deb).arg(prefix),
            )?;
        }
        Ok(())
    }
}

/// Fails unless this runs as root, naming the step and what it needs root for.
fn need_root(step: &str, why: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("setup: {step}: {why} needs root; run as root");
    }
    Ok(())
}

/// `containerd --version` of the unpacked containerd, if it runs.
fn containerd_version() -> Option<String> {
    Command::new(PathBuf::from(CONTAINERD_PREFIX).join("usr/bin/containerd"))
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Unpacks Debian trixie's containerd 1.7 (`containerd`, `ctr`, the runc shim) into
/// [`CONTAINERD_PREFIX`]: not installed, no service. Its only dependencies, libc6 >= 2.34 and
/// runc, are Debian 12's.
pub fn containerd(installed: &mut Vec<String>) -> anyhow::Result<()> {
    if containerd_version().is_some_and(|v| v.contains(" 1.7.")) {
        return Ok(());
    }
    need_root("containerd", &format!("unpacking into {CONTAINERD_PREFIX}"))?;
    println!(
        "setup: unpacking containerd 1.7 from Debian {CONTAINERD_SUITE} into {CONTAINERD_PREFIX} \
         (the NRI plugin's test against a real containerd)"
    );
    let apt = PrivateApt::new("containerd", CONTAINERD_SUITE)?;
    apt.update()?;
    apt.unpack(&["containerd"], CONTAINERD_PREFIX)?;
    match containerd_version() {
        Some(v) if v.contains(" 1.7.") => {}
        other => bail!(
            "setup: containerd: unpacked, but `containerd --version` gives {:?}",
            other.unwrap_or_default()
        ),
    }
    installed.push(format!("containerd 1.7 ({CONTAINERD_PREFIX})"));
    Ok(())
}

/// `etcd` and `kubectl` under [`KUBE_TOOLS_PREFIX`], if both run.
pub fn kube_tools_present() -> bool {
    let bin = PathBuf::from(KUBE_TOOLS_PREFIX).join("usr/bin");
    let runs = |tool: &str, args: &[&str]| {
        Command::new(bin.join(tool))
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    runs("etcd", &["--version"]) && runs("kubectl", &["version", "--client"])
}

/// Unpacks Debian sid's etcd 3.5 (`etcd-server`) and kubectl 1.36 (`kubectl`, which
/// `kubernetes-client` depends on) into [`KUBE_TOOLS_PREFIX`] for `cargo xtask cluster`: Debian 12's are
/// too old for a 1.36 control plane, and nothing from sid is installed system-wide.
pub fn kube_tools(installed: &mut Vec<String>) -> anyhow::Result<()> {
    if kube_tools_present() {
        return Ok(());
    }
    need_root("kube-tools", &format!("unpacking into {KUBE_TOOLS_PREFIX}"))?;
    println!(
        "setup: unpacking etcd and kubectl from Debian sid into {KUBE_TOOLS_PREFIX} \
         (`cargo xtask cluster`)"
    );
    let apt = PrivateApt::new("kube-tools", "sid")?;
    apt.update()?;
    // `/sid`: a host may have another `kubectl` installed (e.g. Google Cloud's), which apt
    // would otherwise take as the candidate.
    apt.unpack(&["etcd-server/sid", "kubectl/sid"], KUBE_TOOLS_PREFIX)?;
    if !kube_tools_present() {
        bail!(
            "setup: kube-tools: unpacked, but {KUBE_TOOLS_PREFIX}/usr/bin/etcd or kubectl does \
             not run"
        );
    }
    installed.push(format!(
        "etcd and kubectl from Debian sid ({KUBE_TOOLS_PREFIX})"
    ));
    Ok(())
}

/// The release of the sid kernel unpacked under [`SID_KERNEL_PREFIX`], if its image is there.
pub fn sid_kernel_release() -> Option<String> {
    std::fs::read_dir(PathBuf::from(SID_KERNEL_PREFIX).join("usr/lib/modules"))
        .ok()?
        .filter_map(Result::ok)
        .find(|e| e.path().join("vmlinuz").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
}

/// Unpacks the newest kernel Debian ships (sid's `linux-image-amd64`: its `linux-binary-*` and
/// `linux-modules-*`) into [`SID_KERNEL_PREFIX`], for the kernel matrix's newest rows: a change
/// in the kernel's hooks or BTF shows there before it shows on a host. Kept once unpacked; remove
/// the directory to fetch a newer one.
fn sid_kernel(installed: &mut Vec<String>) -> anyhow::Result<()> {
    if sid_kernel_release().is_some() {
        return Ok(());
    }
    need_root("sid-kernel", &format!("unpacking into {SID_KERNEL_PREFIX}"))?;
    println!("setup: unpacking Debian sid's kernel into {SID_KERNEL_PREFIX} (the kernel matrix)");
    let apt = PrivateApt::new("sid-kernel", "sid")?;
    apt.update()?;
    // linux-image-amd64 → linux-image-<release> → linux-binary-<release> (the image),
    // linux-base-<release>; the modules are linux-modules-<release>.
    let image = apt
        .depends("linux-image-amd64")?
        .into_iter()
        .find(|d| d.starts_with("linux-image-"))
        .context("setup: sid-kernel: linux-image-amd64 names no linux-image-<release>")?;
    let release = image.trim_start_matches("linux-image-").to_owned();
    let (binary, modules) = (
        format!("linux-binary-{release}"),
        format!("linux-modules-{release}"),
    );
    apt.unpack(&[&binary, &modules], SID_KERNEL_PREFIX)?;
    if sid_kernel_release().as_deref() != Some(release.as_str()) {
        bail!(
            "setup: sid-kernel: unpacked {binary} and {modules}, but {SID_KERNEL_PREFIX}/usr/lib/\
             modules/{release}/vmlinuz is not there"
        );
    }
    installed.push(format!(
        "kernel {release} from Debian sid ({SID_KERNEL_PREFIX})"
    ));
    Ok(())
}

/// The cargo-deb release `package deb` uses (its maintainer-script snippets are debhelper's).
const CARGO_DEB: &str = "cargo-deb@3.8.0";
const CARGO_DEB_VERSION_PREFIX: &str = "3.8.";

/// What `cargo deb --version` prints, if it runs.
fn cargo_deb_version() -> Option<String> {
    cargo()
        .args(["deb", "--version"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Installs cargo-deb unless that release is there.
fn cargo_deb(installed: &mut Vec<String>) -> anyhow::Result<()> {
    let found = cargo_deb_version();
    if found
        .as_deref()
        .and_then(|v| v.split_whitespace().last())
        .is_some_and(|v| v.starts_with(CARGO_DEB_VERSION_PREFIX))
    {
        return Ok(());
    }
    let log = log_path("cargo-deb");
    println!(
        "setup: building {CARGO_DEB} (found: {}; log in {})",
        found.as_deref().unwrap_or("none"),
        log.display()
    );
    run_logged(
        &format!("setup: cargo-deb: `cargo install {CARGO_DEB}`"),
        cargo().args(["install", CARGO_DEB, "--locked"]),
        &log,
        "can crates.io be reached?",
    )?;
    if cargo_deb_version().is_none() {
        bail!(
            "setup: cargo-deb: installed, but `cargo deb --version` fails: is ~/.cargo/bin on PATH?"
        );
    }
    installed.push(CARGO_DEB.to_owned());
    Ok(())
}

/// Runs every step and prints one summary line; fails on the first failing step.
pub fn run() -> anyhow::Result<()> {
    let mut installed = Vec::new();
    packages(&mut installed)?;
    containerd(&mut installed)?;
    sid_kernel(&mut installed)?;
    kube_tools(&mut installed)?;
    rustup_components(&mut installed)?;
    bpf_linker(&mut installed)?;
    cargo_deb(&mut installed)?;
    if installed.is_empty() {
        println!("setup: ok (all present)");
    } else {
        println!("setup: ok (installed {})", installed.join(", "));
    }
    Ok(())
}
