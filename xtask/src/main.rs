//! `cargo xtask`: the project's own tasks. Every task that needs tools installs them first
//! (`setup`), so a fresh machine needs nothing but this repository, rustup and its `nightly`.

mod bench;
mod cluster;
mod fuzz;
mod install;
mod package;
mod run;
mod setup;
mod soak;
mod test;
mod util;
mod vm;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "gpud developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent; fast when all is present).
    Setup,
    /// Set up, build, and run gpud in the foreground with config/gpud.toml (on a private D-Bus
    /// when no system bus runs).
    Run {
        /// Extra arguments for gpud, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up and run every test: lints, unit and real-kernel tests, VM tests. Needs root.
    Test {
        /// Skip the qemu VM tests (fentry / BPF-LSM kernel).
        #[arg(long)]
        no_vm: bool,
        /// Skip fmt and both clippy runs.
        #[arg(long)]
        no_lint: bool,
    },
    /// Measure the probes' overhead (host: tracepoints; VM: fentry and tracepoints), write
    /// target/bench/results.json; `bench compute`: compute shares on the simulated GPU.
    Bench {
        /// Skip the VM runs.
        #[arg(long)]
        no_vm: bool,
        #[command(subcommand)]
        what: Option<BenchWhat>,
    },
    /// Run the fuzz targets with many cases (PROPTEST_CASES) and more corrupted RM calls
    /// through the real probes. The RM run needs root.
    Fuzz {
        /// Cases per property target.
        #[arg(long, default_value_t = 20_000)]
        cases: u32,
        /// Rounds of 400 corrupted RM calls, each checked against the fake driver.
        #[arg(long, default_value_t = 50)]
        rm_rounds: u64,
    },
    /// Churn soak: the real gpud while cgroups and processes come and go, allocate, fork, exit
    /// and are killed; asserts usage equals the fake driver's and nothing leaks. Runs on an idle
    /// machine, then with every CPU kept busy. Needs root.
    Soak {
        /// How long to churn, in each of the two runs.
        #[arg(long, default_value_t = 10)]
        minutes: u64,
    },
    /// Build the release binaries and install gpud as a system service (unit, D-Bus policy,
    /// default config if none, OCI hooks, manifest for uninstall). Needs root for the real /.
    Install {
        #[command(flatten)]
        layout: LayoutArgs,
        /// Install the binaries found in DIR instead of building the release ones.
        #[arg(long, value_name = "DIR")]
        bin_dir: Option<PathBuf>,
    },
    /// Remove what `install` put there (per its manifest), except files changed since; never the
    /// state directory.
    Uninstall {
        #[command(flatten)]
        layout: LayoutArgs,
    },
    /// Build what operators install, from the release binaries, into target/package/: `deb`
    /// (cargo-deb) or `image` (Debian minbase + the binaries, an OCI archive; no registry).
    Package {
        #[command(subcommand)]
        what: PackageWhat,
        /// Then check it as `cargo xtask test` does (the .deb: installed, run and purged on
        /// this machine; the image: loaded and run by Podman). Needs root.
        #[arg(long, global = true)]
        check: bool,
    },
    /// A real single-node Kubernetes 1.36 on this machine for tests (etcd, control plane,
    /// containerd, kubelet, kube-proxy; state in target/cluster/run). Needs root.
    Cluster {
        #[command(subcommand)]
        what: ClusterWhat,
    },
    /// Only the kernel matrix of `test` (VM rows and this host), each row as one line.
    Matrix,
    /// Boot the Debian-kernel VM and run BINARY ARGS… inside it: `cargo xtask vm -- BINARY ARGS…`.
    Vm {
        /// Seconds before qemu is killed.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// How the kernel is booted: `debian` (bpf in lsm=), `ubuntu` (Ubuntu's LSM list) or
        /// `ubuntu-secure-boot` (the same with lockdown=integrity).
        #[arg(long, default_value = "debian")]
        boot: String,
        /// The kernel: `installed` (the newest Debian kernel in /boot) or `sid` (Debian sid's
        /// newest, which `cargo xtask setup` unpacks under /opt/gpud-test/kernels/sid).
        #[arg(long, default_value = "installed")]
        kernel: String,
        /// The binary to run (with its shared libraries).
        binary: PathBuf,
        /// Its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// A benchmark other than the default overhead run.
#[derive(Subcommand)]
enum BenchWhat {
    /// Compute shares on the simulated GPU (tests/gpusim, virtual time): the policy matrix
    /// across kernel durations, queue depths and firmware modes, LC vs BE, and the H100
    /// reproduction; pass/miss per case (the exit status does not depend on them).
    Compute {
        /// gpusim-bench's own arguments, passed on as given: `--quick`, `--json`,
        /// `--controller law|old|none`, `--threads N`, `--filter TEXT` (its `--help` says more).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The smoke run `cargo xtask test` makes: every benchmark once, briefly, from the debug
    /// build; fails when one does not complete or leaves a figure out.
    Smoke,
}

/// What `cluster` does.
#[derive(Subcommand)]
enum ClusterWhat {
    /// Start the cluster (after taking down what an earlier one left) and wait for the node to be
    /// Ready; prints the kubeconfig. Exits 77 when the Kubernetes binaries are absent.
    Up,
    /// Stop everything and remove its pods, mounts, cgroups, iptables rules and bridge; checks
    /// that nothing is left.
    Down,
    /// Which components run, the node's readiness, `kubectl get nodes`.
    Status,
    /// gpud end to end on the cluster: up, gpud's image imported, deploy/kubernetes/gpud and
    /// the DRA flavour applied and checked (tests/src/bin/gpud-cluster-e2e.rs), down. Exits 77
    /// when the Kubernetes binaries are absent.
    E2e,
}

/// What `package` builds.
#[derive(Subcommand)]
enum PackageWhat {
    /// The Debian package: binaries, unit, D-Bus policy, config (conffile), hooks.d, sysusers,
    /// NRI unit and example; enabled on install, stopped on removal.
    Deb,
    /// The image for the Kubernetes side (gpud-k8s, gpud-nri, gpud): localhost/gpud:VERSION as
    /// an OCI archive, for `podman load` or `ctr images import`.
    Image,
    /// This tree's package over the previous release's (built from its tag, kept in
    /// /var/cache/gpud-xtask): with `--check`, the upgrade test (tenants holding memory while
    /// `dpkg -i` upgrades gpud across an eBPF ABI change).
    Upgrade,
}

/// Where `install` and `uninstall` work.
#[derive(clap::Args)]
struct LayoutArgs {
    /// Installation prefix of the binaries (PREFIX/bin) and their documentation.
    #[arg(long, default_value = "/usr/local", value_name = "DIR")]
    prefix: PathBuf,
    /// Staging root: every path goes under DIR (for packaging); no group, no reloads.
    #[arg(long, value_name = "DIR")]
    destdir: Option<PathBuf>,
}

impl LayoutArgs {
    fn layout(self) -> install::Layout {
        install::Layout {
            prefix: self.prefix,
            destdir: self.destdir,
        }
    }
}

/// An error that has already been reported (e.g. by the test summary): exit non-zero quietly.
#[derive(Debug)]
pub struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("failed (reported above)")
    }
}

impl std::error::Error for Reported {}

/// A task that could not run on this machine for want of something it says: exit 77 (the
/// "skipped" status of automake and meson), never a silent pass.
#[derive(Debug)]
pub struct Skipped;

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("skipped (reported above)")
    }
}

impl std::error::Error for Skipped {}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Task::Setup => setup::run(),
        Task::Run { args } => run::run(&args),
        Task::Test { no_vm, no_lint } => test::run(!no_vm, !no_lint),
        Task::Bench {
            what: Some(BenchWhat::Compute { args }),
            ..
        } => bench::compute(&args),
        Task::Bench {
            no_vm,
            what: Some(BenchWhat::Smoke),
        } => bench::smoke(!no_vm),
        Task::Bench { no_vm, what: None } => bench::run(!no_vm),
        Task::Fuzz { cases, rm_rounds } => fuzz::run(cases, rm_rounds),
        Task::Soak { minutes } => soak::run(std::time::Duration::from_secs(minutes * 60)),
        Task::Install { layout, bin_dir } => install::install(&layout.layout(), bin_dir.as_deref()),
        Task::Uninstall { layout } => install::uninstall(&layout.layout()),
        Task::Package { what, check } => setup::run().and_then(|()| match (what, check) {
            (PackageWhat::Deb, false) => package::deb().map(drop),
            (PackageWhat::Image, false) => package::image().map(drop),
            (PackageWhat::Deb, true) => package::test_deb(),
            (PackageWhat::Image, true) => package::test_image(),
            (PackageWhat::Upgrade, false) => {
                package::previous_deb().and_then(|_| package::deb().map(drop))
            }
            (PackageWhat::Upgrade, true) => package::test_upgrade(),
        }),
        Task::Cluster { what } => match what {
            ClusterWhat::Up => cluster::up(),
            ClusterWhat::Down => cluster::down(),
            ClusterWhat::Status => cluster::status(),
            ClusterWhat::E2e => cluster::e2e(),
        },
        // The console is echoed as it comes.
        Task::Matrix => test::matrix_only(),
        Task::Vm {
            timeout,
            boot,
            kernel,
            binary,
            args,
        } => vm::Boot::parse(&boot).and_then(|b| {
            let k = vm::KernelSource::parse(&kernel)?;
            vm::run_booted(&binary, &args, Duration::from_secs(timeout), b, k).map(drop)
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Reported>() => ExitCode::FAILURE,
        Err(e) if e.is::<Skipped>() => ExitCode::from(77),
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
