//! The capabilities gpud runs with, checked at start-up so that a unit or container that drops
//! one it needs fails with the capability's name rather than a bare `EPERM` from `bpf(2)`.
//!
//! Needed (docs/operations.md, measured by tests/tests/unit.rs): `CAP_BPF` (maps, programs) and
//! `CAP_PERFMON` (tracing programs, tracepoint attach), or `CAP_SYS_ADMIN` in their stead (it
//! covers both, and is the only way before Linux 5.8). Wanted: `CAP_SYS_PTRACE` and
//! `CAP_DAC_READ_SEARCH`, without which the `/proc` scan misses processes that hold more
//! capabilities than gpud or belong to other users, and `CAP_SYS_ADMIN` for the in-container
//! memory view (the kernel allows `bpf_probe_write_user` only with it).

const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("cannot read the process's capabilities from /proc/self/status")]
    Read(#[from] std::io::Error),
    #[error(
        "missing {missing}: gpud needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN) to load and \
         attach its eBPF programs (effective set {effective:#x})"
    )]
    Missing { missing: String, effective: u64 },
}

/// The effective capability set (`CapEff` of `/proc/self/status`).
pub fn effective() -> Result<u64, PrivilegeError> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    cap_eff(&status).ok_or_else(|| {
        PrivilegeError::Read(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no CapEff line",
        ))
    })
}

fn cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

fn has(set: u64, cap: u32) -> bool {
    set & (1 << cap) != 0
}

/// Whether the effective set holds `CAP_SYS_ADMIN`, which the kernel requires of a program
/// that calls `bpf_probe_write_user` (the in-container memory view); `None` when unreadable.
pub fn sys_admin() -> Option<bool> {
    effective().ok().map(|set| has(set, CAP_SYS_ADMIN))
}

/// Fails without the capabilities BPF needs; returns warnings for the ones the `/proc` scan
/// wants.
pub fn check(set: u64) -> Result<Vec<&'static str>, PrivilegeError> {
    if !has(set, CAP_SYS_ADMIN) {
        let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
            .into_iter()
            .filter(|(c, _)| !has(set, *c))
            .map(|(_, n)| n)
            .collect();
        if !missing.is_empty() {
            return Err(PrivilegeError::Missing {
                missing: missing.join(" and "),
                effective: set,
            });
        }
    }
    let mut warnings = Vec::new();
    if !has(set, CAP_SYS_PTRACE) {
        warnings.push(
            "no CAP_SYS_PTRACE: the /proc scan cannot read the files of processes holding \
             capabilities gpud lacks",
        );
    }
    if !has(set, CAP_DAC_READ_SEARCH) {
        warnings.push("no CAP_DAC_READ_SEARCH: the /proc scan cannot read other users' processes");
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT_SET: u64 =
        (1 << CAP_BPF) | (1 << CAP_PERFMON) | (1 << CAP_SYS_PTRACE) | (1 << CAP_DAC_READ_SEARCH);

    #[test]
    fn required_and_wanted() {
        assert_eq!(check(UNIT_SET).expect("enough").len(), 0);
        assert_eq!(
            check(1 << CAP_SYS_ADMIN).expect("admin covers BPF").len(),
            2
        );
        let err = check(UNIT_SET & !(1 << CAP_BPF)).unwrap_err().to_string();
        assert!(err.starts_with("missing CAP_BPF:"), "{err}");
        let err = check(0).unwrap_err().to_string();
        assert!(err.contains("missing CAP_BPF and CAP_PERFMON"), "{err}");
    }

    #[test]
    fn reads_cap_eff() {
        let status = "Name:\tgpud\nCapInh:\t0000000000000000\nCapEff:\t000000c000080004\n";
        assert_eq!(cap_eff(status), Some(UNIT_SET));
        assert!(effective().is_ok());
    }
}
