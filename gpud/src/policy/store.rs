//! Persistence of the limits in force: `<state_dir>/limits.json`, written atomically on every
//! change and read back at start (a corrupt file is set aside or refused, per
//! `[daemon] on_corrupt_state`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use tracing::info;

use super::{GpuSelector, Limits, PolicyError};
use crate::config::CorruptState;

/// One stored entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredLimit {
    pub cgroup: String,
    pub gpu: GpuSelector,
    #[serde(flatten)]
    pub limits: Limits,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    version: u32,
    limits: Vec<StoredLimit>,
}

const STATE_VERSION: u32 = 1;

/// The limits in force, persisted to `<state_dir>/limits.json` on every change.
#[derive(Debug)]
pub struct LimitStore {
    path: PathBuf,
    entries: BTreeMap<(String, GpuSelector), Limits>,
}

impl LimitStore {
    pub const FILE: &'static str = "limits.json";

    /// Makes sure `state_dir` exists and takes files: a limit set later must not fail to persist
    /// because of a mistake that start-up could have shown.
    pub fn check_dir(state_dir: &Path) -> Result<(), PolicyError> {
        let err = |source| PolicyError::StateDir {
            path: state_dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(err)?;
        let probe = state_dir.join(".gpud-write-test");
        std::fs::write(&probe, b"").map_err(err)?;
        std::fs::remove_file(&probe).map_err(err)
    }

    /// Loads the store. A missing file is an empty store. An unreadable or corrupt one (bad
    /// JSON, another schema, an unsupported version) is, with [`CorruptState::StartEmpty`],
    /// moved aside (`limits.json.corrupt-<unix time>`) with an error log, and the daemon starts
    /// with no limits rather than wrong ones; with [`CorruptState::Refuse`] it is left in place
    /// and the load fails.
    pub fn load(state_dir: &Path, on_corrupt: CorruptState) -> Result<Self, PolicyError> {
        let path = state_dir.join(Self::FILE);
        let mut store = Self {
            path: path.clone(),
            entries: BTreeMap::new(),
        };
        let corrupt = |reason: String| -> Result<Self, PolicyError> {
            match on_corrupt {
                CorruptState::Refuse => Err(PolicyError::CorruptState {
                    path: path.clone(),
                    reason,
                }),
                CorruptState::StartEmpty => {
                    set_aside(&path, &reason);
                    Ok(Self {
                        path: path.clone(),
                        entries: BTreeMap::new(),
                    })
                }
            }
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(store),
            Err(e) => return corrupt(format!("cannot read it: {e}")),
        };
        match serde_json::from_str::<StateFile>(&text) {
            Ok(f) if f.version == STATE_VERSION => {
                for l in f.limits {
                    if !l.limits.is_empty() {
                        store.entries.insert((l.cgroup, l.gpu), l.limits);
                    }
                }
                info!(path = %path.display(), limits = store.entries.len(), "limits restored");
                Ok(store)
            }
            Ok(f) => corrupt(format!("unsupported version {}", f.version)),
            Err(e) => corrupt(e.to_string()),
        }
    }

    pub fn get(&self, cgroup: &str, gpu: &GpuSelector) -> Option<&Limits> {
        self.entries.get(&(cgroup.to_owned(), gpu.clone()))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&(String, GpuSelector), &Limits)> {
        self.entries.iter()
    }

    /// Replaces the whole set (after a change was validated and applied) and persists it; on a
    /// write error the previous set stays in force.
    pub fn replace(
        &mut self,
        entries: BTreeMap<(String, GpuSelector), Limits>,
    ) -> Result<(), PolicyError> {
        let entries: BTreeMap<_, _> = entries.into_iter().filter(|(_, l)| !l.is_empty()).collect();
        write_state(&self.path, &entries)?;
        self.entries = entries;
        Ok(())
    }

    pub fn entries(&self) -> &BTreeMap<(String, GpuSelector), Limits> {
        &self.entries
    }
}

fn set_aside(path: &Path, reason: &str) {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let aside = path.with_extension(format!("json.corrupt-{stamp}"));
    match std::fs::rename(path, &aside) {
        Ok(()) => tracing::error!(
            path = %path.display(), kept = %aside.display(),
            "stored limits are corrupt ({reason}); kept aside, starting with no limits"
        ),
        Err(e) => tracing::error!(
            path = %path.display(),
            "stored limits are corrupt ({reason}) and cannot be moved aside ({e}); starting with no limits"
        ),
    }
}

/// Writes the limits' state file ([`write_atomically`]).
fn write_state(
    path: &Path,
    entries: &BTreeMap<(String, GpuSelector), Limits>,
) -> Result<(), PolicyError> {
    let file = StateFile {
        version: STATE_VERSION,
        limits: entries
            .iter()
            .map(|((cgroup, gpu), limits)| StoredLimit {
                cgroup: cgroup.clone(),
                gpu: gpu.clone(),
                limits: limits.clone(),
            })
            .collect(),
    };
    write_atomically(path, &file)
}

/// Writes `value` as JSON atomically: a temporary file in the same directory, fsynced, then
/// renamed over `path`.
pub(super) fn write_atomically(path: &Path, value: &impl Serialize) -> Result<(), PolicyError> {
    use std::io::Write as _;
    let werr = |source| PolicyError::Write {
        path: path.to_owned(),
        source,
    };
    let text = serde_json::to_string_pretty(value).map_err(|e| werr(std::io::Error::other(e)))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(werr)?;
    }
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(werr)?;
    f.write_all(text.as_bytes()).map_err(werr)?;
    f.write_all(b"\n").map_err(werr)?;
    f.sync_all().map_err(werr)?;
    std::fs::rename(&tmp, path).map_err(werr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Priority;

    #[test]
    fn store_round_trips_and_sets_corrupt_files_aside() -> Result<(), PolicyError> {
        let dir = std::env::temp_dir().join(format!("gpud-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = LimitStore::load(&dir, CorruptState::StartEmpty)?;
        assert!(s.entries().is_empty());
        let mut e = BTreeMap::new();
        e.insert(
            ("/a".to_owned(), GpuSelector::All),
            Limits {
                memory_max: Some(42),
                compute_max: Some(30),
                priority: Some(Priority::BestEffort),
                ..Limits::default()
            },
        );
        s.replace(e.clone())?;
        assert_eq!(
            LimitStore::load(&dir, CorruptState::StartEmpty)?.entries(),
            &e
        );
        std::fs::write(dir.join(LimitStore::FILE), "{ not json").map_err(|source| {
            PolicyError::Write {
                path: dir.clone(),
                source,
            }
        })?;
        assert!(matches!(
            LimitStore::load(&dir, CorruptState::Refuse),
            Err(PolicyError::CorruptState { .. })
        ));
        assert!(
            dir.join(LimitStore::FILE).exists(),
            "refuse leaves it in place"
        );
        assert!(
            LimitStore::load(&dir, CorruptState::StartEmpty)?
                .entries()
                .is_empty()
        );
        assert!(!dir.join(LimitStore::FILE).exists(), "moved aside");
        let aside = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .any(|f| f.file_name().to_string_lossy().contains("corrupt"))
            })
            .unwrap_or(false);
        assert!(aside, "corrupt file kept aside");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
