//! The H100 observations the simulated GPU must reproduce with its default (H100) parameters
//! (docs/real-gpu.md, "Compute shares"; docs/design.md, "The simulated GPU"), and the old
//! controller's misses on it (issue 17, "reproduce first").

use std::collections::BTreeMap;

use gpud::policy::{Limits, Priority};
use gpusim::{
    Controller, Ctx, Firmware, MS, Nanos, NoControl, ProcessSampling, SEC, Scenario, Sim,
    SimParams, TenantId, TenantSpec, US, Workload,
    nvml::{NvmlError, ProcessUtilizationSample},
    old::OldController,
};

/// One tenant `a` with workload `w`, no policy, the default (H100) parameters.
fn alone(w: Workload) -> Sim {
    let specs = vec![TenantSpec::new("a", 101, w, Limits::default())];
    Sim::new(SimParams::default(), specs)
}

fn saturating(kernel: Nanos, depth: usize) -> Workload {
    Workload::Saturating { kernel, depth }
}

fn two(w: Workload) -> Vec<TenantSpec> {
    vec![
        TenantSpec::new("a", 101, w.clone(), Limits::default()),
        TenantSpec::new("b", 102, w, Limits::default()),
    ]
}

/// Reads NVML as the daemon's sampler does (new samples since the last seen) and keeps them.
#[derive(Default)]
struct Recorder {
    last_seen: Option<u64>,
    samples: Vec<ProcessUtilizationSample>,
    device: Vec<u32>,
    empty_reads: usize,
    reads: usize,
}

impl Controller for Recorder {
    fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
        let nvml = ctx.nvml();
        self.reads += 1;
        match nvml.process_utilization_stats(0, self.last_seen) {
            Ok(s) => {
                self.last_seen = s.iter().map(|s| s.timestamp).max();
                self.samples.extend(s);
            }
            Err(NvmlError::NotFound) => self.empty_reads += 1,
            Err(e) => panic!("{e}"),
        }
        self.device.push(nvml.utilization_rate(0).expect("GPU 0"));
    }
}

#[test]
fn two_saturating_tenants_read_0_or_99_about_every_sixth_of_a_second() {
    // NVML listing the processes that read 0 (both ran in every window), to see the 0s.
    let mut p = SimParams::default();
    p.nvml.omit_zero = false;
    let mut sim = Sim::new(p, two(saturating(200 * US, 1024)));
    let mut rec = Recorder::default();
    sim.run(&mut rec, 20 * SEC);
    // One window every 1/6 s, each listing both (both ran), at one timestamp.
    let mut windows: BTreeMap<u64, Vec<(u32, u32)>> = BTreeMap::new();
    for s in &rec.samples {
        windows
            .entry(s.timestamp)
            .or_default()
            .push((s.pid, s.sm_util));
    }
    assert!((119..=121).contains(&windows.len()), "{}", windows.len());
    let stamps: Vec<u64> = windows.keys().copied().collect();
    assert!(
        stamps
            .windows(2)
            .all(|w| (166_666..=166_667).contains(&(w[1] - w[0])))
    );
    let mut holder = BTreeMap::<u32, usize>::new();
    for list in windows.values() {
        assert_eq!(list.len(), 2, "both listed: {list:?}");
        // Whoever held the engine at the instant reads the device's 98–99; the other 0.
        let mut values: Vec<u32> = list.iter().map(|&(_, u)| u).collect();
        values.sort_unstable();
        assert_eq!(values[0], 0, "{list:?}");
        assert!((97..=99).contains(&values[1]), "{list:?}");
        let (pid, _) = list.iter().find(|&&(_, u)| u > 0).expect("a holder");
        *holder.entry(*pid).or_default() += 1;
    }
    // Each holds about half the samples: the per-process readings carry no share, only noise.
    for n in holder.values() {
        assert!((40..=80).contains(n), "{holder:?}");
    }
    // The daemon's 100 ms reads find nothing new about 40 % of the time.
    let empty = rec.empty_reads as f64 / rec.reads as f64;
    assert!((0.3..0.5).contains(&empty), "{empty}");
    // Device-level utilization: ~98 % (1,024 µs slices, 20 µs switches).
    assert!(rec.device[5..].iter().all(|&u| (97..=99).contains(&u)));
}

#[test]
fn nvml_leaves_out_zero_samples_and_lists_every_device_window() {
    // As real NVML (H200, 2026-11-27): per-process samples name only the processes above 0,
    // device windows come every window, 0 when idle. b stops at 5 s, a at 8.05 s.
    let specs = vec![
        TenantSpec::new("a", 101, saturating(200 * US, 1024), Limits::default())
            .stopping(8 * SEC + 50 * MS),
        TenantSpec::new("b", 102, saturating(200 * US, 1024), Limits::default()).stopping(5 * SEC),
    ];
    struct Both {
        rec: Recorder,
        last_device: Option<u64>,
        device: Vec<(u64, u32)>,
    }
    impl Controller for Both {
        fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
            self.rec.on_sample(ctx);
            if let Ok(d) = ctx.nvml().utilization_samples(0, self.last_device) {
                self.last_device = d.iter().map(|s| s.timestamp).max();
                self.device.extend(d.iter().map(|s| (s.timestamp, s.value)));
            }
        }
    }
    let mut sim = Sim::new(SimParams::default(), specs);
    let mut c = Both {
        rec: Recorder::default(),
        last_device: None,
        device: Vec::new(),
    };
    sim.run(&mut c, 10 * SEC);
    let mut windows: BTreeMap<u64, Vec<(u32, u32)>> = BTreeMap::new();
    for s in &c.rec.samples {
        windows
            .entry(s.timestamp)
            .or_default()
            .push((s.pid, s.sm_util));
    }
    // Every window with work lists one process, the holder, reading 97–99 (alone: 100, capped);
    // none after a stopped (nothing ran), the last one a's last 50 ms (30 %).
    assert!(windows.values().all(|l| l.len() == 1), "{windows:?}");
    assert!(
        windows
            .range(..=8_000_000)
            .all(|(_, l)| (97..=99).contains(&l[0].1)),
        "{windows:?}"
    );
    let (&last, l) = windows.last_key_value().expect("windows");
    assert_eq!(last, 8_166_666, "{windows:?}");
    assert!((29..=31).contains(&l[0].1), "{l:?}");
    // The device's windows: every one, each once, 0 after both stopped.
    assert!(c.device.len() >= 58, "{:?}", c.device);
    assert!(
        c.device
            .windows(2)
            .all(|w| (166_666..=166_667).contains(&(w[1].0 - w[0].0))),
        "{:?}",
        c.device
    );
    let idle: Vec<u32> = c
        .device
        .iter()
        .filter(|(t, _)| *t > 8_166_667)
        .map(|(_, v)| *v)
        .collect();
    assert!(idle.len() >= 9 && idle.iter().all(|&v| v == 0), "{idle:?}");
}

#[test]
fn exact_sampling_gives_each_tenant_its_true_share() {
    let mut p = SimParams::default();
    p.nvml.sampling = ProcessSampling::Exact;
    // Timeslices 3:1 make the true shares unequal.
    struct Slices(Recorder);
    impl Controller for Slices {
        fn start(&mut self, ctx: &mut Ctx<'_>) {
            ctx.wake_at(MS);
        }
        fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
            ctx.set_timeslice(TenantId(0), 3_000);
            ctx.set_timeslice(TenantId(1), 1_000);
        }
        fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
            self.0.on_sample(ctx);
        }
    }
    let mut sim = Sim::new(p, two(saturating(50 * US, 1024)));
    let mut rec = Slices(Recorder::default());
    sim.run(&mut rec, 10 * SEC);
    let truth = |i| sim.busy(i) as f64 / (10 * SEC) as f64 * 100.0;
    let mean = |pid| {
        let v: Vec<f64> = rec.0.samples[6..]
            .iter()
            .filter(|s| s.pid == pid)
            .map(|s| f64::from(s.sm_util))
            .collect();
        v.iter().sum::<f64>() / v.len() as f64
    };
    assert!((truth(0) - 73.4).abs() < 1.0, "{}", truth(0));
    assert!(
        (mean(101) - truth(0)).abs() < 1.0,
        "{} vs {}",
        mean(101),
        truth(0)
    );
    assert!(
        (mean(102) - truth(1)).abs() < 1.0,
        "{} vs {}",
        mean(102),
        truth(1)
    );
}

/// Freezes one tenant at `at`.
struct FreezeAt(Nanos, TenantId);

impl Controller for FreezeAt {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.wake_at(self.0);
    }
    fn on_sample(&mut self, _ctx: &mut Ctx<'_>) {}
    fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
        ctx.freeze(self.1, true);
    }
}

#[test]
fn a_frozen_tenants_queued_work_keeps_running() {
    // Alone: 1,024 × 2 ms queued drains for ~2 s after the freeze.
    let mut sim = alone(saturating(2 * MS, 1024));
    let mut ctrl = FreezeAt(5 * SEC, TenantId(0));
    sim.run(&mut ctrl, 5 * SEC + MS);
    let at_freeze = sim.busy(0);
    sim.run(&mut ctrl, 8 * SEC);
    let drained = sim.busy(0) - at_freeze;
    // 1,024 kernels of 2 ms ± 5 % (one of them begun).
    assert!(
        (2_030 * MS..=2_060 * MS).contains(&drained),
        "{}",
        drained / MS
    );
    sim.run(&mut ctrl, 9 * SEC);
    assert_eq!(sim.busy(0) - at_freeze, drained, "nothing after the queue");
    assert_eq!(sim.tenants()[0].spec.name, "a");
    // Beside a neighbour it takes twice as long: the GPU still time-slices the frozen one.
    let mut sim = Sim::new(SimParams::default(), two(saturating(2 * MS, 1024)));
    let mut ctrl = FreezeAt(5 * SEC, TenantId(0));
    sim.run(&mut ctrl, 5 * SEC);
    let at_freeze = sim.busy(0);
    sim.run(&mut ctrl, 8 * SEC);
    let share = (sim.busy(0) - at_freeze) as f64 / (3 * SEC) as f64;
    assert!((share - 0.49).abs() < 0.01, "{share}");
}

#[test]
fn each_control_stops_queued_work_only_where_the_firmware_honors_it() {
    // GPFIFO_SCHEDULE off then PREEMPT (the law's runlist lever), or FIFO_DISABLE_CHANNELS (its
    // channels lever), on a tenant with 1,024 × 2 ms queued, frozen as well (no new work).
    struct HwFreeze(bool);
    impl Controller for HwFreeze {
        fn start(&mut self, ctx: &mut Ctx<'_>) {
            ctx.wake_at(SEC);
        }
        fn on_sample(&mut self, _ctx: &mut Ctx<'_>) {}
        fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
            if self.0 {
                assert_eq!(
                    ctx.disable_channels(TenantId(0), true),
                    gpusim::RmStatus::Ok
                );
            } else {
                assert_eq!(ctx.schedule(TenantId(0), false), gpusim::RmStatus::Ok);
                assert_eq!(ctx.preempt(TenantId(0)), gpusim::RmStatus::Ok);
            }
            ctx.freeze(TenantId(0), true);
        }
    }
    // The H200 (2026-11-27): the runlist lever accepted and ignored, the channels stopping it.
    for (fw, channels, stopped) in [
        (Firmware::Honors, false, true),
        (Firmware::Honors, true, true),
        (Firmware::H200, false, false),
        (Firmware::H200, true, true),
        (Firmware::Ignores, false, false),
        (Firmware::Ignores, true, false),
    ] {
        let mut p = SimParams::default();
        p.engine.firmware = fw;
        let mut sim = Sim::new(p, two(saturating(2 * MS, 1024)));
        let mut c = HwFreeze(channels);
        sim.run(&mut c, SEC);
        let at_issue = sim.busy(0);
        // Past either control's latency (50 µs; disable-channels 3 ms).
        sim.run(&mut c, SEC + 5 * MS);
        let at = sim.busy(0);
        sim.run(&mut c, 2 * SEC);
        let after = sim.busy(0) - at;
        if stopped {
            assert_eq!(after, 0, "{fw:?} channels {channels}");
            // It ran on for the latency at most (beside a neighbour: part of it).
            let latency = if channels { 3 * MS } else { 50 * US };
            assert!(at - at_issue <= latency, "{fw:?}: {}", at - at_issue);
        } else {
            assert!(after > 400 * MS, "{fw:?}: {}", after / MS);
        }
    }
}

#[test]
fn timeslices_of_the_priority_classes_starve_the_short_one_as_on_the_h200() {
    // The H200 (2026-11-27): a tenant at 128 µs against a neighbour at 16,384 µs fell to 0.5 %.
    // Two deep queues here: 128 / (128 + 16,384 + two switches) ≈ 0.8 %.
    struct Slices;
    impl Controller for Slices {
        fn start(&mut self, ctx: &mut Ctx<'_>) {
            ctx.wake_at(MS);
        }
        fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
            ctx.set_timeslice(TenantId(0), 128);
            ctx.set_timeslice(TenantId(1), 16_384);
        }
        fn on_sample(&mut self, _ctx: &mut Ctx<'_>) {}
    }
    for fw in [Firmware::Honors, Firmware::H200] {
        let mut p = SimParams::default();
        p.engine.firmware = fw;
        let o =
            Scenario::new("slices", p, two(saturating(50 * US, 1024)), 10 * SEC).run(&mut Slices);
        let a = o.share("a", SEC, 10 * SEC);
        assert!((0.5..1.0).contains(&a), "{fw:?}: {a}");
    }
}

#[test]
fn the_freezer_stops_new_work_after_its_latencies() {
    // Depth 1: nothing queued ahead, so the freezer's own latencies show.
    struct Cycle;
    impl Controller for Cycle {
        fn start(&mut self, ctx: &mut Ctx<'_>) {
            ctx.wake_at(SEC);
            ctx.wake_at(2 * SEC);
        }
        fn on_sample(&mut self, _ctx: &mut Ctx<'_>) {}
        fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
            ctx.freeze(TenantId(0), ctx.now() == SEC);
        }
    }
    let mut sim = alone(saturating(100 * US, 1));
    sim.run(&mut Cycle, SEC);
    let b0 = sim.busy(0);
    sim.run(&mut Cycle, 2 * SEC);
    // Runs on for the 0.3 ms freeze latency (plus the kernel in flight).
    let ran = sim.busy(0) - b0;
    assert!((300 * US..=420 * US).contains(&ran), "{}", ran / US);
    sim.run(&mut Cycle, 2 * SEC + 290 * US);
    assert_eq!(sim.busy(0) - b0, ran, "still frozen before the 0.3 ms thaw");
    sim.run(&mut Cycle, 2 * SEC + 10 * MS);
    assert!(sim.busy(0) - b0 > ran + 9 * MS);
}

#[test]
fn latency_critical_requests_wait_behind_a_saturating_neighbour() {
    let lc = TenantSpec::new(
        "lc",
        101,
        Workload::LatencyCritical {
            kernel: 300 * US,
            kernels_per_request: 10,
            load: 0.3,
        },
        Limits {
            priority: Some(Priority::LatencyCritical),
            ..Limits::default()
        },
    );
    let be = TenantSpec::new(
        "be",
        102,
        saturating(2 * MS, 1024),
        Limits {
            priority: Some(Priority::BestEffort),
            ..Limits::default()
        },
    );
    let s = Scenario::new("lc-be", SimParams::default(), vec![lc, be], 20 * SEC);
    let solo = s.solo("lc").run(&mut NoControl);
    let both = s.run(&mut NoControl);
    let (l1, l2) = (
        solo.latency("lc", SEC, 19 * SEC).expect("requests"),
        both.latency("lc", SEC, 19 * SEC).expect("requests"),
    );
    // Solo: 3 ms of kernels plus launches; the same arrivals in both runs.
    assert!((3_000 * US..3_600 * US).contains(&l1.p50), "{l1:?}");
    assert_eq!(l1.count, l2.count);
    // Time-sliced against a deep queue: each request takes about twice as long.
    assert!(l2.p99 as f64 > 1.8 * l1.p99 as f64, "{l1:?} {l2:?}");
    assert!((both.share("lc", SEC, 20 * SEC) - 30.0).abs() < 3.0);
    // Without control the best-effort tenant takes all the rest.
    assert!(both.idle_share("be", "lc", SEC, 20 * SEC) > 95.0);
}

#[test]
fn runs_are_deterministic() {
    let s = Scenario::new(
        "det",
        SimParams::default(),
        two(Workload::Batched {
            kernel: 200 * US,
            batch: 10,
            depth: 1024,
        }),
        5 * SEC,
    );
    let a = s.run(&mut OldController::new(100 * MS));
    let b = s.run(&mut OldController::new(100 * MS));
    assert_eq!(a, b);
}

fn h100(policy: (Limits, Limits), w: Workload) -> (f64, f64) {
    let mut specs = vec![
        TenantSpec::new("a", 101, w.clone(), policy.0),
        TenantSpec::new("b", 102, w, policy.1),
    ];
    for t in &mut specs {
        t.host.launch = 15 * US;
        t.host.sync_return = 20 * US;
    }
    let s = Scenario::new("h100", SimParams::default(), specs, 40 * SEC);
    let o = s.run(&mut OldController::new(100 * MS));
    (
        o.share("a", 5 * SEC, 40 * SEC),
        o.share("b", 5 * SEC, 40 * SEC),
    )
}

fn caps(a: u32, b: u32) -> (Limits, Limits) {
    let l = |m| Limits {
        compute_max: Some(m),
        ..Limits::default()
    };
    (l(a), l(b))
}

fn weights(a: u32, b: u32) -> (Limits, Limits) {
    let l = |w| Limits {
        compute_weight: Some(w),
        ..Limits::default()
    };
    (l(a), l(b))
}

const MATMUL: Workload = Workload::Batched {
    kernel: 200 * US,
    batch: 10,
    depth: 1024,
};

#[test]
fn the_old_controller_misses_like_on_the_h100() {
    // Weights 1:3 stay 50:50: time-sliced, each reads ~50 and looks satisfied.
    for w in [MATMUL, saturating(200 * US, 1024)] {
        let (a, b) = h100(weights(1, 3), w);
        assert!((a - b).abs() < 1.0 && a > 45.0, "{a} {b}");
    }
    // Caps 30/70: the tenant capped at 70 falls well short of it (on the H100: 63 %).
    for w in [MATMUL, saturating(200 * US, 1024)] {
        let (a, b) = h100(caps(30, 70), w);
        assert!(b < 67.0 && a > 27.0, "{a} {b}");
    }
}

#[test]
fn with_exact_samples_and_short_queues_the_old_controller_meets_a_cap() {
    // What CI's CPU-burner simulated GPU showed: the control law holds when the measurement is
    // exact and the queue short. The H100 misses come from the hardware's behaviour.
    let mut p = SimParams::default();
    p.nvml.sampling = ProcessSampling::Exact;
    let l = caps(30, 70);
    let specs = vec![
        TenantSpec::new("a", 101, MATMUL, l.0),
        TenantSpec::new("b", 102, MATMUL, l.1),
    ];
    let o = Scenario::new("exact", p, specs, 40 * SEC).run(&mut OldController::new(100 * MS));
    let a = o.share("a", 5 * SEC, 40 * SEC);
    assert!((a - 30.0).abs() < 1.5, "{a}");
}

#[test]
fn a_tenant_that_exits_leaves_with_its_queue() {
    struct Watch(Vec<usize>);
    impl Controller for Watch {
        fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
            let n = ctx
                .nvml()
                .running_compute_processes(0)
                .expect("GPU 0")
                .len();
            self.0.push(n);
        }
    }
    let specs = vec![
        TenantSpec::new("a", 101, saturating(2 * MS, 1024), Limits::default()),
        TenantSpec::new("b", 102, saturating(2 * MS, 1024), Limits::default()).stopping(SEC),
    ];
    let mut sim = Sim::new(SimParams::default(), specs);
    let mut w = Watch(Vec::new());
    sim.run(&mut w, SEC);
    let (a_at_exit, b_at_exit) = (sim.busy(0), sim.busy(1));
    sim.run(&mut w, 3 * SEC);
    // Its channel group is freed with the ~2 s of work it had queued: the GPU is a's at once.
    assert_eq!(sim.busy(1), b_at_exit);
    let a = sim.busy(0) - a_at_exit;
    assert!(a > 2 * SEC - 5 * MS, "{}", a / MS);
    assert_eq!(w.0.first(), Some(&2));
    assert_eq!(w.0.last(), Some(&1));
}

#[test]
fn each_gpu_has_its_own_engine_and_samples() {
    let p = SimParams {
        gpus: 2,
        ..SimParams::default()
    };
    let mut b = TenantSpec::new("b", 102, saturating(2 * MS, 64), Limits::default());
    b.gpu = 1;
    let specs = vec![
        TenantSpec::new("a", 101, saturating(2 * MS, 64), Limits::default()),
        b,
    ];
    struct PerGpu(Vec<Vec<u32>>);
    impl Controller for PerGpu {
        fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
            let nvml = ctx.nvml();
            for g in 0..2 {
                let pids = nvml.running_compute_processes(g).expect("GPU");
                self.0[g as usize] = pids.iter().map(|p| p.pid).collect();
            }
        }
    }
    let mut sim = Sim::new(p, specs);
    let mut c = PerGpu(vec![Vec::new(); 2]);
    sim.run(&mut c, 2 * SEC);
    assert_eq!(c.0, vec![vec![101], vec![102]]);
    for i in 0..2 {
        assert!(sim.busy(i) > 1_990 * MS, "{}", sim.busy(i) / MS);
    }
}
