//! The fake's state as the `state` file shows it ([`Snapshot`]): per-GPU use, open files,
//! clients, objects, channel groups and channels, per-command control counts and running
//! counters, with the queries tests make of it.

use std::collections::BTreeMap;

use gpud_common::rm::{Handle, class};
use serde::{Deserialize, Serialize};

/// Per-GPU totals in a [`Snapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuState {
    pub index: u32,
    pub capacity: u64,
    /// Bytes of live video memory (rounded sizes).
    pub used: u64,
}

/// An open `nvidiactl` file (one open file description; forks and dups share it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileState {
    /// The FUSE file handle.
    pub fh: u64,
    /// Process that opened it.
    pub pid: u32,
    pub clients: Vec<Handle>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientState {
    pub handle: Handle,
    /// The open file it is bound to.
    pub file: u64,
    /// Process that created it.
    pub pid: u32,
}

/// A live RM object (not clients).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectState {
    pub client: Handle,
    pub handle: Handle,
    /// The client handle for top-level objects.
    pub parent: Handle,
    pub class: u32,
    /// The GPU the object belongs to (devices and what is under them).
    pub gpu: Option<u32>,
    /// Video memory held (class 0x40 only; rounded size).
    pub bytes: u64,
    /// The video memory it references, shared with its duplicates (0: none).
    #[serde(default)]
    pub mem: u64,
    /// Process that created it.
    pub pid: u32,
}

/// A channel group in a [`Snapshot`], with what its controls set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelGroupState {
    pub client: Handle,
    pub handle: Handle,
    /// Process that created it.
    pub pid: u32,
    pub gpu: Option<u32>,
    /// On the runlist.
    pub enabled: bool,
    pub timeslice_us: u64,
    /// `SET_TIMESLICE` controls that reached it (whoever issued them).
    #[serde(default)]
    pub timeslice_sets: u64,
    /// `GPFIFO_SCHEDULE` and `PREEMPT` controls that reached it.
    pub schedules: u64,
    pub preempts: u64,
    /// `SET_INTERLEAVE_LEVEL` of the group or of one of its channels: LOW 0 (at creation),
    /// MEDIUM 1, HIGH 2.
    #[serde(default)]
    pub interleave: u32,
    /// `MAKE_REALTIME`.
    #[serde(default)]
    pub realtime: bool,
}

/// A channel (`HOPPER_CHANNEL_GPFIFO_A`) in a [`Snapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelState {
    pub client: Handle,
    pub handle: Handle,
    /// Its channel group.
    pub group: Handle,
    /// Process that created it.
    pub pid: u32,
    pub gpu: Option<u32>,
    /// Not disabled by `FIFO_DISABLE_CHANNELS` (true at creation).
    pub enabled: bool,
    /// `FIFO_DISABLE_CHANNELS` disables it was given, by whichever process.
    #[serde(default)]
    pub disabled_times: u64,
}

/// How long this fake has kept each process stopped (`runlist stop`/`channels`), summed over
/// its stops: what the stand-in GPU did not run of it. Read apart from [`Snapshot`], which stays
/// equal while nothing happens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The fake's monotonic clock at this reading (ns since it started).
    pub clock_ns: u64,
    /// Per process, ns stopped up to `clock_ns`.
    pub by_pid: BTreeMap<u32, u64>,
}

impl Held {
    /// Nanoseconds `pid` was kept stopped up to this reading.
    pub fn of(&self, pid: u32) -> u64 {
        self.by_pid.get(&pid).copied().unwrap_or(0)
    }
}

/// Running counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Ioctls received on `nvidiactl`.
    pub ioctls: u64,
    /// Clients and objects created.
    pub created: u64,
    /// Requests answered with an RM status other than `NV_OK`.
    pub refused: u64,
    /// `nvidiactl` files released (last close).
    pub released: u64,
    /// RM controls on the driver's GSS-legacy path (`cmd` bit 15) that reached the "firmware"
    /// (answered `NV_ERR_NOT_SUPPORTED`, nothing done).
    #[serde(default)]
    pub legacy: u64,
}

/// The fake's state, as the `state` file shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Channel groups (`KEPLER_CHANNEL_GROUP_A`) and their scheduling state.
    #[serde(default)]
    pub channel_groups: Vec<ChannelGroupState>,
    /// Channels (`HOPPER_CHANNEL_GPFIFO_A`).
    #[serde(default)]
    pub channels: Vec<ChannelState>,
    /// Per command (`0x%08x`, e.g. `"0xa06c0103"`): the RM controls this fake models that
    /// passed every check of the driver and took effect (answered `NV_OK`); a command absent
    /// here never reached the "driver" or was refused by it. See [`Snapshot::control_count`].
    #[serde(default)]
    pub controls: BTreeMap<String, u64>,
    pub page_size: u64,
    pub gpus: Vec<GpuState>,
    pub files: Vec<FileState>,
    pub clients: Vec<ClientState>,
    pub objects: Vec<ObjectState>,
    pub stats: Stats,
}

impl Snapshot {
    /// Live video-memory objects (class `NV01_MEMORY_LOCAL_USER`).
    pub fn memory(&self) -> impl Iterator<Item = &ObjectState> {
        self.objects
            .iter()
            .filter(|o| o.class == class::MEMORY_LOCAL_USER)
    }

    /// Bytes of video memory in use on `gpu`.
    pub fn used(&self, gpu: u32) -> u64 {
        self.gpus
            .iter()
            .find(|g| g.index == gpu)
            .map_or(0, |g| g.used)
    }

    /// Bytes of video memory these processes keep alive through a handle (an allocation or
    /// a duplicate), each allocation counted once: the driver's own ledger, what gpud's figures
    /// for their cgroup must equal.
    pub fn held_by(&self, pids: &[u32]) -> u64 {
        let mut seen = std::collections::BTreeSet::new();
        self.memory()
            .filter(|o| pids.contains(&o.pid) && (o.mem == 0 || seen.insert(o.mem)))
            .map(|o| o.bytes)
            .sum()
    }

    /// Bytes of video memory in use on all GPUs.
    pub fn used_total(&self) -> u64 {
        self.gpus.iter().map(|g| g.used).sum()
    }

    pub fn object(&self, client: Handle, handle: Handle) -> Option<&ObjectState> {
        self.objects
            .iter()
            .find(|o| o.client == client && o.handle == handle)
    }

    pub fn has_client(&self, client: Handle) -> bool {
        self.clients.iter().any(|c| c.handle == client)
    }

    /// How many controls `cmd` took effect ([`Snapshot::controls`]).
    pub fn control_count(&self, cmd: u32) -> u64 {
        self.controls
            .get(&format!("{cmd:#010x}"))
            .copied()
            .unwrap_or(0)
    }

    pub fn channel_group(&self, client: Handle, handle: Handle) -> Option<&ChannelGroupState> {
        self.channel_groups
            .iter()
            .find(|g| g.client == client && g.handle == handle)
    }

    pub fn channel(&self, client: Handle, handle: Handle) -> Option<&ChannelState> {
        self.channels
            .iter()
            .find(|c| c.client == client && c.handle == handle)
    }
}
