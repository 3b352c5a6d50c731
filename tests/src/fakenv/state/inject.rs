//! Fault injection into the fake's RM: what is pending ([`Inject`]) and the grammar of the
//! `inject` file (see [`crate::fakenv::FakeNv::inject`]).

use std::time::Duration;

use super::{Rm, Runlist};
use crate::fakenv::{parse_num, parse_size};

/// Pending fault injections.
#[derive(Debug, Default)]
pub(in crate::fakenv) struct Inject {
    /// The next `count` video-memory allocations fail with `status`.
    pub(super) fail_alloc: Option<(u32, u64)>,
    /// The next `count` ioctls fail with `errno`.
    pub(super) errno: Option<(i32, u64)>,
    /// Every ioctl waits this long before it is handled.
    pub(in crate::fakenv) delay: Duration,
    /// The next `count` RM controls with command `cmd` answer `status`: (cmd, status).
    pub(super) fail_control: Option<((u32, u32), u64)>,
}

/// Uses one of a counted injection's remaining shots.
pub(super) fn take<T: Copy>(slot: &mut Option<(T, u64)>) -> Option<T> {
    let (v, n) = slot.as_mut()?;
    let v = *v;
    *n -= 1;
    if *n == 0 {
        *slot = None;
    }
    Some(v)
}

impl Rm {
    pub(in crate::fakenv) fn inject_text(&self) -> String {
        let mut s = String::new();
        if let Some((st, n)) = self.inject.fail_alloc {
            s += &format!("fail-next-alloc {st:#x} {n}\n");
        }
        if let Some((e, n)) = self.inject.errno {
            s += &format!("errno-next-ioctl {e} {n}\n");
        }
        if !self.inject.delay.is_zero() {
            s += &format!("delay-ioctl-ms {}\n", self.inject.delay.as_millis());
        }
        if let Some(((cmd, st), n)) = self.inject.fail_control {
            s += &format!("fail-control {cmd:#x} {st:#x} {n}\n");
        }
        match self.runlist {
            Runlist::Stop => s += "runlist stop\n",
            Runlist::Channels => s += "runlist channels\n",
            Runlist::Record => {}
        }
        s
    }

    /// Applies one line of the `inject` grammar (see [`FakeNv::inject`]).
    pub(in crate::fakenv) fn apply_inject(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| parse_num(s).ok_or_else(|| format!("bad number {s:?}"));
        let count = |w: Option<&&str>| w.map_or(Ok(1), |s| num(s)).map(|n| n.max(1));
        match words.as_slice() {
            [] => Ok(()),
            [w, ..] if w.starts_with('#') => Ok(()),
            ["fail-next-alloc", st, rest @ ..] if rest.len() <= 1 => {
                self.inject.fail_alloc = Some((num(st)? as u32, count(rest.first())?));
                Ok(())
            }
            ["errno-next-ioctl", e, rest @ ..] if rest.len() <= 1 => {
                let e = num(e)? as i32;
                if e <= 0 {
                    return Err("errno must be positive".into());
                }
                self.inject.errno = Some((e, count(rest.first())?));
                Ok(())
            }
            ["fail-control", cmd, st, rest @ ..] if rest.len() <= 1 => {
                let cmd = num(cmd)? as u32;
                self.inject.fail_control = Some(((cmd, num(st)? as u32), count(rest.first())?));
                Ok(())
            }
            ["runlist", "stop"] => {
                self.runlist = Runlist::Stop;
                self.apply_runlist();
                Ok(())
            }
            ["runlist", "record"] => {
                self.runlist = Runlist::Record;
                self.apply_runlist();
                Ok(())
            }
            ["runlist", "channels"] => {
                self.runlist = Runlist::Channels;
                self.apply_runlist();
                Ok(())
            }
            ["delay-ioctl-ms", ms] => {
                self.inject.delay = Duration::from_millis(num(ms)?);
                Ok(())
            }
            ["capacity", gpu, bytes] => {
                let g = num(gpu)? as usize;
                let bytes = parse_size(bytes).ok_or_else(|| format!("bad size {bytes:?}"))?;
                let gpu = self.gpus.get_mut(g).ok_or_else(|| format!("no GPU {g}"))?;
                gpu.capacity = bytes;
                Ok(())
            }
            ["clear"] => {
                self.inject = Inject::default();
                Ok(())
            }
            _ => Err(format!("unknown injection {line:?}")),
        }
    }
}
