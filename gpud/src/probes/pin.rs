//! The pin directory: mounting bpffs, where gpud pins under it, and the hygiene that runs before
//! pins are adopted (other ABI versions, maps of a foreign layout, a resized event ring).

use std::{
    ffi::CString,
    path::{Path, PathBuf},
};

use gpud_common::{
    ABI_VERSION, Ancestry, CgroupUsage, FileKey, IoctlCounts, KernelLimit, ObjEntry, ObjKey,
    ProbeConfig, ProcEntry, UsageKey, maps,
};
use tracing::{info, warn};

use super::{ProbeError, io_err};

pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
pub const TRACEFS_MAGIC: i64 = 0x7472_6163;
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// The pin directory for this ABI under `bpffs`.
pub fn pin_base(bpffs: &Path) -> PathBuf {
    bpffs.join("gpud").join(format!("v{ABI_VERSION}"))
}

/// Mounts `fstype` at `path` unless a filesystem with `magic` is already there.
pub fn ensure_mounted(path: &Path, fstype: &str, magic: i64) -> Result<(), ProbeError> {
    let mount_err = |source| ProbeError::Mount {
        fstype: fstype.to_owned(),
        path: path.to_owned(),
        source,
    };
    let invalid = |e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let c_path =
        CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| mount_err(invalid(e)))?;
    // A directory inside an existing mount of the right type is fine (e.g. a subdirectory of
    // /sys/fs/bpf): create it first so statfs sees what contains it.
    std::fs::create_dir_all(path).map_err(io_err("create", path))?;
    // SAFETY: statfs writes into a zeroed struct we own; c_path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } == 0 && st.f_type == magic {
        return Ok(());
    }
    let c_type = CString::new(fstype).map_err(|e| mount_err(invalid(e)))?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe {
        libc::mount(
            c_type.as_ptr(),
            c_path.as_ptr(),
            c_type.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(mount_err(std::io::Error::last_os_error()));
    }
    info!(path = %path.display(), fstype, "mounted");
    Ok(())
}

/// Key and value sizes of every pinned map, as this build defines them.
pub(super) fn expected_layouts() -> [(&'static str, usize, usize); 20] {
    use std::mem::size_of;
    [
        (maps::OBJECTS, size_of::<ObjKey>(), size_of::<ObjEntry>()),
        (maps::USAGE, size_of::<u64>(), size_of::<CgroupUsage>()),
        (
            maps::LIMITS,
            size_of::<UsageKey>(),
            size_of::<KernelLimit>(),
        ),
        (maps::ANCESTRY, size_of::<u64>(), size_of::<Ancestry>()),
        (maps::CONFIG, size_of::<u32>(), size_of::<ProbeConfig>()),
        (maps::EXTRA_FILES, size_of::<FileKey>(), size_of::<u32>()),
        (maps::PROCS, size_of::<u32>(), size_of::<ProcEntry>()),
        (maps::CGROUPS, size_of::<u64>(), size_of::<IoctlCounts>()),
        (maps::STATS, size_of::<u32>(), size_of::<u64>()),
        (maps::TRACKED, size_of::<u32>(), size_of::<u64>()),
        (maps::SCHED_ALLOW, size_of::<u64>(), size_of::<u64>()),
        (maps::HELD_GROUPS, size_of::<ObjKey>(), size_of::<u32>()),
        (
            maps::GUARD_COUNTS,
            size_of::<gpud_common::GuardKey>(),
            size_of::<u64>(),
        ),
        (
            maps::GUARD_BUCKET,
            size_of::<u64>(),
            size_of::<gpud_common::GuardBucket>(),
        ),
        (maps::SHARES, size_of::<u64>(), size_of::<u64>()),
        (maps::SCHED_FILES, size_of::<u64>(), size_of::<u32>()),
        (maps::SCHED_GROUPS, size_of::<ObjKey>(), size_of::<u64>()),
        (maps::FILE_MARKS, size_of::<u64>(), size_of::<u32>()),
        (maps::LIMITS_GEN, size_of::<u32>(), size_of::<u64>()),
        (maps::EVENTS, 0, 0),
    ]
}

/// A pinned ring buffer is adopted as it is (the programs attached to it keep sending): a new
/// size applies once the pins are gone. Say so rather than silently run with the old size.
pub(super) fn warn_if_pinned_ring_differs(base_dir: &Path, want: u32) {
    if let Ok(info) = aya::maps::MapInfo::from_pin(base_dir.join(maps::EVENTS))
        && info.max_entries() != want
    {
        warn!(
            pinned_kib = info.max_entries() / 1024,
            configured_kib = want / 1024,
            "the pinned event ring keeps its size until the pins are removed (probes.events_ring_kib)"
        );
    }
}

/// `PENDING`, the hash of RM calls in flight, became per-task storage (`CALLS`, not pinned).
const RETIRED_MAPS: [&str; 1] = ["PENDING"];

/// Pinned maps whose key or value size differs from this build's (an ABI change without a
/// version bump) would be read with the wrong layout: detach and remove them all, and start from
/// empty maps, rather than count into garbage.
pub(super) fn remove_if_foreign_layout(base_dir: &Path) -> Result<(), ProbeError> {
    // Maps earlier builds of this ABI pinned and this one no longer has: nothing uses them.
    for retired in RETIRED_MAPS {
        let path = base_dir.join(retired);
        if path.exists() {
            info!(map = retired, dir = %base_dir.display(), "removing the pin of a retired map");
            std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
        }
    }
    for (name, key, value) in expected_layouts() {
        let path = base_dir.join(name);
        if !path.exists() {
            continue;
        }
        let matches = aya::maps::MapInfo::from_pin(&path).is_ok_and(|info| {
            info.key_size() as usize == key && info.value_size() as usize == value
        });
        if !matches {
            warn!(
                map = name,
                dir = %base_dir.display(),
                "pinned map has another layout than this build; removing the pins and starting from empty maps"
            );
            return std::fs::remove_dir_all(base_dir).map_err(io_err("remove", base_dir));
        }
    }
    Ok(())
}
