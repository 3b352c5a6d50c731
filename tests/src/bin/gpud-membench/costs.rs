//! The costs of the memory view (per `FB_GET_INFO_V2` call) and of the scheduler guard (per
//! guarded control), each phase through gpud's own kernel stack.

#[allow(unused_imports)]
use super::*;

/// The memory view's cost per `FB_GET_INFO_V2` call (see the module docs): the phases' ns per
/// call of gpud's ioctl programs, and the view's state.
pub(super) fn memory_info_cost(
    o: &Opts,
    ctl: &Path,
    cg: &Path,
    rel: &str,
) -> anyhow::Result<(serde_json::Value, String)> {
    use gpud_common::rm::fb;
    let calls = o.calls;
    const CYCLES: usize = 3;
    const LIMIT: u64 = 8 << 30;
    let (mut core, _ring) = setup(o, ctl, ReactAction::Notify, "view")?;
    let state = core.memory_info();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let (c, dir) = (ctl.to_owned(), cg.to_owned());
    let unfollowed = unfollowed_run_ns();
    let setup_tenant = move || inproc::rm_tenant(&c, &dir);
    // `calls N`: N queries; replies with the last HEAP_SIZE read (KiB).
    let serve = |s: &mut (std::fs::File, [u32; 3]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let n: u64 = req
            .strip_prefix("calls ")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut heap = 0;
        for _ in 0..n {
            let (_, pairs) = rm.fb_info_v2(
                s.1[0],
                s.1[2],
                &[fb::HEAP_FREE, fb::HEAP_SIZE, fb::FB_TAX_SIZE_KB],
            );
            heap = pairs.get(1).map_or(0, |p| p.1);
        }
        heap.to_string()
    };
    let mut tenant = inproc::fork_serving(setup_tenant, serve)?;
    let (_, id) = core.attribution.id_of(rel)?;
    let phases = [
        ("unlimited", false, true),
        ("limited_view_off", true, false),
        ("limited_view_on", true, true),
    ];
    // The phases alternate, CYCLES times; the median of each counts.
    let mut per_call: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    for _ in 0..CYCLES {
        for (i, (name, limit, view)) in phases.into_iter().enumerate() {
            if limit {
                core.settings.set_limit(id, gpud_common::GPU_ALL, LIMIT)?;
            } else {
                core.settings.clear_limit(id, gpud_common::GPU_ALL)?;
            }
            core.probes.set_memory_info(view)?;
            if name == "limited_view_on" && core.memory_info() != "on" {
                continue;
            }
            let before = prog_stats();
            let heap: u64 = tenant.ask(&format!("calls {calls}"))?.parse()?;
            let spent: f64 = on_ioctls(&stats_since(&before), calls, &unfollowed)
                .values()
                .sum();
            let rewritten = heap == LIMIT >> 10;
            ensure!(
                rewritten == (name == "limited_view_on"),
                "{name}: the process read a heap of {heap} KiB"
            );
            per_call[i].push(spent / calls as f64);
        }
    }
    let phases: serde_json::Map<String, serde_json::Value> = phases
        .iter()
        .zip(per_call)
        .map(|((name, ..), v)| {
            let value = if v.is_empty() {
                serde_json::Value::Null
            } else {
                json!(median(v))
            };
            ((*name).to_owned(), value)
        })
        .collect();
    tenant.release();
    core.settings.clear_limit(id, gpud_common::GPU_ALL)?;
    core.close(false);
    Ok((serde_json::Value::Object(phases), state))
}

/// The scheduler guard's cost per call (see the module docs): the phases' ns per call of gpud's
/// ioctl programs, and the guard's state.
pub(super) fn scheduler_guard_cost(
    o: &Opts,
    ctl: &Path,
    cg: &Path,
) -> anyhow::Result<(serde_json::Value, String)> {
    use gpud::config::GuardMode;
    use gpud_common::rm::fb;
    let calls = o.calls;
    const CYCLES: usize = 3;
    let (mut core, mut ring) = setup(o, ctl, ReactAction::Notify, "guard")?;
    core.probes.set_memory_info(false)?;
    let state = core.scheduler_guard();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let unfollowed = unfollowed_run_ns();
    let (c, dir) = (ctl.to_owned(), cg.to_owned());
    let setup_tenant = move || {
        let (f, [client, dev, sub]) = inproc::rm_tenant(&c, &dir)?;
        let g = Ctl::new(&f).alloc_channel_group(client, dev);
        if !g.ok() {
            return Err(format!("channel group: {g:?}"));
        }
        Ok((f, [client, sub, g.handle]))
    };
    // `fbinfo N` or `timeslice N`: N calls; replies with the last RM status.
    let serve = |s: &mut (std::fs::File, [u32; 3]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, sub, group] = s.1;
        let (what, n) = req.split_once(' ').unwrap_or((req, "0"));
        let n: u64 = n.parse().unwrap_or(0);
        let mut status = u32::MAX;
        for _ in 0..n {
            status = if what == "fbinfo" {
                rm.fb_info_v2(
                    client,
                    sub,
                    &[fb::HEAP_FREE, fb::HEAP_SIZE, fb::FB_TAX_SIZE_KB],
                )
                .0
                .status
            } else {
                rm.set_timeslice(client, group, 1_000_000).status
            };
        }
        status.to_string()
    };
    let mut tenant = inproc::fork_serving(setup_tenant, serve)?;
    let phases = [
        ("ordinary_guard_off", "fbinfo", GuardMode::Off),
        ("ordinary_guard_on", "fbinfo", GuardMode::Enforce),
        ("set_timeslice_guarded", "timeslice", GuardMode::Enforce),
    ];
    let mut per_call: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    for _ in 0..CYCLES {
        for (i, (name, what, mode)) in phases.into_iter().enumerate() {
            core.probes.set_guard(mode)?;
            let before = prog_stats();
            let status = tenant.ask(&format!("{what} {calls}"))?;
            let spent: f64 = on_ioctls(&stats_since(&before), calls, &unfollowed)
                .values()
                .sum();
            ensure!(status == "0", "{name}: the driver answered status {status}");
            per_call[i].push(spent / calls as f64);
            // The guard's reports of this phase, read so the ring never fills.
            while ring.next().is_some() {}
        }
    }
    let guarded = core
        .attribution
        .counters()?
        .stats()
        .get("sched_guarded")
        .copied();
    ensure!(
        guarded == Some(calls * CYCLES as u64),
        "the guard saw {guarded:?} of {} timeslices",
        calls * CYCLES as u64
    );
    let phases: serde_json::Map<String, serde_json::Value> = phases
        .iter()
        .zip(per_call)
        .map(|((name, ..), v)| ((*name).to_owned(), json!(median(v))))
        .collect();
    tenant.release();
    core.close(false);
    Ok((serde_json::Value::Object(phases), state))
}

/// Where an alloc+free pair's time goes (see the module docs): gpud's programs' run time per
/// call, allocations and frees apart, each program apart; and what the calls sent through the
/// ring and cost gpud's state code to handle.
/// `clock`: what the run-time statistics add to each run ([`super::stats_clock_ns`]), taken out
/// of `programs_net_ns_per_pair`.
pub(super) fn pair_breakdown(
    o: &Opts,
    ctl: &Path,
    cg: &Path,
    clock: f64,
) -> anyhow::Result<serde_json::Value> {
    const CYCLES: usize = 3;
    let n = o.pairs * o.rounds as u64;
    let (mut core, mut ring) = setup(o, ctl, ReactAction::Notify, "pair")?;
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let unfollowed = unfollowed_run_ns();
    let (c, dir) = (ctl.to_owned(), cg.to_owned());
    let setup_tenant = move || inproc::rm_tenant(&c, &dir).map(|(f, h)| (f, h, Vec::new()));
    // `alloc N`: N allocations of 2 MiB, kept; `free`: frees them. Replies with the count done.
    let serve = |s: &mut (std::fs::File, [u32; 3], Vec<u32>), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, device, _] = s.1;
        if let Some(k) = req
            .strip_prefix("alloc ")
            .and_then(|k| k.parse::<u64>().ok())
        {
            for _ in 0..k {
                let a = rm.alloc_vidmem(client, device, 2 * MIB, Form::Nvos64);
                if !a.ok() {
                    return format!("alloc: {a:?}");
                }
                s.2.push(a.handle);
            }
            return s.2.len().to_string();
        }
        let mut freed = 0;
        for h in s.2.drain(..) {
            freed += usize::from(rm.free(client, h).ok());
        }
        freed.to_string()
    };
    let mut tenant = inproc::fork_serving(setup_tenant, serve)?;
    // Per phase (alloc, free): program → ns per call of each cycle; notices and drain time.
    let mut per_prog: [std::collections::BTreeMap<String, Vec<f64>>; 2] = Default::default();
    let mut notices = [0usize; 2];
    let mut drain_ns = [0u128; 2];
    for _ in 0..CYCLES {
        for (i, request) in [format!("alloc {n}"), "free".to_owned()].iter().enumerate() {
            core.drain(&mut ring, |_| ());
            let before = prog_stats();
            let done = tenant.ask(request)?;
            ensure!(
                done == n.to_string(),
                "{request}: the tenant replied {done:?}"
            );
            for (name, spent) in on_ioctls(&stats_since(&before), n, &unfollowed) {
                if spent > 0.0 {
                    per_prog[i].entry(name).or_default().push(spent / n as f64);
                }
            }
            let t = Instant::now();
            notices[i] += core.drain(&mut ring, |_| ()).len();
            drain_ns[i] += t.elapsed().as_nanos();
        }
    }
    tenant.release();
    core.close(false);
    let calls = (n * CYCLES as u64) as f64;
    let phase = |i: usize| {
        let programs: serde_json::Map<String, serde_json::Value> = per_prog[i]
            .iter()
            .map(|(k, v)| (k.clone(), json!(median(v.clone()))))
            .collect();
        let total: f64 = per_prog[i].values().map(|v| median(v.clone())).sum();
        json!({
            "programs_ns_per_call": programs,
            "programs_total_ns_per_call": total,
            "ring_notices_per_call": notices[i] as f64 / calls,
            "state_code_ns_per_call": drain_ns[i] as f64 / calls,
        })
    };
    let (alloc, free) = (phase(0), phase(1));
    let runs_per_pair: usize = per_prog.iter().map(|p| p.len()).sum();
    let per_pair = alloc["programs_total_ns_per_call"]
        .as_f64()
        .unwrap_or(f64::NAN)
        + free["programs_total_ns_per_call"]
            .as_f64()
            .unwrap_or(f64::NAN);
    Ok(json!({
        "calls_per_phase": n,
        "cycles": CYCLES,
        "alloc": alloc,
        "free": free,
        "programs_ns_per_pair": per_pair,
        "programs_net_ns_per_pair": per_pair - runs_per_pair as f64 * clock,
        "stats_clock_ns_per_run": clock,
        // What the other system calls' runs were taken out at (see `on_ioctls`).
        "unfollowed_run_ns": unfollowed,
    }))
}
