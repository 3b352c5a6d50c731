//! Where a container's cgroup is, as a path relative to the cgroup v2 root (what gpud's D-Bus
//! API takes): from its process (`/proc/<pid>/cgroup`, the `0::` line, exact whatever the cgroup
//! driver) or, without a process, from the OCI `linux.cgroupsPath` in its cgroupfs
//! (`/kubepods/pod1/ctr`) or systemd (`<slice>:<prefix>:<name>`) form.
//!
//! Paths read from `/proc` are relative to the reader's cgroup namespace: the hook and the plugin
//! run in the host's, like gpud.
//!
//! The few cgroup facts the runtime side needs are kept here (the daemon's own cgroup module is
//! the daemon's): where the hierarchy is mounted, a process's cgroup, and the normal form of a
//! path as gpud's D-Bus API takes it.

use std::path::PathBuf;

use gpud_api::cgroup_path::cgroup2_mount_from;

use super::RuntimeError;

/// The cgroup of process `pid`. Refuses the root cgroup: a limit there would apply to the whole
/// machine, and a container is never meant to run in it.
pub fn of_pid(pid: u32) -> Result<String, RuntimeError> {
    if pid == 0 {
        return Err(RuntimeError::Cgroup("no container process (pid 0)".into()));
    }
    let raw = path_of_pid(pid).ok_or_else(|| {
        RuntimeError::Cgroup(format!(
            "cannot read the cgroup v2 path of pid {pid} from /proc/{pid}/cgroup (process gone, \
             or no cgroup v2 hierarchy)"
        ))
    })?;
    container_cgroup(&raw, &format!("pid {pid}"))
}

/// The cgroup named by an OCI `linux.cgroupsPath`: `<slice>:<prefix>:<name>` (the systemd cgroup
/// driver, as runc and crun resolve it) or an absolute path below the cgroup v2 root (cgroupfs).
pub fn of_cgroups_path(cgroups_path: &str) -> Result<String, RuntimeError> {
    let what = format!("cgroupsPath {cgroups_path:?}");
    let parts: Vec<&str> = cgroups_path.split(':').collect();
    match parts.as_slice() {
        [slice, prefix, name] => {
            let slice = if slice.is_empty() {
                "system.slice"
            } else {
                slice
            };
            let parent =
                expand_slice(slice).map_err(|r| RuntimeError::Cgroup(format!("{what}: {r}")))?;
            if name.is_empty() || name.contains('/') {
                return Err(RuntimeError::Cgroup(format!("{what}: invalid unit name")));
            }
            // As runc names the unit: a scope unless a slice is asked for.
            let unit = if name.ends_with(".slice") {
                (*name).to_owned()
            } else {
                format!("{prefix}-{name}.scope")
            };
            container_cgroup(&format!("{parent}/{unit}"), &what)
        }
        [path] if path.starts_with('/') => container_cgroup(path, &what),
        [_] => Err(RuntimeError::Cgroup(format!(
            "{what}: a relative path depends on the runtime's own cgroup; need the container's pid"
        ))),
        _ => Err(RuntimeError::Cgroup(format!(
            "{what}: neither a path nor <slice>:<prefix>:<name>"
        ))),
    }
}

/// systemd's slice naming: `a-b-c.slice` is `/a.slice/a-b.slice/a-b-c.slice`; `-.slice` is the
/// root.
pub fn expand_slice(slice: &str) -> Result<String, String> {
    let Some(stem) = slice.strip_suffix(".slice") else {
        return Err(format!("slice {slice:?} does not end in .slice"));
    };
    if slice.contains('/') {
        return Err(format!("slice {slice:?} contains a /"));
    }
    if stem == "-" {
        return Ok(String::new());
    }
    if stem.is_empty() || stem.starts_with('-') || stem.ends_with('-') || stem.contains("--") {
        return Err(format!("invalid slice name {slice:?}"));
    }
    let mut path = String::new();
    let mut prefix = String::new();
    for part in stem.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        path.push('/');
        path.push_str(&prefix);
        path.push_str(".slice");
    }
    Ok(path)
}

/// Normalizes and refuses the root.
fn container_cgroup(raw: &str, what: &str) -> Result<String, RuntimeError> {
    let path = normalize(raw).map_err(|e| RuntimeError::Cgroup(format!("{what}: {e}")))?;
    if path == "/" {
        return Err(RuntimeError::Cgroup(format!(
            "{what} is in the root cgroup; refusing to set limits on the whole machine"
        )));
    }
    Ok(path)
}

/// Cgroup v2 path of a process, from `/proc/<pid>/cgroup`; `None` if the process is gone.
pub fn path_of_pid(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    path_in_proc_cgroup(&text)
}

/// The cgroup v2 path in the text of a `/proc/<pid>/cgroup` file: its `0::` line (hybrid
/// hierarchies list v1 controllers first), without the ` (deleted)` the kernel appends for a
/// removed cgroup.
fn path_in_proc_cgroup(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end_matches(" (deleted)").to_owned())
}

/// A cgroup path ("/", "/a/b" or "a/b") in the normal form gpud's API takes ("/a/b"), or why it
/// is none (gpud-api's rule: anything that could leave the hierarchy is refused).
pub fn normalize(path: &str) -> Result<String, String> {
    gpud_api::cgroup_path::normalize(path).map_err(|e| e.to_string())
}

/// Where the cgroup v2 hierarchy is mounted, from `/proc/self/mountinfo` (never assumed to be
/// `/sys/fs/cgroup`); `None` without one.
pub fn root() -> Option<PathBuf> {
    cgroup2_mount_from(&std::fs::read_to_string("/proc/self/mountinfo").ok()?)
}

/// Removes the JSON records (`*.json` of type `T`) in `dir` whose cgroup (`cgroup_of`, a path
/// relative to the cgroup v2 `root`) is gone, and returns them. Best effort: what cannot be
/// read, parsed or removed is left.
pub fn remove_records_of_gone<T: serde::de::DeserializeOwned>(
    dir: &std::path::Path,
    root: &std::path::Path,
    cgroup_of: impl Fn(&T) -> &str,
) -> Vec<T> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|path| path.extension().is_some_and(|x| x == "json"))
        .filter_map(|path| {
            let record: T = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
            let gone = !root
                .join(cgroup_of(&record).trim_start_matches('/'))
                .exists();
            (gone && std::fs::remove_file(&path).is_ok()).then_some(record)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_and_cgroupfs_paths() {
        let ok = |p: &str| of_cgroups_path(p).unwrap_or_else(|e| panic!("{p}: {e}"));
        assert_eq!(
            ok("kubepods-besteffort-pod12ab.slice:cri-containerd:0123abcd"),
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12ab.slice/cri-containerd-0123abcd.scope"
        );
        assert_eq!(ok("system.slice:crio:abc"), "/system.slice/crio-abc.scope");
        assert_eq!(ok(":runc:abc"), "/system.slice/runc-abc.scope");
        assert_eq!(ok("-.slice:p:abc"), "/p-abc.scope");
        assert_eq!(ok("user.slice::abc"), "/user.slice/-abc.scope");
        assert_eq!(ok("machine.slice:x:my.slice"), "/machine.slice/my.slice");
        assert_eq!(
            ok("/kubepods/burstable/pod1/ctr"),
            "/kubepods/burstable/pod1/ctr"
        );
        assert_eq!(ok("//a//b/"), "/a/b");
        for bad in [
            "",
            "relative/path",
            "/",
            "/a/../..",
            "noslice:p:n",
            "a--b.slice:p:n",
            "-a.slice:p:n",
            "a/b.slice:p:n",
            "a.slice:p:",
            "a.slice:p:x/y",
            "a:b",
            "a:b:c:d",
        ] {
            assert!(of_cgroups_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn own_process() {
        // This test's own cgroup, unless it runs in the root cgroup (then refused).
        let pid = std::process::id();
        match path_of_pid(pid).as_deref() {
            Some("/") => assert!(of_pid(pid).is_err()),
            Some(p) => assert_eq!(of_pid(pid).ok(), normalize(p).ok()),
            None => assert!(of_pid(pid).is_err()),
        }
        assert!(of_pid(0).is_err());
        assert!(of_pid(u32::MAX).is_err(), "no such process");
    }

    #[test]
    fn proc_cgroup_and_mountinfo_texts() {
        assert_eq!(
            path_in_proc_cgroup("12:cpu:/x\n0::/a/b (deleted)\n").as_deref(),
            Some("/a/b")
        );
        assert_eq!(path_in_proc_cgroup("12:cpu:/x\n"), None);
        let unified = "30 1 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let escaped = "31 1 0:27 / /my\\040cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_from(&format!("{unified}{escaped}")),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount_from(escaped), Some(PathBuf::from("/my cg")));
        assert_eq!(
            cgroup2_mount_from("1 2 0:1 / /x rw - ext4 /dev/sda rw"),
            None
        );
        assert_eq!(normalize("a//b/").as_deref(), Ok("/a/b"));
        assert!(normalize("/a/../b").is_err());
    }
}
