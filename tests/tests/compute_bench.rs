//! Benchmark of compute shares on the simulated GPU, run by `cargo xtask bench` (a test target
//! that `cargo test` leaves out: `test = false` in tests/Cargo.toml): achieved vs target shares
//! over 1 s and 10 s windows, convergence after a limit change, and a plot of the 1:3 case.

use std::{
    path::{Path, PathBuf},
    process::Child,
    time::{Duration, Instant},
};

use gpud_tests::{Bus, Cgroup, TempDir, bin_dir};
use serde_json::json;

mod simulated_gpu;
use simulated_gpu::{Procs, SERIAL, burner, runtime_ns, set, shares, start};

/// Shares per `step` of each pid over `total`, in percent.
fn series(pids: &[u32], step: Duration, total: Duration) -> Vec<Vec<f64>> {
    let mut out = vec![Vec::new(); pids.len()];
    let mut prev: Vec<u64> = pids.iter().map(|p| runtime_ns(*p)).collect();
    let mut t = Instant::now();
    let end = t + total;
    while Instant::now() < end {
        std::thread::sleep(step);
        let now = Instant::now();
        let wall = (now - t).as_nanos() as f64;
        for (i, p) in pids.iter().enumerate() {
            let rt = runtime_ns(*p);
            out[i].push((rt - prev[i]) as f64 / wall * 100.0);
            prev[i] = rt;
        }
        t = now;
    }
    out
}

/// Seconds until the 1 s moving average of `s` (100 ms steps) stays within `tol` of `target`.
fn convergence(s: &[f64], target: f64, tol: f64) -> Option<f64> {
    let avg: Vec<f64> = s
        .windows(10)
        .map(|w| w.iter().sum::<f64>() / 10.0)
        .collect();
    (0..avg.len())
        .find(|&i| avg[i..].iter().all(|a| (a - target).abs() <= tol))
        .map(|i| (i + 10) as f64 / 10.0)
}

fn windows_1s(s: &[f64]) -> Vec<f64> {
    s.chunks(10)
        .filter(|c| c.len() == 10)
        .map(|c| c.iter().sum::<f64>() / 10.0)
        .collect()
}

fn svg(series: &[(&str, &str, &[f64], f64)], path: &Path) {
    let (w, h) = (800.0, 300.0);
    let n = series.iter().map(|s| s.2.len()).max().unwrap_or(1).max(2) as f64;
    let x = |i: usize| 40.0 + i as f64 / (n - 1.0) * (w - 60.0);
    let y = |v: f64| h - 30.0 - v.clamp(0.0, 100.0) / 100.0 * (h - 50.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"40\" y=\"14\">share of the simulated GPU per 100 ms (solid) and target (dashed), weights 1:3 set at t = 0</text>\n"
    );
    for v in [0.0, 25.0, 50.0, 75.0, 100.0] {
        out += &format!(
            "<line x1=\"40\" x2=\"{}\" y1=\"{y0}\" y2=\"{y0}\" stroke=\"#ddd\"/><text x=\"5\" y=\"{}\">{v}%</text>\n",
            w - 20.0,
            y(v) + 4.0,
            y0 = y(v)
        );
    }
    for (name, color, s, target) in series {
        let pts: Vec<String> = s
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
            .collect();
        out += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" points=\"{}\"/>\n<line x1=\"40\" x2=\"{}\" y1=\"{t}\" y2=\"{t}\" stroke=\"{color}\" stroke-dasharray=\"4 4\"/>\n<text x=\"{}\" y=\"{}\" fill=\"{color}\">{name}</text>\n",
            pts.join(" "),
            w - 20.0,
            w - 120.0,
            y(*target) - 4.0,
            t = y(*target)
        );
    }
    out += &format!(
        "<text x=\"{}\" y=\"{}\">time: {:.0} s</text>\n</svg>\n",
        w - 100.0,
        h - 8.0,
        n / 10.0
    );
    let _ = std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")));
    std::fs::write(path, out).expect("write SVG");
}

/// The benchmark itself.
#[tokio::test(flavor = "multi_thread")]
async fn bench_compute_shares() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("compute-bench");
    let lib_dir = dir.path().join("lib");
    let (a, b) = (Cgroup::new("bench-a"), Cgroup::new("bench-b"));
    let procs = Procs(vec![burner(&a), burner(&b)]);
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    let quiet = shares(&pids, Duration::from_millis(1500));
    let bus = Bus::start();
    let d = start(&dir, &lib_dir, &bus, &pids).await;
    let step = Duration::from_millis(100);
    // Weights 1:3, from the unthrottled state.
    set(&d, &a, &[("compute_weight", zbus::Variant::from(1u32))]).await;
    set(&d, &b, &[("compute_weight", zbus::Variant::from(3u32))]).await;
    let w = series(&pids, step, Duration::from_secs(12));
    // Then caps 30 / 70 replace the weights.
    set(&d, &a, &[("compute_max", zbus::Variant::from(30u32))]).await;
    set(&d, &b, &[("compute_max", zbus::Variant::from(70u32))]).await;
    let c = series(&pids, step, Duration::from_secs(12));
    let summary = |s: &[f64], target: f64| {
        let last10: Vec<f64> = s[s.len().saturating_sub(100)..].to_vec();
        let w1 = windows_1s(&last10);
        json!({
            "target": target,
            "share_10s": last10.iter().sum::<f64>() / last10.len().max(1) as f64,
            "share_1s_min": w1.iter().copied().fold(f64::MAX, f64::min),
            "share_1s_max": w1.iter().copied().fold(f64::MIN, f64::max),
            "convergence_s_within_3_points": convergence(s, target, 3.0),
        })
    };
    let result = json!({
        "free_cpu_share_before": quiet,
        "period_ms": 100, "sample_ms": 100,
        "weights_1_3": { "a": summary(&w[0], 25.0), "b": summary(&w[1], 75.0) },
        "caps_30_70": { "a": summary(&c[0], 30.0), "b": summary(&c[1], 70.0) },
    });
    let out = std::env::var_os("GPUD_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("../bench"));
    svg(
        &[
            ("weight 1", "#1f77b4", &w[0], 25.0),
            ("weight 3", "#d62728", &w[1], 75.0),
        ],
        &out.join("compute-weights-1-3.svg"),
    );
    println!("BENCH JSON: {result}");
}
