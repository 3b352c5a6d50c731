//! The `OBJECTS` map's keys and entries (RM clients, devices, subdevices, memory, channel groups
//! and channels, with their GPU and their maker's control file), and the GPU keys of `USAGE` and
//! `LIMITS`.

/// GPU index meaning "the allocation's parent device is not known" (charged, reported apart).
pub const GPU_UNKNOWN: u32 = 0xffff_fffe;
/// GPU index of the all-GPUs total kept beside each per-GPU usage, and of all-GPU limits.
pub const GPU_ALL: u32 = 0xffff_ffff;
/// The `LIMITS` entry under [`GPU_UNKNOWN`] of a cgroup with a limit on some GPU by itself,
/// kept by the daemon beside those limits: memory on a GPU the probes cannot name may be on any
/// GPU, so it meets every per-GPU limit (fail closed), and the kernel side finds that in the
/// one lookup it makes for the key anyway. Its presence also tells the kernel side that the
/// cgroup has per-GPU limits at all.
pub const UNNAMED_GPU_MAX: u64 = 0;

/// `ObjEntry::kind`: an RM client (`NV01_ROOT_CLIENT`), keyed by its own handle.
pub const OBJ_CLIENT: u32 = 1;
/// `ObjEntry::kind`: a device (`NV01_DEVICE_0`), which names the GPU of what is allocated below.
pub const OBJ_DEVICE: u32 = 2;
/// `ObjEntry::kind`: a subdevice (`NV20_SUBDEVICE_0`), one GPU of a device.
pub const OBJ_SUBDEVICE: u32 = 3;
/// `ObjEntry::kind`: video memory (`NV01_MEMORY_LOCAL_USER`), the only kind that is charged:
/// an allocation or a duplicate of one (`RM_DUP_OBJECT`), which holds the same charge.
pub const OBJ_MEMORY: u32 = 4;
/// `ObjEntry::kind`: a channel group (`KEPLER_CHANNEL_GROUP_A`): what the compute controller
/// takes on and off the runlist for its process.
pub const OBJ_CHANNEL_GROUP: u32 = 5;
/// `ObjEntry::kind`: a GPFIFO channel (`VOLTA_CHANNEL_GPFIFO_A` and later), parent its channel
/// group: what the compute controller disables (`FIFO_DISABLE_CHANNELS`) to hold its process's
/// queued work off the GPU, where the firmware ignores runlist controls.
pub const OBJ_CHANNEL: u32 = 6;

/// Key of the `OBJECTS` map: RM handles are unique only within their client.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    /// The client handle (`hRoot` of the RM call).
    pub client: u32,
    /// The object's handle within that client (the client's own handle for a client).
    pub object: u32,
}

/// Value of the `OBJECTS` map: an RM object the accounting follows (clients, devices,
/// subdevices, video memory).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjEntry {
    /// `OBJ_*`.
    pub kind: u32,
    /// Parent handle in the same client (the client itself for devices).
    pub parent: u32,
    /// RM device instance (`NV0080_ALLOC_PARAMETERS.deviceId`), or `GPU_UNKNOWN`.
    pub gpu: u32,
    /// Process that allocated it.
    pub tgid: u32,
    /// cgroup charged (memory) or of the allocating task.
    pub cgroup_id: u64,
    /// Bytes charged (memory objects; the size the driver wrote back).
    pub bytes: u64,
    /// Address of the control `struct file` the object was made through (for a client, the
    /// file that owns it). The driver frees every object made through a file when its last
    /// reference goes, so this alone decides that release.
    pub file: u64,
    /// `bpf_ktime_get_ns()` at creation: the daemon releases an object only if it still has
    /// this serial, and only objects older than the event that released their tree.
    pub serial: u64,
    /// Memory: the charge it holds, named by the serial of the allocation that made it (its own
    /// serial for an allocation, the original's for a duplicate). The driver frees the pages
    /// with their last handle, so the bytes are uncharged with the charge's last holder
    /// (`SHARES` counts the others). A channel group: what its own process did to it
    /// ([`OWNER_SCHEDULED`], [`OWNER_OFF_RUNLIST`], [`OWNER_DISABLES`]; [`ObjEntry::owner_holds`]).
    /// 0 for other kinds.
    pub charge: u64,
    /// [`OBJ_MAY_SHARE`] on memory; read on memory only, so the bit a race may leave on another
    /// kind (see there) means nothing.
    pub flags: u32,
    /// Explicit padding (always 0).
    pub _pad: u32,
}

/// An [`ObjEntry::flags`] bit of memory: its charge may have holders beyond this one (`SHARES`):
/// it is a duplicate, or the source of one, or was adopted at an upgrade. The free of memory
/// without it is its charge's last holder and does not look `SHARES` up, a hash keyed by
/// serials whose bucket is never in the cache (about a tenth of a free's return,
/// docs/benchmarks.md). The entry side of a duplicate sets it on the live source, before the
/// driver runs; where that source was freed and its element reused meanwhile, the bit lands on
/// another entry, whose free then only makes the lookup.
pub const OBJ_MAY_SHARE: u32 = 1;

/// A channel group's [`ObjEntry::charge`] bit: its own process took it off the runlist
/// (`GPFIFO_SCHEDULE` disable) and has not put it back.
pub const OWNER_OFF_RUNLIST: u64 = 1 << 63;

/// A channel group's [`ObjEntry::charge`] bit: its own process put it on the runlist
/// (`GPFIFO_SCHEDULE` enable: CUDA's last step in making a context's group).
pub const OWNER_SCHEDULED: u64 = 1 << 62;

/// The [`ObjEntry::charge`] bits of a channel group that count its own process's disables.
pub const OWNER_DISABLES: u64 = !(OWNER_OFF_RUNLIST | OWNER_SCHEDULED);

impl ObjEntry {
    /// A channel group's holds by its own process, as the scheduler guard saw its controls: the
    /// group off the runlist ([`OWNER_OFF_RUNLIST`]) and, below it, how many disables of its
    /// channels (`FIFO_DISABLE_CHANNELS`) it made beyond its enables (the driver counts them).
    /// Non-zero: the process holds its own work off, and gpud's sweep after a raced control
    /// leaves the group alone.
    pub fn owner_holds(&self) -> u64 {
        if self.kind == OBJ_CHANNEL_GROUP {
            self.charge & !OWNER_SCHEDULED
        } else {
            0
        }
    }

    /// Whether a channel group's own process has put it on the runlist ([`OWNER_SCHEDULED`]):
    /// before that its context is still being made, and gpud does not put it there first.
    pub fn owner_scheduled(&self) -> bool {
        self.kind == OBJ_CHANNEL_GROUP && self.charge & OWNER_SCHEDULED != 0
    }
}
