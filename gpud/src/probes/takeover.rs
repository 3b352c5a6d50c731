//! Taking over the pinned maps of the probes attached before, at an upgrade (docs/design.md,
//! "Upgrades").
//!
//! A daemon of a new ABI finds the previous one's pins under `<bpffs>/gpud/v<previous>/`, with
//! its programs still attached and counting; a daemon of the same ABI but another eBPF object
//! (another build) finds that object's links in its own directory, and moves the directory
//! aside to `v<ABI>-replaced` first. Nothing of the old is touched until the new is attached
//! and holds everything, so every failure before that leaves the old probes running, put back
//! where they were (the new daemon removes its own pins and exits with the reason):
//!
//! 1. before the new programs attach, the maps only the daemon writes or that change slowly
//!    (limits, allowances, held groups, guard counts, ancestry, processes, ioctl counts,
//!    channel groups, the tracked-process filter, the health counters) are copied into the new
//!    ones, converted where the layout changed ([`gpud_common::previous`]);
//! 2. the new programs attach (both sets run; each counts into its own maps);
//! 3. processes the old filter marked meanwhile are marked in the new; every object of the old
//!    `OBJECTS` is adopted by the kernel (`gpud_adopt`), then those made while adopting:
//!    recorded unless the new programs recorded them already, memory charged once per charge
//!    (usage, shares and per-cgroup counts are rebuilt with the kernel's atomic updates, never
//!    written from here); an adopted object the old map (its programs still running) no longer
//!    holds was freed before its adoption, unseen by the new programs: it is released by serial;
//! 4. the old links are unpinned: the old programs detach (the same look for freed objects
//!    once more);
//! 5. the old event ring is handed to the daemon, which reads its records like its own;
//! 6. the old directory is removed.
//!
//! A map that cannot be converted is named in the log and in the report, never dropped
//! silently. Pins of a newer ABI are refused: a downgrade would drop their accounting.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap},
    path::{Path, PathBuf},
};

use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, RingBuf};
use gpud_common::{ABI_VERSION, ObjEntry, ObjKey, TRACKED_PER_WORD, previous};
use tracing::{info, warn};

use super::{
    KernelRuns, ProbeError, io_err, map_entries,
    maps::{array_entries, pinned},
    runs::Adopted,
};

/// What start-up found beside this ABI's pins: the directory to take over, if any, and what was
/// removed unconverted.
pub(super) struct Previous {
    /// The pins to take over: the previous ABI's, or this ABI's of another eBPF object (moved
    /// aside to [`replaced_dir`] first); `None`: nothing to take over.
    dir: Option<PathBuf>,
    /// Their ABI.
    from_abi: u32,
    /// Pins removed unconverted (no conversion is kept for their ABI, or no programs of theirs
    /// were attached), with why.
    unconverted: Vec<String>,
}

/// What a take-over did: the D-Bus property `ProbesTakenOver` and the start-up log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TakeOver {
    /// The ABI taken over.
    pub from_abi: u32,
    /// Entries copied per map before the new programs attached.
    pub copied: BTreeMap<&'static str, usize>,
    /// Objects adopted (recorded and charged in the new maps).
    pub adopted: usize,
    /// Objects the new programs had recorded themselves.
    pub present: usize,
    /// Objects freed while both sets of programs ran, released from the new maps.
    pub released: usize,
    /// Objects `OBJECTS` had no room for.
    pub no_room: usize,
    /// Maps or pin directories not converted, with why.
    pub unconverted: Vec<String>,
}

impl TakeOver {
    /// The report as `ProbesTakenOver` gives it: empty where nothing was taken over.
    pub fn as_map(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        if self.from_abi != 0 {
            let copied: Vec<String> = self
                .copied
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            m.extend(
                [
                    ("from_abi", self.from_abi.to_string()),
                    ("objects_adopted", self.adopted.to_string()),
                    ("objects_present", self.present.to_string()),
                    ("objects_released", self.released.to_string()),
                    ("objects_no_room", self.no_room.to_string()),
                    ("maps_copied", copied.join(",")),
                ]
                .map(|(k, v)| (k.to_owned(), v)),
            );
        }
        if !self.unconverted.is_empty() {
            m.insert("unconverted".into(), self.unconverted.join("; "));
        }
        m
    }
}

/// `<bpffs>/gpud/v<N>` directories other than this ABI's, by version (`None`: not a version).
fn other_versions(bpffs: &Path) -> Vec<(Option<u32>, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(bpffs.join("gpud")) else {
        return Vec::new();
    };
    let mut out: Vec<_> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let version = name.strip_prefix('v').and_then(|v| v.parse::<u32>().ok());
            (version != Some(ABI_VERSION) && e.path() != replaced_dir(bpffs))
                .then(|| (version, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Where this ABI's pins of another eBPF object are moved while this one takes them over.
fn replaced_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("gpud").join(format!("v{ABI_VERSION}-replaced"))
}

/// After a failed take-over: removes this build's pins at `current` and puts pins of this ABI
/// that were moved aside back in their place (the previous ABI's were never moved).
pub(super) fn put_back(bpffs: &Path, current: &Path) {
    if let Err(e) = std::fs::remove_dir_all(current)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(dir = %current.display(), "removing this build's pins: {e}");
    }
    let replaced = replaced_dir(bpffs);
    if replaced.exists() {
        match std::fs::rename(&replaced, current) {
            Ok(()) => info!(dir = %current.display(), "the pins taken over are back in place"),
            Err(e) => {
                warn!(from = %replaced.display(), to = %current.display(), "putting the pins back: {e}")
            }
        }
    }
}

/// Whether `dir/links` holds links of an eBPF object other than this build's (another build of
/// this ABI attached them).
fn attached_by_another_object(dir: &Path) -> bool {
    let ours = super::attach::object_hash();
    std::fs::read_dir(dir.join("links")).is_ok_and(|d| {
        d.flatten()
            .any(|e| !e.file_name().to_string_lossy().starts_with(&ours))
    })
}

/// Whether `dir/links` holds any pinned link directory (the programs are attached).
fn attached(dir: &Path) -> bool {
    std::fs::read_dir(dir.join("links"))
        .map(|mut d| d.next().is_some())
        .unwrap_or(false)
}

impl Previous {
    /// Looks at the pins beside this ABI's before anything is loaded: refuses a newer ABI's,
    /// removes those of ABIs with no conversion (naming them), and finds what to take over: the
    /// previous ABI's pins where their probes are attached, or this ABI's where another eBPF
    /// object (another build) attached them, moved aside first so that this build's maps start
    /// empty beside them. A take-over interrupted after its new probes attached is redone from
    /// the start while the old ones are still attached, and finished (the old maps removed) once
    /// they are not.
    pub(super) fn find(bpffs: &Path, current: &Path) -> Result<Self, ProbeError> {
        let mut found = Self {
            dir: None,
            from_abi: 0,
            unconverted: Vec::new(),
        };
        let mut previous = None;
        for (version, path) in other_versions(bpffs) {
            match version {
                Some(v) if v > ABI_VERSION => {
                    return Err(ProbeError::NewerAbi {
                        found: v,
                        path: path.clone(),
                    });
                }
                Some(previous::ABI_VERSION) => previous = Some(path),
                _ => {
                    let why = format!(
                        "{}: no conversion from it (this build converts ABI {} only); removed",
                        path.display(),
                        previous::ABI_VERSION
                    );
                    warn!("pins of another ABI: {why}");
                    std::fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
                    found.unconverted.push(why);
                }
            }
        }
        let replaced = replaced_dir(bpffs);
        let (dir, from_abi) = match previous {
            Some(dir) => (dir, previous::ABI_VERSION),
            None if replaced.exists() => (replaced, ABI_VERSION),
            None if attached_by_another_object(current) => {
                // Another build of this ABI: its maps are taken over like an older ABI's, so its
                // programs run until this build's are attached and hold everything.
                std::fs::rename(current, &replaced).map_err(io_err("move aside", current))?;
                info!(from = %current.display(), to = %replaced.display(), "another eBPF object of this ABI is attached: taking its maps over");
                return Ok(Self {
                    dir: Some(replaced),
                    from_abi: ABI_VERSION,
                    ..found
                });
            }
            None => return Ok(found),
        };
        if !attached(&dir) {
            // Its programs are gone (a take-over stopped after detaching them, or a daemon
            // that removed its links): nothing counts into these maps any more.
            let why = format!(
                "{}: its probes were not attached; removed, not converted",
                dir.display()
            );
            warn!("pins to take over: {why}");
            std::fs::remove_dir_all(&dir).map_err(io_err("remove", &dir))?;
            found.unconverted.push(why);
            return Ok(found);
        }
        if current.exists() {
            warn!(
                dir = %current.display(),
                "a take-over of earlier probes was interrupted; starting it again"
            );
            std::fs::remove_dir_all(current).map_err(io_err("remove", current))?;
        }
        info!(dir = %dir.display(), from = from_abi, to = ABI_VERSION, "taking over the probes attached before");
        Ok(Self {
            dir: Some(dir),
            from_abi,
            ..found
        })
    }

    /// Whether there is something to take over.
    pub(super) fn taking_over(&self) -> bool {
        self.dir.is_some()
    }

    /// What [`Self::find`] removed unconverted, where nothing is taken over.
    pub(super) fn report(&self) -> TakeOver {
        TakeOver {
            unconverted: self.unconverted.clone(),
            ..TakeOver::default()
        }
    }

    /// Step 1: copies the maps the new programs need from their first call (see the module
    /// docs) into `new`'s.
    pub(super) fn copy_settled(&self, new: &Path) -> Result<TakeOver, ProbeError> {
        use gpud_common::maps as m;
        use previous as p;
        let mut report = TakeOver {
            from_abi: self.from_abi,
            unconverted: self.unconverted.clone(),
            ..TakeOver::default()
        };
        let Some(old) = &self.dir else {
            return Ok(report);
        };
        // Same layouts in both ABIs: entry by entry.
        macro_rules! copy {
            ($k:ty, $v:ty, $name:expr) => {
                report
                    .copied
                    .insert($name, copy_hash::<$k, $v>(old, new, $name)?);
            };
        }
        copy!(p::UsageKey, p::KernelLimit, m::LIMITS);
        copy!(u64, u64, m::SCHED_ALLOW);
        copy!(p::ObjKey, u32, m::HELD_GROUPS);
        copy!(p::GuardKey, u64, m::GUARD_COUNTS);
        copy!(u64, p::GuardBucket, m::GUARD_BUCKET);
        report.copied.insert(
            m::ANCESTRY,
            copy_ancestry(old, new, self.from_abi, Replace::Yes)?,
        );
        copy!(u32, p::ProcEntry, m::PROCS);
        copy!(u64, p::IoctlCounts, m::CGROUPS);
        copy!(u64, u32, m::SCHED_FILES);
        copy!(p::ObjKey, u64, m::SCHED_GROUPS);
        report.copied.insert(m::TRACKED, copy_tracked(old, new)?);
        let counters = if self.from_abi == ABI_VERSION {
            gpud_common::stat::COUNT
        } else {
            p::STAT_COUNT
        };
        report
            .copied
            .insert(m::STATS, copy_stats(old, new, counters)?);
        Ok(report)
    }

    /// Steps 3 to 6, once the new programs are attached: adopts every object, releases those
    /// freed meanwhile, detaches the old programs, and returns the old event ring for the daemon
    /// to read. Before the old links go, an error leaves them attached.
    pub(super) fn finish(
        self,
        runs: &KernelRuns,
        new: &Path,
        report: &mut TakeOver,
    ) -> Result<Option<RingBuf<MapData>>, ProbeError> {
        use gpud_common::maps as m;
        let Some(dir) = self.dir.clone() else {
            return Ok(None);
        };
        let old_objects = OldObjects::open(&dir, self.from_abi)?;
        let new_objects = open::<HashMap<MapData, ObjKey, ObjEntry>>(new, m::OBJECTS)?;
        // Charges some object in the new maps holds already (the new programs recorded a
        // duplicate of adopted memory, or an allocation): adopting another holder shares it.
        let mut held: BTreeSet<u64> = map_entries(&new_objects)
            .into_iter()
            .map(|(_, e)| e.charge)
            .filter(|c| *c != 0)
            .collect();
        // Processes the old filter marked since the copy, and cgroups first charged since: the
        // new programs follow them from here, and adopted memory is charged up their ancestry.
        mark_tracked(runs, &dir, new)?;
        // Only the records not there yet: a walk of the new programs may be reading the others.
        copy_ancestry(&dir, new, self.from_abi, Replace::No)?;
        // Every object, then those made while adopting (the new programs saw most of them).
        let mut adopted: StdHashMap<ObjKey, u64> = StdHashMap::new();
        for _ in 0..2 {
            for (key, entry) in old_objects.entries() {
                if adopted.get(&key) == Some(&entry.serial) {
                    continue;
                }
                adopt_one(runs, key, &entry, &mut held, report)?;
                adopted.insert(key, entry.serial);
            }
        }
        // An object freed before its adoption (the new programs ignored a free of what they did
        // not know) is gone from the old map, whose programs still run: released by serial.
        release_freed(runs, &old_objects, &adopted, report);

        // Step 4: the old programs detach with their links' pins.
        let links = dir.join("links");
        std::fs::remove_dir_all(&links).map_err(io_err("remove", &links))?;
        info!(dir = %dir.display(), "the probes taken over are detached");
        // Step 5. Frees the new programs saw after the last look were theirs to release; this
        // finds nothing more unless a free raced that look.
        release_freed(runs, &old_objects, &adopted, report);
        let ring = match pinned::<RingBuf<MapData>>(&dir, m::EVENTS) {
            Ok(r) => Some(r),
            Err(e) => {
                report.unconverted.push(format!(
                    "{}: its unread events cannot be read: {}",
                    m::EVENTS,
                    crate::report::Chain(&e)
                ));
                None
            }
        };
        // Step 6: the maps stay alive while the ring's descriptor is open.
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            warn!(dir = %dir.display(), "removing the pins taken over: {e}");
        }
        for why in &report.unconverted {
            warn!("not taken over: {why}");
        }
        info!(
            from = report.from_abi,
            adopted = report.adopted,
            present = report.present,
            released = report.released,
            no_room = report.no_room,
            "took over the maps of the probes attached before"
        );
        Ok(ring)
    }
}

/// Releases from the new maps every adopted object the old map no longer holds with the
/// serial it was adopted with (freed, or freed and made again); a second release of one
/// finds nothing.
fn release_freed(
    runs: &KernelRuns,
    old_objects: &OldObjects,
    adopted: &StdHashMap<ObjKey, u64>,
    report: &mut TakeOver,
) {
    let now: StdHashMap<ObjKey, u64> = old_objects
        .entries()
        .into_iter()
        .map(|(k, e)| (k, e.serial))
        .collect();
    for (key, serial) in adopted {
        if now.get(key) == Some(serial) {
            continue;
        }
        match runs.release(*key, *serial, false) {
            Ok(true) => report.released += 1,
            Ok(false) => {}
            Err(e) => report
                .unconverted
                .push(format!("releasing {key:?}: {}", crate::report::Chain(&e))),
        }
    }
}

/// The `OBJECTS` map taken over, in its ABI's layout.
enum OldObjects {
    /// This ABI's (another eBPF object of it).
    Current(HashMap<MapData, ObjKey, ObjEntry>),
    /// The previous ABI's, whose entries have no flags.
    Previous(HashMap<MapData, ObjKey, previous::ObjEntry>),
}

impl OldObjects {
    fn open(dir: &Path, from_abi: u32) -> Result<Self, ProbeError> {
        let name = gpud_common::maps::OBJECTS;
        Ok(if from_abi == ABI_VERSION {
            Self::Current(open(dir, name)?)
        } else {
            Self::Previous(open(dir, name)?)
        })
    }

    /// Every entry, as this ABI lays it out (the adopting program sets the flags).
    fn entries(&self) -> Vec<(ObjKey, ObjEntry)> {
        match self {
            Self::Current(map) => map_entries(map),
            Self::Previous(map) => map_entries(map)
                .into_iter()
                .map(|(k, e)| (k, e.into()))
                .collect(),
        }
    }
}

/// Adopts one object, sharing its charge where another holder is recorded.
fn adopt_one(
    runs: &KernelRuns,
    key: ObjKey,
    entry: &ObjEntry,
    held: &mut BTreeSet<u64>,
    report: &mut TakeOver,
) -> Result<(), ProbeError> {
    let first = entry.charge == 0 || !held.contains(&entry.charge);
    match runs.adopt(key, entry, first)? {
        Adopted::Yes => {
            report.adopted += 1;
            if entry.charge != 0 {
                held.insert(entry.charge);
            }
        }
        Adopted::Present => report.present += 1,
        Adopted::Full => report.no_room += 1,
    }
    Ok(())
}

/// `ProbeError::TakeMap` for `name`.
fn map_err(name: &'static str) -> impl Fn(MapError) -> ProbeError {
    move |source| ProbeError::TakeMap { name, source }
}

/// The map `name` pinned under `dir`.
fn open<T: TryFrom<Map, Error = MapError>>(
    dir: &Path,
    name: &'static str,
) -> Result<T, ProbeError> {
    pinned(dir, name).map_err(map_err(name))
}

/// Copies every entry of the hash map `name` from `old` to `new` (same key and value types:
/// a layout that changes gets a converting copy of its own); the entries copied.
fn copy_hash<K: aya::Pod, V: aya::Pod>(
    old: &Path,
    new: &Path,
    name: &'static str,
) -> Result<usize, ProbeError> {
    let from: HashMap<MapData, K, V> = open(old, name)?;
    let mut to: HashMap<MapData, K, V> = open(new, name)?;
    let entries = map_entries(&from);
    for (k, v) in &entries {
        to.insert(k, v, 0).map_err(map_err(name))?;
    }
    Ok(entries.len())
}

/// Whether a copy replaces the entries the new map holds already.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Replace {
    Yes,
    No,
}

/// Copies the `ANCESTRY` records of pins of ABI `from_abi` into `new`'s, converted where ABI 7's
/// layout is read, each with nothing known of its levels' limits: a record's `limits_seen` word
/// is of the old `LIMITS_GEN`'s generations, which the new map does not continue. The records
/// copied.
fn copy_ancestry(
    old: &Path,
    new: &Path,
    from_abi: u32,
    replace: Replace,
) -> Result<usize, ProbeError> {
    use gpud_common::{Ancestry, maps::ANCESTRY};
    let records: Vec<(u64, Ancestry)> = if from_abi == ABI_VERSION {
        let from: HashMap<MapData, u64, Ancestry> = open(old, ANCESTRY)?;
        map_entries(&from)
            .into_iter()
            .map(|(k, a)| {
                (
                    k,
                    Ancestry {
                        limits_seen: 0,
                        ..a
                    },
                )
            })
            .collect()
    } else {
        let from: HashMap<MapData, u64, previous::Ancestry> = open(old, ANCESTRY)?;
        map_entries(&from)
            .into_iter()
            .map(|(k, a)| (k, a.into()))
            .collect()
    };
    let mut to: HashMap<MapData, u64, Ancestry> = open(new, ANCESTRY)?;
    let flags = match replace {
        Replace::Yes => 0,
        Replace::No => super::BPF_NOEXIST,
    };
    let mut copied = 0;
    for (k, a) in &records {
        match to.insert(k, a, flags) {
            Ok(()) => copied += 1,
            Err(MapError::SyscallError(e))
                if replace == Replace::No && e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(map_err(ANCESTRY)(e)),
        }
    }
    Ok(copied)
}

/// Copies the words of the tracked-process filter that mark a process; the words copied.
fn copy_tracked(old: &Path, new: &Path) -> Result<usize, ProbeError> {
    let name = gpud_common::maps::TRACKED;
    let from: Array<MapData, u64> = open(old, name)?;
    let mut to: Array<MapData, u64> = open(new, name)?;
    let mut n = 0;
    for (i, word) in array_entries(&from) {
        if word != 0 && i < to.len() {
            to.set(i, word, 0).map_err(map_err(name))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Marks in the new filter (through `gpud_seed`, as the kernel marks) every process the old
/// one marks: those it marked after [`copy_tracked`].
fn mark_tracked(runs: &KernelRuns, old: &Path, new: &Path) -> Result<(), ProbeError> {
    let name = gpud_common::maps::TRACKED;
    let from: Array<MapData, u64> = open(old, name)?;
    let to: Array<MapData, u64> = open(new, name)?;
    let mut marked = vec![0u64; to.len() as usize];
    for (i, word) in array_entries(&to) {
        if let Some(w) = marked.get_mut(i as usize) {
            *w = word;
        }
    }
    for (i, was) in array_entries(&from) {
        let Some(&is) = marked.get(i as usize) else {
            continue;
        };
        for slot in 0..TRACKED_PER_WORD {
            let shift = slot * 8;
            if (was >> shift) & 0xff != 0 && (is >> shift) & 0xff == 0 {
                runs.seed(i * TRACKED_PER_WORD + slot)?;
            }
        }
    }
    Ok(())
}

/// Copies the first `counters` health counters (the previous ABI's [`previous::STAT_COUNT`], the
/// same indices) so that they keep growing across the upgrade; the counters copied.
fn copy_stats(old: &Path, new: &Path, counters: u32) -> Result<usize, ProbeError> {
    let name = gpud_common::maps::STATS;
    let from: PerCpuArray<MapData, u64> = open(old, name)?;
    let mut to: PerCpuArray<MapData, u64> = open(new, name)?;
    let n = counters.min(from.len()).min(to.len());
    for i in 0..n {
        let values = from.get(&i, 0).map_err(map_err(name))?;
        to.set(i, values, 0).map_err(map_err(name))?;
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bpffs stand-in: `gpud/v<N>` directories, with a pinned link directory where `attached`.
    struct Bpffs(PathBuf);

    impl Bpffs {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Bpffs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn bpffs(versions: &[(u32, bool)]) -> Bpffs {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            Bpffs(std::env::temp_dir().join(format!("gpud-takeover-{}-{n}", std::process::id())));
        for (v, attached) in versions {
            let base = dir.path().join("gpud").join(format!("v{v}"));
            std::fs::create_dir_all(base.join("links")).expect("mkdir");
            if *attached {
                std::fs::create_dir_all(base.join("links/0123-tracepoint-react")).expect("mkdir");
            }
        }
        dir
    }

    fn base(dir: &Bpffs, v: u32) -> PathBuf {
        dir.path().join("gpud").join(format!("v{v}"))
    }

    #[test]
    fn pins_of_a_newer_abi_are_refused_and_left_alone() {
        let dir = bpffs(&[(ABI_VERSION + 1, true), (previous::ABI_VERSION, true)]);
        let err = Previous::find(dir.path(), &base(&dir, ABI_VERSION))
            .err()
            .expect("refused");
        assert!(matches!(err, ProbeError::NewerAbi { found, .. } if found == ABI_VERSION + 1));
        assert!(
            err.to_string().contains("will not drop their accounting"),
            "{err}"
        );
        assert!(base(&dir, ABI_VERSION + 1).exists());
        assert!(base(&dir, previous::ABI_VERSION).exists());
    }

    #[test]
    fn the_previous_abi_is_taken_over_and_older_ones_removed_by_name() {
        let dir = bpffs(&[
            (previous::ABI_VERSION - 1, true),
            (previous::ABI_VERSION, true),
        ]);
        let found = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        assert_eq!(found.dir, Some(base(&dir, previous::ABI_VERSION)));
        assert_eq!(found.from_abi, previous::ABI_VERSION);
        assert!(!base(&dir, previous::ABI_VERSION - 1).exists());
        assert_eq!(found.unconverted.len(), 1);
        assert!(found.unconverted[0].contains(&format!("v{}", previous::ABI_VERSION - 1)));
    }

    #[test]
    fn an_interrupted_take_over_starts_again_while_the_old_probes_are_attached() {
        let dir = bpffs(&[(previous::ABI_VERSION, true), (ABI_VERSION, true)]);
        let found = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        assert!(found.taking_over());
        assert!(!base(&dir, ABI_VERSION).exists(), "the half-made pins stay");
    }

    #[test]
    fn previous_pins_without_programs_are_removed_not_converted() {
        let dir = bpffs(&[(previous::ABI_VERSION, false), (ABI_VERSION, true)]);
        let found = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        assert!(!found.taking_over());
        assert!(!base(&dir, previous::ABI_VERSION).exists());
        assert!(base(&dir, ABI_VERSION).exists(), "this ABI's pins are kept");
        assert!(found.report().as_map().contains_key("unconverted"));
    }

    #[test]
    fn another_objects_pins_of_this_abi_are_moved_aside_and_taken_over() {
        // `bpffs` names the links as another object's ("0123-…").
        let dir = bpffs(&[(ABI_VERSION, true)]);
        let found = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        let aside = replaced_dir(dir.path());
        assert_eq!(found.dir.as_deref(), Some(aside.as_path()));
        assert_eq!(found.from_abi, ABI_VERSION);
        assert!(!base(&dir, ABI_VERSION).exists());
        // Interrupted after that: the moved pins are found again, the half-made ones go.
        std::fs::create_dir_all(base(&dir, ABI_VERSION).join("links")).expect("mkdir");
        let again = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        assert_eq!(again.dir, Some(aside.clone()));
        assert!(!base(&dir, ABI_VERSION).exists());
        // A failed take-over puts them back where they were.
        std::fs::create_dir_all(base(&dir, ABI_VERSION).join("links/new")).expect("mkdir");
        put_back(dir.path(), &base(&dir, ABI_VERSION));
        assert!(!aside.exists());
        assert!(
            base(&dir, ABI_VERSION)
                .join("links/0123-tracepoint-react")
                .exists()
        );
        assert!(!base(&dir, ABI_VERSION).join("links/new").exists());
    }

    #[test]
    fn this_objects_own_links_are_not_taken_over() {
        let dir = bpffs(&[]);
        let links = base(&dir, ABI_VERSION).join("links").join(format!(
            "{}-tracepoint-react",
            super::super::attach::object_hash()
        ));
        std::fs::create_dir_all(&links).expect("mkdir");
        let found = Previous::find(dir.path(), &base(&dir, ABI_VERSION)).expect("find");
        assert!(!found.taking_over());
        assert!(links.exists());
    }

    #[test]
    fn the_report_is_empty_without_a_take_over_and_names_what_was_not_converted() {
        assert!(TakeOver::default().as_map().is_empty());
        let r = TakeOver {
            from_abi: 7,
            adopted: 3,
            unconverted: vec!["v5: no conversion".into()],
            ..TakeOver::default()
        };
        let m = r.as_map();
        assert_eq!(m["from_abi"], "7");
        assert_eq!(m["objects_adopted"], "3");
        assert_eq!(m["unconverted"], "v5: no conversion");
    }
}
