//! gpud's D-Bus API as its clients see it: the bus name and object paths, the records the
//! methods return, the client proxies, the names of the errors the daemon answers with, and the
//! list of methods that change state.
//!
//! This crate is to D-Bus what `gpud-common` is to the kernel: one definition of the wire shapes,
//! shared by the daemon (which serves them) and every client (`gpudctl`, the NRI plugin, the OCI
//! hook, the Kubernetes plugin). It knows nothing of the daemon's internals; the daemon converts
//! its own types into these records at its API edge. docs/dbus-api.md documents every member.
//!
//! [`limits`] is the limit schema (names on D-Bus and in annotations, value types and ranges,
//! parsing, rendering, GPU selectors, the `a{sv}` dictionary): the one definition the daemon's
//! policy, its D-Bus handler, gpudctl, the container-runtime integration and gpud-k8s share.

#![warn(missing_docs)]

pub mod cgroup_path;
pub mod error;
pub mod limits;
pub mod model;
pub mod proxy;
pub mod report;
pub mod workload;

pub use error::ApiError;
pub use model::{
    CgroupRecord, ComputeRecord, GpuRecord, IdleRecord, LimitRecord, LimitState, NvmlEventRecord,
    NvmlUsageRecord, ProcessRecord,
};
pub use proxy::{Cgroup1Proxy, Gpu1Proxy, Manager1Proxy, connect_builder};

/// The daemon's well-known name on the bus.
pub const BUS_NAME: &str = "dev.gpud.Daemon1";
/// The object that serves [`MANAGER_INTERFACE`].
pub const OBJECT_PATH: &str = "/dev/gpud/Daemon1";
/// The daemon's main interface: attribution, limits, NVML figures, compute shares.
pub const MANAGER_INTERFACE: &str = "dev.gpud.Manager1";
/// One object per GPU and MIG device (see [`gpu_path`]).
pub const GPU_INTERFACE: &str = "dev.gpud.Gpu1";
/// One object per attributed cgroup (see [`cgroup_object_path`]).
pub const CGROUP_INTERFACE: &str = "dev.gpud.Cgroup1";

/// Object path of the cgroup at `path` (relative to the cgroup v2 root, `/a/b`):
/// `/dev/gpud/Daemon1/cgroup/<label>`, the label escaped as systemd escapes its unit paths
/// (`sd_bus_path_encode`: every byte but an ASCII letter, or a digit past the first, becomes `_`
/// and two lowercase hex digits; the empty string is `_`), so `/a/b` is `_2fa_2fb`.
pub fn cgroup_object_path(path: &str) -> String {
    let mut label = String::with_capacity(path.len() * 3);
    if path.is_empty() {
        label.push('_');
    }
    for (i, b) in path.bytes().enumerate() {
        if b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()) {
            label.push(b as char);
        } else {
            label.push_str(&format!("_{b:02x}"));
        }
    }
    format!("{OBJECT_PATH}/cgroup/{label}")
}

/// The cgroup path a [`cgroup_object_path`] names; `None` for any other object path or a label
/// that is not a valid escape.
pub fn cgroup_of_object_path(object: &str) -> Option<String> {
    let label = object.strip_prefix(OBJECT_PATH)?.strip_prefix("/cgroup/")?;
    if label == "_" {
        return Some(String::new());
    }
    let mut out = Vec::with_capacity(label.len());
    let mut bytes = label.bytes();
    while let Some(b) = bytes.next() {
        if b == b'_' {
            let hex = [bytes.next()?, bytes.next()?];
            out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else if b.is_ascii_alphanumeric() {
            out.push(b);
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

/// Methods (of any `dev.gpud.*` interface) that change state: only root and the admin group may
/// call them. The shipped bus policy (systemd/dev.gpud.Daemon1.conf) allows every other method to
/// everyone and these to root and the group only, and the daemon checks their callers again. A
/// test introspects the daemon and fails on a method that is in neither list, so a new method
/// must be classified here or in the policy file.
pub const MUTATING_METHODS: &[&str] = &["SetLimits", "ClearLimits", "SetWorkload", "ShareCharges"];

/// Every signal the daemon emits (of `dev.gpud.Manager1` and `dev.gpud.Gpu1`), by name: what
/// `gpudctl events` decodes. A test compares it, and the proxies, with the running daemon's
/// introspection, so a signal added to the daemon alone fails it.
pub const SIGNALS: [&str; 6] = [
    "MemoryLimitExceeded",
    "SchedulerControlGuarded",
    "ComputeThrottled",
    "IdleChanged",
    "Xid",
    "KernelEventsLost",
];

/// Object path of a GPU (`mig == u32::MAX`) or of a MIG device under it.
pub fn gpu_path(index: u32, mig: u32) -> String {
    if mig == u32::MAX {
        format!("{OBJECT_PATH}/gpu/{index}")
    } else {
        format!("{OBJECT_PATH}/gpu/{index}/mig/{mig}")
    }
}

/// The container id a cgroup path names, if any: the last component that is a runtime's scope
/// (`docker-<id>.scope`, `cri-containerd-<id>.scope`, `crio-<id>.scope`, `libpod-<id>.scope`) or
/// a bare 64-hex-digit id (cgroupfs drivers). The metrics endpoint labels series with it and
/// `gpudctl top` shows it.
pub fn container_id(path: &str) -> Option<String> {
    const PREFIXES: [&str; 4] = ["docker-", "cri-containerd-", "crio-", "libpod-"];
    let is_id = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
    path.rsplit('/').find_map(|c| {
        let bare = c.strip_suffix(".scope").map_or(c, |s| {
            PREFIXES.iter().find_map(|p| s.strip_prefix(p)).unwrap_or(s)
        });
        is_id(bare).then(|| bare.to_ascii_lowercase())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn container_ids_from_runtime_cgroup_paths() {
        for p in [
            format!("/system.slice/docker-{ID}.scope"),
            format!("/kubepods.slice/kubepods-pod1.slice/cri-containerd-{ID}.scope"),
            format!("/kubepods.slice/kubepods-besteffort.slice/crio-{ID}.scope"),
            format!("/machine.slice/libpod-{ID}.scope/container"),
            format!("/docker/{ID}"),
            format!("/kubepods/besteffort/pod1234/{}", ID.to_uppercase()),
        ] {
            assert_eq!(container_id(&p).as_deref(), Some(ID), "{p}");
        }
        for p in [
            "/",
            "/user.slice/session-1.scope",
            "/docker-abc.scope",
            &format!("/docker-{}.scope", &ID[1..]),
            &format!("/x/{ID}0"),
            "/crio-conmon-zz.scope",
        ] {
            assert_eq!(container_id(p), None, "{p}");
        }
    }

    #[test]
    fn gpu_and_mig_object_paths() {
        assert_eq!(gpu_path(1, u32::MAX), "/dev/gpud/Daemon1/gpu/1");
        assert_eq!(gpu_path(1, 3), "/dev/gpud/Daemon1/gpu/1/mig/3");
    }
}
