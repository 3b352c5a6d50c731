//! `cargo xtask test`: every test, from nothing, as root. Setup, lints (fmt, clippy on the
//! workspace, clippy on the eBPF crate with nightly), the unit and real-kernel integration tests
//! (real cgroups, real dbus-daemon), a smoke run of every benchmark (they must complete and
//! report every figure), the packages (the .deb installed, run and purged on this machine; the
//! previous release's .deb upgraded to this one's under load; the image loaded and run by
//! Podman), gpud on a real single-node Kubernetes from that image (`cluster::e2e`; skipped, and
//! said so, without the Kubernetes binaries), then the VM tests on a kernel with fentry and
//! BPF-LSM and the benchmarks' smoke run there.
//!
//! Every step runs even when an earlier one failed (except after a failed setup), and every test
//! binary runs even when an earlier one failed, so one run shows every problem. The output ends
//! with a summary (each failed step with why, the failed test binaries named) and a plain
//! `N passed, N failed` line.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::util::{build_test_binaries, cargo, describe, free_bytes, gib, root, run as run_cmd};

/// The VM test's verdict line.
const VMTEST_PASS: &str = "VMTEST RESULT: PASS";
/// The VM test boots an emulated (TCG) machine: generous.
const VMTEST_TIMEOUT: Duration = Duration::from_secs(600);

/// The disk a whole run takes from a clean clone, with room to spare: its steps took 8.8 GiB
/// (debug and release builds, the eBPF lint's target, the packages, the images, the cluster's
/// containerd: the summary's `disk:` line), setup's packages and kernels some 3 GiB more, and
/// the previous release's build for the upgrade stage up to 3 GiB while it runs (removed once
/// its package is kept). A machine with less is told so at once, not by a dozen steps failing
/// with ENOSPC.
const DISK_NEEDED: u64 = 20 << 30;

/// A named step of the test run.
struct Step {
    name: &'static str,
    run: fn() -> anyhow::Result<()>,
}

fn fmt() -> anyhow::Result<()> {
    run_cmd(
        "cargo fmt --all --check",
        cargo().args(["fmt", "--all", "--check"]),
    )
}

fn clippy() -> anyhow::Result<()> {
    // `--workspace` would include the eBPF crate, which only builds for the BPF target; it is
    // linted by `clippy_ebpf`.
    run_cmd(
        "cargo clippy --workspace",
        cargo()
            .args([
                "clippy",
                "--workspace",
                "--exclude",
                "gpud-ebpf",
                "--all-targets",
            ])
            .args(["--", "-D", "warnings"]),
    )
}

fn clippy_ebpf() -> anyhow::Result<()> {
    run_cmd(
        "cargo +nightly clippy -p gpud-ebpf",
        // The rustup proxy (not $CARGO, which is the stable cargo) so that `+nightly` works.
        Command::new("cargo")
            .args(["+nightly", "clippy", "-p", "gpud-ebpf"])
            .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
            // Its own target dir: nightly-built host artifacts would otherwise evict the stable
            // ones in target/debug and make the next stable build start over.
            .arg("--target-dir")
            .arg(root().join("target/ebpf-lint"))
            .args(["--", "-D", "warnings"])
            // What `cargo run` put in xtask's environment must not pin the stable toolchain.
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("RUSTC")
            .env_remove("CARGO"),
    )
}

fn build() -> anyhow::Result<()> {
    build_test_binaries(
        "cargo build (gpud, gpud-runtime, gpud-k8s, gpud-tests binaries, fake NVML library)",
    )
}

/// `cargo test` of the workspace with `--no-fail-fast`: a failing test binary does not keep the
/// others from running. Its standard error is passed through and read for the binaries cargo
/// names as failed, which the step's error lists.
fn unit_and_integration() -> anyhow::Result<()> {
    let mut child = cargo()
        .args([
            "test",
            "--workspace",
            "--exclude",
            "gpud-ebpf",
            "--no-fail-fast",
        ])
        .current_dir(root())
        .stderr(Stdio::piped())
        .spawn()
        .context("cargo test: cannot start cargo")?;
    let mut failed = Vec::new();
    if let Some(stderr) = child.stderr.take() {
        let mut listing = false;
        for line in BufReader::new(stderr).lines() {
            let line = line.context("cargo test: reading its output")?;
            eprintln!("{line}");
            if let Some(t) = failed_targets(&line, &mut listing)
                && !failed.contains(&t)
            {
                failed.push(t);
            }
        }
    }
    let status = child.wait().context("cargo test: waiting for cargo")?;
    if !status.success() {
        if failed.is_empty() {
            bail!("cargo test failed ({})", describe(status));
        }
        bail!(
            "cargo test failed ({}); failed test binaries: {}",
            describe(status),
            failed.join(", ")
        );
    }
    Ok(())
}

/// The failed test targets one line of cargo's standard error names: `error: test failed, to
/// rerun pass `…``, or the lines after `error: N targets failed:`, each `` `-p P --test T` ``
/// (`listing` carries that state from line to line).
fn failed_targets(line: &str, listing: &mut bool) -> Option<String> {
    if let Some((_, rest)) = line.split_once("to rerun pass `") {
        return rest.split_once('`').map(|(t, _)| t.to_owned());
    }
    if line.starts_with("error:") && line.contains("targets failed") {
        *listing = true;
        return None;
    }
    if *listing {
        let target = line
            .trim()
            .strip_prefix('`')
            .and_then(|l| l.strip_suffix('`'));
        if target.is_none() {
            *listing = false;
        }
        return target.map(str::to_owned);
    }
    None
}

fn vm() -> anyhow::Result<()> {
    run_cmd(
        "cargo build -p gpud-tests --bin gpud-vmtest",
        cargo().args(["build", "-p", "gpud-tests", "--bin", "gpud-vmtest"]),
    )?;
    let binary = root().join("target/debug/gpud-vmtest");
    let console = crate::vm::run(&binary, &["test".to_owned()], VMTEST_TIMEOUT)?;
    if !console.lines().any(|l| l.trim() == VMTEST_PASS) {
        bail!("gpud-vmtest exited 0 but printed no `{VMTEST_PASS}` line");
    }
    matrix_lines(&console);
    Ok(())
}

/// The `kernel-matrix:` lines seen so far (the VM test prints the Debian row).
static MATRIX: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps the `kernel-matrix:` lines of a console.
fn matrix_lines(console: &str) {
    let lines = console
        .lines()
        .filter_map(|l| l.find("kernel-matrix: ").map(|i| l[i..].trim().to_owned()));
    if let Ok(mut m) = MATRIX.lock() {
        m.extend(lines);
    }
}

/// The kernel matrix: the same checks (`gpud-vmtest row`) on the kernels GPU hosts run —
/// Ubuntu's LSM list, the same under Secure Boot's lockdown, tracepoints only (VM), the newest
/// kernel Debian ships (sid) booted as Debian and as Ubuntu, and this host's own kernel. Each
/// row fails unless what it shows is the row's expectation; every row is printed as one
/// `kernel-matrix:` line at the end.
fn kernel_matrix() -> anyhow::Result<()> {
    use crate::vm::{Boot, KernelSource};
    let binary = root().join("target/debug/gpud-vmtest");
    let mut failed = Vec::new();
    let vm_rows = [
        ("ubuntu", Boot::Ubuntu, KernelSource::Installed),
        (
            "ubuntu-secure-boot",
            Boot::UbuntuLockdown,
            KernelSource::Installed,
        ),
        (
            "tracepoint-only",
            Boot::UbuntuLockdown,
            KernelSource::Installed,
        ),
        // The newest kernel Debian ships, booted as Debian and as Ubuntu would. (Only the rows:
        // the VM test's tracepoint-mode checks make 7.2 oops under qemu when they detach, with
        // or without gpud's 32-bit programs; docs/design.md, the kernel matrix.)
        ("sid-debian", Boot::Debian, KernelSource::Sid),
        ("sid-ubuntu", Boot::Ubuntu, KernelSource::Sid),
    ];
    for (row, boot, kernel) in vm_rows {
        let args = ["row".to_owned(), row.to_owned()];
        match crate::vm::run_booted(&binary, &args, VMTEST_TIMEOUT, boot, kernel) {
            Ok(console) => matrix_lines(&console),
            Err(e) => {
                println!("kernel matrix: {row}: {e:#}");
                failed.push(format!("{row} ({e:#})"));
            }
        }
    }
    let out = Command::new(&binary)
        .args(["row", "host"])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    matrix_lines(&text);
    if !out.status.success() {
        failed.push(format!("host (gpud-vmtest exited with {})", out.status));
    }
    println!("\nWhat gpud enforces on each kernel:");
    if let Ok(m) = MATRIX.lock() {
        for line in m.iter() {
            println!("{line}");
        }
    }
    if !failed.is_empty() {
        bail!("kernel matrix rows failed: {}", failed.join("; "));
    }
    Ok(())
}

/// `cargo xtask matrix`: builds the VM test binary and runs the kernel matrix's rows (the Debian
/// row is the VM test's; run `cargo xtask test` for it).
pub fn matrix_only() -> anyhow::Result<()> {
    run_cmd(
        "cargo build -p gpud-tests --bin gpud-vmtest",
        cargo().args(["build", "-p", "gpud-tests", "--bin", "gpud-vmtest"]),
    )?;
    kernel_matrix()
}

/// The steps after setup, as the flags select them.
fn steps(vm_tests: bool, lint: bool) -> Vec<Step> {
    let mut steps = Vec::new();
    if lint {
        steps.push(Step {
            name: "fmt",
            run: fmt,
        });
        steps.push(Step {
            name: "clippy",
            run: clippy,
        });
        steps.push(Step {
            name: "clippy (eBPF, nightly)",
            run: clippy_ebpf,
        });
    }
    steps.push(Step {
        name: "build",
        run: build,
    });
    steps.push(Step {
        name: "cargo test",
        run: unit_and_integration,
    });
    steps.push(Step {
        name: "benchmarks (smoke)",
        run: crate::bench::smoke_host,
    });
    steps.push(Step {
        name: "package: .deb cycle",
        run: crate::package::test_deb,
    });
    steps.push(Step {
        name: "package: upgrade",
        run: crate::package::test_upgrade,
    });
    steps.push(Step {
        name: "package: image",
        run: crate::package::test_image,
    });
    steps.push(Step {
        name: "kubernetes (real cluster)",
        run: crate::cluster::e2e,
    });
    if vm_tests {
        steps.push(Step {
            name: "VM tests (fentry, BPF-LSM)",
            run: vm,
        });
        steps.push(Step {
            name: "kernel matrix",
            run: kernel_matrix,
        });
        steps.push(Step {
            name: "benchmarks (smoke, VM)",
            run: crate::bench::smoke_vm,
        });
    }
    steps
}

/// What [`run_steps`] did: each step run, with its time and error, in order; and the steps
/// skipped, for want of something they said (`Skipped`) or after a failed setup.
struct Ran {
    results: Vec<(&'static str, Duration, Option<String>)>,
    skipped: Vec<&'static str>,
}

/// Runs every step, even after a failed one, except that nothing runs after a failed first
/// step (setup: nothing works without the tools). A step that returns [`crate::Skipped`] is
/// neither passed nor failed.
fn run_steps(all: impl IntoIterator<Item = Step>) -> Ran {
    let mut results: Vec<(&'static str, Duration, Option<String>)> = Vec::new();
    let mut skipped = Vec::new();
    for step in all {
        if results.first().is_some_and(|(_, _, error)| error.is_some()) {
            skipped.push(step.name);
            continue;
        }
        println!("\n==> {}", step.name);
        let started = Instant::now();
        let result = (step.run)();
        match &result {
            // Said why above; not a failure, never a pass.
            Err(e) if e.is::<crate::Skipped>() => {
                println!("SKIPPED: {}", step.name);
                skipped.push(step.name);
                continue;
            }
            Err(e) => println!("FAILED: {}: {e:#}", step.name),
            Ok(()) => {}
        }
        results.push((
            step.name,
            started.elapsed(),
            result.err().map(|e| format!("{e:#}")),
        ));
    }
    Ran { results, skipped }
}

/// Runs the steps; prints the summary. The error it returns on failure has been reported.
pub fn run(vm_tests: bool, lint: bool) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("test: run as root: the tests load BPF programs, make cgroups and start a VM");
    }
    let total = Instant::now();
    let target = root().join("target");
    std::fs::create_dir_all(&target).with_context(|| format!("{}", target.display()))?;
    let free_at_start = free_bytes(&target)?;
    println!(
        "disk: {} free for {} (a run from a clean clone needs about {})",
        gib(free_at_start),
        target.display(),
        gib(DISK_NEEDED)
    );
    if free_at_start < DISK_NEEDED {
        bail!(
            "test: {} free on the file system of {}, a run from a clean clone needs about {}: \
             free some space and run again",
            gib(free_at_start),
            target.display(),
            gib(DISK_NEEDED)
        );
    }
    let all = std::iter::once(Step {
        name: "setup",
        run: crate::setup::run,
    })
    .chain(steps(vm_tests, lint));
    let Ran { results, skipped } = run_steps(all);

    println!("\n==> summary ({:.0}s)", total.elapsed().as_secs_f64());
    if let Ok(free) = free_bytes(&target) {
        println!(
            "  disk: {} free at the start, {} at the end",
            gib(free_at_start),
            gib(free)
        );
    }
    for (name, took, error) in &results {
        let status = if error.is_none() { "ok" } else { "FAILED" };
        println!("  {status:<6} {name:<28} {:>6.1}s", took.as_secs_f64());
        if let Some(e) = error {
            println!("         {e}");
        }
    }
    for name in &skipped {
        println!("  {:<6} {name}", "skipped");
    }
    let failed = results.iter().filter(|r| r.2.is_some()).count();
    println!(
        "{} passed, {failed} failed, {} skipped",
        results.len() - failed,
        skipped.len()
    );
    if failed > 0 {
        return Err(crate::Reported.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Step, failed_targets, run_steps};

    fn passes() -> anyhow::Result<()> {
        Ok(())
    }

    fn fails() -> anyhow::Result<()> {
        anyhow::bail!("broken")
    }

    fn lacks_something() -> anyhow::Result<()> {
        Err(crate::Skipped.into())
    }

    fn step(name: &'static str, run: fn() -> anyhow::Result<()>) -> Step {
        Step { name, run }
    }

    /// A skipped step (no Kubernetes binaries, say) is reported as skipped, not as passed or
    /// failed, and the steps after it run.
    #[test]
    fn a_skipped_step_is_neither_passed_nor_failed() {
        let ran = run_steps([
            step("setup", passes),
            step("cluster", lacks_something),
            step("after", fails),
            step("last", passes),
        ]);
        assert_eq!(ran.skipped, ["cluster"]);
        let names: Vec<_> = ran.results.iter().map(|r| (r.0, r.2.is_some())).collect();
        assert_eq!(names, [("setup", false), ("after", true), ("last", false)]);
    }

    /// After a failed setup nothing else runs: every other step is skipped.
    #[test]
    fn nothing_runs_after_a_failed_setup() {
        let ran = run_steps([step("setup", fails), step("a", passes), step("b", passes)]);
        assert_eq!(ran.skipped, ["a", "b"]);
        assert_eq!(ran.results.len(), 1);
    }

    /// Both forms cargo prints, as cargo 1.95 prints them.
    #[test]
    fn failed_test_binaries_are_read_from_cargos_error_lines() {
        let text = "test result: FAILED. 1 passed; 1 failed\n\
                    error: test failed, to rerun pass `-p gpud-tests --test podman`\n\
                    error: 2 targets failed:\n    `-p gpud-tests --test podman`\n    \
                    `-p gpud-tests --test nri`\nwarning: something else\n    `not a target`";
        let mut listing = false;
        let found: Vec<String> = text
            .lines()
            .filter_map(|l| failed_targets(l, &mut listing))
            .collect();
        assert_eq!(
            found,
            [
                "-p gpud-tests --test podman",
                "-p gpud-tests --test podman",
                "-p gpud-tests --test nri"
            ]
        );
    }
}
