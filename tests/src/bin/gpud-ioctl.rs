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

use gpud_tests::inproc;

#[derive(Default)]
struct Plan {
    cgroup: Option<String>,
    file: Option<String>,
    ioctls: Vec<(u32, u64)>,
    xfers: Vec<(u32, u32, u64)>,
    unmatched: Vec<(String, u64)>,
    fork_child: bool,
    hold: bool,
}

fn parse_u32(s: &str) -> u32 {
    let parsed = match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    parsed.unwrap_or_else(|_| die(&format!("bad number {s:?}")))
}

fn die(msg: &str) -> ! {
    eprintln!("gpud-ioctl: {msg}");
    std::process::exit(2)
}

fn parse() -> Plan {
    let mut plan = Plan::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| die(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--cgroup" => plan.cgroup = Some(val()),
            "--file" => plan.file = Some(val()),
            "--ioctl" => {
                let v = val();
                let (c, n) = v
                    .split_once(':')
                    .unwrap_or_else(|| die("--ioctl CMD:COUNT"));
                plan.ioctls.push((parse_u32(c), parse_u32(n).into()));
            }
            "--xfer" => {
                let v = val();
                let p: Vec<&str> = v.split(':').collect();
                if p.len() != 3 {
                    die("--xfer NR:SIZE:COUNT");
                }
                plan.xfers
                    .push((parse_u32(p[0]), parse_u32(p[1]), parse_u32(p[2]).into()));
            }
            "--unmatched" => {
                let v = val();
                let (p, n) = v
                    .rsplit_once(':')
                    .unwrap_or_else(|| die("--unmatched PATH:COUNT"));
                plan.unmatched.push((p.to_owned(), parse_u32(n).into()));
            }
            "--fork-child" => plan.fork_child = true,
            "--hold" => plan.hold = true,
            other => die(&format!("unknown argument {other}")),
        }
    }
    plan
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
    let plan = parse();
    if let Some(cg) = &plan.cgroup {
        std::fs::write(format!("{cg}/cgroup.procs"), std::process::id().to_string())
            .unwrap_or_else(|e| die(&format!("joining cgroup {cg}: {e}")));
    }
    let path = plan
        .file
        .clone()
        .unwrap_or_else(|| die("--file is required"));
    let file = File::open(&path).unwrap_or_else(|e| die(&format!("open {path}: {e}")));
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
