//! Harness for gpud's integration tests: real parts only. A private `dbus-daemon`, the real
//! `gpud` binary on its own bpffs instance, real cgroup v2 children, and real processes
//! (`gpud-ioctl`, `gpud-rm`) issuing ioctls on stand-in device files or on the fake NVIDIA
//! control device ([`fakenv`]).
//!
//! A test starts from a [`Rig`] (directory, bus, fakes, daemon) and a [`TestConfig`]; the
//! pieces below are what the rig is made of, for tests that need one alone. tests/README.md says
//! how to write a test.
//!
//! Tests need root, a kernel that loads BPF tracepoint programs, and `dbus-daemon`.

use std::time::{Duration, Instant};

// gpud's D-Bus client side (the gpud-api crate), named here once: the tests import these from
// the harness.
pub use gpud_api::{
    BUS_NAME, CgroupRecord, Gpu1Proxy, LimitState, MANAGER_INTERFACE, MUTATING_METHODS,
    Manager1Proxy, NvmlUsageRecord, OBJECT_PATH, connect_builder,
};

pub use bus::{
    Bus, TestGroup, for_each_gpud_interface, introspect_tree, parse_dbus_xml, shipped_bus_policy,
};
pub use cgroup::{Cgroup, cgroup2_root, process_state, spawn_in_cgroup};
pub use config::TestConfig;
pub use daemon::Daemon;
pub use fixtures::{Issuer, RmProcess};
/// The fake NVML's scenario types, for typed scenarios ([`write_nvml_scenario`]).
pub use nvidia_ml_fake::scenario;
pub use nvml::{LedgerNvml, gpus_with, install_fake_nvml, one_gpu, write_nvml_scenario};
pub use paths::{TempDir, bin_dir, gpud_bin, gpudctl_bin, remove_state_dir, unmount_under};
pub use rig::Rig;

pub mod apiserver;
mod bus;
mod cgroup;
mod config;
pub mod containerd;
mod daemon;
pub mod fakenv;
mod fixtures;
pub mod hwcontrols;
#[cfg(target_arch = "x86_64")]
pub mod ia32;
pub mod inproc;
pub mod kubelet;
mod nvml;
mod paths;
pub mod podman;
mod rig;
pub mod rm;
pub mod runtime;

/// Per-class counts as gpud reports them (every class present), from the non-zero ones.
pub fn class_counts(pairs: &[(&str, u64)]) -> std::collections::BTreeMap<String, u64> {
    let mut m: std::collections::BTreeMap<String, u64> = gpud_common::IOCTL_CLASS_NAMES
        .iter()
        .map(|n| ((*n).to_owned(), 0))
        .collect();
    for (k, v) in pairs {
        m.insert((*k).to_owned(), *v);
    }
    m
}

/// Polls `f` until it returns `Some`, for at most `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
