//! What this kernel offers gpud, discovered at start-up (never assumed from a version number).

use std::{collections::BTreeMap, path::Path};

/// Mechanisms gpud can use, each probed on the running kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelCaps {
    /// Syscall tracepoint programs load and attach (`syscalls:sys_enter_ioctl`).
    pub tracepoint: bool,
    /// BPF trampolines load (`fentry` on `security_file_ioctl`).
    pub fentry: bool,
    /// BPF-LSM programs load (`lsm/file_ioctl`) and `bpf` is in the active LSM list.
    pub bpf_lsm: bool,
    /// The kernel has the separate `security_file_ioctl_compat` hook (6.8+).
    pub file_ioctl_compat: bool,
    /// The `dmem` cgroup controller is available on the cgroup v2 hierarchy.
    pub dmem_cgroup: bool,
}

impl KernelCaps {
    /// Names and values, as reported on D-Bus (`a{sb}`) and by `gpudctl status`.
    pub fn as_map(&self) -> BTreeMap<String, bool> {
        [
            ("tracepoint", self.tracepoint),
            ("fentry", self.fentry),
            ("bpf_lsm", self.bpf_lsm),
            ("file_ioctl_compat", self.file_ioctl_compat),
            ("dmem_cgroup", self.dmem_cgroup),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

/// Whether `bpf` is among the active LSMs (`/sys/kernel/security/lsm`, needs securityfs).
pub fn bpf_in_lsm_list() -> bool {
    std::fs::read_to_string("/sys/kernel/security/lsm")
        .map(|s| s.trim().split(',').any(|l| l == "bpf"))
        .unwrap_or(false)
}

/// Whether the `dmem` controller is listed in the root's `cgroup.controllers`.
pub fn dmem_available(cgroup2_root: &Path) -> bool {
    std::fs::read_to_string(cgroup2_root.join("cgroup.controllers"))
        .map(|s| s.split_whitespace().any(|c| c == "dmem"))
        .unwrap_or(false)
}
