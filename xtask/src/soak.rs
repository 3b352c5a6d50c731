//! `cargo xtask soak --minutes N`: the churn soak (tests/tests/soak/) for N minutes instead of
//! the short run `cargo test` gives it. It starts the real gpud on a private bus with the fake
//! NVIDIA device, churns cgroups, processes and limits, and checks usage against the fake
//! driver and every kernel map and daemon table for leaks; it prints a summary line
//! `SOAK SUMMARY: …` and fails on any mismatch or leak. Both variants run, N minutes each: on
//! an otherwise idle machine and with every CPU kept busy (`GPUD_SOAK_SEED` and
//! `GPUD_SOAK_RUNS` pass through to the test).

use std::time::Duration;

use anyhow::bail;

use crate::util::{cargo, run as run_cmd};

pub fn run(duration: Duration) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("soak: run as root: it loads BPF programs, makes cgroups and mounts FUSE");
    }
    if duration.is_zero() {
        bail!("soak: --minutes must be at least 1");
    }
    crate::setup::run()?;
    crate::util::build_test_binaries("soak: cargo build (gpud, gpud-tests binaries)")?;
    run_cmd(
        "soak: churn",
        cargo()
            .args([
                "test",
                "-p",
                "gpud-tests",
                "--test",
                "soak",
                "--",
                "--nocapture",
            ])
            .env("GPUD_SOAK_SECS", duration.as_secs().to_string()),
    )
}
