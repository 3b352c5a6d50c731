//! `cargo xtask test`: every test, from nothing. Set-up, lints, unit and real-kernel integration
//! tests (root, real cgroups, real dbus-daemon), then the VM tests on a kernel with fentry and
//! BPF-LSM. Ends with one `N passed, N failed` line counting the steps.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::util::{cargo, root, run as run_cmd};

type Step = (&'static str, Box<dyn Fn() -> anyhow::Result<()>>);

fn steps(vm: bool, lint: bool) -> Vec<Step> {
    let mut s: Vec<Step> = Vec::new();
    if lint {
        s.push((
            "cargo fmt --check",
            Box::new(|| run_cmd("fmt", cargo().args(["fmt", "--all", "--check"]))),
        ));
        s.push((
            "cargo clippy (workspace)",
            Box::new(|| {
                run_cmd(
                    "clippy",
                    // The eBPF crate only builds for the bpf target; it is linted below.
                    cargo().args([
                        "clippy",
                        "--workspace",
                        "--exclude",
                        "gpud-ebpf",
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ]),
                )
            }),
        ));
        s.push((
            "cargo clippy (eBPF crate, nightly)",
            Box::new(|| {
                let target_dir = root().join("target/ebpf-lint");
                run_cmd(
                    "eBPF clippy",
                    Command::new("rustup")
                        .args(["run", "nightly", "cargo", "clippy", "-p", "gpud-ebpf"])
                        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
                        .arg("--target-dir")
                        .arg(target_dir)
                        .args(["--", "-D", "warnings"])
                        // The nightly cargo must not inherit the stable toolchain's settings.
                        .env_remove("RUSTC")
                        .env_remove("RUSTUP_TOOLCHAIN")
                        .env_remove("CARGO"),
                )
            }),
        ));
    }
    s.push((
        "build binaries",
        Box::new(|| {
            run_cmd(
                "build",
                cargo().args([
                    "build",
                    "--package",
                    "gpud",
                    "--package",
                    "gpud-tests",
                    "--bins",
                ]),
            )
        }),
    ));
    s.push((
        "cargo test --workspace",
        Box::new(|| {
            run_cmd(
                "tests",
                cargo().args(["test", "--workspace", "--exclude", "gpud-ebpf"]),
            )
        }),
    ));
    if vm {
        s.push(("VM tests (fentry, BPF-LSM)", Box::new(vm_tests)));
    }
    s
}

fn vm_tests() -> anyhow::Result<()> {
    run_cmd(
        "build gpud-vmtest",
        cargo().args([
            "build",
            "--release",
            "-p",
            "gpud-tests",
            "--bin",
            "gpud-vmtest",
        ]),
    )?;
    let bin = root().join("target/release/gpud-vmtest");
    let out =
        crate::vm::run(&bin, &["test".to_owned()], Duration::from_secs(600)).context("VM test")?;
    for line in out
        .lines()
        .filter(|l| l.starts_with('[') || l.starts_with("VM") || l.starts_with("kernel"))
    {
        println!("  vm| {line}");
    }
    if !out.contains("VMTEST RESULT: PASS") {
        bail!("VM test did not pass:\n{out}");
    }
    Ok(())
}

pub fn run(vm: bool, lint: bool) -> anyhow::Result<()> {
    let total = Instant::now();
    let mut results: Vec<(&str, Duration, Option<String>)> = Vec::new();
    let t = Instant::now();
    let setup = crate::setup::run();
    results.push((
        "setup",
        t.elapsed(),
        setup.as_ref().err().map(|e| format!("{e:#}")),
    ));
    if setup.is_ok() {
        for (name, step) in steps(vm, lint) {
            println!("\n==> {name}");
            let t = Instant::now();
            let r = step();
            if let Err(e) = &r {
                println!("FAILED: {name}: {e:#}");
            }
            results.push((name, t.elapsed(), r.err().map(|e| format!("{e:#}"))));
        }
    }
    println!("\n==> summary ({:.0?})", total.elapsed());
    for (name, took, err) in &results {
        let status = if err.is_none() { "ok" } else { "FAILED" };
        println!("  {status:<6} {name} ({took:.1?})");
    }
    let failed = results.iter().filter(|r| r.2.is_some()).count();
    let passed = results.len() - failed;
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} step(s) failed");
    }
    Ok(())
}
