//! `cargo xtask run`: set up, build, and run gpud in the foreground with config/gpud.toml. Where
//! no system bus runs, a private dbus-daemon is started and its address printed.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::util::{cargo, root, run as run_cmd};

const DEV_DIR: &str = "/run/gpud-dev";
const SYSTEM_BUS_SOCKET: &str = "/run/dbus/system_bus_socket";

/// Kills the private bus when `xtask run` ends.
struct PrivateBus(Child);

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_private_bus() -> anyhow::Result<(PrivateBus, String)> {
    std::fs::create_dir_all(DEV_DIR).with_context(|| format!("creating {DEV_DIR}"))?;
    let socket = Path::new(DEV_DIR).join("bus");
    let _ = std::fs::remove_file(&socket);
    let conf = Path::new(DEV_DIR).join("bus.conf");
    std::fs::write(
        &conf,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- Private development bus of `cargo xtask run`: everything allowed. -->
<busconfig>
  <type>session</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"#,
            socket.display()
        ),
    )?;
    let mut child = Command::new("dbus-daemon")
        .arg("--config-file")
        .arg(&conf)
        .args(["--nofork", "--print-address"])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting dbus-daemon (package `dbus`)")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("dbus-daemon stdout")?)
        .read_line(&mut line)
        .context("reading the private bus address")?;
    let address = line.trim().to_owned();
    if address.is_empty() {
        bail!("dbus-daemon printed no address");
    }
    Ok((PrivateBus(child), address))
}

pub fn run(extra: &[String]) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_cmd(
        "build",
        cargo().args(["build", "--package", "gpud", "--bins"]),
    )?;
    let bin = root().join("target/debug");
    let has_system_bus = std::env::var_os("DBUS_SYSTEM_BUS_ADDRESS").is_some()
        || Path::new(SYSTEM_BUS_SOCKET).exists();
    let mut cmd = Command::new(bin.join("gpud"));
    cmd.arg("--config").arg(root().join("config/gpud.toml"));
    let _bus = if has_system_bus {
        println!("gpud: serving on the system bus");
        None
    } else {
        let (bus, address) = start_private_bus()?;
        let plain = address.split(',').next().unwrap_or(&address).to_owned();
        println!("gpud: no system bus here; private D-Bus at {plain}");
        println!("  busctl --address={plain} introspect dev.gpud.Daemon1 /dev/gpud/Daemon1");
        println!(
            "  {} --bus-address={plain} list --json",
            bin.join("gpudctl").display()
        );
        cmd.arg("--bus-address").arg(&address);
        Some(bus)
    };
    cmd.args(extra);
    // gpud handles SIGINT/SIGTERM itself; Ctrl-C reaches it through the process group.
    let status = cmd.status().context("starting gpud")?;
    if !status.success() {
        bail!("gpud exited with {status}");
    }
    Ok(())
}
