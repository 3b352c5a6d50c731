//! The cgroup v2 hierarchy, the one home of cgroup-path knowledge in gpud: where it is mounted,
//! the mapping between cgroup ids (what the probes record, `bpf_get_current_cgroup_id()`, the
//! inode number of the cgroup's directory) and paths relative to the root, the validation of
//! paths clients send, a process's cgroup (`/proc/<pid>/cgroup`) and the freezer. Attribution,
//! NVML, enforcement and the runtime helpers all use it; it depends on nothing else in gpud.

use std::{
    collections::HashMap,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup2 filesystem in /proc/self/mountinfo")]
    NoCgroup2,
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid cgroup path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },
    #[error("no cgroup {0}")]
    NotFound(String),
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub use gpud_api::cgroup_path::cgroup2_mount_from;

/// The cgroup v2 hierarchy and a cache of id → path.
pub struct CgroupFs {
    root: PathBuf,
    root_dir: Option<std::fs::File>,
    freezer: Freezer,
    cache: HashMap<u64, String>,
    /// Ids found gone (cgroup ids are not reused): a removed cgroup's id is met by every list
    /// and sweep until its entries are forgotten, and must not cost a lookup each time.
    gone: std::collections::HashSet<u64>,
}

/// Bound on remembered removed ids (forgotten all at once when reached; they are only a cache).
const MAX_GONE: usize = 65_536;

/// What opening a cgroup by its id as a file handle said.
enum ByHandle {
    Found(String),
    /// The kernel knows no such cgroup (any more).
    Gone,
    /// Handles cannot answer here (no capability, no handle support): walk instead.
    Unavailable,
}

impl CgroupFs {
    /// Locates the hierarchy from `/proc/self/mountinfo` (never assumes `/sys/fs/cgroup`).
    pub fn discover() -> Result<Self, CgroupError> {
        let p = Path::new("/proc/self/mountinfo");
        let text = std::fs::read_to_string(p).map_err(|source| CgroupError::Read {
            path: p.to_owned(),
            source,
        })?;
        let root = cgroup2_mount_from(&text).ok_or(CgroupError::NoCgroup2)?;
        Ok(Self::at(root))
    }

    pub fn at(root: PathBuf) -> Self {
        let root_dir = std::fs::File::open(&root).ok();
        Self {
            freezer: Freezer::new(&root),
            root,
            root_dir,
            cache: HashMap::new(),
            gone: std::collections::HashSet::new(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Validates a cgroup path given by a client ("/", "/a/b" or "a/b") and returns its
    /// normal form ("/a/b"). Rejects anything that could leave the hierarchy.
    pub fn normalize(path: &str) -> Result<String, CgroupError> {
        gpud_api::cgroup_path::normalize(path).map_err(|e| CgroupError::InvalidPath {
            path: e.path,
            reason: e.reason,
        })
    }

    /// The id of the cgroup at `path` (relative to the root, already normalized).
    pub fn id_of(&mut self, path: &str) -> Result<u64, CgroupError> {
        let id = id_at(&self.root, path)?;
        self.gone.remove(&id);
        self.cache.insert(id, path.to_owned());
        Ok(id)
    }

    /// The path of cgroup `id`, or `None` if it no longer exists.
    pub fn path_of(&mut self, id: u64) -> Option<String> {
        if let Some(p) = self.cache.get(&id) {
            // A cached path is only good while the directory still has this id.
            let full = self.root.join(p.trim_start_matches('/'));
            if std::fs::metadata(&full).is_ok_and(|m| m.ino() == id) {
                return Some(p.clone());
            }
            self.cache.remove(&id);
        }
        // Walk the hierarchy only where handles cannot answer: a cgroup the kernel says is gone
        // stays gone, and walking thousands of directories for every removed id that a list
        // or sweep meets would cost more than everything else the list does.
        if self.gone.contains(&id) {
            return None;
        }
        let found = match self.path_by_handle(id) {
            ByHandle::Found(p) => Some(p),
            ByHandle::Gone => None,
            ByHandle::Unavailable => self.path_by_walk(id),
        };
        let Some(path) = found else {
            if self.gone.len() >= MAX_GONE {
                self.gone.clear();
            }
            self.gone.insert(id);
            return None;
        };
        self.cache.insert(id, path.clone());
        Some(path)
    }

    /// The paths of many cgroups at once (`None` for those gone), as [`Self::path_of`] would
    /// give them. Cached paths are checked by reading each parent directory once (a directory
    /// entry's inode number is the cgroup id) instead of one path lookup per cgroup: listing a
    /// thousand cgroups under one parent takes a few `getdents` calls, not a thousand `statx`.
    pub fn paths_of(&mut self, ids: impl IntoIterator<Item = u64>) -> HashMap<u64, Option<String>> {
        let mut out = HashMap::new();
        let mut by_parent: HashMap<String, Vec<(u64, String)>> = HashMap::new();
        let mut unchecked = Vec::new();
        for id in ids {
            match self.cache.get(&id) {
                Some(p) if p != "/" => {
                    let (parent, name) = p.rsplit_once('/').unwrap_or(("", p));
                    by_parent
                        .entry(parent.to_owned())
                        .or_default()
                        .push((id, name.to_owned()));
                }
                _ => unchecked.push(id),
            }
        }
        for (parent, children) in by_parent {
            let dir = self.root.join(parent.trim_start_matches('/'));
            let listed: HashMap<std::ffi::OsString, u64> = match std::fs::read_dir(&dir) {
                Ok(entries) => entries
                    .flatten()
                    .map(|e| (e.file_name(), std::os::unix::fs::DirEntryExt::ino(&e)))
                    .collect(),
                Err(_) => HashMap::new(),
            };
            for (id, name) in children {
                if listed.get(std::ffi::OsStr::new(&name)) == Some(&id) {
                    out.insert(id, Some(format!("{parent}/{name}")));
                } else {
                    unchecked.push(id);
                }
            }
        }
        for id in unchecked {
            let p = self.path_of(id);
            out.insert(id, p);
        }
        out
    }

    /// kernfs exports cgroup ids as file handles: open the directory by handle and read back
    /// its path. Needs CAP_DAC_READ_SEARCH.
    fn path_by_handle(&self, id: u64) -> ByHandle {
        #[repr(C)]
        struct Handle {
            header: libc::file_handle,
            id: [u8; 8],
        }
        // FILEID_KERNFS, from include/linux/exportfs.h.
        const FILEID_KERNFS: libc::c_int = 0xfe;
        let Some(mount) = self.root_dir.as_ref() else {
            return ByHandle::Unavailable;
        };
        let mut h = Handle {
            header: libc::file_handle {
                handle_bytes: 8,
                handle_type: FILEID_KERNFS,
                f_handle: [],
            },
            id: id.to_ne_bytes(),
        };
        // SAFETY: `h` is a file_handle followed by its 8 handle bytes, as handle_bytes says.
        let fd = unsafe {
            libc::open_by_handle_at(
                mount.as_raw_fd(),
                &mut h.header,
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ESTALE | libc::ENOENT) => ByHandle::Gone,
                _ => ByHandle::Unavailable,
            };
        }
        // SAFETY: fd was just returned to us and is owned by nobody else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
            return ByHandle::Unavailable;
        };
        let Ok(rel) = target.strip_prefix(&self.root) else {
            // Outside the mount (another namespace's view): let the walk decide.
            return ByHandle::Unavailable;
        };
        let rel = rel.display().to_string();
        // Removed while open: the link names it with this suffix.
        if rel.ends_with(" (deleted)") {
            return ByHandle::Gone;
        }
        ByHandle::Found(format!("/{rel}"))
    }

    /// Fallback where file handles are unavailable: walk the hierarchy comparing inode numbers.
    fn path_by_walk(&self, id: u64) -> Option<String> {
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let Ok(ft) = e.file_type() else { continue };
                if !ft.is_dir() {
                    continue;
                }
                let p = e.path();
                if e.metadata().is_ok_and(|m| m.ino() == id) {
                    let rel = p.strip_prefix(&self.root).ok()?;
                    return Some(format!("/{}", rel.display()));
                }
                stack.push(p);
            }
        }
        if std::fs::metadata(&self.root).is_ok_and(|m| m.ino() == id) {
            return Some("/".to_owned());
        }
        None
    }

    /// Cgroup v2 path of a process, from `/proc/<pid>/cgroup`; `None` if the process is gone.
    pub fn path_of_pid(pid: u32) -> Option<String> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        path_in_proc_cgroup(&text)
    }

    /// Kills every process in the cgroup at `path` and below it (`cgroup.kill`, Linux 5.14+; a
    /// root-owned file, so no capability is needed whoever the processes run as).
    pub fn kill(&self, path: &str) -> Result<(), CgroupError> {
        let file = self
            .root
            .join(path.trim_start_matches('/'))
            .join("cgroup.kill");
        std::fs::write(&file, "1").map_err(|source| CgroupError::Write { path: file, source })
    }

    /// The one writer of `cgroup.freeze` below this root, for its holders (the memory
    /// enforcement, the compute actuator) to share.
    pub fn freezer(&self) -> Freezer {
        self.freezer.clone()
    }
}

/// Who wants a cgroup frozen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// The memory limit's `freeze` action (until the limit is raised or cleared).
    Memory,
    /// The compute law's freezer (its slots within each period).
    Compute,
}

/// The one writer of `cgroup.freeze`: a cgroup is frozen while any holder wants it, so the
/// compute law thawing a slot never undoes a memory freeze (and releasing a memory freeze leaves
/// a cgroup frozen that the law froze). The holders' wishes and the write are one step under a
/// lock: the state task and the compute actuator's thread both write through it, and neither can
/// slip a write between the other's decision and its write.
#[derive(Clone, Debug)]
pub struct Freezer {
    root: PathBuf,
    wishes: std::sync::Arc<std::sync::Mutex<Wishes>>,
}

/// Which cgroups each holder wants frozen.
#[derive(Debug, Default)]
struct Wishes {
    memory: std::collections::BTreeSet<String>,
    compute: std::collections::BTreeSet<String>,
}

impl Freezer {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            wishes: Default::default(),
        }
    }

    /// `holder` wants the cgroup at `path` frozen, or no longer; writes what all holders want.
    pub fn set(&self, holder: Holder, path: &str, frozen: bool) -> Result<(), CgroupError> {
        // A panic elsewhere while holding the lock leaves plain sets: still usable.
        let mut guard = self.wishes.lock().unwrap_or_else(|e| e.into_inner());
        let wishes = &mut *guard;
        let (mine, other) = match holder {
            Holder::Memory => (&mut wishes.memory, &wishes.compute),
            Holder::Compute => (&mut wishes.compute, &wishes.memory),
        };
        if frozen {
            mine.insert(path.to_owned());
        } else {
            mine.remove(path);
        }
        let want = frozen || other.contains(path);
        freeze_at(&self.root, path, want)
    }

    /// Whether `holder` wants the cgroup at `path` frozen.
    pub fn holds(&self, holder: Holder, path: &str) -> bool {
        self.held_by(holder).contains(path)
    }

    /// Every cgroup `holder` wants frozen: the one record of who froze what.
    pub fn held_by(&self, holder: Holder) -> std::collections::BTreeSet<String> {
        let wishes = self.wishes.lock().unwrap_or_else(|e| e.into_inner());
        match holder {
            Holder::Memory => wishes.memory.clone(),
            Holder::Compute => wishes.compute.clone(),
        }
    }

    /// `holder` no longer wants the cgroup at `path` frozen because it is gone: forgotten,
    /// nothing written (a new cgroup at that path starts thawed).
    pub fn forget(&self, holder: Holder, path: &str) {
        let mut wishes = self.wishes.lock().unwrap_or_else(|e| e.into_inner());
        match holder {
            Holder::Memory => wishes.memory.remove(path),
            Holder::Compute => wishes.compute.remove(path),
        };
    }
}

/// The id of the cgroup at `path` (normalized, relative to `root`): its directory's inode.
/// Reads nothing but the directory's metadata, so any task may ask.
pub fn id_at(root: &Path, path: &str) -> Result<u64, CgroupError> {
    let full = root.join(path.trim_start_matches('/'));
    let meta = std::fs::metadata(&full).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CgroupError::NotFound(path.to_owned()),
        _ => CgroupError::Read {
            path: full.clone(),
            source: e,
        },
    })?;
    if !meta.is_dir() {
        return Err(CgroupError::NotFound(path.to_owned()));
    }
    Ok(meta.ino())
}

/// The cgroup v2 path in the text of a `/proc/<pid>/cgroup` file: its `0::` line (hybrid
/// hierarchies list v1 controllers first), without the ` (deleted)` the kernel appends for a
/// removed cgroup.
pub fn path_in_proc_cgroup(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end_matches(" (deleted)").to_owned())
}

/// Freezes or thaws the cgroup at `path` below the hierarchy mounted at `root`: the write the
/// [`Freezer`] makes, and nothing else.
fn freeze_at(root: &Path, path: &str, frozen: bool) -> Result<(), CgroupError> {
    let file = root
        .join(path.trim_start_matches('/'))
        .join("cgroup.freeze");
    std::fs::write(&file, if frozen { "1" } else { "0" })
        .map_err(|source| CgroupError::Write { path: file, source })
}

#[cfg(test)]
mod tests {

    /// A cgroup is frozen while any holder wants it; each holder's release writes what the
    /// other still wants (a directory stands in for the cgroup: the file takes each write).
    #[test]
    fn the_freezer_keeps_a_cgroup_frozen_while_any_holder_wants_it() -> std::io::Result<()> {
        let root = std::env::temp_dir().join(format!("gpud-freezer-{}", std::process::id()));
        std::fs::create_dir_all(root.join("t"))?;
        let f = Freezer::new(&root);
        let g = f.clone();
        let read = || std::fs::read_to_string(root.join("t/cgroup.freeze"));
        let set = |f: &Freezer, h, on| f.set(h, "/t", on).map_err(std::io::Error::other);
        set(&f, Holder::Compute, true)?;
        assert_eq!(read()?, "1");
        set(&g, Holder::Memory, true)?;
        // The law's thaw of its slot leaves the memory freeze.
        set(&f, Holder::Compute, false)?;
        assert_eq!(read()?, "1");
        set(&f, Holder::Compute, true)?;
        // The memory release leaves the law's slot.
        set(&g, Holder::Memory, false)?;
        assert_eq!(read()?, "1");
        set(&f, Holder::Compute, false)?;
        assert_eq!(read()?, "0");
        std::fs::remove_dir_all(&root)
    }

    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_mountinfo() {
        let mi = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                  32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                  41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_from(mi),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let pure =
            "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            cgroup2_mount_from(pure),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        let esc = "1 2 0:3 / /mnt/my\\040cg rw - cgroup2 none rw\n";
        assert_eq!(cgroup2_mount_from(esc), Some(PathBuf::from("/mnt/my cg")));
        assert_eq!(
            cgroup2_mount_from("1 2 0:3 / /x rw - ext4 /dev/a rw\n"),
            None
        );
    }

    /// Real cgroups (needs root and cgroup v2, as all of gpud's tests; v2 refuses renames): a
    /// path is found by id, and a removed cgroup reads as gone, every time.
    #[test]
    fn paths_by_id_and_removals() -> Result<(), Box<dyn std::error::Error>> {
        let mut fs = CgroupFs::discover()?;
        let name = format!("gpud-unit-cgroupfs-{}", std::process::id());
        let dir = fs.root().join(&name);
        std::fs::create_dir(&dir)?;
        let id = std::fs::metadata(&dir)?.ino();
        // Fresh state: nothing cached, the lookup by handle (or the walk) finds it.
        let mut fresh = CgroupFs::at(fs.root().to_owned());
        assert_eq!(fresh.path_of(id), Some(format!("/{name}")));
        let root_id = std::fs::metadata(fs.root())?.ino();
        let never = u64::MAX - 1;
        let many = fresh.paths_of([id, root_id, never]);
        assert_eq!(
            many[&id],
            Some(format!("/{name}")),
            "checked by its parent's listing"
        );
        assert_eq!(many[&root_id], Some("/".to_owned()));
        assert_eq!(many[&never], None);
        std::fs::remove_dir(&dir)?;
        assert_eq!(
            fresh.paths_of([id])[&id],
            None,
            "its parent no longer lists it"
        );
        assert_eq!(fresh.path_of(id), None);
        assert_eq!(fresh.path_of(id), None, "still gone");
        assert_eq!(fs.path_of(id), None);
        Ok(())
    }

    #[test]
    fn cgroup_v2_line_is_found_among_v1_lines() {
        let hybrid = "12:cpu,cpuacct:/x\n1:name=systemd:/user.slice\n0::/kubepods/pod1/ctr\n";
        assert_eq!(
            path_in_proc_cgroup(hybrid).as_deref(),
            Some("/kubepods/pod1/ctr")
        );
        assert_eq!(path_in_proc_cgroup("0::/\n").as_deref(), Some("/"));
        assert_eq!(
            path_in_proc_cgroup("0::/gone (deleted)\n").as_deref(),
            Some("/gone")
        );
        assert_eq!(path_in_proc_cgroup("3:memory:/a\n"), None);
        assert_eq!(path_in_proc_cgroup(""), None);
    }

    #[test]
    fn normalize_rejects_escapes() -> Result<(), CgroupError> {
        assert_eq!(CgroupFs::normalize("/")?, "/");
        assert_eq!(CgroupFs::normalize("a/b")?, "/a/b");
        assert_eq!(CgroupFs::normalize("//a///b/")?, "/a/b");
        for bad in ["", "/a/../b", "..", "a\0b"] {
            assert!(CgroupFs::normalize(bad).is_err(), "{bad:?}");
        }
        assert!(CgroupFs::normalize(&"a".repeat(5000)).is_err());
        Ok(())
    }

    proptest::proptest! {
        /// Whatever a D-Bus caller sends, a normalized path stays inside the hierarchy.
        #[test]
        fn normalized_paths_never_escape(path in "(?s).{0,64}") {
            if let Ok(n) = CgroupFs::normalize(&path) {
                proptest::prop_assert!(n.starts_with('/'));
                proptest::prop_assert!(!n.split('/').any(|c| c == ".." || c == "."));
                proptest::prop_assert!(!n.contains('\0') && !n.contains("//"));
            }
        }
    }
}

/// Fuzz targets (`cargo xtask fuzz`): mountinfo text of any content.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any text (mount points with multi-byte characters after a backslash included) yields
        /// a mount point or none; nothing panics.
        #[test]
        fn any_mountinfo_never_panics(text in "(?s)(.|\\\\[0-7]{0,3}){0,200}") {
            let _ = cgroup2_mount_from(&text);
        }

        /// A mount point escaped as the kernel escapes it (`\ooo` for space, tab, newline and
        /// backslash) reads back as written.
        #[test]
        fn escaped_mount_points_round_trip(dir in "/([^\\s\\x00]|[ \\t\\n\\\\]){0,40}") {
            let escaped: String = dir
                .chars()
                .map(|c| match c {
                    ' ' | '\t' | '\n' | '\\' => format!("\\{:03o}", c as u32),
                    c => c.to_string(),
                })
                .collect();
            let text = format!(
                "30 1 0:25 / /proc rw - proc proc rw\n31 1 0:26 / {escaped} rw,nosuid - cgroup2 cgroup2 rw\n"
            );
            prop_assert_eq!(cgroup2_mount_from(&text), Some(PathBuf::from(dir)));
        }
    }
}
