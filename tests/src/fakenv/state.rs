//! The fake's resource manager: clients bound to open files, object trees, per-GPU capacity,
//! and the escapes that act on them. The FUSE side ([`super`]) hands it each ioctl with the
//! caller's open file and thread; nested structs are read and written in the caller's memory.
//!
//! What of this model has been checked on a real GPU (`tests/gpu/real-gpu.sh`) and what has not
//! yet: see "What this fake models" in [`super`].

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    time::Duration,
};

/// What the driver keeps of a GPU's memory for itself: `TOTAL_RAM_SIZE` less `HEAP_SIZE` (480 MiB
/// on the H100 of docs/real-gpu.md).
const DRIVER_RESERVE: u64 = 480 << 20;

use gpud_common::{
    nv,
    rm::{self, Handle, sched},
};

use super::{
    ChannelGroupState, ChannelState, ClientState, FileState, GpuState, ObjectState, Options,
    Snapshot, Stats, parse_num, parse_size,
};
use crate::rm::{
    Plain, bytes_of, bytes_of_mut, class, from_bytes, get_u32, get_u64, nvos54_flags, put_u32,
    put_u64, status,
};

/// `hClass`-independent facts about a live object.
#[derive(Clone, Copy, Debug)]
struct Object {
    parent: Handle,
    class: u32,
    gpu: Option<u32>,
    bytes: u64,
    pid: u32,
    /// Channel groups: their scheduling state.
    sched: Option<Sched>,
    /// Channels (`HOPPER_CHANNEL_GPFIFO_A`, under a channel group, the `parent`): their state.
    channel: Option<Chan>,
}

/// A channel group's scheduling state, as its controls set it.
#[derive(Clone, Copy, Debug)]
struct Sched {
    enabled: bool,
    timeslice_us: u64,
    schedules: u64,
    preempts: u64,
    /// `SET_INTERLEAVE_LEVEL` (of the group or one of its channels): LOW 0, MEDIUM 1, HIGH 2.
    interleave: u32,
    /// `MAKE_REALTIME`.
    realtime: bool,
}

/// A channel's state, as `FIFO_DISABLE_CHANNELS` sets it: the driver counts disables. On the
/// H200 (docs/real-gpu.md, "Hardware controls") a channel disabled twice stayed stopped through
/// every later single enable until its group was put on the runlist again (`GPFIFO_SCHEDULE`
/// enable), so here a disable adds one, an enable takes one away, a group's schedule enable
/// clears its channels' count, and a channel runs at 0.
#[derive(Clone, Copy, Debug)]
struct Chan {
    disables: u32,
}

impl Chan {
    fn enabled(self) -> bool {
        self.disables == 0
    }
}

/// What a control needs of the caller beyond a client of its own file (the export row's access
/// right or flags; gpu-scheduler-controls.md §0.12).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// `NON_PRIVILEGED`, no access right.
    None,
    /// The `NICE` access right: `CAP_SYS_NICE` or `CAP_SYS_ADMIN`.
    Nice,
    /// `PRIVILEGED`: `USER_ROOT`, i.e. `CAP_SYS_ADMIN`.
    Privileged,
}

/// The gate of control `cmd`.
fn gate(cmd: u32) -> Gate {
    match cmd {
        sched::TSG_SET_INTERLEAVE_LEVEL
        | sched::CHANNEL_SET_INTERLEAVE_LEVEL
        | sched::TSG_MAKE_REALTIME
        | sched::CHANNEL_RESTART_RUNLIST
        | sched::RUNLIST_SET_SCHED_POLICY => Gate::Nice,
        sched::SET_COMPUTE_POLICY_CONFIG
        | sched::DEVICE_STOP_RUNLIST
        | sched::DEVICE_START_RUNLIST
        | sched::CONFIG_CTXSW_TIMEOUT => Gate::Privileged,
        _ => Gate::None,
    }
}

/// The parameter size of the controls this fake models (the export rows' sizes): the
/// scheduling controls of [`sched::CONTROLS`] (the channel-group ones among them) and
/// `FB_GET_INFO_V2`. `None` for any other command, which answers `NV_OK` doing nothing.
fn param_size(cmd: u32) -> Option<u32> {
    if cmd == rm::fb::GET_INFO_V2 {
        return Some(size_of::<rm::fb::GetInfoV2Params>() as u32);
    }
    sched::CONTROLS
        .iter()
        .find(|c| c.cmd == cmd)
        .map(|c| c.size)
}

/// Whether an object of `class` exports `cmd`: RM resolves a command on the object's resource
/// type, whatever class `cmd[31:16]` names (every channel class is one `KernelChannel`;
/// gpu-scheduler-controls.md §0.11).
fn exported(cmd: u32, object_class: u32) -> bool {
    let c = cmd >> 16;
    match object_class {
        class::CHANNEL_GROUP => c == 0xa06c || cmd == sched::CTX_SET_TPC_PARTITION_MODE,
        class::HOPPER_CHANNEL_GPFIFO_A => {
            matches!(c, 0xa06f | 0x906f | 0x506f | 0xc86f)
                || cmd == sched::CTX_SET_TPC_PARTITION_MODE
        }
        class::SUBDEVICE => c == 0x2080,
        class::DEVICE => c == 0x0080,
        _ => false,
    }
}

/// `CAP_SYS_ADMIN`, what RM calls `USER_ROOT`.
const CAP_SYS_ADMIN: u32 = 21;
/// `CAP_SYS_NICE`, which RM also takes for the `NICE` right.
const CAP_SYS_NICE: u32 = 23;

/// Whether thread `tid` holds `cap` in its effective set (`CapEff` of `/proc/TID/status`); no
/// when that cannot be read. The driver asks `capable()`, i.e. in the initial user namespace;
/// this reads the thread's own namespace's set, the same for the tests, which run in the
/// initial one.
fn capable(tid: u32, cap: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// RM's default channel-group timeslice on Volta and later (gpu-scheduler-controls.md §2).
const DEFAULT_TIMESLICE_US: u64 = 1024;

/// What taking a channel group off the runlist does to its process in this fake, which runs no
/// GPU work: `Record` only records it (as firmware that ignores the control would leave the
/// work running); `Stop` stops the owning process (SIGSTOP) while any of its groups is off, and
/// continues it when all are back: tests whose tenants burn CPU as their "GPU work" then see the
/// control take effect, as a context off the runlist makes no progress.
///
/// `Channels` is what the H200 showed (docs/real-gpu.md, "Hardware controls"): only disabled
/// channels stop the process; a group off the runlist is recorded and runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Runlist {
    #[default]
    Record,
    Stop,
    Channels,
}

#[derive(Debug)]
struct Client {
    file: u64,
    pid: u32,
    objects: BTreeMap<Handle, Object>,
    /// Next index for generated handles.
    next: u32,
}

impl Client {
    /// A handle from the client's generated range that is not in use.
    fn generate(&mut self, me: Handle) -> Option<Handle> {
        for _ in 0..rm::RS_UNIQUE_HANDLE_RANGE {
            let h = rm::RS_UNIQUE_HANDLE_BASE + self.next % rm::RS_UNIQUE_HANDLE_RANGE;
            self.next = self.next.wrapping_add(1);
            if h != me && !self.objects.contains_key(&h) {
                return Some(h);
            }
        }
        None
    }
}

#[derive(Clone, Copy, Debug)]
struct Gpu {
    capacity: u64,
    used: u64,
}

/// Pending fault injections.
#[derive(Debug, Default)]
pub(super) struct Inject {
    /// The next `count` video-memory allocations fail with `status`.
    fail_alloc: Option<(u32, u64)>,
    /// The next `count` ioctls fail with `errno`.
    errno: Option<(i32, u64)>,
    /// Every ioctl waits this long before it is handled.
    pub(super) delay: Duration,
    /// The next `count` RM controls with command `cmd` answer `status`: (cmd, status).
    fail_control: Option<((u32, u32), u64)>,
}

/// Uses one of a counted injection's remaining shots.
fn take<T: Copy>(slot: &mut Option<(T, u64)>) -> Option<T> {
    let (v, n) = slot.as_mut()?;
    let v = *v;
    *n -= 1;
    if *n == 0 {
        *slot = None;
    }
    Some(v)
}

/// Who issued a request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Caller {
    /// The open file (FUSE file handle).
    pub(super) fh: u64,
    /// The calling thread, as FUSE names it (a thread id serves for process_vm_readv).
    pub(super) tid: u32,
}

/// Video-memory request fields, from `NV_MEMORY_ALLOCATION_PARAMS` or `NVOS32`.
#[derive(Clone, Copy, Debug)]
struct VidReq {
    size: u64,
    flags: u32,
    attr: u32,
}

/// The fields of an `NV_ESC_RM_ALLOC` the fake acts on.
#[derive(Clone, Copy, Debug)]
struct AllocReq {
    root: Handle,
    parent: Handle,
    new: Handle,
    class: u32,
    /// `pAllocParms`, in the caller's memory.
    params: u64,
    /// NVOS64 with `FINN_SERIALIZED`.
    finn: bool,
}

/// What kind of object is made, with what its construction needs.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Device(u32),
    Subdevice(u32),
    Vidmem(VidReq),
    /// Memory classes without video memory (virtual, system): under a device or subdevice.
    Memory,
    /// `KEPLER_CHANNEL_GROUP_A`: under a device.
    ChannelGroup,
    /// `HOPPER_CHANNEL_GPFIFO_A`: under a channel group.
    Channel,
    Plain,
}

/// Result of an escape: `Ok` for `ioctl()` returning 0 (the RM status is in the struct), or an
/// errno.
type EscapeResult = Result<(), i32>;

/// The fake resource manager.
#[derive(Debug)]
pub(super) struct Rm {
    page_size: u64,
    gpus: Vec<Gpu>,
    clients: BTreeMap<Handle, Client>,
    /// Open `nvidiactl` files: FUSE file handle → opener's pid.
    pub(super) files: BTreeMap<u64, u32>,
    next_client: u32,
    pub(super) inject: Inject,
    runlist: Runlist,
    /// Processes this fake stopped (`Runlist::Stop`).
    stopped: BTreeSet<u32>,
    /// Per command: the modelled RM controls that passed every check and took effect.
    controls: BTreeMap<u32, u64>,
    stats: Stats,
    verbose: bool,
}

impl Rm {
    pub(super) fn new(o: &Options) -> Self {
        Self {
            page_size: o.page_size.max(1),
            gpus: vec![
                Gpu {
                    capacity: o.capacity,
                    used: 0
                };
                o.gpus as usize
            ],
            clients: BTreeMap::new(),
            files: BTreeMap::new(),
            next_client: 1,
            inject: Inject::default(),
            runlist: Runlist::default(),
            stopped: BTreeSet::new(),
            controls: BTreeMap::new(),
            stats: Stats::default(),
            verbose: o.verbose,
        }
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        let gpus = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuState {
                index: i as u32,
                capacity: g.capacity,
                used: g.used,
            })
            .collect();
        let files = self
            .files
            .iter()
            .map(|(&fh, &pid)| FileState {
                fh,
                pid,
                clients: self
                    .clients
                    .iter()
                    .filter(|(_, c)| c.file == fh)
                    .map(|(&h, _)| h)
                    .collect(),
            })
            .collect();
        let clients = self
            .clients
            .iter()
            .map(|(&handle, c)| ClientState {
                handle,
                file: c.file,
                pid: c.pid,
            })
            .collect();
        let mut objects = Vec::new();
        let mut channel_groups = Vec::new();
        let mut channels = Vec::new();
        for (&client, c) in &self.clients {
            for (&handle, o) in &c.objects {
                objects.push(ObjectState {
                    client,
                    handle,
                    parent: o.parent,
                    class: o.class,
                    gpu: o.gpu,
                    bytes: o.bytes,
                    pid: o.pid,
                });
                if let Some(s) = o.sched {
                    channel_groups.push(ChannelGroupState {
                        client,
                        handle,
                        pid: o.pid,
                        gpu: o.gpu,
                        enabled: s.enabled,
                        timeslice_us: s.timeslice_us,
                        schedules: s.schedules,
                        preempts: s.preempts,
                        interleave: s.interleave,
                        realtime: s.realtime,
                    });
                }
                if let Some(ch) = o.channel {
                    channels.push(ChannelState {
                        client,
                        handle,
                        group: o.parent,
                        pid: o.pid,
                        gpu: o.gpu,
                        enabled: ch.enabled(),
                    });
                }
            }
        }
        Snapshot {
            channel_groups,
            channels,
            controls: self
                .controls
                .iter()
                .map(|(cmd, &n)| (format!("{cmd:#010x}"), n))
                .collect(),
            page_size: self.page_size,
            gpus,
            files,
            clients,
            objects,
            stats: self.stats.clone(),
        }
    }

    /// One ioctl on `nvidiactl`: `input` is what the kernel copied in (`_IOC_SIZE` bytes for a
    /// write-direction command). Returns the struct to copy out, or an errno.
    pub(super) fn ioctl(&mut self, c: Caller, cmd: u32, input: &[u8]) -> Result<Vec<u8>, i32> {
        self.stats.ioctls += 1;
        if let Some(e) = take(&mut self.inject.errno) {
            return Err(e);
        }
        let nr = nv::ioc_nr(cmd);
        let mut buf = input.to_vec();
        buf.resize(nv::ioc_size(cmd) as usize, 0);
        let r = if nr == nv::NV_ESC_IOCTL_XFER_CMD {
            self.xfer(c, &buf)
        } else {
            self.escape(c, nr, &mut buf)
        };
        if self.verbose {
            eprintln!(
                "fakenv: tid {} fh {} cmd {cmd:#010x} (nr {nr:#x}, size {}) -> {r:?}",
                c.tid,
                c.fh,
                buf.len()
            );
        }
        r.map(|()| buf)
    }

    /// `NV_ESC_IOCTL_XFER_CMD`: the inner struct lives at `xfer.ptr` in the caller's memory.
    fn xfer(&mut self, c: Caller, buf: &[u8]) -> EscapeResult {
        if buf.len() != nv::NV_IOCTL_XFER_SIZE as usize {
            return Err(libc::EINVAL);
        }
        let x: rm::NvIoctlXfer = from_bytes(buf);
        if x.size > nv::NV_MAX_IOCTL_SIZE || x.cmd > 0xff || x.cmd == nv::NV_ESC_IOCTL_XFER_CMD {
            return Err(libc::EINVAL);
        }
        let mut inner = vec![0u8; x.size as usize];
        remote_read(c.tid, x.ptr, &mut inner).map_err(|_| libc::EFAULT)?;
        self.escape(c, x.cmd, &mut inner)?;
        remote_write(c.tid, x.ptr, &inner).map_err(|_| libc::EFAULT)
    }

    /// One escape on its parameter struct (`buf.len()` is the size the caller gave).
    fn escape(&mut self, c: Caller, nr: u32, buf: &mut [u8]) -> EscapeResult {
        let size = buf.len() as u32;
        match nr {
            nv::NV_ESC_RM_ALLOC => self.rm_alloc(c, buf),
            nv::NV_ESC_RM_FREE => {
                if size != nv::NVOS00_SIZE {
                    return Err(libc::EINVAL);
                }
                let mut p: rm::Nvos00 = from_bytes(buf);
                p.status = self.free(c.fh, p.h_root, p.h_object_old);
                self.count(p.status);
                buf.copy_from_slice(bytes_of(&p));
                Ok(())
            }
            nv::NV_ESC_RM_VID_HEAP_CONTROL => self.vid_heap(c, buf),
            nv::NV_ESC_RM_CONTROL if size == nv::NVOS54_SIZE => {
                let mut p: rm::Nvos54 = from_bytes(buf);
                p.status = self.control(c, &p);
                self.count(p.status);
                buf.copy_from_slice(bytes_of(&p));
                Ok(())
            }
            // Device files only: the driver refuses it on the control device.
            nv::NV_ESC_RM_ALLOC_MEMORY => Err(libc::EINVAL),
            _ => match rm::escape_status_offset(nr, size) {
                Some((off, has_client)) => {
                    let st = if nr == nv::NV_ESC_RM_DUP_OBJECT {
                        status::NV_ERR_NOT_SUPPORTED
                    } else if has_client {
                        self.check_client(c.fh, get_u32(buf, 0))
                    } else {
                        status::NV_OK
                    };
                    self.count(st);
                    put_u32(buf, off, st);
                    Ok(())
                }
                // An escape the fake knows with a size the driver refuses.
                None if known_size_escape(nr) => Err(libc::EINVAL),
                None if (0x27..=0x5f).contains(&nr) || (200..=218).contains(&nr) => Ok(()),
                // RmIoctl's default case: an unknown command is a malformed request.
                None => Err(libc::EINVAL),
            },
        }
    }

    fn count(&mut self, st: u32) {
        if st != status::NV_OK {
            self.stats.refused += 1;
        }
    }

    /// `NV_ESC_RM_ALLOC`, NVOS21 or NVOS64 by size.
    fn rm_alloc(&mut self, c: Caller, buf: &mut [u8]) -> EscapeResult {
        let (long, status_at) = match buf.len() as u32 {
            nv::NVOS21_SIZE => (false, rm::NVOS21_STATUS),
            nv::NVOS64_SIZE => (true, rm::NVOS64_STATUS),
            _ => return Err(libc::EINVAL),
        };
        let finn = long && get_u32(buf, rm::NVOS64_FLAGS) & rm::NVOS64_FLAGS_FINN_SERIALIZED != 0;
        let a = AllocReq {
            root: get_u32(buf, rm::ALLOC_H_ROOT),
            parent: get_u32(buf, rm::ALLOC_H_PARENT),
            new: get_u32(buf, rm::ALLOC_H_NEW),
            class: get_u32(buf, rm::ALLOC_H_CLASS),
            params: get_u64(buf, rm::ALLOC_P_PARAMS),
            finn,
        };
        let st = match self.alloc(c, a) {
            Ok(h) => {
                put_u32(buf, rm::ALLOC_H_NEW, h);
                status::NV_OK
            }
            Err(st) => st,
        };
        self.count(st);
        put_u32(buf, status_at, st);
        Ok(())
    }

    fn alloc(&mut self, c: Caller, a: AllocReq) -> Result<Handle, u32> {
        let AllocReq {
            root,
            parent,
            new,
            class,
            params,
            finn,
        } = a;
        if class::is_root(class) {
            return self.alloc_client(c, new);
        }
        match class {
            class::MEMORY_LOCAL_USER => {
                if finn {
                    return Err(status::NV_ERR_NOT_SUPPORTED);
                }
                let mut p: rm::MemoryAllocationParams =
                    read_remote(c.tid, params).ok_or(status::NV_ERR_INVALID_POINTER)?;
                let req = VidReq {
                    size: p.size,
                    flags: p.flags,
                    attr: p.attr,
                };
                let (h, bytes) = self.create(c, root, parent, new, class, Kind::Vidmem(req))?;
                // RM copies the whole params struct back on success, with the allocated size.
                p.size = bytes;
                p.limit = bytes - 1;
                if remote_write(c.tid, params, bytes_of(&p)).is_err() {
                    self.free(c.fh, root, h);
                    return Err(status::NV_ERR_INVALID_POINTER);
                }
                Ok(h)
            }
            class::MEMORY_VIRTUAL | class::MEMORY_SYSTEM => {
                if finn {
                    return Err(status::NV_ERR_NOT_SUPPORTED);
                }
                self.create(c, root, parent, new, class, Kind::Memory)
                    .map(|(h, _)| h)
            }
            class::DEVICE => {
                let p: rm::Nv0080AllocParams = read_params(c.tid, params)?;
                self.create(c, root, parent, new, class, Kind::Device(p.device_id))
                    .map(|(h, _)| h)
            }
            class::CHANNEL_GROUP => self
                .create(c, root, parent, new, class, Kind::ChannelGroup)
                .map(|(h, _)| h),
            // Its params (`NV_CHANNEL_ALLOC_PARAMS`: GPFIFO, error notifier…) are not read.
            class::HOPPER_CHANNEL_GPFIFO_A => self
                .create(c, root, parent, new, class, Kind::Channel)
                .map(|(h, _)| h),
            class::SUBDEVICE => {
                let p: rm::Nv2080AllocParams = read_params(c.tid, params)?;
                self.create(
                    c,
                    root,
                    parent,
                    new,
                    class,
                    Kind::Subdevice(p.sub_device_id),
                )
                .map(|(h, _)| h)
            }
            _ => self
                .create(c, root, parent, new, class, Kind::Plain)
                .map(|(h, _)| h),
        }
    }

    /// A client bound to the caller's open file; `new` 0 generates the handle.
    fn alloc_client(&mut self, c: Caller, new: Handle) -> Result<Handle, u32> {
        let h = if new != 0 {
            if self.clients.contains_key(&new) {
                return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
            }
            new
        } else {
            let mut found = None;
            for _ in 0..0x10_0000 {
                let h = rm::RS_CLIENT_HANDLE_BASE | (self.next_client & 0xf_ffff);
                self.next_client = self.next_client.wrapping_add(1);
                if !self.clients.contains_key(&h) {
                    found = Some(h);
                    break;
                }
            }
            found.ok_or(status::NV_ERR_INSUFFICIENT_RESOURCES)?
        };
        self.clients.insert(
            h,
            Client {
                file: c.fh,
                pid: tgid(c.tid),
                objects: BTreeMap::new(),
                next: 0,
            },
        );
        self.stats.created += 1;
        Ok(h)
    }

    /// `NV_OK` when `client` is live and bound to file `fh`.
    fn check_client(&self, fh: u64, client: Handle) -> u32 {
        match self.clients.get(&client) {
            Some(c) if c.file == fh => status::NV_OK,
            _ => status::NV_ERR_INVALID_CLIENT,
        }
    }

    /// Makes an object of `class` under `parent` in `root`; returns its handle and the video
    /// memory it holds.
    fn create(
        &mut self,
        c: Caller,
        root: Handle,
        parent: Handle,
        new: Handle,
        class: u32,
        kind: Kind,
    ) -> Result<(Handle, u64), u32> {
        let st = self.check_client(c.fh, root);
        if st != status::NV_OK {
            return Err(st);
        }
        let client = &self.clients[&root];
        let parent_obj = if parent == root {
            None
        } else {
            Some(
                *client
                    .objects
                    .get(&parent)
                    .ok_or(status::NV_ERR_INVALID_OBJECT_PARENT)?,
            )
        };
        let parent_class = parent_obj.map(|o| o.class);
        let parent_gpu = parent_obj.and_then(|o| o.gpu);
        let under_gpu = matches!(parent_class, Some(class::DEVICE | class::SUBDEVICE));
        if new != 0 && (new == root || client.objects.contains_key(&new)) {
            return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
        }
        let (gpu, vid) = match kind {
            Kind::Device(id) => {
                if parent_obj.is_some() {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                if id as usize >= self.gpus.len() {
                    return Err(status::NV_ERR_INVALID_ARGUMENT);
                }
                (Some(id), None)
            }
            Kind::Subdevice(id) => {
                if parent_class != Some(class::DEVICE) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                if id != 0 {
                    return Err(status::NV_ERR_INVALID_ARGUMENT);
                }
                (parent_gpu, None)
            }
            Kind::Vidmem(req) => {
                if !under_gpu {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, Some(req))
            }
            Kind::Memory => {
                if !under_gpu {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::ChannelGroup => {
                if parent_class != Some(class::DEVICE) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::Channel => {
                if parent_class != Some(class::CHANNEL_GROUP) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::Plain => (parent_gpu, None),
        };
        let bytes = match (vid, gpu) {
            (Some(req), Some(g)) => self.charge(g, req)?,
            _ => 0,
        };
        let client = self.clients.get_mut(&root).expect("client checked above");
        let h = if new != 0 {
            new
        } else {
            match client.generate(root) {
                Some(h) => h,
                None => {
                    if let Some(g) = gpu {
                        self.gpus[g as usize].used -= bytes;
                    }
                    return Err(status::NV_ERR_INSUFFICIENT_RESOURCES);
                }
            }
        };
        client.objects.insert(
            h,
            Object {
                parent,
                class,
                gpu,
                bytes,
                pid: tgid(c.tid),
                sched: matches!(kind, Kind::ChannelGroup).then_some(Sched {
                    enabled: true,
                    timeslice_us: DEFAULT_TIMESLICE_US,
                    schedules: 0,
                    preempts: 0,
                    // kchangrpInit zeroes the levels: LOW.
                    interleave: 0,
                    realtime: false,
                }),
                channel: matches!(kind, Kind::Channel).then_some(Chan { disables: 0 }),
            },
        );
        self.stats.created += 1;
        Ok((h, bytes))
    }

    /// Takes video memory from `gpu` as `vidmemConstruct` would; returns the rounded size.
    fn charge(&mut self, gpu: u32, req: VidReq) -> Result<u64, u32> {
        if req.flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0
            || rm::attr_location(req.attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM
        {
            return Err(status::NV_ERR_INVALID_ARGUMENT);
        }
        if let Some(st) = take(&mut self.inject.fail_alloc) {
            return Err(st);
        }
        if req.size == 0 {
            return Err(status::NV_ERR_INVALID_ARGUMENT);
        }
        let rounded = req
            .size
            .checked_next_multiple_of(self.page_size)
            .ok_or(status::NV_ERR_NO_MEMORY)?;
        let g = &mut self.gpus[gpu as usize];
        match g.used.checked_add(rounded) {
            Some(total) if total <= g.capacity => {
                g.used = total;
                Ok(rounded)
            }
            _ => Err(status::NV_ERR_NO_MEMORY),
        }
    }

    fn uncharge(&mut self, objects: impl IntoIterator<Item = Object>) {
        for o in objects {
            if let (Some(g), true) = (o.gpu, o.bytes > 0) {
                self.gpus[g as usize].used -= o.bytes;
            }
        }
    }

    /// `RM_FREE` semantics: the object and its subtree, the whole client when `handle == root`,
    /// `NV_OK` for a handle that does not exist.
    fn free(&mut self, fh: u64, root: Handle, handle: Handle) -> u32 {
        let st = self.check_client(fh, root);
        if st != status::NV_OK {
            return st;
        }
        if handle == root {
            self.free_client(root);
            return status::NV_OK;
        }
        let client = self.clients.get_mut(&root).expect("client checked above");
        if !client.objects.contains_key(&handle) {
            return status::NV_OK;
        }
        let mut doomed = vec![handle];
        let mut i = 0;
        while i < doomed.len() {
            let p = doomed[i];
            doomed.extend(
                client
                    .objects
                    .iter()
                    .filter(|(_, o)| o.parent == p)
                    .map(|(&h, _)| h),
            );
            i += 1;
        }
        let gone: Vec<Object> = doomed
            .iter()
            .filter_map(|h| client.objects.remove(h))
            .collect();
        self.uncharge(gone);
        self.apply_runlist();
        status::NV_OK
    }

    fn free_client(&mut self, root: Handle) {
        if let Some(c) = self.clients.remove(&root) {
            self.uncharge(c.objects.into_values());
        }
        self.apply_runlist();
    }

    /// `NV_ESC_RM_CONTROL` (NVOS54), with the driver's checks in the driver's order
    /// (gpu-scheduler-controls.md §0; `control.c`, `rs_server.c`):
    ///
    /// 1. `cmd` bit 15 ([`sched::LEGACY_BIT`]): the GSS-legacy path, which forwards the call
    ///    to the firmware after a mere lookup of the client (any live client, whatever file it
    ///    is bound to; none: `NV_ERR_INVALID_CLIENT`), with no size, privilege or binding check;
    ///    bit 14 as well needs `CAP_SYS_ADMIN` (else `NV_ERR_INSUFFICIENT_PERMISSIONS`). The
    ///    firmware answered `NV_ERR_NOT_SUPPORTED` on the H100 (docs/real-gpu.md): so does
    ///    this fake, counting the call in `stats.legacy`, nothing read or done.
    /// 2. A NULL command (`cmd` 0, or category and index 0, as `0xa06c0000`): `NV_OK` at once,
    ///    nothing checked, read or done.
    /// 3. `flags` bit 0 or 1 (raised IRQL, lock bypass): `NV_ERR_INVALID_ARGUMENT`.
    /// 4. No such client: `NV_ERR_INVALID_CLIENT`.
    /// 5. A control this fake models ([`param_size`]): `flags` `FINN_SERIALIZED` answers
    ///    `NV_ERR_NOT_SUPPORTED` (the fake's choice: it deserializes nothing); a parameter size
    ///    other than the control's, a size with a null pointer or a pointer with size 0 answer
    ///    `NV_ERR_INVALID_ARGUMENT`, before the parameters are read. Other controls answer
    ///    `NV_OK` doing nothing once the client passes step 6.
    /// 6. A client bound to another open file: `NV_ERR_INVALID_CLIENT` (strict validation, the
    ///    driver's default). So the size check comes first, as in the driver.
    /// 7. No such object: `NV_ERR_OBJECT_NOT_FOUND`; an object that does not export the
    ///    command ([`exported`]): `NV_ERR_NOT_SUPPORTED`. Channel-group commands (`0xa06c…`)
    ///    answer `NV_ERR_INVALID_OBJECT_HANDLE` for both instead, as this fake always has (gpud
    ///    reads it as "the group is gone").
    /// 8. The `NICE` right or the `PRIVILEGED` flag ([`gate`]) missing:
    ///    `NV_ERR_INSUFFICIENT_PERMISSIONS`.
    /// 9. An injected `fail-control` answers its status; otherwise the control takes effect
    ///    ([`Rm::effect`]) and, where it answers `NV_OK`, is counted per command.
    fn control(&mut self, c: Caller, p: &rm::Nvos54) -> u32 {
        if p.cmd & sched::LEGACY_BIT != 0 {
            if !self.clients.contains_key(&p.h_client) {
                return status::NV_ERR_INVALID_CLIENT;
            }
            if p.cmd & 0x4000 != 0 && !capable(c.tid, CAP_SYS_ADMIN) {
                return status::NV_ERR_INSUFFICIENT_PERMISSIONS;
            }
            self.stats.legacy += 1;
            return status::NV_ERR_NOT_SUPPORTED;
        }
        if p.cmd & 0xffff == 0 {
            return status::NV_OK;
        }
        if p.flags & (nvos54_flags::IRQL_RAISED | nvos54_flags::LOCK_BYPASS) != 0 {
            return status::NV_ERR_INVALID_ARGUMENT;
        }
        if !self.clients.contains_key(&p.h_client) {
            return status::NV_ERR_INVALID_CLIENT;
        }
        let Some(size) = param_size(p.cmd) else {
            return self.check_client(c.fh, p.h_client);
        };
        if p.flags & nvos54_flags::FINN_SERIALIZED != 0 {
            return status::NV_ERR_NOT_SUPPORTED;
        }
        if (p.params_size != 0 && p.params == 0)
            || (p.params_size == 0 && p.params != 0)
            || p.params_size != size
        {
            return status::NV_ERR_INVALID_ARGUMENT;
        }
        let st = self.check_client(c.fh, p.h_client);
        if st != status::NV_OK {
            return st;
        }
        let group_cmd = p.cmd >> 16 == class::CHANNEL_GROUP;
        let Some(obj) = self.clients[&p.h_client].objects.get(&p.h_object).copied() else {
            return if group_cmd {
                status::NV_ERR_INVALID_OBJECT_HANDLE
            } else {
                status::NV_ERR_OBJECT_NOT_FOUND
            };
        };
        if !exported(p.cmd, obj.class) {
            return if group_cmd {
                status::NV_ERR_INVALID_OBJECT_HANDLE
            } else {
                status::NV_ERR_NOT_SUPPORTED
            };
        }
        let allowed = match gate(p.cmd) {
            Gate::None => true,
            Gate::Nice => capable(c.tid, CAP_SYS_NICE) || capable(c.tid, CAP_SYS_ADMIN),
            Gate::Privileged => capable(c.tid, CAP_SYS_ADMIN),
        };
        if !allowed {
            return status::NV_ERR_INSUFFICIENT_PERMISSIONS;
        }
        if let Some(((cmd, st), _)) = self.inject.fail_control
            && cmd == p.cmd
        {
            take(&mut self.inject.fail_control);
            return st;
        }
        let st = self.effect(c, p, &obj);
        if st == status::NV_OK {
            *self.controls.entry(p.cmd).or_default() += 1;
        }
        self.apply_runlist();
        st
    }

    /// What a modelled control does once every check passed, on object `obj` (`p.h_object`),
    /// which exports it. Channel-group controls act on the group; a channel's interleave level
    /// is its group's (the driver applies it to the whole group). The scheduling controls
    /// this fake gives no effect (the guard's `Refuse` rows: `RESTART_RUNLIST`,
    /// `SET_CHANNEL_PROPERTIES`, `STOP`/`START_RUNLIST`, `SET_GPFIFO`, `SET_SCHED_POLICY`,
    /// `SET_COMPUTE_POLICY_CONFIG`, key rotation, …) read their parameters and answer `NV_OK`:
    /// the per-command count is what shows the driver saw them.
    fn effect(&mut self, c: Caller, p: &rm::Nvos54, obj: &Object) -> u32 {
        use rm::tsg;
        let (client, h) = (p.h_client, p.h_object);
        match p.cmd {
            rm::fb::GET_INFO_V2 => self.fb_info(c, p, obj),
            tsg::GPFIFO_SCHEDULE => match params::<tsg::ScheduleParams>(c, p) {
                Ok(s) => {
                    let st = self.with_group(client, h, |g| {
                        g.enabled = s.enable != 0;
                        g.schedules += 1;
                    });
                    if st == status::NV_OK && s.enable != 0 && s.skip_enable == 0 {
                        self.enable_group_channels(client, h);
                    }
                    st
                }
                Err(st) => st,
            },
            tsg::SET_TIMESLICE => match params::<tsg::TimesliceParams>(c, p) {
                Ok(t) => self.with_group(client, h, |g| g.timeslice_us = t.timeslice_us),
                Err(st) => st,
            },
            tsg::GET_TIMESLICE => match params::<tsg::TimesliceParams>(c, p) {
                Ok(_) => {
                    let Some(timeslice_us) = self.group(client, h).map(|g| g.timeslice_us) else {
                        return status::NV_ERR_INVALID_OBJECT_HANDLE;
                    };
                    let t = tsg::TimesliceParams { timeslice_us };
                    if remote_write(c.tid, p.params, bytes_of(&t)).is_ok() {
                        status::NV_OK
                    } else {
                        status::NV_ERR_INVALID_POINTER
                    }
                }
                Err(st) => st,
            },
            tsg::PREEMPT => match params::<tsg::PreemptParams>(c, p) {
                Ok(_) => self.with_group(client, h, |g| g.preempts += 1),
                Err(st) => st,
            },
            // `kchangrpSetInterleaveLevel` takes LOW, MEDIUM and HIGH only.
            sched::TSG_SET_INTERLEAVE_LEVEL | sched::CHANNEL_SET_INTERLEAVE_LEVEL => {
                match params::<sched::InterleaveParams>(c, p) {
                    Ok(l) if l.level > 2 => status::NV_ERR_INVALID_ARGUMENT,
                    Ok(l) => self.with_group(client, h, |g| g.interleave = l.level),
                    Err(st) => st,
                }
            }
            sched::TSG_MAKE_REALTIME => match params::<sched::RealtimeParams>(c, p) {
                Ok(r) => self.with_group(client, h, |g| g.realtime = r.realtime != 0),
                Err(st) => st,
            },
            sched::DISABLE_CHANNELS => match params::<sched::DisableChannelsParams>(c, p) {
                Ok(d) => self.disable_channels(&d),
                Err(st) => st,
            },
            _ => {
                let mut raw = vec![0u8; p.params_size as usize];
                match remote_read(c.tid, p.params, &mut raw) {
                    Ok(()) => status::NV_OK,
                    Err(_) => status::NV_ERR_INVALID_POINTER,
                }
            }
        }
    }

    /// The scheduling state of channel group `h` of `client`, or of the group of channel `h`.
    fn group(&self, client: Handle, h: Handle) -> Option<&Sched> {
        let objects = &self.clients.get(&client)?.objects;
        let o = objects.get(&h)?;
        let g = if o.channel.is_some() { o.parent } else { h };
        objects.get(&g)?.sched.as_ref()
    }

    /// Applies `f` to the state of [`Rm::group`]: `NV_OK`, or `NV_ERR_INVALID_OBJECT_HANDLE`
    /// where there is no such group.
    fn with_group(&mut self, client: Handle, h: Handle, f: impl FnOnce(&mut Sched)) -> u32 {
        let Some(objects) = self.clients.get_mut(&client).map(|c| &mut c.objects) else {
            return status::NV_ERR_INVALID_CLIENT;
        };
        let g = match objects.get(&h) {
            Some(o) if o.channel.is_some() => o.parent,
            _ => h,
        };
        match objects.get_mut(&g).and_then(|o| o.sched.as_mut()) {
            Some(s) => {
                f(s);
                status::NV_OK
            }
            None => status::NV_ERR_INVALID_OBJECT_HANDLE,
        }
    }

    /// A group put on the runlist enables its channels (`GPFIFO_SCHEDULE` without
    /// `bSkipEnable`), whatever `FIFO_DISABLE_CHANNELS` counted.
    fn enable_group_channels(&mut self, client: Handle, group: Handle) {
        if let Some(c) = self.clients.get_mut(&client) {
            for o in c.objects.values_mut().filter(|o| o.parent == group) {
                if let Some(ch) = o.channel.as_mut() {
                    ch.disables = 0;
                }
            }
        }
    }

    /// `FIFO_DISABLE_CHANNELS`: each listed (client, channel) pair is looked up among **all**
    /// clients, whoever owns them, as the driver does (neither the kernel nor, on the H100, the
    /// firmware checks that the clients are the caller's: docs/real-gpu.md), and disabled or
    /// enabled. A non-null `pRunlistPreemptEvent` from user space is refused with
    /// `NV_ERR_INSUFFICIENT_PERMISSIONS` (the kernel's one check, `kernel_fifo_ctrl.c`). The
    /// fake's choices where the firmware decides: `numChannels` past 64 is
    /// `NV_ERR_INVALID_ARGUMENT`, and a pair that names no channel `NV_ERR_INVALID_CHANNEL`
    /// with nothing changed (every pair is resolved before any is applied).
    fn disable_channels(&mut self, d: &sched::DisableChannelsParams) -> u32 {
        if d.runlist_preempt_event != 0 {
            return status::NV_ERR_INSUFFICIENT_PERMISSIONS;
        }
        let n = d.num_channels as usize;
        if n > sched::DISABLE_CHANNELS_MAX {
            return status::NV_ERR_INVALID_ARGUMENT;
        }
        let pairs: Vec<(Handle, Handle)> = d.client_list[..n]
            .iter()
            .copied()
            .zip(d.channel_list[..n].iter().copied())
            .collect();
        let is_channel = |&(client, h): &(Handle, Handle)| {
            self.clients
                .get(&client)
                .and_then(|c| c.objects.get(&h))
                .is_some_and(|o| o.channel.is_some())
        };
        if !pairs.iter().all(is_channel) {
            return status::NV_ERR_INVALID_CHANNEL;
        }
        for (client, h) in pairs {
            if let Some(ch) = self
                .clients
                .get_mut(&client)
                .and_then(|c| c.objects.get_mut(&h))
                .and_then(|o| o.channel.as_mut())
            {
                ch.disables = if d.disable == 0 {
                    ch.disables.saturating_sub(1)
                } else {
                    ch.disables + 1
                };
            }
        }
        status::NV_OK
    }

    /// `FB_GET_INFO_V2` on a subdevice: its GPU's memory size and free memory in KiB, as the
    /// driver of drivers 580–595 answers (1 to `MAX_LIST_SIZE` pairs). As on the H100
    /// (docs/real-gpu.md): the heap is the capacity, the total (`RAM_SIZE`, `TOTAL_RAM_SIZE`,
    /// `USABLE_RAM_SIZE`) adds the driver's 480 MiB reserve, `BUS_WIDTH` is 5120 and
    /// `FB_TAX_SIZE_KB` 0; indices this fake does not model read 0.
    fn fb_info(&self, c: Caller, p: &rm::Nvos54, obj: &Object) -> u32 {
        use rm::fb;
        let Some(gpu) = obj.gpu else {
            return status::NV_ERR_NOT_SUPPORTED;
        };
        let mut q = match params::<fb::GetInfoV2Params>(c, p) {
            Ok(q) => q,
            Err(st) => return st,
        };
        let n = q.list_size as usize;
        if n == 0 || n > fb::MAX_LIST_SIZE {
            return status::NV_ERR_INVALID_ARGUMENT;
        }
        let g = self.gpus[gpu as usize];
        let kib = |bytes: u64| u32::try_from(bytes >> 10).unwrap_or(u32::MAX);
        for e in &mut q.list[..n] {
            e.data = match e.index {
                fb::RAM_SIZE | fb::TOTAL_RAM_SIZE | fb::USABLE_RAM_SIZE => {
                    kib(g.capacity + DRIVER_RESERVE)
                }
                fb::HEAP_SIZE | fb::MAPPABLE_HEAP_SIZE => kib(g.capacity),
                fb::HEAP_FREE | fb::LARGEST_FREE_REGION_SIZE_KB => {
                    kib(g.capacity.saturating_sub(g.used))
                }
                fb::BUS_WIDTH => 5120,
                _ => 0,
            };
        }
        if remote_write(c.tid, p.params, bytes_of(&q)).is_ok() {
            status::NV_OK
        } else {
            status::NV_ERR_INVALID_POINTER
        }
    }

    /// `Runlist::Stop`: each process with a channel group off the runlist, or a channel
    /// disabled (`FIFO_DISABLE_CHANNELS`, by whichever process), is stopped, the others (that
    /// this fake stopped) continued; `Runlist::Channels`: only a disabled channel stops it.
    fn apply_runlist(&mut self) {
        let runlist_stops = self.runlist == Runlist::Stop;
        let off: BTreeSet<u32> = if self.runlist == Runlist::Record {
            BTreeSet::new()
        } else {
            self.clients
                .values()
                .flat_map(|c| c.objects.values())
                .filter(|o| {
                    (runlist_stops && o.sched.is_some_and(|s| !s.enabled))
                        || o.channel.is_some_and(|c| !c.enabled())
                })
                .map(|o| o.pid)
                .collect()
        };
        for pid in off.difference(&self.stopped) {
            // SAFETY: kill(2) with a pid and a signal number.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGSTOP) };
        }
        for pid in self.stopped.difference(&off) {
            // SAFETY: as above.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGCONT) };
        }
        self.stopped = off;
    }

    /// The last reference to open file `fh` is gone: its clients go, with no RM_FREE.
    pub(super) fn release(&mut self, fh: u64) {
        let mine: Vec<Handle> = self
            .clients
            .iter()
            .filter(|(_, c)| c.file == fh)
            .map(|(&h, _)| h)
            .collect();
        for h in mine {
            self.free_client(h);
        }
        if self.files.remove(&fh).is_some() {
            self.stats.released += 1;
        }
    }

    /// `NV_ESC_RM_VID_HEAP_CONTROL`.
    fn vid_heap(&mut self, c: Caller, buf: &mut [u8]) -> EscapeResult {
        if buf.len() != nv::NVOS32_SIZE as usize {
            return Err(libc::EINVAL);
        }
        let root = get_u32(buf, rm::VIDHEAP_H_ROOT);
        let parent = get_u32(buf, rm::VIDHEAP_H_PARENT);
        let function = get_u32(buf, rm::VIDHEAP_FUNCTION);
        let st = if let Some((attr_at, size_at)) = rm::vidheap_alloc_fields(function) {
            let flags = get_u32(buf, rm::VIDHEAP_FLAGS);
            let attr = get_u32(buf, attr_at);
            let size = get_u64(buf, size_at);
            let new = if flags & rm::NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED != 0 {
                get_u32(buf, rm::VIDHEAP_H_MEMORY)
            } else {
                0
            };
            // The class the driver turns the request into (rmapi_deprecated_vidheapctrl.c).
            let (class, kind) = if flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0 {
                (class::MEMORY_VIRTUAL, Kind::Memory)
            } else if rm::attr_location(attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM {
                (class::MEMORY_SYSTEM, Kind::Memory)
            } else {
                let req = VidReq { size, flags, attr };
                (class::MEMORY_LOCAL_USER, Kind::Vidmem(req))
            };
            match self.create(c, root, parent, new, class, kind) {
                Ok((h, bytes)) => {
                    put_u32(buf, rm::VIDHEAP_H_MEMORY, h);
                    if class == class::MEMORY_LOCAL_USER {
                        put_u64(buf, size_at, bytes);
                    }
                    status::NV_OK
                }
                Err(st) => st,
            }
        } else {
            match function {
                rm::NVOS32_FUNCTION_FREE => {
                    self.free(c.fh, root, get_u32(buf, rm::VIDHEAP_H_MEMORY))
                }
                rm::NVOS32_FUNCTION_INFO => match self.gpu_of(c.fh, root, parent) {
                    Ok(g) => {
                        let g = self.gpus[g as usize];
                        put_u64(buf, rm::VIDHEAP_TOTAL, g.capacity);
                        put_u64(buf, rm::VIDHEAP_FREE, g.capacity - g.used);
                        // The largest free block: all of it, as this fake does not fragment.
                        put_u64(buf, rm::VIDHEAP_INFO_SIZE, g.capacity - g.used);
                        status::NV_OK
                    }
                    Err(st) => st,
                },
                _ => self.check_client(c.fh, root),
            }
        };
        self.count(st);
        put_u32(buf, rm::VIDHEAP_STATUS, st);
        Ok(())
    }

    /// The GPU of object `h` of `root` (a device, subdevice or something under one).
    fn gpu_of(&self, fh: u64, root: Handle, h: Handle) -> Result<u32, u32> {
        let st = self.check_client(fh, root);
        if st != status::NV_OK {
            return Err(st);
        }
        self.clients[&root]
            .objects
            .get(&h)
            .and_then(|o| o.gpu)
            .ok_or(status::NV_ERR_INVALID_OBJECT_PARENT)
    }

    pub(super) fn inject_text(&self) -> String {
        let mut s = String::new();
        if let Some((st, n)) = self.inject.fail_alloc {
            s += &format!("fail-next-alloc {st:#x} {n}\n");
        }
        if let Some((e, n)) = self.inject.errno {
            s += &format!("errno-next-ioctl {e} {n}\n");
        }
        if !self.inject.delay.is_zero() {
            s += &format!("delay-ioctl-ms {}\n", self.inject.delay.as_millis());
        }
        if let Some(((cmd, st), n)) = self.inject.fail_control {
            s += &format!("fail-control {cmd:#x} {st:#x} {n}\n");
        }
        match self.runlist {
            Runlist::Stop => s += "runlist stop\n",
            Runlist::Channels => s += "runlist channels\n",
            Runlist::Record => {}
        }
        s
    }

    /// Applies one line of the `inject` grammar (see [`FakeNv::inject`]).
    pub(super) fn apply_inject(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| parse_num(s).ok_or_else(|| format!("bad number {s:?}"));
        let count = |w: Option<&&str>| w.map_or(Ok(1), |s| num(s)).map(|n| n.max(1));
        match words.as_slice() {
            [] => Ok(()),
            [w, ..] if w.starts_with('#') => Ok(()),
            ["fail-next-alloc", st, rest @ ..] if rest.len() <= 1 => {
                self.inject.fail_alloc = Some((num(st)? as u32, count(rest.first())?));
                Ok(())
            }
            ["errno-next-ioctl", e, rest @ ..] if rest.len() <= 1 => {
                let e = num(e)? as i32;
                if e <= 0 {
                    return Err("errno must be positive".into());
                }
                self.inject.errno = Some((e, count(rest.first())?));
                Ok(())
            }
            ["fail-control", cmd, st, rest @ ..] if rest.len() <= 1 => {
                let cmd = num(cmd)? as u32;
                self.inject.fail_control = Some(((cmd, num(st)? as u32), count(rest.first())?));
                Ok(())
            }
            ["runlist", "stop"] => {
                self.runlist = Runlist::Stop;
                self.apply_runlist();
                Ok(())
            }
            ["runlist", "record"] => {
                self.runlist = Runlist::Record;
                self.apply_runlist();
                Ok(())
            }
            ["runlist", "channels"] => {
                self.runlist = Runlist::Channels;
                self.apply_runlist();
                Ok(())
            }
            ["delay-ioctl-ms", ms] => {
                self.inject.delay = Duration::from_millis(num(ms)?);
                Ok(())
            }
            ["capacity", gpu, bytes] => {
                let g = num(gpu)? as usize;
                let bytes = parse_size(bytes).ok_or_else(|| format!("bad size {bytes:?}"))?;
                let gpu = self.gpus.get_mut(g).ok_or_else(|| format!("no GPU {g}"))?;
                gpu.capacity = bytes;
                Ok(())
            }
            ["clear"] => {
                self.inject = Inject::default();
                Ok(())
            }
            _ => Err(format!("unknown injection {line:?}")),
        }
    }
}

/// Escapes whose only valid sizes are the ones in [`rm::escape_status_offset`].
fn known_size_escape(nr: u32) -> bool {
    matches!(
        nr,
        nv::NV_ESC_RM_CONTROL
            | nv::NV_ESC_RM_MAP_MEMORY
            | nv::NV_ESC_RM_UNMAP_MEMORY
            | nv::NV_ESC_RM_MAP_MEMORY_DMA
            | nv::NV_ESC_RM_UNMAP_MEMORY_DMA
            | nv::NV_ESC_RM_DUP_OBJECT
            | nv::NV_ESC_RM_SHARE
            | nv::NV_ESC_ALLOC_OS_EVENT
            | nv::NV_ESC_FREE_OS_EVENT
    )
}

/// Thread group id of thread `tid` (the process to report), or `tid` itself when unknown.
pub(super) fn tgid(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(tid)
}

/// Reads `buf.len()` bytes at `addr` in process (or thread) `pid`; all or an error.
fn remote_read(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    remote_io(pid, addr, buf.as_mut_ptr(), buf.len(), false)
}

/// Writes `buf` at `addr` in process (or thread) `pid`; all or an error.
fn remote_write(pid: u32, addr: u64, buf: &[u8]) -> io::Result<()> {
    // Only read from: process_vm_writev takes the local side as a mutable iovec all the same.
    remote_io(pid, addr, buf.as_ptr().cast_mut(), buf.len(), true)
}

/// `len` bytes between `local` and `addr` in process (or thread) `pid`: all or an error.
fn remote_io(pid: u32, addr: u64, local: *mut u8, len: usize, write: bool) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: local.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: one local iovec over the caller's buffer of `len` bytes (written only when
    // reading); the remote side is checked by the kernel.
    let n = unsafe {
        if write {
            libc::process_vm_writev(pid as libc::pid_t, &local, 1, &remote, 1, 0)
        } else {
            libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0)
        }
    };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize != len => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        _ => Ok(()),
    }
}

/// A `T` read from `addr` in `pid`'s memory; `None` for a null or unreadable pointer.
fn read_remote<T: Plain>(pid: u32, addr: u64) -> Option<T> {
    if addr == 0 {
        return None;
    }
    let mut v = T::default();
    remote_read(pid, addr, bytes_of_mut(&mut v)).ok()?;
    Some(v)
}

/// Class params: zeroes for a null pointer (RM's defaults), the struct otherwise.
fn read_params<T: Plain>(pid: u32, addr: u64) -> Result<T, u32> {
    if addr == 0 {
        return Ok(T::default());
    }
    read_remote(pid, addr).ok_or(status::NV_ERR_INVALID_POINTER)
}

/// A control's parameters from the caller's memory, once [`Rm::control`] has checked their
/// size: `NV_ERR_INVALID_ARGUMENT` for a size other than `T`'s all the same,
/// `NV_ERR_INVALID_POINTER` where they cannot be read.
fn params<T: Plain>(c: Caller, p: &rm::Nvos54) -> Result<T, u32> {
    if p.params_size as usize != size_of::<T>() {
        return Err(status::NV_ERR_INVALID_ARGUMENT);
    }
    read_remote(c.tid, p.params).ok_or(status::NV_ERR_INVALID_POINTER)
}
