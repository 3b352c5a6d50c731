//! `gpusim-bench [--quick] [--json] [--controller NAME] [--threads N] [--filter TEXT]`: the
//! compute-share benchmark on the simulated GPU (run by `cargo xtask bench compute`). The exit
//! status says whether it ran, not whether targets were met.

use std::{process::ExitCode, time::Instant};

use clap::Parser;
use gpusim::bench;

#[derive(Parser)]
#[command(name = "gpusim-bench", about = "Compute shares on the simulated GPU")]
struct Args {
    /// A representative subset of the matrix.
    #[arg(long)]
    quick: bool,
    /// One JSON object per line and case instead of the table.
    #[arg(long)]
    json: bool,
    /// `law` (gpud's), `old` (the controller it replaced) or `none`.
    #[arg(long, default_value = "law")]
    controller: String,
    /// Worker threads (default: the CPUs available).
    #[arg(long)]
    threads: Option<usize>,
    /// Only the cases whose scenario contains this text.
    #[arg(long, default_value = "")]
    filter: String,
}

fn main() -> ExitCode {
    let a = Args::parse();
    if bench::controller(&a.controller).is_none() {
        eprintln!(
            "gpusim-bench: unknown controller {:?} (known: {})",
            a.controller,
            bench::CONTROLLERS.join(", ")
        );
        return ExitCode::from(2);
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let started = Instant::now();
    let mut cases = bench::cases(a.quick);
    cases.retain(|c| c.scenario.name.contains(&a.filter));
    let results = bench::run_all(&cases, &a.controller, threads);
    if a.json {
        for r in &results {
            println!("{}", bench::to_json(r));
        }
    } else {
        println!(
            "compute shares on the simulated GPU, controller {}{}:",
            a.controller,
            if a.quick { " (quick)" } else { "" }
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
