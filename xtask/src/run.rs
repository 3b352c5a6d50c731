//! `cargo xtask run`: set up, build, and run gpud in the foreground with config/gpud.toml. Where
//! no system bus runs, a private dbus-daemon is started for the daemon's lifetime and its address
//! printed with ready-to-paste `busctl` and `gpudctl` commands.

use std::{
    io::{BufRead as _, BufReader},
    os::unix::{net::UnixStream, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicI32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::util::{cargo, describe, root, run as run_cmd};

/// Runtime directory of the private development bus.
const DEV_DIR: &str = "/run/gpud-dev";
const SYSTEM_BUS_SOCKET: &str = "/run/dbus/system_bus_socket";
const BUS_NAME: &str = "dev.gpud.Daemon1";
const OBJECT_PATH: &str = "/dev/gpud/Daemon1";

/// The private bus: a session-type bus on a socket in [`DEV_DIR`], allowing everything (the
/// same configuration the integration tests use).
fn bus_config(socket: &Path) -> String {
    include_str!("../../tests/fixtures/private-bus.conf")
        .replace("@SOCKET@", &socket.display().to_string())
}

/// A dbus-daemon that is stopped (SIGTERM, then waited for) when dropped.
struct PrivateBus {
    child: Child,
    socket: PathBuf,
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; the child has not been reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Starts the private bus; returns it and its address (without the `guid=` part).
fn start_private_bus() -> anyhow::Result<(PrivateBus, String)> {
    std::fs::create_dir_all(DEV_DIR).with_context(|| format!("run: creating {DEV_DIR}"))?;
    let socket = Path::new(DEV_DIR).join("bus");
    if UnixStream::connect(&socket).is_ok() {
        bail!(
            "run: a private bus is already live at {} (another `cargo xtask run`?); stop it first",
            socket.display()
        );
    }
    // A stale socket from a run that was killed.
    let _ = std::fs::remove_file(&socket);
    let conf = Path::new(DEV_DIR).join("bus.conf");
    std::fs::write(&conf, bus_config(&socket))
        .with_context(|| format!("run: writing {}", conf.display()))?;
    let mut child = Command::new("dbus-daemon")
        .arg("--config-file")
        .arg(&conf)
        .args(["--print-address", "--nofork"])
        .stdout(Stdio::piped())
        // Its own process group: Ctrl-C must not stop the bus before gpud has left it.
        .process_group(0)
        .die_with_parent()
        .spawn()
        .context("run: cannot start dbus-daemon (package `dbus`)")?;
    let stdout = child.stdout.take().context("run: dbus-daemon stdout")?;
    let bus = PrivateBus { child, socket };
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .context("run: reading the private bus address")?;
    let address = line.trim().split(',').next().unwrap_or_default().to_owned();
    if address.is_empty() {
        bail!(
            "run: dbus-daemon printed no address (config {})",
            conf.display()
        );
    }
    Ok((bus, address))
}

/// Asks the kernel to send SIGTERM to a child when xtask dies, even by SIGKILL.
trait DieWithParent {
    fn die_with_parent(&mut self) -> &mut Self;
}

impl DieWithParent for Command {
    fn die_with_parent(&mut self) -> &mut Self {
        // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
        // async-signal-safe.
        unsafe {
            self.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        }
    }
}

/// The last SIGINT or SIGTERM received, to forward to gpud; 0 when none is pending.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn record_signal(signal: libc::c_int) {
    PENDING_SIGNAL.store(signal, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM set [`PENDING_SIGNAL`] instead of ending xtask.
fn catch_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(signal, record_signal as *const () as libc::sighandler_t) };
    }
}

/// Waits for `child`, forwarding SIGINT and SIGTERM to it; true if a signal was forwarded.
fn wait_forwarding(child: &mut Child) -> anyhow::Result<(std::process::ExitStatus, bool)> {
    let mut forwarded = false;
    loop {
        let signal = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
        if signal != 0 {
            // SAFETY: kill(2) on our own child's pid; the child has not been reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
            forwarded = true;
        }
        if let Some(status) = child.try_wait()? {
            return Ok((status, forwarded));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(extra: &[String]) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_cmd(
        "run: cargo build --package gpud --bins",
        cargo().args(["build", "--package", "gpud", "--bins"]),
    )?;
    let bin = root().join("target/debug");
    let mut cmd = Command::new(bin.join("gpud"));
    cmd.arg("--config").arg(root().join("config/gpud.toml"));

    let has_system_bus = std::env::var_os("DBUS_SYSTEM_BUS_ADDRESS").is_some()
        || Path::new(SYSTEM_BUS_SOCKET).exists();
    // Kept alive until gpud has exited; dropping it stops the bus.
    let _bus = if has_system_bus {
        println!("gpud: serving {BUS_NAME} on the system bus");
        println!("  try: busctl introspect {BUS_NAME} {OBJECT_PATH}");
        println!("       {} list --json", bin.join("gpudctl").display());
        None
    } else {
        let (bus, address) = start_private_bus()?;
        println!(
            "gpud: private D-Bus at {address} — try: busctl --address={address} introspect \
             {BUS_NAME} {OBJECT_PATH}"
        );
        println!(
            "gpud: or: {} --bus-address={address} list --json",
            bin.join("gpudctl").display()
        );
        cmd.arg("--bus-address").arg(&address);
        Some(bus)
    };
    cmd.args(extra);

    catch_signals();
    // Its own process group, so that a terminal's Ctrl-C reaches gpud once, forwarded by us.
    let mut gpud = cmd
        .process_group(0)
        .die_with_parent()
        .spawn()
        .with_context(|| format!("run: cannot start {}", bin.join("gpud").display()))?;
    let (status, signalled) = wait_forwarding(&mut gpud)?;
    if !status.success() && !signalled {
        bail!("run: gpud exited with {}", describe(status));
    }
    println!("gpud: exited ({})", describe(status));
    Ok(())
}
