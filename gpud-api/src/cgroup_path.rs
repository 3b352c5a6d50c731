//! Cgroup paths as the API takes them: relative to the cgroup v2 root, in the normal form
//! `/a/b` ("/", "/a/b/" and "a//b" are accepted and normalized), and nothing that could leave the
//! hierarchy. The daemon checks every path argument with it; clients normalize with it before
//! they ask.

use std::path::{Component, Path};

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
}
