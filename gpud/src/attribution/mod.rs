//! Attribution: who uses NVIDIA devices. Reads the probes' per-cgroup and per-process counters,
//! maps cgroup ids to paths, seeds processes found holding devices, and forgets processes and
//! cgroups that are gone. Owned by the state task (`daemon`); nothing here is shared.

mod counters;
pub mod memory;
pub mod scan;

use std::collections::HashMap;

use gpud_common::{IoctlCounts, PROC_OPENED, PROC_SCANNED, ProcEntry, stat};
use tracing::{debug, info, warn};

use crate::cgroupfs::{CgroupError, CgroupFs};
use crate::{
    probes::{
        AttachMode, BPF_NOEXIST, KernelMaps, KernelRuns, Matcher, Probes, events::KernelEvent,
        map_entries,
    },
    report::Chain,
};
pub use counters::KernelCounters;
pub use memory::MemoryView;

/// Most process exits answered by one check of control files while events keep coming.
const EXIT_BATCH: u32 = 256;

#[derive(Debug, thiserror::Error)]
pub enum AttributionError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("cannot read a kernel map")]
    Map(#[from] aya::maps::MapError),
    #[error(transparent)]
    Probes(#[from] crate::probes::ProbeError),
    #[error("the charges of {member} cannot also go to {group}: {why}")]
    ShareRefused {
        member: String,
        group: String,
        why: &'static str,
    },
}

/// Whether a tracked process is shown as a user of NVIDIA files (a process forked by one is
/// tracked, but only shown once it opens or uses a device itself).
fn visible(p: &ProcEntry) -> bool {
    p.flags & (PROC_OPENED | PROC_SCANNED) != 0 || p.counts.total() > 0
}

/// One attributed cgroup: what its processes did on NVIDIA files and the GPU memory charged to
/// it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupView {
    /// cgroup v2 id (the inode number of its directory).
    pub id: u64,
    /// Path relative to the cgroup v2 root.
    pub path: String,
    /// Live attributed processes in it, ordered.
    pub pids: Vec<u32>,
    /// Its ioctls on NVIDIA files by class.
    pub ioctls: IoctlCounts,
    /// GPU memory charged to it (with its descendants) and its limits.
    pub memory: MemoryView,
    /// The workload names the runtime integrations reported for it (the state task adds them;
    /// the attribution knows none).
    pub workload: std::collections::BTreeMap<String, String>,
}

/// One live attributed process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessView {
    pub pid: u32,
    /// cgroup at its last open or ioctl of an NVIDIA file, and that cgroup's path (empty if it
    /// was removed).
    pub cgroup_id: u64,
    pub cgroup: String,
    /// Its ioctls on NVIDIA files by class.
    pub ioctls: IoctlCounts,
}

/// A channel group (TSG) a process allocated: what the compute controls address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChannelGroup {
    /// The allocating process.
    pub pid: u32,
    /// RM device instance (the GPU index), or `GPU_UNKNOWN`.
    pub gpu: u32,
    /// Its client and its handle there.
    pub client: u32,
    pub handle: u32,
}

/// Another RM object of a process that the compute controls address: a channel (what
/// `FIFO_DISABLE_CHANNELS` lists) or a subdevice (what it is issued on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RmRef {
    /// RM device instance (the GPU index), or `GPU_UNKNOWN`.
    pub gpu: u32,
    pub client: u32,
    pub handle: u32,
}

/// What the compute controls need of one process: its channel groups (runlist and timeslice
/// controls), its channels and its subdevices (holding its work with `FIFO_DISABLE_CHANNELS`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantObjects {
    pub groups: Vec<ChannelGroup>,
    pub channels: Vec<RmRef>,
    pub subdevices: Vec<RmRef>,
}

/// The attribution state: the probes' accounting maps and the programs that change them, owned
/// here (the probes themselves, their links and settings, are the core's).
pub struct Attribution {
    runs: KernelRuns,
    /// Tracepoint mode has no file-release hook: exits are checked instead.
    mode: AttachMode,
    maps: KernelMaps,
    cgroups: CgroupFs,
    matcher: Matcher,
    /// The kernel's `events_lost` counter when last looked at.
    events_lost_seen: u64,
    /// A tracked process exited (tracepoint mode, which has no file-release hook) and the
    /// files its clients were made through have not been checked since: the check walks the
    /// object table, so a burst of exits is answered with one walk (see
    /// [`Self::check_pending_files`]). Counts the exits.
    exits_unchecked: u32,
}

impl Attribution {
    /// Takes the accounting maps and the run programs of `probes`.
    pub fn new(
        probes: &mut Probes,
        cgroups: CgroupFs,
        matcher: Matcher,
    ) -> Result<Self, AttributionError> {
        Ok(Self {
            runs: probes.runs()?,
            mode: probes.mode(),
            maps: probes.take_maps()?,
            cgroups,
            matcher,
            events_lost_seen: 0,
            exits_unchecked: 0,
        })
    }

    /// Ring-buffer records the kernel could not deliver since the last call (the buffer was
    /// full: the daemon stopped or fell behind). What they would have said is caught up by the
    /// periodic sweeps and reconciliation; the count is what operators alert on.
    pub fn newly_lost_events(&mut self) -> u64 {
        let lost = counters::summed(&self.maps.stats, stat::EVENTS_LOST);
        let new = lost.saturating_sub(self.events_lost_seen);
        self.events_lost_seen = lost;
        new
    }

    /// What counts as an NVIDIA file (for scans run off the state task).
    pub fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    pub fn cgroup_root(&self) -> &std::path::Path {
        self.cgroups.root()
    }

    fn procs(&self) -> Vec<(u32, ProcEntry)> {
        map_entries(&self.maps.procs)
    }

    fn pids_by_cgroup(&self) -> HashMap<u64, Vec<u32>> {
        let mut by: HashMap<u64, Vec<u32>> = HashMap::new();
        for (pid, p) in self.procs() {
            if visible(&p) {
                by.entry(p.cgroup_id).or_default().push(pid);
            }
        }
        for v in by.values_mut() {
            v.sort_unstable();
        }
        by
    }

    /// The attributed processes of one cgroup, found among its members (`cgroup.procs`) rather
    /// than by walking the whole kernel process table: one lookup per member, so a query stays
    /// cheap however many processes the host tracks. Same rule as [`Self::list`]: visible, and
    /// in this cgroup at their last open or ioctl.
    fn pids_in(&self, path: &str, id: u64) -> Vec<u32> {
        let file = self
            .cgroups
            .root()
            .join(path.trim_start_matches('/'))
            .join("cgroup.procs");
        // Gone or unreadable: the cgroup was just removed; it has no members then.
        let members = std::fs::read_to_string(file).unwrap_or_default();
        let mut pids: Vec<u32> = members
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|pid| {
                self.maps
                    .procs
                    .get(pid, 0)
                    .is_ok_and(|p| p.cgroup_id == id && visible(&p))
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Every attributed cgroup that still exists, ordered by path.
    pub fn list(&mut self) -> Vec<CgroupView> {
        let mut pids = self.pids_by_cgroup();
        let mut counts: HashMap<u64, IoctlCounts> =
            map_entries(&self.maps.cgroups).into_iter().collect();
        for id in pids.keys() {
            counts.entry(*id).or_default();
        }
        // Memory figures of all cgroups from one walk of the usage and limit maps; a cgroup with
        // memory or a limit (but no ioctl of its own, e.g. a parent) is listed too.
        let mut memory = self.memory_views(None);
        for (id, v) in &memory {
            if v.current.get("all").is_some_and(|b| *b != 0) || !v.max.is_empty() {
                counts.entry(*id).or_default();
            }
        }
        let mut paths = self.cgroups.paths_of(counts.keys().copied());
        let mut out: Vec<CgroupView> = counts
            .into_iter()
            .filter_map(|(id, ioctls)| {
                // A cgroup removed since is left to the sweep.
                let path = paths.remove(&id).flatten()?;
                Some(CgroupView {
                    id,
                    path,
                    pids: pids.remove(&id).unwrap_or_default(),
                    ioctls,
                    memory: memory.remove(&id).unwrap_or_else(MemoryView::empty),
                    workload: Default::default(),
                })
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// Every live attributed process, ordered by pid.
    pub fn processes(&mut self) -> Vec<ProcessView> {
        let procs: Vec<(u32, ProcEntry)> = self
            .procs()
            .into_iter()
            .filter(|(_, p)| visible(p))
            .collect();
        let paths = self
            .cgroups
            .paths_of(procs.iter().map(|(_, p)| p.cgroup_id));
        let mut out: Vec<ProcessView> = procs
            .into_iter()
            .map(|(pid, p)| ProcessView {
                pid,
                cgroup_id: p.cgroup_id,
                cgroup: paths
                    .get(&p.cgroup_id)
                    .cloned()
                    .flatten()
                    .unwrap_or_default(),
                ioctls: p.counts,
            })
            .collect();
        out.sort_by_key(|r| r.pid);
        out
    }

    /// One cgroup by path (relative to the cgroup v2 root). An existing cgroup that never used a
    /// device reads as zeros; a path that is not a cgroup is an error.
    pub fn get(&mut self, path: &str) -> Result<CgroupView, AttributionError> {
        let path = CgroupFs::normalize(path)?;
        let id = self.cgroups.id_of(&path)?;
        let counts = match self.maps.cgroups.get(&id, 0) {
            Ok(c) => c,
            Err(aya::maps::MapError::KeyNotFound) => IoctlCounts::default(),
            Err(e) => return Err(e.into()),
        };
        let pids = self.pids_in(&path, id);
        Ok(CgroupView {
            id,
            path,
            pids,
            ioctls: counts,
            memory: self.memory_of(id),
            workload: Default::default(),
        })
    }

    /// Tracks processes found holding NVIDIA files that the probes do not know yet.
    pub fn scan(&mut self) -> usize {
        let holders = scan::holders(&self.matcher);
        self.track_holders(holders)
    }

    /// Tracks the given holders (from [`scan::holders`]) that the probes do not know yet.
    pub fn track_holders(&mut self, holders: std::collections::BTreeSet<u32>) -> usize {
        let known: std::collections::HashSet<u32> =
            self.procs().into_iter().map(|(pid, _)| pid).collect();
        let mut added = 0;
        for pid in holders {
            if known.contains(&pid) {
                continue;
            }
            let Some(path) = CgroupFs::path_of_pid(pid) else {
                continue;
            };
            let Ok(cgroup_id) = self.cgroups.id_of(&path) else {
                continue;
            };
            let entry = ProcEntry {
                cgroup_id,
                flags: PROC_SCANNED,
                ..ProcEntry::default()
            };
            match self.maps.procs.insert(pid, entry, BPF_NOEXIST) {
                Ok(()) => {
                    info!(pid, cgroup = %path, "found process holding an NVIDIA file");
                    added += 1;
                }
                // The probes saw it meanwhile.
                Err(e) => debug!(pid, "scan insert skipped: {e}"),
            }
            if let Err(e) = self.runs.seed(pid) {
                warn!(pid, "cannot mark process as tracked: {}", Chain(&e));
            }
        }
        added
    }

    /// Forgets processes that no longer exist and cgroups that were removed and hold no process.
    pub fn sweep(&mut self) {
        let procs = self.procs();
        for (pid, _) in &procs {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                debug!(pid, "forgetting exited process");
                let _ = self.maps.procs.remove(pid);
            }
        }
        let live_cgroups: std::collections::HashSet<u64> =
            procs.iter().map(|(_, p)| p.cgroup_id).collect();
        let ids: Vec<(u64, IoctlCounts)> = map_entries(&self.maps.cgroups)
            .into_iter()
            .filter(|(id, _)| !live_cgroups.contains(id))
            .collect();
        let paths = self.cgroups.paths_of(ids.iter().map(|(id, _)| *id));
        for (id, counts) in ids {
            if paths.get(&id).is_some_and(Option::is_some) {
                continue;
            }
            info!(
                cgroup_id = id,
                ioctls = counts.total(),
                "cgroup removed; dropping its counts"
            );
            let _ = self.maps.cgroups.remove(&id);
        }
    }

    /// Reacts to what the probes report about processes and objects: releases the kernel
    /// leaves to the daemon; the maps already hold the rest.
    pub fn on_kernel_event(&mut self, ev: &KernelEvent) {
        match *ev {
            KernelEvent::ProcessTracked {
                pid,
                cgroup_id,
                parent,
            } => match self.cgroups.path_of(cgroup_id) {
                // The path as text (a journal field), the id where the path is unknown.
                Some(p) => debug!(pid, parent, cgroup = %p, "process attributed"),
                None => debug!(pid, parent, cgroup_id, "process attributed"),
            },
            KernelEvent::ProcessExited { pid } => {
                debug!(pid, "attributed process exited");
                if self.mode == AttachMode::Tracepoint {
                    self.exits_unchecked += 1;
                    // Under a sustained stream of events the queue may never run empty.
                    if self.exits_unchecked >= EXIT_BATCH {
                        self.check_pending_files();
                    }
                }
            }
            KernelEvent::TreeFreed {
                client,
                object,
                clock,
            } => {
                self.release_tree(client, object, clock);
            }
            KernelEvent::FileReleased { file, clock } => {
                self.release_file(file, clock);
            }
            // The enforcement's and the guard's.
            KernelEvent::LimitCrossed(_)
            | KernelEvent::AllocationDenied(_)
            | KernelEvent::SchedulerGuarded(_) => {}
        }
    }

    /// Checks which control files are gone ([`Self::release_closed_files`]) if a process
    /// exited since the last check. The state task calls it when no further event is queued and
    /// before answering a query, so queries see it done and a storm of exits costs one walk, not
    /// one per exit. Returns whether a check ran.
    pub fn check_pending_files(&mut self) -> bool {
        if self.exits_unchecked > 0 {
            self.release_closed_files();
            return true;
        }
        false
    }

    /// Kills every process of the cgroup at `path` and its descendants (`cgroup.kill`).
    pub fn kill(&mut self, path: &str) -> Result<(), AttributionError> {
        Ok(self.cgroups.kill(path)?)
    }

    /// Path of a cgroup id, if it still exists.
    pub fn path_of(&mut self, id: u64) -> Option<String> {
        self.cgroups.path_of(id)
    }

    /// Id of a cgroup path (normalized first).
    pub fn id_of(&mut self, path: &str) -> Result<(String, u64), AttributionError> {
        let path = CgroupFs::normalize(path)?;
        let id = self.cgroups.id_of(&path)?;
        Ok((path, id))
    }
}
