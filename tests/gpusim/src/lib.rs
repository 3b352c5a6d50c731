//! A simulated GPU that fails like the H100, in virtual time: the fixture compute-share
//! controllers are judged on (issue 17). Never a dependency of the daemon.
//!
//! - [`engine`]: one GPU's engine: channel groups (TSGs) with kernel FIFOs, round robin with a
//!   timeslice, context-switch cost, preemption granularity, the RM controls and which of them
//!   the firmware honors (all, none, or the H200's: disable-channels and timeslices only). Independent of how time advances (`advance_to`,
//!   `next_event_time`, `submit`, `control`).
//! - [`tenant`]: processes that feed a TSG asynchronously like CUDA (queue depth, blocking
//!   launches, synchronize): saturating, batched (the H100 matmul loop), latency-critical.
//! - [`nvml`]: NVML's sampling as the H100 reports it (per-process windows naming whoever held
//!   the engine, listing only processes that ran and read above 0; device utilization, every
//!   window), or exact for comparison.
//! - [`control`]: what a controller sees (NVML calls, tenants) and does (`cgroup.freeze`, TSG
//!   controls, wake-ups).
//! - [`sim`]: the virtual-time driver, the freezer's latencies, the ground truth.
//! - [`scenario`]: runs and their measures (shares, settling, latency percentiles).
//! - [`old`]: the daemon's current controller driven on the simulator.
//! - [`bench`]: the benchmark matrix of `cargo xtask bench compute`.
//!
//! Parameters and what each is calibrated on: docs/design.md, "The simulated GPU".

pub mod bench;
pub mod control;
pub mod engine;
pub mod law;
pub mod nvml;
pub mod old;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod tenant;

/// Virtual time and durations, in nanoseconds.
pub type Nanos = u64;

pub const US: Nanos = 1_000;
pub const MS: Nanos = 1_000_000;
pub const SEC: Nanos = 1_000_000_000;

pub use control::{Controller, Ctx, NoControl, TenantId, TenantInfo};
pub use engine::{Engine, EngineParams, Firmware, Honored, Preemption, RmStatus};
pub use nvml::{NvmlParams, ProcessSampling};
pub use scenario::{Outcome, Scenario};
pub use sim::{FreezerParams, Sim, SimParams};
pub use tenant::{HostParams, TenantSpec, Workload};
