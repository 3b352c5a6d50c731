//! `cargo xtask`: the project's own tasks. Every task that needs tools installs them first
//! (`setup`), so a fresh machine needs nothing but this repository and rustup.

mod bench;
mod run;
mod setup;
mod test;
mod util;
mod vm;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "gpud developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what building and testing need (idempotent; fast when all is present).
    Setup,
    /// Set up, build, and run gpud in the foreground with config/gpud.toml.
    Run {
        /// Extra arguments for gpud.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up and run every test: lints, unit and real-kernel tests, VM tests.
    Test {
        /// Skip the qemu VM tests (fentry / BPF-LSM kernel).
        #[arg(long)]
        no_vm: bool,
        /// Skip fmt and clippy.
        #[arg(long)]
        no_lint: bool,
    },
    /// Measure the probes' overhead (host: tracepoints; VM: fentry), write target/bench/.
    Bench {
        /// Skip the VM runs.
        #[arg(long)]
        no_vm: bool,
    },
    /// Boot the Debian-kernel VM and run BINARY ARGS… inside it.
    Vm {
        binary: PathBuf,
        args: Vec<String>,
        /// Seconds before qemu is killed.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Setup => setup::run().map(|_| ()),
        Command::Run { args } => run::run(&args),
        Command::Test { no_vm, no_lint } => test::run(!no_vm, !no_lint),
        Command::Bench { no_vm } => bench::run(!no_vm),
        Command::Vm {
            binary,
            args,
            timeout,
        } => vm::run(&binary, &args, std::time::Duration::from_secs(timeout)).map(|out| {
            print!("{out}");
        }),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
