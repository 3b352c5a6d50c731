//! The scheduler guard: tenants' scheduling controls clamped, refused or undone per priority class, a neighbour's channels kept running, held groups kept off.

#[allow(unused_imports)]
use super::*;

/// The scheduler guard on the fake control device: a tenant's timeslice is lowered to its
/// allowance (the default, a latency-critical cgroup's longer one, the least over the ancestry)
/// and read back so; controls tenants may not use, legacy-path and serialized aliases are
/// refused (`EPERM` in the deny tier, turned into calls the driver rejects elsewhere); a
/// disable-channels call naming a neighbour's channel leaves it running while one naming the
/// caller's own acts; malformed calls are left to the driver; gpud's own timeslice passes;
/// `audit` lets everything through and reports it; `off` reports nothing.
pub(super) fn scheduler_guard(
    pref: AttachPreference,
    tier: TierPreference,
    hook: DenyHookPreference,
    want: AttachMode,
) -> anyhow::Result<()> {
    use gpud::{enforcement::guard, notice::GuardNotice};
    let tag = format!(
        "{}-{}-{}",
        want.as_str(),
        format!("{tier:?}").to_lowercase(),
        hook.as_str()
    );
    let _watchdog = inproc::Watchdog::arm(std::time::Duration::from_secs(150));
    let (fake, ctl) = stage(&format!("/tmp/vm-guard-{tag}"))?;
    let Opened {
        core,
        events: mut ring,
        held,
        matcher,
        ..
    } = open_stack(
        &format!("guard-{tag}"),
        &ctl,
        &[
            ("probes.attach", pref.as_str()),
            ("enforcement.tier", tier.as_str()),
            ("enforcement.deny_hook", hook.as_str()),
        ],
    )
    .context("opening gpud's kernel stack")?;
    let (mut probes, mut attribution, mut settings, root) = parts(core, Some(want))?;
    let deny = probes.tier() == Tier::Deny;
    let held = gpud::enforcement::compute::channel::HeldGroups::new(held);
    let want_state = if deny {
        "enforce (deny, rewrite)"
    } else {
        "enforce (rewrite)"
    };
    ensure!(
        probes.guard().describe() == want_state,
        "guard {}",
        probes.guard().describe()
    );
    let base = format!("/vm-guard-{tag}");
    let (pa, pb, lc, be) = (
        format!("{base}/a"),
        format!("{base}/b"),
        format!("{base}/lc"),
        format!("{base}/lc/be"),
    );
    for p in [&base, &pa, &pb, &lc, &be] {
        std::fs::create_dir_all(root.join(&p[1..]))?;
    }
    let (_, id_lc) = attribution.id_of(&lc)?;
    let (_, id_be) = attribution.id_of(&be)?;
    let (lc_us, be_us) = (16_384, 128);
    settings.set_sched_allowance(id_lc, Some(lc_us))?;
    settings.set_sched_allowance(id_be, Some(be_us))?;
    let mut drain = |attribution: &mut Attribution| -> Vec<GuardNotice> {
        let mut out = Vec::new();
        while let Some(item) = ring.next() {
            match Record::decode(&item) {
                Ok(Record::Event(KernelEvent::SchedulerGuarded(g))) => {
                    out.push(guard::on_event(attribution, &g));
                }
                Ok(Record::Event(ev)) => attribution.on_kernel_event(&ev),
                _ => {}
            }
        }
        out
    };
    let seen = |n: &[GuardNotice]| {
        n.iter()
            .map(|n| format!("{}:{}:{}", n.control, n.action.as_str(), n.reason.as_str()))
            .collect::<Vec<_>>()
            .join(",")
    };

    println!("[guard-{tag}] probes attached, starting tenants");
    let mut a = guard_tenant(&ctl, &root.join(&pa[1..]))?;
    let mut b = guard_tenant(&ctl, &root.join(&pb[1..]))?;
    let mut l = guard_tenant(&ctl, &root.join(&lc[1..]))?;
    let mut e = guard_tenant(&ctl, &root.join(&be[1..]))?;
    let ids = |t: &mut inproc::Serving| -> anyhow::Result<Vec<String>> {
        Ok(t.ask("ids")?.split(' ').map(str::to_owned).collect())
    };
    let (ia, ib) = (ids(&mut a)?, ids(&mut b)?);
    drain(&mut attribution);

    // Timeslices: at most the allowance, read back as such; below it, untouched.
    let ok_got = |us: u64| format!("errno=0 status=0x0 got={us}");
    ensure!(a.ask("ts 1000")? == ok_got(1000), "a: 1000 µs");
    ensure!(a.ask("ts 1000000")? == ok_got(2048), "a: 1 s");
    ensure!(l.ask("ts 10000")? == ok_got(10_000), "lc: 10 ms");
    ensure!(l.ask("ts 1000000")? == ok_got(lc_us), "lc: 1 s");
    ensure!(e.ask("ts 1000000")? == ok_got(be_us), "be under lc: 1 s");
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == ["SET_TIMESLICE:clamped:timeslice"; 3].join(","),
        "timeslice reports: {n:?}"
    );
    ensure!(
        n[0].cgroup == pa && n[0].requested == 1_000_000 && n[0].allowed == 2048,
        "report: {:?}",
        n[0]
    );
    println!("[guard-{tag}] timeslices lowered to the allowances");

    // A neighbour's channel: refused; the caller's own: done.
    let refused = if deny {
        "errno=1 status=0x0".to_owned()
    } else {
        format!(
            "errno=0 status={:#x}",
            gpud_common::rm::status::NV_ERR_INVALID_ARGUMENT
        )
    };
    let chan_enabled = |f: &gpud_tests::fakenv::FakeNv, ids: &[String]| {
        f.snapshot()
            .channels
            .iter()
            .find(|c| format!("{:#x}", c.handle) == ids[2] && format!("{:#x}", c.client) == ids[0])
            .map(|c| c.enabled)
    };
    // `t` disables the channel `ids` names (the driver takes it), the fake device shows it
    // disabled, and `t` enables it again; `what` names the step in errors.
    let disable_and_enable = |t: &mut inproc::Serving, ids: &[String], what: &str| {
        let r = t.ask(&format!("disable {} {}", ids[0], ids[2]))?;
        ensure!(r == "errno=0 status=0x0", "{what}: disable: {r}");
        ensure!(
            chan_enabled(&fake, ids) == Some(false),
            "{what}: the channel is still enabled"
        );
        let r = t.ask(&format!("enable {} {}", ids[0], ids[2]))?;
        ensure!(r == "errno=0 status=0x0", "{what}: enable: {r}");
        anyhow::Ok(())
    };
    let r = a.ask(&format!("disable {} {}", ib[0], ib[2]))?;
    ensure!(r == refused, "a disables b's channel: {r}");
    ensure!(
        chan_enabled(&fake, &ib) == Some(true),
        "b's channel was disabled"
    );
    disable_and_enable(&mut a, &ia, "a's own channel")?;
    let n = drain(&mut attribution);
    ensure!(
        seen(&n)
            == format!(
                "FIFO_DISABLE_CHANNELS:{}:foreign-client",
                if deny { "denied" } else { "refused" }
            ),
        "disable-channels reports: {n:?}"
    );
    println!("[guard-{tag}] a neighbour's channels are out of reach");

    // Controls no tenant may use, and the aliases that would hide one.
    let before = fake.snapshot().controls;
    for name in ["interleave", "realtime", "sched-policy", "legacy", "flags"] {
        let r = a.ask(&format!("ctl {name}"))?;
        if deny {
            ensure!(r == refused, "{name}: {r}");
        } else {
            ensure!(
                r.starts_with("errno=0 status=0x") && r != "errno=0 status=0x0",
                "{name}: {r}"
            );
        }
    }
    ensure!(
        fake.snapshot().controls == before,
        "a refused control reached the driver"
    );
    ensure!(
        a.ask("get")? == "2048",
        "a's timeslice changed: {}",
        a.ask("get")?
    );
    let n = drain(&mut attribution);
    let act = if deny { "denied" } else { "refused" };
    ensure!(
        seen(&n)
            == format!(
                "TSG_SET_INTERLEAVE_LEVEL:{act}:forbidden,MAKE_REALTIME:{act}:forbidden,\
                 FIFO_RUNLIST_SET_SCHED_POLICY:{act}:forbidden,\
                 SET_TIMESLICE(legacy 0xa06c8103):{act}:legacy-path,SET_TIMESLICE:{act}:flags"
            ),
        "refusal reports: {n:?}"
    );
    ensure!(a.ask("malformed")? == "ok", "malformed calls");
    ensure!(
        drain(&mut attribution).is_empty(),
        "malformed calls reported"
    );
    println!("[guard-{tag}] forbidden controls refused, malformed ones left to the driver");

    // gpud's own control, issued through the tenant's file as the compute law does.
    let pid_a = a.pid;
    let groups = attribution
        .tenant_objects(&[pid_a].into())
        .remove(&pid_a)
        .unwrap_or_default()
        .groups;
    ensure!(groups.len() == 1, "a's channel groups: {groups:?}");
    let mut controls = gpud::enforcement::compute::channel::Controls::new(matcher, Some(held));
    controls
        .timeslice(&groups[0], 1_000_000)
        .map_err(|e| anyhow::anyhow!("gpud's own timeslice: {e}"))?;
    ensure!(
        a.ask("get")? == "1000000",
        "gpud's own timeslice: {}",
        a.ask("get")?
    );
    ensure!(
        drain(&mut attribution).is_empty(),
        "gpud's own call reported"
    );
    println!("[guard-{tag}] gpud's own control passes");

    // A group gpud holds off the runlist: its owner's enable does nothing until gpud puts it
    // back; its own disable, and enables outside the hold, pass.
    let on_runlist = |f: &gpud_tests::fakenv::FakeNv| {
        f.snapshot()
            .channel_groups
            .iter()
            .find(|g| g.client == groups[0].client && g.handle == groups[0].handle)
            .map(|g| g.enabled)
    };
    let ok = "errno=0 status=0x0";
    controls
        .schedule(&groups[0], false)
        .map_err(|e| anyhow::anyhow!("gpud holds a's group off: {e}"))?;
    ensure!(on_runlist(&fake) == Some(false), "gpud's hold");
    ensure!(a.ask("schedule 1")? == ok, "a's enable while held");
    ensure!(
        on_runlist(&fake) == Some(false),
        "a put its group back while held"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == "TSG_GPFIFO_SCHEDULE:refused:held-off",
        "hold reports: {n:?}"
    );
    controls
        .schedule(&groups[0], true)
        .map_err(|e| anyhow::anyhow!("gpud puts a's group back: {e}"))?;
    ensure!(
        a.ask("schedule 0")? == ok && a.ask("schedule 1")? == ok,
        "a's own schedule"
    );
    ensure!(on_runlist(&fake) == Some(true), "a's group after the hold");
    ensure!(
        drain(&mut attribution).is_empty(),
        "schedules outside a hold reported"
    );
    println!("[guard-{tag}] a group gpud holds off stays off");

    // Channels gpud holds disabled (its lever where the firmware ignores the runlist): their
    // owner's own enable does nothing until gpud enables them; outside the hold it passes.
    let objs = attribution
        .tenant_objects(&[pid_a].into())
        .remove(&pid_a)
        .unwrap_or_default();
    ensure!(
        objs.channels.len() == 1 && objs.subdevices.len() == 1,
        "a's channels and subdevices: {objs:?}"
    );
    let hold = |controls: &mut gpud::enforcement::compute::channel::Controls, on: bool| {
        controls
            .disable_channels(pid_a, objs.subdevices[0], &objs.channels, on)
            .map_err(|e| anyhow::anyhow!("gpud's FIFO_DISABLE_CHANNELS {on}: {e}"))
    };
    hold(&mut controls, true)?;
    ensure!(
        chan_enabled(&fake, &ia) == Some(false),
        "gpud's channel hold"
    );
    ensure!(
        a.ask(&format!("enable {} {}", ia[0], ia[2]))? == ok,
        "a's channel enable while held"
    );
    ensure!(
        chan_enabled(&fake, &ia) == Some(false),
        "a enabled its channel while held"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == "FIFO_DISABLE_CHANNELS:refused:held-off",
        "channel hold reports: {n:?}"
    );
    hold(&mut controls, false)?;
    ensure!(
        chan_enabled(&fake, &ia) == Some(true),
        "a's channel after the hold"
    );
    ensure!(
        a.ask(&format!("disable {} {}", ia[0], ia[2]))? == ok
            && a.ask(&format!("enable {} {}", ia[0], ia[2]))? == ok,
        "a's own disable and enable"
    );
    ensure!(
        drain(&mut attribution).is_empty(),
        "channel controls outside a hold reported"
    );
    println!("[guard-{tag}] channels gpud holds disabled stay disabled");

    // audit: everything through, and reported; off: nothing looked at.
    probes.set_guard(gpud::config::GuardMode::Audit)?;
    ensure!(a.ask("ts 1000000")? == ok_got(1_000_000), "audit: 1 s");
    disable_and_enable(&mut a, &ib, "audit: a disables b's channel")?;
    let n = drain(&mut attribution);
    ensure!(
        seen(&n)
            == "SET_TIMESLICE:audited:timeslice,FIFO_DISABLE_CHANNELS:audited:foreign-client,\
                FIFO_DISABLE_CHANNELS:audited:foreign-client",
        "audit reports: {n:?}"
    );
    probes.set_guard(gpud::config::GuardMode::Off)?;
    ensure!(a.ask("ts 999999")? == ok_got(999_999), "off: timeslice");
    ensure!(drain(&mut attribution).is_empty(), "off: reported");
    let stats = attribution.counters()?.stats();
    ensure!(
        // 3 lowered, 1 foreign list, 5 refusals, 1 held group, 1 held channel, 3 in audit.
        stats.get("sched_guarded") == Some(&14),
        "kernel stats {stats:?}"
    );

    // Corrupted calls from the best-effort tenant, guard enforcing: whatever got through, the
    // driver holds no timeslice above its allowance, no interleave or realtime, and the
    // neighbour's channel runs.
    probes.set_guard(gpud::config::GuardMode::Enforce)?;
    let ie = ids(&mut e)?;
    let hex = |s: &str| u32::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0);
    let (ec, eg) = (hex(&ie[0]), hex(&ie[1]));
    let refused_before: Vec<u64> = {
        let snap = fake.snapshot();
        gpud_common::rm::sched::CONTROLS
            .iter()
            .filter(|c| c.rule == gpud_common::rm::sched::Rule::Refuse)
            .map(|c| snap.control_count(c.cmd))
            .collect()
    };
    for seed in [3u64, 17, 2026] {
        let r = e.ask(&format!("fuzz {seed} 300 {} {}", ib[0], ib[2]))?;
        ensure!(r.starts_with("ok accepted="), "fuzz {seed}: {r}");
        let snap = fake.snapshot();
        let g = snap
            .channel_group(ec, eg)
            .ok_or_else(|| anyhow::anyhow!("e's group gone after fuzz {seed}"))?;
        ensure!(
            g.timeslice_us <= be_us && g.interleave == 0 && !g.realtime,
            "fuzz {seed}: e's group {g:?}"
        );
        ensure!(
            chan_enabled(&fake, &ib) == Some(true),
            "fuzz {seed}: b's channel disabled"
        );
        let refused_now: Vec<u64> = gpud_common::rm::sched::CONTROLS
            .iter()
            .filter(|c| c.rule == gpud_common::rm::sched::Rule::Refuse)
            .map(|c| snap.control_count(c.cmd))
            .collect();
        ensure!(
            refused_now == refused_before,
            "fuzz {seed}: a refused control reached the driver"
        );
    }
    drain(&mut attribution);
    println!("[guard-{tag}] corrupted calls: nothing past the guard");

    for t in [a, b, l, e] {
        t.release();
    }
    drop(attribution);
    probes.shutdown(false);
    drop(fake);
    for p in [&be, &lc, &pa, &pb, &base] {
        let _ = std::fs::remove_dir(root.join(&p[1..]));
    }
    println!("[guard-{tag}] scheduler guard checks passed");
    Ok(())
}
