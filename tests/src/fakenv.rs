//! A fake NVIDIA control device: a FUSE filesystem whose regular file `nvidiactl` answers the
//! RM ioctl ABI the way `/dev/nvidiactl` does, for the subset gpud accounts and steers (clients,
//! devices, subdevices, video memory, channel groups and channels; alloc, free,
//! VID_HEAP_CONTROL, XFER, and the RM controls that report memory or change scheduling), so
//! tests drive real processes in real cgroups while gpud's probes watch real ioctls and read
//! their argument structs from the callers' memory.
//!
//! This module owns the mount's lifetime and the public API ([`mount`], [`FakeNv`],
//! [`Snapshot`]); `fs` owns the FUSE server (the files and their requests), `snapshot` the
//! [`Snapshot`] types, and `state` the fake's RM (clients bound to open files, object
//! trees, per-GPU capacity). The ABI layouts are gpud-common's ([`gpud_common::rm`]).
//!
//! Files at the mount point:
//! * `nvidiactl` — the control device. FUSE hands a regular file's ioctls over as "restricted"
//!   ioctls: the kernel copies `_IOC_SIZE` bytes in and out by the direction bits, so the
//!   `_IOWR` outer struct round-trips through the reply; nested structs (`pAllocParms`, the XFER
//!   pointer) are read and written in the caller's memory with `process_vm_readv`/`writev`
//!   (the FUSE request names the calling thread). Commands must be `_IOWR` (as CUDA issues
//!   them); other direction bits lose the struct in FUSE, unlike the driver, which ignores them.
//! * `state` — read-only JSON [`Snapshot`] of live files, clients, objects and per-GPU use.
//! * `inject` — write one command per line to inject faults (see [`FakeNv::inject`]); reading
//!   it lists what is pending.
//!
//! Behaviour copied from the driver (ABI reference §1-5): RM errors go into `status` with
//! `ioctl()` returning 0; malformed requests (wrong size for the escape, bad XFER) fail with
//! `EINVAL`, unreadable XFER payloads with `EFAULT`; clients are bound to the open file that made
//! them (strict validation: `NV_ERR_INVALID_CLIENT` through another file); `RM_FREE` takes the
//! subtree, of the client when `hObjectOld == hRoot`, and answers `NV_OK` for an unknown handle;
//! the last close of a file frees its clients without any RM_FREE. Memory is rounded up to the
//! page size, refused with `NV_ERR_NO_MEMORY` past a GPU's capacity, and the rounded size and
//! `limit` are written back. `NV_ESC_RM_DUP_OBJECT` of video memory makes a handle on the same
//! memory, which goes back to its GPU with its last handle (`memCopyConstruct_IMPL`); the
//! snapshot's `mem` names it, and [`Snapshot::held_by`] counts it once. Choices of the fake where
//! the driver is not modelled: a duplicate of anything but video memory answers
//! `NV_ERR_NOT_SUPPORTED`, and one across processes `NV_ERR_INSUFFICIENT_PERMISSIONS` (RM's share
//! policy, `RM_SHARE`, is not modelled), NVOS64 with
//! `FINN_SERIALIZED` on memory classes answers `NV_ERR_NOT_SUPPORTED`, other RM escapes with a
//! status field answer `NV_OK` after the client check, other RM and OS escape numbers succeed
//! doing nothing, and numbers that are no escape fail with `EINVAL` (as RmIoctl's default case).
//!
//! `NV_ESC_RM_CONTROL` runs the driver's checks in the driver's order
//! (docs/driver/scheduler-controls.md §0; the details in `state`): a `cmd` with bit 15 set takes
//! the GSS-legacy path, which checks neither size nor privilege nor the client's file, and
//! answers `NV_ERR_NOT_SUPPORTED` (counted in [`Stats::legacy`]); a NULL command (`cmd` 0 or
//! `0xXXXX0000`) answers `NV_OK` having done nothing; `flags` bit 0 or 1 is
//! `NV_ERR_INVALID_ARGUMENT`; an unknown client `NV_ERR_INVALID_CLIENT`; then, for the controls
//! the fake models (every row of `gpud_common::rm::sched::CONTROLS`, the channel-group ones among
//! them, and `FB_GET_INFO_V2`), a parameter size other than the control's, or a size without a
//! pointer or a pointer without a size, is `NV_ERR_INVALID_ARGUMENT` before the parameters are
//! read; then the client must be bound to the caller's file (`NV_ERR_INVALID_CLIENT`), the object
//! must exist (`NV_ERR_OBJECT_NOT_FOUND`) and export the command (`NV_ERR_NOT_SUPPORTED`;
//! channel-group commands answer `NV_ERR_INVALID_OBJECT_HANDLE` for both, which gpud reads as
//! "the group is gone"), and `SET_INTERLEAVE_LEVEL`, `MAKE_REALTIME`, `RESTART_RUNLIST` and
//! `RUNLIST_SET_SCHED_POLICY` need the `NICE` right (the calling thread's effective
//! `CAP_SYS_NICE` or `CAP_SYS_ADMIN`), the `PRIVILEGED` controls (`SET_COMPUTE_POLICY_CONFIG`,
//! `STOP`/`START_RUNLIST`, `CONFIG_CTXSW_TIMEOUT`) `CAP_SYS_ADMIN`
//! (`NV_ERR_INSUFFICIENT_PERMISSIONS`). Controls the fake does not model answer `NV_OK` doing
//! nothing once the client checks pass. What passes takes effect ([`Snapshot`]: a group's
//! runlist state, timeslice, interleave level and realtime flag, a channel's `enabled`) and is
//! counted per command ([`Snapshot::controls`]), scheduling controls without a modelled effect
//! included. `FIFO_DISABLE_CHANNELS` resolves its (client, channel) pairs among all clients, the
//! caller's or not, as the driver does. Choices of the fake where the firmware decides:
//! `FINN_SERIALIZED` on a modelled control answers `NV_ERR_NOT_SUPPORTED`; `FIFO_DISABLE_CHANNELS`
//! answers `NV_ERR_INVALID_ARGUMENT` past 64 channels and `NV_ERR_INVALID_CHANNEL` for a pair
//! that names no channel, changing nothing; `CONFIG_CTXSW_TIMEOUT` and `ROTATE_KEYS` are
//! exported as in 595 (580 answers `NV_ERR_NOT_SUPPORTED`).
//!
//! Requests are served one at a time on one thread, so multi-threaded callers are serialized.
//!
//! # What this fake models, and how far to trust it
//!
//! The fake copies the driver's RM ABI from its source (docs/nvidia-ioctl-abi.md), not from a
//! recording, so a test that passes here proves gpud right *about this model*. Each behaviour a
//! test relies on must also be seen once on a real GPU; the scripts under `tests/gpu/` do that
//! (docs/real-gpu.md has their results). Where the model has not been checked on hardware yet, it
//! says so: trust those parts no further than the driver source they were read from.
//!
//! Checked on an H100 (driver 580, CUDA 13) by `tests/gpu/real-gpu.sh`, whose
//! `nv-ioctl-sniffer.c` records every NVIDIA ioctl of a PyTorch workload:
//! * video memory is `NV_ESC_RM_ALLOC` in the **NVOS64** form, class `NV01_MEMORY_LOCAL_USER`
//!   under the `NV01_DEVICE_0` object, `NV_MEMORY_ALLOCATION_PARAMS` behind `pAllocParms` in the
//!   caller's memory, the rounded size written back there;
//! * sizes are rounded up to 2 MiB (three sizes seen: 4,325,376 → 6,291,456, 72,116,352 →
//!   73,400,320, 432,537,600 → 434,110,464), the fake's default page;
//! * `RM_FREE` of a memory handle frees it;
//! * the last release of the control file frees its clients and everything under them, with no
//!   `RM_FREE` (a CUDA process frees nothing at exit);
//! * gpud's figures from these calls equal NVML's per-process memory to the byte, and a limit
//!   crossed in the react tier kills the allocator before its ioctl returns (status 137).
//!
//! Checked on the same H100 (driver 580.159.04) by `tests/gpu/sched_facts.py`, from a second
//! CUDA process through its own client (docs/real-gpu.md, "Scheduling controls"):
//! * `SET_TIMESLICE` takes any value from an unprivileged tenant (0, 1, 100, 2,000,000 and
//!   2^32 µs all answered status 0) and `GET_TIMESLICE` reads it back: the fake stores any
//!   value; an untouched group reads 1,024 µs;
//! * the same control with bit 15 set (`0xa06c8103`) answers `NV_ERR_NOT_SUPPORTED` and
//!   changes nothing: the fake answers every bit-15 command so;
//! * `FIFO_DISABLE_CHANNELS` on the caller's own subdevice naming another process's channels
//!   (its client's handles) answers status 0 and that process stalls until they are enabled
//!   again: the fake disables them whoever owns them, and `runlist stop` stands in for the
//!   stall.
//!
//! **Not checked on hardware yet** (CUDA 13 on that driver never issued them, or the case was
//! not provoked):
//! * the NVOS21 form, `NV_ESC_RM_VID_HEAP_CONTROL` (alloc and free) and `NV_ESC_IOCTL_XFER_CMD`
//!   wrapping: from the driver source only;
//! * `NV_ERR_NO_MEMORY` at a GPU's capacity, with `ioctl()` returning 0;
//! * `RM_FREE` of a device, subdevice or client taking its subtree, and `NV_OK` for an unknown
//!   handle;
//! * clients bound to their open file (`NV_ERR_INVALID_CLIENT` through another one);
//! * the RM_CONTROL checks and their order (all but the bit-15 answer above): the NULL command,
//!   the `flags` bits, the size check before the parameters are read (`NV_ERR_INVALID_ARGUMENT`),
//!   the file binding after it, `NV_ERR_OBJECT_NOT_FOUND` and `NV_ERR_NOT_SUPPORTED` for the
//!   object, the `NICE` right and `PRIVILEGED` flag (`NV_ERR_INSUFFICIENT_PERMISSIONS`); no
//!   real call was made with a wrong size, a NULL command or without the capabilities: from
//!   the driver source only (docs/driver/scheduler-controls.md §0);
//! * channels (`HOPPER_CHANNEL_GPFIFO_A`) under a channel group, their parameters unread;
//! * the channel-group and channel controls (`NV_ESC_RM_CONTROL` on a `KEPLER_CHANNEL_GROUP_A`,
//!   allocated under a device, or a channel): `GPFIFO_SCHEDULE`, `PREEMPT`, the interleave
//!   level (`NV_ERR_INVALID_ARGUMENT` above HIGH) and `MAKE_REALTIME` with their parameter
//!   structs in the caller's memory, through the owning client's file only, from the driver
//!   source (gpu-scheduler-controls.md); the other scheduling controls answer `NV_OK` with no
//!   modelled effect; what any of them does to GPU work is not modelled (no GPU work runs here),
//!   except as `runlist stop` stands in for a group off the runlist or a disabled channel;
//! * `FIFO_DISABLE_CHANNELS` refusing a non-null `pRunlistPreemptEvent` (the kernel's one
//!   check), and its answers past 64 channels and for a pair naming no channel (the fake's
//!   choices);
//! * `EINVAL` for malformed sizes and bad XFER wrappers, `EFAULT` for unreadable payloads;
//! * a forked child allocating on its parent's open file;
//! * what CUDA sees when the `deny` tier refuses an allocation with `ENOMEM` (that machine refuses
//!   BPF-LSM; the deny path is tested in the VM, against this fake).
//!
//! Where the fake knowingly differs from the driver: the control file cannot be mapped, so a
//! client is released at the last `close()`, not after the last mapping goes (CUDA maps the
//! control file: on hardware the release comes after the process's address space is gone); it
//! serializes all callers on one thread; and it answers through FUSE in tens of microseconds,
//! far slower than the driver, so no timing measured against it says anything about a real GPU.
//!
//! Use: [`mount`] (root and `/dev/fuse` needed) serves until the [`FakeNv`] is dropped; callers
//! open [`FakeNv::ctl`]; tests read [`FakeNv::snapshot`], or [`read_state`] from another process.
//! In-process use suits binaries that run alone, like the VM test: a process that serves the
//! fake may fork tenants (glibc's allocator is fork-safe; the server stays in the parent), as
//! `gpud-fake-nvidia --self-test` shows. `gpud-fake-nvidia` is the same server as a process.

use std::{
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, atomic::AtomicU64},
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime},
};

use fs::Fs;
use state::Rm;

pub use snapshot::{
    ChannelGroupState, ChannelState, ClientState, FileState, GpuState, Held, ObjectState, Snapshot,
    Stats,
};

mod fs;
mod snapshot;
mod state;

/// What the fake GPUs look like.
#[derive(Clone, Debug)]
pub struct Options {
    /// Number of GPUs (`NV01_DEVICE_0` device ids 0..gpus).
    pub gpus: u32,
    /// Video memory of each GPU, bytes.
    pub capacity: u64,
    /// Allocation granularity: sizes are rounded up to a multiple.
    pub page_size: u64,
    /// Log every ioctl to stderr.
    pub verbose: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            gpus: 1,
            capacity: 80 << 30,
            page_size: 2 << 20,
            verbose: false,
        }
    }
}

/// Reads and parses the `state` file of a fake mounted at `dir` (by this or another process).
pub fn read_state(dir: &Path) -> io::Result<Snapshot> {
    let text = std::fs::read(dir.join(STATE))?;
    serde_json::from_slice(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Writes one injection command into the `inject` file of a fake mounted at `dir`.
pub fn write_inject(dir: &Path, line: &str) -> io::Result<()> {
    std::fs::write(dir.join(INJECT), format!("{line}\n"))
}

/// Parses a byte count: decimal, `0x` hex, or with a `K`/`M`/`G`/`T` suffix (powers of 1024;
/// `KiB`, `MiB`… also accepted).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        return u64::from_str_radix(h, 16).ok();
    }
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: u64 = n.parse().ok()?;
    let shift = match unit.trim_end_matches("iB").trim_end_matches('B') {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        "T" | "t" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// Parses a number: decimal or `0x` hex.
pub fn parse_num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

pub const CTL: &str = "nvidiactl";
pub const STATE: &str = "state";
pub const INJECT: &str = "inject";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves consistent-enough test state; keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A mounted fake, served on a background thread; unmounted on drop.
pub struct FakeNv {
    dir: PathBuf,
    rm: Arc<Mutex<Rm>>,
    unmounter: Option<fuser::SessionUnmounter>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl std::fmt::Debug for FakeNv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeNv").field("dir", &self.dir).finish()
    }
}

/// Whether this machine can mount the fake (`/dev/fuse` exists).
pub fn available() -> bool {
    Path::new("/dev/fuse").exists()
}

/// Mounts a fake at `dir` (created if missing) and serves it on a background thread. Needs root
/// (or a FUSE mount helper) and `/dev/fuse`.
pub fn mount(dir: &Path, opts: Options) -> io::Result<FakeNv> {
    // A mount left by a run that was killed, its server gone ("transport endpoint is not
    // connected"): detached, so this run can mount there again.
    if std::fs::metadata(dir).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN)) {
        let c =
            std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    std::fs::create_dir_all(dir)?;
    let rm = Arc::new(Mutex::new(Rm::new(&opts)));
    let fs = Fs {
        rm: rm.clone(),
        reads: Mutex::default(),
        writes: Mutex::default(),
        next_fh: AtomicU64::new(1),
        born: SystemTime::now(),
        // SAFETY: plain getters.
        uid: unsafe { libc::geteuid() },
        gid: unsafe { libc::getegid() },
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("gpud-fake-nvidia".into()),
        fuser::MountOption::NoExec,
    ];
    // Callers of any uid (tests run root, but cgroup tenants need not).
    config.acl = fuser::SessionACL::All;
    let mut session = fuser::Session::new(fs, dir, &config)?;
    let unmounter = session.unmount_callable();
    let thread = std::thread::Builder::new()
        .name("fakenv".into())
        .spawn(move || session.run())?;
    Ok(FakeNv {
        dir: dir.to_owned(),
        rm,
        unmounter: Some(unmounter),
        thread: Some(thread),
    })
}

impl FakeNv {
    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the fake control device.
    pub fn ctl(&self) -> PathBuf {
        self.dir.join(CTL)
    }

    /// The current state (what the `state` file shows), read directly.
    pub fn snapshot(&self) -> Snapshot {
        lock(&self.rm).snapshot()
    }

    /// How long the fake has kept each process stopped, summed over its stops, up to now.
    pub fn held(&self) -> Held {
        lock(&self.rm).held()
    }

    /// Polls the state until `pred` holds (`Ok`) or `timeout` passes (`Err` with the last
    /// state). File releases reach the fake asynchronously after `close()`.
    pub fn wait(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&Snapshot) -> bool,
    ) -> Result<Snapshot, Box<Snapshot>> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.snapshot();
            if pred(&s) {
                return Ok(s);
            }
            if Instant::now() > deadline {
                return Err(Box::new(s));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Applies one injection command (the grammar of the `inject` file, one command a line):
    ///
    /// * `fail-next-alloc STATUS [COUNT]` — the next COUNT (default 1) video-memory allocations
    ///   (any form) are refused with RM status STATUS (e.g. `0x51`), nothing allocated;
    /// * `errno-next-ioctl ERRNO [COUNT]` — the next COUNT ioctls on `nvidiactl` fail with
    ///   ERRNO, nothing done;
    /// * `delay-ioctl-ms MS` — every later ioctl waits MS before it is handled (0: off);
    /// * `capacity GPU BYTES` — sets a GPU's capacity (already allocated memory stays);
    /// * `fail-control CMD STATUS [COUNT]` — the next COUNT modelled RM controls CMD (e.g.
    ///   `0xa06c0101`) that pass the driver's checks answer RM status STATUS, nothing changed;
    /// * `runlist stop` / `runlist record` — whether taking a channel group off the runlist, or
    ///   disabling a channel (`FIFO_DISABLE_CHANNELS`), stops the process that made it (SIGSTOP
    ///   until all its groups are back on and its channels enabled) or is only recorded (the
    ///   default): tenants that burn CPU as their GPU work see the control take effect, or see
    ///   firmware that ignores it; `runlist channels` — as the H200: only a disabled channel
    ///   stops it, a group off the runlist is recorded;
    /// * `clear` — drops pending injections and the delay.
    ///
    /// Numbers are decimal or `0x` hex; blank lines and `#` comments are ignored.
    pub fn inject(&self, line: &str) -> Result<(), String> {
        lock(&self.rm).apply_inject(line)
    }

    /// Unmounts. With files still open somewhere the mount is detached lazily and keeps serving
    /// them until they close.
    pub fn unmount(mut self) -> io::Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> io::Result<()> {
        let Some(mut unmounter) = self.unmounter.take() else {
            return Ok(());
        };
        match unmounter.unmount() {
            Ok(()) => {
                // The kernel ended the connection: the serving thread sees ENODEV and returns.
                if let Some(t) = self.thread.take() {
                    t.join()
                        .map_err(|_| io::Error::other("fakenv: server thread panicked"))??;
                }
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                let c = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes())
                    .map_err(io::Error::other)?;
                // SAFETY: valid NUL-terminated path.
                if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                // Leave the thread to serve the open files until the last one closes.
                self.thread.take();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for FakeNv {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("fakenv: unmounting {}: {e}", self.dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("5"), Some(5));
        assert_eq!(parse_size("0x10"), Some(16));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("3G"), Some(3 << 30));
        assert_eq!(parse_size("1X"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999T"), None);
    }
}
