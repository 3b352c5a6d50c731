//! `gpusim-bench [--quick] [--json] [--controller NAME] [--threads N] [--filter TEXT]`: the
//! compute-share benchmark on the simulated GPU (run by `cargo xtask bench compute`). The exit status says
//! whether it ran, not whether targets were met.

use std::{process::ExitCode, time::Instant};

use gpusim::bench;

fn main() -> ExitCode {
    let mut quick = false;
    let mut json = false;
    let mut filter = String::new();
    let mut controller = "old".to_owned();
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--json" => json = true,
            "--filter" => filter = args.next().unwrap_or_default(),
            "--controller" => controller = args.next().unwrap_or_default(),
            "--threads" => threads = args.next().and_then(|n| n.parse().ok()).unwrap_or(threads),
            other => {
                eprintln!(
                    "gpusim-bench: unknown argument {other:?} (--quick, --json, --controller NAME, --threads N, --filter TEXT)"
                );
                return ExitCode::from(2);
            }
        }
    }
    if bench::controller(&controller).is_none() {
        eprintln!(
            "gpusim-bench: unknown controller {controller:?} (known: {})",
            bench::CONTROLLERS.join(", ")
        );
        return ExitCode::from(2);
    }
    let started = Instant::now();
    let mut cases = bench::cases(quick);
    cases.retain(|c| c.scenario.name.contains(&filter));
    let results = bench::run_all(&cases, &controller, threads);
    if json {
        for r in &results {
            println!("{}", bench::to_json(r));
        }
    } else {
        println!(
            "compute shares on the simulated GPU, controller {controller}{}:",
            if quick { " (quick)" } else { "" }
        );
        print!("{}", bench::table(&results));
    }
    eprintln!(
        "gpusim-bench: {} cases in {:.1} s",
        results.len(),
        started.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}
