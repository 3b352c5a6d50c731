//! gpud: per-cgroup attribution and limits of NVIDIA GPU use, for containers sharing GPUs.
//!
//! The data path, in module order: [`probes`] (eBPF load/attach/pin, kernel capabilities) →
//! [`attribution`] (cgroups, processes and GPU memory behind the counters) → [`nvml`] (the
//! driver's own view: inventory, per-process memory and utilization) → [`policy`] (the limits in
//! force, on gpud-api's limit schema, and their persistence; the idle rule) → [`enforcement`]
//! (memory limits into the kernel, actions on crossings; the compute controller) → [`daemon`]
//! (the one task that owns state, and its typed [`daemon::Handle`]) → [`api`] (D-Bus and
//! metrics). The client side for container runtimes (NRI plugin, OCI hook) is the crate
//! gpud-runtime, a client of gpud-api like gpudctl.
//!
//! # Dependency flow
//!
//! Imports point one way, down the data path: `api` uses `daemon`'s handle and converts the
//! core's domain types into gpud-api's wire records at its edge; `daemon` uses `enforcement`,
//! `policy`, `nvml` and `attribution`; `attribution` uses `probes`. Nothing below `api` knows
//! D-Bus, and nothing below `daemon` knows the state task's messages. Leaves that anyone may use:
//! [`config`] (the TOML schema), [`cgroupfs`] (cgroup paths, ids and the freezer), [`report`]
//! (errors printed at the edges), [`logging`], [`privileges`]. The kernel/user ABI is
//! gpud-common's; the D-Bus ABI, the limit schema included (names, value types, parsing), is
//! gpud-api's.

pub mod api;
pub mod attribution;
pub mod cgroupfs;
pub mod config;
pub mod daemon;
pub mod enforcement;
pub mod logging;
pub mod notice;
pub mod nvml;
pub mod policy;
pub mod privileges;
pub mod probes;
pub mod report;

/// Version reported on D-Bus and by `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The source revision this build was made from (git's commit, `$GPUD_REVISION`, or `unknown`).
pub const REVISION: &str = env!("GPUD_REVISION");

/// `<version> (ABI <n>, revision <commit>)`: what `gpud --version` and `gpudctl status` print.
/// The ABI is the kernel/user layout version pinned maps are kept under (CHANGELOG.md names each
/// bump).
pub fn long_version() -> String {
    format!(
        "{VERSION} (ABI {}, revision {REVISION})",
        gpud_common::ABI_VERSION
    )
}

/// A binary's arguments, its `--version` being [`long_version`] (exits with clap's message on
/// bad arguments, as `Parser::parse` does).
pub fn parse_args<T: clap::Parser>() -> T {
    // clap keeps the version for the process's life.
    let version: &'static str = Box::leak(long_version().into_boxed_str());
    let matches = T::command().version(version).get_matches();
    T::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}
