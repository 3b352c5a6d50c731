//! The `EVENTS` ring buffer's records: what the programs tell the daemon (`Event`, by kind), the
//! scheduler guard's verdicts and reasons, and the undo requests (`GuardRestore`).

use crate::{GPU_UNKNOWN, rm};

/// `Event::kind`: a process became tracked (opened an NVIDIA file, first matched ioctl, or forked
/// by a tracked process: then `client` holds the parent's tgid).
pub const EVENT_PROC_NEW: u32 = 1;
/// `Event::kind`: a tracked process exited (its last thread).
pub const EVENT_PROC_EXIT: u32 = 2;
/// `Event::kind`: `RM_FREE` of a client, device or subdevice succeeded (`client`, `object`;
/// `value`: the serial clock then): the daemon releases that object and those below it that are
/// older than the event (a freed video-memory object is released by the kernel side itself).
pub const EVENT_FREE_TREE: u32 = 3;
/// `Event::kind`: the last reference to a control file is going (`value`: the `struct file`
/// address; `bytes`: the serial clock then): the driver frees every client of that file without
/// an `RM_FREE`.
pub const EVENT_FILE_RELEASE: u32 = 4;
/// `Event::kind`: an allocation took `cgroup_id` over its limit on `gpu` (`value`: usage after,
/// `bytes`: the allocation; `tgid`: the allocating process).
pub const EVENT_LIMIT_CROSSED: u32 = 5;
/// `Event::kind`: the `deny` tier refused an allocation of `bytes` in `cgroup_id` on `gpu`
/// (`value`: usage at the time).
pub const EVENT_ALLOC_DENIED: u32 = 6;
/// `Event::kind`: the scheduler guard met a tenant's scheduling control (`tgid`, its
/// `cgroup_id`; `client`: the call's client; `object`: the RM command; `value`: what was asked,
/// a timeslice in µs or the foreign client named; `bytes`: the caller's timeslice allowance;
/// `gpu`: `GUARD_*` action | `GUARD_REASON_*` << 8). Sent for at most [`GUARD_EVENT_BURST`]
/// calls of a cgroup at once and one per [`GUARD_EVENT_GAP_NS`] after that: a tenant looping on
/// refused controls must not fill the ring the accounting's events share. Every call is counted
/// in `GUARD_COUNTS`.
pub const EVENT_SCHED_GUARD: u32 = 7;
/// Record kind of a [`GuardRestore`]: sent at the exit of a tenant's control that neither a hook
/// nor a rewrite could stop, for the daemon to undo what it did.
pub const EVENT_GUARD_RESTORE: u32 = 8;
/// `Event::kind`: a tenant's RM control on a control file that holds channel groups returned,
/// and the guard's reading of its parameters at the entry proves nothing of what the driver ran
/// (another thread may have rewritten the command, the object or the parameters in between):
/// the daemon reads the driver's state back (`value`: the `struct file` address; `bytes`: the
/// caller's timeslice allowance, µs). At most one is outstanding per file (`SCHED_FILES`).
pub const EVENT_GUARD_READ_BACK: u32 = 9;
/// `Event::kind`: a video-memory object (or a duplicate of one) was made and charged by a
/// caller under a limit (`tgid`: the caller; `cgroup_id`: its cgroup; `client`, `object`: the
/// object's keys; `value`: its serial; `bytes`: its charge; `gpu`). The entry side read the
/// request from the caller's memory before the driver copied it, and another thread of the
/// caller may have changed it in between: the daemon asks the driver what it holds for the
/// object and acts where that is more.
pub const EVENT_MEM_READ_BACK: u32 = 10;
/// `Event::kind`: a device (`NV01_DEVICE_0`) was made by a caller under a limit on some GPU
/// (`tgid`, `cgroup_id`: the caller and its cgroup; `client`, `object`: the device's keys;
/// `value`: its serial; `gpu`: the instance the entry side read). The driver copied `deviceId`
/// after the entry side read it: the daemon asks the driver which GPU the device is on and acts
/// where that is another GPU than the one recorded.
pub const EVENT_DEVICE_READ_BACK: u32 = 11;
/// `Event::kind`: a caller under a limit freed a recorded object (or its client) and the driver
/// said it did (`tgid`, `cgroup_id`: the caller and its cgroup; `client`, `object`: the keys the
/// entry side read; `value`: the serial clock after the driver answered). The driver copied the
/// handle after the entry side read it, and the probes released what they read: the daemon asks
/// the driver whether that object is gone, and acts where it is not (another object was freed).
pub const EVENT_FREE_READ_BACK: u32 = 12;
/// Guard events a cgroup may send at once (see [`EVENT_SCHED_GUARD`]).
pub const GUARD_EVENT_BURST: u64 = 64;
/// The rate the burst refills at: one event per this many nanoseconds (100 per second).
pub const GUARD_EVENT_GAP_NS: u64 = 10_000_000;

/// The guard refused the call with `EPERM` before the driver saw it (BPF-LSM).
pub const GUARD_DENIED: u32 = 1;
/// The guard turned the call into one the driver rejects (its parameter size set to 0), or, for
/// an enable of a held group, into the driver's NULL command (answered `NV_OK`, nothing done).
pub const GUARD_REFUSED: u32 = 2;
/// The guard lowered the timeslice asked to the caller's allowance.
pub const GUARD_CLAMPED: u32 = 3;
/// `audit`: the call went through; `enforce` would have acted on it.
pub const GUARD_AUDITED: u32 = 4;
/// `enforce`, but this kernel allows neither refusing nor rewriting the call: it went through.
pub const GUARD_UNENFORCED: u32 = 5;
/// No hook and no rewrite could stop the call: it went through, and the daemon undoes it at its
/// exit (a timeslice set back to the allowance, a neighbour's channels enabled again).
pub const GUARD_RESTORED: u32 = 6;
/// No hook and no rewrite could stop the call: its caller was sent `SIGKILL` at its entry (it dies
/// before it returns to user space; `[enforcement] guard_react_action = "kill"`), and what the
/// call did is undone as for [`GUARD_RESTORED`].
pub const GUARD_KILLED: u32 = 7;
/// A control tenants may never use.
pub const GUARD_REASON_FORBIDDEN: u32 = 1;
/// A timeslice above the caller's allowance.
pub const GUARD_REASON_TIMESLICE: u32 = 2;
/// A disable-channels list naming another process's client.
pub const GUARD_REASON_FOREIGN: u32 = 3;
/// A scheduling command on the driver's legacy path (`cmd` bit 15), which skips its checks.
pub const GUARD_REASON_LEGACY: u32 = 4;
/// A guarded control with `NVOS54.flags` set (a serialized parameter layout the guard cannot
/// read).
pub const GUARD_REASON_FLAGS: u32 = 5;
/// `GPFIFO_SCHEDULE` enabling a channel group that gpud holds off the runlist (the compute law's
/// hardware mode).
pub const GUARD_REASON_HELD: u32 = 6;

/// Record sent through the `EVENTS` ring buffer. What each field holds depends on `kind` (see
/// the `EVENT_*` constants); fields a kind does not name are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// `EVENT_*`.
    pub kind: u32,
    /// The process concerned (the calling process, or the child of a fork).
    pub tgid: u32,
    /// cgroup v2 id: the caller's, or the cgroup whose limit was crossed or enforced.
    pub cgroup_id: u64,
    /// RM client handle, or the parent's tgid for a forked process.
    pub client: u32,
    /// RM object handle within `client`.
    pub object: u32,
    /// Kind-specific: a serial clock reading, a usage in bytes, or a `struct file` address.
    pub value: u64,
    /// Kind-specific: an allocation's bytes, or a serial clock reading.
    pub bytes: u64,
    /// RM device instance, `GPU_UNKNOWN` or `GPU_ALL`.
    pub gpu: u32,
    /// Explicit padding (always 0).
    pub _pad: u32,
}

/// What the daemon must undo after a tenant's control went through where no hook could refuse
/// it and no rewrite could change it ([`EVENT_GUARD_RESTORE`] in the `EVENTS` ring, sent at the
/// call's exit, so the undo follows what the driver did). Its own record type, apart from
/// [`Event`]: the daemon tells them by size.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardRestore {
    /// [`EVENT_GUARD_RESTORE`].
    pub kind: u32,
    /// The calling process.
    pub tgid: u32,
    /// Its cgroup v2 id.
    pub cgroup_id: u64,
    /// The call's client.
    pub client: u32,
    /// The call's object: `SET_TIMESLICE`'s channel group, `FIFO_DISABLE_CHANNELS`'s subdevice.
    pub object: u32,
    /// The RM command.
    pub cmd: u32,
    /// `GUARD_RESTORED` or `GUARD_KILLED` | `GUARD_REASON_*` << 8.
    pub verdict: u32,
    /// `SET_TIMESLICE`: the timeslice to set back (µs, the caller's allowance).
    pub allowed: u64,
    /// The GPU of `object` (`GPU_UNKNOWN` when the probes did not see it made).
    pub gpu: u32,
    /// `FIFO_DISABLE_CHANNELS`: entries used in `clients` and `channels` (the channels the call
    /// disabled, copied at its entry, before the driver read them).
    pub num_channels: u32,
    /// The client of each channel disabled.
    pub clients: [u32; rm::sched::DISABLE_CHANNELS_MAX],
    /// The channels disabled, each a handle in the client at the same index.
    pub channels: [u32; rm::sched::DISABLE_CHANNELS_MAX],
}

impl Default for GuardRestore {
    fn default() -> Self {
        Self {
            kind: EVENT_GUARD_RESTORE,
            tgid: 0,
            cgroup_id: 0,
            client: 0,
            object: 0,
            cmd: 0,
            verdict: 0,
            allowed: 0,
            gpu: GPU_UNKNOWN,
            num_channels: 0,
            clients: [0; rm::sched::DISABLE_CHANNELS_MAX],
            channels: [0; rm::sched::DISABLE_CHANNELS_MAX],
        }
    }
}

const _: () = assert!(size_of::<GuardRestore>() != size_of::<Event>());
