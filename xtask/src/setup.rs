//! Idempotent bootstrap of a fresh machine of the project's kind (Debian 12, rustup, root):
//! Debian packages, nightly `rust-src`, `bpf-linker` 0.13 against LLVM 22, rustfmt and clippy.
//! Each step checks first and acts only when something is missing; a failure names the step
//! and the reason in one line.

use std::process::Command;

use anyhow::{Context as _, bail};

use crate::util::{cargo, output};

/// Debian packages the build and the tests use, with why.
const PACKAGES: &[(&str, &str)] = &[
    (
        "llvm-22-dev",
        "bpf-linker links against LLVM 22, the nightly's LLVM",
    ),
    (
        "libpolly-22-dev",
        "LLVM 22's link dependencies for bpf-linker",
    ),
    ("libzstd-dev", "LLVM 22's link dependencies for bpf-linker"),
    ("libelf-dev", "libbpf (kernel BTF parsing in gpud)"),
    ("zlib1g-dev", "libbpf (kernel BTF parsing in gpud)"),
    (
        "pkg-config",
        "finding libelf and zlib while building libbpf",
    ),
    ("dbus", "dbus-daemon for the D-Bus tests and `xtask run`"),
    ("systemd", "busctl for the D-Bus tests"),
    (
        "qemu-system-x86",
        "the VM tests (fentry and BPF-LSM need a distribution kernel)",
    ),
    ("linux-image-amd64", "the Debian kernel the VM tests boot"),
    ("busybox-static", "the VM's init and tools"),
    ("cpio", "packing the VM's initramfs"),
];

/// What setup did, for the summary line.
#[derive(Default)]
pub struct Report {
    pub installed: Vec<String>,
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn apt_install(missing: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("apt-get")
        .args(["update", "-qq"])
        .status()
        .context("setup: apt-get update: cannot run apt-get (is this Debian, running as root?)")?;
    if !status.success() {
        bail!(
            "setup: apt-get update failed ({status}): no package lists, so nothing can be installed"
        );
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("setup: apt-get install: cannot run apt-get")?;
    if !status.success() {
        bail!(
            "setup: apt-get install {} failed ({status}); see apt's output above",
            missing.join(" ")
        );
    }
    Ok(())
}

fn packages(report: &mut Report) -> anyhow::Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(p, _)| !dpkg_installed(p))
        .map(|(p, _)| *p)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    for (p, why) in PACKAGES.iter().filter(|(p, _)| missing.contains(p)) {
        println!("setup: installing {p} ({why})");
    }
    apt_install(&missing)?;
    report
        .installed
        .extend(missing.iter().map(|p| (*p).to_owned()));
    Ok(())
}

fn rustup_components(report: &mut Report) -> anyhow::Result<()> {
    let toolchains = output(
        "setup: rustup toolchain list",
        Command::new("rustup").args(["toolchain", "list"]),
    )?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        bail!(
            "setup: no `nightly` toolchain: the eBPF crate needs nightly (-Z build-std); \
             install it with `rustup toolchain install nightly`"
        );
    }
    for (toolchain, component, why) in [
        (
            "nightly",
            "rust-src",
            "building core for bpfel-unknown-none",
        ),
        ("nightly", "clippy", "linting the eBPF crate"),
        ("stable", "rustfmt", "cargo fmt --check"),
        ("stable", "clippy", "cargo clippy"),
    ] {
        let installed = output(
            "setup: rustup component list",
            Command::new("rustup").args([
                "component",
                "list",
                "--installed",
                "--toolchain",
                toolchain,
            ]),
        )?;
        if installed.lines().any(|l| l.starts_with(component)) {
            continue;
        }
        println!("setup: adding {component} to {toolchain} ({why})");
        output(
            &format!("setup: rustup component add {component} --toolchain {toolchain}"),
            Command::new("rustup").args(["component", "add", component, "--toolchain", toolchain]),
        )?;
        report.installed.push(format!("{toolchain}/{component}"));
    }
    Ok(())
}

fn bpf_linker(report: &mut Report) -> anyhow::Result<()> {
    let version = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if version.as_deref().is_some_and(|v| v.contains(" 0.13.")) {
        return Ok(());
    }
    println!("setup: building bpf-linker 0.13 against LLVM 22 (takes a few minutes)");
    let status = cargo()
        .args([
            "install",
            "bpf-linker@0.13.0",
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", "/usr/lib/llvm-22")
        .status()
        .context("setup: bpf-linker: cannot run cargo install")?;
    if !status.success() {
        bail!(
            "setup: bpf-linker: `cargo install bpf-linker@0.13.0` failed ({status}); it needs \
             llvm-22-dev, libpolly-22-dev and libzstd-dev from Debian 12's updates"
        );
    }
    report.installed.push("bpf-linker 0.13".into());
    Ok(())
}

/// Runs every step; prints one summary line.
pub fn run() -> anyhow::Result<Report> {
    let mut report = Report::default();
    packages(&mut report)?;
    rustup_components(&mut report)?;
    bpf_linker(&mut report)?;
    if report.installed.is_empty() {
        println!("setup: ok (all present)");
    } else {
        println!("setup: ok (installed {})", report.installed.join(", "));
    }
    Ok(report)
}
