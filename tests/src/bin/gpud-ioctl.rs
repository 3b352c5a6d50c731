//! Test fixture: a process that issues NVIDIA-encoded ioctls on a file, from a given cgroup.
//!
//! `gpud-ioctl [--cgroup DIR] --file PATH [--ioctl CMD:COUNT]... [--xfer NR:SIZE:COUNT]...
//!             [--unmatched PATH:COUNT]... [--fork-child] [--hold]`
//!
//! Moves itself into DIR (a cgroup v2 directory) first, opens PATH, issues each ioctl COUNT
//! times (the result is ignored: a stand-in file answers ENOTTY, which is still one ioctl the
//! probes see), prints `DONE <pid>`, and with `--hold` waits for standard input to close; each
//! line read meanwhile makes it issue the same ioctls again and print `DONE <pid>` again.
//! `--fork-child` makes a child (which never opens the file itself) issue the same ioctls on the
//! inherited descriptor, after the parent; it prints `CHILD <pid>` and is held the same way.

use std::{fs::File, io::Write, os::fd::AsRawFd};

use clap::Parser;
use gpud_tests::inproc;

/// Issues NVIDIA-encoded ioctls on a file, from a cgroup (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-ioctl")]
struct Plan {
    /// The cgroup v2 directory to join first.
    #[arg(long, value_name = "DIR")]
    cgroup: Option<String>,
    /// The file to open and issue the ioctls on.
    #[arg(long, value_name = "PATH")]
    file: String,
    /// An ioctl command and how many times to issue it (numbers decimal or 0x hex).
    #[arg(long = "ioctl", value_name = "CMD:COUNT", value_parser = ioctl_arg)]
    ioctls: Vec<(u32, u64)>,
    /// An NV_ESC_IOCTL_XFER_CMD wrapping escape NR of SIZE bytes, COUNT times.
    #[arg(long = "xfer", value_name = "NR:SIZE:COUNT", value_parser = xfer_arg)]
    xfers: Vec<(u32, u32, u64)>,
    /// An RM_ALLOC-encoded ioctl on another file, COUNT times.
    #[arg(long = "unmatched", value_name = "PATH:COUNT", value_parser = unmatched_arg)]
    unmatched: Vec<(String, u64)>,
    /// A child (which opens nothing) issues the same ioctls on the inherited descriptor.
    #[arg(long)]
    fork_child: bool,
    /// Waits for standard input to close, issuing everything again for each line read.
    #[arg(long)]
    hold: bool,
}

fn num(s: &str) -> Result<u32, String> {
    match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("bad number {s:?}"))
}

fn ioctl_arg(v: &str) -> Result<(u32, u64), String> {
    let (c, n) = v.split_once(':').ok_or("CMD:COUNT")?;
    Ok((num(c)?, num(n)?.into()))
}

fn xfer_arg(v: &str) -> Result<(u32, u32, u64), String> {
    match v.split(':').collect::<Vec<_>>()[..] {
        [nr, size, n] => Ok((num(nr)?, num(size)?, num(n)?.into())),
        _ => Err("NR:SIZE:COUNT".to_owned()),
    }
}

fn unmatched_arg(v: &str) -> Result<(String, u64), String> {
    let (p, n) = v.rsplit_once(':').ok_or("PATH:COUNT")?;
    Ok((p.to_owned(), num(n)?.into()))
}

fn die(msg: &str) -> ! {
    eprintln!("gpud-ioctl: {msg}");
    std::process::exit(2)
}

fn issue(file: &File, plan: &Plan) {
    let fd = file.as_raw_fd();
    for &(cmd, n) in &plan.ioctls {
        inproc::issue(fd, cmd, n);
    }
    for &(nr, size, n) in &plan.xfers {
        inproc::issue_xfer(fd, nr, size, n);
    }
    for (path, n) in &plan.unmatched {
        let f = File::open(path).unwrap_or_else(|e| die(&format!("open {path}: {e}")));
        inproc::issue(f.as_raw_fd(), 0xc030_462b, *n);
    }
}

fn hold(plan: &Plan, file: &File) {
    if !plan.hold {
        return;
    }
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        issue(file, plan);
        println!("DONE {}", std::process::id());
        line.clear();
    }
}

fn main() {
    let plan = Plan::parse();
    if let Some(cg) = &plan.cgroup {
        std::fs::write(format!("{cg}/cgroup.procs"), std::process::id().to_string())
            .unwrap_or_else(|e| die(&format!("joining cgroup {cg}: {e}")));
    }
    let path = &plan.file;
    let file = File::open(path).unwrap_or_else(|e| die(&format!("open {path}: {e}")));
    issue(&file, &plan);
    let mut out = std::io::stdout();
    let _ = writeln!(out, "DONE {}", std::process::id());
    let _ = out.flush();
    if plan.fork_child {
        // SAFETY: single-threaded process; the child only issues ioctls, prints and exits.
        match unsafe { libc::fork() } {
            0 => {
                issue(&file, &plan);
                let _ = writeln!(out, "CHILD {}", std::process::id());
                let _ = out.flush();
                hold(&plan, &file);
                std::process::exit(0);
            }
            pid if pid < 0 => die("fork failed"),
            child => {
                hold(&plan, &file);
                let mut status = 0;
                // SAFETY: waiting for our own child.
                unsafe { libc::waitpid(child, &mut status, 0) };
                return;
            }
        }
    }
    hold(&plan, &file);
}
