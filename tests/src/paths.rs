//! Where a test's files are: scratch directories ([`TempDir`], removed on drop) and the
//! workspace's built binaries the tests start (`gpud`, `gpudctl`, the fixtures).

use std::path::{Path, PathBuf};

/// A scratch directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("gpud-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        remove_state_dir(&self.0);
    }
}

/// Removes a directory a test's daemon kept its state in. The bpffs instances mounted inside
/// (the daemon's own, `<dir>/bpffs`, or one per hook a test tried) are unmounted first, which
/// drops their pins: probes a failed test left pinned there do not stay attached to the host.
pub fn remove_state_dir(dir: &Path) {
    unmount_under(dir, Some("bpf"));
    let _ = std::fs::remove_dir_all(dir);
}

/// Detaches the mounts under `dir` (of type `fstype` only, where named), innermost first.
pub fn unmount_under(dir: &Path, fstype: Option<&str>) {
    let mut points: Vec<PathBuf> = mounts()
        .into_iter()
        .filter(|(point, kind)| point.starts_with(dir) && fstype.is_none_or(|t| t == kind))
        .map(|(point, _)| point)
        .collect();
    points.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    for m in points {
        if let Ok(c) = std::ffi::CString::new(m.as_os_str().as_encoded_bytes()) {
            // SAFETY: valid NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// Where filesystems of type `fstype` are mounted.
pub fn mount_points(fstype: &str) -> Vec<PathBuf> {
    mounts()
        .into_iter()
        .filter(|(_, kind)| kind == fstype)
        .map(|(point, _)| point)
        .collect()
}

/// Every mount of this process's namespace, from `/proc/self/mountinfo`: mount point and type.
fn mounts() -> Vec<(PathBuf, String)> {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mi.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let point = pre.split_whitespace().nth(4)?;
            let kind = post.split_whitespace().next()?;
            Some((PathBuf::from(point), kind.to_owned()))
        })
        .collect()
}

/// Directory of the workspace's built binaries (`target/debug`): beside this executable when it
/// is one of them, else (a test, in `target/debug/deps`) one level up.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("target dir");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target dir").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

pub fn gpud_bin() -> PathBuf {
    std::env::var_os("GPUD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("gpud"))
}

pub fn gpudctl_bin() -> PathBuf {
    std::env::var_os("GPUDCTL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("gpudctl"))
}
