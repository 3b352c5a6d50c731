/// `NVOS54.flags` bit 15 of `cmd`: the GSS-legacy path, forwarded to the GPU's firmware with
/// no size, privilege or client check (`rmapi_gss_legacy_control.c`).
pub const LEGACY_BIT: u32 = 0x8000;
/// The timeslice (µs) libcuda sets on its compute channel group at context creation (580,
/// H100: docs/real-gpu.md): refusing it fails `cuCtxCreate`, so no ceiling is below it
/// where the call can only be refused.
pub const CUDA_TIMESLICE_US: u64 = 2048;

/// `NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL` (NICE): the group's share of runlist slots.
pub const TSG_SET_INTERLEAVE_LEVEL: u32 = 0xa06c_0107;
/// `NVA06C_CTRL_CMD_MAKE_REALTIME` (NICE): jumps the runlist.
pub const TSG_MAKE_REALTIME: u32 = 0xa06c_0110;
/// `NVA06F_CTRL_CMD_GPFIFO_SCHEDULE`: a channel on or off the runlist.
pub const CHANNEL_GPFIFO_SCHEDULE: u32 = 0xa06f_0103;
/// `NVA06F_CTRL_CMD_SET_INTERLEAVE_LEVEL` (NICE).
pub const CHANNEL_SET_INTERLEAVE_LEVEL: u32 = 0xa06f_0109;
/// `NVA06F_CTRL_CMD_RESTART_RUNLIST` (NICE): preempts whoever runs.
pub const CHANNEL_RESTART_RUNLIST: u32 = 0xa06f_0111;
/// `NV0090_CTRL_CMD_SET_TPC_PARTITION_MODE` (on a group's graphics context).
pub const CTX_SET_TPC_PARTITION_MODE: u32 = 0x0090_0101;
/// `NV0080_CTRL_CMD_FIFO_SET_CHANNEL_PROPERTIES`: can set or disable a channel's timeslice.
pub const DEVICE_SET_CHANNEL_PROPERTIES: u32 = 0x0080_170f;
/// `NV0080_CTRL_CMD_FIFO_STOP_RUNLIST` (privileged): stops an engine's whole runlist.
pub const DEVICE_STOP_RUNLIST: u32 = 0x0080_1711;
/// `NV0080_CTRL_CMD_FIFO_START_RUNLIST` (privileged).
pub const DEVICE_START_RUNLIST: u32 = 0x0080_1712;
/// `NV2080_CTRL_CMD_SET_GPFIFO`: reprograms a channel.
pub const SUBDEVICE_SET_GPFIFO: u32 = 0x2080_1102;
/// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS`: lists of (client, channel) handles, any client's.
pub const DISABLE_CHANNELS: u32 = 0x2080_110b;
/// `NV2080_CTRL_CMD_FIFO_CONFIG_CTXSW_TIMEOUT` (privileged; 595 only).
pub const CONFIG_CTXSW_TIMEOUT: u32 = 0x2080_1110;
/// `NV2080_CTRL_CMD_FIFO_RUNLIST_SET_SCHED_POLICY` (NICE): runlist-wide policy.
pub const RUNLIST_SET_SCHED_POLICY: u32 = 0x2080_1115;
/// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS_FOR_KEY_ROTATION`: other clients' channels.
pub const DISABLE_CHANNELS_FOR_KEY_ROTATION: u32 = 0x2080_111a;
/// `NV2080_CTRL_CMD_FIFO_ROTATE_KEYS` (595): other clients' channels.
pub const ROTATE_KEYS: u32 = 0x2080_111c;
/// `NV2080_CTRL_CMD_FIFO_OBJSCHED_SET_STATE`: the vGPU scheduler's state.
pub const OBJSCHED_SET_STATE: u32 = 0x2080_1121;
/// `NV2080_CTRL_CMD_GPU_SET_COMPUTE_POLICY_CONFIG` (privileged): the device-wide timeslice.
pub const SET_COMPUTE_POLICY_CONFIG: u32 = 0x2080_0194;
/// `NV2080_CTRL_CMD_GR_CTXSW_PREEMPTION_BIND`: carries another client's handle.
pub const GR_CTXSW_PREEMPTION_BIND: u32 = 0x2080_1211;
/// `NV2080_CTRL_CMD_GR_SET_TPC_PARTITION_MODE`.
pub const GR_SET_TPC_PARTITION_MODE: u32 = 0x2080_122c;

/// What the guard does with a control from a tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `SET_TIMESLICE`: a value above the caller's allowance is lowered to it (refused only
    /// where nothing can be rewritten): CUDA itself sets one at context creation.
    Timeslice,
    /// `FIFO_DISABLE_CHANNELS`: refused when its list names a client of another process.
    DisableChannels,
    /// A channel group's `GPFIFO_SCHEDULE`: CUDA enables its groups with it at context
    /// creation, so it passes, but for an enable of a group gpud holds off the runlist.
    Schedule,
    /// Never a tenant's: refused (with `EPERM`, or turned into a call the driver rejects).
    Refuse,
    /// Scheduling controls that act on the caller's own work only and that CUDA issues:
    /// let through (listed so the table is the whole set, and reported nowhere).
    Pass,
}

/// One row of [`CONTROLS`].
#[derive(Clone, Copy, Debug)]
pub struct Control {
    /// The command number (`class << 16 | category << 8 | index`).
    pub cmd: u32,
    /// The driver's name, without its `NVxxxx_CTRL_CMD_` prefix.
    pub name: &'static str,
    /// The parameter struct's size (the driver's export row).
    pub size: u32,
    /// What the guard does with it.
    pub rule: Rule,
}

const fn c(cmd: u32, name: &'static str, size: u32, rule: Rule) -> Control {
    Control {
        cmd,
        name,
        size,
        rule,
    }
}

/// Every guarded control, with its rule. [`rule_of`] is the kernel side's copy of the same
/// decision (a `match` the compiler turns into comparisons); a test keeps both in step.
pub const CONTROLS: [Control; 25] = [
    c(
        super::tsg::SET_TIMESLICE,
        "SET_TIMESLICE",
        8,
        Rule::Timeslice,
    ),
    c(
        DISABLE_CHANNELS,
        "FIFO_DISABLE_CHANNELS",
        536,
        Rule::DisableChannels,
    ),
    c(
        TSG_SET_INTERLEAVE_LEVEL,
        "TSG_SET_INTERLEAVE_LEVEL",
        4,
        Rule::Refuse,
    ),
    c(TSG_MAKE_REALTIME, "MAKE_REALTIME", 1, Rule::Refuse),
    c(
        CHANNEL_SET_INTERLEAVE_LEVEL,
        "CHANNEL_SET_INTERLEAVE_LEVEL",
        4,
        Rule::Refuse,
    ),
    c(CHANNEL_RESTART_RUNLIST, "RESTART_RUNLIST", 2, Rule::Refuse),
    c(
        CTX_SET_TPC_PARTITION_MODE,
        "SET_TPC_PARTITION_MODE",
        8,
        Rule::Refuse,
    ),
    c(
        DEVICE_SET_CHANNEL_PROPERTIES,
        "FIFO_SET_CHANNEL_PROPERTIES",
        16,
        Rule::Refuse,
    ),
    c(DEVICE_STOP_RUNLIST, "FIFO_STOP_RUNLIST", 4, Rule::Refuse),
    c(DEVICE_START_RUNLIST, "FIFO_START_RUNLIST", 4, Rule::Refuse),
    c(SUBDEVICE_SET_GPFIFO, "SET_GPFIFO", 24, Rule::Refuse),
    c(
        CONFIG_CTXSW_TIMEOUT,
        "FIFO_CONFIG_CTXSW_TIMEOUT",
        8,
        Rule::Refuse,
    ),
    c(
        RUNLIST_SET_SCHED_POLICY,
        "FIFO_RUNLIST_SET_SCHED_POLICY",
        8,
        Rule::Refuse,
    ),
    c(
        DISABLE_CHANNELS_FOR_KEY_ROTATION,
        "FIFO_DISABLE_CHANNELS_FOR_KEY_ROTATION",
        520,
        Rule::Refuse,
    ),
    c(ROTATE_KEYS, "FIFO_ROTATE_KEYS", 520, Rule::Refuse),
    c(
        OBJSCHED_SET_STATE,
        "FIFO_OBJSCHED_SET_STATE",
        24,
        Rule::Refuse,
    ),
    c(
        SET_COMPUTE_POLICY_CONFIG,
        "GPU_SET_COMPUTE_POLICY_CONFIG",
        8,
        Rule::Refuse,
    ),
    c(
        GR_CTXSW_PREEMPTION_BIND,
        "GR_CTXSW_PREEMPTION_BIND",
        112,
        Rule::Refuse,
    ),
    c(
        GR_SET_TPC_PARTITION_MODE,
        "GR_SET_TPC_PARTITION_MODE",
        32,
        Rule::Refuse,
    ),
    c(
        super::tsg::GPFIFO_SCHEDULE,
        "TSG_GPFIFO_SCHEDULE",
        3,
        Rule::Schedule,
    ),
    c(super::tsg::GET_TIMESLICE, "GET_TIMESLICE", 8, Rule::Pass),
    c(super::tsg::PREEMPT, "PREEMPT", 8, Rule::Pass),
    c(
        CHANNEL_GPFIFO_SCHEDULE,
        "CHANNEL_GPFIFO_SCHEDULE",
        3,
        Rule::Pass,
    ),
    c(0x906f_0102, "RESET_CHANNEL", 16, Rule::Pass),
    c(0x2080_1210, "GR_SET_CTXSW_PREEMPTION_MODE", 32, Rule::Pass),
];

/// The rule for `cmd` (exact match, whatever the class of the object it is sent to: the
/// driver resolves a command on any object that exports it). A command with
/// [`LEGACY_BIT`] set whose class and category are scheduling ones is refused: that path
/// skips every check the driver makes.
#[inline(always)]
pub const fn rule_of(cmd: u32) -> Option<Rule> {
    match plain_rule(cmd) {
        Some(r) => Some(r),
        None if cmd & LEGACY_BIT != 0
            && (legacy_scheduling(cmd) || plain_rule(cmd & !LEGACY_BIT).is_some()) =>
        {
            Some(Rule::Refuse)
        }
        None => None,
    }
}

/// [`rule_of`] without the legacy aliases.
#[inline(always)]
const fn plain_rule(cmd: u32) -> Option<Rule> {
    match cmd {
        super::tsg::SET_TIMESLICE => Some(Rule::Timeslice),
        DISABLE_CHANNELS => Some(Rule::DisableChannels),
        super::tsg::GPFIFO_SCHEDULE => Some(Rule::Schedule),
        TSG_SET_INTERLEAVE_LEVEL
        | TSG_MAKE_REALTIME
        | CHANNEL_SET_INTERLEAVE_LEVEL
        | CHANNEL_RESTART_RUNLIST
        | CTX_SET_TPC_PARTITION_MODE
        | DEVICE_SET_CHANNEL_PROPERTIES
        | DEVICE_STOP_RUNLIST
        | DEVICE_START_RUNLIST
        | SUBDEVICE_SET_GPFIFO
        | CONFIG_CTXSW_TIMEOUT
        | RUNLIST_SET_SCHED_POLICY
        | DISABLE_CHANNELS_FOR_KEY_ROTATION
        | ROTATE_KEYS
        | OBJSCHED_SET_STATE
        | SET_COMPUTE_POLICY_CONFIG
        | GR_CTXSW_PREEMPTION_BIND
        | GR_SET_TPC_PARTITION_MODE => Some(Rule::Refuse),
        _ => None,
    }
}

/// Whether a legacy-path command addresses scheduling: a channel, channel group or context
/// class, or the FIFO and GR categories of a device or subdevice (no legacy category of
/// those exists, so nothing legitimate is lost).
#[inline(always)]
pub const fn legacy_scheduling(cmd: u32) -> bool {
    let (class, category) = (cmd >> 16, (cmd >> 8) & 0x3f);
    matches!(class, 0xa06c | 0xa06f | 0x906f | 0x506f | 0x0090 | 0x9067)
        || (class == 0x2080 && matches!(category, 0x11 | 0x12))
        || (class == 0x0080 && matches!(category, 0x11 | 0x17))
}

/// The row of `cmd` in [`CONTROLS`] (a legacy alias by the command it aliases).
pub fn control(cmd: u32) -> Option<&'static Control> {
    let plain = cmd & !LEGACY_BIT;
    CONTROLS.iter().find(|c| c.cmd == cmd || c.cmd == plain)
}

/// `NV2080_CTRL_FIFO_DISABLE_CHANNELS_PARAMS` (536 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DisableChannelsParams {
    /// Disable (1) or enable (0) the listed channels.
    pub disable: u8,
    /// Padding to the `NvU32`.
    pub _pad0: [u8; 3],
    /// Entries used in both lists (at most [`DISABLE_CHANNELS_MAX`]).
    pub num_channels: u32,
    /// Only take the channels off the schedule (no preemption).
    pub only_disable_scheduling: u8,
    /// Rewind the channels' GP_PUT.
    pub rewind_gp_put: u8,
    /// Padding to the `NvP64`.
    pub _pad1: [u8; 6],
    /// `NvP64`: an event to signal on runlist preemption (kernel callers only).
    pub runlist_preempt_event: u64,
    /// The client of each channel: any client's, unchecked by the driver.
    pub client_list: [u32; DISABLE_CHANNELS_MAX],
    /// The channels, each a handle in the client at the same index.
    pub channel_list: [u32; DISABLE_CHANNELS_MAX],
}

/// Capacity of the disable-channels lists.
pub const DISABLE_CHANNELS_MAX: usize = 64;

impl Default for DisableChannelsParams {
    fn default() -> Self {
        Self {
            disable: 0,
            _pad0: [0; 3],
            num_channels: 0,
            only_disable_scheduling: 0,
            rewind_gp_put: 0,
            _pad1: [0; 6],
            runlist_preempt_event: 0,
            client_list: [0; DISABLE_CHANNELS_MAX],
            channel_list: [0; DISABLE_CHANNELS_MAX],
        }
    }
}

/// Offset of `num_channels` (ctrl2080fifo.h, measured: 4).
pub const DISABLE_NUM_CHANNELS: usize = core::mem::offset_of!(DisableChannelsParams, num_channels);
/// Offset of `client_list` (measured: 24).
pub const DISABLE_CLIENT_LIST: usize = core::mem::offset_of!(DisableChannelsParams, client_list);
/// Offset of `channel_list` (measured: 280).
pub const DISABLE_CHANNEL_LIST: usize = core::mem::offset_of!(DisableChannelsParams, channel_list);
const _: () = assert!(size_of::<DisableChannelsParams>() == 536);
const _: () = assert!(DISABLE_NUM_CHANNELS == 4 && DISABLE_CLIENT_LIST == 24);
const _: () = assert!(core::mem::offset_of!(DisableChannelsParams, channel_list) == 280);

/// `NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS` / `NVA06F_…` (4 bytes): LOW 0, MEDIUM 1, HIGH 2.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterleaveParams {
    /// The interleave level.
    pub level: u32,
}

/// `NVA06C_CTRL_MAKE_REALTIME_PARAMS` (1 byte).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RealtimeParams {
    /// Realtime (1) or not (0).
    pub realtime: u8,
}

/// Offset of `NVOS54.cmd`, which the guard rewrites for a legacy-path command.
pub const NVOS54_CMD: usize = core::mem::offset_of!(super::Nvos54, cmd);
/// Offset of `NVOS54.paramsSize`, which the guard sets to 0 to have the driver reject a call.
pub const NVOS54_PARAMS_SIZE: usize = core::mem::offset_of!(super::Nvos54, params_size);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_and_the_kernel_side_agree() {
        for c in CONTROLS {
            let want = if c.rule == Rule::Pass {
                None
            } else {
                Some(c.rule)
            };
            assert_eq!(rule_of(c.cmd), want, "{}", c.name);
            // A legacy alias of a refused, clamped or passed scheduling control is refused.
            assert_eq!(
                rule_of(c.cmd | LEGACY_BIT),
                Some(Rule::Refuse),
                "{} alias",
                c.name
            );
        }
        // Ordinary controls pass: memory info, the GPU's info, the client's.
        for cmd in [
            0x2080_1303,
            0x2080_0101,
            0x0000_0201,
            0x0080_0101,
            0x2080_9303,
        ] {
            assert_eq!(rule_of(cmd), None, "{cmd:#x}");
        }
    }
}
