//! RM controls on a tenant's channel groups, issued through the tenant's own open file.
//!
//! The driver binds an RM client to the control file that created it and refuses a control
//! through any other file (`NV_ERR_INVALID_CLIENT`: strict client validation, on by default). A
//! second descriptor of the same open file passes, so the daemon takes one from the tenant with
//! `pidfd_getfd(2)` (CAP_SYS_PTRACE over it; Yama's `ptrace_scope = 3` forbids it), issues the
//! control with its own privilege, and closes the descriptor at once: held, it would keep the
//! tenant's file open, and with it the tenant's clients and their GPU memory past its exit
//! (shared/reference/gpu-scheduler-controls.md §1.1). Which of the tenant's NVIDIA files owns a
//! client is not visible from outside: the files are tried, control files first, and the one
//! that answers is remembered.
//!
//! This module owns those descriptors' lifetimes and the pidfds it keeps per process.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use gpud_common::{
    DeviceKind, GPU_UNKNOWN, ObjKey, nv,
    rm::{Nv2080AllocParams, Nvos00, Nvos21, Nvos54, class, id, sched, status, surface, tsg},
};

use tracing::warn;

use crate::{
    attribution::{ChannelGroup, RmRef},
    probes::Matcher,
    report::Chain,
};

/// A control that could not be issued, or that the driver refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("cannot signal process {pid}")]
    Signal {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot open a pidfd of process {pid}")]
    Pidfd {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot take descriptor {fd} from process {pid} (pidfd_getfd needs CAP_SYS_PTRACE)")]
    TakeFd {
        pid: u32,
        fd: RawFd,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} has no subdevice on GPU {gpu} to disable its channels on")]
    NoSubdevice { pid: u32, gpu: u32 },
    #[error("process {pid} has no NVIDIA file that owns RM client {client:#x}")]
    NoFile { pid: u32, client: u32 },
    #[error("the RM control ioctl {cmd:#x} failed")]
    Ioctl {
        cmd: u32,
        #[source]
        source: io::Error,
    },
    #[error("the driver refused call {cmd:#x} on object {handle:#x} (status {status:#x})")]
    Refused { cmd: u32, handle: u32, status: u32 },
}

impl ControlError {
    /// Whether the channel group itself is gone (freed with its context): not a failure of the
    /// controls.
    pub fn group_gone(&self) -> bool {
        matches!(
            self,
            Self::Refused { status: s, .. } if *s == status::NV_ERR_INVALID_OBJECT_HANDLE
        )
    }
}

/// The channel groups the daemon holds off the runlist and the channels it holds disabled,
/// mirrored in the kernel's `HELD_GROUPS` map: meanwhile the scheduler guard turns their owners'
/// own `GPFIFO_SCHEDULE` and `FIFO_DISABLE_CHANNELS` enables of them into calls that do nothing
/// (or refuses them), so a tenant cannot let itself run during another's window.
pub struct HeldGroups {
    map: aya::maps::HashMap<aya::maps::MapData, ObjKey, u32>,
    /// Each held group's process, to forget the groups of processes that are gone.
    pids: BTreeMap<ObjKey, u32>,
}

impl HeldGroups {
    /// Takes over the map, emptied: what a previous daemon held was put back when it stopped,
    /// or is put back at the law's first sample.
    pub fn new(map: aya::maps::HashMap<aya::maps::MapData, ObjKey, u32>) -> Self {
        let mut held = Self {
            map,
            pids: BTreeMap::new(),
        };
        let stale: Vec<ObjKey> = held.map.keys().filter_map(Result::ok).collect();
        for k in stale {
            held.forget(k);
        }
        held
    }

    fn set(&mut self, g: &ChannelGroup, held: bool) {
        let key = ObjKey {
            client: g.client,
            object: g.handle,
        };
        self.set_key(key, g.pid, held);
    }

    /// Marks object `key` of process `pid` (a group or a channel) held or not.
    fn set_key(&mut self, key: ObjKey, pid: u32, held: bool) {
        if !held {
            self.forget(key);
            return;
        }
        match self.map.insert(key, 1, 0) {
            Ok(()) => {
                self.pids.insert(key, pid);
            }
            Err(e) => warn!(
                pid,
                object = format_args!("{:#x}", key.object),
                "the scheduler guard will not keep this object held: {}",
                Chain(&e)
            ),
        }
    }

    fn forget(&mut self, key: ObjKey) {
        self.pids.remove(&key);
        if let Err(e) = crate::probes::remove_key(&mut self.map, &key) {
            warn!("cannot release a held channel group: {}", Chain(&e));
        }
    }

    fn retain(&mut self, keep: &impl Fn(u32) -> bool) {
        let gone: Vec<ObjKey> = self
            .pids
            .iter()
            .filter(|(_, pid)| !keep(**pid))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            self.forget(k);
        }
    }
}

/// An RM object of a tenant: its process, its client, its handle there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmObject {
    pub pid: u32,
    pub client: u32,
    pub object: u32,
}

/// Taken around every change of what the daemon holds (a hold's control and its `HELD_GROUPS`
/// entry together) and by the restorer's sweep around its reading of `HELD_GROUPS` and the
/// groups it puts back ([`crate::enforcement::restore`]): a group put back on the runlist has
/// its channels' disables cleared, so a sweep landing between a hold's disable and its entry
/// would lift the hold while the law believes it in force. No state is kept under it: it only
/// orders the two threads' calls to the driver.
static HOLDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`HOLDS`] (a panic elsewhere under it left nothing half-changed that it guards).
pub(crate) fn holds() -> std::sync::MutexGuard<'static, ()> {
    HOLDS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The controls, with what they keep between calls.
pub struct Controls {
    matcher: Matcher,
    /// Where the kernel learns which groups are held off (`None`: the guard is not told).
    held: Option<HeldGroups>,
    pidfds: HashMap<u32, OwnedFd>,
    /// Per (process, client): the descriptor number of the file that owns the client.
    owners: HashMap<(u32, u32), RawFd>,
}

impl Controls {
    pub fn new(matcher: Matcher, held: Option<HeldGroups>) -> Self {
        Self {
            matcher,
            held,
            pidfds: HashMap::new(),
            owners: HashMap::new(),
        }
    }

    /// What counts as an NVIDIA file here.
    pub fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    /// Puts the group on the runlist, or takes it off and preempts it (off the runlist alone, a
    /// group on the engine keeps it until its timeslice ends).
    pub fn schedule(&mut self, g: &ChannelGroup, enabled: bool) -> Result<(), ControlError> {
        let _holds = holds();
        let mut params = tsg::ScheduleParams {
            enable: u8::from(enabled),
            ..Default::default()
        };
        self.control(g, tsg::GPFIFO_SCHEDULE, &mut params)?;
        if let Some(held) = &mut self.held {
            held.set(g, !enabled);
        }
        if !enabled {
            // Not waiting: the actuator keeps its times; the preemption completes within the
            // GPU's preemption latency.
            let mut preempt = tsg::PreemptParams::default();
            self.control(g, tsg::PREEMPT, &mut preempt)?;
        }
        Ok(())
    }

    /// Disables (or enables again) a process's channels with `FIFO_DISABLE_CHANNELS`, issued on
    /// `subdevice` (one of its own) through the file that owns that subdevice's client: the
    /// driver disables and preempts them, their queued work kept for when they are enabled.
    pub fn disable_channels(
        &mut self,
        pid: u32,
        subdevice: RmRef,
        channels: &[RmRef],
        disable: bool,
    ) -> Result<(), ControlError> {
        let _holds = holds();
        for chunk in channels.chunks(sched::DISABLE_CHANNELS_MAX) {
            let mut p = sched::DisableChannelsParams {
                disable: u8::from(disable),
                num_channels: chunk.len() as u32,
                ..Default::default()
            };
            for (i, c) in chunk.iter().enumerate() {
                p.client_list[i] = c.client;
                p.channel_list[i] = c.handle;
            }
            let target = RmObject {
                pid,
                client: subdevice.client,
                object: subdevice.handle,
            };
            self.control_on(target, sched::DISABLE_CHANNELS, &mut p)?;
            if let Some(held) = &mut self.held {
                for c in chunk {
                    let key = ObjKey {
                        client: c.client,
                        object: c.handle,
                    };
                    held.set_key(key, pid, disable);
                }
            }
        }
        Ok(())
    }

    /// Sets the group's timeslice (µs; the driver rounds it down to what the hardware holds).
    pub fn timeslice(&mut self, g: &ChannelGroup, us: u64) -> Result<(), ControlError> {
        let mut params = tsg::TimesliceParams { timeslice_us: us };
        self.control(g, tsg::SET_TIMESLICE, &mut params)
    }

    /// Forgets the processes `keep` rejects (their pidfds are closed).
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        if let Some(held) = &mut self.held {
            held.retain(&keep);
        }
        self.pidfds.retain(|pid, _| keep(*pid));
        self.owners.retain(|(pid, _), _| keep(*pid));
    }

    fn control<P>(
        &mut self,
        g: &ChannelGroup,
        cmd: u32,
        params: &mut P,
    ) -> Result<(), ControlError> {
        self.control_on(
            RmObject {
                pid: g.pid,
                client: g.client,
                object: g.handle,
            },
            cmd,
            params,
        )
    }

    /// Issues RM control `cmd` on object `o.object` of client `o.client`, through the file of
    /// process `o.pid` that owns the client.
    pub fn control_on<P>(
        &mut self,
        o: RmObject,
        cmd: u32,
        params: &mut P,
    ) -> Result<(), ControlError> {
        let mut req = Nvos54 {
            h_client: o.client,
            h_object: o.object,
            cmd,
            flags: 0,
            params: std::ptr::from_mut(params) as u64,
            params_size: size_of::<P>() as u32,
            status: 0,
        };
        // The driver reads `params_size` bytes at `params`: a live `P`, for the whole call.
        let status = self.through_owner(o.pid, o.client, cmd, |fd| {
            escape(fd, nv::NV_ESC_RM_CONTROL, &mut req).map(|()| req.status)
        })?;
        match status {
            status::NV_OK => Ok(()),
            status => Err(ControlError::Refused {
                cmd,
                handle: o.object,
                status,
            }),
        }
    }

    /// The size the driver allocated for memory object `o.object` of client `o.client`
    /// (`GET_SURFACE_INFO`'s `PHYS_SIZE`), asked through the file of process `o.pid` that owns
    /// the client.
    pub fn surface_size(&mut self, o: RmObject) -> Result<u64, ControlError> {
        let mut list = [surface::Info {
            index: surface::INDEX_PHYS_SIZE,
            data: 0,
        }];
        let mut params = surface::GetSurfaceInfoParams {
            list_size: list.len() as u32,
            _pad: 0,
            list: list.as_mut_ptr() as u64,
        };
        // The driver copies the list in and out through `params.list`: `list` lives on this
        // frame for the whole call.
        self.control_on(o, surface::GET_SURFACE_INFO, &mut params)?;
        Ok(u64::from(list[0].data) * surface::PHYS_SIZE_UNIT)
    }

    /// Whether the driver still has object `o.object` of client `o.client` (the client itself
    /// where they are equal), asked through the file of process `o.pid` that owns the client:
    /// any control on it answers `NV_ERR_OBJECT_NOT_FOUND` where the object is gone, before the
    /// driver looks at the command; the surface information is asked (answered by memory,
    /// `NV_ERR_NOT_SUPPORTED` by any other object).
    pub fn exists(&mut self, o: RmObject) -> Result<bool, ControlError> {
        match self.surface_size(o) {
            Ok(_) => Ok(true),
            Err(ControlError::Refused {
                status: status::NV_ERR_NOT_SUPPORTED,
                ..
            }) => Ok(true),
            Err(ControlError::Refused {
                status: status::NV_ERR_OBJECT_NOT_FOUND | status::NV_ERR_INVALID_OBJECT_HANDLE,
                ..
            }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The RM device instance of the GPU that device `o.object` of client `o.client` is on,
    /// asked through the file of process `o.pid` that owns the client. A device answers no
    /// query of its own instance; its subdevice does (`GPU_GET_ID`), and the client tells the
    /// instance of that `gpuId` (`GET_ID_INFO_V2`). The client's subdevice 0 under the device
    /// is used where it holds one (`FIND_SUBDEVICE_HANDLE`); else one is made for the question
    /// (a handle RM picks) and freed after. The client's own calls racing these (a subdevice
    /// made or freed meanwhile) are retried a few times, then refused.
    pub fn device_instance(&mut self, o: RmObject) -> Result<u32, ControlError> {
        let mut last = None;
        for _ in 0..3 {
            match self.try_device_instance(o) {
                Err(e @ ControlError::Refused { status: s, .. })
                    if s == status::NV_ERR_OBJECT_NOT_FOUND
                        || s == status::NV_ERR_INSUFFICIENT_RESOURCES =>
                {
                    last = Some(e);
                }
                done => return done,
            }
        }
        Err(last.unwrap_or(ControlError::Gone { pid: o.pid }))
    }

    fn try_device_instance(&mut self, o: RmObject) -> Result<u32, ControlError> {
        let mut find = id::FindSubdeviceHandleParams::default();
        let (subdevice, made) = match self.control_on(o, id::FIND_SUBDEVICE_HANDLE, &mut find) {
            Ok(()) => (find.h_sub_device, false),
            Err(ControlError::Refused {
                status: status::NV_ERR_OBJECT_NOT_FOUND,
                ..
            }) => {
                let mut params = Nv2080AllocParams { sub_device_id: 0 };
                (self.alloc_on(o, class::SUBDEVICE, &mut params)?, true)
            }
            Err(e) => return Err(e),
        };
        let sub = RmObject {
            object: subdevice,
            ..o
        };
        let asked = self.instance_of(sub);
        if made && let Err(e) = self.free_on(sub) {
            warn!(
                pid = o.pid,
                client = format_args!("{:#x}", o.client),
                "cannot free the subdevice gpud made to ask a device's GPU: {}",
                Chain(&e)
            );
        }
        asked
    }

    /// The device instance of subdevice `sub`'s GPU.
    fn instance_of(&mut self, sub: RmObject) -> Result<u32, ControlError> {
        let mut gpu = id::GetIdParams::default();
        self.control_on(sub, id::GPU_GET_ID, &mut gpu)?;
        let mut info = id::GetIdInfoV2Params {
            gpu_id: gpu.gpu_id,
            ..Default::default()
        };
        let client = RmObject {
            object: sub.client,
            ..sub
        };
        self.control_on(client, id::GET_ID_INFO_V2, &mut info)?;
        Ok(info.device_instance)
    }

    /// Makes an object of `class` under `o.object` of client `o.client` with `params`, through
    /// the file of process `o.pid` that owns the client: the handle RM picked.
    fn alloc_on<P>(
        &mut self,
        o: RmObject,
        class: u32,
        params: &mut P,
    ) -> Result<u32, ControlError> {
        let mut req = Nvos21 {
            h_root: o.client,
            h_object_parent: o.object,
            h_object_new: 0,
            h_class: class,
            p_alloc_parms: std::ptr::from_mut(params) as u64,
            params_size: size_of::<P>() as u32,
            status: 0,
        };
        // The driver copies the class's struct from `params`: a live `P`, for the whole call.
        let status = self.through_owner(o.pid, o.client, nv::NV_ESC_RM_ALLOC, |fd| {
            escape(fd, nv::NV_ESC_RM_ALLOC, &mut req).map(|()| req.status)
        })?;
        match status {
            status::NV_OK => Ok(req.h_object_new),
            status => Err(ControlError::Refused {
                cmd: nv::NV_ESC_RM_ALLOC,
                handle: o.object,
                status,
            }),
        }
    }

    /// Sends `SIGKILL` to process `pid` through a pidfd: the one opened when a control last
    /// went through it, so never a process that took its pid since (`Gone` where none is kept);
    /// with `just_seen` (the pid made an RM call moments ago) one is opened where none is.
    pub fn kill(&mut self, pid: u32, just_seen: bool) -> Result<(), ControlError> {
        let pidfd = match self.pidfds.get(&pid) {
            Some(fd) => fd.as_raw_fd(),
            None if just_seen => self.pidfd(pid)?,
            None => return Err(ControlError::Gone { pid }),
        };
        // SAFETY: pidfd_send_signal takes a pidfd, a signal, a null siginfo and flags 0.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd,
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        match r {
            0 => Ok(()),
            _ => {
                let source = io::Error::last_os_error();
                if source.raw_os_error() == Some(libc::ESRCH) {
                    return Err(ControlError::Gone { pid });
                }
                Err(ControlError::Signal { pid, source })
            }
        }
    }

    /// Frees object `o.object` of client `o.client` (`RM_FREE`: with its subtree) through the
    /// file of process `o.pid` that owns the client. An object already gone is no error.
    pub fn free_on(&mut self, o: RmObject) -> Result<(), ControlError> {
        let mut req = Nvos00 {
            h_root: o.client,
            h_object_parent: 0,
            h_object_old: o.object,
            status: 0,
        };
        let status = self.through_owner(o.pid, o.client, nv::NV_ESC_RM_FREE, |fd| {
            escape(fd, nv::NV_ESC_RM_FREE, &mut req).map(|()| req.status)
        })?;
        match status {
            status::NV_OK | status::NV_ERR_OBJECT_NOT_FOUND => Ok(()),
            status => Err(ControlError::Refused {
                cmd: nv::NV_ESC_RM_FREE,
                handle: o.object,
                status,
            }),
        }
    }

    /// Makes one RM call (`call`, on a descriptor: its `NV_STATUS`, or the ioctl's error)
    /// through the file of process `pid` that owns RM client `client`: the file remembered for
    /// it first, then its NVIDIA files, control files first; a file that does not own the client
    /// answers `NV_ERR_INVALID_CLIENT` and the next is tried. Each descriptor is closed right
    /// after its call. Returns the status of the file that owns the client.
    fn through_owner(
        &mut self,
        pid: u32,
        client: u32,
        cmd: u32,
        mut call: impl FnMut(RawFd) -> io::Result<u32>,
    ) -> Result<u32, ControlError> {
        let pidfd = self.pidfd(pid)?;
        let known = self.owners.get(&(pid, client)).copied();
        let candidates = known
            .into_iter()
            .chain(nvidia_fds(&self.matcher, pid).filter(|fd| Some(*fd) != known));
        for fd in candidates {
            let file = match take_fd(pidfd, fd) {
                Ok(f) => f,
                // Closed meanwhile: try the others.
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    return Err(ControlError::Gone { pid });
                }
                Err(source) => return Err(ControlError::TakeFd { pid, fd, source }),
            };
            let answer = call(file.as_raw_fd());
            // Closed at once, before anything else: see the module documentation.
            drop(file);
            match answer {
                // Not an RM file after all (a device file without a control file).
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
                Err(source) => return Err(ControlError::Ioctl { cmd, source }),
                Ok(status::NV_ERR_INVALID_CLIENT) => continue,
                Ok(status) => {
                    self.owners.insert((pid, client), fd);
                    return Ok(status);
                }
            }
        }
        self.owners.remove(&(pid, client));
        Err(ControlError::NoFile { pid, client })
    }

    fn pidfd(&mut self, pid: u32) -> Result<RawFd, ControlError> {
        if let Some(fd) = self.pidfds.get(&pid) {
            return Ok(fd.as_raw_fd());
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            let source = io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ESRCH) {
                return Err(ControlError::Gone { pid });
            }
            return Err(ControlError::Pidfd { pid, source });
        }
        // SAFETY: a new descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let raw = owned.as_raw_fd();
        self.pidfds.insert(pid, owned);
        Ok(raw)
    }
}

/// Whether a group belongs on `gpu` (a group whose GPU the probes could not tell goes with all).
pub fn on_gpu(g: &ChannelGroup, gpu: u32) -> bool {
    g.gpu == gpu || g.gpu == GPU_UNKNOWN
}

/// RM escape `nr` with its parameter struct `req` (the request encodes its size) on `fd`.
fn escape<T>(fd: RawFd, nr: u32, req: &mut T) -> io::Result<()> {
    let request = nv::nv_iowr(nr, size_of::<T>() as u32);
    // SAFETY: `req` is a live, exclusively borrowed T of the size the request encodes; what it
    // points to is the caller's to keep alive for the call.
    let ret = unsafe { libc::ioctl(fd, request as _, std::ptr::from_mut(req)) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A descriptor of the file behind `fd` of the process behind `pidfd`.
fn take_fd(pidfd: RawFd, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes two descriptors numbers and flags, returns a new descriptor or -1.
    let new = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(new as RawFd) })
}

/// The process's open NVIDIA files that can own RM clients, control files first.
fn nvidia_fds(matcher: &Matcher, pid: u32) -> impl Iterator<Item = RawFd> + use<> {
    let mut found: Vec<(u8, RawFd)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let fd: RawFd = e.file_name().to_str()?.parse().ok()?;
            let meta = std::fs::metadata(e.path()).ok()?;
            match matcher.kind(&meta)? {
                DeviceKind::Control => Some((0, fd)),
                DeviceKind::Gpu => Some((1, fd)),
                _ => None,
            }
        })
        .collect();
    found.sort_unstable();
    found.into_iter().map(|(_, fd)| fd)
}
