//! `cargo xtask bench`: the probes' overhead, on the host (tracepoint mode) and in the VM (fentry
//! mode, and tracepoint mode on the same kernel for the ratio between the two). Each run of
//! `gpud-bench` prints one `BENCH JSON: {…}` line; they are collected into
//! target/bench/results.json and printed.
//!
//! `cargo xtask bench compute`: compute shares on the simulated GPU (`gpusim-bench`), printed as
//! it prints them.

use std::{process::Command, time::Duration};

use anyhow::Context as _;
use serde_json::{Value, json};

use crate::util::{cargo, output, root, run as run_cmd};

const MARK: &str = "BENCH JSON: ";
/// Software emulation is some 50 times slower than the host.
const VM_TIMEOUT: Duration = Duration::from_secs(900);
/// Fewer calls in the VM, same method: compare ratios between modes there, not absolute times.
const VM_ARGS: &[&str] = &["--calls", "20000", "--rounds", "5"];

/// The JSON object on the `BENCH JSON: ` line of `out`.
fn parse(out: &str) -> anyhow::Result<Value> {
    let line = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(MARK))
        .with_context(|| format!("bench: gpud-bench printed no `{MARK}` line"))?;
    serde_json::from_str(line).context("bench: gpud-bench's JSON does not parse")
}

/// `cargo xtask bench compute [ARGS…]`: builds and runs `gpusim-bench ARGS…` (dev profile:
/// gpusim itself is optimized there, see the workspace manifest); the benchmark defines its own
/// arguments. Its output goes straight to stdout; misses against the targets are reported, not
/// failures.
pub fn compute(args: &[String]) -> anyhow::Result<()> {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--quiet",
        "-p",
        "gpusim",
        "--bin",
        "gpusim-bench",
        "--",
    ]);
    cmd.args(args);
    run_cmd("bench compute: gpusim-bench", &mut cmd)
}

pub fn run(vm: bool) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_cmd(
        "bench: cargo build --release -p gpud-tests --bin gpud-bench",
        cargo().args([
            "build",
            "--release",
            "-p",
            "gpud-tests",
            "--bin",
            "gpud-bench",
            "--bin",
            "gpud-membench",
            "--bin",
            "gpud-scalebench",
            "--bin",
            "gpud-ioctl",
        ]),
    )?;
    let bin = root().join("target/release/gpud-bench");
    let membench = root().join("target/release/gpud-membench");
    let mut results = Vec::new();

    println!("bench: host, tracepoint mode");
    let host = output(
        "bench: gpud-bench on the host",
        Command::new(&bin).args(["--mode", "tracepoint"]),
    )?;
    results.push(json!({"where": "host", "mode": "tracepoint", "result": parse(&host)?}));
    println!("bench: host, GPU-memory accounting and enforcement, tracepoint mode");
    let mem = output(
        "bench: gpud-membench on the host",
        Command::new(&membench).args(["--mode", "tracepoint"]),
    )?;
    results.push(json!({"where": "host", "mode": "tracepoint", "memory": parse(&mem)?}));

    run_cmd(
        "bench: cargo build --release (gpud, fake NVML)",
        cargo().args([
            "build",
            "--release",
            "-p",
            "gpud",
            "-p",
            "fake-nvml",
            "--bins",
            "--lib",
        ]),
    )?;
    println!("bench: gpud at scale (1,000 cgroups, 100 D-Bus clients; ~3 min)");
    let scale = output(
        "bench: gpud-scalebench",
        &mut Command::new(root().join("target/release/gpud-scalebench")),
    )?;
    results.push(json!({"where": "host", "scale": parse(&scale)?}));

    println!("bench: gpud's cost controlling 10 tenants on 2 GPUs (~80 s)");
    let compute = output(
        "bench: compute daemon cost",
        cargo().args([
            "test",
            "--release",
            "-p",
            "gpud-tests",
            "--test",
            "compute_bench",
            "--",
            "--exact",
            "bench_compute_daemon_cost",
            "--nocapture",
        ]),
    )?;
    results.push(json!({"where": "host", "compute_daemon": parse(&compute)?}));

    if vm {
        // The react tier in both modes, then the deny tier through each pre-driver hook.
        for (mode, hook) in [
            ("fentry", "none"),
            ("tracepoint", "none"),
            ("fentry", "lsm"),
            ("fentry", "fmod_ret"),
        ] {
            println!("bench: VM (qemu TCG, Debian kernel), {mode} mode, pre-driver hook {hook}");
            let args: Vec<String> = ["--mode", mode, "--hook", hook]
                .iter()
                .chain(VM_ARGS)
                .map(|s| (*s).to_owned())
                .collect();
            let console = crate::vm::run(&bin, &args, VM_TIMEOUT)?;
            results.push(
                json!({"where": "vm", "mode": mode, "hook": hook, "result": parse(&console)?}),
            );
        }
        println!("bench: VM, GPU-memory accounting and enforcement, fentry mode");
        let args: Vec<String> = [
            "--mode",
            "fentry",
            "--pairs",
            "100",
            "--rounds",
            "3",
            "--holders",
            "100",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let console = crate::vm::run(&membench, &args, VM_TIMEOUT)?;
        results.push(json!({"where": "vm", "mode": "fentry", "memory": parse(&console)?}));
    }

    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("bench: creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(&Value::Array(results))?;
    let file = dir.join("results.json");
    std::fs::write(&file, &text).with_context(|| format!("bench: writing {}", file.display()))?;
    println!("{text}");
    println!("bench: written to {}", file.display());
    Ok(())
}
