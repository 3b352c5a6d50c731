//! Which Kubernetes workload each cgroup runs: the namespace, pod and container names the
//! runtime integrations report (`SetWorkload`), kept per cgroup path and persisted to
//! `<state_dir>/workloads.json` so that a restarted daemon labels its metrics as before. They are
//! labels only: no limit depends on them, so a file that cannot be read starts an empty set (the
//! integrations name each container again when they next apply its limits).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::PolicyError;

/// A workload's names by key (`gpud_api::workload::KEYS`).
pub type Names = BTreeMap<String, String>;

/// Every labelled cgroup's names by path; shared with the published views as it is (a change
/// makes a new one).
pub type ByCgroup = Arc<BTreeMap<String, Names>>;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    version: u32,
    workloads: BTreeMap<String, Names>,
}

const STATE_VERSION: u32 = 1;

/// The names of each labelled cgroup, by path relative to the cgroup v2 root.
#[derive(Debug)]
pub struct Workloads {
    path: PathBuf,
    cgroup_root: PathBuf,
    by_cgroup: ByCgroup,
}

impl Workloads {
    pub const FILE: &'static str = "workloads.json";

    /// Loads the names stored in `state_dir`; `cgroup_root` is where [`Self::forget_removed`]
    /// looks for the cgroups. A missing file is no names; an unreadable one is logged and
    /// ignored (its names come back as the integrations apply limits again).
    pub fn load(state_dir: &Path, cgroup_root: &Path) -> Self {
        let path = state_dir.join(Self::FILE);
        let by_cgroup = match std::fs::read_to_string(&path) {
            Ok(text) => match serde_json::from_str::<StateFile>(&text) {
                Ok(f) if f.version == STATE_VERSION => {
                    info!(path = %path.display(), cgroups = f.workloads.len(), "workload names restored");
                    f.workloads
                }
                Ok(f) => {
                    warn!(path = %path.display(), version = f.version, "workload names of an unknown version ignored");
                    BTreeMap::new()
                }
                Err(e) => {
                    warn!(path = %path.display(), "workload names unreadable ({e}); ignored");
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                warn!(path = %path.display(), "cannot read workload names ({e}); ignored");
                BTreeMap::new()
            }
        };
        Self {
            path,
            cgroup_root: cgroup_root.to_owned(),
            by_cgroup: Arc::new(by_cgroup),
        }
    }

    /// Sets (or, with no names, clears) the names of `cgroup` and persists them; on a write
    /// error nothing changes.
    pub fn set(&mut self, cgroup: &str, names: Names) -> Result<(), PolicyError> {
        if self.by_cgroup.get(cgroup) == Some(&names)
            || (names.is_empty() && !self.by_cgroup.contains_key(cgroup))
        {
            return Ok(());
        }
        let mut next = BTreeMap::clone(&self.by_cgroup);
        if names.is_empty() {
            next.remove(cgroup);
        } else {
            next.insert(cgroup.to_owned(), names);
        }
        self.save(next)
    }

    /// The names of `cgroup`, if any were reported.
    pub fn of(&self, cgroup: &str) -> Option<&Names> {
        self.by_cgroup.get(cgroup)
    }

    /// Every labelled cgroup's names.
    pub fn all(&self) -> ByCgroup {
        self.by_cgroup.clone()
    }

    /// Drops the names of cgroups whose directory is gone (a container removed).
    pub fn forget_removed(&mut self) -> Result<(), PolicyError> {
        let root = &self.cgroup_root;
        let live: BTreeMap<String, Names> = self
            .by_cgroup
            .iter()
            .filter(|(path, _)| root.join(path.trim_start_matches('/')).is_dir())
            .map(|(p, n)| (p.clone(), n.clone()))
            .collect();
        if live.len() == self.by_cgroup.len() {
            return Ok(());
        }
        self.save(live)
    }

    fn save(&mut self, next: BTreeMap<String, Names>) -> Result<(), PolicyError> {
        let file = StateFile {
            version: STATE_VERSION,
            workloads: next,
        };
        super::store::write_atomically(&self.path, &file)?;
        self.by_cgroup = Arc::new(file.workloads);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of its own for one test.
    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpud-workloads-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("test dir");
        d
    }

    fn names(pairs: &[(&str, &str)]) -> Names {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn names_persist_and_go_with_their_cgroup() {
        let dir = dir("persist");
        let (state, root) = (dir.join("state"), dir.join("cg"));
        std::fs::create_dir_all(root.join("kubepods/pod1/ctr")).expect("cgroup");
        let mut w = Workloads::load(&state, &root);
        let ctr = names(&[
            ("namespace", "ml"),
            ("pod", "train-0"),
            ("container", "main"),
        ]);
        w.set("/kubepods/pod1/ctr", ctr.clone()).expect("set");
        w.set("/kubepods/pod2/ctr", names(&[("pod", "gone")]))
            .expect("set");
        let again = Workloads::load(&state, &root);
        assert_eq!(again.of("/kubepods/pod1/ctr"), Some(&ctr));
        let mut again = again;
        again.forget_removed().expect("forget");
        assert_eq!(again.of("/kubepods/pod2/ctr"), None);
        assert_eq!(
            Workloads::load(&state, &root).of("/kubepods/pod2/ctr"),
            None
        );
        again
            .set("/kubepods/pod1/ctr", Names::new())
            .expect("clear");
        assert_eq!(
            Workloads::load(&state, &root).of("/kubepods/pod1/ctr"),
            None
        );
    }

    #[test]
    fn a_corrupt_file_is_no_names() {
        let dir = dir("corrupt");
        std::fs::write(dir.join(Workloads::FILE), "{not json").expect("write");
        let w = Workloads::load(&dir, &dir);
        assert_eq!(w.of("/a"), None);
    }
}
