//! `cargo xtask bench`: the probes' overhead, on the host (tracepoint mode) and in the VM (fentry
//! mode, and tracepoint mode on the same kernel for the ratio between the two). Each benchmark
//! binary prints `BENCH JSON: {…}` lines; they are collected into target/bench/results.json and
//! printed.
//!
//! `cargo xtask bench compute`: compute shares on the simulated GPU (`gpusim-bench`), printed as
//! it prints them.
//!
//! [`smoke_host`] and [`smoke_vm`]: `cargo xtask test` runs every benchmark once, briefly, from
//! the debug build, and fails when one does not complete or leaves a figure out; the figures
//! are printed, never judged (a loaded CI machine measures nothing worth a verdict).

use std::{process::Command, time::Duration};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::util::{cargo, output, root, run as run_cmd};

const MARK: &str = "BENCH JSON: ";
/// Software emulation is some 50 times slower than the host.
const VM_TIMEOUT: Duration = Duration::from_secs(900);

/// A benchmark binary's run: the arguments of both runs, then those of the full run (`cargo xtask
/// bench`) or of the smoke run (`cargo xtask test`).
struct Run {
    /// What it measures, for the progress lines.
    what: &'static str,
    /// The binary, built from gpud-tests.
    bin: &'static str,
    args: &'static [&'static str],
    full: &'static [&'static str],
    smoke: &'static [&'static str],
}

impl Run {
    fn args(&self, smoke: bool) -> Vec<&'static str> {
        let extra = if smoke { self.smoke } else { self.full };
        self.args.iter().chain(extra).copied().collect()
    }
}

/// gpud-bench's smoke run: a few calls, one round; two cycles on the host, so that what one
/// cycle leaves for the next (the stand-in device) is exercised.
const BENCH_SMOKE_HOST: &[&str] = &["--calls", "2000", "--rounds", "2", "--cycles", "2"];
const BENCH_SMOKE_VM: &[&str] = &["--calls", "500", "--rounds", "1", "--cycles", "1"];
/// Fewer calls in the VM than on the host, same method: compare ratios between modes there, not
/// absolute times.
const BENCH_FULL_VM: &[&str] = &["--calls", "20000", "--rounds", "5"];

/// What runs on the host.
const HOST: [Run; 3] = [
    Run {
        what: "probe overhead per syscall, host, tracepoint mode",
        bin: "gpud-bench",
        args: &["--mode", "tracepoint"],
        full: &[],
        smoke: BENCH_SMOKE_HOST,
    },
    Run {
        what: "GPU-memory accounting and enforcement, host, tracepoint mode",
        bin: "gpud-membench",
        args: &["--mode", "tracepoint"],
        full: &[],
        smoke: &[
            "--pairs",
            "20",
            "--rounds",
            "2",
            "--samples",
            "3",
            "--holders",
            "20",
            "--calls",
            "200",
        ],
    },
    Run {
        what: "gpud at scale: attribution, limit changes, D-Bus under load, events",
        bin: "gpud-scalebench",
        args: &[],
        full: &[],
        smoke: &[
            "--cgroups",
            "10",
            "--clients",
            "4",
            "--trials",
            "5",
            "--seconds",
            "1",
            "--rate",
            "200",
            "--forks",
            "200",
        ],
    },
];

/// What runs in the VM (qemu TCG, the Debian kernel): the react tier in both modes, the deny
/// tier through each pre-driver hook (one boot for the fentry hooks), and the memory benchmark.
const VM: [Run; 3] = [
    Run {
        what: "probe overhead, VM, fentry mode, hooks none, lsm, fmod_ret",
        bin: "gpud-bench",
        args: &["--mode", "fentry", "--hook", "none,lsm,fmod_ret"],
        full: BENCH_FULL_VM,
        smoke: BENCH_SMOKE_VM,
    },
    Run {
        what: "probe overhead, VM, tracepoint mode",
        bin: "gpud-bench",
        args: &["--mode", "tracepoint"],
        full: BENCH_FULL_VM,
        smoke: BENCH_SMOKE_VM,
    },
    Run {
        what: "GPU-memory accounting and enforcement, VM, fentry mode",
        bin: "gpud-membench",
        args: &["--mode", "fentry"],
        full: &["--pairs", "100", "--rounds", "3", "--holders", "100"],
        smoke: &[
            "--pairs",
            "10",
            "--rounds",
            "1",
            "--samples",
            "2",
            "--holders",
            "10",
            "--calls",
            "100",
        ],
    },
];

/// Figures a result may leave out (`null`): a JSON pointer (`*` matches any one step) and, where
/// null means "not measured here", the field that must then say why. Without one, null is the
/// figure itself.
const MAY_BE_ABSENT: &[(&str, Option<&str>)] = &[
    // The memory view's rewrite where the kernel refuses `bpf_probe_write_user` (lockdown).
    (
        "/memory_info_ns_per_call/limited_view_on",
        Some("/memory_view"),
    ),
    // gpusim-bench: a tenant that never settled within its bounds.
    ("/tenants/*/settle_ms", None),
];

/// Whether the JSON pointer `path` matches `pattern` (`*` for any one step).
fn matches(pattern: &str, path: &str) -> bool {
    let (mut p, mut q) = (pattern.split('/'), path.split('/'));
    loop {
        match (p.next(), q.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

/// The JSON objects on the `BENCH JSON: ` lines of `out`; at least one.
fn parse_all(what: &str, out: &str) -> anyhow::Result<Vec<Value>> {
    let results = out
        .lines()
        .filter_map(|l| l.trim().strip_prefix(MARK))
        .map(|line| {
            serde_json::from_str(line).with_context(|| format!("{what}: its JSON does not parse"))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    if results.is_empty() {
        bail!("{what}: printed no `{MARK}` line");
    }
    Ok(results)
}

/// The paths (JSON pointers) of the figures `v` leaves out: `null` leaves (a NaN serializes as
/// null, so a figure that was never measured shows here), except those [`MAY_BE_ABSENT`]
/// allows where the result says why.
fn absent_figures(v: &Value) -> Vec<String> {
    fn walk(v: &Value, path: String, out: &mut Vec<String>) {
        match v {
            Value::Null => out.push(path),
            Value::Object(m) => {
                for (k, x) in m {
                    walk(x, format!("{path}/{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, format!("{path}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out.retain(|path| {
        !MAY_BE_ABSENT.iter().any(|(figure, why)| {
            matches(figure, path)
                && why.is_none_or(|why| {
                    v.pointer(why)
                        .and_then(Value::as_str)
                        .is_some_and(|s| !s.is_empty())
                })
        })
    });
    out
}

/// Fails naming the figures a result left out.
fn check_complete(what: &str, results: &[Value]) -> anyhow::Result<()> {
    for r in results {
        let absent = absent_figures(r);
        if !absent.is_empty() {
            bail!(
                "{what}: completed without the figures {}",
                absent.join(", ")
            );
        }
    }
    Ok(())
}

/// Runs `bin args…` from target/`profile` on the host; its results, each complete.
fn on_host(profile: &str, run: &Run, args: &[&str]) -> anyhow::Result<Vec<Value>> {
    println!("bench: {} ({})", run.what, args.join(" "));
    let bin = root().join("target").join(profile).join(run.bin);
    let out = output(run.bin, Command::new(&bin).args(args))?;
    let results = parse_all(run.bin, &out)?;
    check_complete(run.bin, &results)?;
    Ok(results)
}

/// Runs `bin args…` from target/`profile` in the VM; its results, each complete.
fn in_vm(profile: &str, run: &Run, args: &[&str]) -> anyhow::Result<Vec<Value>> {
    println!("bench: {} ({})", run.what, args.join(" "));
    let bin = root().join("target").join(profile).join(run.bin);
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    let console = crate::vm::run(&bin, &args, VM_TIMEOUT)?;
    let results = parse_all(run.bin, &console)?;
    check_complete(run.bin, &results)?;
    Ok(results)
}

/// `cargo xtask bench compute [ARGS…]`: builds and runs `gpusim-bench ARGS…` (dev profile:
/// gpusim itself is optimized there, see the workspace manifest); the benchmark defines its own
/// arguments. Its output goes straight to stdout; misses against the targets are reported, not
/// failures.
pub fn compute(args: &[String]) -> anyhow::Result<()> {
    run_cmd("bench compute: gpusim-bench", &mut gpusim_bench(args))
}

fn gpusim_bench(args: &[String]) -> Command {
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
    cmd
}

/// gpud's own CPU cost of compute shares (tests/tests/compute_bench.rs), over a window of
/// `window_secs` (the test's default when `None`).
fn compute_daemon_cost(release: bool, window_secs: Option<u64>) -> anyhow::Result<Vec<Value>> {
    let mut cmd = cargo();
    cmd.arg("test");
    if release {
        cmd.arg("--release");
    }
    cmd.args([
        "-p",
        "gpud-tests",
        "--test",
        "compute_bench",
        "--",
        "--exact",
        "bench_compute_daemon_cost",
        "--nocapture",
    ]);
    if let Some(secs) = window_secs {
        cmd.env("GPUD_BENCH_WINDOW_SECS", secs.to_string());
    }
    let out = output("compute daemon cost", &mut cmd)?;
    let results = parse_all("compute daemon cost", &out)?;
    for r in &results {
        if let Some(skipped) = r.pointer("/no_policy/skipped") {
            bail!("compute daemon cost: skipped ({skipped})");
        }
    }
    check_complete("compute daemon cost", &results)?;
    Ok(results)
}

pub fn run(vm: bool) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_cmd(
        "bench: cargo build --release (gpud, the benchmarks, fake NVML)",
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
            "-p",
            "gpud",
            "-p",
            "fake-nvml",
            "--bins",
            "--lib",
        ]),
    )?;
    let mut results = Vec::new();
    for run in &HOST {
        for r in on_host("release", run, &run.args(false))? {
            results.push(json!({"where": "host", "bench": run.bin, "result": r}));
        }
    }
    println!("bench: gpud's cost controlling 10 tenants on 2 GPUs (~80 s)");
    for r in compute_daemon_cost(true, None)? {
        results.push(json!({"where": "host", "bench": "compute_daemon", "result": r}));
    }
    if vm {
        for run in &VM {
            for r in in_vm("release", run, &run.args(false))? {
                results.push(json!({"where": "vm", "bench": run.bin, "result": r}));
            }
        }
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

/// Prints one smoke result compactly: the benchmark and its figures.
fn show(bin: &str, results: &[Value]) {
    for r in results {
        println!("bench smoke: {bin}: {r}");
    }
}

/// `cargo xtask test`'s smoke stage on the host: each host benchmark from the debug build
/// (built by the test's build step), the compute daemon cost over 2 s, and one quick case of
/// `gpusim-bench`.
pub fn smoke_host() -> anyhow::Result<()> {
    for run in &HOST {
        show(run.bin, &on_host("debug", run, &run.args(true))?);
    }
    println!("bench: gpud's cost controlling 10 tenants on 2 GPUs (2 s windows)");
    show("compute_bench", &compute_daemon_cost(false, Some(2))?);
    println!("bench: compute shares on the simulated GPU (one quick case)");
    let args: Vec<String> = ["--quick", "--json", "--filter", SIM_CASE]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let out = output("gpusim-bench", &mut gpusim_bench(&args))?;
    let cases: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).context("gpusim-bench: a line that is not JSON"))
        .collect::<anyhow::Result<_>>()?;
    if cases.is_empty() {
        bail!("gpusim-bench: no case matched {SIM_CASE:?}");
    }
    check_complete("gpusim-bench", &cases)?;
    show("gpusim-bench", &cases);
    Ok(())
}

/// `cargo xtask bench smoke`: setup, the build `cargo xtask test` makes, and the smoke stage
/// (with the VM's part unless `vm` is false).
pub fn smoke(vm: bool) -> anyhow::Result<()> {
    crate::setup::run()?;
    crate::util::build_test_binaries("cargo build (the daemon, the benchmarks, fake NVML)")?;
    smoke_host()?;
    if vm {
        smoke_vm()?;
    }
    Ok(())
}

/// The `gpusim-bench` case the smoke run measures.
const SIM_CASE: &str = "caps-30-70";

/// The VM's part of the smoke stage: gpud-bench in fentry mode with each pre-driver hook and in
/// tracepoint mode, and gpud-membench in fentry mode, from the debug build (the test's build
/// step, or [`smoke`]'s, made them).
pub fn smoke_vm() -> anyhow::Result<()> {
    for run in &VM {
        show(run.bin, &in_vm("debug", run, &run.args(true))?);
    }
    Ok(())
}
