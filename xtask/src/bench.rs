//! `cargo xtask bench`: the probes' overhead, host (tracepoint mode) and VM (fentry mode, and
//! tracepoint mode on the same kernel for comparison). Results go to target/bench/results.json;
//! docs/benchmarks.md explains the method and keeps the current figures.

use std::time::Duration;

use anyhow::Context as _;

use crate::util::{cargo, output, root, run as run_cmd};

const MARK: &str = "BENCH JSON: ";

fn parse(out: &str) -> anyhow::Result<serde_json::Value> {
    let line = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(MARK))
        .context("the benchmark printed no result")?;
    Ok(serde_json::from_str(line)?)
}

pub fn run(vm: bool) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_cmd(
        "build gpud-bench",
        cargo().args([
            "build",
            "--release",
            "-p",
            "gpud-tests",
            "--bin",
            "gpud-bench",
        ]),
    )?;
    let bin = root().join("target/release/gpud-bench");
    let mut results = Vec::new();
    println!("bench: host, tracepoint mode");
    let host = output(
        "gpud-bench (host)",
        std::process::Command::new(&bin).args(["--mode", "tracepoint"]),
    )?;
    results.push(serde_json::json!({"where": "host", "result": parse(&host)?}));
    if vm {
        // Software emulation is ~50x slower: fewer calls, same method; compare ratios only.
        for mode in ["fentry", "tracepoint"] {
            println!("bench: VM (qemu TCG, Debian kernel), {mode} mode");
            let args: Vec<String> = ["--mode", mode, "--calls", "20000", "--rounds", "5"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
            let out = crate::vm::run(&bin, &args, Duration::from_secs(900))?;
            results.push(serde_json::json!({"where": "vm", "result": parse(&out)?}));
        }
    }
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = serde_json::Value::Array(results);
    let text = serde_json::to_string_pretty(&all)?;
    std::fs::write(dir.join("results.json"), &text)?;
    println!("{text}");
    println!("bench: written to {}", dir.join("results.json").display());
    Ok(())
}
