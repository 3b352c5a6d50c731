//! gpud: per-cgroup attribution (and, later, limits) of NVIDIA GPU use.
//!
//! The data path, in module order: [`probes`] (eBPF load/attach/pin, kernel capabilities) →
//! [`attribution`] (cgroups, processes and GPU memory behind the counters) → [`policy`] (limits
//! and their persistence) → [`enforcement`] (limits into the kernel, actions on crossings) →
//! [`daemon`] (the one task that owns state) → [`api`] (D-Bus). [`config`] is the TOML schema.

pub mod api;
pub mod attribution;
pub mod config;
pub mod daemon;
pub mod enforcement;
pub mod logging;
pub mod nvml;
pub mod policy;
pub mod privileges;
pub mod probes;
pub mod report;
pub mod runtime;

/// Version reported on D-Bus and by `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
