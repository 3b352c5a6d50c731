//! One GPU's compute engine: channel groups (TSGs, one per tenant process), each with a FIFO of
//! kernels, scheduled round robin with a timeslice, and the RM controls on a TSG (set-timeslice,
//! schedule enable/disable, preempt, disable-channels) with their latencies and whether the
//! firmware honors each.
//!
//! The engine owns its time (`now`), the TSGs' queues and their exact busy time. It does not know
//! how time advances: a driver calls [`Engine::next_event_time`] and [`Engine::advance_to`] (the
//! virtual-time [`crate::sim::Sim`] now; a real-time driver can do the same against a clock), and
//! submits kernels and controls at the engine's current time.

use std::collections::VecDeque;

use crate::Nanos;
pub use params::{EngineParams, Firmware, Honored, Preemption};

mod params;

/// A channel group on one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TsgId(pub usize);

/// What RM returns for a control (the simulated calls never fail for a live TSG).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmStatus {
    /// NV_OK.
    Ok,
    /// NV_ERR_INVALID_OBJECT_HANDLE: the TSG is gone.
    InvalidObjectHandle,
}

/// A TSG control, as RM takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// NVA06C_CTRL_CMD_SET_TIMESLICE (µs).
    SetTimeslice(u64),
    /// NVA06C_CTRL_CMD_GPFIFO_SCHEDULE: on the runlist or off it.
    Schedule(bool),
    /// NVA06C_CTRL_CMD_PREEMPT: off the engine now, still on the runlist.
    Preempt,
    /// NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS (`true`: disabled and preempted, queued work kept).
    DisableChannels(bool),
}

/// A kernel that finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub tsg: TsgId,
    /// The submitter's tag of the kernel.
    pub tag: u64,
    pub at: Nanos,
}

#[derive(Clone, Copy, Debug)]
struct Kernel {
    remaining: Nanos,
    started: bool,
    tag: u64,
}

#[derive(Clone, Debug)]
struct Tsg {
    owner: u32,
    queue: VecDeque<Kernel>,
    alive: bool,
    /// On the runlist (GPFIFO_SCHEDULE).
    scheduled: bool,
    /// Channels enabled (FIFO_DISABLE_CHANNELS).
    channels: bool,
    /// The timeslice the hardware uses.
    timeslice: Nanos,
    /// The last value set (what GET_TIMESLICE reads back).
    requested_timeslice: Nanos,
    busy: Nanos,
}

impl Tsg {
    fn runnable(&self) -> bool {
        self.alive && self.scheduled && self.channels && !self.queue.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    /// Loading `to`'s context until `until`.
    Switching {
        to: usize,
        until: Nanos,
    },
    /// `tsg` holds the engine: its head kernel progressed up to `since`; its slice began at
    /// `slice_start`. `leave`: go at the next kernel boundary (kernel-boundary preemption).
    Running {
        tsg: usize,
        since: Nanos,
        slice_start: Nanos,
        leave: bool,
    },
}

/// One GPU's compute engine.
#[derive(Clone, Debug)]
pub struct Engine {
    params: EngineParams,
    now: Nanos,
    tsgs: Vec<Tsg>,
    phase: Phase,
    /// Whose context is loaded (no switch cost to resume it).
    loaded: Option<usize>,
    /// The TSG that last made kernel progress.
    last_ran: Option<usize>,
    device_busy: Nanos,
    /// Controls on their way to the engine: (effective at, TSG, control), by effective time,
    /// then in issue order.
    controls: VecDeque<(Nanos, usize, Control)>,
    completions: Vec<Completion>,
}

impl Engine {
    pub fn new(params: EngineParams) -> Self {
        Self {
            params,
            now: 0,
            tsgs: Vec::new(),
            phase: Phase::Idle,
            loaded: None,
            last_ran: None,
            device_busy: 0,
            controls: VecDeque::new(),
            completions: Vec::new(),
        }
    }

    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    /// From a control's return to its effect.
    pub fn latency(&self, control: Control) -> Nanos {
        match control {
            Control::DisableChannels(_) => self.params.disable_channels_latency,
            _ => self.params.control_latency,
        }
    }

    pub fn now(&self) -> Nanos {
        self.now
    }

    /// A new channel group of process `owner` (at the default timeslice, on the runlist).
    pub fn add_tsg(&mut self, owner: u32) -> TsgId {
        let ts = self.params.timeslice;
        self.tsgs.push(Tsg {
            owner,
            queue: VecDeque::new(),
            alive: true,
            scheduled: true,
            channels: true,
            timeslice: ts,
            requested_timeslice: ts,
            busy: 0,
        });
        TsgId(self.tsgs.len() - 1)
    }

    /// The TSG is freed (its process exited): queued work is dropped.
    pub fn remove_tsg(&mut self, tsg: TsgId) {
        let t = &mut self.tsgs[tsg.0];
        t.alive = false;
        t.queue.clear();
        self.settle();
    }

    pub fn owner(&self, tsg: TsgId) -> u32 {
        self.tsgs[tsg.0].owner
    }

    pub fn tsgs(&self) -> impl Iterator<Item = TsgId> + '_ {
        (0..self.tsgs.len()).map(TsgId)
    }

    pub fn is_alive(&self, tsg: TsgId) -> bool {
        self.tsgs[tsg.0].alive
    }

    /// Kernels queued and not finished (the running one included).
    pub fn pending(&self, tsg: TsgId) -> usize {
        self.tsgs[tsg.0].queue.len()
    }

    /// Engine time spent running this TSG's kernels, up to `now`.
    pub fn busy(&self, tsg: TsgId) -> Nanos {
        self.tsgs[tsg.0].busy
    }

    /// Engine time in which some kernel ran, up to `now`.
    pub fn device_busy(&self) -> Nanos {
        self.device_busy
    }

    /// The TSG that last made progress (holds the engine, or held it last).
    pub fn last_ran(&self) -> Option<TsgId> {
        self.last_ran.map(TsgId)
    }

    /// The TSG running a kernel now, if any.
    pub fn running(&self) -> Option<TsgId> {
        match self.phase {
            Phase::Running { tsg, .. } => Some(TsgId(tsg)),
            _ => None,
        }
    }

    /// The timeslice the hardware uses for this TSG.
    pub fn timeslice(&self, tsg: TsgId) -> Nanos {
        self.tsgs[tsg.0].timeslice
    }

    /// What GET_TIMESLICE returns: the value last set, not what the hardware uses.
    pub fn requested_timeslice(&self, tsg: TsgId) -> Nanos {
        self.tsgs[tsg.0].requested_timeslice
    }

    /// Queues a kernel of `duration` on `tsg` at the engine's current time (a doorbell write: no
    /// control can hold it back).
    pub fn submit(&mut self, tsg: TsgId, duration: Nanos, tag: u64) {
        let t = &mut self.tsgs[tsg.0];
        if !t.alive {
            return;
        }
        t.queue.push_back(Kernel {
            remaining: duration.max(1),
            started: false,
            tag,
        });
        self.settle();
    }

    /// Issues an RM control at the engine's current time: returns what RM returns at once; the
    /// effect (if the firmware honors that control) comes its latency later ([`Engine::latency`];
    /// controls take effect in the order of their effect times, those due at one instant in
    /// issue order).
    pub fn control(&mut self, tsg: TsgId, control: Control) -> RmStatus {
        let Some(t) = self.tsgs.get_mut(tsg.0).filter(|t| t.alive) else {
            return RmStatus::InvalidObjectHandle;
        };
        if let Control::SetTimeslice(us) = control {
            t.requested_timeslice = us.saturating_mul(1_000);
        }
        if self.params.firmware.honors(control) {
            let at = self.now + self.latency(control);
            let i = self.controls.partition_point(|c| c.0 <= at);
            self.controls.insert(i, (at, tsg.0, control));
        }
        RmStatus::Ok
    }

    /// The timeslice the hardware makes of a request of `us` µs: the register holds an 8-bit
    /// count scaled by a power of two (RM "rounds down to a valid hardware value"), and nothing
    /// below `min_timeslice`.
    pub fn hardware_timeslice(&self, us: u64) -> Nanos {
        let mut scale = 0;
        while us >> scale > 0xff {
            scale += 1;
        }
        (((us >> scale) << scale) * 1_000).max(self.params.min_timeslice)
    }

    /// The time of the engine's next own event (a kernel finishing, a slice ending while another
    /// TSG waits, a context loaded, a control taking effect); `None` if nothing will happen
    /// without a submission or control.
    pub fn next_event_time(&self) -> Option<Nanos> {
        let control = self.controls.front().map(|c| c.0);
        let phase = match self.phase {
            Phase::Idle => None,
            Phase::Switching { until, .. } => Some(until),
            Phase::Running {
                tsg, since, leave, ..
            } => {
                let head = self.tsgs[tsg].queue.front().map(|k| since + k.remaining);
                let slice = (!leave && self.other_runnable(tsg)).then(|| self.slice_end(tsg));
                min_opt(head, slice.map(|s| s.max(self.now)))
            }
        };
        min_opt(control, phase)
    }

    /// Runs the engine up to `t` (not before `now`); completions are collected for
    /// [`Engine::take_completions`].
    pub fn advance_to(&mut self, t: Nanos) {
        while let Some(e) = self.next_event_time().filter(|&e| e <= t) {
            self.progress_to(e);
            self.handle_due();
        }
        self.progress_to(t.max(self.now));
    }

    /// Kernels finished since the last call, in order.
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completions)
    }

    fn slice_end(&self, tsg: usize) -> Nanos {
        match self.phase {
            Phase::Running { slice_start, .. } => slice_start + self.tsgs[tsg].timeslice,
            _ => Nanos::MAX,
        }
    }

    fn other_runnable(&self, tsg: usize) -> bool {
        self.tsgs
            .iter()
            .enumerate()
            .any(|(i, t)| i != tsg && t.runnable())
    }

    /// Moves the clock to `t`, the running kernel progressing.
    fn progress_to(&mut self, t: Nanos) {
        if let Phase::Running { tsg, since, .. } = &mut self.phase {
            let dt = t.saturating_sub(*since);
            if dt > 0 {
                let q = &mut self.tsgs[*tsg];
                if let Some(k) = q.queue.front_mut() {
                    debug_assert!(dt <= k.remaining, "advanced past a kernel's end");
                    k.remaining -= dt;
                    k.started = true;
                    q.busy += dt;
                    self.device_busy += dt;
                    self.last_ran = Some(*tsg);
                }
                *since = t;
            }
        }
        self.now = self.now.max(t);
    }

    /// Handles what is due at `now`.
    fn handle_due(&mut self) {
        while self.controls.front().is_some_and(|c| c.0 <= self.now) {
            let (_, tsg, c) = self.controls.pop_front().expect("front checked");
            self.apply(tsg, c);
        }
        if let Phase::Running { tsg, .. } = self.phase {
            let q = &mut self.tsgs[tsg];
            if q.queue.front().is_some_and(|k| k.remaining == 0) {
                let k = q.queue.pop_front().expect("front checked");
                self.completions.push(Completion {
                    tsg: TsgId(tsg),
                    tag: k.tag,
                    at: self.now,
                });
                if let Phase::Running { leave: true, .. } = self.phase {
                    self.switch_from(tsg);
                }
            }
        }
        self.settle();
    }

    fn apply(&mut self, tsg: usize, c: Control) {
        if !self.tsgs[tsg].alive {
            return;
        }
        match c {
            Control::SetTimeslice(us) => {
                self.tsgs[tsg].timeslice = self.hardware_timeslice(us);
            }
            Control::Schedule(on) => {
                self.tsgs[tsg].scheduled = on;
                if !on {
                    self.preempt(tsg);
                }
            }
            Control::Preempt => self.preempt(tsg),
            Control::DisableChannels(off) => {
                self.tsgs[tsg].channels = !off;
                if off {
                    self.preempt(tsg);
                }
            }
        }
    }

    /// Takes `tsg` off the engine (at the next kernel boundary under kernel-boundary
    /// preemption); it is picked again in its turn if still runnable.
    fn preempt(&mut self, tsg: usize) {
        match self.phase {
            Phase::Running { tsg: r, .. } if r == tsg => self.leave(tsg),
            Phase::Switching { to, .. } if to == tsg => self.phase = Phase::Idle,
            _ => {}
        }
    }

    /// The running `tsg` gives up the engine: now, or at the end of a started kernel.
    fn leave(&mut self, tsg: usize) {
        let started = self.tsgs[tsg].queue.front().is_some_and(|k| k.started);
        if self.params.preemption == Preemption::KernelBoundary && started {
            if let Phase::Running { leave, .. } = &mut self.phase {
                *leave = true;
            }
        } else {
            self.switch_from(tsg);
        }
    }

    /// Puts the next runnable TSG after `from` (round robin) on the engine, or idles.
    fn switch_from(&mut self, from: usize) {
        self.phase = Phase::Idle;
        self.pick(from + 1);
    }

    /// Makes the immediate transitions at `now`: an idle engine takes the next runnable TSG; a
    /// running one leaves if it cannot run on, or its slice is over and another waits.
    fn settle(&mut self) {
        loop {
            match self.phase {
                Phase::Idle => {
                    let start = self.loaded.map_or(0, |l| l + 1);
                    self.pick(start);
                    return;
                }
                Phase::Switching { to, until } => {
                    if !self.tsgs[to].runnable() {
                        self.phase = Phase::Idle;
                        self.pick(to + 1);
                        if self.phase == Phase::Idle {
                            return;
                        }
                        continue;
                    }
                    if until <= self.now {
                        self.loaded = Some(to);
                        self.phase = Phase::Running {
                            tsg: to,
                            since: self.now,
                            slice_start: self.now,
                            leave: false,
                        };
                        continue;
                    }
                    return;
                }
                Phase::Running { tsg, leave, .. } => {
                    let t = &self.tsgs[tsg];
                    if t.queue.is_empty() || !t.alive {
                        self.switch_from(tsg);
                        return;
                    }
                    if leave {
                        return;
                    }
                    if !t.scheduled || !t.channels {
                        self.leave(tsg);
                        return;
                    }
                    if self.slice_end(tsg) <= self.now && self.other_runnable(tsg) {
                        self.leave(tsg);
                    }
                    return;
                }
            }
        }
    }

    /// Starts the first runnable TSG at or after index `start` (cyclic): at once if its context
    /// is loaded, else after a context switch.
    fn pick(&mut self, start: usize) {
        let n = self.tsgs.len();
        let Some(next) = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| self.tsgs[i].runnable())
        else {
            self.phase = Phase::Idle;
            return;
        };
        self.phase = if self.loaded == Some(next) {
            Phase::Running {
                tsg: next,
                since: self.now,
                slice_start: self.now,
                leave: false,
            }
        } else {
            Phase::Switching {
                to: next,
                until: self.now + self.params.context_switch,
            }
        };
        if let Phase::Switching { until, .. } = self.phase
            && until <= self.now
        {
            self.settle();
        }
    }
}

fn min_opt(a: Option<Nanos>, b: Option<Nanos>) -> Option<Nanos> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MS, US};

    fn engine(f: impl FnOnce(&mut EngineParams)) -> Engine {
        let mut p = EngineParams::default();
        f(&mut p);
        Engine::new(p)
    }

    /// One TSG with 100 kernels of 2 ms queued, 10 ms into running them.
    fn queued(fw: Firmware) -> (Engine, TsgId) {
        let mut e = engine(|p| p.firmware = fw);
        let a = e.add_tsg(1);
        for _ in 0..100 {
            e.submit(a, 2 * MS, 0);
        }
        e.advance_to(10 * MS);
        (e, a)
    }

    /// Keeps `tsg` `depth` kernels deep until `until`.
    fn run_saturating(e: &mut Engine, tsgs: &[TsgId], kernel: Nanos, until: Nanos) {
        for &t in tsgs {
            while e.pending(t) < 4 {
                e.submit(t, kernel, 0);
            }
        }
        while let Some(t) = e.next_event_time().filter(|&t| t <= until) {
            e.advance_to(t);
            for c in e.take_completions() {
                e.submit(c.tsg, kernel, 0);
            }
        }
        e.advance_to(until);
    }

    #[test]
    fn a_lone_tsg_runs_its_queue_back_to_back() {
        let mut e = engine(|_| {});
        let a = e.add_tsg(1);
        for i in 0..3 {
            e.submit(a, 2 * MS, i);
        }
        e.advance_to(10 * MS);
        // The first kernel waits for the context to load; then no gaps.
        let at: Vec<Nanos> = e.take_completions().iter().map(|c| c.at).collect();
        let cs = e.params().context_switch;
        assert_eq!(at, vec![cs + 2 * MS, cs + 4 * MS, cs + 6 * MS]);
        assert_eq!(e.busy(a), 6 * MS);
        assert_eq!(e.device_busy(), 6 * MS);
        assert_eq!(e.next_event_time(), None);
    }

    #[test]
    fn two_saturating_tsgs_alternate_by_timeslice() {
        let mut e = engine(|_| {});
        let (a, b) = (e.add_tsg(1), e.add_tsg(2));
        run_saturating(&mut e, &[a, b], 200 * US, 1_000 * MS);
        let (ba, bb) = (e.busy(a) as f64, e.busy(b) as f64);
        assert!((ba / bb - 1.0).abs() < 0.01, "{ba} vs {bb}");
        // Each turn of 1,024 µs costs a 20 µs switch: ~98 % busy.
        let util = e.device_busy() as f64 / (1_000 * MS) as f64;
        assert!((util - 1024.0 / 1044.0).abs() < 0.002, "{util}");
    }

    #[test]
    fn timeslices_split_the_engine_when_honored_and_not_when_ignored() {
        // 3,000 µs is 2,992 in the register; 1,000 is exact.
        for (fw, want) in [
            (Firmware::Honors, 2.992),
            (Firmware::H200, 2.992),
            (Firmware::Ignores, 1.0),
        ] {
            let mut e = engine(|p| p.firmware = fw);
            let (a, b) = (e.add_tsg(1), e.add_tsg(2));
            assert_eq!(e.control(a, Control::SetTimeslice(3_000)), RmStatus::Ok);
            assert_eq!(e.control(b, Control::SetTimeslice(1_000)), RmStatus::Ok);
            assert_eq!(e.requested_timeslice(a), 3 * MS);
            run_saturating(&mut e, &[a, b], 50 * US, 1_000 * MS);
            let ratio = e.busy(a) as f64 / e.busy(b) as f64;
            assert!((ratio - want).abs() < 0.02, "{fw:?}: {ratio}");
        }
    }

    #[test]
    fn schedule_disable_stops_queued_work_after_the_control_latency() {
        for (fw, stops) in [
            (Firmware::Honors, true),
            (Firmware::H200, false),
            (Firmware::Ignores, false),
        ] {
            let (mut e, a) = queued(fw);
            assert_eq!(e.control(a, Control::Schedule(false)), RmStatus::Ok);
            assert_eq!(e.control(a, Control::Preempt), RmStatus::Ok);
            e.advance_to(100 * MS);
            let lat = e.params().control_latency;
            let cs = e.params().context_switch;
            if stops {
                // Instruction-level preemption: the kernel in progress stops at once.
                assert_eq!(e.busy(a), 10 * MS + lat - cs);
                e.control(a, Control::Schedule(true));
                e.advance_to(200 * MS);
                assert_eq!(e.busy(a), 10 * MS + lat - cs + 100 * MS - lat);
            } else {
                // Accepted, and the queue runs on (a preempted lone TSG is picked again).
                assert_eq!(e.busy(a), 100 * MS - cs, "{fw:?}");
            }
        }
    }

    #[test]
    fn disable_channels_stops_queued_work_after_its_own_latency() {
        for (fw, stops) in [
            (Firmware::Honors, true),
            (Firmware::H200, true),
            (Firmware::Ignores, false),
        ] {
            let (mut e, a) = queued(fw);
            assert_eq!(e.control(a, Control::DisableChannels(true)), RmStatus::Ok);
            e.advance_to(100 * MS);
            let lat = e.params().disable_channels_latency;
            assert_eq!(lat, 3 * MS);
            let cs = e.params().context_switch;
            if stops {
                assert_eq!(e.busy(a), 10 * MS + lat - cs, "{fw:?}");
                // Nothing queued is lost: it runs again after the same latency.
                let pending = e.pending(a);
                e.control(a, Control::DisableChannels(false));
                e.advance_to(100 * MS + lat - 1);
                assert_eq!(e.busy(a), 10 * MS + lat - cs);
                e.advance_to(200 * MS);
                // Its context is still loaded: no switch.
                assert_eq!(e.busy(a), 10 * MS + lat - cs + 100 * MS - lat);
                assert!(e.pending(a) <= pending);
            } else {
                assert_eq!(e.busy(a), 100 * MS - cs, "{fw:?}");
            }
        }
    }

    #[test]
    fn controls_take_effect_in_the_order_of_their_latencies() {
        // An enable issued before a schedule-disable lands after it (3 ms against 50 µs).
        let (mut e, a) = queued(Firmware::Honors);
        e.control(a, Control::DisableChannels(true));
        e.advance_to(20 * MS);
        let at = e.busy(a);
        e.control(a, Control::DisableChannels(false));
        e.control(a, Control::Schedule(false));
        e.advance_to(30 * MS);
        // Channels back on at 23 ms, but off the runlist since 20.05 ms: still stopped.
        assert_eq!(e.busy(a), at);
        e.control(a, Control::Schedule(true));
        e.advance_to(40 * MS);
        assert!(e.busy(a) > at);
    }

    #[test]
    fn kernel_boundary_preemption_finishes_the_started_kernel() {
        let mut e = engine(|p| p.preemption = Preemption::KernelBoundary);
        let a = e.add_tsg(1);
        for _ in 0..10 {
            e.submit(a, 20 * MS, 0);
        }
        e.advance_to(5 * MS);
        e.control(a, Control::DisableChannels(true));
        e.advance_to(100 * MS);
        // The first kernel (started at 20 µs) runs to its end; nothing after it.
        assert_eq!(e.busy(a), 20 * MS);
        assert_eq!(e.pending(a), 9);
        e.control(a, Control::DisableChannels(false));
        e.advance_to(200 * MS);
        assert!(e.busy(a) > 20 * MS);
    }

    #[test]
    fn random_submissions_and_controls_keep_the_books_straight() {
        for (seed, preemption) in [
            (1, Preemption::Instruction),
            (2, Preemption::KernelBoundary),
        ] {
            let mut rng = crate::rng::Rng::new(seed);
            let mut e = engine(|p| p.preemption = preemption);
            let tsgs: Vec<TsgId> = (0..4).map(|i| e.add_tsg(i)).collect();
            let mut submitted = 0;
            let mut t = 0;
            for _ in 0..20_000 {
                t += (rng.unit() * 200.0 * US as f64) as Nanos;
                e.advance_to(t);
                let tsg = tsgs[(rng.next_u64() % 4) as usize];
                let control = match rng.next_u64() % 10 {
                    0 => Some(Control::Schedule(rng.unit() < 0.7)),
                    1 => Some(Control::Preempt),
                    2 => Some(Control::DisableChannels(rng.unit() < 0.3)),
                    3 => Some(Control::SetTimeslice(rng.next_u64() % 5_000)),
                    _ => None,
                };
                match control {
                    Some(c) => assert_eq!(e.control(tsg, c), RmStatus::Ok),
                    None => {
                        let d = 1 + rng.next_u64() % (3 * MS);
                        e.submit(tsg, d, 0);
                        submitted += d;
                    }
                }
            }
            for &tsg in &tsgs {
                e.control(tsg, Control::Schedule(true));
                e.control(tsg, Control::DisableChannels(false));
            }
            let end = t + submitted + 10 * crate::SEC;
            e.advance_to(end);
            let busy: Nanos = tsgs.iter().map(|&x| e.busy(x)).sum();
            assert_eq!(busy, e.device_busy());
            // Everything submitted ran, exactly once.
            assert_eq!(busy, submitted, "{preemption:?}");
            assert!(tsgs.iter().all(|&x| e.pending(x) == 0));
            assert_eq!(e.next_event_time(), None);
        }
    }

    #[test]
    fn a_preempted_tsg_waits_its_turn() {
        let mut e = engine(|_| {});
        let (a, b) = (e.add_tsg(1), e.add_tsg(2));
        for _ in 0..10 {
            e.submit(a, 10 * MS, 0);
            e.submit(b, 10 * MS, 0);
        }
        e.advance_to(MS / 2);
        assert_eq!(e.running(), Some(a));
        e.control(a, Control::Preempt);
        e.advance_to(MS);
        assert_eq!(e.running(), Some(b));
    }
}
