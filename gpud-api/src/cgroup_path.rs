//! Cgroup paths as the API takes them: relative to the cgroup v2 root, in the normal form
//! `/a/b` ("/", "/a/b/" and "a//b" are accepted and normalized), and nothing that could leave the
//! hierarchy. The daemon checks every path argument with it; clients normalize with it before
//! they ask. Also where the hierarchy is mounted, from a mountinfo text.

use std::path::{Component, Path, PathBuf};

/// Why a cgroup path is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid cgroup path {path:?}: {reason}")]
pub struct InvalidCgroupPath {
    /// The path given (its first 256 characters).
    pub path: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// `path` in the normal form `/a/b`, or why it is refused: empty, over 4096 bytes, a NUL byte,
/// or a `.` or `..` component.
pub fn normalize(path: &str) -> Result<String, InvalidCgroupPath> {
    let invalid = |reason| InvalidCgroupPath {
        path: path.chars().take(256).collect(),
        reason,
    };
    if path.is_empty() {
        return Err(invalid("empty"));
    }
    if path.len() > 4096 {
        return Err(invalid("longer than 4096 bytes"));
    }
    if path.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    let mut parts = Vec::new();
    for c in Path::new(path).components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => parts.push(n.to_string_lossy().into_owned()),
            Component::CurDir | Component::ParentDir | Component::Prefix(_) => {
                return Err(invalid("`.` and `..` are not allowed"));
            }
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// Finds the cgroup2 mount point in a mountinfo text (fields per proc(5): the root of the mount
/// is the 4th field, the mount point the 5th; the filesystem type follows the " - "
/// separator). Where there are several (a pod with the host's `/` and its cgroup tree both
/// mounted), the hierarchy's root at its usual place (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid host) wins, then any mount of the hierarchy's root,
/// then the first.
pub fn cgroup2_mount_from(mountinfo: &str) -> Option<PathBuf> {
    let mounts: Vec<(&str, PathBuf)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            if post.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let mut fields = pre.split_whitespace();
            let root = fields.nth(3)?;
            let mount_point = fields.next()?;
            Some((root, PathBuf::from(unescape_mountinfo(mount_point))))
        })
        .collect();
    let usual =
        |p: &Path| p == Path::new("/sys/fs/cgroup") || p == Path::new("/sys/fs/cgroup/unified");
    mounts
        .iter()
        .find(|(root, p)| *root == "/" && usual(p))
        .or_else(|| mounts.iter().find(|(root, _)| *root == "/"))
        .or_else(|| mounts.first())
        .map(|(_, p)| p.clone())
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        // Octal digits are ASCII: checking bytes (not slicing `s`) cannot split a character.
        if b[i] == b'\\'
            && let Some(digits) = b.get(i + 1..i + 4)
            && digits.iter().all(|d| (b'0'..=b'7').contains(d))
        {
            let v = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalized_and_escapes_refused() {
        assert_eq!(normalize("/").as_deref(), Ok("/"));
        assert_eq!(normalize("a//b/").as_deref(), Ok("/a/b"));
        assert_eq!(normalize("/a/b").as_deref(), Ok("/a/b"));
        for bad in ["", "/a/../b", "./a", "a/\0"] {
            assert!(normalize(bad).is_err(), "{bad:?}");
        }
        assert!(normalize(&"a".repeat(4097)).is_err());
    }

    /// gpud's pod mounts the host's `/` at /host and the host's cgroup tree at /sys/fs/cgroup:
    /// the usual place wins over the first listed, and a subtree's mount (a cgroup namespace's
    /// view) loses to the hierarchy's root.
    #[test]
    fn the_usual_mount_of_the_hierarchys_root_wins() {
        let pod = "50 40 0:38 / /host/sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                   61 60 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_from(pod),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let namespaced = "50 40 0:38 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n\
                          61 60 0:38 / /mnt/cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_from(namespaced),
            Some(PathBuf::from("/mnt/cg"))
        );
        let only_subtree = "50 40 0:38 /a /x rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount_from(only_subtree), Some(PathBuf::from("/x")));
    }
}
