//! A pod's shares: what the cluster granted a pod as a whole is enforced once, on the pod's
//! cgroup. A DRA claim belongs to its pod, not to a container: however many of the pod's
//! containers use it (each runs the claim's hook), the claim's memory and compute are one limit
//! on the pod's cgroup, which also holds every other container of the pod (a sidecar handed the
//! GPU file allocates inside it). Memory is charged up the cgroup tree, and the compute
//! controller takes the deepest cgroup with a compute policy as the unit, so the containers
//! share the pod's.
//!
//! The ledger ([`Ledger`]) is a file per pod cgroup under the record directory, updated under
//! an exclusive lock by every hook run of the pod: per claim, its shares (as annotation text)
//! and the containers that use it. The pod's limits are the sum over its claims ([`total`]);
//! a claim's contribution goes when its last container stops.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{Read as _, Seek as _, Write as _},
    path::{Path, PathBuf},
};

use gpud_api::limits::{GpuSelector, LimitKind, LimitValue, MAX_BYTES};
use serde::{Deserialize, Serialize};

use crate::{
    RuntimeError,
    annotations::{self, Shares},
};

/// The cgroup of the pod a container's cgroup belongs to: its parent, when the parent is named
/// as the kubelet names pod cgroups (`pod<uid>` with the cgroupfs driver,
/// `kubepods-<class>-pod<uid>.slice` with systemd's). `None` for anything else: the claim's
/// shares then stay on the container.
pub fn pod_cgroup_of(container: &str) -> Option<String> {
    let (parent, _) = container.trim_end_matches('/').rsplit_once('/')?;
    let name = parent.rsplit('/').next()?;
    // cgroupfs: `pod<uid>` (dashes in the uid); systemd: `…-pod<uid>.slice` (dashes as `_`).
    let uid = match name.strip_prefix("pod") {
        Some(uid) => uid,
        None => name
            .strip_suffix(".slice")?
            .rsplit('-')
            .next()?
            .strip_prefix("pod")?,
    };
    let uid_like = !uid.is_empty()
        && uid
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'_');
    uid_like.then(|| parent.to_owned())
}

/// One claim's part of a pod's limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Claim {
    /// The claim's shares as container-level annotations ([`annotations::render`]).
    shares: BTreeMap<String, String>,
    /// The containers using it.
    users: BTreeSet<String>,
}

/// What the ledger holds for one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PodRecord {
    cgroup: String,
    claims: BTreeMap<String, Claim>,
}

/// A pod's limits before and after a change, for applying it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub cgroup: String,
    pub before: Shares,
    pub after: Shares,
}

/// The pod ledgers under one directory.
#[derive(Clone, Debug)]
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Runs `change` on the record of `pod` under the file's exclusive lock and writes it back
    /// (removes it when no claim is left).
    fn update(
        &self,
        pod: &str,
        change: impl FnOnce(&mut PodRecord),
    ) -> Result<Change, RuntimeError> {
        let path = record_file(&self.dir, pod);
        let fresh = || PodRecord {
            cgroup: pod.to_owned(),
            ..PodRecord::default()
        };
        locked_update(&path, fresh, |record: &mut PodRecord| {
            let before = total(record)?;
            change(record);
            record.claims.retain(|_, c| !c.users.is_empty());
            let after = total(record)?;
            Ok((
                !record.claims.is_empty(),
                Change {
                    cgroup: pod.to_owned(),
                    before,
                    after,
                },
            ))
        })
    }

    /// `container` uses `claim` (granting `shares`) in `pod`.
    pub fn join(
        &self,
        pod: &str,
        claim: &str,
        container: &str,
        shares: &Shares,
    ) -> Result<Change, RuntimeError> {
        let rendered = annotations::render(shares);
        self.update(pod, |r| {
            let c = r.claims.entry(claim.to_owned()).or_default();
            c.shares = rendered;
            c.users.insert(container.to_owned());
        })
    }

    /// Removes the records of pods whose cgroup (under the cgroup v2 `root`) is gone: gpud
    /// dropped their limits with the cgroup. Best effort; returns how many went.
    pub fn prune(&self, root: &Path) -> usize {
        let gone =
            crate::cgroup::remove_records_of_gone(&self.dir, root, |r: &PodRecord| &r.cgroup);
        for record in &gone {
            tracing::info!(pod = %record.cgroup, "record of a pod whose cgroup is gone removed");
        }
        gone.len()
    }

    /// `container` stopped: the claims it used lose it as a user, and go with their last.
    pub fn leave(&self, pod: &str, container: &str) -> Result<Change, RuntimeError> {
        self.update(pod, |r| {
            for c in r.claims.values_mut() {
                c.users.remove(container);
            }
        })
    }
}

/// `name` with every byte outside `[A-Za-z0-9._-]` written as `esc` and two hex digits: one
/// distinct file or directory name per name.
pub(crate) fn escaped(name: &str, esc: char) -> String {
    let mut out = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || (b"._-".contains(&b) && char::from(b) != esc) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("{esc}{b:02X}"));
        }
    }
    out
}

/// The ledger file of `key` (a pod's cgroup, a claim) under `dir`.
pub(crate) fn record_file(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{}.json", escaped(key, '%')))
}

/// Runs `change` on the JSON record at `path` (`fresh()` where there is none) under the file's
/// exclusive lock, so that hooks of several containers running at once each see the others'
/// changes; writes it back where `change` answers true, else removes the file. The directory is
/// made where missing.
pub(crate) fn locked_update<T: Serialize + serde::de::DeserializeOwned, R>(
    path: &Path,
    fresh: impl FnOnce() -> T,
    change: impl FnOnce(&mut T) -> Result<(bool, R), RuntimeError>,
) -> Result<R, RuntimeError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| RuntimeError::Io { path, source }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io(path))?;
    file.lock().map_err(io(path))?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io(path))?;
    let mut record: T = if text.trim().is_empty() {
        fresh()
    } else {
        serde_json::from_str(&text)
            .map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))?
    };
    let (keep, out) = change(&mut record)?;
    if keep {
        let text = serde_json::to_string(&record)
            .map_err(|e| RuntimeError::Input(format!("cannot encode {}: {e}", path.display())))?;
        file.set_len(0).map_err(io(path))?;
        file.rewind().map_err(io(path))?;
        file.write_all(text.as_bytes()).map_err(io(path))?;
    } else {
        std::fs::remove_file(path).map_err(io(path))?;
    }
    Ok(out)
}

/// The pod's limits: per GPU, the claims' memory and compute summed (each within its range),
/// the highest weight and class any grants.
fn total(record: &PodRecord) -> Result<Shares, RuntimeError> {
    let none = std::collections::HashMap::new();
    let mut out = Shares::default();
    for claim in record.claims.values() {
        let granted: std::collections::HashMap<String, String> =
            claim.shares.clone().into_iter().collect();
        let shares = annotations::resolve(&none, &granted, None)?;
        for (gpu, limits) in shares.gpus {
            let into: &mut BTreeMap<LimitKind, LimitValue> = out.gpus.entry(gpu).or_default();
            for (kind, value) in limits {
                let merged = match (into.get(&kind), &value) {
                    (None, v) => v.clone(),
                    (Some(LimitValue::Number(a)), LimitValue::Number(b)) => {
                        LimitValue::Number(sum(kind, *a, *b))
                    }
                    (Some(LimitValue::Priority(a)), LimitValue::Priority(b)) => {
                        LimitValue::Priority(*a.min(b))
                    }
                    (Some(a), _) => a.clone(),
                };
                into.insert(kind, merged);
            }
        }
    }
    Ok(out)
}

fn sum(kind: LimitKind, a: u64, b: u64) -> u64 {
    match kind {
        LimitKind::MemoryMax => a.saturating_add(b).min(MAX_BYTES),
        LimitKind::ComputeMax | LimitKind::ComputeMin => (a + b).min(100),
        LimitKind::ComputeWeight => a.max(b),
        LimitKind::Priority => a,
    }
}

/// The GPUs and limits `before` had that `after` lacks: what to clear after setting `after`.
pub fn removed(before: &Shares, after: &Shares) -> Vec<(GpuSelector, Vec<LimitKind>)> {
    before
        .gpus
        .iter()
        .filter_map(|(gpu, limits)| {
            let kept = after.gpus.get(gpu);
            let gone: Vec<LimitKind> = limits
                .keys()
                .filter(|k| kept.is_none_or(|l| !l.contains_key(k)))
                .copied()
                .collect();
            (!gone.is_empty()).then(|| (gpu.clone(), gone))
        })
        .collect()
}

#[cfg(test)]
mod tests;
