//! The `EVENTS` ring buffer's records decoded once, into typed events with named fields: the
//! kernel side packs several meanings into `gpud_common::Event`'s fields (by kind), and this is
//! the one place that knows how. Everything past the ring reader sees a [`KernelEvent`].

use gpud_common::{
    EVENT_ALLOC_DENIED, EVENT_DEVICE_READ_BACK, EVENT_FILE_RELEASE, EVENT_FREE_READ_BACK,
    EVENT_FREE_TREE, EVENT_GUARD_READ_BACK, EVENT_GUARD_RESTORE, EVENT_LIMIT_CROSSED,
    EVENT_MEM_READ_BACK, EVENT_PROC_EXIT, EVENT_PROC_NEW, EVENT_SCHED_GUARD, Event, GUARD_AUDITED,
    GUARD_CLAMPED, GUARD_DENIED, GUARD_KILLED, GUARD_REASON_FLAGS, GUARD_REASON_FORBIDDEN,
    GUARD_REASON_FOREIGN, GUARD_REASON_HELD, GUARD_REASON_LEGACY, GUARD_REASON_TIMESLICE,
    GUARD_REFUSED, GUARD_RESTORED, GUARD_UNENFORCED, GuardRestore,
};

/// Why a ring-buffer record was not decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("a record of {0} bytes is neither an event nor an undo request")]
    Size(usize),
    #[error("unknown event kind {0}")]
    Kind(u32),
    #[error("unknown scheduler guard action {0}")]
    GuardAction(u32),
    #[error("unknown scheduler guard reason {0}")]
    GuardReason(u32),
    #[error("an undo request for reason {0}, which has nothing to undo")]
    NothingToUndo(&'static str),
}

/// One record of the ring: an event for the state task, or an undo or read-back request for
/// the restorer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Event(KernelEvent),
    Undo(Undo),
    ReadBack(ReadBack),
    SizeCheck(SizeCheck),
    DeviceCheck(DeviceCheck),
    FreeCheck(FreeCheck),
}

/// What a tenant's control did that the restorer must undo (a `GuardRestore` record, decoded:
/// its packed verdict and its channel list read here and nowhere else).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Undo {
    /// A timeslice above the caller's allowance on channel group `group` of `client`: set back
    /// to `allowed` µs.
    Timeslice {
        pid: u32,
        cgroup_id: u64,
        client: u32,
        group: u32,
        allowed: u64,
    },
    /// Channels of other processes' clients disabled by a call on subdevice `subdevice` of
    /// `client`: each (client, channel) pair enabled again.
    Channels {
        pid: u32,
        cgroup_id: u64,
        client: u32,
        subdevice: u32,
        channels: Vec<(u32, u32)>,
    },
}

impl Undo {
    /// The process whose control is undone.
    pub fn pid(&self) -> u32 {
        match self {
            Self::Timeslice { pid, .. } | Self::Channels { pid, .. } => *pid,
        }
    }

    pub fn cgroup_id(&self) -> u64 {
        match self {
            Self::Timeslice { cgroup_id, .. } | Self::Channels { cgroup_id, .. } => *cgroup_id,
        }
    }

    /// From the kernel's record: what its reason says to undo.
    fn of(r: &GuardRestore) -> Result<Self, DecodeError> {
        Ok(match GuardReason::from_code(r.verdict >> 8)? {
            GuardReason::Timeslice => Self::Timeslice {
                pid: r.tgid,
                cgroup_id: r.cgroup_id,
                client: r.client,
                group: r.object,
                allowed: r.allowed,
            },
            GuardReason::ForeignClient => {
                let n = (r.num_channels as usize).min(gpud_common::rm::sched::DISABLE_CHANNELS_MAX);
                Self::Channels {
                    pid: r.tgid,
                    cgroup_id: r.cgroup_id,
                    client: r.client,
                    subdevice: r.object,
                    channels: r.clients[..n]
                        .iter()
                        .copied()
                        .zip(r.channels[..n].iter().copied())
                        .collect(),
                }
            }
            other => return Err(DecodeError::NothingToUndo(other.as_str())),
        })
    }
}

/// A tenant's control on a control file with channel groups returned: the driver's state of
/// those groups is to be read back (`EVENT_GUARD_READ_BACK`), whatever the guard saw at entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadBack {
    /// The calling process.
    pub pid: u32,
    pub cgroup_id: u64,
    /// The control file (`struct file` address).
    pub file: u64,
    /// The caller's timeslice allowance (µs).
    pub allowed: u64,
}

/// A memory object made and charged under a limit, whose size the driver is to be asked
/// (`EVENT_MEM_READ_BACK`): the probes charged what they read before the driver copied the
/// request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeCheck {
    /// The allocating (or duplicating) process.
    pub pid: u32,
    /// Its cgroup, under a limit.
    pub cgroup_id: u64,
    /// RM device instance, or `GPU_UNKNOWN`.
    pub gpu: u32,
    pub client: u32,
    pub object: u32,
    /// The object's serial in `OBJECTS` (a handle reused since is another object).
    pub serial: u64,
    /// What the probes charged for it.
    pub charged: u64,
}

/// A device made by a caller under a limit, whose GPU the driver is to be asked
/// (`EVENT_DEVICE_READ_BACK`): the probes recorded the instance they read before the driver
/// copied the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCheck {
    /// The process that made it.
    pub pid: u32,
    /// Its cgroup, under a limit on some GPU.
    pub cgroup_id: u64,
    pub client: u32,
    pub object: u32,
    /// The device's serial in `OBJECTS` (a handle reused since is another object).
    pub serial: u64,
    /// The RM device instance the probes recorded for it.
    pub recorded: u32,
}

/// An object a caller under a limit freed, which the driver is to be asked is gone
/// (`EVENT_FREE_READ_BACK`): the probes released the object whose handle they read before the
/// driver copied the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeCheck {
    /// The freeing process.
    pub pid: u32,
    /// Its cgroup, under a limit.
    pub cgroup_id: u64,
    pub client: u32,
    pub object: u32,
    /// The serial clock once the driver had answered: a record of the handle made later is
    /// another object, made after the free.
    pub at: u64,
}

/// What the kernel side reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    /// A process became tracked: it opened an NVIDIA file, made its first matched ioctl, or was
    /// forked by a tracked `parent`.
    ProcessTracked {
        pid: u32,
        cgroup_id: u64,
        parent: Option<u32>,
    },
    /// A tracked process exited (its last thread).
    ProcessExited { pid: u32 },
    /// `RM_FREE` of a client, device or subdevice succeeded: the daemon releases that object and
    /// those below it made before `clock` (the serial clock then).
    TreeFreed {
        client: u32,
        object: u32,
        clock: u64,
    },
    /// The last reference to a control file (`file`: its `struct file` address) went at `clock`:
    /// the driver frees every client of that file without an `RM_FREE`.
    FileReleased { file: u64, clock: u64 },
    /// An allocation took a cgroup over its limit (react tier).
    LimitCrossed(LimitEvent),
    /// The deny tier refused an allocation.
    AllocationDenied(LimitEvent),
    /// The scheduler guard met a tenant's scheduling control.
    SchedulerGuarded(GuardEvent),
}

/// A memory limit met by an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitEvent {
    /// The allocating process.
    pub pid: u32,
    /// The cgroup whose limit it was (the caller's or an ancestor).
    pub cgroup_id: u64,
    /// RM device instance, `GPU_UNKNOWN` or `GPU_ALL`: the limit's key.
    pub gpu: u32,
    /// The cgroup's usage after the allocation (crossed) or at the time (denied).
    pub usage: u64,
    /// The allocation's size.
    pub bytes: u64,
    /// The allocation's RM client, and its handle (0 where it was refused: none was made).
    pub client: u32,
    pub object: u32,
}

/// A tenant's scheduling control, as the guard saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardEvent {
    pub pid: u32,
    pub cgroup_id: u64,
    /// The call's RM client.
    pub client: u32,
    /// The RM command.
    pub command: u32,
    /// What was asked: a timeslice in µs, or the foreign client named.
    pub requested: u64,
    /// The caller's timeslice allowance (µs).
    pub allowance: u64,
    pub action: GuardAction,
    pub reason: GuardReason,
}

/// What the guard did with a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GuardAction {
    /// Refused with `EPERM` before the driver saw it (a pre-driver hook).
    Denied,
    /// Rewritten so the driver rejects it, or into the driver's NULL command.
    Refused,
    /// A timeslice lowered to the allowance.
    Clamped,
    /// `audit`: let through.
    Audited,
    /// `enforce`, but this kernel can neither refuse nor rewrite: let through.
    Unenforced,
    /// Let through and undone after.
    Restored,
    /// Its caller killed, what it did undone.
    Killed,
}

impl GuardAction {
    pub fn from_code(code: u32) -> Result<Self, DecodeError> {
        Ok(match code {
            GUARD_DENIED => Self::Denied,
            GUARD_REFUSED => Self::Refused,
            GUARD_CLAMPED => Self::Clamped,
            GUARD_AUDITED => Self::Audited,
            GUARD_UNENFORCED => Self::Unenforced,
            GUARD_RESTORED => Self::Restored,
            GUARD_KILLED => Self::Killed,
            other => return Err(DecodeError::GuardAction(other)),
        })
    }

    /// The name in signals, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Denied => "denied",
            Self::Refused => "refused",
            Self::Clamped => "clamped",
            Self::Audited => "audited",
            Self::Unenforced => "unenforced",
            Self::Restored => "restored",
            Self::Killed => "killed",
        }
    }
}

/// Why the guard acted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GuardReason {
    /// A control tenants may never use.
    Forbidden,
    /// A timeslice above the allowance.
    Timeslice,
    /// A disable-channels list naming another process's client.
    ForeignClient,
    /// The driver's legacy path (command bit 15), which skips its checks.
    LegacyPath,
    /// A serialized parameter layout the guard cannot read.
    Flags,
    /// An enable of a channel or group gpud holds off.
    HeldOff,
}

impl GuardReason {
    pub fn from_code(code: u32) -> Result<Self, DecodeError> {
        Ok(match code {
            GUARD_REASON_FORBIDDEN => Self::Forbidden,
            GUARD_REASON_TIMESLICE => Self::Timeslice,
            GUARD_REASON_FOREIGN => Self::ForeignClient,
            GUARD_REASON_LEGACY => Self::LegacyPath,
            GUARD_REASON_FLAGS => Self::Flags,
            GUARD_REASON_HELD => Self::HeldOff,
            other => return Err(DecodeError::GuardReason(other)),
        })
    }

    /// The name in signals and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forbidden => "forbidden",
            Self::Timeslice => "timeslice",
            Self::ForeignClient => "foreign-client",
            Self::LegacyPath => "legacy-path",
            Self::Flags => "flags",
            Self::HeldOff => "held-off",
        }
    }
}

/// The guard's verdict word (`Event::gpu` of a guard event, `GuardKey::verdict`): the action in
/// the low byte, the reason above it.
pub fn split_verdict(verdict: u32) -> Result<(GuardAction, GuardReason), DecodeError> {
    Ok((
        GuardAction::from_code(verdict & 0xff)?,
        GuardReason::from_code(verdict >> 8)?,
    ))
}

impl Record {
    /// Decodes one ring-buffer record: told apart by size, then by kind.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() == size_of::<GuardRestore>() {
            // SAFETY: the length matches and GuardRestore is plain old data (any bit pattern is
            // valid); read_unaligned copes with any alignment of the ring-buffer slice.
            let r = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<GuardRestore>()) };
            return match r.kind {
                EVENT_GUARD_RESTORE => Undo::of(&r).map(Self::Undo),
                other => Err(DecodeError::Kind(other)),
            };
        }
        if bytes.len() != size_of::<Event>() {
            return Err(DecodeError::Size(bytes.len()));
        }
        // SAFETY: as above, for Event.
        let ev = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<Event>()) };
        Ok(match ev.kind {
            EVENT_GUARD_READ_BACK => Self::ReadBack(ReadBack {
                pid: ev.tgid,
                cgroup_id: ev.cgroup_id,
                file: ev.value,
                allowed: ev.bytes,
            }),
            EVENT_MEM_READ_BACK => Self::SizeCheck(SizeCheck {
                pid: ev.tgid,
                cgroup_id: ev.cgroup_id,
                gpu: ev.gpu,
                client: ev.client,
                object: ev.object,
                serial: ev.value,
                charged: ev.bytes,
            }),
            EVENT_DEVICE_READ_BACK => Self::DeviceCheck(DeviceCheck {
                pid: ev.tgid,
                cgroup_id: ev.cgroup_id,
                client: ev.client,
                object: ev.object,
                serial: ev.value,
                recorded: ev.gpu,
            }),
            EVENT_FREE_READ_BACK => Self::FreeCheck(FreeCheck {
                pid: ev.tgid,
                cgroup_id: ev.cgroup_id,
                client: ev.client,
                object: ev.object,
                at: ev.value,
            }),
            _ => Self::Event(KernelEvent::from_raw(&ev)?),
        })
    }
}

impl KernelEvent {
    /// The fields of a raw event by its kind (see the `EVENT_*` constants).
    pub fn from_raw(ev: &Event) -> Result<Self, DecodeError> {
        let limit = || LimitEvent {
            pid: ev.tgid,
            cgroup_id: ev.cgroup_id,
            gpu: ev.gpu,
            usage: ev.value,
            bytes: ev.bytes,
            client: ev.client,
            object: ev.object,
        };
        Ok(match ev.kind {
            EVENT_PROC_NEW => Self::ProcessTracked {
                pid: ev.tgid,
                cgroup_id: ev.cgroup_id,
                parent: (ev.client != 0).then_some(ev.client),
            },
            EVENT_PROC_EXIT => Self::ProcessExited { pid: ev.tgid },
            EVENT_FREE_TREE => Self::TreeFreed {
                client: ev.client,
                object: ev.object,
                clock: ev.value,
            },
            EVENT_FILE_RELEASE => Self::FileReleased {
                file: ev.value,
                clock: ev.bytes,
            },
            EVENT_LIMIT_CROSSED => Self::LimitCrossed(limit()),
            EVENT_ALLOC_DENIED => Self::AllocationDenied(limit()),
            EVENT_SCHED_GUARD => {
                let (action, reason) = split_verdict(ev.gpu)?;
                Self::SchedulerGuarded(GuardEvent {
                    pid: ev.tgid,
                    cgroup_id: ev.cgroup_id,
                    client: ev.client,
                    command: ev.object,
                    requested: ev.value,
                    allowance: ev.bytes,
                    action,
                    reason,
                })
            }
            other => return Err(DecodeError::Kind(other)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
        // SAFETY: the ABI records are repr(C) plain data without implicit padding.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    #[test]
    fn records_are_told_apart_by_size_then_kind() {
        let ev = Event {
            kind: EVENT_PROC_NEW,
            tgid: 42,
            cgroup_id: 7,
            client: 41,
            ..Default::default()
        };
        assert_eq!(
            Record::decode(&bytes_of(&ev)),
            Ok(Record::Event(KernelEvent::ProcessTracked {
                pid: 42,
                cgroup_id: 7,
                parent: Some(41)
            }))
        );
        let bytes = bytes_of(&ev);
        assert_eq!(
            Record::decode(&bytes[..bytes.len() - 1]),
            Err(DecodeError::Size(bytes.len() - 1))
        );
        assert_eq!(Record::decode(&[]), Err(DecodeError::Size(0)));
        let mut r = GuardRestore {
            kind: EVENT_GUARD_RESTORE,
            tgid: 9,
            cgroup_id: 3,
            client: 0xc1,
            object: 0x5d,
            verdict: GUARD_RESTORED | GUARD_REASON_FOREIGN << 8,
            num_channels: 2,
            ..Default::default()
        };
        (r.clients[0], r.channels[0], r.clients[1], r.channels[1]) = (0xa, 0x1, 0xb, 0x2);
        assert_eq!(
            Record::decode(&bytes_of(&r)),
            Ok(Record::Undo(Undo::Channels {
                pid: 9,
                cgroup_id: 3,
                client: 0xc1,
                subdevice: 0x5d,
                channels: vec![(0xa, 0x1), (0xb, 0x2)],
            }))
        );
        let ts = GuardRestore {
            verdict: GUARD_RESTORED | GUARD_REASON_TIMESLICE << 8,
            allowed: 2048,
            ..r
        };
        assert_eq!(
            Record::decode(&bytes_of(&ts)),
            Ok(Record::Undo(Undo::Timeslice {
                pid: 9,
                cgroup_id: 3,
                client: 0xc1,
                group: 0x5d,
                allowed: 2048,
            }))
        );
        let nothing = GuardRestore {
            verdict: GUARD_KILLED | GUARD_REASON_FORBIDDEN << 8,
            ..r
        };
        assert_eq!(
            Record::decode(&bytes_of(&nothing)),
            Err(DecodeError::NothingToUndo("forbidden"))
        );
        let other = GuardRestore { kind: 0, ..r };
        assert_eq!(Record::decode(&bytes_of(&other)), Err(DecodeError::Kind(0)));
    }

    #[test]
    fn a_read_back_request_names_the_file_and_the_allowance() {
        let ev = Event {
            kind: EVENT_GUARD_READ_BACK,
            tgid: 7,
            cgroup_id: 42,
            value: 0xffff_8880_1234_5600,
            bytes: 2048,
            ..Default::default()
        };
        assert_eq!(
            Record::decode(&bytes_of(&ev)),
            Ok(Record::ReadBack(ReadBack {
                pid: 7,
                cgroup_id: 42,
                file: 0xffff_8880_1234_5600,
                allowed: 2048,
            }))
        );
    }

    #[test]
    fn a_size_check_names_the_object_its_serial_and_its_charge() {
        let ev = Event {
            kind: EVENT_MEM_READ_BACK,
            tgid: 7,
            cgroup_id: 42,
            client: 0xc1d0_0001,
            object: 0xcaf0_0002,
            value: 123_456,
            bytes: 4096,
            gpu: 1,
            _pad: 0,
        };
        assert_eq!(
            Record::decode(&bytes_of(&ev)),
            Ok(Record::SizeCheck(SizeCheck {
                pid: 7,
                cgroup_id: 42,
                gpu: 1,
                client: 0xc1d0_0001,
                object: 0xcaf0_0002,
                serial: 123_456,
                charged: 4096,
            }))
        );
    }

    #[test]
    fn a_device_check_names_the_device_its_serial_and_the_gpu_recorded() {
        let ev = Event {
            kind: EVENT_DEVICE_READ_BACK,
            tgid: 7,
            cgroup_id: 42,
            client: 0xc1d0_0001,
            object: 0xcaf0_0003,
            value: 123_457,
            bytes: 0,
            gpu: 1,
            _pad: 0,
        };
        assert_eq!(
            Record::decode(&bytes_of(&ev)),
            Ok(Record::DeviceCheck(DeviceCheck {
                pid: 7,
                cgroup_id: 42,
                client: 0xc1d0_0001,
                object: 0xcaf0_0003,
                serial: 123_457,
                recorded: 1,
            }))
        );
    }

    #[test]
    fn a_free_check_names_the_object_and_when_the_driver_answered() {
        let ev = Event {
            kind: EVENT_FREE_READ_BACK,
            tgid: 7,
            cgroup_id: 42,
            client: 0xc1d0_0001,
            object: 0xcaf0_0004,
            value: 123_458,
            bytes: 0,
            gpu: gpud_common::GPU_UNKNOWN,
            _pad: 0,
        };
        assert_eq!(
            Record::decode(&bytes_of(&ev)),
            Ok(Record::FreeCheck(FreeCheck {
                pid: 7,
                cgroup_id: 42,
                client: 0xc1d0_0001,
                object: 0xcaf0_0004,
                at: 123_458,
            }))
        );
    }

    #[test]
    fn a_guard_events_verdict_word_is_split_into_action_and_reason() {
        let ev = Event {
            kind: EVENT_SCHED_GUARD,
            tgid: 5,
            cgroup_id: 3,
            client: 0xc1d0_0001,
            object: 0xa06c_0103,
            value: 1_000_000,
            bytes: 128,
            gpu: GUARD_CLAMPED | GUARD_REASON_TIMESLICE << 8,
            _pad: 0,
        };
        let Ok(KernelEvent::SchedulerGuarded(g)) = KernelEvent::from_raw(&ev) else {
            panic!("not a guard event");
        };
        assert_eq!(
            (g.action, g.reason, g.requested, g.allowance, g.command),
            (
                GuardAction::Clamped,
                GuardReason::Timeslice,
                1_000_000,
                128,
                0xa06c_0103
            )
        );
        let bad = Event {
            gpu: 99 | GUARD_REASON_TIMESLICE << 8,
            ..ev
        };
        assert_eq!(
            KernelEvent::from_raw(&bad),
            Err(DecodeError::GuardAction(99))
        );
        let bad = Event {
            gpu: GUARD_CLAMPED | 77 << 8,
            ..ev
        };
        assert_eq!(
            KernelEvent::from_raw(&bad),
            Err(DecodeError::GuardReason(77))
        );
    }

    #[test]
    fn a_process_tracked_without_a_parent_has_none() {
        let ev = Event {
            kind: EVENT_PROC_NEW,
            tgid: 1,
            ..Default::default()
        };
        assert_eq!(
            KernelEvent::from_raw(&ev),
            Ok(KernelEvent::ProcessTracked {
                pid: 1,
                cgroup_id: 0,
                parent: None
            })
        );
    }
}

/// Fuzz targets (`cargo xtask fuzz` runs them with many more cases): ring-buffer records of any
/// length and content decode or are refused with a typed error, never a panic.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn any_record_decodes_or_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            match Record::decode(&bytes) {
                Ok(
                    Record::Event(_)
                    | Record::ReadBack(_)
                    | Record::SizeCheck(_)
                    | Record::DeviceCheck(_)
                    | Record::FreeCheck(_),
                ) => {
                    prop_assert_eq!(bytes.len(), size_of::<Event>())
                }
                Ok(Record::Undo(_)) => prop_assert_eq!(bytes.len(), size_of::<GuardRestore>()),
                Err(DecodeError::Size(n)) => {
                    prop_assert_eq!(n, bytes.len());
                    prop_assert!(n != size_of::<Event>() && n != size_of::<GuardRestore>());
                }
                Err(_) => {}
            }
        }

        /// An event read from any offset of a buffer (the ring buffer guarantees no alignment to
        /// user space) decodes as the event written there.
        #[test]
        fn events_decode_at_any_alignment(
            tgid in any::<u32>(), cgroup_id in any::<u64>(), client in any::<u32>(),
            object in any::<u32>(), value in any::<u64>(), bytes in any::<u64>(),
            gpu in any::<u32>(), offset in 0usize..16,
        ) {
            let ev = Event {
                kind: EVENT_LIMIT_CROSSED, tgid, cgroup_id, client, object, value, bytes, gpu,
                _pad: 0,
            };
            let mut buf = vec![0xa5u8; offset];
            // SAFETY: Event is repr(C) plain data without implicit padding.
            buf.extend(unsafe {
                std::slice::from_raw_parts((&ev as *const Event).cast::<u8>(), size_of::<Event>())
            });
            prop_assert_eq!(
                Record::decode(&buf[offset..]),
                Ok(Record::Event(KernelEvent::LimitCrossed(LimitEvent {
                    pid: tgid, cgroup_id, gpu, usage: value, bytes, client, object,
                })))
            );
        }
    }
}
