//! Test fixture: a process that issues RM calls (through [`gpud_tests::rm`]) on a control
//! device, from a given cgroup, as a script on standard input tells it.
//!
//! `gpud-rm [--cgroup DIR] [--file PATH] [--entry 32|64]`
//!
//! Moves itself into DIR (a cgroup v2 directory) first, then opens PATH (read-write; through the
//! i386 system-call entry with `--entry 32`, as the RM calls then are: see `entry`), then reads
//! one command per line and answers each with one JSON line on stdout. Numbers are decimal or
//! `0x` hex; blank lines and lines starting with `#` are ignored. RM calls answer
//! `{"ok":…,"ret":…,"errno":…,"status":…,"handle":…,"size":…}` where `ok` means `ret == 0` and
//! `status == NV_OK`, `handle` is the handle RM wrote back and `size` the size it wrote back.
//! Anything that cannot be done answers `{"ok":false,"error":"…"}`.
//!
//! | command | does |
//! |---|---|
//! | `client [HANDLE]` | allocates a client (RM picks the handle unless HANDLE) |
//! | `clients N` | allocates N clients, stopping at the first failure: `{"ok":…,"made":…,"failed":REPLY}` |
//! | `device CLIENT ID` | `NV01_DEVICE_0` for GPU ID under CLIENT |
//! | `subdevice CLIENT DEVICE` | `NV20_SUBDEVICE_0` under DEVICE |
//! | `channel-group CLIENT DEVICE` | `KEPLER_CHANNEL_GROUP_A` under DEVICE |
//! | `schedule CLIENT GROUP 0\|1` | `NVA06C_CTRL_CMD_GPFIFO_SCHEDULE` (off or on the runlist) |
//! | `timeslice CLIENT GROUP US` | `NVA06C_CTRL_CMD_SET_TIMESLICE` |
//! | `timeslice-loop CLIENT GROUP US N` | N `SET_TIMESLICE` calls back to back (the last reply) |
//! | `get-timeslice CLIENT GROUP` | `NVA06C_CTRL_CMD_GET_TIMESLICE`: adds `timeslice_us` |
//! | `race-timeslice CLIENT GROUP US N` | N `GET_TIMESLICE` calls a second thread turns into `SET_TIMESLICE` of US and back while each is in flight: `{"ok":true,"calls":…,"refused":…}` |
//! | `race-disable CLIENT SUBDEVICE CHANNEL VCLIENT VCHANNEL N [WAIT_MS]` | N `FIFO_DISABLE_CHANNELS` disables of (CLIENT, CHANNEL) whose list a second thread points at (VCLIENT, VCHANNEL) and back while each is in flight (with WAIT_MS: WAIT_MS into each call, and back once it returned): `{"ok":true,"calls":…,"refused":…,"failed":…}` |
//! | `channel CLIENT GROUP` | `HOPPER_CHANNEL_GPFIFO_A` under GROUP |
//! | `disable-channels CLIENT SUBDEVICE 1\|0 [OWNER CHANNEL]...` | `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS` on the (client, channel) pairs, whoever owns them |
//! | `burn` | answers, then spins on the CPU until killed (a tenant whose CPU time stands for its GPU work) |
//! | `progress [gated]` | as `burn`, counting its spins in a `u64` another process can read: answers `{"ok":true,"pid":…,"progress":ADDR,"gate":ADDR}`; `gated` waits until the `u64` at `gate` is 1 and stops counting once it is 2 (the stand-in of tests/gpu/hw_tenant.cu, for gpud-hwcontrols) |
//! | `alloc CLIENT PARENT SIZE [FORM] [handle=H] [flags=F] [attr=A] [class=C]` | video memory; FORM is `nvos21`, `nvos64` (default), `vidheap`, `xfer21`, `xfer64` or `xfervidheap` |
//! | `parallel N CLIENT PARENT SIZE [FORM]` | N threads allocate at once: `{"ok":…,"results":[…]}` |
//! | `dup CLIENT PARENT SRC_CLIENT SRC [HANDLE]` | `NV_ESC_RM_DUP_OBJECT` of SRC_CLIENT:SRC under PARENT (RM picks the handle unless HANDLE) |
//! | `dup-free CLIENT PARENT SIZE N` | N rounds of allocate, duplicate, free the original (see [`gpud_tests::rm::attack`]) |
//! | `race-status CLIENT PARENT SIZE N` | N allocations whose `status` a second thread rewrites to a failure once the driver answered |
//! | `race-size CLIENT PARENT SIZE SMALL N` | N allocations whose params' `size` a second thread rewrites to SMALL once the driver answered |
//! | `unsized CLIENT PARENT SIZE N` | N allocations whose params lie on a mapped page never touched (the driver faults it in; a probe cannot) |
//! | `race-xfer CLIENT PARENT SIZE SMALL N WAIT_MS` | N XFER'd allocations of SMALL bytes whose `pAllocParms` a second thread points at SIZE bytes' WAIT_MS into the call, and back once answered |
//! | `race-dup CLIENT PARENT SIZE SMALL N WAIT_MS` | N rounds: SMALL and SIZE bytes allocated, an XFER'd duplicate of the SMALL one whose `hObjectSrc` a second thread points at the SIZE one WAIT_MS into the call (and back once answered), the SIZE original freed |
//! | `race-device CLIENT GPU SEEN SIZE N WAIT_MS` | a device read as GPU SEEN whose `deviceId` a second thread makes GPU WAIT_MS into the call (and puts back once answered), then N allocations under it |
//! | `race-free CLIENT PARENT SIZE SMALL N WAIT_MS` | N rounds: SIZE and SMALL bytes allocated, an XFER'd free of the SIZE one whose `hObjectOld` a second thread points at the SMALL one WAIT_MS into the call (and back once answered) |
//! | `race-free-client SIZE SMALL N WAIT_MS` | N rounds: a new client with a device and SIZE and SMALL bytes, an XFER'd free of the client whose `hObjectOld` a second thread points at the SMALL allocation WAIT_MS into the call (and back once answered) |
//! | `free CLIENT HANDLE` | `NV_ESC_RM_FREE` (HANDLE == CLIENT frees the client) |
//! | `vidheap-free CLIENT PARENT HANDLE` | `NV_ESC_RM_VID_HEAP_CONTROL` FREE |
//! | `ioctl CMD` | CMD on a zeroed buffer: `{"ok":…,"ret":…,"errno":…}` |
//! | `fuzz CLIENT DEVICE SEED N` | N corrupted RM calls (see [`fuzz`]): `{"ok":true,"accepted":…}` |
//! | `close` | closes the file descriptor (through the i386 entry under `entry 32`) |
//! | `open [PATH]` | opens PATH (default: `--file`) as the file descriptor, closing the old one (through the i386 entry under `entry 32`) |
//! | `cgroup DIR` | moves this process into DIR |
//! | `sleep MS` | waits |
//! | `entry 32\|64` | RM calls from now on go through the i386 system-call entry (`int 0x80`, as a 32-bit process makes them, argument below 4 GiB) or the 64-bit one (the default) |
//! | `pid` | `{"ok":true,"pid":…}` |
//! | `fork` | forks; see below |
//! | `forks N` | forks N children that keep the file and wait, dying with this process: `{"ok":true,"children":N}` |
//! | `handoff` | forks; the child takes over the script and answers `{"ok":true,"pid":CHILD,"parent":PARENT}`; the parent exits at once (a daemon's double fork is two of these) |
//! | `dup2` | duplicates the file descriptor to a higher number and closes the original |
//! | `listen PATH` | binds a unix stream socket at PATH |
//! | `recv-fd` | accepts one connection on it and takes the descriptor sent there (SCM_RIGHTS) as its file, closing the old one |
//! | `send-fd PATH` | connects to PATH and sends the file descriptor there (SCM_RIGHTS), keeping its own |
//! | `exit [CODE]` | answers `{"ok":true,"exit":PID}` and exits at once, closing nothing itself |
//!
//! `fork`: the child shares the open file (one open file description, as after a real fork)
//! and takes over the script: it answers `{"ok":true,"pid":CHILD}` and runs the following
//! commands until `exit` or end of input. The parent waits for it meanwhile, then answers
//! `{"ok":true,"reaped":CHILD,"code":CODE}` and goes on with the commands after that. Forks nest.
//! Standard input is read unbuffered, so neither process reads lines meant for the other.

use std::{
    fs::File,
    io::Write as _,
    os::unix::net::UnixListener,
    path::{Path, PathBuf},
};

use clap::Parser;
use gpud_common::nv;
use gpud_tests::{
    fakenv::{parse_num, parse_size},
    rm::{Ctl, Form, MemRequest, Reply, attack},
};
use serde_json::{Value, json};

use fd::{recv_fd, redup, send_fd};
use fork::{fork, forks, handoff};
use fuzz::fuzz;

mod fd;
mod fork;
mod fuzz;

struct State {
    path: Option<PathBuf>,
    file: Option<File>,
    listener: Option<UnixListener>,
}

fn die(msg: &str) -> ! {
    eprintln!("gpud-rm: {msg}");
    std::process::exit(2)
}

fn emit(v: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// One line of standard input, read a byte at a time (`None` at end of input).
fn read_line() -> Option<String> {
    let mut line = Vec::new();
    loop {
        let mut b = 0u8;
        // SAFETY: reads one byte into `b`.
        let n = unsafe { libc::read(0, (&mut b as *mut u8).cast(), 1) };
        match n {
            1 if b == b'\n' => break,
            1 => line.push(b),
            0 if line.is_empty() => return None,
            0 => break,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&line).into_owned())
}

fn reply_json(r: &Reply) -> Value {
    json!({
        "ok": r.ok(),
        "ret": r.ret,
        "errno": r.errno,
        "status": r.status,
        "handle": r.handle,
        "size": r.size,
    })
}

/// An attack's answer: `{"ok":true,"held":[HANDLE…],"failed":REPLY|null}` (see
/// [`gpud_tests::rm::attack`]).
fn outcome(o: &attack::Outcome) -> Value {
    json!({
        "ok": true,
        "held": o.held,
        "failed": o.failed.as_ref().map(reply_json),
    })
}

fn err(msg: impl std::fmt::Display) -> Value {
    json!({ "ok": false, "error": msg.to_string() })
}

fn num(s: &str) -> Result<u64, String> {
    parse_num(s).ok_or_else(|| format!("bad number {s:?}"))
}

/// `progress [gated]`: never returns.
fn progress(gated: bool) -> ! {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    static GATE: AtomicU64 = AtomicU64::new(0);
    emit(&json!({
        "ok": true,
        "pid": std::process::id(),
        "progress": COUNT.as_ptr() as u64,
        "gate": GATE.as_ptr() as u64,
    }));
    loop {
        match GATE.load(Relaxed) {
            0 if gated => std::thread::sleep(std::time::Duration::from_micros(200)),
            2.. if gated => loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            },
            _ => {
                // A unit of "work": about a microsecond of CPU.
                for _ in 0..1000 {
                    std::hint::spin_loop();
                }
                COUNT.fetch_add(1, Relaxed);
            }
        }
    }
}

fn join_cgroup(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
}

/// Opens `path` read-write, through the i386 entry while RM calls use it.
fn open(path: &Path) -> std::io::Result<File> {
    #[cfg(target_arch = "x86_64")]
    if gpud_tests::rm::uses_32bit_entry() {
        return gpud_tests::ia32::open(path);
    }
    File::options().read(true).write(true).open(path)
}

/// `--entry`/`entry`: 32 or 64.
fn entry(bits: &str) -> Result<(), String> {
    let on = match bits {
        "32" => true,
        "64" => false,
        _ => return Err(format!("entry: 32 or 64, not {bits:?}")),
    };
    gpud_tests::rm::use_32bit_entry(on).map_err(|e| format!("entry {bits}: {e}"))
}

/// `alloc` arguments after CLIENT PARENT SIZE.
fn mem_request(args: &[&str]) -> Result<MemRequest, String> {
    let [client, parent, size, rest @ ..] = args else {
        return Err("usage: alloc CLIENT PARENT SIZE [FORM] [key=value]…".into());
    };
    let size = parse_size(size).ok_or_else(|| format!("bad size {size:?}"))?;
    let mut r = MemRequest::vidmem(num(client)? as u32, num(parent)? as u32, size, Form::Nvos64);
    for a in rest {
        match a.split_once('=') {
            Some(("handle", v)) => r.handle = num(v)? as u32,
            Some(("flags", v)) => r.flags = num(v)? as u32,
            Some(("attr", v)) => r.attr = num(v)? as u32,
            Some(("class", v)) => r.class = num(v)? as u32,
            Some((k, _)) => return Err(format!("unknown option {k}")),
            None => r.form = Form::parse(a).ok_or_else(|| format!("unknown form {a}"))?,
        }
    }
    Ok(r)
}

/// Runs one command; `None` for lines that need no answer.
fn run(st: &mut State, words: &[&str]) -> Option<Value> {
    let (&cmd, args) = words.split_first()?;
    if cmd.starts_with('#') {
        return None;
    }
    // Commands that need no file.
    match (cmd, args) {
        ("pid", []) => return Some(json!({ "ok": true, "pid": std::process::id() })),
        ("close", []) => {
            return Some(match st.file.take() {
                #[cfg(target_arch = "x86_64")]
                Some(f) if gpud_tests::rm::uses_32bit_entry() => match gpud_tests::ia32::close(f) {
                    Ok(()) => json!({ "ok": true }),
                    Err(e) => err(format!("close: {e}")),
                },
                Some(_) => json!({ "ok": true }),
                None => err("no file open"),
            });
        }
        ("open", [] | [_]) => {
            let path = args.first().map(PathBuf::from).or_else(|| st.path.clone());
            let Some(path) = path else {
                return Some(err("no path to open"));
            };
            return Some(match open(&path) {
                Ok(f) => {
                    st.file = Some(f);
                    st.path = Some(path);
                    json!({ "ok": true })
                }
                Err(e) => err(format!("open {}: {e}", path.display())),
            });
        }
        ("dup2", []) => {
            return Some(match st.file.take() {
                Some(f) => match redup(f) {
                    Ok((f, fd)) => {
                        st.file = Some(f);
                        json!({ "ok": true, "fd": fd })
                    }
                    Err(e) => err(format!("dup2: {e}")),
                },
                None => err("no file open"),
            });
        }
        ("listen", [path]) => {
            let _ = std::fs::remove_file(path);
            return Some(match UnixListener::bind(path) {
                Ok(l) => {
                    st.listener = Some(l);
                    json!({ "ok": true })
                }
                Err(e) => err(format!("bind {path}: {e}")),
            });
        }
        ("recv-fd", []) => {
            let Some(l) = &st.listener else {
                return Some(err("not listening"));
            };
            return Some(match recv_fd(l) {
                Ok(f) => {
                    st.file = Some(f);
                    json!({ "ok": true })
                }
                Err(e) => err(format!("receiving a descriptor: {e}")),
            });
        }
        ("send-fd", [path]) => {
            let Some(f) = &st.file else {
                return Some(err("no file open"));
            };
            return Some(match send_fd(Path::new(path), f) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => err(format!("sending the descriptor to {path}: {e}")),
            });
        }
        ("entry", [bits]) => {
            return Some(match entry(bits) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => err(e),
            });
        }
        ("cgroup", [dir]) => {
            return Some(match join_cgroup(Path::new(dir)) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => err(format!("joining {dir}: {e}")),
            });
        }
        ("burn", []) => {
            println!("{}", json!({ "ok": true }));
            let _ = std::io::stdout().flush();
            loop {
                std::hint::spin_loop();
            }
        }
        ("progress", rest @ ([] | ["gated"])) => progress(!rest.is_empty()),
        ("sleep", [ms]) => {
            return Some(match num(ms) {
                Ok(ms) => {
                    std::thread::sleep(std::time::Duration::from_millis(ms));
                    json!({ "ok": true })
                }
                Err(e) => err(e),
            });
        }
        _ => {}
    }
    let Some(file) = st.file.as_ref() else {
        return Some(err("no file open"));
    };
    let ctl = Ctl::new(file);
    let r = (|| -> Result<Value, String> {
        let size = |i: usize| -> Result<u64, String> {
            args.get(i)
                .ok_or_else(|| format!("{cmd}: missing argument"))
                .and_then(|s| parse_size(s).ok_or_else(|| format!("{cmd}: bad size {s:?}")))
        };
        let n = |i: usize| -> Result<u32, String> {
            args.get(i)
                .ok_or_else(|| format!("{cmd}: missing argument"))
                .and_then(|s| num(s))
                .map(|v| v as u32)
        };
        Ok(match (cmd, args.len()) {
            ("client", 0) => reply_json(&ctl.alloc_client()),
            ("client", 1) => reply_json(&ctl.alloc_client_with(n(0)?)),
            ("clients", 1) => {
                // A tenant filling the host's maps: clients cost no GPU memory.
                let want = n(0)?;
                let mut made = 0u32;
                let mut failed = Value::Null;
                for _ in 0..want {
                    let r = ctl.alloc_client();
                    if !r.ok() {
                        failed = reply_json(&r);
                        break;
                    }
                    made += 1;
                }
                json!({ "ok": made == want, "made": made, "failed": failed })
            }
            ("device", 2) => reply_json(&ctl.alloc_device(n(0)?, n(1)?)),
            ("subdevice", 2) => reply_json(&ctl.alloc_subdevice(n(0)?, n(1)?)),
            ("channel-group", 2) => reply_json(&ctl.alloc_channel_group(n(0)?, n(1)?)),
            ("schedule", 3) => {
                let mut p = gpud_common::rm::tsg::ScheduleParams {
                    enable: n(2)? as u8,
                    ..Default::default()
                };
                reply_json(&ctl.control(
                    n(0)?,
                    n(1)?,
                    gpud_common::rm::tsg::GPFIFO_SCHEDULE,
                    &mut p,
                ))
            }
            ("timeslice", 3) => {
                let mut p = gpud_common::rm::tsg::TimesliceParams {
                    timeslice_us: u64::from(n(2)?),
                };
                reply_json(&ctl.control(n(0)?, n(1)?, gpud_common::rm::tsg::SET_TIMESLICE, &mut p))
            }
            ("channel", 2) => match ctl.alloc_channel(n(0)?, n(1)?) {
                Ok(h) => json!({"ok": true, "ret": 0, "errno": 0, "status": 0, "handle": h}),
                Err(r) => reply_json(&r),
            },
            // `timeslice-loop CLIENT GROUP US N`: N SET_TIMESLICE calls back to back; the last reply.
            ("timeslice-loop", 4) => {
                let mut last = Reply::default();
                for _ in 0..n(3)? {
                    last = ctl.set_timeslice(n(0)?, n(1)?, u64::from(n(2)?));
                }
                reply_json(&last)
            }
            ("race-timeslice", 4) => {
                let r = gpud_tests::rm::attack::race_timeslice(
                    &ctl,
                    n(0)?,
                    n(1)?,
                    u64::from(n(2)?),
                    n(3)?,
                );
                json!({"ok": true, "calls": r.calls, "refused": r.refused})
            }
            ("race-disable", 6 | 7) => {
                let wait = match args.get(6) {
                    Some(_) => Some(std::time::Duration::from_millis(u64::from(n(6)?))),
                    None => None,
                };
                let r = gpud_tests::rm::attack::race_disable(
                    &ctl,
                    (n(0)?, n(1)?, n(2)?),
                    (n(3)?, n(4)?),
                    n(5)?,
                    wait,
                );
                json!({"ok": true, "calls": r.calls, "refused": r.refused, "failed": r.failed})
            }
            ("get-timeslice", 2) => {
                let (r, us) = ctl.get_timeslice(n(0)?, n(1)?);
                let mut v = reply_json(&r);
                v["timeslice_us"] = json!(us);
                v
            }
            // `disable-channels CLIENT SUBDEVICE 1|0 [OWNER CHANNEL]...`
            ("disable-channels", 3..) => {
                let pairs = args[3..]
                    .chunks(2)
                    .map(|p| match p {
                        [c, h] => Ok((num(c)? as u32, num(h)? as u32)),
                        _ => Err("disable-channels: CLIENT CHANNEL pairs".to_owned()),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                reply_json(&ctl.disable_channels(n(0)?, n(1)?, n(2)? != 0, &pairs))
            }
            ("fbinfo", 2..) => {
                // `fbinfo CLIENT SUBDEVICE INDEX...`: FB_GET_INFO_V2 for those indices (none:
                // an empty list, which the driver refuses).
                use gpud_common::rm::fb;
                let mut p = fb::GetInfoV2Params::default();
                let indices = &args[2..];
                if indices.len() > fb::MAX_LIST_SIZE {
                    return Err(format!("fbinfo: at most {} indices", fb::MAX_LIST_SIZE));
                }
                p.list_size = indices.len() as u32;
                for (e, i) in p.list.iter_mut().zip(indices) {
                    e.index = num(i)? as u32;
                }
                let r = ctl.control(n(0)?, n(1)?, fb::GET_INFO_V2, &mut p);
                let mut v = reply_json(&r);
                v["info"] = p.list[..indices.len()]
                    .iter()
                    .map(|e| json!([e.index, e.data]))
                    .collect();
                v
            }
            ("alloc", _) => reply_json(&ctl.alloc_memory(&mem_request(args)?)),
            ("parallel", 4 | 5) => {
                let threads = n(0)? as usize;
                let r = mem_request(&args[1..])?;
                let replies: Vec<Reply> = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..threads)
                        .map(|_| s.spawn(|| ctl.alloc_memory(&r)))
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap_or_default())
                        .collect()
                });
                json!({
                    "ok": replies.iter().all(Reply::ok),
                    "results": replies.iter().map(reply_json).collect::<Vec<_>>(),
                })
            }
            ("dup", 4 | 5) => {
                let h = if args.len() == 5 { n(4)? } else { 0 };
                reply_json(&ctl.dup(n(0)?, n(1)?, h, n(2)?, n(3)?))
            }
            ("dup-free", 4) => outcome(&attack::dup_free(&ctl, n(0)?, n(1)?, size(2)?, n(3)?)),
            ("race-status", 4) => outcome(&attack::race(
                &ctl,
                n(0)?,
                n(1)?,
                size(2)?,
                n(3)?,
                attack::Race::Status,
            )),
            ("race-size", 5) => {
                let small = attack::Race::Size(size(3)?);
                outcome(&attack::race(&ctl, n(0)?, n(1)?, size(2)?, n(4)?, small))
            }
            ("unsized", 4) => outcome(&attack::unsized_params(&ctl, n(0)?, n(1)?, size(2)?, n(3)?)),
            ("race-xfer", 6) => {
                let wait = std::time::Duration::from_millis(n(5)?.into());
                let (big, small) = (size(2)?, size(3)?);
                outcome(&attack::race_xfer(
                    &ctl,
                    n(0)?,
                    n(1)?,
                    big,
                    small,
                    n(4)?,
                    wait,
                ))
            }
            ("race-dup", 6) => {
                let wait = std::time::Duration::from_millis(n(5)?.into());
                outcome(&attack::race_dup(
                    &ctl,
                    n(0)?,
                    n(1)?,
                    size(2)?,
                    size(3)?,
                    n(4)?,
                    wait,
                ))
            }
            ("race-device", 6) => {
                let wait = std::time::Duration::from_millis(n(5)?.into());
                outcome(&attack::race_device(
                    &ctl,
                    n(0)?,
                    n(1)?,
                    n(2)?,
                    size(3)?,
                    n(4)?,
                    wait,
                ))
            }
            ("race-free", 6) => {
                let wait = std::time::Duration::from_millis(n(5)?.into());
                outcome(&attack::race_free(
                    &ctl,
                    n(0)?,
                    n(1)?,
                    size(2)?,
                    size(3)?,
                    n(4)?,
                    wait,
                ))
            }
            ("race-free-client", 4) => {
                let wait = std::time::Duration::from_millis(n(3)?.into());
                outcome(&attack::race_free_client(
                    &ctl,
                    size(0)?,
                    size(1)?,
                    n(2)?,
                    wait,
                ))
            }
            ("free", 2) => reply_json(&ctl.free(n(0)?, n(1)?)),
            ("vidheap-free", 3) => reply_json(&ctl.vidheap_free(n(0)?, n(1)?, n(2)?)),
            ("fuzz", 4) => fuzz(&ctl, n(0)?, n(1)?, u64::from(n(2)?), u64::from(n(3)?)),
            ("ioctl", 1) => {
                // Large enough for any encoded size.
                let mut buf = vec![0u8; nv::NV_MAX_IOCTL_SIZE as usize];
                // SAFETY: the buffer holds any encoded size; a zeroed struct points nowhere.
                let (ret, errno) = unsafe { ctl.raw(n(0)?, buf.as_mut_ptr()) };
                json!({ "ok": ret == 0, "ret": ret, "errno": errno })
            }
            _ => return Err(format!("unknown command or arguments: {}", words.join(" "))),
        })
    })();
    Some(r.unwrap_or_else(err))
}

/// Issues RM calls on a control device as standard input tells it (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-rm")]
struct Args {
    /// The cgroup v2 directory to join first.
    #[arg(long, value_name = "DIR")]
    cgroup: Option<PathBuf>,
    /// The control device to open (read-write).
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
    /// The system-call entry of the open and the RM calls: 64, or 32 (i386, as a 32-bit
    /// process; x86-64 only).
    #[arg(long, value_name = "BITS", default_value = "64")]
    entry: String,
}

fn main() {
    let Args {
        cgroup,
        file: path,
        entry: bits,
    } = Args::parse();
    if let Some(cg) = &cgroup {
        join_cgroup(cg).unwrap_or_else(|e| die(&format!("joining cgroup {}: {e}", cg.display())));
    }
    entry(&bits).unwrap_or_else(|e| die(&e));
    let file = path
        .as_ref()
        .map(|p| open(p).unwrap_or_else(|e| die(&format!("open {}: {e}", p.display()))));
    let mut st = State {
        path,
        file,
        listener: None,
    };
    while let Some(line) = read_line() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["fork"] => emit(&fork()),
            ["forks", n] => emit(&match parse_num(n) {
                Some(n) => forks(n),
                None => err(format!("forks: bad count {n:?}")),
            }),
            ["handoff"] => emit(&handoff()),
            ["exit"] | ["exit", _] => {
                let code = words.get(1).and_then(|c| parse_num(c)).unwrap_or(0) as i32;
                emit(&json!({ "ok": true, "exit": std::process::id() }));
                // SAFETY: leaves at once; the kernel closes the descriptors.
                unsafe { libc::_exit(code) };
            }
            _ => {
                if let Some(v) = run(&mut st, &words) {
                    emit(&v);
                }
            }
        }
    }
}
