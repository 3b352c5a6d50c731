//! cgroup v2 children for tests ([`Cgroup`], removed on drop) and the processes in them:
//! spawning into a cgroup, reading a process's state.

use std::{
    path::PathBuf,
    process::{Child, Command},
    time::Duration,
};

/// The cgroup v2 mount point, from mountinfo (hybrid hosts have it at /sys/fs/cgroup/unified).
pub fn cgroup2_root() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    gpud::cgroupfs::cgroup2_mount_from(&mi).expect("a cgroup2 mount")
}

/// A process's state letter from `/proc/<pid>/stat` (`T`: stopped, `R`: running); `?` when gone.
pub fn process_state(pid: u32) -> char {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()?
                .split_whitespace()
                .next()?
                .chars()
                .next()
        })
        .unwrap_or('?')
}

/// A process running `script` under sh inside `cg`, returned once it is in the cgroup.
pub fn spawn_in_cgroup(cg: &Cgroup, script: &str) -> Child {
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec sh -c '{script}'",
            cg.dir.display()
        ))
        .spawn()
        .expect("spawn");
    for _ in 0..200 {
        let procs = std::fs::read_to_string(cg.dir.join("cgroup.procs")).unwrap_or_default();
        if procs.lines().any(|l| l.trim() == child.id().to_string()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child
}

/// A child cgroup, removed (after killing its processes) on drop.
pub struct Cgroup {
    pub dir: PathBuf,
    /// Path relative to the cgroup v2 root, as gpud reports it.
    pub rel: String,
}

impl Cgroup {
    pub fn new(name: &str) -> Self {
        let rel = format!("/gpud-test-{}-{name}", std::process::id());
        let dir = cgroup2_root().join(rel.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).expect("create cgroup");
        Self { dir, rel }
    }

    /// A child cgroup `name`. Declared after its parent, it is removed before it (a cgroup with
    /// children cannot be removed).
    pub fn child(&self, name: &str) -> Self {
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).expect("create child cgroup");
        Self {
            dir,
            rel: format!("{}/{name}", self.rel),
        }
    }

    /// The cgroup's id as gpud reports it: its directory's inode number.
    pub fn id(&self) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(&self.dir).expect("stat cgroup").ino()
    }

    /// Whether `cgroup.events` says the cgroup is frozen.
    pub fn frozen(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events"))
            .is_ok_and(|t| t.lines().any(|l| l == "frozen 1"))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if !self.dir.exists() {
            // The test removed it itself.
            return;
        }
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
