//! The OCI hook (`gpud-oci-hook`): what it does at each stage, with the OCI state it receives on
//! standard input.
//!
//! - `createRuntime` (or the deprecated `prestart`, which runc runs at the same point): the
//!   container's process exists in its cgroup and the hook runs in the runtime's namespaces. The
//!   hook reads the annotations (from the state; from the bundle's `config.json` when the state
//!   has none), resolves the cgroup from the state's pid, sets the shares, and records what it
//!   set in `<record dir>/<container id>.json`. It then names the container's Kubernetes
//!   workload to gpud from the runtime's annotations ([`crate::workload`]), and the pod's on the
//!   pod's cgroup where a claim's shares went there; a failure there is only a warning.
//! - `poststop`: the process is gone and runc has already removed the cgroup, so nothing can be
//!   learned from the container any more: the hook clears what the record says and removes it.
//!   A record rather than re-deriving the path from `linux.cgroupsPath` because the record holds
//!   the path the kernel reported for the container's own process, whatever the cgroup driver.
//!
//! `createContainer` and `startContainer` hooks run inside the container's mount namespace,
//! where neither this binary nor gpud's bus socket can be assumed; they are not used.

use std::{
    collections::HashMap,
    io::Read,
    path::{Path, PathBuf},
    time::Duration,
};

use oci_spec::runtime::{Spec, State};
use serde::{Deserialize, Serialize};

use super::{
    RuntimeError, annotations,
    client::{Applied, Client},
    trust::{self, Ignored, Sources, Trust},
};

/// Where create records what it set, for poststop.
pub const DEFAULT_RECORD_DIR: &str = "/run/gpud-hook";

/// Annotations with which runtimes mark a pod's sandbox (infrastructure) container: CRI-O and
/// containerd's CRI. It runs no workload and gets no shares.
const SANDBOX_MARKERS: &[(&str, &str)] = &[
    ("io.kubernetes.cri-o.ContainerType", "sandbox"),
    ("io.kubernetes.cri.container-type", "sandbox"),
];
/// The container's name in a pod (CRI-O, containerd's CRI), for container-scoped pod keys.
const CONTAINER_NAME_KEYS: &[&str] = &[
    "io.kubernetes.container.name",
    "io.kubernetes.cri.container-name",
];

/// Largest state document read from standard input.
const MAX_STATE_BYTES: u64 = 1 << 20;

/// Settings of one hook run.
#[derive(Clone, Debug)]
pub struct HookConfig {
    /// `"system"` or a D-Bus address.
    pub bus: String,
    /// Bound of the connection and of each D-Bus call.
    pub timeout: Duration,
    pub record_dir: PathBuf,
    /// Annotations given to the hook itself (`--annotation KEY=VALUE`), as the CDI spec of a DRA
    /// claim passes the claim's shares: what the cluster granted, over the runtime's.
    pub annotations: HashMap<String, String>,
    /// How far the OCI spec's annotations count against the hook's ([`trust`]).
    pub trust: Trust,
    /// The DRA claim (and device) the `--annotation` grant is (`--claim`): the pod's, enforced
    /// once on the pod's cgroup however many of its containers use it ([`crate::pod`]).
    pub claim: Option<String>,
}

impl HookConfig {
    /// Whether the hook carries shares the cluster granted (a DRA claim's): gpud is expected to
    /// enforce them.
    pub fn granted(&self) -> bool {
        self.annotations
            .keys()
            .any(|k| k.starts_with(annotations::PREFIX))
    }
}

/// What a hook run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Shares set on the container's cgroup; `ignored`: annotations that would have widened what
    /// the cluster granted; `pod`: the pod's cgroup and what it has now, where the grant is a
    /// claim's; `warnings`: what went wrong without failing the container (the workload's names
    /// not reported).
    Applied {
        cgroup: String,
        applied: Applied,
        ignored: Vec<Ignored>,
        pod: Option<(String, Applied)>,
        /// The claim's own cgroup, where the container's memory is also charged
        /// ([`crate::claim`]).
        claim_group: Option<String>,
        warnings: Vec<String>,
    },
    /// The container has no shares (after leaving out `ignored`).
    NoShares { ignored: Vec<Ignored> },
    /// Not a container that gets shares (a pod sandbox).
    Skipped(&'static str),
    /// poststop: the limits set at create were cleared.
    Cleared { cgroup: String, gpus: Vec<String> },
    /// poststop: nothing was set at create.
    NothingToClear,
}

/// What create leaves for poststop.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub id: String,
    pub cgroup: String,
    pub gpus: Vec<String>,
    /// The pod's cgroup whose ledger lists this container as a user of a claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The claim whose ledger lists this container as a user ([`crate::claim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// The pod ledgers' directory under the record directory.
fn ledger(cfg: &HookConfig) -> crate::pod::Ledger {
    crate::pod::Ledger::new(cfg.record_dir.join("pods"))
}

/// The claim ledgers' directory under the record directory.
fn claims(cfg: &HookConfig) -> crate::claim::Claims {
    crate::claim::Claims::new(cfg.record_dir.join("claims"))
}

/// The claim's own cgroup, shared by every pod using the claim, gets the claim's memory, and the
/// container's charges go there too ([`crate::claim`]): however many pods use the claim, its
/// memory is one limit. Before the container runs (it is charged nothing yet). The claim's
/// cgroup where the claim's ledger now lists the container, with what went wrong.
async fn share_claim(
    client: &Client,
    cfg: &HookConfig,
    (claim, pod): (&str, &str),
    (id, cgroup): (&str, &str),
    grant: &crate::annotations::Shares,
) -> (Option<String>, Result<(), RuntimeError>) {
    let memory = crate::claim::memory_of(grant);
    if memory.is_empty() {
        return (None, Ok(()));
    }
    let Some(root) = super::cgroup::root() else {
        return (
            None,
            Err(RuntimeError::Cgroup(
                "no cgroup v2 hierarchy is mounted".to_owned(),
            )),
        );
    };
    let group = match claims(cfg).join(&root, claim, pod, id) {
        Ok(g) => g,
        Err(e) => return (None, Err(e)),
    };
    let result = async {
        client.apply(&group, &memory).await.1?;
        client.share_charges(cgroup, &group).await
    }
    .await;
    (Some(group), result)
}

/// Reads and parses the OCI state from `input` (the hook's standard input).
pub fn read_state(input: impl Read) -> Result<State, RuntimeError> {
    let mut text = String::new();
    input
        .take(MAX_STATE_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| RuntimeError::Input(format!("reading the OCI state from stdin: {e}")))?;
    serde_json::from_str(&text)
        .map_err(|e| RuntimeError::Input(format!("the OCI state on stdin does not parse: {e}")))
}

/// The container's annotations: the state's, or the bundle's `config.json`'s when the state
/// carries none (the runtime spec makes them optional in the state).
pub fn annotations_of(state: &State) -> Result<HashMap<String, String>, RuntimeError> {
    if let Some(a) = state.annotations() {
        return Ok(a.clone());
    }
    let config = state.bundle().join("config.json");
    let spec = Spec::load(&config)
        .map_err(|e| RuntimeError::Input(format!("{}: {e}", config.display())))?;
    Ok(spec.annotations().clone().unwrap_or_default())
}

/// The container id, checked to be usable as a file name (runc allows `[A-Za-z0-9_+.-]`).
fn checked_id(state: &State) -> Result<&str, RuntimeError> {
    let id = state.id().as_str();
    let fine = !id.is_empty()
        && id.len() <= 1024
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_+.-".contains(&b));
    if fine {
        Ok(id)
    } else {
        Err(RuntimeError::Input(format!(
            "container id {:?} is not a valid OCI container id",
            id.chars().take(80).collect::<String>()
        )))
    }
}

fn record_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.json"))
}

fn save(dir: &Path, record: &Record) -> Result<(), RuntimeError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| RuntimeError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = record_path(dir, &record.id);
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string(record)
        .map_err(|e| RuntimeError::Input(format!("cannot encode the record: {e}")))?;
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

fn load(dir: &Path, id: &str) -> Result<Option<Record>, RuntimeError> {
    let path = record_path(dir, id);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(RuntimeError::Io { path, source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))
}

/// Removes the records of containers whose cgroup is gone without a `poststop` (a container
/// that failed after `createRuntime` under a runtime that never ran the hook again): gpud dropped
/// their limits when it saw the cgroup removed, so only the file is left. Best effort, at every
/// hook run. Returns how many were removed.
pub fn prune_records(dir: &Path) -> usize {
    let Some(root) = super::cgroup::root() else {
        return 0;
    };
    let gone = super::cgroup::remove_records_of_gone(dir, &root, |r: &Record| &r.cgroup);
    let claims = crate::claim::Claims::new(dir.join("claims"));
    for record in &gone {
        tracing::info!(
            container = %record.id,
            cgroup = %record.cgroup,
            "record of a container whose cgroup is gone removed"
        );
        // Its poststop never ran: it leaves its claim here.
        if let Some(claim) = &record.claim
            && let Err(e) = claims.leave(&root, claim, &record.id)
        {
            tracing::warn!(
                claim,
                "cannot update the claim's ledger: {}",
                crate::report::Chain(&e)
            );
        }
    }
    gone.len() + crate::pod::Ledger::new(dir.join("pods")).prune(&root)
}

/// The `createRuntime`/`prestart` stage.
pub async fn create(state: &State, cfg: &HookConfig) -> Result<Outcome, RuntimeError> {
    prune_records(&cfg.record_dir);
    let id = checked_id(state)?;
    let ann = annotations_of(state)?;
    if SANDBOX_MARKERS
        .iter()
        .any(|(k, v)| ann.get(*k).is_some_and(|x| x == v))
    {
        return Ok(Outcome::Skipped("pod sandbox container"));
    }
    let name = CONTAINER_NAME_KEYS
        .iter()
        .find_map(|k| ann.get(*k))
        .map(String::as_str);
    // The runtime hands one set of annotations, whichever pod annotations it copied there: they
    // are what the pod asked; container-scoped keys pick this container by name. The hook's own
    // arguments are what a DRA claim granted.
    let src = Sources {
        asked: &ann,
        granted: &cfg.annotations,
        name,
        kubernetes: trust::kubernetes_container(&ann) || cfg.granted(),
    };
    let decision = trust::decide(&src, cfg.trust)?;
    let ignored = decision.ignored.clone();
    if decision.shares.is_empty() {
        return Ok(Outcome::NoShares { ignored });
    }
    let pid = state
        .pid()
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| RuntimeError::Input("the OCI state has no container pid".into()))?;
    let cgroup = super::cgroup::of_pid(pid)?;
    let client = Client::connect(&cfg.bus, cfg.timeout).await?;
    // A claim's grant is the pod's: on the pod's cgroup, once; the container keeps only what its
    // pod asked on top (narrowing). Where no pod cgroup is above, the container gets it all.
    let pod_cgroup = cfg
        .claim
        .as_ref()
        .filter(|_| !decision.grant.is_empty())
        .and_then(|claim| crate::pod::pod_cgroup_of(&cgroup).map(|pod| (claim, pod)));
    if cfg.claim.is_some() && pod_cgroup.is_none() && !decision.grant.is_empty() {
        tracing::warn!(
            %cgroup,
            "no pod cgroup above the container: the claim's shares go on the container alone"
        );
    }
    let mut pod = None;
    let mut pod_result = Ok(());
    let mut claim_group = None;
    let shares = match &pod_cgroup {
        Some((claim, pod_cg)) => {
            let change = ledger(cfg).join(pod_cg, claim, id, &decision.grant)?;
            let (applied, result) = client.apply_change(&change).await;
            pod = Some((pod_cg.clone(), applied));
            pod_result = result;
            if pod_result.is_ok() {
                let (group, result) = share_claim(
                    &client,
                    cfg,
                    (claim, pod_cg),
                    (id, &cgroup),
                    &decision.grant,
                )
                .await;
                claim_group = group.map(|g| ((*claim).clone(), g));
                pod_result = result;
            }
            decision.asked.clone()
        }
        None => decision.shares.clone(),
    };
    let (applied, result) = if shares.is_empty() || pod_result.is_err() {
        (Applied::default(), Ok(()))
    } else {
        client.apply(&cgroup, &shares).await
    };
    // Recorded whatever failed: poststop clears what was set.
    if !applied.gpus.is_empty() || pod.is_some() {
        let record = Record {
            id: id.to_owned(),
            cgroup: cgroup.clone(),
            gpus: applied.gpus.clone(),
            pod: pod.as_ref().map(|(cg, _)| cg.clone()),
            claim: claim_group.as_ref().map(|(c, _)| c.clone()),
        };
        if let Err(e) = save(&cfg.record_dir, &record) {
            // The limits stay until gpud sees the cgroup removed; not worth failing the
            // container for.
            tracing::warn!(
                "cannot record the limits for poststop ({e}); gpud drops them when the cgroup is removed"
            );
        }
    }
    pod_result?;
    result?;
    // Names for the cgroups that got something: the pod's, and the container's (also where the
    // claim's shares all went to its pod, since its own usage is still its cgroup's).
    let names = crate::workload::from_annotations(&ann);
    let mut named = Vec::new();
    if let Some((pod_cg, pod_applied)) = &pod
        && !pod_applied.gpus.is_empty()
    {
        named.push((pod_cg.as_str(), crate::workload::of_pod(&names)));
    }
    if !applied.gpus.is_empty() || pod.is_some() {
        named.push((cgroup.as_str(), names.clone()));
    }
    let mut warnings = Vec::new();
    for (cg, names) in named.iter().filter(|(_, n)| !n.is_empty()) {
        if let Err(e) = client.set_workload(cg, names).await {
            warnings.push(format!(
                "workload names of {cg} not reported: {}",
                crate::report::Chain(&e)
            ));
        }
    }
    Ok(Outcome::Applied {
        cgroup,
        applied,
        ignored,
        pod,
        claim_group: claim_group.map(|(_, g)| g),
        warnings,
    })
}

/// The `poststop` stage.
pub async fn poststop(state: &State, cfg: &HookConfig) -> Result<Outcome, RuntimeError> {
    let id = checked_id(state)?;
    let outcome = poststop_of(id, cfg).await;
    prune_records(&cfg.record_dir);
    outcome
}

async fn poststop_of(id: &str, cfg: &HookConfig) -> Result<Outcome, RuntimeError> {
    let Some(record) = load(&cfg.record_dir, id)? else {
        return Ok(Outcome::NothingToClear);
    };
    let path = record_path(&cfg.record_dir, id);
    // The claims it used lose a user whatever gpud answers (the ledger is the hooks' own), and
    // the last one's share leaves the pod.
    let change = match &record.pod {
        Some(pod) => Some(ledger(cfg).leave(pod, &record.id)),
        None => None,
    };
    // The claim's own cgroup goes with its last user (gpud drops its limits with it).
    if let Some(claim) = &record.claim
        && let Some(root) = super::cgroup::root()
        && let Err(e) = claims(cfg).leave(&root, claim, &record.id)
    {
        tracing::warn!(
            claim,
            "cannot update the claim's ledger: {}",
            crate::report::Chain(&e)
        );
    }
    let result = async {
        let client = Client::connect(&cfg.bus, cfg.timeout).await?;
        client.clear(&record.cgroup, &record.gpus).await?;
        if let Some(change) = change {
            client.apply_change(&change?).await.1?;
        }
        Ok(())
    }
    .await;
    // Removed whatever happened: a gpud that cannot be reached now drops the limits of removed
    // cgroups when it sweeps or restarts, and a retry would find nothing else to do.
    if let Err(source) = std::fs::remove_file(&path)
        && source.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("cannot remove {}: {source}", path.display());
    }
    result.map(|()| Outcome::Cleared {
        cgroup: record.cgroup,
        gpus: record.gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(json: &str) -> State {
        read_state(json.as_bytes()).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    #[test]
    fn states_as_runc_sends_them() {
        // runc 1.1's createRuntime and poststop states, verbatim.
        let s = state(
            r#"{"ociVersion":"1.0.2-dev","id":"try1","status":"creating","pid":19319,"bundle":"/tmp/b","annotations":{"gpud.dev/memory-max":"8Gi"}}"#,
        );
        assert_eq!(s.pid(), &Some(19319));
        assert_eq!(
            annotations_of(&s)
                .ok()
                .and_then(|a| a.get("gpud.dev/memory-max").cloned()),
            Some("8Gi".to_owned())
        );
        let s = state(
            r#"{"ociVersion":"1.0.2-dev","id":"try1","status":"stopped","bundle":"/tmp/b","annotations":{"gpud.dev/memory-max":"8Gi"}}"#,
        );
        assert_eq!(s.pid(), &None);
        assert!(checked_id(&s).is_ok());
        for bad in ["", "{", "null", r#"{"id": 5}"#, r#"{"id":"x","pid":"1"}"#] {
            assert!(read_state(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn annotations_from_the_bundle_when_the_state_has_none() {
        let dir = std::env::temp_dir().join(format!("gpud-oci-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let config = r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"},"annotations":{"gpud.dev/memory-max":"1Gi"}}"#;
        let written = std::fs::write(dir.join("config.json"), config);
        assert!(written.is_ok(), "{written:?}");
        let s = state(&format!(
            r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1,"bundle":{:?}}}"#,
            dir.display().to_string()
        ));
        assert_eq!(
            annotations_of(&s)
                .ok()
                .and_then(|a| a.get("gpud.dev/memory-max").cloned()),
            Some("1Gi".to_owned())
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert!(annotations_of(&s).is_err(), "no config.json");
    }

    #[test]
    fn ids_that_cannot_be_file_names_are_refused() {
        for bad in ["", ".", "..", "a/b", "../x", "a b", "a\0b"] {
            let id = serde_json::to_string(bad).unwrap_or_default();
            let s = state(&format!(
                r#"{{"ociVersion":"1.0.2","id":{id},"status":"stopped","bundle":"/"}}"#
            ));
            assert!(checked_id(&s).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn records_round_trip() {
        let dir = std::env::temp_dir().join(format!("gpud-rec-{}", std::process::id()));
        let r = Record {
            id: "c1".into(),
            cgroup: "/a/b".into(),
            gpus: vec!["all".into(), "0".into()],
            pod: None,
            claim: Some("uid-gpu-0".into()),
        };
        assert!(save(&dir, &r).is_ok());
        // A record written before pods were kept reads as one without a pod.
        std::fs::write(
            dir.join("old.json"),
            r#"{"id":"old","cgroup":"/a/c","gpus":["all"]}"#,
        )
        .expect("write");
        assert_eq!(load(&dir, "old").ok().flatten().map(|r| r.pod), Some(None));
        assert_eq!(load(&dir, "c1").ok().flatten(), Some(r));
        assert_eq!(load(&dir, "c2").ok().flatten(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_of_removed_cgroups_are_pruned_and_others_kept() {
        let dir = std::env::temp_dir().join(format!("gpud-oci-prune-{}", std::process::id()));
        let gone = Record {
            id: "gone".into(),
            cgroup: format!("/gpud-no-such-cgroup-{}", std::process::id()),
            gpus: vec!["all".into()],
            pod: None,
            claim: None,
        };
        let live = Record {
            id: "live".into(),
            cgroup: "/".into(),
            gpus: vec!["all".into()],
            pod: None,
            claim: None,
        };
        for r in [&gone, &live] {
            save(&dir, r).expect("save");
        }
        std::fs::write(dir.join("notes.txt"), "not a record").expect("write");
        assert_eq!(prune_records(&dir), 1);
        assert_eq!(load(&dir, "gone").ok().flatten(), None);
        assert_eq!(load(&dir, "live").ok().flatten(), Some(live));
        assert!(dir.join("notes.txt").exists(), "other files are left alone");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
