//! The scheduler guard's react-and-restore tier: where no pre-driver hook can refuse a tenant's
//! control and no rewrite can change it (tracepoints only under lockdown, or `deny_hook =
//! "none"`), the kernel side lets the call through and, at its exit, asks for it to be undone
//! (`GuardRestore` records in the event ring). This module owns undoing them:
//! - a timeslice above the caller's allowance is set back to the allowance on that channel
//!   group, through a `pidfd_getfd` copy of the caller's file (the compute law's path);
//! - channels of other processes disabled by `FIFO_DISABLE_CHANNELS` are enabled again, through
//!   a copy of each victim's own file, on a subdevice of the victim's client (the driver binds a
//!   client to the file that made it, so the victim's file is the one that works even after the
//!   caller was killed).
//!
//! Each goes through the process most likely to hold the file (the caller, the creator) and,
//! where none of them does any more (exited after handing the file to a forked child or over a
//! socket), through whichever process holds it now ([`through_a_holder`]).
//! - a read-back ([`ReadBack`]): after any tenant control on a control file with channel groups,
//!   the driver's timeslice of each of them is read (`GET_TIMESLICE`) and set back to the
//!   caller's allowance where above, whatever the guard saw at the call's entry (another thread
//!   may have rewritten the command or the parameters before the driver copied them).
//! - a sweep ([`Restorer::sweep`]), after the read-backs of a batch and at most every
//!   [`SWEEP_EVERY`]: every recorded channel group is put back on the runlist
//!   (`GPFIFO_SCHEDULE` enable, which clears its channels' disables) unless its own process
//!   holds it off (`ObjEntry::owner_holds`) or the compute law does (`HELD_GROUPS`; such a
//!   group is looked at again once let go). A `FIFO_DISABLE_CHANNELS` whose client list another
//!   thread turned from the caller's own client to a neighbour's once the guard had read it
//!   leaves nothing the driver answers a query of; this is what undoes it.
//! - a crossing allocation the react tier's `kill` left in a file another process holds is
//!   freed through that holder's file ([`super::crossing`]).
//! - a size check ([`SizeCheck`]): the driver's size of each memory object a limited cgroup
//!   makes is read (`GET_SURFACE_INFO`) and judged against the limits with what the probes
//!   charged ([`super::sizes`]); an object that takes its cgroup over a limit that way was
//!   raced past the probes, and gets the crossing's treatment: its caller killed, the object
//!   freed.
//! - a device check ([`DeviceCheck`]): the driver's GPU of each device a cgroup with a per-GPU
//!   limit makes is read ([`Controls::device_instance`]); a device on another GPU than the
//!   probes recorded, where the caller has a limit, was raced past them: its caller killed, the
//!   device freed with everything below it.
//! - a free check ([`FreeCheck`]): the driver is asked whether an object a limited cgroup freed
//!   is gone; one still held that the probes released (its handle raced) is unaccounted: its
//!   caller killed, the object freed.
//!
//! It runs on its own thread ([`spawn`]): the undo is a few blocking ioctls, and must not wait
//! behind the state task's work.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData};
use gpud_common::{
    OBJ_CHANNEL, OBJ_CHANNEL_GROUP, OBJ_CLIENT, OBJ_DEVICE, OBJ_SUBDEVICE, ObjEntry, ObjKey,
    rm::{sched, tsg},
};
use tracing::{debug, info, warn};

use super::{
    compute::channel::{ControlError, Controls, RmObject, holds},
    sizes::{Crossed, Excess, Sizes},
};
use crate::{
    probes::{
        KernelRuns, Matcher,
        events::{DeviceCheck, FreeCheck, LimitEvent, ReadBack, SizeCheck, Undo},
    },
    report::Chain,
};

/// What one sweep did ([`Restorer::sweep`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Groups put back on the runlist.
    pub scheduled: u32,
    /// Groups their own process holds off or has not put on the runlist yet, left alone.
    pub owner_held: u32,
    /// Groups the compute law holds, looked at again once let go.
    pub law_held: u32,
}

/// Why an undo could not be done.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("cannot take the kernel's run programs")]
    Runs(#[from] crate::probes::ProbeError),
    #[error("cannot open the pinned map {path}")]
    OpenMap {
        path: std::path::PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(transparent)]
    Control(#[from] ControlError),
    /// A disabled channel's client is not one the probes saw made (older than gpud).
    #[error("client {client:#x} of a disabled channel is unknown to gpud")]
    UnknownClient { client: u32 },
    #[error("client {client:#x} has no subdevice gpud knows of to enable its channels on")]
    NoSubdevice { client: u32 },
    #[error("cannot update the pinned map {map}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

/// What an undo did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// The channel group's timeslice set back to this many µs.
    Timeslice(u64),
    /// This many channels enabled again.
    Channels(u32),
    /// A read-back: this many channel groups read, of which `set_back` were above the allowance
    /// and set back to it.
    ReadBack { groups: u32, set_back: u32 },
}

/// What a size check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeChecked {
    /// The object was freed (or its handle reused) before the driver was asked.
    Gone,
    /// The driver did not answer for it (`status`): not a memory object it sizes.
    Unanswered { status: u32 },
    /// The driver holds `size` for it, `excess` beyond its charge; with what else the driver
    /// holds beyond the charges, the cgroup is within its limits.
    Within { size: u64, excess: u64 },
    /// The driver holds `size` where `charged` was charged, and what it holds beyond the
    /// charges takes a cgroup over its limit: under `kill`, every object whose excess counts
    /// against that limit was acted on (`acted`); else it is reported only.
    Crossed {
        size: u64,
        charged: u64,
        limit: Crossed,
        acted: Vec<Raced>,
    },
}

/// What the driver answered about an object ([`Restorer::ask_object`]).
enum Asked<T> {
    Answer(T),
    /// The object, or every process holding its file, is gone.
    Gone,
    /// The driver refused the question (`NV_STATUS`).
    Unanswered(u32),
}

/// What a device check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChecked {
    /// The device was freed (or its handle reused) before the driver was asked.
    Gone,
    /// The driver did not answer which GPU it is on (`status`).
    Unanswered { status: u32 },
    /// The driver made it on the GPU the probes recorded.
    Same { gpu: u32 },
    /// The driver made it on GPU `actual`, the probes recorded `recorded` (its caller changed
    /// `deviceId` while the driver copied it). Where `actual` has a limit over the caller
    /// (`limited`: the cgroup holding it) what is allocated under the device escapes it: under
    /// `kill` the maker is killed (`killed`) and the device freed with all below it (`freed`).
    Moved {
        recorded: u32,
        actual: u32,
        limited: Option<u64>,
        killed: bool,
        freed: Option<super::crossing::Outcome>,
    },
}

/// What a free check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FreeChecked {
    /// The driver no longer has the object, as the probes assumed.
    Gone,
    /// The handle names an object the probes recorded since the free: it is charged.
    Recorded,
    /// The driver did not answer for it (`status`).
    Unanswered { status: u32 },
    /// The driver still has the object the probes released with the free (another thread
    /// changed the handle before the driver copied it, and another object was freed): held
    /// uncharged. Under `kill` its caller is killed (`killed`) and the object freed, with
    /// everything below it, through a holder's file (`freed`).
    Survived { killed: bool, freed: bool },
}

/// An object whose excess took its cgroup over a limit, acted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Raced {
    /// Its maker, killed (`killed`: the signal was sent).
    pub pid: u32,
    pub object: ObjKey,
    /// What the driver held for it beyond the charge.
    pub excess: u64,
    pub killed: bool,
    /// The object freed where another process kept its file.
    pub freed: super::crossing::Outcome,
}

/// Undoes what tenants' controls did; see the module docs.
pub struct Restorer {
    controls: Controls,
    /// The kernel's release of an object's record and charge, for crossing allocations freed.
    runs: KernelRuns,
    /// The react tier kills the caller of a crossing allocation (`react_action = "kill"`): its
    /// allocation is freed where another process keeps the file.
    kill: bool,
    objects: HashMap<MapData, ObjKey, ObjEntry>,
    /// Files with channel groups, and whether a read-back is asked (`SCHED_FILES`).
    files: HashMap<MapData, u64, u32>,
    /// Channel groups by the file they were made through (`SCHED_GROUPS`).
    groups: HashMap<MapData, ObjKey, u64>,
    /// When `groups` was last pruned of groups and files that are gone.
    pruned: Option<Instant>,
    /// What the compute law holds (`HELD_GROUPS`: groups off the runlist, channels disabled).
    held: HashMap<MapData, ObjKey, u32>,
    /// A sweep is asked (a tenant's control returned since the last one).
    sweep_asked: bool,
    /// When the last sweep ran.
    swept: Option<Instant>,
    /// Groups a sweep left alone because the compute law held them: looked at again (every
    /// [`OWED_EVERY`]) until it lets them go, as a raced disable may have landed meanwhile.
    owed: BTreeSet<ObjKey>,
    /// The charges and limits the size checks are judged against, and the excess found.
    sizes: Sizes,
}

/// Runs `attempt` (an RM call on a tenant's client, through the process it is given) through
/// the first process that holds a file owning that client: `likely` in order (the caller, the
/// client's or object's creator), then, only when none of them does, every process holding an
/// NVIDIA file (the driver answers only through a file that owns the client, and `Controls`
/// says `NoFile` for the others). With no holder left, the last `Gone` or `NoFile`.
fn through_a_holder<T>(
    controls: &mut Controls,
    likely: &[Option<u32>],
    mut attempt: impl FnMut(&mut Controls, u32) -> Result<T, ControlError>,
) -> Result<T, ControlError> {
    let elsewhere =
        |e: &ControlError| matches!(e, ControlError::Gone { .. } | ControlError::NoFile { .. });
    let mut tried = vec![std::process::id()];
    let mut last = None;
    for pid in likely.iter().flatten().copied() {
        if tried.contains(&pid) {
            continue;
        }
        tried.push(pid);
        match attempt(controls, pid) {
            Err(e) if elsewhere(&e) => last = Some(e),
            done => return done,
        }
    }
    let matcher = controls.matcher().clone();
    for pid in crate::attribution::scan::holders(&matcher) {
        if tried.contains(&pid) {
            continue;
        }
        match attempt(controls, pid) {
            Err(e) if elsewhere(&e) => last = Some(e),
            done => return done,
        }
    }
    Err(last.unwrap_or(ControlError::Gone { pid: 0 }))
}

/// Least time between two sweeps: a tenant looping on controls costs the driver one
/// `GPFIFO_SCHEDULE` per recorded channel group per this, not one per call.
pub const SWEEP_EVERY: Duration = Duration::from_millis(10);

/// How often groups a sweep skipped while the compute law held them are looked at again.
pub const OWED_EVERY: Duration = Duration::from_millis(50);

/// `bpf_map_update_elem`'s flag: update an entry that exists, never make one.
const BPF_EXIST: u64 = 2;

/// How often at most the read-back prunes `SCHED_GROUPS` (a walk of the whole map).
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Opens the pinned hash map `name` under `pins`.
fn pinned<K: aya::Pod, V: aya::Pod>(
    pins: &Path,
    name: &str,
) -> Result<HashMap<MapData, K, V>, RestoreError> {
    crate::probes::pinned(pins, name).map_err(|source| RestoreError::OpenMap {
        path: pins.join(name),
        source,
    })
}

impl Restorer {
    /// `pins`: the probes' pin directory (the `OBJECTS` map, read for the victims' processes and
    /// subdevices); `kill`: the react tier kills crossing callers.
    pub fn new(
        matcher: Matcher,
        pins: &Path,
        runs: KernelRuns,
        kill: bool,
    ) -> Result<Self, RestoreError> {
        use gpud_common::maps;
        Ok(Self {
            controls: Controls::new(matcher, None),
            runs,
            kill,
            objects: pinned(pins, maps::OBJECTS)?,
            files: pinned(pins, maps::SCHED_FILES)?,
            groups: pinned(pins, maps::SCHED_GROUPS)?,
            pruned: None,
            held: pinned(pins, maps::HELD_GROUPS)?,
            sweep_asked: false,
            swept: None,
            owed: BTreeSet::new(),
            sizes: Sizes::new(
                pinned(pins, maps::USAGE)?,
                pinned(pins, maps::LIMITS)?,
                pinned(pins, maps::ANCESTRY)?,
            ),
        })
    }

    /// Asks the driver what it allocated for the object of `c` and judges the limits of its
    /// cgroup with it ([`super::sizes`]); under `kill` a crossing kills the caller and frees the
    /// object, as for an allocation the probes saw cross.
    pub fn check_size(&mut self, c: &SizeCheck) -> Result<SizeChecked, RestoreError> {
        let key = ObjKey {
            client: c.client,
            object: c.object,
        };
        let made = match self.objects.get(&key, 0) {
            Ok(e) if e.serial == c.serial => e,
            _ => return Ok(SizeChecked::Gone),
        };
        let size = match self.ask_object(c.pid, key, Controls::surface_size)? {
            Asked::Answer(size) => size,
            Asked::Gone => return Ok(SizeChecked::Gone),
            Asked::Unanswered(status) => return Ok(SizeChecked::Unanswered { status }),
        };
        // Counted against the caller's cgroup: a duplicate's record carries its source's
        // charge, which may be a neighbour's.
        let excess = Excess {
            pid: c.pid,
            serial: c.serial,
            gpu: c.gpu,
            bytes: size.saturating_sub(made.bytes),
            levels: self.sizes.levels(c.cgroup_id),
        };
        let over = excess.bytes;
        let objects = &self.objects;
        let crossed = self.sizes.note(key, excess, |k, serial| {
            objects.get(k, 0).is_ok_and(|e| e.serial == serial)
        });
        let Some((limit, raced)) = crossed else {
            return Ok(SizeChecked::Within { size, excess: over });
        };
        let mut acted = Vec::new();
        if self.kill {
            for (object, e) in raced {
                let killed = self.kill_maker(e.pid)?;
                let freed = super::crossing::free(
                    &mut self.controls,
                    &self.objects,
                    &self.runs,
                    e.pid,
                    object,
                );
                self.sizes.forget(&object);
                acted.push(Raced {
                    pid: e.pid,
                    object,
                    excess: e.bytes,
                    killed,
                    freed,
                });
            }
        }
        Ok(SizeChecked::Crossed {
            size,
            charged: made.bytes,
            limit,
            acted,
        })
    }

    /// Asks the driver which GPU the device of `c` is on. Where that is not the GPU the probes
    /// recorded and the actual GPU has a limit over the caller's cgroup, what the caller
    /// allocates under the device is charged where that limit does not see it: under `kill`
    /// the caller is killed and the device freed (with everything below it), as for an
    /// allocation that crossed the limit.
    pub fn check_device(&mut self, c: &DeviceCheck) -> Result<DeviceChecked, RestoreError> {
        let key = ObjKey {
            client: c.client,
            object: c.object,
        };
        match self.objects.get(&key, 0) {
            Ok(e) if e.serial == c.serial && e.kind == OBJ_DEVICE => {}
            _ => return Ok(DeviceChecked::Gone),
        }
        let actual = match self.ask_object(c.pid, key, Controls::device_instance)? {
            Asked::Answer(gpu) => gpu,
            Asked::Gone => return Ok(DeviceChecked::Gone),
            Asked::Unanswered(status) => return Ok(DeviceChecked::Unanswered { status }),
        };
        if actual == c.recorded {
            return Ok(DeviceChecked::Same { gpu: actual });
        }
        let levels = self.sizes.levels(c.cgroup_id);
        let limited = self.sizes.limited_on(&levels, actual);
        let (mut killed, mut freed) = (false, None);
        if self.kill && limited.is_some() {
            killed = self.kill_maker(c.pid)?;
            freed = Some(super::crossing::free(
                &mut self.controls,
                &self.objects,
                &self.runs,
                c.pid,
                key,
            ));
        }
        Ok(DeviceChecked::Moved {
            recorded: c.recorded,
            actual,
            limited,
            killed,
            freed,
        })
    }

    /// Asks the driver whether the object of `c`, which a limited caller freed and the probes
    /// released, is gone. Where it is not and the probes hold no record of it made since, it is
    /// held uncharged: under `kill` its caller is killed and the object freed.
    pub fn check_free(&mut self, c: &FreeCheck) -> Result<FreeChecked, RestoreError> {
        let key = ObjKey {
            client: c.client,
            object: c.object,
        };
        // A record made after the free is a reuse of the handle (a program that frees a handle
        // and makes it again does so once the free returned), charged. An older one is what the
        // free releases: the state task drops a device's or a client's subtree on its event,
        // maybe after this check.
        let remade = |objects: &HashMap<MapData, ObjKey, ObjEntry>| {
            objects.get(&key, 0).is_ok_and(|e| e.serial > c.at)
        };
        if remade(&self.objects) {
            return Ok(FreeChecked::Recorded);
        }
        match self.ask_object(c.pid, key, Controls::exists)? {
            Asked::Answer(true) => {}
            Asked::Answer(false) | Asked::Gone => return Ok(FreeChecked::Gone),
            Asked::Unanswered(status) => return Ok(FreeChecked::Unanswered { status }),
        }
        // Made again under the same handle while the driver was asked.
        if remade(&self.objects) {
            return Ok(FreeChecked::Recorded);
        }
        let (mut killed, mut freed) = (false, false);
        if self.kill {
            killed = self.kill_maker(c.pid)?;
            freed = matches!(
                self.ask_object(c.pid, key, Controls::free_on),
                Ok(Asked::Answer(()))
            );
        }
        Ok(FreeChecked::Survived { killed, freed })
    }

    /// Asks `ask` of the object at `key` made by process `pid`, through the first process that
    /// holds a file owning its client: the maker, the client's creator, then whoever holds the
    /// file now. The object gone (`NV_ERR_OBJECT_NOT_FOUND`) or no holder left is
    /// [`Asked::Gone`]; another refusal of the driver [`Asked::Unanswered`].
    fn ask_object<T>(
        &mut self,
        pid: u32,
        key: ObjKey,
        mut ask: impl FnMut(&mut Controls, RmObject) -> Result<T, ControlError>,
    ) -> Result<Asked<T>, RestoreError> {
        let likely = [Some(pid), self.creator_of(&key)];
        let got = through_a_holder(&mut self.controls, &likely, |ctl, pid| {
            ask(
                ctl,
                RmObject {
                    pid,
                    client: key.client,
                    object: key.object,
                },
            )
        });
        match got {
            Ok(answer) => Ok(Asked::Answer(answer)),
            Err(ControlError::Refused {
                status: gpud_common::rm::status::NV_ERR_OBJECT_NOT_FOUND,
                ..
            })
            | Err(ControlError::Gone { .. } | ControlError::NoFile { .. }) => Ok(Asked::Gone),
            Err(ControlError::Refused { status, .. }) => Ok(Asked::Unanswered(status)),
            Err(e) => Err(e.into()),
        }
    }

    /// Kills process `pid`, the maker of an object raced past the probes, through the pidfd kept
    /// from its own call (never a process that took its pid since): whether it was signalled.
    fn kill_maker(&mut self, pid: u32) -> Result<bool, RestoreError> {
        match self.controls.kill(pid, false) {
            Ok(()) => Ok(true),
            Err(ControlError::Gone { .. }) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }

    /// Reads back the timeslice of every channel group made through `r.file` and sets back to
    /// `r.allowed` those above it. The file's request is cleared first: a control that returns
    /// meanwhile asks again, so none is left unread.
    pub fn read_back(&mut self, r: &ReadBack) -> Result<Restored, RestoreError> {
        match self.files.insert(r.file, 0, BPF_EXIST) {
            Ok(()) => {}
            // The file was released meanwhile: its groups went with it.
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                return Ok(Restored::ReadBack {
                    groups: 0,
                    set_back: 0,
                });
            }
            Err(source) => {
                return Err(RestoreError::Map {
                    map: gpud_common::maps::SCHED_FILES,
                    source,
                });
            }
        }
        self.prune();
        let groups: Vec<ObjKey> = crate::probes::map_entries(&self.groups)
            .into_iter()
            .filter(|(_, file)| *file == r.file)
            .map(|(k, _)| k)
            .collect();
        let (mut read, mut set_back) = (0, 0);
        for g in groups {
            let mut params = tsg::TimesliceParams { timeslice_us: 0 };
            // The caller may have exited or let the file go: then the group's creator (a forked
            // worker's parent), or whoever holds the file now.
            let likely = [Some(r.pid), self.creator_of(&g)];
            let got = through_a_holder(&mut self.controls, &likely, |c, pid| {
                let group = RmObject {
                    pid,
                    client: g.client,
                    object: g.object,
                };
                c.control_on(group, tsg::GET_TIMESLICE, &mut params)
                    .map(|()| group)
            });
            let group = match got {
                Ok(group) => {
                    read += 1;
                    group
                }
                // Freed meanwhile, or no process left that holds its file (which the driver then
                // releases with the group).
                Err(
                    ControlError::Refused { .. }
                    | ControlError::Gone { .. }
                    | ControlError::NoFile { .. },
                ) => continue,
                Err(e) => return Err(e.into()),
            };
            if params.timeslice_us <= r.allowed {
                continue;
            }
            warn!(
                pid = group.pid,
                cgroup_id = r.cgroup_id,
                group = format_args!("{:#x}", g.object),
                timeslice_us = params.timeslice_us,
                allowed_us = r.allowed,
                "a tenant's channel group runs with a timeslice above its allowance, read back \
                 after its control: set back"
            );
            let mut back = tsg::TimesliceParams {
                timeslice_us: r.allowed,
            };
            self.controls
                .control_on(group, tsg::SET_TIMESLICE, &mut back)?;
            set_back += 1;
        }
        Ok(Restored::ReadBack {
            groups: read,
            set_back,
        })
    }

    /// A tenant's control returned: a sweep is owed.
    pub fn ask_sweep(&mut self) {
        self.sweep_asked = true;
    }

    /// When the next sweep is due: [`SWEEP_EVERY`] after the last where one is asked,
    /// [`OWED_EVERY`] after it where only groups the law held wait; `None` when neither.
    pub fn sweep_due(&self) -> Option<Instant> {
        let after = if self.sweep_asked {
            SWEEP_EVERY
        } else if !self.owed.is_empty() {
            OWED_EVERY
        } else {
            return None;
        };
        Some(self.swept.map_or_else(Instant::now, |at| at + after))
    }

    /// Puts back on the runlist every recorded channel group (where only groups the law held
    /// wait, those) that its own process put there and neither it nor the compute law holds
    /// off: the driver clears a group's channels' disables when it is put back (as the H200
    /// showed), so any disable another process raced into the driver is undone, whatever the
    /// guard read.
    pub fn sweep(&mut self) -> Result<Swept, RestoreError> {
        let full = std::mem::take(&mut self.sweep_asked);
        self.swept = Some(Instant::now());
        // The law's holds and this sweep's calls in one order (see `holds`).
        let _holds = holds();
        let held: BTreeSet<ObjKey> = crate::probes::map_entries(&self.held)
            .into_iter()
            .map(|(k, _)| match self.objects.get(&k, 0) {
                // A channel held disabled holds its group.
                Ok(e) if e.kind == OBJ_CHANNEL => ObjKey {
                    client: k.client,
                    object: e.parent,
                },
                _ => k,
            })
            .collect();
        let targets: Vec<ObjKey> = if full {
            self.prune();
            crate::probes::map_entries(&self.groups)
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        } else {
            self.owed.iter().copied().collect()
        };
        let mut out = Swept::default();
        for g in targets {
            self.owed.remove(&g);
            let Some(e) = self
                .objects
                .get(&g, 0)
                .ok()
                .filter(|e| e.kind == OBJ_CHANNEL_GROUP)
            else {
                continue;
            };
            if !e.owner_scheduled() || e.owner_holds() != 0 {
                out.owner_held += 1;
                continue;
            }
            if held.contains(&g) {
                self.owed.insert(g);
                out.law_held += 1;
                continue;
            }
            let mut params = tsg::ScheduleParams {
                enable: 1,
                ..Default::default()
            };
            let got = through_a_holder(&mut self.controls, &[Some(e.tgid)], |c, pid| {
                let group = RmObject {
                    pid,
                    client: g.client,
                    object: g.object,
                };
                c.control_on(group, tsg::GPFIFO_SCHEDULE, &mut params)
            });
            match got {
                Ok(()) => out.scheduled += 1,
                // Freed meanwhile, not schedulable yet (its channels not all set up), or no
                // process left that holds its file.
                Err(
                    ControlError::Refused { .. }
                    | ControlError::Gone { .. }
                    | ControlError::NoFile { .. },
                ) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Removes from `SCHED_GROUPS` the groups whose file was released or which were freed (at
    /// most once per [`PRUNE_EVERY`]).
    fn prune(&mut self) {
        if self.pruned.is_some_and(|at| at.elapsed() < PRUNE_EVERY) {
            return;
        }
        self.pruned = Some(Instant::now());
        let gone: Vec<ObjKey> = crate::probes::map_entries(&self.groups)
            .into_iter()
            .filter(|(k, file)| self.files.get(file, 0).is_err() || self.objects.get(k, 0).is_err())
            .map(|(k, _)| k)
            .collect();
        for k in gone {
            let _ = self.groups.remove(&k);
        }
    }

    /// Undoes one call.
    pub fn apply(&mut self, u: &Undo) -> Result<Restored, RestoreError> {
        match u {
            Undo::Timeslice {
                pid,
                client,
                group,
                allowed,
                ..
            } => {
                let mut params = tsg::TimesliceParams {
                    timeslice_us: *allowed,
                };
                let key = ObjKey {
                    client: *client,
                    object: *group,
                };
                // A caller the guard killed in its call leaves the group to whoever holds the
                // file: its creator, or another holder.
                let likely = [Some(*pid), self.creator_of(&key)];
                through_a_holder(&mut self.controls, &likely, |c, pid| {
                    let group = RmObject {
                        pid,
                        client: key.client,
                        object: key.object,
                    };
                    c.control_on(group, tsg::SET_TIMESLICE, &mut params)
                })?;
                Ok(Restored::Timeslice(*allowed))
            }
            // The list was copied from user memory the caller's other threads may change: a
            // pair naming the caller's own client is not a neighbour's to enable (its file may
            // have gone with the caller, killed in the call).
            Undo::Channels {
                client, channels, ..
            } => {
                let theirs: Vec<(u32, u32)> = channels
                    .iter()
                    .copied()
                    .filter(|(c, _)| c != client)
                    .collect();
                self.enable(&theirs)
            }
        }
    }

    /// Enables again the (client, channel) pairs, each client's through its own process's file.
    fn enable(&mut self, pairs: &[(u32, u32)]) -> Result<Restored, RestoreError> {
        let mut by_client: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for &(client, channel) in pairs {
            by_client.entry(client).or_default().push(channel);
        }
        // One walk of the objects for every victim's subdevice.
        let mut subdevices: BTreeMap<u32, u32> = BTreeMap::new();
        for (k, e) in crate::probes::map_entries(&self.objects) {
            if e.kind == OBJ_SUBDEVICE && by_client.contains_key(&k.client) {
                subdevices.entry(k.client).or_insert(k.object);
            }
        }
        let mut enabled = 0;
        let mut first_error = None;
        for (client, channels) in by_client {
            for chunk in channels.chunks(sched::DISABLE_CHANNELS_MAX) {
                match self.enable_client(client, subdevices.get(&client).copied(), chunk) {
                    Ok(()) => enabled += chunk.len() as u32,
                    Err(e) => {
                        warn!(
                            client = format_args!("{client:#x}"),
                            "cannot enable a tenant's channels disabled by another: {}",
                            Chain(&e)
                        );
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        match first_error {
            Some(e) if enabled == 0 => Err(e),
            _ => Ok(Restored::Channels(enabled)),
        }
    }

    fn enable_client(
        &mut self,
        client: u32,
        subdevice: Option<u32>,
        channels: &[u32],
    ) -> Result<(), RestoreError> {
        let owner = self
            .objects
            .get(
                &ObjKey {
                    client,
                    object: client,
                },
                0,
            )
            .ok()
            .filter(|e| e.kind == OBJ_CLIENT)
            .ok_or(RestoreError::UnknownClient { client })?;
        let subdevice = subdevice.ok_or(RestoreError::NoSubdevice { client })?;
        let mut params = sched::DisableChannelsParams {
            disable: 0,
            num_channels: channels.len() as u32,
            ..Default::default()
        };
        for (i, ch) in channels.iter().enumerate() {
            params.client_list[i] = client;
            params.channel_list[i] = *ch;
        }
        // The client's creator, or, where it exited (a daemon's double fork, a file handed to
        // a worker), whoever holds its file now.
        through_a_holder(&mut self.controls, &[Some(owner.tgid)], |c, pid| {
            let target = RmObject {
                pid,
                client,
                object: subdevice,
            };
            c.control_on(target, sched::DISABLE_CHANNELS, &mut params)
        })?;
        Ok(())
    }

    /// The process that made `object`, as the probes recorded it.
    fn creator_of(&self, object: &ObjKey) -> Option<u32> {
        self.objects.get(object, 0).ok().map(|e| e.tgid)
    }

    /// Frees the allocation of a limit crossing whose caller the kernel killed where another
    /// process keeps its file ([`super::crossing`]).
    pub fn free_crossing(&mut self, ev: &LimitEvent) -> super::crossing::Outcome {
        let key = ObjKey {
            client: ev.client,
            object: ev.object,
        };
        super::crossing::free(&mut self.controls, &self.objects, &self.runs, ev.pid, key)
    }

    /// Forgets the processes `keep` rejects (their pidfds are closed).
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        self.controls.retain(keep);
    }
}

/// Most undo entries waiting at once (a channel group's timeslice, or one disabled channel,
/// each): a tenant that makes new objects faster than they are undone is bounded here.
const QUEUE_MAX: usize = 4096;

/// What (process, client, object) an undo request is about.
type Target = (u32, u32, u32);

/// Undo requests waiting for the restorer thread, coalesced as they arrive: a tenant looping on a
/// control leaves one undo per object, not one per call.
#[derive(Default)]
struct Queue {
    /// Per channel group, the latest timeslice to set back: the allowance in force at the last
    /// call.
    timeslices: BTreeMap<Target, Undo>,
    /// Per (process, client, subdevice) of `FIFO_DISABLE_CHANNELS` calls: every (client,
    /// channel) any of them disabled, and the first call's cgroup. Merged, not replaced: each
    /// call may name other victims.
    foreign: BTreeMap<Target, (u64, BTreeSet<(u32, u32)>)>,
    /// Read-backs per control file: the latest request (the kernel sends one per file until
    /// the restorer begins it, so this holds at most one per file anyway).
    read_backs: BTreeMap<u64, ReadBack>,
    /// Limit crossings whose allocation may outlive its killed caller, in order.
    crossings: Vec<LimitEvent>,
    /// Objects limited cgroups made or freed that the driver is to be asked about, in order.
    checks: Vec<Check>,
    /// Callers of checks that did not fit: killed under `kill` (a limited cgroup fails closed
    /// where what it makes cannot be checked).
    unchecked: BTreeSet<u32>,
    /// Entries held: one per timeslice, one per channel in `foreign`, one per read-back.
    held: usize,
    /// Requests (or channels of one) left out because [`QUEUE_MAX`] entries were waiting.
    dropped: u64,
    /// No more requests will come.
    closed: bool,
}

/// A request to ask the driver about an object a limited cgroup made or freed.
#[derive(Clone, Copy, Debug)]
enum Check {
    Size(SizeCheck),
    Device(DeviceCheck),
    Free(FreeCheck),
}

impl Check {
    fn pid(&self) -> u32 {
        match self {
            Self::Size(c) => c.pid,
            Self::Device(c) => c.pid,
            Self::Free(c) => c.pid,
        }
    }
}

impl Queue {
    /// Adds `u`; how many of its entries did not fit.
    fn push(&mut self, u: Undo) -> u64 {
        match u {
            Undo::Timeslice {
                pid, client, group, ..
            } => {
                let key = (pid, client, group);
                if self.timeslices.contains_key(&key) || self.held < QUEUE_MAX {
                    if self.timeslices.insert(key, u).is_none() {
                        self.held += 1;
                    }
                    return 0;
                }
                self.dropped += 1;
                1
            }
            Undo::Channels {
                pid,
                cgroup_id,
                client,
                subdevice,
                channels: pairs,
            } => {
                let held = &mut self.held;
                let (_, channels) = self
                    .foreign
                    .entry((pid, client, subdevice))
                    .or_insert_with(|| (cgroup_id, BTreeSet::new()));
                let mut left_out = 0;
                for pair in pairs {
                    if channels.contains(&pair) {
                        continue;
                    }
                    if *held < QUEUE_MAX {
                        channels.insert(pair);
                        *held += 1;
                    } else {
                        left_out += 1;
                    }
                }
                self.dropped += left_out;
                left_out
            }
        }
    }

    /// Adds a read-back request; false if it did not fit.
    fn push_read_back(&mut self, r: ReadBack) -> bool {
        if !self.read_backs.contains_key(&r.file) && self.held >= QUEUE_MAX {
            self.dropped += 1;
            return false;
        }
        if self.read_backs.insert(r.file, r).is_none() {
            self.held += 1;
        }
        true
    }

    /// Adds a check; false (its caller noted) if it did not fit.
    fn push_check(&mut self, c: Check) -> bool {
        if self.held >= QUEUE_MAX {
            self.dropped += 1;
            self.unchecked.insert(c.pid());
            return false;
        }
        self.checks.push(c);
        self.held += 1;
        true
    }

    /// Adds a limit crossing; false if it did not fit.
    fn push_crossing(&mut self, ev: LimitEvent) -> bool {
        if self.held >= QUEUE_MAX {
            self.dropped += 1;
            return false;
        }
        self.crossings.push(ev);
        self.held += 1;
        true
    }

    /// Everything waiting, as limit crossings, undos (a target's merged channels in one) and
    /// read-backs; the queue is left empty.
    fn take(&mut self) -> Batch {
        let read_backs = std::mem::take(&mut self.read_backs).into_values().collect();
        let crossings = std::mem::take(&mut self.crossings);
        Batch {
            crossings,
            checks: std::mem::take(&mut self.checks),
            unchecked: std::mem::take(&mut self.unchecked),
            undos: self.take_undos(),
            read_backs,
        }
    }

    fn take_undos(&mut self) -> Vec<Undo> {
        self.held = 0;
        let mut out: Vec<Undo> = std::mem::take(&mut self.timeslices).into_values().collect();
        for ((pid, client, subdevice), (cgroup_id, channels)) in std::mem::take(&mut self.foreign) {
            // A call none of whose channels fitted has nothing waiting.
            if channels.is_empty() {
                continue;
            }
            out.push(Undo::Channels {
                pid,
                cgroup_id,
                client,
                subdevice,
                channels: channels.into_iter().collect(),
            });
        }
        out
    }

    fn is_empty(&self) -> bool {
        self.timeslices.is_empty()
            && self.foreign.is_empty()
            && self.read_backs.is_empty()
            && self.crossings.is_empty()
            && self.checks.is_empty()
            && self.unchecked.is_empty()
    }
}

/// What the restorer thread takes from the queue at once.
struct Batch {
    crossings: Vec<LimitEvent>,
    checks: Vec<Check>,
    unchecked: BTreeSet<u32>,
    undos: Vec<Undo>,
    read_backs: Vec<ReadBack>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// The restorer frees crossing allocations (the react tier kills their callers): only then
    /// are crossings queued.
    kill: bool,
}

impl Shared {
    /// The queue (a poisoned lock still holds a whole queue: every change completes under it).
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Hands undo requests to the restorer thread ([`spawn`]); never blocks. Dropping it ends the
/// thread once what waits is undone.
pub struct RestoreSender(Arc<Shared>);

impl RestoreSender {
    /// Makes one change to the queue (`push`: whether the request fitted) and wakes the thread.
    fn queue(&self, push: impl FnOnce(&mut Queue) -> bool) -> bool {
        let fitted = push(&mut self.0.lock());
        self.0.ready.notify_one();
        fitted
    }

    /// Queues `r`, coalesced with what waits for the same object; what does not fit in
    /// [`QUEUE_MAX`] entries is counted and said.
    pub fn send(&self, r: Undo) {
        let pid = r.pid();
        let (mut left_out, mut dropped) = (0, 0);
        self.queue(|q| {
            (left_out, dropped) = (q.push(r), q.dropped);
            left_out == 0
        });
        // Said at the first and then at each doubling: a flood does not flood the log too.
        if left_out > 0 && (dropped - left_out).checked_ilog2() != dropped.checked_ilog2() {
            warn!(
                pid,
                dropped_total = dropped,
                "the scheduler guard's undo queue is full ({QUEUE_MAX} entries): undo requests \
                 left out (an object's next guarded call queues it again)"
            );
        }
    }

    /// Queues a read-back. One that does not fit is counted; the kernel asks again at the
    /// file's next control only once this one was begun, so a lost request is said at once.
    pub fn read_back(&self, r: ReadBack) {
        if !self.queue(|q| q.push_read_back(r)) {
            warn!(
                pid = r.pid,
                "the scheduler guard's undo queue is full ({QUEUE_MAX} entries): a read-back of \
                 a tenant's channel groups left out"
            );
        }
    }

    /// Queues a size check. One that does not fit is said, and its caller killed under `kill`.
    pub fn check_size(&self, c: SizeCheck) {
        if !self.queue(|q| q.push_check(Check::Size(c))) {
            warn!(
                pid = c.pid,
                cgroup_id = c.cgroup_id,
                "the restorer's queue is full ({QUEUE_MAX} entries): a limited tenant's \
                 allocation cannot be read back"
            );
        }
    }

    /// Queues a device check. One that does not fit is said, and its caller killed under
    /// `kill`.
    pub fn check_device(&self, c: DeviceCheck) {
        if !self.queue(|q| q.push_check(Check::Device(c))) {
            warn!(
                pid = c.pid,
                cgroup_id = c.cgroup_id,
                "the restorer's queue is full ({QUEUE_MAX} entries): a limited tenant's device \
                 cannot be read back"
            );
        }
    }

    /// Queues a free check. One that does not fit is said, and its caller killed under `kill`.
    pub fn check_free(&self, c: FreeCheck) {
        if !self.queue(|q| q.push_check(Check::Free(c))) {
            warn!(
                pid = c.pid,
                cgroup_id = c.cgroup_id,
                "the restorer's queue is full ({QUEUE_MAX} entries): a limited tenant's free \
                 cannot be read back"
            );
        }
    }

    /// Queues a limit crossing, whose allocation the restorer frees if another process keeps
    /// the killed caller's file (none where the react tier does not kill). One that does not fit
    /// is said.
    pub fn crossing(&self, ev: LimitEvent) {
        if !self.0.kill {
            return;
        }
        if !self.queue(|q| q.push_crossing(ev)) {
            warn!(
                pid = ev.pid,
                "the restorer's queue is full ({QUEUE_MAX} entries): a crossing allocation is \
                 not checked for another holder of its file"
            );
        }
    }
}

impl Drop for RestoreSender {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.ready.notify_one();
    }
}

/// Runs `restorer` on its own thread, undoing what is sent through the returned sender; the
/// thread ends when the sender is dropped.
pub fn spawn(mut restorer: Restorer) -> std::io::Result<RestoreSender> {
    let shared = Arc::new(Shared {
        kill: restorer.kill,
        ..Shared::default()
    });
    let theirs = Arc::clone(&shared);
    std::thread::Builder::new()
        .name("gpud-restore".to_owned())
        .spawn(move || {
            loop {
                let batch = {
                    let mut q = theirs.lock();
                    while q.is_empty() && !q.closed {
                        let Some(due) = restorer.sweep_due() else {
                            q = theirs
                                .ready
                                .wait(q)
                                .unwrap_or_else(std::sync::PoisonError::into_inner);
                            continue;
                        };
                        let now = Instant::now();
                        if due <= now {
                            break;
                        }
                        q = theirs
                            .ready
                            .wait_timeout(q, due - now)
                            .map_or_else(|e| e.into_inner().0, |(q, _)| q);
                    }
                    if q.is_empty() && q.closed {
                        break;
                    }
                    q.take()
                };
                let Batch {
                    crossings,
                    checks,
                    unchecked,
                    undos,
                    read_backs,
                } = batch;
                for ev in crossings {
                    free_crossing(&mut restorer, &ev);
                }
                for c in checks {
                    match c {
                        Check::Size(c) => check_size(&mut restorer, &c),
                        Check::Device(c) => check_device(&mut restorer, &c),
                        Check::Free(c) => check_free(&mut restorer, &c),
                    }
                }
                for pid in unchecked {
                    kill_unchecked(&mut restorer, pid);
                }
                for r in undos {
                    undo(&mut restorer, &r);
                }
                if !read_backs.is_empty() {
                    restorer.ask_sweep();
                }
                for r in read_backs {
                    read_back(&mut restorer, &r);
                }
                if restorer
                    .sweep_due()
                    .is_some_and(|due| due <= Instant::now())
                {
                    sweep(&mut restorer);
                }
                // Processes come and go: keep only the pidfds of live ones.
                restorer.retain(|pid| Path::new(&format!("/proc/{pid}")).exists());
            }
        })?;
    Ok(RestoreSender(shared))
}

/// One crossing allocation's check, logged where one was freed or could not be.
fn free_crossing(restorer: &mut Restorer, ev: &LimitEvent) {
    use super::crossing::Outcome;
    match restorer.free_crossing(ev) {
        // The caller itself, dying: the file's release would have freed it too.
        Outcome::Freed { holder } if holder == ev.pid => {
            debug!(
                pid = ev.pid,
                "freed a crossing allocation through its dying caller's file"
            );
        }
        Outcome::Freed { holder } => warn!(
            pid = ev.pid,
            holder,
            cgroup_id = ev.cgroup_id,
            bytes = ev.bytes,
            "freed a crossing allocation that another process kept through the killed caller's \
             file"
        ),
        Outcome::NoHolder => warn!(
            pid = ev.pid,
            cgroup_id = ev.cgroup_id,
            bytes = ev.bytes,
            "a crossing allocation is held through a file no process gpud can reach holds"
        ),
        Outcome::Gone => {}
    }
}

/// One size check, logged where the driver holds more than was charged or it failed.
fn check_size(restorer: &mut Restorer, c: &SizeCheck) {
    match restorer.check_size(c) {
        Ok(SizeChecked::Crossed {
            size,
            charged,
            limit,
            acted,
        }) => warn!(
            pid = c.pid,
            cgroup_id = limit.cgroup_id,
            gpu = limit.gpu,
            size,
            charged,
            usage = limit.usage,
            max = limit.max,
            acted = ?acted,
            "the driver holds more for a limited tenant's allocations than the probes charged \
             (their requests changed after the probes read them), and that takes it over its \
             limit"
        ),
        Ok(SizeChecked::Within { size, excess }) if excess > 0 => info!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            size,
            charged = c.charged,
            "the driver holds more for a limited tenant's allocation than the probes charged; \
             counted against its limits"
        ),
        Ok(done) => debug!(pid = c.pid, "read back an allocation's size: {done:?}"),
        Err(e) => warn!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            "cannot read back a limited tenant's allocation: {}",
            Chain(&e)
        ),
    }
}

/// One device check, logged where the driver made the device on another GPU than the probes
/// recorded or it failed.
fn check_device(restorer: &mut Restorer, c: &DeviceCheck) {
    match restorer.check_device(c) {
        Ok(DeviceChecked::Moved {
            recorded,
            actual,
            limited: Some(cgroup_id),
            killed,
            freed,
        }) => warn!(
            pid = c.pid,
            cgroup_id,
            recorded,
            actual,
            killed,
            freed = ?freed,
            "a limited tenant's device is on another GPU than the probes recorded (its deviceId \
             changed after the probes read it), one where its limit applies"
        ),
        Ok(DeviceChecked::Moved {
            recorded, actual, ..
        }) => info!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            recorded,
            actual,
            "a tenant's device is on another GPU than the probes recorded (its deviceId changed \
             after the probes read it); no limit of its own applies there"
        ),
        Ok(done) => debug!(pid = c.pid, "read back a device's GPU: {done:?}"),
        Err(e) => warn!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            "cannot read back a limited tenant's device: {}",
            Chain(&e)
        ),
    }
}

/// One free check, logged where the object the probes released outlived its free or it failed.
fn check_free(restorer: &mut Restorer, c: &FreeCheck) {
    match restorer.check_free(c) {
        Ok(FreeChecked::Survived { killed, freed }) => warn!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            client = format_args!("{:#x}", c.client),
            object = format_args!("{:#x}", c.object),
            killed,
            freed,
            "a limited tenant's freed object is still held by the driver (its handle changed \
             after the probes read it, and another object was freed)"
        ),
        Ok(done) => debug!(pid = c.pid, "read back a free: {done:?}"),
        Err(e) => warn!(
            pid = c.pid,
            cgroup_id = c.cgroup_id,
            "cannot read back a limited tenant's free: {}",
            Chain(&e)
        ),
    }
}

/// A caller whose size check did not fit in the queue: killed under `kill`, since what it was
/// allocating under a limit cannot be checked.
fn kill_unchecked(restorer: &mut Restorer, pid: u32) {
    if !restorer.kill {
        return;
    }
    match restorer.controls.kill(pid, true) {
        Ok(()) => warn!(
            pid,
            "killed a limited tenant whose allocations came faster than gpud could read them back"
        ),
        Err(ControlError::Gone { .. }) => {}
        Err(e) => warn!(pid, "cannot kill a limited tenant: {}", Chain(&e)),
    }
}

/// One read-back, logged where it failed (a set-back is logged by the restorer).
fn read_back(restorer: &mut Restorer, r: &ReadBack) {
    match restorer.read_back(r) {
        Ok(done) => debug!(pid = r.pid, "read back a tenant's channel groups: {done:?}"),
        Err(e) => warn!(
            pid = r.pid,
            cgroup_id = r.cgroup_id,
            "cannot read back a tenant's channel groups: {}",
            Chain(&e)
        ),
    }
}

/// One sweep, logged.
fn sweep(restorer: &mut Restorer) {
    match restorer.sweep() {
        Ok(done) => debug!("swept the channel groups back onto the runlist: {done:?}"),
        Err(e) => warn!(
            "cannot put other processes' channel groups back on the runlist after a tenant's \
             control: {}",
            Chain(&e)
        ),
    }
}

/// One undo, logged.
fn undo(restorer: &mut Restorer, r: &Undo) {
    let started = Instant::now();
    match restorer.apply(r) {
        Ok(done) => debug!(
            pid = r.pid(),
            cgroup_id = r.cgroup_id(),
            us = started.elapsed().as_micros() as u64,
            "undid a tenant's scheduling control: {done:?}"
        ),
        Err(e) => warn!(
            pid = r.pid(),
            cgroup_id = r.cgroup_id(),
            "cannot undo a tenant's scheduling control: {}",
            Chain(&e)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeslice(pid: u32, group: u32, allowed: u64) -> Undo {
        Undo::Timeslice {
            pid,
            cgroup_id: 1,
            client: 0xc1,
            group,
            allowed,
        }
    }

    fn disable(pid: u32, victims: &[(u32, u32)]) -> Undo {
        Undo::Channels {
            pid,
            cgroup_id: 1,
            client: 0xc1,
            subdevice: 0x5d,
            channels: victims.to_vec(),
        }
    }

    fn group_and_allowance(u: &Undo) -> (u32, u64) {
        match u {
            Undo::Timeslice { group, allowed, .. } => (*group, *allowed),
            Undo::Channels { .. } => panic!("not a timeslice: {u:?}"),
        }
    }

    /// A loop on one channel group leaves one undo, with the last allowance.
    #[test]
    fn timeslices_keep_the_latest_per_group() {
        let mut q = Queue::default();
        for allowed in [100, 200, 300] {
            q.push(timeslice(7, 0x10, allowed));
        }
        q.push(timeslice(7, 0x11, 50));
        let mut out: Vec<(u32, u64)> = q.take_undos().iter().map(group_and_allowance).collect();
        out.sort();
        assert_eq!(out, [(0x10, 300), (0x11, 50)]);
        assert!(q.is_empty() && q.held == 0);
    }

    /// Calls through one subdevice that disable different neighbours' channels are all undone:
    /// their channels are merged, not replaced by the last call's.
    #[test]
    fn disabled_channels_of_several_calls_are_merged() {
        let mut q = Queue::default();
        q.push(disable(7, &[(0xa, 1)]));
        q.push(disable(7, &[(0xb, 2), (0xa, 1)]));
        let out = q.take_undos();
        assert_eq!(
            out,
            [Undo::Channels {
                pid: 7,
                cgroup_id: 1,
                client: 0xc1,
                subdevice: 0x5d,
                channels: vec![(0xa, 1), (0xb, 2)],
            }]
        );
    }

    /// A tenant making new objects faster than they are undone is bounded and counted.
    #[test]
    fn the_queue_is_bounded_and_counts_what_it_leaves_out() {
        let mut q = Queue::default();
        let over = QUEUE_MAX as u32 + 10;
        let left_out: u64 = (0..over).map(|g| q.push(timeslice(7, g, 1))).sum();
        assert_eq!((left_out, q.dropped, q.held), (10, 10, QUEUE_MAX));
        // What waits is still coalesced: a known group updates in place.
        assert_eq!(q.push(timeslice(7, 0, 9)), 0);
        assert_eq!(q.push(disable(7, &[(0xa, 1)])), 1);
        assert_eq!(q.take_undos().len(), QUEUE_MAX);
    }

    #[test]
    fn read_backs_are_one_per_file_and_bounded() {
        let mut q = Queue::default();
        let rb = |file, pid| ReadBack {
            pid,
            cgroup_id: 1,
            file,
            allowed: 2048,
        };
        assert!(q.push_read_back(rb(0x1000, 1)));
        assert!(q.push_read_back(rb(0x1000, 2)));
        assert!(q.push_read_back(rb(0x2000, 1)));
        let Batch {
            undos, read_backs, ..
        } = q.take();
        assert!(undos.is_empty());
        assert_eq!(read_backs, vec![rb(0x1000, 2), rb(0x2000, 1)]);
        assert!(q.is_empty());
        for i in 0..QUEUE_MAX as u64 {
            assert!(q.push_read_back(rb(i, 1)));
        }
        assert!(!q.push_read_back(rb(u64::MAX, 1)));
        assert!(
            q.push_read_back(rb(0, 3)),
            "a file already waiting still fits"
        );
        assert_eq!(q.dropped, 1);
    }
}
