//! The fake's resource manager: clients bound to open files, object trees, per-GPU capacity,
//! and the escapes that act on them. The FUSE side ([`super`]) hands it each ioctl with the
//! caller's open file and thread; nested structs are read and written in the caller's memory.
//!
//! What of this model has been checked on a real GPU (`tests/gpu/real-gpu.sh`) and what has not
//! yet: see "What this fake models" in [`super`].
//!
//! Here: the RM's state, the ioctl dispatch and the release of files; `objects` owns allocation
//! and freeing, `control` the RM controls, `inject` fault injection, `remote` the caller's
//! memory.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use gpud_common::{
    nv,
    rm::{self, Handle},
};

use super::{
    ChannelGroupState, ChannelState, ClientState, FileState, GpuState, Held, ObjectState, Options,
    Snapshot, Stats,
};
use crate::rm::{bytes_of, from_bytes, get_u32, put_u32, status};
use inject::{Inject, take};
use remote::{remote_read, remote_write};

mod control;
mod inject;
mod objects;
mod remote;

/// `hClass`-independent facts about a live object.
#[derive(Clone, Copy, Debug)]
struct Object {
    parent: Handle,
    class: u32,
    gpu: Option<u32>,
    bytes: u64,
    /// The video memory this handle references (`Rm::mems`), shared by its duplicates; 0 for
    /// none.
    mem: u64,
    pid: u32,
    /// Channel groups: their scheduling state.
    sched: Option<Sched>,
    /// Channels (`HOPPER_CHANNEL_GPFIFO_A`, under a channel group, the `parent`): their state.
    channel: Option<Chan>,
}

impl Object {
    /// The client itself, as the object a control names by the client's handle (the driver's
    /// `RmClientResource`, which exports the `NV0000_*` controls).
    fn client(c: Caller) -> Self {
        Self {
            parent: 0,
            class: crate::rm::class::ROOT_CLIENT,
            gpu: None,
            bytes: 0,
            mem: 0,
            pid: tgid(c.tid),
            sched: None,
            channel: None,
        }
    }
}

/// A channel group's scheduling state, as its controls set it.
#[derive(Clone, Copy, Debug)]
struct Sched {
    enabled: bool,
    timeslice_us: u64,
    /// `SET_TIMESLICE` controls that reached it.
    timeslice_sets: u64,
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
    /// Every disable it was given, whoever gave it.
    disabled_times: u64,
}

impl Chan {
    fn enabled(self) -> bool {
        self.disables == 0
    }
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

/// Video memory as the driver's memory descriptor holds it: freed with its last handle (the
/// original or a duplicate, `memdescAddRef`/`memdescDestroy`), not with the original's.
#[derive(Clone, Copy, Debug)]
struct Mem {
    gpu: u32,
    bytes: u64,
    refs: u32,
}

#[derive(Clone, Copy, Debug)]
struct Gpu {
    capacity: u64,
    used: u64,
}

/// Who issued a request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Caller {
    /// The open file (FUSE file handle).
    pub(super) fh: u64,
    /// The calling thread, as FUSE names it (a thread id serves for process_vm_readv).
    pub(super) tid: u32,
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
    /// Live video memory by id, with its reference count.
    mems: BTreeMap<u64, Mem>,
    next_mem: u64,
    /// Open `nvidiactl` files: FUSE file handle → opener's pid.
    pub(super) files: BTreeMap<u64, u32>,
    next_client: u32,
    pub(super) inject: Inject,
    runlist: Runlist,
    /// Processes this fake stopped ([`Runlist`]), and since when.
    stopped: BTreeMap<u32, Instant>,
    /// Per process, how long this fake kept it stopped before its current stop: the stand-in
    /// GPU's time is the wall time a process is let run, which its CPU clock does not measure
    /// where a hypervisor steals its CPU.
    held: BTreeMap<u32, Duration>,
    /// Where [`Held::clock_ns`] counts from.
    born: Instant,
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
            mems: BTreeMap::new(),
            next_mem: 1,
            files: BTreeMap::new(),
            next_client: 1,
            inject: Inject::default(),
            runlist: Runlist::default(),
            stopped: BTreeMap::new(),
            held: BTreeMap::new(),
            born: Instant::now(),
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
                    mem: o.mem,
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
                        timeslice_sets: s.timeslice_sets,
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
                        disabled_times: ch.disabled_times,
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

    /// Per process this fake ever stopped, how long it kept it stopped up to now.
    pub(super) fn held(&self) -> Held {
        let now = Instant::now();
        let mut by_pid: BTreeMap<u32, u64> = self
            .held
            .iter()
            .map(|(&pid, d)| (pid, d.as_nanos() as u64))
            .collect();
        for (&pid, &since) in &self.stopped {
            *by_pid.entry(pid).or_default() +=
                now.saturating_duration_since(since).as_nanos() as u64;
        }
        Held {
            clock_ns: now.saturating_duration_since(self.born).as_nanos() as u64,
            by_pid,
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
            nv::NV_ESC_RM_DUP_OBJECT if size == nv::NVOS55_SIZE => {
                let mut p: rm::Nvos55 = from_bytes(buf);
                p.status = match self.dup(c, &p) {
                    Ok(h) => {
                        p.h_object = h;
                        status::NV_OK
                    }
                    Err(st) => st,
                };
                self.count(p.status);
                buf.copy_from_slice(bytes_of(&p));
                Ok(())
            }
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
                    let st = if has_client {
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
///
/// One read of the status file's head (`Tgid` is its fourth line; a name is at most 64 bytes
/// escaped): the fake answers every RM call with it, and each system call the server makes is
/// one more run of gpud's raw system-call programs, which the benchmarks must take out of the
/// caller's figures.
pub(super) fn tgid(tid: u32) -> u32 {
    use std::io::Read as _;
    let mut head = [0u8; 512];
    let n = std::fs::File::open(format!("/proc/{tid}/status"))
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    String::from_utf8_lossy(&head[..n])
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(tid)
}
