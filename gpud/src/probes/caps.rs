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
    /// `dmem.capacity` lists regions of NVIDIA GPUs (the `dmem` tier is possible).
    pub dmem_nvidia: bool,
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
            ("dmem_nvidia", self.dmem_nvidia),
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

/// Where PCI devices are listed (vendor ids in `<bdf>/vendor`).
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";
const NVIDIA_PCI_VENDOR: &str = "0x10de";

/// The `dmem` regions of NVIDIA GPUs and their capacities, from the root's `dmem.capacity`
/// (lines such as `drm/0000:03:00.0/vram0 17179869184`), matched against the PCI functions whose
/// vendor is NVIDIA. `None` when the controller is absent.
pub fn dmem_nvidia_regions(cgroup2_root: &Path, pci_devices: &Path) -> Option<Vec<(String, u64)>> {
    let text = std::fs::read_to_string(cgroup2_root.join("dmem.capacity")).ok()?;
    let is_nvidia = |bdf: &str| {
        std::fs::read_to_string(pci_devices.join(bdf).join("vendor"))
            .is_ok_and(|v| v.trim() == NVIDIA_PCI_VENDOR)
    };
    Some(
        text.lines()
            .filter_map(|l| {
                let (name, size) = l.split_once(char::is_whitespace)?;
                let bdf = name.strip_prefix("drm/")?.split('/').next()?;
                let size = size.trim().parse().ok()?;
                is_nvidia(bdf).then(|| (name.to_owned(), size))
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmem_regions_are_matched_to_nvidia_functions() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("gpud-dmem-{}", std::process::id()));
        let cg = dir.join("cg");
        let pci = dir.join("pci");
        for (bdf, vendor) in [("0000:03:00.0", "0x10de\n"), ("0000:04:00.0", "0x8086\n")] {
            std::fs::create_dir_all(pci.join(bdf))?;
            std::fs::write(pci.join(bdf).join("vendor"), vendor)?;
        }
        std::fs::create_dir_all(&cg)?;
        assert_eq!(dmem_nvidia_regions(&cg, &pci), None, "no controller");
        std::fs::write(
            cg.join("dmem.capacity"),
            "drm/0000:04:00.0/vram0 8589934592\n",
        )?;
        assert_eq!(
            dmem_nvidia_regions(&cg, &pci),
            Some(vec![]),
            "only an Intel GPU"
        );
        std::fs::write(
            cg.join("dmem.capacity"),
            "drm/0000:04:00.0/vram0 8589934592\ndrm/0000:03:00.0/vram0 85899345920\ngarbage\n",
        )?;
        assert_eq!(
            dmem_nvidia_regions(&cg, &pci),
            Some(vec![("drm/0000:03:00.0/vram0".to_owned(), 85_899_345_920)])
        );
        std::fs::remove_dir_all(&dir)
    }
}
