/// `NVA06C_CTRL_CMD_GPFIFO_SCHEDULE`: the group on (or off) the runlist;
/// [`ScheduleParams`].
pub const GPFIFO_SCHEDULE: u32 = 0xa06c_0101;
/// `NVA06C_CTRL_CMD_SET_TIMESLICE`: [`TimesliceParams`]; takes effect at once.
pub const SET_TIMESLICE: u32 = 0xa06c_0103;
/// `NVA06C_CTRL_CMD_GET_TIMESLICE`: the value last set (not what the hardware uses).
pub const GET_TIMESLICE: u32 = 0xa06c_0104;
/// `NVA06C_CTRL_CMD_PREEMPT`: takes the group off the engine now; [`PreemptParams`].
pub const PREEMPT: u32 = 0xa06c_0105;

/// `NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS` (3 `NvBool`s).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScheduleParams {
    /// On the runlist (1) or off it (0).
    pub enable: u8,
    /// Skip submitting the runlist update.
    pub skip_submit: u8,
    /// Skip enabling the channels.
    pub skip_enable: u8,
}

/// `NVA06C_CTRL_TIMESLICE_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimesliceParams {
    /// Microseconds; rounded down to what the hardware holds.
    pub timeslice_us: u64,
}

/// `NVA06C_CTRL_PREEMPT_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PreemptParams {
    /// Wait until the preemption completes.
    pub wait: u8,
    /// Use `timeout_us` instead of RM's timeout.
    pub manual_timeout: u8,
    /// Padding to the `NvU32`.
    pub _pad: [u8; 2],
    /// At most 1 s.
    pub timeout_us: u32,
}

const _: () = assert!(size_of::<ScheduleParams>() == 3);
const _: () = assert!(size_of::<TimesliceParams>() == 8);
const _: () = assert!(size_of::<PreemptParams>() == 8);
