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
//! It runs on its own thread ([`spawn`]): the undo is a few blocking ioctls, and must not wait
//! behind the state task's work.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::mpsc::{Receiver, Sender},
    time::Instant,
};

use aya::maps::{HashMap, Map, MapData};
use gpud_common::{
    GUARD_REASON_FOREIGN, GUARD_REASON_TIMESLICE, GuardRestore, OBJ_CLIENT, OBJ_SUBDEVICE,
    ObjEntry, ObjKey,
    rm::{sched, tsg},
};
use tracing::{debug, warn};

use super::compute::channel::{ControlError, Controls, RmObject};
use crate::{probes::Matcher, report::Chain};

/// Why an undo could not be done.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
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
    #[error("record with reason {0} has nothing to undo")]
    Nothing(u32),
}

/// What an undo did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// The channel group's timeslice set back to this many µs.
    Timeslice(u64),
    /// This many channels enabled again.
    Channels(u32),
}

/// Undoes what tenants' controls did; see the module docs.
pub struct Restorer {
    controls: Controls,
    objects: HashMap<MapData, ObjKey, ObjEntry>,
}

impl Restorer {
    /// `pins`: the probes' pin directory (the `OBJECTS` map, read for the victims' processes and
    /// subdevices).
    pub fn new(matcher: Matcher, pins: &Path) -> Result<Self, RestoreError> {
        let path = pins.join(gpud_common::maps::OBJECTS);
        let oerr = |source| RestoreError::OpenMap {
            path: path.clone(),
            source,
        };
        let data = MapData::from_pin(&path).map_err(oerr)?;
        let objects = HashMap::try_from(Map::HashMap(data)).map_err(oerr)?;
        Ok(Self {
            controls: Controls::new(matcher, None),
            objects,
        })
    }

    /// Undoes one call.
    pub fn apply(&mut self, r: &GuardRestore) -> Result<Restored, RestoreError> {
        match r.verdict >> 8 {
            GUARD_REASON_TIMESLICE => {
                let mut params = tsg::TimesliceParams {
                    timeslice_us: r.allowed,
                };
                let group = RmObject {
                    pid: r.tgid,
                    client: r.client,
                    object: r.object,
                };
                self.controls
                    .control_on(group, tsg::SET_TIMESLICE, &mut params)?;
                Ok(Restored::Timeslice(r.allowed))
            }
            GUARD_REASON_FOREIGN => self.enable(r),
            reason => Err(RestoreError::Nothing(reason)),
        }
    }

    /// Enables again the channels `r` names, each client's through its own process's file.
    fn enable(&mut self, r: &GuardRestore) -> Result<Restored, RestoreError> {
        let n = (r.num_channels as usize).min(sched::DISABLE_CHANNELS_MAX);
        let mut by_client: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for i in 0..n {
            by_client
                .entry(r.clients[i])
                .or_default()
                .push(r.channels[i]);
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
            match self.enable_client(client, subdevices.get(&client).copied(), &channels) {
                Ok(()) => enabled += channels.len() as u32,
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
        let target = RmObject {
            pid: owner.tgid,
            client,
            object: subdevice,
        };
        self.controls
            .control_on(target, sched::DISABLE_CHANNELS, &mut params)?;
        Ok(())
    }

    /// Forgets the processes `keep` rejects (their pidfds are closed).
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        self.controls.retain(keep);
    }
}

/// Runs `restorer` on its own thread, undoing each record sent on the returned channel; the
/// thread ends when every sender is gone.
pub fn spawn(mut restorer: Restorer) -> std::io::Result<Sender<GuardRestore>> {
    let (tx, rx): (Sender<GuardRestore>, Receiver<GuardRestore>) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("gpud-restore".to_owned())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                // A tenant looping on a control leaves many undos of one object queued: the last
                // of each is enough (each costs a pidfd_getfd and an ioctl).
                let mut batch = vec![first];
                batch.extend(rx.try_iter());
                let mut last: BTreeMap<(u32, u32, u32, u32), GuardRestore> = BTreeMap::new();
                for r in batch {
                    last.insert((r.tgid, r.client, r.object, r.verdict >> 8), r);
                }
                for r in last.into_values() {
                    undo(&mut restorer, &r);
                }
                // Processes come and go: keep only the pidfds of live ones.
                restorer.retain(|pid| Path::new(&format!("/proc/{pid}")).exists());
            }
        })?;
    Ok(tx)
}

/// One undo, logged.
fn undo(restorer: &mut Restorer, r: &GuardRestore) {
    let started = Instant::now();
    match restorer.apply(r) {
        Ok(done) => debug!(
            pid = r.tgid,
            cgroup_id = r.cgroup_id,
            us = started.elapsed().as_micros() as u64,
            "undid a tenant's scheduling control: {done:?}"
        ),
        Err(e) => warn!(
            pid = r.tgid,
            cgroup_id = r.cgroup_id,
            "cannot undo a tenant's scheduling control: {}",
            Chain(&e)
        ),
    }
}
