//! `cargo xtask fuzz [--cases N] [--rm-rounds R]`: the property-based fuzz targets with many
//! more cases than `cargo test` gives them, then the corrupted-RM-call run against the real
//! daemon with more rounds.
//!
//! The targets live in test modules named `fuzz` (gpud-api's limit schema: quantities, GPU
//! selectors, limit values, D-Bus limit dictionaries; gpud-runtime's annotations; gpud's library:
//! ring-buffer records, `/proc/devices`, mountinfo, the configuration; gpud-common's
//! `tests/fuzz.rs`: the ABI offsets the probes read), so the filter `fuzz::` selects them. The kernel-side RM decoder is fuzzed through the real probes by
//! `gpud-rm fuzz` in tests/tests/memory.rs, each round of calls checked against the fake
//! driver's ground truth.

use anyhow::bail;

use crate::util::{cargo, run as run_cmd};

/// The memory test that drives `gpud-rm fuzz`.
const RM_FUZZ_TEST: &str = "corrupted_rm_calls_never_charge_more_or_less_than_the_driver_allocated";
/// Calls per round: a round answers within gpud-rm's 10 s reply window.
const RM_FUZZ_CALLS: u64 = 400;

pub fn run(cases: u32, rm_rounds: u64) -> anyhow::Result<()> {
    if cases == 0 {
        bail!("fuzz: --cases must be at least 1");
    }
    let cases = cases.to_string();
    println!("fuzz: property targets, {cases} cases each");
    // The limit schema (quantities, GPU selectors, values, D-Bus dictionaries), the annotations,
    // and the daemon's own decoders (ring-buffer records, /proc text, the configuration).
    for package in ["gpud-api", "gpud-runtime", "gpud"] {
        run_cmd(
            &format!("fuzz: {package} library targets"),
            cargo()
                .args(["test", "-p", package, "--lib", "--", "fuzz::"])
                .env("PROPTEST_CASES", &cases),
        )?;
    }
    run_cmd(
        "fuzz: gpud-common ABI targets",
        cargo()
            .args([
                "test",
                "-p",
                "gpud-common",
                "--test",
                "fuzz",
                "--",
                "fuzz::",
            ])
            .env("PROPTEST_CASES", &cases),
    )?;

    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("fuzz: the corrupted-RM-call run loads BPF programs and mounts FUSE: run as root");
    }
    println!(
        "fuzz: {rm_rounds} rounds of {RM_FUZZ_CALLS} corrupted RM calls through gpud's probes"
    );
    crate::util::build_test_binaries("fuzz: cargo build (gpud, gpud-tests binaries)")?;
    run_cmd(
        "fuzz: corrupted RM calls",
        cargo()
            .args([
                "test",
                "-p",
                "gpud-tests",
                "--test",
                "memory",
                "--",
                "--exact",
            ])
            .arg(RM_FUZZ_TEST)
            .env("GPUD_FUZZ_RM_ROUNDS", rm_rounds.to_string())
            .env("GPUD_FUZZ_RM_CALLS", RM_FUZZ_CALLS.to_string()),
    )?;
    println!("fuzz: passed");
    Ok(())
}
