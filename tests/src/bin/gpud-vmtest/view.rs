//! The in-container memory view: what a limited cgroup's tenants read from `FB_GET_INFO_V2`, and malformed calls left alone.

#[allow(unused_imports)]
use super::*;

/// The FB info indices a tenant asks for: every size and free index the view lowers, and two it
/// leaves alone (the bus width and the vGPU tax).
pub(super) const VIEW_INDICES: [u32; 9] = [
    fb::HEAP_SIZE,
    fb::TOTAL_RAM_SIZE,
    fb::RAM_SIZE,
    fb::USABLE_RAM_SIZE,
    fb::MAPPABLE_HEAP_SIZE,
    fb::HEAP_FREE,
    fb::LARGEST_FREE_REGION_SIZE_KB,
    fb::BUS_WIDTH,
    fb::FB_TAX_SIZE_KB,
];

/// What a tenant read: FB info value by index, and the VID_HEAP_CONTROL INFO figures.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Seen {
    fb: std::collections::BTreeMap<u32, u64>,
    heap: [u64; 3],
}

impl Seen {
    /// What the driver says of a GPU of `capacity` bytes with `used` allocated (in KiB for the
    /// list; the fake models the H100's 480 MiB reserve and 5120-bit bus).
    fn real(capacity: u64, used: u64) -> Self {
        Self::of(capacity, capacity + (480 << 20), capacity - used)
    }

    /// A view: heap `total`, whole memory `ram`, `free`, all in bytes.
    fn of(total: u64, ram: u64, free: u64) -> Self {
        let k = |b: u64| b >> 10;
        let fb = [
            (fb::HEAP_SIZE, k(total)),
            (fb::TOTAL_RAM_SIZE, k(ram)),
            (fb::RAM_SIZE, k(ram)),
            (fb::USABLE_RAM_SIZE, k(ram)),
            (fb::MAPPABLE_HEAP_SIZE, k(total)),
            (fb::HEAP_FREE, k(free)),
            (fb::LARGEST_FREE_REGION_SIZE_KB, k(free)),
            (fb::BUS_WIDTH, 5120),
            (fb::FB_TAX_SIZE_KB, 0),
        ]
        .into_iter()
        .collect();
        Self {
            fb,
            heap: [total, free, free],
        }
    }

    /// The view of a cgroup limited to `limit` with `headroom` left: every size is the limit.
    fn limited(limit: u64, headroom: u64) -> Self {
        Self::of(limit, limit, headroom)
    }

    fn parse(reply: &str) -> anyhow::Result<Self> {
        let mut fb = std::collections::BTreeMap::new();
        let mut heap = [0; 3];
        for (i, word) in reply.split_whitespace().enumerate() {
            let (k, v) = word.split_once('=').context(reply.to_owned())?;
            let v: u64 = v.parse().context(reply.to_owned())?;
            match k {
                "st" | "hst" => ensure!(v == 0, "status {v} in {reply}"),
                "total" => heap[0] = v,
                "free" => heap[1] = v,
                "largest" => heap[2] = v,
                _ => {
                    fb.insert(k.parse().context(reply.to_owned())?, v);
                }
            }
            ensure!(i < 32, "long reply {reply}");
        }
        Ok(Self { fb, heap })
    }
}

/// A process in a cgroup with its own client, device 0 and subdevice on the fake control device,
/// answering `alloc MIB`, `view` and `malformed`.
pub(super) fn tenant(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
) -> anyhow::Result<inproc::Serving> {
    use gpud_tests::rm::{Ctl, Form};
    const MIB: u64 = 1 << 20;
    let (c, dir) = (ctl.to_owned(), cgroup.to_owned());
    let setup = move || inproc::rm_tenant(&c, &dir);
    let serve = |s: &mut (std::fs::File, [u32; 3]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, dev, sub] = s.1;
        match req.split_whitespace().collect::<Vec<_>>()[..] {
            ["alloc", mib] => {
                let mib: u64 = mib.parse().unwrap_or(0);
                let r = rm.alloc_vidmem(client, dev, mib * MIB, Form::Nvos64);
                if r.ok() {
                    "ok".into()
                } else {
                    format!("refused errno={} status={}", r.errno, r.status)
                }
            }
            ["view"] => {
                let (r, pairs) = rm.fb_info_v2(client, sub, &VIEW_INDICES);
                let (h, [total, free, largest]) = rm.vidheap_info(client, dev);
                let mut out = format!("st={} hst={}", r.status, h.status);
                for (i, v) in pairs {
                    out += &format!(" {i}={v}");
                }
                out + &format!(" total={total} free={free} largest={largest}")
            }
            ["malformed"] => malformed(&rm, client, sub),
            _ => format!("unknown request {req:?}"),
        }
    };
    Ok(inproc::fork_serving(setup, serve)?)
}

/// Calls the driver refuses (empty list, a list past the maximum, parameters shorter than the
/// struct, a null parameter pointer): the replies must stay as the caller wrote them. `ok`, or
/// what went wrong.
pub(super) fn malformed(rm: &gpud_tests::rm::Ctl<'_>, client: u32, sub: u32) -> String {
    const SENTINEL: u32 = 0xdead_beef;
    let mut bad = Vec::new();
    for (name, count, size) in [
        ("empty list", 0u32, 1028u32),
        ("list past the maximum", 200, 1028),
        ("short parameters", 1, 12),
        ("null parameters", 1, 1028),
    ] {
        let mut p = fb::GetInfoV2Params {
            list_size: count,
            ..Default::default()
        };
        for e in &mut p.list {
            *e = fb::Info {
                index: fb::HEAP_SIZE,
                data: SENTINEL,
            };
        }
        let ptr = if name == "null parameters" {
            std::ptr::null_mut()
        } else {
            gpud_tests::rm::bytes_of_mut(&mut p).as_mut_ptr()
        };
        // SAFETY: `p` is 1028 bytes, at least `size`; a null pointer is the driver's to refuse.
        let r = unsafe { rm.control_raw(client, sub, fb::GET_INFO_V2, ptr, size) };
        if r.ret != 0 || r.status == 0 {
            bad.push(format!("{name}: accepted or failed ({r:?})"));
        }
        if p.list.iter().any(|e| e.data != SENTINEL) {
            bad.push(format!("{name}: the reply was written"));
        }
    }
    if bad.is_empty() {
        "ok".into()
    } else {
        bad.join("; ")
    }
}

/// The in-container memory view on the fake control device: limited cgroups read their limit as
/// the GPU's size and their headroom as its free memory (the smallest over their ancestors),
/// following allocations and limit changes while they run; an unlimited sibling reads the
/// driver's figures; indices the view does not own, and refused calls, are left as they are;
/// turning the view off (a reload) or clearing the limits gives the real figures back.
pub(super) fn memory_view(pref: AttachPreference, want: AttachMode) -> anyhow::Result<()> {
    const MIB: u64 = 1 << 20;
    let tag = want.as_str();
    // A hang in the VM prints where every thread and child waits instead of timing out mute.
    let _watchdog = inproc::Watchdog::arm(std::time::Duration::from_secs(150));
    let opts = gpud_tests::fakenv::Options::default();
    let capacity = opts.capacity;
    let fake =
        gpud_tests::fakenv::mount(std::path::Path::new(&format!("/tmp/vm-view-{tag}")), opts)
            .context("mounting the fake NVIDIA device")?;
    let ctl = fake.ctl();
    let Opened { core, .. } = open_stack(
        &format!("view-{tag}"),
        &ctl,
        &[("probes.attach", pref.as_str())],
    )
    .context("opening gpud's kernel stack")?;
    let (mut probes, mut attribution, mut settings, root) = parts(core, Some(want))?;
    ensure!(
        probes.caps().probe_write_user && *probes.memory_info() == MemoryInfoState::On,
        "memory view {:?} (caps {:?})",
        probes.memory_info(),
        probes.caps()
    );
    let deny = probes.tier() == Tier::Deny;
    let parent = format!("/vm-view-{tag}");
    let (pc, pd, sib) = (
        format!("{parent}/c"),
        format!("{parent}/d"),
        format!("{parent}-sibling"),
    );
    for p in [&parent, &pc, &pd, &sib] {
        std::fs::create_dir_all(root.join(&p[1..]))?;
    }
    let (_, id_parent) = attribution.id_of(&parent)?;
    let (_, id_c) = attribution.id_of(&pc)?;
    settings.set_limit(id_parent, gpud_common::GPU_ALL, 32 * MIB)?;
    settings.set_limit(id_c, 0, 48 * MIB)?;

    println!("[view-{tag}] probes attached, starting tenants");
    let mut c = tenant(&ctl, &root.join(&pc[1..]))?;
    let mut d = tenant(&ctl, &root.join(&pd[1..]))?;
    let mut s = tenant(&ctl, &root.join(&sib[1..]))?;
    println!("[view-{tag}] tenants ready");
    let view = |t: &mut inproc::Serving| -> anyhow::Result<Seen> { Seen::parse(&t.ask("view")?) };
    ensure!(
        c.ask("alloc 8")? == "ok" && d.ask("alloc 4")? == "ok",
        "first allocations"
    );
    // The parent's 32 MiB is the smallest limit above both; its headroom (32 - 12) the smallest.
    let want_cd = Seen::limited(32 * MIB, 20 * MIB);
    ensure!(view(&mut c)? == want_cd, "c: {:?}", view(&mut c)?);
    ensure!(view(&mut d)? == want_cd, "d: {:?}", view(&mut d)?);
    let real = |f: &gpud_tests::fakenv::FakeNv| Seen::real(capacity, f.snapshot().used_total());
    ensure!(view(&mut s)? == real(&fake), "sibling: {:?}", view(&mut s)?);

    // c's own limit drops below its parent's while it runs.
    println!("[view-{tag}] nested limits hold");
    settings.set_limit(id_c, 0, 16 * MIB)?;
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, 8 * MIB),
        "c at 16 MiB: {:?}",
        view(&mut c)?
    );
    ensure!(
        view(&mut d)? == want_cd,
        "d after c's change: {:?}",
        view(&mut d)?
    );
    // 10 MiB more: refused by the deny tier, or charged by react: never a negative headroom.
    let r = c.ask("alloc 10")?;
    let headroom = if deny {
        ensure!(r.starts_with("refused errno=12"), "deny tier: {r}");
        8 * MIB
    } else {
        ensure!(r == "ok", "react tier: {r}");
        0
    };
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, headroom),
        "c over its limit: {:?}",
        view(&mut c)?
    );
    println!("[view-{tag}] a changed limit holds");
    let r = c.ask("malformed")?;
    ensure!(r == "ok", "malformed calls: {r}");

    // A reload turns the view off and on again.
    println!("[view-{tag}] malformed calls left alone");
    probes.set_memory_info(false)?;
    println!("[view-{tag}] view turned off");
    ensure!(
        probes.memory_info().describe() == "off",
        "{}",
        probes.memory_info().describe()
    );
    ensure!(
        view(&mut c)? == real(&fake),
        "view off: {:?}",
        view(&mut c)?
    );
    probes.set_memory_info(true)?;
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, headroom),
        "view on again: {:?}",
        view(&mut c)?
    );
    // No limit left: the driver's figures.
    settings.clear_limit(id_c, 0)?;
    settings.clear_limit(id_parent, gpud_common::GPU_ALL)?;
    ensure!(
        view(&mut c)? == real(&fake),
        "limits cleared: {:?}",
        view(&mut c)?
    );
    let stats = attribution.counters()?.stats();
    ensure!(
        // Six views by limited tenants while the view was on, two replies each.
        stats.get("memory_info_rewritten") == Some(&12)
            && stats.get("memory_info_skipped") == Some(&0),
        "kernel stats {stats:?}"
    );
    for t in [c, d, s] {
        t.release();
    }
    drop(attribution);
    probes.shutdown(false);
    drop(fake);
    for p in [&pc, &pd, &parent, &sib] {
        let _ = std::fs::remove_dir(root.join(&p[1..]));
    }
    println!("[view-{tag}] memory view checks passed");
    Ok(())
}
