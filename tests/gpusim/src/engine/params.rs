//! The engine's parameters: which controls the firmware honors ([`Firmware`], [`Honored`]),
//! where a running TSG can be preempted, the timeslice, context-switch cost and the controls'
//! latencies (defaults: the H100 as far as it is known).

use super::Control;
use crate::Nanos;

/// Which TSG controls the firmware acts on (GSP runs the scheduler on Hopper): each one either
/// takes effect after its latency or is accepted (RM returns OK) and changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Honored {
    /// NVA06C_CTRL_CMD_SET_TIMESLICE.
    pub timeslice: bool,
    /// NVA06C_CTRL_CMD_GPFIFO_SCHEDULE.
    pub schedule: bool,
    /// NVA06C_CTRL_CMD_PREEMPT.
    pub preempt: bool,
    /// NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS.
    pub disable_channels: bool,
}

impl Honored {
    pub const ALL: Self = Self {
        timeslice: true,
        schedule: true,
        preempt: true,
        disable_channels: true,
    };
    pub const NONE: Self = Self {
        timeslice: false,
        schedule: false,
        preempt: false,
        disable_channels: false,
    };
}

/// The firmware's behaviour: which controls take effect (the benchmark's modes, by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Firmware {
    /// Timeslice, schedule enable/disable, preempt and disable-channels all take effect.
    Honors,
    /// The calls return OK and change nothing (one public report says an A100's firmware
    /// acknowledged them and changed nothing): the freezer fallback's case.
    Ignores,
    /// As measured on an H200 (2026-11-27, driver 580.159.04, tests/gpu/hw-controls.sh):
    /// `GPFIFO_SCHEDULE` off and `PREEMPT` accepted and ignored (the tenant ran on at 100 %);
    /// `FIFO_DISABLE_CHANNELS` stops queued work and `SET_TIMESLICE` takes effect.
    H200,
    /// Any other combination.
    Custom(Honored),
}

impl Firmware {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Honors => "honors",
            Self::Ignores => "ignores",
            Self::H200 => "h200",
            Self::Custom(_) => "custom",
        }
    }

    /// Which controls take effect.
    pub fn honored(self) -> Honored {
        match self {
            Self::Honors => Honored::ALL,
            Self::Ignores => Honored::NONE,
            Self::H200 => Honored {
                timeslice: true,
                schedule: false,
                preempt: false,
                disable_channels: true,
            },
            Self::Custom(h) => h,
        }
    }

    /// Whether `control` takes effect.
    pub fn honors(self, control: Control) -> bool {
        let h = self.honored();
        match control {
            Control::SetTimeslice(_) => h.timeslice,
            Control::Schedule(_) => h.schedule,
            Control::Preempt => h.preempt,
            Control::DisableChannels(_) => h.disable_channels,
        }
    }

    /// Whether some control stops a TSG's queued work (disable-channels, or schedule-disable
    /// with preempt): the firmware a controller can make shares with in hardware.
    pub fn stops_queued_work(self) -> bool {
        let h = self.honored();
        h.disable_channels || (h.schedule && h.preempt)
    }
}

/// Where a TSG running a kernel can be taken off the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preemption {
    /// Anywhere (compute instruction-level preemption, Pascal and later): progress is kept.
    Instruction,
    /// Only between kernels: a started kernel runs to completion first.
    KernelBoundary,
}

/// The engine's parameters (defaults: the H100 as far as it is known; docs/design.md, "The
/// simulated GPU").
#[derive(Clone, Debug, PartialEq)]
pub struct EngineParams {
    /// Timeslice of a new TSG (RM's default on Volta and later: 1,024 µs).
    pub timeslice: Nanos,
    /// Engine time of a switch between TSGs, in which no kernel progresses.
    pub context_switch: Nanos,
    pub preemption: Preemption,
    /// From an RM control's return to its effect on the engine (set-timeslice, schedule,
    /// preempt).
    pub control_latency: Nanos,
    /// The same for disable-channels (both ways): on the H200 a tenant's 2 ms kernels stopped
    /// 14–16 ms after the control's issue and came back 13–15 ms after the enable, measured in
    /// 10 ms bins (which add 10–20 ms to a stop at issue time: the first wholly empty bin ends
    /// that long after it), of which issuing it took ~1 ms: a few ms of its own.
    pub disable_channels_latency: Nanos,
    /// Smallest timeslice the hardware takes; smaller requests get it.
    pub min_timeslice: Nanos,
    pub firmware: Firmware,
}

impl Default for EngineParams {
    fn default() -> Self {
        Self {
            timeslice: 1_024_000,
            context_switch: 20_000,
            preemption: Preemption::Instruction,
            control_latency: 50_000,
            disable_channels_latency: 3_000_000,
            min_timeslice: 1_000,
            firmware: Firmware::Honors,
        }
    }
}
