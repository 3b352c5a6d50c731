//! gpud's kernel side: attribution of ioctls on NVIDIA device files to cgroups and processes.
//!
//! Two attach modes, chosen by the daemon after probing the kernel:
//! - **fentry**: `security_file_ioctl` (and `_compat`) hand over the `struct file`, so only ioctls
//!   pay, and only a few loads decide whether the file is an NVIDIA device; `security_file_open`
//!   marks processes that open one.
//! - **tracepoint**: a program runs for every ioctl on the host (on the raw `sys_enter`
//!   tracepoint, or on `syscalls:sys_enter_ioctl` where 32-bit callers are not followed). A
//!   process is looked up in `TRACKED` first and leaves at once unless it is known to hold an
//!   NVIDIA file (it opened one, `sys_exit_open*`; it was forked by such a process,
//!   `sched_process_fork`; or the daemon found one in its fd table) or the command is an NVIDIA
//!   escape (type 'F': the file may have been received). Only then is the fd table walked to the
//!   file.
//!
//! Both modes share the identification of the file and the accounting: per-cgroup and
//! per-process counters by ioctl class, in pinned maps that outlive the daemon.
//!
//! This file holds only the programs, whose names the daemon loads them by
//! (`gpud_common::programs`); what they share lives in one module per concern:
//! [`maps`] (every map), [`kernel`] (reading kernel structs, identifying NVIDIA files),
//! [`counting`] (ioctl counters and the tracked-process filter), [`rm`] (the RM calls' entry and
//! exit sides, routed to the three that follow), [`memory`] (GPU-memory accounting and limits),
//! [`meminfo`] (the memory view of limited cgroups), [`guard`] (the scheduler guard), and
//! [`ledger`] (the reads of the accounting those three share). Each of those modules imports
//! only [`maps`], [`kernel`] and [`ledger`]: no circle.
//!
//! Programs that may call `bpf_probe_write_user` (the memory view's and the guard's rewrites)
//! come in twins, `*_rw`: the verifier refuses the helper under lockdown, and there the plain
//! twin runs instead.
//!
//! In fentry mode the `deny` tier replaces the fentry ioctl programs by a pre-driver hook's, which
//! count the same and may refuse the call: BPF-LSM `file_ioctl` (`gpud_lsm_*`) where `bpf` is in
//! `lsm=`, else fmod_ret on `security_file_ioctl` (`gpud_fmodret_*`, loaded by the daemon itself:
//! see [`modify_return_program`]). Both share [`refusing`].
#![no_std]
#![no_main]
// The bpf target has no atomic RMW types; the intrinsic lowers to BPF_ATOMIC_ADD (XADD).
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod counting;
mod guard;
mod kernel;
mod ledger;
mod maps;
mod meminfo;
mod memory;
mod rm;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_cgroup_id, bpf_get_current_task},
    macros::{fentry, fexit, lsm, raw_tracepoint, tracepoint},
    programs::{FEntryContext, FExitContext, LsmContext, RawTracePointContext, TracePointContext},
};
use gpud_common::{
    CFG_EXIT_RELEASE, DeviceKind, EVENT_PROC_EXIT, EVENT_PROC_NEW, Event, ObjKey, PROC_INHERITED,
    ProcEntry, nv, stat,
};

use crate::{
    counting::{account, clear_tracked, is_tracked, mark_opened, mark_tracked},
    kernel::{
        Abi, BtfRead, ProbeRead, current_tgid, device_kind, file_of_fd, read_at, referenced,
        sole_reference,
    },
    maps::{PROCS, bump_stat, config, emit, send},
    memory::{adopt, file_released, release, release_files_at_exit},
    rm::{rm_entry, rm_exit},
};

/// Offsets of the syscall tracepoint records (`common_*` header, `__syscall_nr`, then 8-byte args),
/// from `/sys/kernel/tracing/events/syscalls/*/format`; stable across kernels.
const TP_SYSCALL_ARG0: usize = 16;
const TP_SYSCALL_RET: usize = 16;

/// A u64 of a syscall tracepoint's record, loaded straight from the context (the verifier allows
/// aligned loads inside the record) rather than through a helper call: the ioctl programs run for
/// every ioctl on the host.
#[inline(always)]
fn tp_u64(ctx: &TracePointContext, offset: usize) -> u64 {
    use aya_ebpf::EbpfContext as _;
    unsafe { core::ptr::read_volatile(ctx.as_ptr().cast::<u8>().add(offset).cast::<u64>()) }
}

// ---- run by the daemon -------------------------------------------------------------------------

/// A raw-tracepoint program the daemon runs itself (`BPF_PROG_TEST_RUN`) and reads the return
/// value of. aya-ebpf's `#[raw_tracepoint]` returns 0 whatever the function returns, so these
/// are wrapped here instead, keeping the value.
macro_rules! run_program {
    ($(#[$doc:meta])* fn $name:ident($ctx:ident) -> i32 $body:block) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[unsafe(link_section = "raw_tp")]
        pub fn $name(raw: *mut core::ffi::c_void) -> i32 {
            let $ctx = RawTracePointContext::new(raw);
            $body
        }
    };
}

run_program! {
    /// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` (arguments: client, object,
    /// serial, orphan) to release an object below a freed subtree, client or file, or (orphan
    /// non-zero) one its sweep found with neither a client nor a known file, counted in
    /// `ORPHANS_RELEASED`. Returns 0 if released.
    fn gpud_release(ctx) -> i32 {
        let client: u64 = ctx.arg(0);
        let object: u64 = ctx.arg(1);
        let serial: u64 = ctx.arg(2);
        let orphan: u64 = ctx.arg(3);
        let key = ObjKey {
            client: client as u32,
            object: object as u32,
        };
        if serial == 0 || !release(&key, serial) {
            return 1;
        }
        if orphan != 0 {
            bump_stat(stat::ORPHANS_RELEASED);
        }
        0
    }
}

run_program! {
    /// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` (argument 0: the address of a
    /// control file its objects name) to learn whether the driver still holds that file's clients.
    /// Returns 0 while the file is a control file with a reference left, 1 once it was released.
    /// A new control file at the same address is reported when opened (see [`gpud_tp_open`]), so
    /// the daemon never takes it for the old one for long.
    fn gpud_file_held(ctx) -> i32 {
        let file: u64 = ctx.arg(0);
        let Some(cfg) = config() else { return 1 };
        let r = ProbeRead(&cfg.offsets);
        let file = file as *const u8;
        if file.is_null() {
            return 1;
        }
        let held = matches!(unsafe { device_kind(&r, file) }, Some(DeviceKind::Control))
            && unsafe { referenced(&r, file, cfg.offsets.file_one_ref) };
        if held { 0 } else { 1 }
    }
}

/// An NVIDIA control file was just opened at `file`: whatever the daemon recorded under that
/// address belonged to an earlier file, released since (its release may have gone unseen: a last
/// reference dropped by `munmap`, or by a process gpud does not track).
#[inline(always)]
fn control_file_opened(file: *const u8) {
    file_released(file as u64);
}

// ---- fentry mode -------------------------------------------------------------------------------

/// Shared by the fentry and LSM programs on the ioctl hooks; `deny` only from LSM.
#[inline(always)]
fn on_file_ioctl<const REWRITE: bool>(file: *const u8, cmd: u32, arg: u64, deny: bool) -> i32 {
    let Some(kind) = (unsafe { device_kind(&BtfRead, file) }) else {
        return 0;
    };
    account(kind, cmd, arg);
    if let DeviceKind::Control = kind {
        return rm_entry::<REWRITE>(file as u64, cmd, arg, deny);
    }
    0
}

/// The pre-driver hooks' common body (BPF-LSM and fmod_ret alike): `prev`, the verdict of a
/// program before this one, stands; otherwise this call's.
#[inline(always)]
fn refusing<const REWRITE: bool>(file: *const u8, cmd: u32, arg: u64, prev: i32) -> i32 {
    if prev != 0 {
        return prev;
    }
    on_file_ioctl::<REWRITE>(file, cmd, arg, true)
}

#[fentry(function = "security_file_ioctl")]
pub fn gpud_fentry_ioctl(ctx: FEntryContext) -> i32 {
    on_file_ioctl::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// 32-bit callers on kernels with the `file_ioctl_compat` hook (6.8+, some 6.6.y) skip
/// `security_file_ioctl`; loaded only where the kernel has the function.
#[fentry(function = "security_file_ioctl_compat")]
pub fn gpud_fentry_ioctl_compat(ctx: FEntryContext) -> i32 {
    on_file_ioctl::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// [`gpud_fentry_ioctl`] whose scheduler guard may rewrite a tenant's control.
#[fentry(function = "security_file_ioctl")]
pub fn gpud_fentry_ioctl_rw(ctx: FEntryContext) -> i32 {
    on_file_ioctl::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// [`gpud_fentry_ioctl_compat`] whose scheduler guard may rewrite a tenant's control.
#[fentry(function = "security_file_ioctl_compat")]
pub fn gpud_fentry_ioctl_compat_rw(ctx: FEntryContext) -> i32 {
    on_file_ioctl::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// The `deny` tier: counts like [`gpud_fentry_ioctl`] and refuses, before the driver sees it,
/// a video-memory allocation that would take the caller's cgroup (or an ancestor) over a limit,
/// and a tenant's scheduling control the guard does not allow.
#[lsm(hook = "file_ioctl")]
pub fn gpud_lsm_ioctl(ctx: LsmContext) -> i32 {
    refusing::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
}

/// The `deny` tier for 32-bit callers on kernels with the `file_ioctl_compat` hook.
#[lsm(hook = "file_ioctl_compat")]
pub fn gpud_lsm_ioctl_compat(ctx: LsmContext) -> i32 {
    refusing::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
}

/// [`gpud_lsm_ioctl`] whose scheduler guard may also lower a tenant's timeslice.
#[lsm(hook = "file_ioctl")]
pub fn gpud_lsm_ioctl_rw(ctx: LsmContext) -> i32 {
    refusing::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
}

/// [`gpud_lsm_ioctl_compat`] whose scheduler guard may also lower a tenant's timeslice.
#[lsm(hook = "file_ioctl_compat")]
pub fn gpud_lsm_ioctl_compat_rw(ctx: LsmContext) -> i32 {
    refusing::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
}

/// A BPF_MODIFY_RETURN program on `$hook`: `file, cmd, arg`, then the return value so far (0
/// unless an earlier fmod_ret program refused). A non-zero return skips the hook's body and is
/// the hook's result, so `-ENOMEM` or `-EPERM` stops the ioctl before the driver, as from LSM.
///
/// The section is `fentry/$hook`: aya 0.14 parses no `fmod_ret/` section (it would refuse the
/// whole object) and never loads these itself; the daemon loads them with the attach type
/// `BPF_MODIFY_RETURN` (gpud/src/probes/modify_return.rs). aya-ebpf's `#[fentry]` would drop the
/// return value, hence this wrapper.
macro_rules! modify_return_program {
    ($(#[$doc:meta])* $hook:literal fn $name:ident($ctx:ident) -> i32 $body:block) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[unsafe(link_section = concat!("fentry/", $hook))]
        pub fn $name(raw: *mut core::ffi::c_void) -> i32 {
            let $ctx = FEntryContext::new(raw);
            $body
        }
    };
}

modify_return_program! {
    /// The `deny` tier through fmod_ret on `security_file_ioctl`: [`gpud_lsm_ioctl`] where
    /// BPF-LSM does not run.
    "security_file_ioctl" fn gpud_fmodret_ioctl(ctx) -> i32 {
        refusing::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
    }
}

modify_return_program! {
    /// [`gpud_fmodret_ioctl`] on `security_file_ioctl_compat`.
    "security_file_ioctl_compat" fn gpud_fmodret_ioctl_compat(ctx) -> i32 {
        refusing::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
    }
}

modify_return_program! {
    /// [`gpud_fmodret_ioctl`] whose scheduler guard may also lower a tenant's timeslice.
    "security_file_ioctl" fn gpud_fmodret_ioctl_rw(ctx) -> i32 {
        refusing::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
    }
}

modify_return_program! {
    /// [`gpud_fmodret_ioctl_compat`] whose scheduler guard may also lower a tenant's timeslice.
    "security_file_ioctl_compat" fn gpud_fmodret_ioctl_compat_rw(ctx) -> i32 {
        refusing::<true>(ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3))
    }
}

modify_return_program! {
    /// Capability probe only: attached for a moment to learn whether the kernel runs fmod_ret
    /// programs on `security_file_ioctl`. Lets every call through.
    "security_file_ioctl" fn gpud_fmodret_probe(ctx) -> i32 {
        let prev: i32 = ctx.arg(3);
        prev
    }
}

/// Return side of `ioctl(2)` in the fentry and LSM tiers. The loader attaches it to the
/// architecture's syscall entry (`__x64_sys_ioctl`, `__ia32_compat_sys_ioctl`, ...), which takes
/// one argument (`struct pt_regs *`), so the return value is argument 1. Only threads with a
/// pending RM call do more than one lookup.
#[fexit(function = "__x64_sys_ioctl")]
pub fn gpud_fexit_ioctl(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit::<false>(ret);
    0
}

/// [`gpud_fexit_ioctl`] for 32-bit callers (`__ia32_compat_sys_ioctl` on x86-64).
#[fexit(function = "__ia32_compat_sys_ioctl")]
pub fn gpud_fexit_ioctl_compat(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit::<false>(ret);
    0
}

/// [`gpud_fexit_ioctl`] that also gives limited cgroups their memory view. A separate program
/// because `bpf_probe_write_user` is refused under lockdown: where it is, the plain one runs.
#[fexit(function = "__x64_sys_ioctl")]
pub fn gpud_fexit_ioctl_rw(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit::<true>(ret);
    0
}

/// [`gpud_fexit_ioctl_rw`] for 32-bit callers.
#[fexit(function = "__ia32_compat_sys_ioctl")]
pub fn gpud_fexit_ioctl_compat_rw(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit::<true>(ret);
    0
}

/// Last reference to a file dropped (fentry and LSM tiers): a control file's clients are freed
/// by the driver without an `RM_FREE`.
#[fentry(function = "security_file_free")]
pub fn gpud_fentry_file_free(ctx: FEntryContext) -> i32 {
    let file: *const u8 = ctx.arg(0);
    if let Some(DeviceKind::Control) = unsafe { device_kind(&BtfRead, file) } {
        file_released(file as u64);
    }
    0
}

#[fentry(function = "security_file_open")]
pub fn gpud_fentry_open(ctx: FEntryContext) -> i32 {
    let file: *const u8 = ctx.arg(0);
    let Some(kind) = (unsafe { device_kind(&BtfRead, file) }) else {
        return 0;
    };
    mark_opened();
    if let DeviceKind::Control = kind {
        control_file_opened(file);
    }
    0
}

/// Capability probe only: the daemon loads (never attaches) it to learn whether BPF-LSM programs
/// are accepted by this kernel.
#[lsm(hook = "file_ioctl")]
pub fn gpud_lsm_probe(_ctx: LsmContext) -> i32 {
    0
}

/// Capability probe only: the daemon loads (never attaches) it to learn whether the kernel lets
/// its programs call `bpf_probe_write_user` (CAP_SYS_ADMIN, no lockdown) before it loads a
/// rewriting twin: a refused twin costs the verifier a walk of its thousands of instructions,
/// and the loader's retries with a log, seconds of every start on a locked-down host. The
/// write, were it ever run, targets address 0 and fails.
#[raw_tracepoint]
pub fn gpud_write_user_probe(_ctx: RawTracePointContext) -> i32 {
    let byte = 0u8;
    match unsafe { aya_ebpf::helpers::bpf_probe_write_user(core::ptr::null_mut::<u8>(), &byte) } {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

/// Benchmark reference only (`xtask bench`): an empty program, attached in place of gpud's to
/// measure what any program on the same hook costs: on the raw `sys_enter` and `sys_exit`
/// tracepoints, as tracepoint mode's ioctl programs are. The daemon never attaches it.
#[raw_tracepoint]
pub fn gpud_noop_raw_tp(_ctx: RawTracePointContext) -> i32 {
    0
}

/// Benchmark reference only: the fentry counterpart of [`gpud_noop_raw_tp`].
#[fentry(function = "security_file_ioctl")]
pub fn gpud_noop_fentry(_ctx: FEntryContext) -> i32 {
    0
}

/// Benchmark reference only: an empty program where fentry mode has its return side, so the
/// reference pays the same hooks as gpud.
#[fexit(function = "__x64_sys_ioctl")]
pub fn gpud_noop_fexit(_ctx: FExitContext) -> i32 {
    0
}

// ---- tracepoint mode ---------------------------------------------------------------------------

#[tracepoint]
pub fn gpud_tp_ioctl(ctx: TracePointContext) -> u32 {
    tp_ioctl::<false>(&ctx)
}

/// [`gpud_tp_ioctl`] whose scheduler guard may rewrite a tenant's control.
#[tracepoint]
pub fn gpud_tp_ioctl_rw(ctx: TracePointContext) -> u32 {
    tp_ioctl::<true>(&ctx)
}

/// `syscalls:sys_enter_ioctl`.
#[inline(always)]
fn tp_ioctl<const REWRITE: bool>(ctx: &TracePointContext) -> u32 {
    // fd and arg are loaded only past the filter: every ioctl on the host comes here.
    let cmd = tp_u64(ctx, TP_SYSCALL_ARG0 + 8);
    if ioctl_filtered(cmd) {
        ioctl_entered::<REWRITE>(
            cmd,
            tp_u64(ctx, TP_SYSCALL_ARG0),
            tp_u64(ctx, TP_SYSCALL_ARG0 + 16),
        );
    }
    0
}

/// Whether an ioctl of `cmd` by the calling process goes past the filter.
///
/// The one lookup every process on the host pays: an array read the verifier inlines. An
/// untracked process goes on only with an RM or OS escape (`_IOC_TYPE` 'F'): it may have
/// received an NVIDIA file (SCM_RIGHTS, pidfd_getfd), and its first call on it makes it
/// tracked, so what it allocates is charged to its cgroup at once. Other drivers rarely use
/// 'F'; UVM's commands carry no type, so a process that only ever received a UVM file is found
/// by the periodic scan.
#[inline(always)]
fn ioctl_filtered(cmd: u64) -> bool {
    is_tracked(current_tgid()) || nv::is_escape_type(cmd as u32)
}

/// The entry of an ioctl past [`ioctl_filtered`] in tracepoint mode, 64-bit or 32-bit.
#[inline(always)]
fn ioctl_entered<const REWRITE: bool>(cmd: u64, fd: u64, arg: u64) {
    let Some(cfg) = config() else { return };
    let Some(file) = (unsafe { file_of_fd(fd) }) else {
        return;
    };
    if let Some(kind) = unsafe { device_kind(&ProbeRead(&cfg.offsets), file) } {
        account(kind, cmd as u32, arg);
        if let DeviceKind::Control = kind {
            rm_entry::<REWRITE>(file as u64, cmd as u32, arg, false);
        }
    }
}

/// `syscalls:sys_exit_ioctl`: the return side in tracepoint mode.
#[tracepoint]
pub fn gpud_tp_ioctl_exit(ctx: TracePointContext) -> u32 {
    if !is_tracked(current_tgid()) {
        return 0;
    }
    rm_exit::<false>(tp_u64(&ctx, TP_SYSCALL_RET) as i64);
    0
}

/// [`gpud_tp_ioctl_exit`] that also gives limited cgroups their memory view (see
/// [`gpud_fexit_ioctl_rw`]).
#[tracepoint]
pub fn gpud_tp_ioctl_exit_rw(ctx: TracePointContext) -> u32 {
    if !is_tracked(current_tgid()) {
        return 0;
    }
    rm_exit::<true>(tp_u64(&ctx, TP_SYSCALL_RET) as i64);
    0
}

/// `syscalls:sys_enter_close` (tracepoint mode, which has no file-release hook).
#[tracepoint]
pub fn gpud_tp_close(ctx: TracePointContext) -> u32 {
    if !is_tracked(current_tgid()) {
        return 0;
    }
    closing(tp_u64(&ctx, TP_SYSCALL_ARG0));
    0
}

/// A tracked process closes `fd`: closing the only reference to a control file releases its
/// clients.
#[inline(always)]
fn closing(fd: u64) {
    let Some(cfg) = config() else { return };
    let Some(file) = (unsafe { file_of_fd(fd) }) else {
        return;
    };
    let r = ProbeRead(&cfg.offsets);
    if let Some(DeviceKind::Control) = unsafe { device_kind(&r, file) }
        && unsafe { sole_reference(&r, file, cfg.offsets.file_one_ref) }
    {
        file_released(file as u64);
    }
}

/// Attached to `sys_exit_open`, `sys_exit_openat` and `sys_exit_openat2`.
#[tracepoint]
pub fn gpud_tp_open(ctx: TracePointContext) -> u32 {
    let ret = tp_u64(&ctx, TP_SYSCALL_RET) as i64;
    if ret >= 0 {
        opened(ret as u64);
    }
    0
}

/// `fd` was just opened: if it is an NVIDIA file, its process holds one.
#[inline(always)]
fn opened(fd: u64) {
    let Some(cfg) = config() else { return };
    let Some(file) = (unsafe { file_of_fd(fd) }) else {
        return;
    };
    let Some(kind) = (unsafe { device_kind(&ProbeRead(&cfg.offsets), file) }) else {
        return;
    };
    mark_opened();
    if let DeviceKind::Control = kind {
        control_file_opened(file);
    }
}

// ---- tracepoint mode: every system call -------------------------------------------------------
//
// Every system call passes the raw `sys_enter` and `sys_exit` tracepoints. Where 32-bit callers
// are followed (x86-64), programs there take the ioctls and closes, 64-bit and 32-bit, and the
// 32-bit opens, instead of programs on the `syscalls:*` events: those skip 32-bit system calls
// (i386's `int 0x80`/`sysenter` and x32's), which the driver serves through the same handlers
// with the same layouts, and each is an event record the kernel builds, for every ioctl and
// close on the host, before its program runs (about a quarter of a µs a call,
// docs/benchmarks.md), while a raw tracepoint runs its program at once. The entry picks the
// calls from the number (a tracepoint argument) and tells i386's numbers, which the 64-bit table
// reuses, by the task's `TS_COMPAT`; the return knows an RM call by the thread's note of it, and
// reads the number from the saved registers only for a tracked caller's other calls. Every
// other system call on the host leaves after the number (entry) or the `TRACKED` read (exit).
// Elsewhere the `syscalls:*` programs run and the daemon reports 32-bit ioctls in `UnseenCalls`.

/// A system call these programs follow.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Ioctl,
    Close,
    Open,
}

/// The call system call `nr` may be, and its table. The 64-bit opens are left to the
/// `syscalls:sys_exit_open*` programs, which see every process's (an untracked process opening
/// an NVIDIA file becomes tracked there), not only tracked ones'.
#[inline(always)]
fn followed_call(nr: i64) -> Option<(Call, Abi)> {
    use gpud_common::compat::*;
    Some(match nr {
        NATIVE_IOCTL => (Call::Ioctl, Abi::Native),
        NATIVE_CLOSE => (Call::Close, Abi::Native),
        IA32_IOCTL => (Call::Ioctl, Abi::I386),
        IA32_CLOSE => (Call::Close, Abi::I386),
        IA32_OPEN | IA32_OPENAT | IA32_OPENAT2 => (Call::Open, Abi::I386),
        X32_IOCTL => (Call::Ioctl, Abi::X32),
        X32_CLOSE => (Call::Close, Abi::X32),
        X32_OPEN | X32_OPENAT | X32_OPENAT2 => (Call::Open, Abi::X32),
        _ => return None,
    })
}

/// Whether the calling task's system call is of `abi`'s table, where its number said it may be:
/// i386's numbers are the 64-bit table's too.
#[inline(always)]
fn of_table(abi: Abi) -> bool {
    match abi {
        Abi::Native => !kernel::in_ia32_syscall(),
        Abi::I386 => kernel::in_ia32_syscall(),
        Abi::X32 => true,
    }
}

/// Raw tracepoint `sys_enter(regs, id)`: an ioctl's entry, a close.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn gpud_tp_sys_enter(ctx: RawTracePointContext) -> i32 {
    sys_enter::<false>(&ctx);
    0
}

/// [`gpud_tp_sys_enter`] whose scheduler guard may rewrite a tenant's control.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn gpud_tp_sys_enter_rw(ctx: RawTracePointContext) -> i32 {
    sys_enter::<true>(&ctx);
    0
}

#[inline(always)]
fn sys_enter<const REWRITE: bool>(ctx: &RawTracePointContext) {
    let id: i64 = ctx.arg(1);
    let Some((call, abi)) = followed_call(id) else {
        return;
    };
    match call {
        // Seen at the return, where the descriptor is known.
        Call::Open => return,
        Call::Close if !is_tracked(current_tgid()) => return,
        _ => {}
    }
    // The table first where that settles an i386 number cheaply; a 64-bit ioctl's command
    // first (every ioctl on the host comes here, and few go past the filter).
    if abi != Abi::Native && !of_table(abi) {
        return;
    }
    let regs: *const u8 = ctx.arg(0);
    let Some([fd, cmd, arg]) = (unsafe { kernel::syscall_args(regs, abi) }) else {
        return;
    };
    if (call == Call::Ioctl && !ioctl_filtered(cmd)) || (abi == Abi::Native && !of_table(abi)) {
        return;
    }
    match call {
        Call::Ioctl => ioctl_entered::<REWRITE>(cmd, fd, arg),
        Call::Close => closing(fd),
        Call::Open => {}
    }
}

/// Raw tracepoint `sys_exit(regs, ret)`: the return of an RM call noted at its entry, a 32-bit
/// open of a tracked process. (An untracked 32-bit process becomes tracked at its first RM
/// call, an 'F' escape, or by the daemon's periodic scan; its opens are not looked at, so that
/// only tracked processes go past the `TRACKED` read here.) Raw, as the entry is: a raw
/// tracepoint runs the program without building the event record `raw_syscalls:sys_exit` fills
/// for a perf-event program first (docs/benchmarks.md).
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn gpud_tp_sys_exit(ctx: RawTracePointContext) -> i32 {
    sys_exit::<false>(&ctx);
    0
}

/// [`gpud_tp_sys_exit`] that also gives limited cgroups their memory view.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn gpud_tp_sys_exit_rw(ctx: RawTracePointContext) -> i32 {
    sys_exit::<true>(&ctx);
    0
}

#[inline(always)]
fn sys_exit<const REWRITE: bool>(ctx: &RawTracePointContext) {
    // The caller first (a helper call and an array read).
    if !is_tracked(current_tgid()) {
        return;
    }
    let ret: i64 = ctx.arg(1);
    // An RM call the thread noted is this system call's own, 64-bit or 32-bit: a thread is in
    // one system call at a time, and its entry noted the call. Its return needs no number.
    if rm_exit::<REWRITE>(ret) {
        return;
    }
    // Else only a 32-bit open is looked for: the number from the registers (a kernel read).
    let regs: *const u8 = ctx.arg(0);
    let Some(nr) = (unsafe { read_at::<i64>(regs, gpud_common::compat::REGS_ORIG_AX as u32) })
    else {
        return;
    };
    if let Some((Call::Open, abi)) = followed_call(nr)
        && ret >= 0
        && of_table(abi)
    {
        opened(ret as u64);
    }
}

/// `sched_process_fork(parent, child)`: a child of a tracked process may hold its files.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn gpud_tp_fork(ctx: RawTracePointContext) -> i32 {
    let parent_tgid = current_tgid();
    if !is_tracked(parent_tgid) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let child: *const u8 = ctx.arg(1);
    let Some(child_tgid) = (unsafe { read_at::<u32>(child, cfg.offsets.task_tgid) }) else {
        return 0;
    };
    if child_tgid == parent_tgid {
        return 0; // a new thread, not a new process
    }
    let entry = ProcEntry {
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        flags: PROC_INHERITED,
        ..ProcEntry::default()
    };
    match PROCS.insert(child_tgid, entry, BPF_NOEXIST as u64) {
        Ok(()) => {
            mark_tracked(child_tgid);
            send(&Event {
                kind: EVENT_PROC_NEW,
                tgid: child_tgid,
                cgroup_id: entry.cgroup_id,
                client: parent_tgid,
                ..Event::default()
            });
        }
        Err(_) => {
            // As in `proc_entry`: uncounted, still followed.
            mark_tracked(child_tgid);
            bump_stat(stat::PROCS_FULL);
        }
    }
    0
}

/// `sched_process_exit` runs for each exiting thread; the process is gone when its
/// `signal->live` count has dropped to zero (decremented before the tracepoint fires).
#[tracepoint]
pub fn gpud_tp_exit(_ctx: TracePointContext) -> u32 {
    let tgid = current_tgid();
    let entry = PROCS.get_ptr(tgid);
    if entry.is_none() && !is_tracked(tgid) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let o = &cfg.offsets;
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(signal) = (unsafe { read_at::<*const u8>(task, o.task_signal) }) else {
        return 0;
    };
    if signal.is_null() {
        return 0;
    }
    let Some(live) = (unsafe { read_at::<i32>(signal, o.signal_live) }) else {
        return 0;
    };
    if live != 0 {
        return 0;
    }
    if cfg.flags & CFG_EXIT_RELEASE != 0 {
        release_files_at_exit(cfg);
    }
    clear_tracked(tgid);
    if let Some(entry) = entry {
        let cgroup_id = unsafe { (*entry).cgroup_id };
        let _ = PROCS.remove(tgid);
        emit(EVENT_PROC_EXIT, tgid, cgroup_id);
    }
    0
}

run_program! {
    /// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` at an upgrade, once per
    /// object of the previous ABI's `OBJECTS` (arguments: the key as `client << 32 | object`,
    /// `kind | parent << 32`, `gpu | tgid << 32`, cgroup, bytes, file, serial, charge, and
    /// whether no other holder of its charge is recorded yet). Returns 0 when adopted, 1 when
    /// an object is recorded under its key already, 2 when the map has no room.
    fn gpud_adopt(ctx) -> i32 {
        let key: u64 = ctx.arg(0);
        let kind_parent: u64 = ctx.arg(1);
        let gpu_tgid: u64 = ctx.arg(2);
        let first: u64 = ctx.arg(8);
        let key = ObjKey {
            client: (key >> 32) as u32,
            object: key as u32,
        };
        let entry = gpud_common::ObjEntry {
            kind: kind_parent as u32,
            parent: (kind_parent >> 32) as u32,
            gpu: gpu_tgid as u32,
            tgid: (gpu_tgid >> 32) as u32,
            cgroup_id: ctx.arg(3),
            bytes: ctx.arg(4),
            file: ctx.arg(5),
            serial: ctx.arg(6),
            charge: ctx.arg(7),
            // Set by `adopt`.
            flags: 0,
            _pad: 0,
        };
        adopt(&key, &entry, first != 0)
    }
}

run_program! {
    /// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` (argument 0: a tgid) to mark a
    /// process it found holding an NVIDIA file, so `TRACKED` is only ever changed atomically.
    fn gpud_seed(ctx) -> i32 {
        let tgid: u64 = ctx.arg(0);
        if tgid == 0 || tgid > u32::MAX as u64 {
            return 1;
        }
        mark_tracked(tgid as u32);
        0
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
