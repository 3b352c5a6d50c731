//! `NV_ESC_RM_CONTROL` on the fake's RM: the driver's checks in the driver's order (the
//! command's gate, parameter size, client binding, exporting object, rights), the effects of the
//! controls this fake models on channel groups, channels and `FB_GET_INFO_V2`, and what taking a
//! group off the runlist or disabling a channel does to its process ([`Runlist`]).

use std::{collections::BTreeSet, time::Instant};

use gpud_common::rm::{self, Handle, id, sched};

use super::{
    Caller, Object, Rm, Runlist, Sched,
    inject::take,
    remote::{params, remote_read, remote_write},
};
use crate::rm::{bytes_of, class, nvos54_flags, status};

/// What the driver keeps of a GPU's memory for itself: `TOTAL_RAM_SIZE` less `HEAP_SIZE` (480 MiB
/// on the H100 of docs/real-gpu.md).
const DRIVER_RESERVE: u64 = 480 << 20;

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
    if cmd == rm::surface::GET_SURFACE_INFO {
        return Some(size_of::<rm::surface::GetSurfaceInfoParams>() as u32);
    }
    match cmd {
        id::FIND_SUBDEVICE_HANDLE => return Some(size_of::<id::FindSubdeviceHandleParams>() as u32),
        id::GPU_GET_ID => return Some(size_of::<id::GetIdParams>() as u32),
        id::GET_ID_INFO_V2 => return Some(size_of::<id::GetIdInfoV2Params>() as u32),
        _ => {}
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
        // Every memory class is a `Memory`, whose controls are `NV0041_*`.
        class::MEMORY_LOCAL_USER | class::MEMORY_SYSTEM => c == 0x0041,
        // The client itself (`RmClientResource`): `NV0000_*`.
        class::ROOT_CLIENT => c == 0x0000,
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

impl Rm {
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
    pub(super) fn control(&mut self, c: Caller, p: &rm::Nvos54) -> u32 {
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
        let found = if p.h_object == p.h_client {
            Some(Object::client(c))
        } else {
            self.clients[&p.h_client].objects.get(&p.h_object).copied()
        };
        let Some(obj) = found else {
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
            rm::surface::GET_SURFACE_INFO => self.surface_info(c, p, obj),
            id::FIND_SUBDEVICE_HANDLE => match params::<id::FindSubdeviceHandleParams>(c, p) {
                Ok(q) if q.sub_device_inst != 0 => status::NV_ERR_INVALID_ARGUMENT,
                Ok(_) => match self.subdevice_of(client, h) {
                    Some(h_sub_device) => answer(
                        c,
                        p,
                        &id::FindSubdeviceHandleParams {
                            sub_device_inst: 0,
                            h_sub_device,
                        },
                    ),
                    None => status::NV_ERR_OBJECT_NOT_FOUND,
                },
                Err(st) => st,
            },
            id::GPU_GET_ID => match (params::<id::GetIdParams>(c, p), obj.gpu) {
                (Ok(_), Some(g)) => answer(c, p, &id::GetIdParams { gpu_id: gpu_id(g) }),
                (Ok(_), None) => status::NV_ERR_NOT_SUPPORTED,
                (Err(st), _) => st,
            },
            id::GET_ID_INFO_V2 => match params::<id::GetIdInfoV2Params>(c, p) {
                Ok(q) => match (0..self.gpus.len() as u32).find(|&g| gpu_id(g) == q.gpu_id) {
                    Some(g) => answer(
                        c,
                        p,
                        &id::GetIdInfoV2Params {
                            gpu_id: q.gpu_id,
                            gpu_flags: 1,
                            device_instance: g,
                            sub_device_instance: 0,
                            sli_status: 0,
                            board_id: q.gpu_id,
                            gpu_instance: g,
                            numa_id: -1,
                        },
                    ),
                    None => status::NV_ERR_INVALID_ARGUMENT,
                },
                Err(st) => st,
            },
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
                Ok(t) => self.with_group(client, h, |g| {
                    g.timeslice_us = t.timeslice_us;
                    g.timeslice_sets += 1;
                }),
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

    /// `GET_SURFACE_INFO` on a memory object: the list is copied in from the caller's
    /// `surfaceInfoList` (at most `RMAPI_PARAM_COPY_MAX_PARAMS_SIZE`, 1 MiB, as the driver's
    /// embedded-pointer copy takes), each index this fake knows filled (`PHYS_SIZE`: the bytes
    /// the memory holds, duplicates included, in 4 KiB units), an unknown one answered
    /// `NV_ERR_INVALID_ARGUMENT` (`memCtrlCmdGetSurfaceInfoLvm_IMPL`), and the list copied out.
    fn surface_info(&self, c: Caller, p: &rm::Nvos54, obj: &Object) -> u32 {
        use rm::surface;
        let Ok(q) = params::<surface::GetSurfaceInfoParams>(c, p) else {
            return status::NV_ERR_INVALID_ARGUMENT;
        };
        let n = q.list_size as usize;
        let len = n * size_of::<surface::Info>();
        if n == 0 || q.list == 0 || len > 1 << 20 {
            return status::NV_ERR_INVALID_ARGUMENT;
        }
        let mut raw = vec![0u8; len];
        if remote_read(c.tid, q.list, &mut raw).is_err() {
            return status::NV_ERR_INVALID_POINTER;
        }
        let bytes = self.mems.get(&obj.mem).map_or(obj.bytes, |m| m.bytes);
        for entry in raw.chunks_exact_mut(size_of::<surface::Info>()) {
            let index = u32::from_ne_bytes([entry[0], entry[1], entry[2], entry[3]]);
            let data = match index {
                // Past 16 TiB the driver answers `NV_ERR_OUT_OF_RANGE`; no fake GPU holds that.
                surface::INDEX_PHYS_SIZE => (bytes / surface::PHYS_SIZE_UNIT) as u32,
                _ => return status::NV_ERR_INVALID_ARGUMENT,
            };
            entry[4..8].copy_from_slice(&data.to_ne_bytes());
        }
        match remote_write(c.tid, q.list, &raw) {
            Ok(()) => status::NV_OK,
            Err(_) => status::NV_ERR_INVALID_POINTER,
        }
    }

    /// The subdevice (instance 0, the only one this fake makes) `client` holds under device
    /// `device`.
    pub(super) fn subdevice_of(&self, client: Handle, device: Handle) -> Option<Handle> {
        self.clients
            .get(&client)?
            .objects
            .iter()
            .find(|(_, o)| o.class == class::SUBDEVICE && o.parent == device)
            .map(|(h, _)| *h)
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
                if d.disable == 0 {
                    ch.disables = ch.disables.saturating_sub(1);
                } else {
                    ch.disables += 1;
                    ch.disabled_times += 1;
                }
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
    pub(super) fn apply_runlist(&mut self) {
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
        let now = Instant::now();
        for &pid in &off {
            self.stopped.entry(pid).or_insert_with(|| {
                // SAFETY: kill(2) with a pid and a signal number.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
                now
            });
        }
        for (pid, since) in self.stopped.extract_if(.., |pid, _| !off.contains(pid)) {
            // SAFETY: as above.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
            *self.held.entry(pid).or_default() += now.saturating_duration_since(since);
        }
    }
}

/// The `gpuId` of this fake's GPU `index`: the driver's `NVGPU_GET_ID` of a GPU in PCI domain 0,
/// bus `index + 1`, device 0 (`domain << 16 | bus << 8 | device`).
fn gpu_id(index: u32) -> u32 {
    (index + 1) << 8
}

/// Writes a control's out-parameters `out` back to the caller: `NV_OK`, or
/// `NV_ERR_INVALID_POINTER` where its memory cannot be written.
fn answer<T: crate::rm::Plain>(c: Caller, p: &rm::Nvos54, out: &T) -> u32 {
    match remote_write(c.tid, p.params, bytes_of(out)) {
        Ok(()) => status::NV_OK,
        Err(_) => status::NV_ERR_INVALID_POINTER,
    }
}
