//! What gpud-hwcontrols (tests/gpu/hw-controls.sh) makes of a tenant's progress counter: rates in
//! fixed bins, and per control how fast the tenant stopped, how far, and how fast it came back.

use serde::Serialize;

/// One reading of both processes' progress counters, `at` seconds after the start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub at: f64,
    pub counts: [u64; 2],
}

/// Progress per second of each process in bins of `width` seconds from 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Bins {
    pub width: f64,
    pub rates: Vec<[f64; 2]>,
}

impl Bins {
    /// Each bin's rate from the counts read last before its two edges (bins before the first
    /// reading, or after the last, are left out).
    pub fn new(samples: &[Sample], width: f64) -> Self {
        let mut rates = Vec::new();
        let Some(last) = samples.last() else {
            return Self { width, rates };
        };
        let count_at = |t: f64| -> Option<[u64; 2]> {
            let i = samples.partition_point(|s| s.at <= t);
            (i > 0).then(|| samples[i - 1].counts)
        };
        let n = (last.at / width).floor() as usize;
        for b in 0..n {
            let (t0, t1) = (b as f64 * width, (b + 1) as f64 * width);
            let rate = match (count_at(t0), count_at(t1)) {
                (Some(a), Some(z)) => [0, 1].map(|k| z[k].saturating_sub(a[k]) as f64 / width),
                _ => [f64::NAN; 2],
            };
            rates.push(rate);
        }
        Self { width, rates }
    }

    /// Mean rate of process `k` over the bins wholly inside `[from, to)`.
    pub fn mean(&self, k: usize, from: f64, to: f64) -> Option<f64> {
        let v: Vec<f64> = self
            .range(from, to)
            .map(|(_, r)| r[k])
            .filter(|r| r.is_finite())
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// (start time, rates) of the bins wholly inside `[from, to)`.
    fn range(&self, from: f64, to: f64) -> impl Iterator<Item = (f64, [f64; 2])> + '_ {
        let w = self.width;
        self.rates
            .iter()
            .enumerate()
            .map(move |(i, r)| (i as f64 * w, *r))
            .filter(move |(t, _)| *t >= from - 1e-9 && *t + w <= to + 1e-9)
    }
}

/// When one control was applied and undone (seconds from the start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    /// The reference rate's span.
    pub before: (f64, f64),
    /// From the first control issued to the last one's return.
    pub apply: (f64, f64),
    /// When the undo was issued.
    pub undo: f64,
    /// End of the watch after the undo.
    pub end: f64,
}

/// What one stopping control did to a process.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hold {
    /// Progress per second before.
    pub before: Option<f64>,
    /// From the control's issue until the rate fell below 5 % of `before` and stayed there for
    /// [`STAY_BINS`] bins (ms); `None`: it never did while held.
    pub stop_ms: Option<f64>,
    /// Mean rate while held, after the first 200 ms, in percent of `before`.
    pub held_pct: Option<f64>,
    /// From the undo until a bin reached half of `before` (ms).
    pub back_ms: Option<f64>,
    /// Mean rate in the last second of the watch, in percent of `before`.
    pub after_pct: Option<f64>,
    /// How long issuing the control took (ms).
    pub issue_ms: f64,
}

/// Bins a stopped process must stay below the threshold.
pub const STAY_BINS: usize = 5;

pub fn summarize_hold(bins: &Bins, k: usize, w: &Window) -> Hold {
    let before = bins.mean(k, w.before.0, w.before.1);
    let pct = |x: Option<f64>| -> Option<f64> {
        let (x, b) = (x?, before?);
        (b > 0.0).then(|| (x / b * 1000.0).round() / 10.0)
    };
    let held: Vec<(f64, [f64; 2])> = bins.range(w.apply.0, w.undo).collect();
    let stop_ms = before.and_then(|b| {
        let low = |r: &[f64; 2]| r[k].is_finite() && r[k] < 0.05 * b;
        (0..held.len())
            .find(|&i| {
                held[i..].len() >= STAY_BINS.min(held.len() - i)
                    && held[i..].iter().take(STAY_BINS).all(|(_, r)| low(r))
            })
            .map(|i| ((held[i].0 + bins.width - w.apply.0) * 1000.0).round())
    });
    let back_ms = before.and_then(|b| {
        bins.range(w.undo, w.end)
            .find(|(_, r)| r[k] >= 0.5 * b)
            .map(|(t, _)| ((t + bins.width - w.undo) * 1000.0).round())
    });
    Hold {
        before: before.map(|b| b.round()),
        stop_ms,
        held_pct: pct(bins.mean(k, w.apply.0 + 0.2, w.undo)),
        back_ms,
        after_pct: pct(bins.mean(k, w.end - 1.0, w.end)),
        issue_ms: ((w.apply.1 - w.apply.0) * 1e4).round() / 10.0,
    }
}

/// The two processes' shares of their summed progress, before and with other timeslices.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Split {
    /// Rates (progress per second) of the tenant and the neighbour, before.
    pub before: [Option<f64>; 2],
    pub during: [Option<f64>; 2],
    /// The tenant's share of the two's progress (percent), before and during.
    pub tenant_share_before: Option<f64>,
    pub tenant_share_during: Option<f64>,
}

pub fn summarize_split(bins: &Bins, before: (f64, f64), during: (f64, f64)) -> Split {
    let rates = |(a, b): (f64, f64)| [0, 1].map(|k| bins.mean(k, a, b).map(f64::round));
    let share = |r: [Option<f64>; 2]| {
        let (a, b) = (r[0]?, r[1]?);
        (a + b > 0.0).then(|| (a / (a + b) * 1000.0).round() / 10.0)
    };
    let (b, d) = (rates(before), rates(during));
    Split {
        before: b,
        during: d,
        tenant_share_before: share(b),
        tenant_share_during: share(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tenant running at 500/s, stopped from 1.05 s to 3.0 s (the control at 1.0 s), the
    /// neighbour steady at 100/s; read every ms.
    fn run() -> Vec<Sample> {
        let (mut a, mut b) = (0.0f64, 0.0f64);
        (0..5000)
            .map(|i| {
                let at = i as f64 / 1000.0;
                if !(1.05..3.0).contains(&at) {
                    a += 0.5;
                }
                b += 0.1;
                Sample {
                    at,
                    counts: [a as u64, b as u64],
                }
            })
            .collect()
    }

    #[test]
    fn a_stop_and_its_return_are_timed_from_the_progress() {
        let bins = Bins::new(&run(), 0.01);
        let h = summarize_hold(
            &bins,
            0,
            &Window {
                before: (0.0, 1.0),
                apply: (1.0, 1.001),
                undo: 3.0,
                end: 4.99,
            },
        );
        assert_eq!(h.before, Some(500.0));
        assert_eq!(h.stop_ms, Some(60.0), "{h:?}");
        assert_eq!(h.held_pct, Some(0.0));
        assert_eq!(h.back_ms, Some(10.0));
        assert!((h.after_pct.unwrap() - 100.0).abs() < 1.5, "{h:?}");
        assert_eq!(h.issue_ms, 1.0);
        // A process that never stopped.
        let n = summarize_hold(
            &bins,
            1,
            &Window {
                before: (0.0, 1.0),
                apply: (1.0, 1.0),
                undo: 3.0,
                end: 4.99,
            },
        );
        assert_eq!(n.stop_ms, None);
        assert!((n.held_pct.unwrap() - 100.0).abs() < 2.0, "{n:?}");
    }

    #[test]
    fn the_split_is_each_ones_share_of_the_progress() {
        let bins = Bins::new(&run(), 0.01);
        let s = summarize_split(&bins, (0.0, 1.0), (3.5, 4.9));
        assert_eq!(s.tenant_share_before, Some(83.3));
        assert_eq!(s.before, [Some(500.0), Some(100.0)]);
    }

    #[test]
    fn no_readings_no_rates() {
        let bins = Bins::new(&[], 0.01);
        assert!(bins.rates.is_empty());
        assert_eq!(bins.mean(0, 0.0, 1.0), None);
    }
}
