//! The scheduler guard: what a tenant (any process but gpud) may do with the RM controls that
//! change how the GPU divides its time (`gpud_common::rm::sched`).
//!
//! Entry side of `NV_ESC_RM_CONTROL` only, before the driver copies anything in. Ordinary
//! controls pay one `match` on the command number. A guarded one is refused (`EPERM` from the
//! BPF-LSM hook), or, where the program may call `bpf_probe_write_user`, turned into a call the
//! driver rejects (`paramsSize` 0) or, for `SET_TIMESLICE`, lowered to the caller's allowance;
//! an enable of a channel group the daemon holds off the runlist (`HELD_GROUPS`) becomes the
//! driver's NULL command.
//! In `audit` it is only reported. Every call acted on is reported through the ring.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_user_buf, bpf_probe_write_user, bpf_send_signal,
    },
};
use gpud_common::{
    CFG_GUARD_KILL, CFG_SCHED_ENFORCE, EVENT_SCHED_GUARD, Event, GPU_UNKNOWN, GUARD_AUDITED,
    GUARD_CLAMPED, GUARD_DENIED, GUARD_EVENT_BURST, GUARD_EVENT_GAP_NS, GUARD_KILLED,
    GUARD_REASON_FLAGS, GUARD_REASON_FORBIDDEN, GUARD_REASON_FOREIGN, GUARD_REASON_HELD,
    GUARD_REASON_LEGACY, GUARD_REASON_TIMESLICE, GUARD_REFUSED, GUARD_RESTORED, GUARD_UNENFORCED,
    GuardBucket, GuardKey, OBJ_CHANNEL, OBJ_CHANNEL_GROUP, OBJ_CLIENT, OWNER_DISABLES,
    OWNER_OFF_RUNLIST, OWNER_SCHEDULED, ObjKey, ProbeConfig, nv,
    rm::{
        self,
        sched::{self, Rule},
    },
    stat,
};

use crate::{
    kernel::current_tgid,
    ledger::{current_ancestry, user},
    maps::{
        EVENTS, GUARD_BUCKET, GUARD_COUNTS, GUARD_PENDING, HELD_GROUPS, OBJECTS, RESTORE_SCRATCH,
        SCHED_ALLOW, SCHED_FILES, SCHED_GROUPS, bump_stat, config, counter_slot, noting, send,
    },
};

const SIGKILL: u32 = 9;

const EPERM: i32 = 1;

/// What a guarded call asked for, and why it is acted on.
struct Finding {
    reason: u32,
    /// The timeslice asked (µs), or the foreign client named.
    asked: u64,
    /// The caller's timeslice allowance (µs; 0 where no timeslice is involved).
    allowed: u64,
}

/// Entry side of an RM control `c` (its `NVOS54` at `nvos54` in user memory) on control file
/// `file`. `None` for a control the guard does not own (the caller goes on with it); otherwise
/// the verdict: `-EPERM` to refuse (only where `deny`), 0 to let the (possibly rewritten) call
/// through.
#[inline(always)]
pub(crate) fn control<const REWRITE: bool>(
    cfg: &ProbeConfig,
    file: u64,
    nvos54: u64,
    c: &rm::Nvos54,
    deny: bool,
) -> Option<i32> {
    let rule = sched::rule_of(c.cmd)?;
    if current_tgid() == cfg.daemon_tgid {
        return Some(0);
    }
    let found = match rule {
        Rule::Pass => return Some(0),
        _ if c.cmd & sched::LEGACY_BIT != 0 => Finding {
            reason: GUARD_REASON_LEGACY,
            asked: 0,
            allowed: 0,
        },
        // A serialized layout would hide the parameters read below.
        _ if c.flags != 0 => Finding {
            reason: GUARD_REASON_FLAGS,
            asked: 0,
            allowed: 0,
        },
        Rule::Refuse => Finding {
            reason: GUARD_REASON_FORBIDDEN,
            asked: 0,
            allowed: 0,
        },
        Rule::Timeslice => timeslice(cfg, c)?,
        Rule::DisableChannels => channels_rule(file, c)?,
        Rule::Schedule => held_enable(file, c)?,
    };
    bump_stat(stat::SCHED_GUARDED);
    let action = if cfg.flags & CFG_SCHED_ENFORCE == 0 {
        GUARD_AUDITED
    } else if found.reason == GUARD_REASON_HELD && REWRITE && neutralize(nvos54, c) {
        // Done as the driver does a NULL command: CUDA may check the status.
        GUARD_REFUSED
    } else if found.reason == GUARD_REASON_TIMESLICE {
        clamp::<REWRITE>(c, &found, deny)
    } else if deny {
        GUARD_DENIED
    } else if REWRITE && reject(nvos54, c) {
        GUARD_REFUSED
    } else {
        GUARD_UNENFORCED
    };
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    // Neither a hook nor a rewrite stopped it: react now, and have the daemon undo it at the exit.
    let action = if action == GUARD_UNENFORCED && cfg.flags & CFG_SCHED_ENFORCE != 0 {
        react(cfg, file, nvos54, c, &found, cgroup_id)
    } else {
        action
    };
    let verdict = action | found.reason << 8;
    count(GuardKey {
        cgroup_id,
        cmd: c.cmd,
        verdict,
    });
    if may_send(cgroup_id) {
        send(&Event {
            kind: EVENT_SCHED_GUARD,
            tgid: current_tgid(),
            cgroup_id,
            client: c.h_client,
            object: c.cmd,
            value: found.asked,
            bytes: found.allowed,
            gpu: verdict,
            _pad: 0,
        });
    } else {
        bump_stat(stat::SCHED_GUARD_QUIET);
    }
    Some(if action == GUARD_DENIED { -EPERM } else { 0 })
}

/// A call that went through although the guard would stop it (no hook, no rewrite): a timeslice
/// is set back and a neighbour's channels enabled again by the daemon at the call's exit
/// ([`restore_at_exit`]); the caller of a foreign disable or a forbidden control is killed at
/// once where `guard_react_action = "kill"` (it dies before it returns to user space; the call
/// itself still runs, hence the restore).
#[inline(always)]
fn react(
    cfg: &ProbeConfig,
    file: u64,
    nvos54: u64,
    c: &rm::Nvos54,
    f: &Finding,
    cgroup_id: u64,
) -> u32 {
    let kill = cfg.flags & CFG_GUARD_KILL != 0;
    let restorable = matches!(f.reason, GUARD_REASON_TIMESLICE | GUARD_REASON_FOREIGN);
    let noted = restorable && note_restore(file, nvos54, c, f, cgroup_id, kill);
    match f.reason {
        GUARD_REASON_TIMESLICE if noted => GUARD_RESTORED,
        // The compute law takes a held group off the runlist again at its next period.
        GUARD_REASON_TIMESLICE | GUARD_REASON_HELD => GUARD_UNENFORCED,
        _ if kill => {
            let _ = unsafe { bpf_send_signal(SIGKILL) };
            GUARD_KILLED
        }
        _ if noted => GUARD_RESTORED,
        _ => GUARD_UNENFORCED,
    }
}

/// Notes what the daemon must undo at the call's exit (its parameters copied now, before the
/// driver reads them), and the call as pending so the exit side looks. False if it could not.
#[inline(always)]
fn note_restore(
    file: u64,
    nvos54: u64,
    c: &rm::Nvos54,
    f: &Finding,
    cgroup_id: u64,
    kill: bool,
) -> bool {
    let Some(r) = RESTORE_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    let r = unsafe { &mut *r };
    r.kind = gpud_common::EVENT_GUARD_RESTORE;
    r.tgid = current_tgid();
    r.cgroup_id = cgroup_id;
    r.client = c.h_client;
    r.object = c.h_object;
    r.cmd = c.cmd;
    r.verdict = if kill && f.reason == GUARD_REASON_FOREIGN {
        GUARD_KILLED
    } else {
        GUARD_RESTORED
    } | f.reason << 8;
    r.allowed = f.allowed;
    r.gpu = unsafe {
        OBJECTS.get(ObjKey {
            client: c.h_client,
            object: c.h_object,
        })
    }
    .map_or(GPU_UNKNOWN, |e| e.gpu);
    r.num_channels = 0;
    if f.reason == GUARD_REASON_FOREIGN {
        let Some(n) = (unsafe { user::<u32>(c.params + sched::DISABLE_NUM_CHANNELS as u64) })
        else {
            return false;
        };
        if n as usize > sched::DISABLE_CHANNELS_MAX {
            return false;
        }
        if !read_list(&mut r.clients, c.params + sched::DISABLE_CLIENT_LIST as u64)
            || !read_list(
                &mut r.channels,
                c.params + sched::DISABLE_CHANNEL_LIST as u64,
            )
        {
            return false;
        }
        r.num_channels = n;
    }
    let id = bpf_get_current_pid_tgid();
    // By reference to the scratch value: a copy (568 bytes) would not fit the BPF stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let inserted = GUARD_PENDING.insert(id, &*r, 0);
    if inserted.is_err() {
        return false;
    }
    let Some(p) = noting() else {
        return false;
    };
    (p.file, p.params, p.nr, p.size, p.gpu) = (
        file,
        nvos54,
        nv::NV_ESC_RM_CONTROL,
        nv::NVOS54_SIZE,
        GPU_UNKNOWN,
    );
    true
}

/// Copies one of the disable-channels lists from user memory at `at`.
#[inline(always)]
fn read_list(dst: &mut [u32; sched::DISABLE_CHANNELS_MAX], at: u64) -> bool {
    // SAFETY: a plain u32 array, read as its bytes.
    let bytes =
        unsafe { core::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), size_of_val(dst)) };
    unsafe { bpf_probe_read_user_buf(at as *const u8, bytes) }.is_ok()
}

/// Exit side of an RM control noted by [`note_restore`]: hands what to undo to the daemon. Not
/// rate-limited like the reports: each is an undo the daemon must do.
#[inline(always)]
pub(crate) fn restore_at_exit(id: u64) {
    let Some(r) = (unsafe { GUARD_PENDING.get(id) }) else {
        return;
    };
    if EVENTS.output::<gpud_common::GuardRestore>(r, 0).is_err() {
        bump_stat(stat::EVENTS_LOST);
    }
    let _ = GUARD_PENDING.remove(id);
}

// ---- read-back ----------------------------------------------------------------------------------
//
// Everything the entry side judges is user memory: another thread of the caller can rewrite the
// command (`GET_TIMESLICE` into `SET_TIMESLICE`), the object or the parameters between the
// guard's read and the driver's copy, and put them back before the exit. What the driver ran
// is known only from the driver: after a tenant's control on a control file that holds
// channel groups, whatever the guard saw, the daemon reads those groups' timeslices back
// (`GET_TIMESLICE`) and sets back any above the allowance. One read-back at a time per file
// (`SCHED_FILES` 1 from the request until the daemon begins it), so a tenant looping on
// controls costs one ring record per read-back, not one per call.

/// A channel group was made through control file `file`: its file is one whose controls are
/// read back.
#[inline(always)]
pub(crate) fn watch_group(file: u64, group: ObjKey) {
    // The file first: the daemon prunes watched groups whose file is not marked.
    watch_file(file);
    if SCHED_GROUPS.insert(group, file, 0).is_err() {
        bump_stat(stat::SCHED_GROUPS_FULL);
    }
}

/// A channel group or a subdevice was made through control file `file`: its controls are read
/// back. A subdevice is all `FIFO_DISABLE_CHANNELS` needs, so a file with one and no channel
/// group of its own can still disable a neighbour's channels.
#[inline(always)]
pub(crate) fn watch_file(file: u64) {
    let _ = SCHED_FILES.insert(file, 0, BPF_NOEXIST as u64);
}

/// Whether a control on `file` by the caller is read back at its exit: a tenant's (not gpud's)
/// on a file with channel groups, with the guard enforcing.
#[inline(always)]
pub(crate) fn reads_back(cfg: &ProbeConfig, file: u64) -> bool {
    cfg.flags & CFG_SCHED_ENFORCE != 0
        && current_tgid() != cfg.daemon_tgid
        && unsafe { SCHED_FILES.get(file) }.is_some()
}

/// Exit side of a tenant's control on `file` (or of an XFER, whose inner call another thread
/// may have turned into one): asks the daemon for a read-back unless one is already asked.
/// The record is written in the ring's own memory: the exit programs' stack has no room for one.
#[inline(always)]
pub(crate) fn read_back_at_exit(file: u64) {
    let Some(cfg) = config() else { return };
    if !reads_back(cfg, file) {
        return;
    }
    let Some(asked) = SCHED_FILES.get_ptr_mut(file) else {
        return;
    };
    if unsafe { *asked } != 0 {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        // The next control asks again.
        bump_stat(stat::EVENTS_LOST);
        return;
    };
    unsafe { *asked = 1 };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` is the reserved record, written field by field before it is submitted.
    unsafe {
        (*e).kind = gpud_common::EVENT_GUARD_READ_BACK;
        (*e).tgid = current_tgid();
        (*e).cgroup_id = bpf_get_current_cgroup_id();
        (*e).client = 0;
        (*e).object = 0;
        (*e).value = file;
        (*e).bytes = allowance(cfg);
        (*e).gpu = 0;
        (*e)._pad = 0;
    }
    entry.submit(0);
    bump_stat(stat::READ_BACKS);
}

/// The control file at `file` is gone: nothing of it is read back any more (its groups' entries
/// are pruned by the daemon).
#[inline(always)]
pub(crate) fn forget_file(file: u64) {
    let _ = SCHED_FILES.remove(file);
}

/// One more call under `key` in `GUARD_COUNTS`.
#[inline(always)]
fn count(key: GuardKey) {
    match counter_slot(&GUARD_COUNTS, key) {
        Some(slot) => {
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, 1) };
        }
        None => bump_stat(stat::GUARD_COUNTS_FULL),
    }
}

/// Whether the cgroup's burst of events has one left (refilled one per `GUARD_EVENT_GAP_NS`
/// since the last refill). Racing CPUs may both take the last token: a bound, not a count.
#[inline(always)]
fn may_send(cgroup_id: u64) -> bool {
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(b) = GUARD_BUCKET.get_ptr_mut(cgroup_id) else {
        let fresh = GuardBucket {
            tokens: GUARD_EVENT_BURST - 1,
            at: now,
        };
        let _ = GUARD_BUCKET.insert(cgroup_id, fresh, 0);
        return true;
    };
    let b = unsafe { &mut *b };
    let refill = now.saturating_sub(b.at) / GUARD_EVENT_GAP_NS;
    if refill > 0 {
        b.tokens = (b.tokens + refill).min(GUARD_EVENT_BURST);
        b.at += refill * GUARD_EVENT_GAP_NS;
    }
    if b.tokens == 0 {
        return false;
    }
    b.tokens -= 1;
    true
}

/// `SET_TIMESLICE` above the caller's allowance: what it asked and may have. `None` when it
/// asks no more, or the call is malformed (the driver refuses it; nothing is written).
#[inline(always)]
fn timeslice(cfg: &ProbeConfig, c: &rm::Nvos54) -> Option<Finding> {
    if c.params_size as usize != size_of::<rm::tsg::TimesliceParams>() {
        return None;
    }
    let asked: u64 = unsafe { user(c.params)? };
    let allowed = allowance(cfg);
    (asked > allowed).then_some(Finding {
        reason: GUARD_REASON_TIMESLICE,
        asked,
        allowed,
    })
}

/// The least allowance over the caller's cgroup and its ancestors, or the configured default.
#[inline(always)]
fn allowance(cfg: &ProbeConfig) -> u64 {
    let mut allowed = cfg.guard_timeslice_us;
    let mut found = false;
    if let Some((_, anc)) = current_ancestry() {
        for i in 0..gpud_common::MAX_CGROUP_DEPTH {
            if i as u32 >= anc.depth {
                break;
            }
            if let Some(v) = unsafe { SCHED_ALLOW.get(anc.ids[i]) } {
                allowed = if found { allowed.min(*v) } else { *v };
                found = true;
            }
        }
    }
    allowed
}

/// Lowers the timeslice in the caller's parameters where the program may write them; refuses
/// the call where it may only refuse (never below what CUDA itself sets at context creation,
/// whose refusal would fail it).
#[inline(always)]
fn clamp<const REWRITE: bool>(c: &rm::Nvos54, f: &Finding, deny: bool) -> u32 {
    if REWRITE {
        let to = f.allowed;
        if unsafe { bpf_probe_write_user(c.params as *mut u64, &to as *const u64) }.is_ok() {
            return GUARD_CLAMPED;
        }
    }
    if deny && f.asked > f.allowed.max(sched::CUDA_TIMESLICE_US) {
        return GUARD_DENIED;
    }
    GUARD_UNENFORCED
}

/// Makes the driver reject the call before it reads any parameter: `paramsSize` 0 fails its
/// size check (`NV_ERR_INVALID_ARGUMENT`); a legacy-path command loses its bit 15 first, as
/// that path checks no size.
#[inline(always)]
fn reject(nvos54: u64, c: &rm::Nvos54) -> bool {
    if c.cmd & sched::LEGACY_BIT != 0 {
        let plain = c.cmd & !sched::LEGACY_BIT;
        let at = nvos54 + sched::NVOS54_CMD as u64;
        if unsafe { bpf_probe_write_user(at as *mut u32, &plain as *const u32) }.is_err() {
            return false;
        }
    }
    let zero = 0u32;
    let at = nvos54 + sched::NVOS54_PARAMS_SIZE as u64;
    unsafe { bpf_probe_write_user(at as *mut u32, &zero as *const u32) }.is_ok()
}

/// `GPFIFO_SCHEDULE` putting back on the runlist a channel group gpud holds off it. `None` for
/// any other (CUDA's own enables at context creation, a disable), or a malformed call. A group
/// of the caller's own that it takes off the runlist or puts back is noted on the group
/// ([`owner_schedules`]).
#[inline(always)]
fn held_enable(file: u64, c: &rm::Nvos54) -> Option<Finding> {
    if c.params_size as usize != size_of::<rm::tsg::ScheduleParams>() {
        return None;
    }
    let enable: u8 = unsafe { user(c.params)? };
    let key = ObjKey {
        client: c.h_client,
        object: c.h_object,
    };
    let held = enable != 0 && unsafe { HELD_GROUPS.get(key) }.is_some();
    if !held && own_client(file, c.h_client) {
        owner_schedules(key, enable != 0);
    }
    held.then_some(Finding {
        reason: GUARD_REASON_HELD,
        asked: 1,
        allowed: 0,
    })
}

// ---- the owner's own holds ---------------------------------------------------------------------
//
// A raced `FIFO_DISABLE_CHANNELS` (its client list naming the caller's own client when the guard
// reads it and a neighbour's when the driver copies it) leaves no state the driver answers a
// query of, so after a tenant's control the daemon puts the recorded channel groups back on the
// runlist, which clears their channels' disables (the driver counts them). What a process
// holds off itself must stay off: its own disables and runlist removals are noted on the group's
// `OBJECTS` entry (`ObjEntry::owner_holds`), and the daemon leaves a group with any alone. Only
// calls on the caller's own client are noted: a client named in user memory that another process
// made is never the caller's to mark.

/// Whether `client` is one the caller made, on `file` or in its own process (as the foreign-client
/// rule tells them apart). False for a client gpud never saw made.
#[inline(always)]
fn own_client(file: u64, client: u32) -> bool {
    unsafe {
        OBJECTS.get(ObjKey {
            client,
            object: client,
        })
    }
    .is_some_and(|e| e.kind == OBJ_CLIENT && (e.file == file || e.tgid == current_tgid()))
}

/// The caller took its own group `key` off the runlist (`enable` false) or put it on, which
/// also clears its channels' disables in the driver.
#[inline(always)]
fn owner_schedules(key: ObjKey, enable: bool) {
    let Some(g) = OBJECTS.get_ptr_mut(key) else {
        return;
    };
    let g = unsafe { &mut *g };
    if g.kind != OBJ_CHANNEL_GROUP {
        return;
    }
    g.charge = if enable {
        OWNER_SCHEDULED
    } else {
        g.charge | OWNER_OFF_RUNLIST
    };
}

/// The caller disabled (or enabled) its own channel `(client, channel)`: one more (or one
/// fewer) of its disables on the channel's group.
#[inline(always)]
fn owner_disables(client: u32, channel: u32, disable: bool) {
    let Some(ch) = (unsafe {
        OBJECTS.get(ObjKey {
            client,
            object: channel,
        })
    }) else {
        return;
    };
    if ch.kind != OBJ_CHANNEL {
        return;
    }
    let group = ObjKey {
        client,
        object: ch.parent,
    };
    let Some(g) = OBJECTS.get_ptr_mut(group) else {
        return;
    };
    let g = unsafe { &mut *g };
    if g.kind != OBJ_CHANNEL_GROUP {
        return;
    }
    let count = g.charge & OWNER_DISABLES;
    let count = if disable {
        count + 1
    } else {
        count.saturating_sub(1)
    };
    g.charge = g.charge & !OWNER_DISABLES | count & OWNER_DISABLES;
}

/// Makes the call one the driver answers `NV_OK` without doing anything: the control's class
/// with category and index 0 (`control.c`'s NULL command).
#[inline(always)]
fn neutralize(nvos54: u64, c: &rm::Nvos54) -> bool {
    let null = c.cmd & 0xffff_0000;
    let at = nvos54 + sched::NVOS54_CMD as u64;
    unsafe { bpf_probe_write_user(at as *mut u32, &null as *const u32) }.is_ok()
}

/// `FIFO_DISABLE_CHANNELS` naming a client that gpud saw made on another control file by
/// another process (a client gpud never saw made, older than gpud, cannot be told apart and
/// passes), or enabling a channel gpud holds disabled (`HELD_GROUPS`: its owner would escape
/// the compute law's hold). `None` when every client named is the caller's and no held channel
/// is enabled, or the call is malformed.
#[inline(always)]
fn channels_rule(file: u64, c: &rm::Nvos54) -> Option<Finding> {
    if c.params_size as usize != size_of::<sched::DisableChannelsParams>() {
        return None;
    }
    let disable: u8 = unsafe { user(c.params)? };
    let n: u32 = unsafe { user(c.params + sched::DISABLE_NUM_CHANNELS as u64)? };
    let mut n = n;
    if n > sched::DISABLE_CHANNELS_MAX as u32 {
        // The driver refuses an over-long list itself.
        return None;
    }
    let tgid = current_tgid();
    let mut held = None;
    let mut at = 0u64;
    for _ in 0..sched::DISABLE_CHANNELS_MAX {
        if n == 0 {
            break;
        }
        n -= 1;
        // An unreadable list is the driver's to refuse.
        let client: u32 = unsafe { user(c.params + sched::DISABLE_CLIENT_LIST as u64 + at)? };
        let key = ObjKey {
            client,
            object: client,
        };
        let own = match unsafe { OBJECTS.get(key) } {
            Some(e) if e.file != file && e.tgid != tgid => {
                return Some(Finding {
                    reason: GUARD_REASON_FOREIGN,
                    asked: client as u64,
                    allowed: 0,
                });
            }
            Some(e) => e.kind == OBJ_CLIENT,
            None => false,
        };
        let channel: u32 = unsafe { user(c.params + sched::DISABLE_CHANNEL_LIST as u64 + at)? };
        let key = ObjKey {
            client,
            object: channel,
        };
        // An enable of a channel gpud holds is refused: not an enable of the owner's.
        let held_here = disable == 0 && unsafe { HELD_GROUPS.get(key) }.is_some();
        if held_here && held.is_none() {
            held = Some(Finding {
                reason: GUARD_REASON_HELD,
                asked: channel as u64,
                allowed: 0,
            });
        }
        if own && !held_here {
            owner_disables(client, channel, disable != 0);
        }
        at += 4;
    }
    held
}
