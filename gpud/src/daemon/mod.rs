//! The daemon's core: one task owns all mutable state (attribution with the probes' maps, memory
//! enforcement with the limit store, the NVML view, the idle report); the ring-buffer reader, the
//! NVML sampler thread, the `/proc` scans and the timers reach it only as messages, and the API
//! only through a [`Handle`]. [`spawn`] wires it all up and hands back a [`Running`] daemon.
//!
//! The modules, each importing only those listed before it (no circle):
//! - `messages`: the state task's inbox and the answers' types;
//! - `core`: the kernel stack opened from a configuration, and the routing of kernel events (the
//!   one rig the VM test and the benchmarks use too);
//! - `joins`: joins of the state computed on demand (attribution × NVML, the controller's input);
//! - `state`: what the state task owns;
//! - `view`: the published [`View`] of the state that readers get without queuing behind its
//!   work;
//! - `handle`: the typed requests the API may make;
//! - `ring`, `removals`: the event ring buffer's reader, the watch on limited cgroups' removal;
//! - `task`: the state task's loop and its handlers;
//! - `start`: start-up (the core opened, the tasks started) and orderly stop.

pub mod core;
mod handle;
mod joins;
mod messages;
mod removals;
mod ring;
mod start;
mod state;
mod task;
mod view;

pub use core::{DaemonInfo, StartError};
pub use handle::{Figures, Handle};
pub use joins::NvmlUsage;
pub use messages::{ComputeStats, DaemonError, NvmlStatus};
pub use start::{Running, spawn};
pub use view::View;
