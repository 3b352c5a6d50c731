//! Measurement tool of tests/gpu/hw-controls.sh: which RM control stops a tenant's queued GPU work,
//! how fast, and whether it comes back, judged by the tenant's own progress rather than NVML.
//!
//! `gpud-hwcontrols sequence --tenant JSON --neighbour JSON [--out DIR] [--extra-path PATH]…`
//! applies, through gpud's own code path ([`Controls`]: `pidfd_getfd` copies of the tenants'
//! files, the compute actuator's), one candidate at a time, each held [`HOLD`] and undone:
//! 1. `schedule`: `GPFIFO_SCHEDULE` disable + `PREEMPT` on every channel group of the tenant;
//! 2. `disable-own`: `FIFO_DISABLE_CHANNELS` of the tenant's channels on its own subdevice;
//! 3. `disable-via-neighbour`: the same on the neighbour's subdevice (another client's);
//! 4. the neighbour's load is let go (its gate), both at their timeslices as they are, then the
//!    tenant at 128 µs against the neighbour at 16,384 µs (`SET_TIMESLICE`), then put back.
//!
//! A thread reads each process's progress counter (a `u64` in its memory, given as `progress`)
//! every millisecond with `process_vm_readv`; the counts are binned by 10 ms. Per control it
//! prints one JSON line: the rate before, the time until the rate stays below 5 % of it, the
//! rate while held and after, the time to come back to half of it, and the controls' errors.
//! `--out DIR` also gets `bins.jsonl` (every bin) and `summary.json`.
//!
//! `gpud-hwcontrols timeslice --tenant JSON --us US` sets the timeslice of a tenant's groups.
//!
//! A tenant is `{"pid":…,"progress":ADDR,"gate":ADDR|null,"client":…,"subdevice":…,
//! "groups":[…],"channels":[…]}` (handles of its RM client, from a sniffer log on a GPU or from
//! gpud-rm on the fake device). Measurement tooling, not part of gpud.

use std::{
    io::Write as _,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use gpud::{
    attribution::ChannelGroup,
    enforcement::compute::channel::{Controls, RmObject},
    probes::devices::{DynamicMajors, Matcher, resolve_extra_paths},
    report::Chain,
};
use gpud_common::{
    GPU_UNKNOWN,
    rm::{sched, tsg},
};
use gpud_tests::hwcontrols::{Bins, Sample, Window, summarize_hold, summarize_split};
use serde::Deserialize;
use serde_json::{Value, json};

/// How long each stopping control is held, and how long the tenant is watched after.
const HOLD: Duration = Duration::from_secs(2);
const RECOVER: Duration = Duration::from_secs(2);
/// The rate before a control: this long before it.
const BEFORE: Duration = Duration::from_secs(1);
/// Each timeslice phase.
const SPLIT: Duration = Duration::from_secs(3);

#[derive(Parser)]
#[command(about = "Which RM control stops a tenant's queued GPU work, measured by its progress")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Files that stand for the control device (the fake device), as gpud's
    /// `devices.extra_paths`.
    #[arg(long = "extra-path", global = true)]
    extra: Vec<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The candidates one after the other, with the progress of both processes.
    Sequence {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        neighbour: String,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Sets the timeslice of every channel group of a tenant.
    Timeslice {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        us: u64,
    },
}

#[derive(Clone, Debug, Deserialize)]
struct Tenant {
    pid: u32,
    progress: u64,
    gate: Option<u64>,
    client: u32,
    subdevice: u32,
    groups: Vec<u32>,
    channels: Vec<u32>,
}

impl Tenant {
    fn groups(&self) -> impl Iterator<Item = ChannelGroup> + '_ {
        self.groups.iter().map(|&handle| ChannelGroup {
            pid: self.pid,
            gpu: GPU_UNKNOWN,
            client: self.client,
            handle,
        })
    }
}

fn parse_tenant(s: &str) -> Result<Tenant> {
    serde_json::from_str(s).with_context(|| format!("bad tenant {s}"))
}

/// The `u64` at `addr` in process `pid`: read, or (`value`) written and returned.
fn remote_u64(pid: u32, addr: u64, value: Option<u64>) -> std::io::Result<u64> {
    let mut v = value.unwrap_or(0);
    let local = libc::iovec {
        iov_base: (&mut v as *mut u64).cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 8,
    };
    let pid = pid as libc::pid_t;
    // SAFETY: one local iovec over `v` (8 bytes) and one remote; the kernel checks the remote.
    let n = unsafe {
        if value.is_some() {
            libc::process_vm_writev(pid, &local, 1, &remote, 1, 0)
        } else {
            libc::process_vm_readv(pid, &local, 1, &remote, 1, 0)
        }
    };
    if n != 8 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

fn read_u64(pid: u32, addr: u64) -> std::io::Result<u64> {
    remote_u64(pid, addr, None)
}

fn write_u64(pid: u32, addr: u64, v: u64) -> std::io::Result<()> {
    remote_u64(pid, addr, Some(v)).map(drop)
}

struct Run {
    controls: Controls,
    tenant: Tenant,
    neighbour: Tenant,
    start: Instant,
}

impl Run {
    fn at(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Off (`false`) or back on the runlist, every group of the tenant.
    fn schedule(&mut self, enabled: bool) -> Vec<String> {
        let groups: Vec<ChannelGroup> = self.tenant.groups().collect();
        groups
            .iter()
            .filter_map(|g| self.controls.schedule(g, enabled).err())
            .map(|e| Chain(&e).to_string())
            .collect()
    }

    /// The tenant's channels disabled (or enabled) on `via`'s subdevice.
    fn disable(&mut self, via_neighbour: bool, disable: bool) -> Vec<String> {
        let via = if via_neighbour {
            &self.neighbour
        } else {
            &self.tenant
        };
        let target = RmObject {
            pid: via.pid,
            client: via.client,
            object: via.subdevice,
        };
        let mut errors = Vec::new();
        for chunk in self.tenant.channels.chunks(sched::DISABLE_CHANNELS_MAX) {
            let mut p = sched::DisableChannelsParams {
                disable: u8::from(disable),
                num_channels: chunk.len() as u32,
                ..Default::default()
            };
            for (i, &ch) in chunk.iter().enumerate() {
                p.client_list[i] = self.tenant.client;
                p.channel_list[i] = ch;
            }
            if let Err(e) = self
                .controls
                .control_on(target, sched::DISABLE_CHANNELS, &mut p)
            {
                errors.push(Chain(&e).to_string());
            }
        }
        errors
    }
}

fn timeslices(controls: &mut Controls, t: &Tenant, us: u64) -> Vec<String> {
    let groups: Vec<ChannelGroup> = t.groups().collect();
    groups
        .iter()
        .filter_map(|g| controls.timeslice(g, us).err())
        .map(|e| Chain(&e).to_string())
        .collect()
}

/// Each of the tenant's groups with the timeslice it holds (`None`: it could not be read).
fn timeslices_now(controls: &mut Controls, t: &Tenant) -> Vec<(u32, Option<u64>)> {
    t.groups
        .iter()
        .map(|&group| {
            let mut p = tsg::TimesliceParams::default();
            let o = RmObject {
                pid: t.pid,
                client: t.client,
                object: group,
            };
            let got = controls.control_on(o, tsg::GET_TIMESLICE, &mut p);
            (group, got.ok().map(|()| p.timeslice_us))
        })
        .collect()
}

fn emit(v: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn sequence(
    controls: Controls,
    tenant: Tenant,
    neighbour: Tenant,
    out: Option<PathBuf>,
) -> Result<()> {
    for t in [&tenant, &neighbour] {
        read_u64(t.pid, t.progress)
            .with_context(|| format!("cannot read the progress of process {}", t.pid))?;
    }
    let Some(gate) = neighbour.gate else {
        bail!("the neighbour has no gate");
    };
    let start = Instant::now();
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    emit(&json!({ "start_unix": unix }));
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (samples, stop) = (samples.clone(), stop.clone());
        let pids = [
            (tenant.pid, tenant.progress),
            (neighbour.pid, neighbour.progress),
        ];
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let at = start.elapsed().as_secs_f64();
                let v = pids.map(|(pid, addr)| read_u64(pid, addr).ok());
                if let [Some(a), Some(b)] = v
                    && let Ok(mut s) = samples.lock()
                {
                    s.push(Sample { at, counts: [a, b] });
                }
                thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut run = Run {
        controls,
        tenant,
        neighbour,
        start,
    };
    let mut steps: Vec<(String, Window, Vec<String>)> = Vec::new();
    thread::sleep(BEFORE);
    type Apply = fn(&mut Run, bool) -> Vec<String>;
    let candidates: [(&str, Apply); 3] = [
        ("schedule", |r, on| r.schedule(!on)),
        ("disable-own", |r, on| r.disable(false, on)),
        ("disable-via-neighbour", |r, on| r.disable(true, on)),
    ];
    for (name, apply) in candidates {
        let from = run.at();
        let mut errors = apply(&mut run, true);
        let applied = run.at();
        thread::sleep(HOLD);
        let undo = run.at();
        errors.extend(
            apply(&mut run, false)
                .into_iter()
                .map(|e| format!("undo: {e}")),
        );
        thread::sleep(RECOVER);
        steps.push((
            name.into(),
            Window {
                before: (from - BEFORE.as_secs_f64(), from),
                apply: (from, applied),
                undo,
                end: run.at(),
            },
            errors,
        ));
        thread::sleep(Duration::from_millis(200));
    }
    // The timeslice lever against a loaded neighbour.
    let mut errors = Vec::new();
    if let Err(e) = write_u64(run.neighbour.pid, gate, 1) {
        errors.push(format!("cannot open the neighbour's gate: {e}"));
    }
    let shared_from = run.at();
    thread::sleep(SPLIT);
    let before = timeslices_now(&mut run.controls, &run.tenant);
    let before_n = timeslices_now(&mut run.controls, &run.neighbour);
    let split_from = run.at();
    errors.extend(timeslices(&mut run.controls, &run.tenant, 128));
    errors.extend(timeslices(&mut run.controls, &run.neighbour, 16_384));
    thread::sleep(SPLIT);
    let split_end = run.at();
    for (t, groups) in [(&run.tenant, &before), (&run.neighbour, &before_n)] {
        for &(g, us) in groups {
            let mut p = tsg::TimesliceParams {
                timeslice_us: us.unwrap_or(1024),
            };
            let o = RmObject {
                pid: t.pid,
                client: t.client,
                object: g,
            };
            if let Err(e) = run.controls.control_on(o, tsg::SET_TIMESLICE, &mut p) {
                errors.push(format!("restore: {}", Chain(&e)));
            }
        }
    }
    let _ = write_u64(run.neighbour.pid, gate, 2);
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();

    let samples = samples
        .lock()
        .map_err(|_| anyhow::anyhow!("sampler panicked"))?
        .clone();
    let bins = Bins::new(&samples, 0.010);
    let mut summary = Vec::new();
    for (name, w, errors) in &steps {
        let s = summarize_hold(&bins, 0, w);
        let v = json!({ "control": name, "errors": errors, "result": s });
        emit(&v);
        summary.push(v);
    }
    let split = summarize_split(
        &bins,
        (shared_from + 1.0, split_from),
        (split_from + 1.0, split_end),
    );
    let v = json!({
        "control": "timeslice 128 / 16384",
        "errors": errors,
        "timeslices_before": {
            "tenant": before.iter().map(|(_, us)| *us).collect::<Vec<_>>(),
            "neighbour": before_n.iter().map(|(_, us)| *us).collect::<Vec<_>>(),
        },
        "result": split,
    });
    emit(&v);
    summary.push(v);
    if let Some(dir) = out {
        std::fs::create_dir_all(&dir)?;
        let mut f = std::fs::File::create(dir.join("bins.jsonl"))?;
        for (i, r) in bins.rates.iter().enumerate() {
            writeln!(
                f,
                "{}",
                json!({"t": (i as f64 * bins.width * 1000.0).round() / 1000.0, "tenant": r[0], "neighbour": r[1]})
            )?;
        }
        std::fs::write(
            dir.join("summary.json"),
            serde_json::to_string_pretty(&summary)?,
        )?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let matcher = Matcher {
        majors: DynamicMajors::read().context("cannot read /proc/devices")?,
        extra: resolve_extra_paths(&cli.extra)?,
    };
    let mut controls = Controls::new(matcher, None);
    match cli.cmd {
        Cmd::Sequence {
            tenant,
            neighbour,
            out,
        } => sequence(
            controls,
            parse_tenant(&tenant)?,
            parse_tenant(&neighbour)?,
            out,
        ),
        Cmd::Timeslice { tenant, us } => {
            let t = parse_tenant(&tenant)?;
            let errors = timeslices(&mut controls, &t, us);
            emit(&json!({ "pid": t.pid, "us": us, "errors": errors }));
            if errors.is_empty() {
                Ok(())
            } else {
                bail!("{} groups refused", errors.len())
            }
        }
    }
}
