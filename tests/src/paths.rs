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
        // A bpffs may be mounted inside (the daemon's own instance).
        let bpffs = self.0.join("bpffs");
        if let Ok(c) = std::ffi::CString::new(bpffs.as_os_str().as_encoded_bytes()) {
            // SAFETY: valid NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
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
