//! The scheduler guard's tenants and their calls: well-formed, malformed and fuzzed scheduling controls issued from forked processes.

#[allow(unused_imports)]
use super::*;

/// A tenant for the scheduler guard: its own client, device 0, subdevice, channel group and
/// channel on the fake control device, answering `ids`, `ts US` (set, then read back), `get`,
/// `schedule 0|1` (its group off or on the runlist), `race-disable CLIENT CHANNEL N WAIT_MS` (see
/// [`gpud_tests::rm::attack::race_disable`]), `fuzz SEED N CLIENT CHANNEL` (see
/// [`guard_fuzz`]),
/// `disable|enable CLIENT CHANNEL`, `ctl NAME` (a control tenants may not use) and `malformed`.
pub(super) fn guard_tenant(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
) -> anyhow::Result<inproc::Serving> {
    use gpud_common::rm::{sched, tsg};
    use gpud_tests::rm::{Ctl, Reply};
    let (c, dir) = (ctl.to_owned(), cgroup.to_owned());
    let setup = move || {
        let (f, [client, dev, sub]) = inproc::rm_tenant(&c, &dir)?;
        let rm = Ctl::new(&f);
        let tsg = rm.alloc_channel_group(client, dev);
        if !tsg.ok() {
            return Err(format!("channel group: {tsg:?}"));
        }
        let chan = rm
            .alloc_channel(client, tsg.handle)
            .map_err(|r| format!("channel: {r:?}"))?;
        Ok((f, [client, sub, tsg.handle, chan]))
    };
    let said = |r: Reply| format!("errno={} status={:#x}", r.errno, r.status);
    let serve = move |s: &mut (std::fs::File, [u32; 4]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, sub, tsg, chan] = s.1;
        let num = |v: &str| u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap_or(0);
        match req.split_whitespace().collect::<Vec<_>>()[..] {
            ["ids"] => format!("{client:#x} {tsg:#x} {chan:#x}"),
            ["ts", us] => {
                let r = rm.set_timeslice(client, tsg, us.parse().unwrap_or(0));
                let (_, got) = rm.get_timeslice(client, tsg);
                format!("{} got={got}", said(r))
            }
            ["get"] => rm.get_timeslice(client, tsg).1.to_string(),
            // `GET_TIMESLICE` calls a second thread turns into `SET_TIMESLICE` while in flight.
            ["race", us, n] => {
                let r = gpud_tests::rm::attack::race_timeslice(
                    &rm,
                    client,
                    tsg,
                    us.parse().unwrap_or(0),
                    n.parse().unwrap_or(0),
                );
                format!("calls={} refused={}", r.calls, r.refused)
            }
            // Disables of its own channel whose list a second thread points at (CLIENT,
            // CHANNEL) WAIT_MS into each call.
            ["race-disable", vc, vch, n, wait_ms] => {
                let r = gpud_tests::rm::attack::race_disable(
                    &rm,
                    (client, sub, chan),
                    (num(vc) as u32, num(vch) as u32),
                    n.parse().unwrap_or(0),
                    Some(std::time::Duration::from_millis(
                        wait_ms.parse().unwrap_or(0),
                    )),
                );
                format!(
                    "calls={} refused={} failed={}",
                    r.calls, r.refused, r.failed
                )
            }
            ["schedule", on] => {
                let mut p = tsg::ScheduleParams {
                    enable: u8::from(on == "1"),
                    ..Default::default()
                };
                said(rm.control(client, tsg, tsg::GPFIFO_SCHEDULE, &mut p))
            }
            [verb @ ("disable" | "enable"), c, h] => said(rm.disable_channels(
                client,
                sub,
                verb == "disable",
                &[(num(c) as u32, num(h) as u32)],
            )),
            ["ctl", name] => {
                let (object, cmd, mut params, flags) = match name {
                    "interleave" => (tsg, sched::TSG_SET_INTERLEAVE_LEVEL, vec![2, 0, 0, 0], 0),
                    "realtime" => (tsg, sched::TSG_MAKE_REALTIME, vec![1], 0),
                    "sched-policy" => (sub, sched::RUNLIST_SET_SCHED_POLICY, vec![0; 8], 0),
                    // SET_TIMESLICE of 1 s on the driver's legacy path, and serialized.
                    "legacy" => (
                        tsg,
                        tsg::SET_TIMESLICE | sched::LEGACY_BIT,
                        vec![0x40; 8],
                        0,
                    ),
                    "flags" => (
                        tsg,
                        tsg::SET_TIMESLICE,
                        1_000_000u64.to_ne_bytes().to_vec(),
                        4,
                    ),
                    _ => return format!("unknown control {name}"),
                };
                let mut p = gpud_common::rm::Nvos54 {
                    h_client: client,
                    h_object: object,
                    cmd,
                    flags,
                    params: params.as_mut_ptr() as u64,
                    params_size: params.len() as u32,
                    status: 0,
                };
                // SAFETY: `params` is live and exactly `params_size` bytes.
                said(unsafe { rm.control_nvos54(&mut p) })
            }
            ["malformed"] => guard_malformed(&rm, client, sub, tsg),
            ["fuzz", seed, n, bc, bch] => guard_fuzz(
                &rm,
                [client, sub, tsg, chan],
                (num(bc) as u32, num(bch) as u32),
                seed.parse().unwrap_or(1),
                n.parse().unwrap_or(0),
            ),
            _ => format!("unknown request {req:?}"),
        }
    };
    Ok(inproc::fork_serving(setup, serve)?)
}

/// Guarded controls the driver refuses itself (short or null parameters, an over-long list):
/// the guard leaves them alone, so each comes back refused by the driver with the caller's
/// bytes as they were. `ok`, or what went wrong.
pub(super) fn guard_malformed(
    rm: &gpud_tests::rm::Ctl<'_>,
    client: u32,
    sub: u32,
    tsg: u32,
) -> String {
    use gpud_common::rm::{sched, tsg as t};
    let mut bad = Vec::new();
    let mut short = [0xffu8; 4];
    let r = rm.sched_control(client, tsg, t::SET_TIMESLICE, &mut short);
    if r.ret != 0 || r.status == 0 || short != [0xff; 4] {
        bad.push(format!("short timeslice: {r:?} {short:?}"));
    }
    let r = rm.sched_control(client, tsg, t::SET_TIMESLICE, &mut []);
    if r.ret != 0 || r.status == 0 {
        bad.push(format!("null timeslice: {r:?}"));
    }
    // 65 channels, one past the lists: the driver's to refuse.
    let mut p = sched::DisableChannelsParams {
        disable: 1,
        num_channels: 65,
        ..Default::default()
    };
    let r = rm.control(client, sub, sched::DISABLE_CHANNELS, &mut p);
    if r.ret != 0 || r.status == 0 || p.num_channels != 65 {
        bad.push(format!("over-long list: {r:?}"));
    }
    if bad.is_empty() {
        "ok".into()
    } else {
        bad.join("; ")
    }
}

/// N corrupted guarded controls (seeded): any guarded command or its legacy alias, random
/// flags, sizes and parameter bytes (timeslices, channel lists naming the caller's own and the
/// given neighbour's client and channel), pointers valid, null or in the kernel half, directly or
/// wrapped in an XFER. The guard may only ever write the caller's own `NVOS54` and parameters;
/// what the driver ends up with is checked by the caller. `ok accepted=K`.
pub(super) fn guard_fuzz(
    rm: &gpud_tests::rm::Ctl<'_>,
    [client, sub, tsg, chan]: [u32; 4],
    (bc, bch): (u32, u32),
    seed: u64,
    n: u64,
) -> String {
    use gpud_common::rm::{self as r, sched};
    let mut next = gpud_tests::rm::xorshift(seed);
    let mut accepted = 0u64;
    for _ in 0..n {
        let row = sched::CONTROLS[(next() % sched::CONTROLS.len() as u64) as usize];
        let mut params = [0u8; 600];
        for b in params.iter_mut() {
            *b = next() as u8;
        }
        match row.cmd {
            r::tsg::SET_TIMESLICE => {
                params[..8].copy_from_slice(&(next() % 4_000_000).to_ne_bytes());
            }
            sched::DISABLE_CHANNELS => {
                let count = (next() % 70) as u32;
                params[4..8].copy_from_slice(&count.to_ne_bytes());
                params[16..24].copy_from_slice(&[0; 8]);
                for i in 0..64 {
                    let (c, h) = match next() % 3 {
                        0 => (bc, bch),
                        1 => (client, chan),
                        _ => (next() as u32, next() as u32),
                    };
                    params[24 + 4 * i..28 + 4 * i].copy_from_slice(&c.to_ne_bytes());
                    params[280 + 4 * i..284 + 4 * i].copy_from_slice(&h.to_ne_bytes());
                }
            }
            _ => {}
        }
        let cmd = if next().is_multiple_of(8) {
            row.cmd | sched::LEGACY_BIT
        } else {
            row.cmd
        };
        let size = match next() % 6 {
            0 => 0,
            1 => (next() % 600) as u32,
            _ => row.size,
        };
        let ptr = match next() % 10 {
            0 => 0,
            1 => next() | 1 << 63,
            _ => params.as_mut_ptr() as u64,
        };
        let mut p = r::Nvos54 {
            h_client: client,
            h_object: if next().is_multiple_of(2) { tsg } else { sub },
            cmd,
            flags: if next().is_multiple_of(10) {
                next() as u32 & 7
            } else {
                0
            },
            params: ptr,
            params_size: size,
            status: next() as u32,
        };
        let (ret, _) = if next().is_multiple_of(4) {
            let mut xfer = r::NvIoctlXfer {
                cmd: nv::NV_ESC_RM_CONTROL,
                size: nv::NVOS54_SIZE,
                ptr: (&mut p as *mut r::Nvos54) as u64,
            };
            let c = nv::nv_iowr(nv::NV_ESC_IOCTL_XFER_CMD, nv::NV_IOCTL_XFER_SIZE);
            // SAFETY: `xfer`, `p` and `params` (600 bytes, more than any size used) live
            // across the call; other pointers are null or kernel-half garbage.
            unsafe { rm.raw(c, (&mut xfer as *mut r::NvIoctlXfer).cast()) }
        } else {
            let c = nv::nv_iowr(nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE);
            // SAFETY: as above.
            unsafe { rm.raw(c, (&mut p as *mut r::Nvos54).cast()) }
        };
        if ret == 0 && p.status == 0 {
            accepted += 1;
        }
    }
    format!("ok accepted={accepted}")
}
