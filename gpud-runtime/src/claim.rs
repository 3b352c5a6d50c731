//! A claim shared by several pods is one limit. The scheduler reserves a DRA claim once, however
//! many pods reference it, while each of their cgroups carries the claim ([`crate::pod`]): N
//! pods could hold N times its memory. So the claim also gets a cgroup of its own, made beside
//! its first user's pod (`gpud-claim-<claim>`, holding no process), whose `memory_max` is the
//! claim's; every container using the claim has its GPU memory charged to that cgroup too
//! (gpud's `ShareCharges`, asked before the container runs), so the claim's limit holds over all
//! of its users together. The claim's compute stays per pod: a cgroup without processes is no
//! unit the compute law can run.
//!
//! The ledger is a file per claim under the record directory, updated under an exclusive lock by
//! every hook run: the claim's cgroup and the containers using it. The cgroup is removed with
//! its last user, and gpud drops its limits when it goes.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use gpud_api::limits::LimitKind;
use serde::{Deserialize, Serialize};

use crate::{
    RuntimeError,
    annotations::Shares,
    pod::{escaped, locked_update, record_file},
};

/// What the ledger holds for one claim.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimRecord {
    /// The claim's cgroup, relative to the cgroup v2 root.
    group: String,
    /// The containers using it.
    users: BTreeSet<String>,
}

/// The claim ledgers under one directory.
#[derive(Clone, Debug)]
pub struct Claims {
    dir: PathBuf,
}

/// The cgroup made for `claim` beside the pod cgroup `pod`.
fn group_beside(pod: &str, claim: &str) -> String {
    let parent = pod
        .trim_end_matches('/')
        .rsplit_once('/')
        .map_or("", |(p, _)| p);
    format!("{parent}/gpud-claim-{}", escaped(claim, '_'))
}

impl Claims {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// `container`, of the pod whose cgroup is `pod`, uses `claim`: the claim's cgroup, made
    /// (under the cgroup v2 mount `root`) beside `pod` where the claim has none yet.
    pub fn join(
        &self,
        root: &Path,
        claim: &str,
        pod: &str,
        container: &str,
    ) -> Result<String, RuntimeError> {
        let path = record_file(&self.dir, claim);
        let fresh = || ClaimRecord {
            group: group_beside(pod, claim),
            users: BTreeSet::new(),
        };
        locked_update(&path, fresh, |r: &mut ClaimRecord| {
            let dir = root.join(r.group.trim_start_matches('/'));
            match std::fs::create_dir(&dir) {
                Ok(()) => {
                    tracing::info!(claim, group = %r.group, "made the claim's cgroup");
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(source) => return Err(RuntimeError::Io { path: dir, source }),
            }
            r.users.insert(container.to_owned());
            Ok((true, r.group.clone()))
        })
    }

    /// `container` stopped: it no longer uses `claim`, and the claim's cgroup is removed (under
    /// `root`) with its last user.
    pub fn leave(&self, root: &Path, claim: &str, container: &str) -> Result<(), RuntimeError> {
        let path = record_file(&self.dir, claim);
        if !path.exists() {
            return Ok(());
        }
        locked_update(&path, ClaimRecord::default, |r: &mut ClaimRecord| {
            r.users.remove(container);
            if !r.users.is_empty() || r.group.is_empty() {
                return Ok((!r.users.is_empty(), ()));
            }
            let dir = root.join(r.group.trim_start_matches('/'));
            match std::fs::remove_dir(&dir) {
                Ok(()) => tracing::info!(claim, group = %r.group, "removed the claim's cgroup"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Still holding something (a process moved into it by hand): left for the
                // operator, named in the log; gpud keeps its limits while it exists.
                Err(e) => {
                    tracing::warn!(claim, group = %r.group, "cannot remove the claim's cgroup: {e}")
                }
            }
            Ok((false, ()))
        })
    }
}

/// The part of a claim's grant its own cgroup carries: its memory (compute needs processes).
pub fn memory_of(grant: &Shares) -> Shares {
    let mut out = Shares::default();
    for (gpu, limits) in &grant.gpus {
        let memory: std::collections::BTreeMap<_, _> = limits
            .iter()
            .filter(|(k, _)| **k == LimitKind::MemoryMax)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        if !memory.is_empty() {
            out.gpus.insert(gpu.clone(), memory);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpud-claims-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn the_claims_cgroup_is_made_beside_the_first_pod_and_goes_with_the_last_user() {
        let (root, records) = (temp("root"), temp("records"));
        std::fs::create_dir_all(root.join("kubepods/pod1")).expect("pods");
        let claims = Claims::new(&records);
        let g1 = claims
            .join(&root, "uid/x", "/kubepods/pod1", "a")
            .expect("join a");
        assert_eq!(g1, "/kubepods/gpud-claim-uid_2Fx");
        assert!(root.join("kubepods/gpud-claim-uid_2Fx").is_dir());
        // A second pod elsewhere finds the same cgroup.
        let g2 = claims
            .join(&root, "uid/x", "/other/pod2", "b")
            .expect("join b");
        assert_eq!(g1, g2);
        claims.leave(&root, "uid/x", "a").expect("leave a");
        assert!(
            root.join("kubepods/gpud-claim-uid_2Fx").is_dir(),
            "b uses it"
        );
        claims.leave(&root, "uid/x", "b").expect("leave b");
        assert!(!root.join("kubepods/gpud-claim-uid_2Fx").exists());
        assert_eq!(std::fs::read_dir(&records).expect("records").count(), 0);
        // Leaving again, or a claim never joined, changes nothing.
        claims.leave(&root, "uid/x", "b").expect("leave again");
    }

    #[test]
    fn only_the_memory_of_a_grant_goes_on_the_claims_cgroup() {
        use gpud_api::limits::{GpuSelector, LimitValue};
        let mut grant = Shares::default();
        grant.gpus.insert(
            GpuSelector::All,
            [
                (LimitKind::MemoryMax, LimitValue::Number(8 << 30)),
                (LimitKind::ComputeMax, LimitValue::Number(30)),
            ]
            .into(),
        );
        let m = memory_of(&grant);
        assert_eq!(
            m.gpus[&GpuSelector::All].keys().collect::<Vec<_>>(),
            vec![&LimitKind::MemoryMax]
        );
    }
}
