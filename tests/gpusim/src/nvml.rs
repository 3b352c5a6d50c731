//! NVML's utilization sampling of one GPU, as the driver reports it: per-process samples (only
//! processes that ran, and by default only those reading above 0) and device-level utilization
//! (every window, 0 included), one window every `sample_period`, kept in a buffer that callers
//! read with a last-seen timestamp (the shape of `nvmlDeviceGetProcessUtilization` and
//! `nvmlDeviceGetSamples`, as nvml-wrapper exposes them).
//!
//! This module owns the sample buffers and how a window's engine time becomes a sample
//! ([`ProcessSampling`]): the part that makes controllers fail or not on a time-sliced GPU.

use std::collections::VecDeque;

use crate::{
    Nanos,
    engine::{Engine, TsgId},
};

/// How a window's per-process samples are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessSampling {
    /// As the H100 reports it on a time-sliced engine: only processes that ran in the window are
    /// listed; the one that last held the engine at the sample instant reads the window's device
    /// utilization (capped at 99), the others 0 (left out where [`NvmlParams::omit_zero`]). Two
    /// saturating processes read 0 or 98–99 (the docs/real-gpu.md observation), while a process
    /// alone reads its real utilization.
    Holder,
    /// As [`ProcessSampling::Holder`], but the holder reads 99 whatever the window's
    /// utilization, and nobody holds an idle engine (all listed read 0): the other reading of
    /// "whoever held the engine", kept to compare.
    HolderFlat,
    /// Each process that ran reads its exact share of the window (what the CPU-burner simulated
    /// GPU's fake NVML gives): for comparison, not a real GPU.
    Exact,
}

/// Parameters of the sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct NvmlParams {
    pub sampling: ProcessSampling,
    /// Length of one sample window (H100: about 1/6 s).
    pub sample_period: Nanos,
    /// Windows the buffers keep.
    pub kept: usize,
    /// Per-process samples leave out a process whose value is 0 (real NVML does: on the H200
    /// the per-process samples omitted processes at 0, while the device-level windows list 0
    /// when idle). Device-level samples are listed every window whatever this says.
    pub omit_zero: bool,
}

impl Default for NvmlParams {
    fn default() -> Self {
        Self {
            sampling: ProcessSampling::Holder,
            sample_period: 166_666_667,
            kept: 100,
            omit_zero: true,
        }
    }
}

/// nvmlProcessUtilizationSample_t (utilizations in percent, timestamp in µs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessUtilizationSample {
    pub pid: u32,
    pub timestamp: u64,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
}

/// One device-level sample (nvmlSample_t of NVML_GPU_UTILIZATION_SAMPLES): percent of the window
/// in which a kernel was executing, timestamp in µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UtilizationSample {
    pub timestamp: u64,
    pub value: u32,
}

/// Errors of the simulated NVML calls (the subset of NVML's return codes they can give).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NvmlError {
    /// NVML_ERROR_NOT_FOUND: no sample newer than the last-seen timestamp.
    #[error("NVML: not found (no sample newer than the last seen)")]
    NotFound,
    /// NVML_ERROR_INVALID_ARGUMENT: no such GPU.
    #[error("NVML: invalid argument (no such GPU)")]
    InvalidArgument,
}

/// One GPU's sampler.
#[derive(Clone, Debug)]
pub struct NvmlModel {
    params: NvmlParams,
    last_tick: Nanos,
    next_tick: Nanos,
    /// Per TSG: its busy time at the last tick.
    last_busy: Vec<Nanos>,
    last_device_busy: Nanos,
    samples: VecDeque<Vec<ProcessUtilizationSample>>,
    device: VecDeque<UtilizationSample>,
}

impl NvmlModel {
    /// A sampler whose first window ends at `first_tick`.
    pub fn new(params: NvmlParams, first_tick: Nanos) -> Self {
        Self {
            params,
            last_tick: 0,
            next_tick: first_tick.max(1),
            last_busy: Vec::new(),
            last_device_busy: 0,
            samples: VecDeque::new(),
            device: VecDeque::new(),
        }
    }

    pub fn params(&self) -> &NvmlParams {
        &self.params
    }

    /// When the current window closes.
    pub fn next_tick(&self) -> Nanos {
        self.next_tick
    }

    /// Closes the window at the engine's time (the driver calls it at [`NvmlModel::next_tick`],
    /// with the engine advanced to it).
    pub fn tick(&mut self, engine: &Engine) {
        let now = engine.now();
        let window = now.saturating_sub(self.last_tick).max(1) as f64;
        let timestamp = now / 1_000;
        let device_busy = engine.device_busy() - self.last_device_busy;
        let device_pct = (device_busy as f64 * 100.0 / window).round().min(100.0) as u32;
        let ran: Vec<(TsgId, Nanos)> = engine
            .tsgs()
            .map(|t| {
                let before = self.last_busy.get(t.0).copied().unwrap_or(0);
                (t, engine.busy(t) - before)
            })
            .filter(|&(_, b)| b > 0)
            .collect();
        let holder = engine.last_ran();
        let list = ran
            .iter()
            .map(|&(t, busy)| ProcessUtilizationSample {
                pid: engine.owner(t),
                timestamp,
                sm_util: match self.params.sampling {
                    ProcessSampling::Holder if Some(t) == holder => device_pct.min(99),
                    ProcessSampling::Holder => 0,
                    ProcessSampling::HolderFlat if Some(t) == engine.running() => 99,
                    ProcessSampling::HolderFlat => 0,
                    ProcessSampling::Exact => {
                        (busy as f64 * 100.0 / window).round().min(100.0) as u32
                    }
                },
                ..ProcessUtilizationSample::default()
            })
            .filter(|s| s.sm_util > 0 || !self.params.omit_zero)
            .collect();
        self.samples.push_back(list);
        self.device.push_back(UtilizationSample {
            timestamp,
            value: device_pct,
        });
        while self.samples.len() > self.params.kept {
            self.samples.pop_front();
            self.device.pop_front();
        }
        self.last_busy = engine.tsgs().map(|t| engine.busy(t)).collect();
        self.last_device_busy = engine.device_busy();
        self.last_tick = now;
        self.next_tick = now + self.params.sample_period;
    }

    /// `nvmlDeviceGetProcessUtilization`: the buffered samples newer than `last_seen` (µs; `None`
    /// or 0: all of them).
    pub fn process_utilization_stats(
        &self,
        last_seen: Option<u64>,
    ) -> Result<Vec<ProcessUtilizationSample>, NvmlError> {
        newer_than(self.samples.iter().flatten(), last_seen, |s| s.timestamp)
    }

    /// `nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES)`: device-level samples newer than
    /// `last_seen` (µs).
    pub fn utilization_samples(
        &self,
        last_seen: Option<u64>,
    ) -> Result<Vec<UtilizationSample>, NvmlError> {
        newer_than(self.device.iter(), last_seen, |s| s.timestamp)
    }

    /// `nvmlDeviceGetUtilizationRates().gpu`: the last closed window's device utilization.
    pub fn utilization_rate(&self) -> u32 {
        self.device.back().map_or(0, |s| s.value)
    }
}

/// The samples stamped after `last_seen` (µs; `None` or 0: all), as NVML answers a sample query:
/// `NotFound` when there is none.
fn newer_than<'a, T: Copy + 'a>(
    samples: impl Iterator<Item = &'a T>,
    last_seen: Option<u64>,
    timestamp: impl Fn(&T) -> u64,
) -> Result<Vec<T>, NvmlError> {
    let since = last_seen.unwrap_or(0);
    let out: Vec<T> = samples.filter(|s| timestamp(s) > since).copied().collect();
    if out.is_empty() {
        Err(NvmlError::NotFound)
    } else {
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MS;

    /// Two saturating TSGs, one window; the samples as `omit_zero` lists them.
    fn one_window(omit_zero: bool) -> (Vec<ProcessUtilizationSample>, Vec<UtilizationSample>) {
        let mut e = Engine::new(crate::EngineParams::default());
        let (a, b) = (e.add_tsg(1), e.add_tsg(2));
        for _ in 0..200 {
            e.submit(a, MS, 0);
            e.submit(b, MS, 0);
        }
        let p = NvmlParams {
            omit_zero,
            ..NvmlParams::default()
        };
        let mut n = NvmlModel::new(p.clone(), p.sample_period);
        e.advance_to(p.sample_period);
        n.tick(&e);
        // Then an idle window: both stopped.
        e.remove_tsg(a);
        e.remove_tsg(b);
        e.advance_to(2 * p.sample_period);
        n.tick(&e);
        (
            n.process_utilization_stats(None).unwrap_or_default(),
            n.utilization_samples(None).expect("device windows"),
        )
    }

    #[test]
    fn per_process_zeros_are_left_out_and_device_windows_always_listed() {
        let (procs, device) = one_window(true);
        // Only the holder, reading the device's 98–99.
        assert_eq!(procs.len(), 1, "{procs:?}");
        assert!((97..=99).contains(&procs[0].sm_util), "{procs:?}");
        // Both windows listed at the device level, the idle one as 0.
        assert_eq!(device.len(), 2, "{device:?}");
        assert!(device[0].value >= 97 && device[1].value == 0, "{device:?}");
        let (procs, device) = one_window(false);
        let mut v: Vec<u32> = procs.iter().map(|s| s.sm_util).collect();
        v.sort_unstable();
        assert_eq!(v.len(), 2, "{procs:?}");
        assert_eq!(v[0], 0);
        assert_eq!(device.len(), 2);
    }
}
