//! What this kernel offers gpud, discovered at start-up (never assumed from a version number).

use std::{collections::BTreeMap, path::Path};

/// Mechanisms gpud can use, each probed on the running kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelCaps {
    /// Syscall tracepoint programs load and attach (`syscalls:sys_enter_ioctl`).
    pub tracepoint: bool,
    /// BPF trampolines load (`fentry` on `security_file_ioctl`).
    pub fentry: bool,
    /// BPF-LSM programs load and attach (`lsm/file_ioctl`) and `bpf` is in the active LSM list.
    pub bpf_lsm: bool,
    /// fmod_ret programs load and attach on `security_file_ioctl`.
    pub fmod_ret: bool,
    /// The kernel has the separate `security_file_ioctl_compat` hook (6.8+).
    pub file_ioctl_compat: bool,
    /// 32-bit system calls can be told apart where every system call passes
    /// (x86-64, with `thread_info.status` in the kernel's BTF): tracepoint mode follows them.
    pub compat_syscalls: bool,
    /// The `dmem` cgroup controller is available on the cgroup v2 hierarchy.
    pub dmem_cgroup: bool,
    /// `dmem.capacity` lists regions of NVIDIA GPUs (the `dmem` tier is possible).
    pub dmem_nvidia: bool,
    /// The ioctl return side may call `bpf_probe_write_user` (the memory view is possible):
    /// refused under lockdown and without CAP_SYS_ADMIN.
    pub probe_write_user: bool,
}

impl KernelCaps {
    /// Names and values, as reported on D-Bus (`a{sb}`) and by `gpudctl status`.
    pub fn as_map(&self) -> BTreeMap<String, bool> {
        [
            ("tracepoint", self.tracepoint),
            ("fentry", self.fentry),
            ("bpf_lsm", self.bpf_lsm),
            ("fmod_ret", self.fmod_ret),
            ("file_ioctl_compat", self.file_ioctl_compat),
            ("compat_syscalls", self.compat_syscalls),
            ("dmem_cgroup", self.dmem_cgroup),
            ("dmem_nvidia", self.dmem_nvidia),
            ("probe_write_user", self.probe_write_user),
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

/// The kernel's lockdown mode when one is in force (`integrity`, `confidentiality`), from
/// `/sys/kernel/security/lockdown` (`none [integrity] confidentiality`); `None` when it is
/// `none` or cannot be read.
pub fn active_lockdown() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/security/lockdown").ok()?;
    lockdown_of(&text)
}

fn lockdown_of(text: &str) -> Option<String> {
    let (_, rest) = text.split_once('[')?;
    let (mode, _) = rest.split_once(']')?;
    (mode != "none").then(|| mode.to_owned())
}

/// Why the memory view cannot run, from the refused load of its return side (`load_error`:
/// the error chain, verifier log included): the verifier's own line about the helper, and its
/// cause — no `CAP_SYS_ADMIN` (`sys_admin`: whether gpud holds it, if known), or the lockdown
/// mode in force.
pub fn write_user_refusal(load_error: &str, sys_admin: Option<bool>) -> String {
    // The verifier's verdict, not its trace of the instruction (`5: (85) call ...`).
    let mut lines = load_error
        .lines()
        .map(str::trim)
        // Lines starting with `;` are the verifier's quotes of the source, not its verdict.
        .filter(|l| l.contains("bpf_probe_write_user") && !l.starts_with(';'));
    let first = lines.clone().next();
    let line = lines.find(|l| !l.contains(") call ")).or(first);
    let cause = match (sys_admin, active_lockdown()) {
        (Some(false), _) => "gpud lacks CAP_SYS_ADMIN".to_owned(),
        (_, Some(mode)) => format!("kernel lockdown: {mode}"),
        (Some(true), None) => "kernel lockdown".to_owned(),
        (None, None) => "kernel lockdown, or no CAP_SYS_ADMIN".to_owned(),
    };
    match line {
        Some(l) => format!("the kernel refuses bpf_probe_write_user ({cause}): {l}"),
        None => format!(
            "its return-side program did not load: {}",
            load_refusal(load_error)
        ),
    }
}

/// The verifier's verdict in a refused load's text: its last line that is neither statistics
/// nor the trace of an instruction (`12: (85) call …`); empty if there is none.
pub fn verifier_verdict(text: &str) -> &str {
    let is_trace = |l: &str| {
        l.split_once(':')
            .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
    };
    text.lines()
        .map(str::trim)
        .rfind(|l| {
            !l.is_empty()
                && !l.starts_with("processed ")
                && !l.starts_with("verification time")
                && !l.starts_with("stack depth")
                && !is_trace(l)
                && !l.starts_with(';')
        })
        .unwrap_or_default()
}

/// A refused load in one line: the error (with its errno) and, where the verifier said more,
/// its verdict.
pub fn load_refusal(load_error: &str) -> String {
    // aya puts the verifier's log after "Verifier output:" on the error's own line; an empty log
    // leaves only the errno repeated there.
    let first = load_error.lines().next().unwrap_or_default();
    let (head, log_start) = match first.split_once(". Verifier output:") {
        Some((head, rest)) => (head, rest),
        None => (first, ""),
    };
    let rest: Vec<&str> = std::iter::once(log_start)
        .chain(load_error.lines().skip(1))
        .collect();
    let log = rest.join("\n");
    let verdict = verifier_verdict(&log).trim_start_matches(':').trim();
    if verdict.is_empty() || head.contains(verdict) {
        head.to_owned()
    } else {
        format!("{head} … {verdict}")
    }
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

/// A PCI function's address without the function number (NVIDIA names its dmem region after
/// function 0, whatever the function): domain, bus, device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
}

impl PciAddr {
    /// `0000:03:00.0` (sysfs), `00000000:03:00.0` (NVML), `0000:03:00` (no function), any case.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
        let bus = u8::from_str_radix(parts.next()?, 16).ok()?;
        let rest = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let device = rest.split('.').next()?;
        let device = u8::from_str_radix(device, 16).ok()?;
        Some(Self {
            domain,
            bus,
            device,
        })
    }
}

/// A `dmem` region of an NVIDIA GPU, as `dmem.capacity` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DmemRegion {
    /// The region's name in the dmem files (`nvidia/00000000:03:00.0/vidmem`).
    pub name: String,
    pub pci: PciAddr,
    /// Bytes.
    pub capacity: u64,
}

/// The `dmem` regions of NVIDIA GPUs and their capacities, from the root's `dmem.capacity`.
/// NVIDIA's open module (615: `nvidia/%08X:%02X:%02X.0/vidmem`; 610:
/// `nvidia/%04x:%02x:%02x/vidmem`) names its regions after the GPU's PCI address; a DRM driver's
/// (`drm/0000:03:00.0/vram0`) counts where the PCI function's vendor is NVIDIA. `None` when the
/// controller is absent.
pub fn dmem_nvidia_regions(cgroup2_root: &Path, pci_devices: &Path) -> Option<Vec<DmemRegion>> {
    let text = std::fs::read_to_string(cgroup2_root.join("dmem.capacity")).ok()?;
    let nvidia_function = |bdf: &str| {
        std::fs::read_to_string(pci_devices.join(bdf).join("vendor"))
            .is_ok_and(|v| v.trim() == NVIDIA_PCI_VENDOR)
    };
    Some(
        text.lines()
            .filter_map(|l| {
                let (name, size) = l.split_once(char::is_whitespace)?;
                let capacity = size.trim().parse().ok()?;
                let (driver, rest) = name.split_once('/')?;
                let addr = rest.split('/').next()?;
                let ours = match driver {
                    "nvidia" => true,
                    "drm" => nvidia_function(addr),
                    _ => false,
                };
                ours.then_some(())?;
                Some(DmemRegion {
                    name: name.to_owned(),
                    pci: PciAddr::parse(addr)?,
                    capacity,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lockdown_mode_is_the_bracketed_one() {
        assert_eq!(
            lockdown_of("none [integrity] confidentiality\n").as_deref(),
            Some("integrity")
        );
        assert_eq!(lockdown_of("[none] integrity confidentiality\n"), None);
        assert_eq!(lockdown_of(""), None);
    }

    #[test]
    fn a_refusal_names_the_verifier_line() {
        let err = "cannot load eBPF program `x`: the BPF_PROG_LOAD syscall failed. Verifier output: 0: R1=ctx()\n; unsafe { bpf_probe_write_user(addr as *mut T, &cap as *const T) }.is_ok() @ meminfo.rs:88\n5: (85) call bpf_probe_write_user#36\nprogram of this type cannot use helper bpf_probe_write_user#36\nprocessed 6 insns";
        let why = write_user_refusal(err, Some(false));
        assert!(
            why.starts_with("the kernel refuses bpf_probe_write_user (gpud lacks CAP_SYS_ADMIN): "),
            "{why}"
        );
        let why = write_user_refusal(err, Some(true));
        assert!(
            why.starts_with("the kernel refuses bpf_probe_write_user (kernel lockdown"),
            "{why}"
        );
        assert!(
            why.ends_with(": program of this type cannot use helper bpf_probe_write_user#36"),
            "{why}"
        );
        let other = write_user_refusal("cannot load eBPF program `x`: out of memory", None);
        assert_eq!(
            other,
            "its return-side program did not load: cannot load eBPF program `x`: out of memory"
        );
        let verifier = write_user_refusal(
            "load failed. Verifier output: 12: (85) call x\nBPF program is too large\nprocessed 1000001 insns\n",
            Some(true),
        );
        assert_eq!(
            verifier,
            "its return-side program did not load: load failed … BPF program is too large"
        );
    }

    #[test]
    fn a_verdict_skips_traces_and_statistics() {
        let log = "func#0 @0\n0: R1=ctx() R10=fp0\n0: (b7) r0 = 0\n\
            can't modify return codes of BPF programs\n\
            processed 1 insns (limit 1000000) max_states_per_insn 0\n";
        assert_eq!(
            verifier_verdict(log),
            "can't modify return codes of BPF programs"
        );
        assert_eq!(verifier_verdict(""), "");
        assert_eq!(
            load_refusal(&format!(
                "cannot load `p`: Invalid argument (os error 22)\n{log}"
            )),
            "cannot load `p`: Invalid argument (os error 22) … can't modify return codes of BPF programs"
        );
    }

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
        // NVIDIA's open module names (615 and 610), a DRM driver's on an NVIDIA function, others.
        std::fs::write(
            cg.join("dmem.capacity"),
            "drm/0000:04:00.0/vram0 8589934592\n\
             nvidia/00000000:A1:00.0/vidmem 85899345920\n\
             nvidia/0001:02:03/vidmem 1024\n\
             drm/0000:03:00.0/vram0 17179869184\n\
             garbage\n",
        )?;
        let at = |domain, bus, device| PciAddr {
            domain,
            bus,
            device,
        };
        assert_eq!(
            dmem_nvidia_regions(&cg, &pci),
            Some(vec![
                DmemRegion {
                    name: "nvidia/00000000:A1:00.0/vidmem".to_owned(),
                    pci: at(0, 0xa1, 0),
                    capacity: 85_899_345_920
                },
                DmemRegion {
                    name: "nvidia/0001:02:03/vidmem".to_owned(),
                    pci: at(1, 2, 3),
                    capacity: 1024
                },
                DmemRegion {
                    name: "drm/0000:03:00.0/vram0".to_owned(),
                    pci: at(0, 3, 0),
                    capacity: 17_179_869_184
                },
            ])
        );
        assert_eq!(PciAddr::parse("00000000:A1:00.0"), Some(at(0, 0xa1, 0)));
        assert_eq!(PciAddr::parse("0000:a1:00"), Some(at(0, 0xa1, 0)));
        assert_eq!(PciAddr::parse("a1:00.0"), None);
        std::fs::remove_dir_all(&dir)
    }
}
