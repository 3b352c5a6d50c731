//! The log's subscriber of the notice bus: one line per notice ([`Notice::log`]), but a tenant
//! looping on a guarded control is logged once per (cgroup, control) every [`GUARD_LOG_EVERY`],
//! the lines skipped counted in the next.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tokio::sync::broadcast::{self, error::RecvError};
use tracing::warn;

use super::{GuardNotice, GuardedControl, Notice};

/// At most one guard line per (cgroup, control) in this long.
pub const GUARD_LOG_EVERY: Duration = Duration::from_secs(10);

/// Slots of the guard's limiter kept before the stale ones are dropped.
const GUARD_SLOTS: usize = 4096;

/// Logs every notice until the bus closes.
pub(super) async fn log_notices(mut rx: broadcast::Receiver<Notice>) {
    let mut guard = GuardLimiter::default();
    loop {
        match rx.recv().await {
            Ok(n) => log(&n, &mut guard, Instant::now()),
            Err(RecvError::Lagged(missed)) => warn!(missed, "notices not logged (log too slow)"),
            Err(RecvError::Closed) => return,
        }
    }
}

fn log(notice: &Notice, guard: &mut GuardLimiter, now: Instant) {
    let skipped = match notice {
        Notice::SchedulerControlGuarded(n) => match guard.admit(n, now) {
            Some(skipped) => skipped,
            None => return,
        },
        _ => 0,
    };
    notice.log(skipped);
}

/// Per (cgroup, control): when a line was last logged, and the lines skipped since.
#[derive(Default)]
struct GuardLimiter(HashMap<(String, GuardedControl), (Instant, u64)>);

impl GuardLimiter {
    /// `Some(lines skipped before)` if this report gets a line.
    fn admit(&mut self, n: &GuardNotice, now: Instant) -> Option<u64> {
        if self.0.len() >= GUARD_SLOTS {
            // Removed cgroups' slots go with the rest that are past their quiet time.
            self.0
                .retain(|_, (at, _)| now.duration_since(*at) < GUARD_LOG_EVERY);
        }
        match self.0.get_mut(&(n.cgroup.clone(), n.control)) {
            Some((at, skipped)) if now.duration_since(*at) < GUARD_LOG_EVERY => {
                *skipped += 1;
                None
            }
            Some(slot) => Some(std::mem::replace(slot, (now, 0)).1),
            None => {
                self.0.insert((n.cgroup.clone(), n.control), (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::events::{GuardAction, GuardReason};

    #[test]
    fn a_looping_tenant_gets_one_guard_line_per_interval_with_the_skipped_count() {
        let n = GuardNotice {
            cgroup: "/t".into(),
            pid: 1,
            control: GuardedControl(gpud_common::rm::tsg::SET_TIMESLICE),
            action: GuardAction::Clamped,
            reason: GuardReason::Timeslice,
            requested: 1_000_000,
            allowed: 128,
            client: 0xc1d0_0001,
        };
        let mut g = GuardLimiter::default();
        let t0 = Instant::now();
        assert_eq!(g.admit(&n, t0), Some(0));
        for i in 1..=5 {
            assert_eq!(g.admit(&n, t0 + Duration::from_millis(i)), None);
        }
        let other = GuardNotice {
            control: GuardedControl(gpud_common::rm::sched::DISABLE_CHANNELS),
            ..n.clone()
        };
        assert_eq!(
            g.admit(&other, t0),
            Some(0),
            "another control has its own slot"
        );
        assert_eq!(g.admit(&n, t0 + GUARD_LOG_EVERY), Some(5));
        assert_eq!(g.admit(&n, t0 + GUARD_LOG_EVERY), None);
    }
}
