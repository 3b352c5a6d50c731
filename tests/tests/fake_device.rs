//! The fake NVIDIA control device behaves like the driver: a real FUSE mount, real processes
//! (`gpud-rm`, and this test process) issuing real ioctls, the fake's `state` as ground truth.
//!
//! Needs root and `/dev/fuse`; skipped with a message where `/dev/fuse` is absent.

use std::{
    fs::File,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use gpud_common::{
    nv::{self, nv_iowr},
    rm::{self, sched},
};
use gpud_tests::{
    Cgroup, Rig, RmProcess, TempDir, bin_dir, class_counts, eventually,
    fakenv::{self, FakeNv, Options, Snapshot},
    rm::{Alloc, Ctl, Form, bytes_of, bytes_of_mut, class, nvos54_flags, status},
};
use rstest::rstest;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;
const WAIT: Duration = Duration::from_secs(5);

/// A fake mounted in a scratch directory; unmounted before the directory goes.
struct Mounted {
    fake: FakeNv,
    _dir: TempDir,
}

impl std::ops::Deref for Mounted {
    type Target = FakeNv;
    fn deref(&self) -> &FakeNv {
        &self.fake
    }
}

/// A fake of 2 GPUs of `capacity` with 2 MiB pages mounted in a scratch directory, or `None`
/// (with a message) without `/dev/fuse`.
fn fake(tag: &str, capacity: u64) -> Option<Mounted> {
    if !fakenv::available() {
        eprintln!("SKIPPED: /dev/fuse is absent, the fake NVIDIA device cannot be mounted");
        return None;
    }
    let dir = TempDir::new(tag);
    let opts = Options {
        gpus: 2,
        capacity,
        page_size: PAGE,
        verbose: false,
    };
    let fake = fakenv::mount(&dir.path().join("mnt"), opts).expect("mount the fake");
    Some(Mounted { fake, _dir: dir })
}

/// [`fake`] and a `gpud-rm` caller on it.
fn caller(tag: &str, capacity: u64) -> Option<(Mounted, RmProcess)> {
    let fake = fake(tag, capacity)?;
    let p = RmProcess::spawn(None, &fake.ctl());
    Some((fake, p))
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("no number {k:?} in {v}"))
}

fn status_of(v: &Value) -> u32 {
    assert_eq!(v["ret"], 0, "ioctl failed: {v}");
    u(v, "status") as u32
}

/// Client, device 0 and its subdevice, in process `p`.
fn setup(p: &mut RmProcess) -> (u32, u32, u32) {
    let client = p.handle("client");
    let device = p.handle(&format!("device {client} 0"));
    let sub = p.handle(&format!("subdevice {client} {device}"));
    (client, device, sub)
}

fn released(s: &Snapshot, clients: &[u32]) -> bool {
    clients.iter().all(|c| !s.has_client(*c))
}

#[test]
fn handles_are_generated_unique_and_sizes_rounded_in_every_form() {
    let Some((fake, mut p)) = caller("forms", GIB) else {
        return;
    };
    let (client, device, sub) = setup(&mut p);
    assert_eq!(
        client & 0xfff0_0000,
        rm::RS_CLIENT_HANDLE_BASE,
        "{client:#x}"
    );
    for h in [device, sub] {
        assert_eq!(h & 0xfff0_0000, rm::RS_UNIQUE_HANDLE_BASE, "{h:#x}");
    }
    let other = p.handle("client");
    assert_ne!(other, client);

    let mut handles = vec![device, sub];
    let mut want = 0;
    for form in Form::ALL {
        for (size, rounded) in [(1, PAGE), (3 * MIB, 4 * MIB), (PAGE, PAGE)] {
            let parent = if form == Form::Nvos21 { device } else { sub };
            let v = p.ok(&format!("alloc {client} {parent} {size} {}", form.name()));
            assert_eq!(u(&v, "size"), rounded, "{} {size}: {v}", form.name());
            let h = u(&v, "handle") as u32;
            handles.push(h);
            want += rounded;
            let s = fake.snapshot();
            let o = s.object(client, h).expect("allocation in the state");
            assert_eq!(
                (o.class, o.bytes, o.gpu, o.parent, o.pid),
                (class::MEMORY_LOCAL_USER, rounded, Some(0), parent, p.pid)
            );
        }
    }
    handles.sort_unstable();
    handles.dedup();
    assert_eq!(handles.len(), 2 + 3 * Form::ALL.len(), "handles repeat");
    let s = fakenv::read_state(fake.dir()).expect("state file");
    assert_eq!(s.used(0), want);
    assert_eq!(s.used(1), 0);
    assert_eq!(s.memory().map(|o| o.bytes).sum::<u64>(), want);
    assert_eq!(s.files.len(), 1);
    assert_eq!(s.files[0].pid, p.pid);
    assert_eq!(s.files[0].clients, vec![client, other]);

    // Handles of the caller's choice: accepted when unused, refused when taken.
    let v = p.cmd(&format!("alloc {client} {device} 1 handle=0x1234"));
    assert_eq!((status_of(&v), u(&v, "handle")), (status::NV_OK, 0x1234));
    let v = p.cmd(&format!("alloc {client} {device} 1 vidheap handle=0x1234"));
    assert_eq!(status_of(&v), status::NV_ERR_INSERT_DUPLICATE_NAME);
    let v = p.cmd(&format!("alloc {client} {device} 1 vidheap handle=0x1235"));
    assert_eq!((status_of(&v), u(&v, "handle")), (status::NV_OK, 0x1235));
    let v = p.cmd(&format!("client {client}"));
    assert_eq!(status_of(&v), status::NV_ERR_INSERT_DUPLICATE_NAME);
    let v = p.cmd("client 0xc1d0abcd");
    assert_eq!(
        (status_of(&v), u(&v, "handle")),
        (status::NV_OK, 0xc1d0_abcd)
    );
    // Object handles are per client: another client may reuse one.
    let d2 = p.handle("device 0xc1d0abcd 1");
    assert_eq!(d2, rm::RS_UNIQUE_HANDLE_BASE);
    let v = p.ok(&format!("alloc 0xc1d0abcd {d2} 5M"));
    assert_eq!(u(&v, "size"), 6 * MIB);
    assert_eq!(fake.snapshot().used(1), 6 * MIB);
}

/// NV_MEMORY_ALLOCATION_PARAMS behind `pAllocParms`, by NVOS21 or NVOS64 (`long`), direct or
/// XFER-wrapped.
#[rstest]
#[case::nvos21(false, false)]
#[case::nvos64(true, false)]
#[case::xfer_nvos21(false, true)]
#[case::xfer_nvos64(true, true)]
fn memory_params_are_written_back_in_the_callers_memory(#[case] long: bool, #[case] xfer: bool) {
    let Some(fake) = fake(&format!("params-{long}-{xfer}"), GIB) else {
        return;
    };
    let f = File::options()
        .read(true)
        .write(true)
        .open(fake.ctl())
        .unwrap();
    let ctl = Ctl::new(&f);
    let client = ctl.alloc_client().handle;
    let device = ctl.alloc_device(client, 1).handle;
    let mut params = rm::MemoryAllocationParams {
        size: 5 * MIB + 1,
        attr2: 0x55,
        ..Default::default()
    };
    let mut a = Alloc::new(client, device, class::MEMORY_LOCAL_USER)
        .params(bytes_of_mut(&mut params).as_mut_ptr());
    a.long = long;
    a.xfer = xfer;
    // SAFETY: `params` is the class's struct and outlives the call.
    let r = unsafe { ctl.alloc(&a) };
    assert!(r.ok(), "{r:?}");
    assert_eq!((params.size, params.limit), (6 * MIB, 6 * MIB - 1));
    assert_eq!(params.attr2, 0x55, "other fields kept");
    let s = fake.snapshot();
    assert_eq!((s.used(0), s.used(1)), (0, 6 * MIB));
    // This process made them.
    assert!(s.memory().all(|o| o.pid == std::process::id()));
}

/// Refused in every allocation form alike; what is left stays usable.
#[rstest]
#[case::nvos21(Form::Nvos21)]
#[case::nvos64(Form::Nvos64)]
#[case::vid_heap_control(Form::VidHeap)]
#[case::xfer_nvos21(Form::Xfer21)]
#[case::xfer_nvos64(Form::Xfer64)]
#[case::xfer_vid_heap_control(Form::XferVidHeap)]
fn capacity_exhaustion_is_status_0x51_with_ioctl_0(#[case] form: Form) {
    let Some((fake, mut p)) = caller(&format!("capacity-{}", form.name()), 8 * MIB) else {
        return;
    };
    let (client, device, sub) = setup(&mut p);
    let first = p.handle(&format!("alloc {client} {device} 5M"));
    assert_eq!(fake.snapshot().used(0), 6 * MIB);
    let v = p.cmd(&format!("alloc {client} {sub} 3M {}", form.name()));
    assert_eq!(v["ret"], 0, "{v}");
    assert_eq!(status_of(&v), status::NV_ERR_NO_MEMORY, "{}", form.name());
    assert_eq!(v["errno"], 0);
    let s = fake.snapshot();
    assert_eq!((s.used(0), s.memory().count()), (6 * MIB, 1));
    assert_eq!(s.stats.refused, 1);
    // What is left still fits, exactly.
    p.ok(&format!("alloc {client} {sub} 2M xfervidheap"));
    let v = p.cmd(&format!("alloc {client} {sub} 1"));
    assert_eq!(status_of(&v), status::NV_ERR_NO_MEMORY);
    // Freeing makes room again; the other GPU has its own capacity.
    p.ok(&format!("free {client} {first}"));
    p.ok(&format!("alloc {client} {sub} 6M"));
    let d1 = p.handle(&format!("device {client} 1"));
    p.ok(&format!("alloc {client} {d1} 8M"));
    assert_eq!(fake.snapshot().used(1), 8 * MIB);
    // A size that cannot be rounded is refused too.
    let v = p.cmd(&format!("alloc {client} {d1} 0xffffffffffffffff"));
    assert_eq!(status_of(&v), status::NV_ERR_NO_MEMORY);
}

#[test]
fn malformed_requests_fail_with_einval() {
    let Some((fake, mut p)) = caller("einval", GIB) else {
        return;
    };
    let errno = |p: &mut RmProcess, cmd: u32| {
        let v = p.cmd(&format!("ioctl {cmd:#x}"));
        (v["ret"].as_i64().unwrap(), v["errno"].as_i64().unwrap())
    };
    let einval = (-1, libc::EINVAL as i64);
    for (nr, size) in [
        (nv::NV_ESC_RM_ALLOC, 36),
        (nv::NV_ESC_RM_ALLOC, nv::NVOS64_SIZE_OLD),
        (nv::NV_ESC_RM_ALLOC, 16),
        (nv::NV_ESC_RM_FREE, 20),
        (nv::NV_ESC_RM_VID_HEAP_CONTROL, 180),
        (nv::NV_ESC_RM_CONTROL, 40),
        (nv::NV_ESC_IOCTL_XFER_CMD, 24),
        // An XFER of a zeroed struct: inner escape 0 of size 0.
        (nv::NV_ESC_IOCTL_XFER_CMD, 16),
        // Device files only.
        (nv::NV_ESC_RM_ALLOC_MEMORY, nv::NVOS02_WITH_FD_SIZE),
    ] {
        assert_eq!(
            errno(&mut p, nv_iowr(nr, size)),
            einval,
            "nr {nr:#x} size {size}"
        );
    }
    // Well-formed requests on a zeroed struct return 0, the RM error in the struct.
    for (nr, size) in [
        (nv::NV_ESC_RM_ALLOC, 32),
        (nv::NV_ESC_RM_ALLOC, 48),
        (nv::NV_ESC_RM_FREE, 16),
        (nv::NV_ESC_RM_CONTROL, 32),
        (nv::NV_ESC_RM_VID_HEAP_CONTROL, 184),
    ] {
        assert_eq!(errno(&mut p, nv_iowr(nr, size)), (0, 0), "nr {nr:#x}");
    }
    // Not an NVIDIA escape.
    assert_eq!(errno(&mut p, nv_iowr(0x10, 8)), einval);
    assert!(fake.snapshot().objects.is_empty());

    // XFER: inner size over the limit, a nested XFER, a full command as inner cmd, an inner
    // pointer that is not mapped.
    let f = File::options()
        .read(true)
        .write(true)
        .open(fake.ctl())
        .unwrap();
    let ctl = Ctl::new(&f);
    let client = ctl.alloc_client().handle;
    let mut inner = rm::Nvos21 {
        h_root: client,
        h_object_parent: client,
        h_class: class::DEVICE,
        ..Default::default()
    };
    let xfer_cmd = nv_iowr(nv::NV_ESC_IOCTL_XFER_CMD, 16);
    let try_xfer = |cmd: u32, size: u32, ptr: u64| {
        let mut x = rm::NvIoctlXfer { cmd, size, ptr };
        // SAFETY: the wrapper is live; the payload pointers tried are `inner` or unmapped (the
        // fake reads no further than the size given, and refuses the rest).
        unsafe { ctl.raw(xfer_cmd, bytes_of_mut(&mut x).as_mut_ptr()) }
    };
    let ptr = bytes_of_mut(&mut inner).as_mut_ptr() as u64;
    assert_eq!(
        try_xfer(nv::NV_ESC_RM_ALLOC, 20000, ptr),
        (-1, libc::EINVAL)
    );
    assert_eq!(
        try_xfer(nv::NV_ESC_IOCTL_XFER_CMD, 16, ptr),
        (-1, libc::EINVAL)
    );
    assert_eq!(try_xfer(nv_iowr(0x2b, 32), 32, ptr), (-1, libc::EINVAL));
    assert_eq!(try_xfer(nv::NV_ESC_RM_ALLOC, 36, ptr), (-1, libc::EINVAL));
    assert_eq!(try_xfer(nv::NV_ESC_RM_ALLOC, 32, 8), (-1, libc::EFAULT));
    assert_eq!(try_xfer(nv::NV_ESC_RM_ALLOC, 32, ptr), (0, 0));
    assert_eq!(inner.status, status::NV_OK);
    assert_eq!(inner.h_object_new, rm::RS_UNIQUE_HANDLE_BASE);
    // Memory params that cannot be read are an RM error, not an errno.
    let bad = Alloc::new(client, inner.h_object_new, class::MEMORY_LOCAL_USER).params(8 as *mut u8);
    // SAFETY: the address is unmapped: nothing can be read or written there.
    let r = unsafe { ctl.alloc(&bad) };
    assert_eq!((r.ret, r.status), (0, status::NV_ERR_INVALID_POINTER));
}

#[test]
fn rm_errors_parents_and_classes_as_the_driver() {
    let Some((fake, mut p)) = caller("errors", GIB) else {
        return;
    };
    let (client, device, sub) = setup(&mut p);
    let st = |p: &mut RmProcess, line: String| status_of(&p.cmd(&line));
    // Unknown parent, wrong parents.
    assert_eq!(
        st(&mut p, format!("alloc {client} 0xbad 1")),
        status::NV_ERR_INVALID_OBJECT_PARENT
    );
    assert_eq!(
        st(&mut p, format!("alloc {client} {client} 1 vidheap")),
        status::NV_ERR_INVALID_OBJECT_PARENT
    );
    assert_eq!(
        st(&mut p, format!("subdevice {client} {client}")),
        status::NV_ERR_INVALID_OBJECT_PARENT
    );
    // Device ids past the fake's GPUs.
    assert_eq!(
        st(&mut p, format!("device {client} 2")),
        status::NV_ERR_INVALID_ARGUMENT
    );
    // Unknown client.
    assert_eq!(
        st(&mut p, "device 0xc1d0ffff 0".into()),
        status::NV_ERR_INVALID_CLIENT
    );
    // vidmemConstruct refuses the VIRTUAL flag and non-vidmem locations.
    let virt = rm::NVOS32_ALLOC_FLAGS_VIRTUAL;
    let pci = rm::NVOS32_ATTR_LOCATION_PCI << rm::NVOS32_ATTR_LOCATION_SHIFT;
    for form in ["nvos21", "nvos64", "xfer64"] {
        assert_eq!(
            st(
                &mut p,
                format!("alloc {client} {sub} 1 {form} flags={virt:#x}")
            ),
            status::NV_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            st(
                &mut p,
                format!("alloc {client} {sub} 1 {form} attr={pci:#x}")
            ),
            status::NV_ERR_INVALID_ARGUMENT
        );
    }
    // VID_HEAP_CONTROL turns them into a VA reservation and system memory, which hold no vidmem.
    let v = p.ok(&format!(
        "alloc {client} {device} 4M vidheap flags={virt:#x}"
    ));
    let va = u(&v, "handle") as u32;
    let v = p.ok(&format!("alloc {client} {device} 4M vidheap attr={pci:#x}"));
    let sys = u(&v, "handle") as u32;
    // Class 0x50a0 by RM_ALLOC: no physical memory either.
    let va2 = p.handle(&format!("alloc {client} {device} 4M class=0x50a0"));
    let s = fake.snapshot();
    assert_eq!(s.object(client, va).unwrap().class, class::MEMORY_VIRTUAL);
    assert_eq!(s.object(client, sys).unwrap().class, class::MEMORY_SYSTEM);
    assert_eq!(s.object(client, va2).unwrap().class, class::MEMORY_VIRTUAL);
    assert_eq!((s.used(0), s.memory().count()), (0, 0));
    // Other classes are plain objects under any parent (0xc8b5: HOPPER_DMA_COPY_A).
    let plain = p.handle(&format!("alloc {client} {sub} 1 class=0xc8b5"));
    assert_eq!(fake.snapshot().object(client, plain).unwrap().gpu, Some(0));
    // A channel only under a channel group.
    let v = p.cmd(&format!(
        "alloc {client} {sub} 1 class={:#x}",
        class::HOPPER_CHANNEL_GPFIFO_A
    ));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_OBJECT_PARENT, "{v}");
    // VID_HEAP FREE frees what it names.
    let m = p.handle(&format!("alloc {client} {device} 1 vidheap"));
    assert_eq!(fake.snapshot().used(0), PAGE);
    p.ok(&format!("vidheap-free {client} {device} {m}"));
    assert_eq!(fake.snapshot().used(0), 0);
    // Other escapes with a status answer NV_OK after the client check.
    let control = nv_iowr(nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE);
    let v = p.cmd(&format!("ioctl {control:#x}"));
    assert_eq!(v["ret"], 0);
}

#[test]
fn free_takes_the_subtree_and_the_client_everything() {
    let Some((fake, mut p)) = caller("subtree", GIB) else {
        return;
    };
    let (client, device, sub) = setup(&mut p);
    let on_dev = p.handle(&format!("alloc {client} {device} 1"));
    let on_sub = p.handle(&format!("alloc {client} {sub} 1 vidheap"));
    let _under_mem = p.handle(&format!("alloc {client} {on_sub} 0 class=0x71"));
    let d1 = p.handle(&format!("device {client} 1"));
    let on_d1 = p.handle(&format!("alloc {client} {d1} 3M xfer21"));
    let s = fake.snapshot();
    assert_eq!(
        (s.used(0), s.used(1), s.objects.len()),
        (2 * PAGE, 4 * MIB, 7)
    );

    // The subdevice takes its memory and what hangs under that.
    p.ok(&format!("free {client} {sub}"));
    let s = fake.snapshot();
    assert_eq!((s.used(0), s.objects.len()), (PAGE, 4));
    assert!(s.object(client, on_dev).is_some() && s.object(client, on_sub).is_none());
    // A handle that does not exist: NV_OK (compatibility mode), nothing changes.
    let v = p.cmd(&format!("free {client} 0xdead"));
    assert_eq!(status_of(&v), status::NV_OK);
    let mut now = fake.snapshot();
    now.stats = s.stats.clone();
    assert_eq!(now, s);
    // The device takes everything under it; the other GPU is untouched.
    p.ok(&format!("free {client} {device}"));
    let s = fake.snapshot();
    assert_eq!((s.used(0), s.used(1), s.objects.len()), (0, 4 * MIB, 2));
    // Freeing the client frees the rest.
    let second = p.handle("client");
    p.ok(&format!("free {client} {client}"));
    let s = fake.snapshot();
    assert_eq!((s.used(1), s.objects.len()), (0, 0));
    assert!(!s.has_client(client) && s.has_client(second));
    assert!(s.object(client, on_d1).is_none());
    // The client is gone: its handle is now unknown.
    let v = p.cmd(&format!("free {client} {client}"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_CLIENT);
}

#[test]
fn last_close_frees_the_files_clients() {
    // `close`: both clients of the file go, with no RM_FREE.
    let Some((fake, mut p)) = caller("release", GIB) else {
        return;
    };
    let (a, device, _) = setup(&mut p);
    p.ok(&format!("alloc {a} {device} 10M"));
    let b = p.handle("client");
    let d = p.handle(&format!("device {b} 1"));
    p.ok(&format!("alloc {b} {d} 1"));
    let s = fake.snapshot();
    assert_eq!((s.used(0), s.used(1)), (10 * MIB, PAGE));
    p.ok("close");
    let s = fake
        .wait(WAIT, |s| released(s, &[a, b]))
        .expect("clients freed on close");
    assert_eq!((s.used_total(), s.objects.len(), s.files.len()), (0, 0, 0));
    assert_eq!(s.stats.released, 1);

    // `exit` without closing anything: the kernel's close frees them the same way.
    p.ok("open");
    let (c, device, _) = setup(&mut p);
    p.ok(&format!("alloc {c} {device} 1"));
    p.ok("exit");
    assert_eq!(p.finish(), Some(0));
    let s = fake
        .wait(WAIT, |s| released(s, &[c]))
        .expect("clients freed at exit");
    assert_eq!(s.used_total(), 0);

    // A forked child shares the open file: the parent's close releases nothing while the child
    // holds it; the child's exit does.
    let mut p = RmProcess::spawn(None, &fake.ctl());
    let (e, device, _) = setup(&mut p);
    p.ok(&format!("alloc {e} {device} 1"));
    let child = u(&p.ok("fork"), "pid");
    // The child uses the parent's client (same open file).
    let m = p.handle(&format!("alloc {e} {device} 1 xfer64"));
    assert_eq!(fake.snapshot().object(e, m).unwrap().pid, child as u32);
    p.ok("sleep 50");
    let before = fake.snapshot();
    assert!(before.has_client(e));
    p.ok("exit");
    let reaped = p.recv();
    assert_eq!((u(&reaped, "reaped"), u(&reaped, "code")), (child, 0));
    // The parent still has the file open.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(fake.snapshot().used(0), 2 * PAGE);
    p.ok("close");
    fake.wait(WAIT, |s| released(s, &[e]) && s.used_total() == 0)
        .expect("freed at the last close");
}

#[test]
fn a_client_is_bound_to_the_file_that_made_it() {
    let Some(fake) = fake("strict", GIB) else {
        return;
    };
    let mut a = RmProcess::spawn(None, &fake.ctl());
    let (client, device, _) = setup(&mut a);
    let m = a.handle(&format!("alloc {client} {device} 1"));
    // Another process, another open file: every use of the client is refused.
    let mut b = RmProcess::spawn(None, &fake.ctl());
    for line in [
        format!("device {client} 0"),
        format!("alloc {client} {device} 1"),
        format!("alloc {client} {device} 1 vidheap"),
        format!("alloc {client} {device} 1 xfer21"),
        format!("free {client} {m}"),
        format!("free {client} {client}"),
        format!("vidheap-free {client} {device} {m}"),
    ] {
        let v = b.cmd(&line);
        assert_eq!(status_of(&v), status::NV_ERR_INVALID_CLIENT, "{line}: {v}");
    }
    // The same process through a second open file is refused too.
    a.ok("open");
    let v = a.cmd(&format!("alloc {client} {device} 1"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_CLIENT);
    // (`open` closed the first file: its client is gone.)
    fake.wait(WAIT, |s| !s.has_client(client))
        .expect("client released with its file");
    assert_eq!(fake.snapshot().used_total(), 0);
}

#[test]
fn concurrent_callers_and_threads() {
    let Some(fake) = fake("threads", GIB) else {
        return;
    };
    let mut procs: Vec<RmProcess> = (0..3)
        .map(|_| RmProcess::spawn(None, &fake.ctl()))
        .collect();
    let mut all = Vec::new();
    for p in &mut procs {
        let (client, device, sub) = setup(p);
        for form in ["xfer64", "vidheap"] {
            let v = p.ok(&format!("parallel 8 {client} {sub} 1 {form}"));
            let results = v["results"].as_array().unwrap();
            assert_eq!(results.len(), 8);
            let mut hs: Vec<u64> = results.iter().map(|r| u(r, "handle")).collect();
            hs.sort_unstable();
            hs.dedup();
            assert_eq!(hs.len(), 8, "handles repeat: {v}");
            all.extend(hs.into_iter().map(|h| (client, h)));
        }
        let _ = device;
    }
    let s = fake.snapshot();
    assert_eq!(s.used(0), 48 * PAGE);
    assert_eq!(s.memory().count(), 48);
    for p in &procs {
        assert_eq!(s.memory().filter(|o| o.pid == p.pid).count(), 16);
    }
}

#[test]
fn injected_faults() {
    let Some((fake, mut p)) = caller("inject", GIB) else {
        return;
    };
    let (client, device, _) = setup(&mut p);
    // Through the file, as another process would.
    fakenv::write_inject(fake.dir(), "fail-next-alloc 0x51 2").unwrap();
    let pending = std::fs::read_to_string(fake.dir().join(fakenv::INJECT)).unwrap();
    assert_eq!(pending, "fail-next-alloc 0x51 2\n");
    for form in ["nvos21", "vidheap"] {
        let v = p.cmd(&format!("alloc {client} {device} 1 {form}"));
        assert_eq!(status_of(&v), status::NV_ERR_NO_MEMORY);
    }
    p.ok(&format!("alloc {client} {device} 1"));
    // Device allocations are not memory allocations.
    fake.inject("fail-next-alloc 0x1f").unwrap();
    p.ok(&format!("device {client} 1"));
    let v = p.cmd(&format!("alloc {client} {device} 1 xfer64"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_ARGUMENT);
    // An errno for the next ioctl, whatever it is.
    fakenv::write_inject(fake.dir(), "errno-next-ioctl 5").unwrap();
    let v = p.cmd(&format!("alloc {client} {device} 1"));
    assert_eq!(
        (v["ret"].as_i64(), v["errno"].as_i64()),
        (Some(-1), Some(5))
    );
    p.ok(&format!("alloc {client} {device} 1"));
    // Capacity at run time.
    fake.inject("capacity 0 4M").unwrap();
    let v = p.cmd(&format!("alloc {client} {device} 1"));
    assert_eq!(status_of(&v), status::NV_ERR_NO_MEMORY);
    // Nonsense is refused at write time.
    assert!(fakenv::write_inject(fake.dir(), "fail-everything").is_err());
    assert!(fake.inject("fail-next-alloc").is_err());
    fake.inject("clear").unwrap();
    assert_eq!(
        std::fs::read_to_string(fake.dir().join(fakenv::INJECT)).unwrap(),
        ""
    );
}

#[test]
fn callers_in_a_cgroup_are_seen_with_their_pids() {
    let Some(fake) = fake("cgroup", GIB) else {
        return;
    };
    let cg = Cgroup::new("fake-rm");
    let mut p = RmProcess::spawn(Some(&cg.dir), &fake.ctl());
    let procs = std::fs::read_to_string(cg.dir.join("cgroup.procs")).unwrap();
    assert!(
        procs.lines().any(|l| l.trim() == p.pid.to_string()),
        "{procs}"
    );
    let (client, device, _) = setup(&mut p);
    p.ok(&format!("alloc {client} {device} 1"));
    let s = fake.snapshot();
    assert!(s.objects.iter().all(|o| o.pid == p.pid));
    assert_eq!(s.clients[0].pid, p.pid);
}

#[test]
fn the_binary_serves_until_stdin_closes_and_unmounts() {
    if !fakenv::available() {
        eprintln!("SKIPPED: /dev/fuse is absent");
        return;
    }
    let dir = TempDir::new("binary");
    let mnt = dir.path().join("mnt");
    let mut child = Command::new(bin_dir().join("gpud-fake-nvidia"))
        .arg(&mnt)
        .args(["--gpus", "3", "--capacity", "64M", "--page-size", "64K"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn gpud-fake-nvidia");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "READY");
    let mut p = RmProcess::spawn(None, &mnt.join(fakenv::CTL));
    let client = p.handle("client");
    let device = p.handle(&format!("device {client} 2"));
    let v = p.ok(&format!("alloc {client} {device} 100K"));
    assert_eq!(u(&v, "size"), 128 << 10);
    let s = fakenv::read_state(&mnt).unwrap();
    assert_eq!(
        (s.gpus.len(), s.page_size, s.used(2)),
        (3, 64 << 10, 128 << 10)
    );
    assert_eq!(s.gpus[2].capacity, 64 * MIB);
    drop(p);
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!is_mounted(&mnt), "still mounted");
}

fn is_mounted(p: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let p = p.display().to_string();
    mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(p.as_str()))
}

#[test]
fn unmount_with_files_open_detaches_and_keeps_serving_them() {
    let Some(fake) = fake("lazy", GIB) else {
        return;
    };
    let mnt = fake.dir().to_owned();
    let mut p = RmProcess::spawn(None, &fake.ctl());
    let client = p.handle("client");
    let Mounted { fake, _dir } = fake;
    fake.unmount().expect("unmount");
    assert!(!is_mounted(&mnt));
    // The open file still reaches the fake.
    p.handle(&format!("device {client} 0"));
    assert_eq!(p.finish(), Some(0));
}

/// The point of the fake: gpud's probes match it by (device, inode) like a stand-in file and
/// see the caller's real ioctls, XFER-wrapped ones decoded, in the caller's cgroup.
#[tokio::test(flavor = "multi_thread")]
async fn gpud_attributes_ioctls_on_the_fake_to_the_callers_cgroup() {
    let Some(mut rig) = Rig::new("gpud-fake").fake_device(2) else {
        return;
    };
    rig.start(rig.config()).await;
    let fake = rig.fake();
    let cg = Cgroup::new("fake-gpud");
    let mut p = RmProcess::spawn(Some(&cg.dir), &fake.ctl());
    let (client, device, sub) = setup(&mut p);
    p.ok(&format!("alloc {client} {sub} 1 nvos64"));
    p.ok(&format!("alloc {client} {sub} 1 xfer21"));
    p.ok(&format!("alloc {client} {device} 1 vidheap"));
    p.ok(&format!("free {client} {device}"));
    let want = class_counts(&[("alloc", 5), ("vid_heap", 1), ("free", 1)]);
    let (_conn, proxy) = rig.proxy().await;
    let got = eventually(WAIT, || async {
        let r = proxy.get_cgroup(&cg.rel).await.ok()?;
        (r.ioctls == want).then_some(r)
    })
    .await;
    let r = proxy.get_cgroup(&cg.rel).await.expect("GetCgroup");
    assert!(
        got.is_some(),
        "gpud counted {:?}\n{}",
        r.ioctls,
        rig.log_text()
    );
    assert_eq!(r.pids, vec![p.pid]);
    assert_eq!(fake.snapshot().used_total(), 0);
}

/// A descriptor of `pid`'s open control file, taken with `pidfd_getfd` (as gpud takes it).
fn steal_ctl(pid: u32, ctl: &Path) -> File {
    use std::os::fd::FromRawFd as _;
    let fd: i32 = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == ctl))
        .and_then(|e| e.file_name().to_str()?.parse().ok())
        .expect("the process holds the control file");
    // SAFETY: plain syscalls on integers; each result is checked.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    let new = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) };
    assert!(new >= 0, "pidfd_getfd: {}", std::io::Error::last_os_error());
    unsafe { libc::close(pidfd as i32) };
    // SAFETY: a new descriptor nothing else owns.
    unsafe { File::from_raw_fd(new as i32) }
}

#[test]
fn channel_group_controls_reach_a_group_only_through_its_clients_file() {
    let Some(fake) = fake("tsg", GIB) else {
        return;
    };
    let mut a = RmProcess::spawn(None, &fake.ctl());
    let (client, device, sub) = setup(&mut a);
    let group = a.handle(&format!("channel-group {client} {device}"));
    // Only under a device.
    let v = a.cmd(&format!("channel-group {client} {sub}"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_OBJECT_PARENT, "{v}");
    let s = fake.snapshot();
    let g = &s.channel_groups[0];
    assert_eq!(
        (g.client, g.handle, g.pid, g.gpu, g.enabled, g.timeslice_us),
        (client, group, a.pid, Some(0), true, 1024)
    );
    // The owner's file: accepted.
    let v = a.cmd(&format!("timeslice {client} {group} 3000"));
    assert_eq!(status_of(&v), status::NV_OK, "{v}");
    assert_eq!(fake.snapshot().channel_groups[0].timeslice_us, 3000);
    // No such group, or not a group: refused.
    for h in [0xdead, device] {
        let v = a.cmd(&format!("schedule {client} {h} 0"));
        assert_eq!(status_of(&v), status::NV_ERR_INVALID_OBJECT_HANDLE, "{v}");
    }
    // Another process's file: refused, nothing changed.
    let mut b = RmProcess::spawn(None, &fake.ctl());
    let v = b.cmd(&format!("schedule {client} {group} 0"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_CLIENT, "{v}");
    assert!(fake.snapshot().channel_groups[0].enabled);
    // A second descriptor of the owner's own file (pidfd_getfd) passes, from any process; with
    // `runlist stop`, off the runlist stops the owner until it is back on.
    fake.inject("runlist stop").expect("inject");
    let stolen = steal_ctl(a.pid, &fake.ctl());
    let ctl = Ctl::new(&stolen);
    let mut off = rm::tsg::ScheduleParams::default();
    let r = ctl.control(client, group, rm::tsg::GPFIFO_SCHEDULE, &mut off);
    assert_eq!((r.ret, r.status), (0, status::NV_OK));
    let stopped = eventually_sync(|| gpud_tests::process_state(a.pid) == 'T');
    assert!(
        stopped,
        "owner not stopped: {}",
        gpud_tests::process_state(a.pid)
    );
    // Parameters of another control's size: refused before they are read.
    let mut bad = rm::tsg::TimesliceParams::default();
    let r = ctl.control(client, group, rm::tsg::GPFIFO_SCHEDULE, &mut bad);
    assert_eq!(r.status, status::NV_ERR_INVALID_ARGUMENT);
    let mut on = rm::tsg::ScheduleParams {
        enable: 1,
        ..Default::default()
    };
    let r = ctl.control(client, group, rm::tsg::GPFIFO_SCHEDULE, &mut on);
    assert_eq!((r.ret, r.status), (0, status::NV_OK));
    assert!(eventually_sync(|| gpud_tests::process_state(a.pid) != 'T'));
    let s = fake.snapshot();
    assert_eq!(
        (s.channel_groups[0].enabled, s.channel_groups[0].schedules),
        (true, 2)
    );
    // An injected refusal.
    fake.inject(&format!("fail-control {:#x} 0x56", rm::tsg::SET_TIMESLICE))
        .expect("inject");
    let v = a.cmd(&format!("timeslice {client} {group} 500"));
    assert_eq!(status_of(&v), status::NV_ERR_NOT_SUPPORTED, "{v}");
    let v = a.cmd(&format!("timeslice {client} {group} 500"));
    assert_eq!(status_of(&v), status::NV_OK, "{v}");
    // The group goes with its client.
    a.ok(&format!("free {client} {client}"));
    assert!(fake.snapshot().channel_groups.is_empty());
}

fn eventually_sync(f: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// `FB_GET_INFO_V2` as the driver answers it (the H100 of docs/real-gpu.md): the heap and free
/// memory in KiB, the total with the driver's reserve on top, the bus width, free memory
/// following allocations; the driver's refusals for an empty list and for a control on the
/// device instead of the subdevice.
#[test]
fn fb_info_reports_size_and_free_memory_in_kib_as_the_driver() {
    use gpud_common::rm::fb;
    let Some((_fake, mut p)) = caller("fbinfo", GIB) else {
        return;
    };
    let (client, device, sub) = setup(&mut p);
    let indices = [
        fb::HEAP_SIZE,
        fb::HEAP_FREE,
        fb::TOTAL_RAM_SIZE,
        fb::BUS_WIDTH,
        fb::USABLE_RAM_SIZE,
        fb::FB_TAX_SIZE_KB,
    ];
    let ask = |p: &mut RmProcess| -> Vec<(u32, u64)> {
        let list: Vec<String> = indices.iter().map(|i| format!("{i:#x}")).collect();
        let v = p.cmd(&format!("fbinfo {client} {sub} {}", list.join(" ")));
        assert_eq!(status_of(&v), status::NV_OK, "{v}");
        v["info"]
            .as_array()
            .expect("info")
            .iter()
            .map(|e| {
                (
                    e[0].as_u64().unwrap_or(0) as u32,
                    e[1].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    let kib = GIB >> 10;
    let total = kib + (480 << 10);
    let want = |free: u64| {
        vec![
            (fb::HEAP_SIZE, kib),
            (fb::HEAP_FREE, free),
            (fb::TOTAL_RAM_SIZE, total),
            (fb::BUS_WIDTH, 5120),
            (fb::USABLE_RAM_SIZE, total),
            (fb::FB_TAX_SIZE_KB, 0),
        ]
    };
    assert_eq!(ask(&mut p), want(kib));
    p.ok(&format!("alloc {client} {device} 64M"));
    assert_eq!(ask(&mut p), want(kib - (64 << 10)));
    // An empty list is refused.
    let v = p.cmd(&format!("fbinfo {client} {sub}"));
    assert_eq!(status_of(&v), status::NV_ERR_INVALID_ARGUMENT, "{v}");
    // On the device, not the subdevice: not this class's control.
    let v = p.cmd(&format!("fbinfo {client} {device} {:#x}", fb::HEAP_SIZE));
    assert_eq!(status_of(&v), status::NV_ERR_NOT_SUPPORTED, "{v}");
}

/// `CAP_SYS_ADMIN` and `CAP_SYS_NICE`: what RM's `USER_ROOT` and `NICE` right come from.
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYS_NICE: u32 = 23;

/// Runs `f` on a thread of this process whose effective capabilities are only those of `keep`
/// (capability numbers) that it holds: a caller without `CAP_SYS_NICE` or `CAP_SYS_ADMIN`, as a
/// container's tenant. Capabilities are per thread, and the fake checks the calling thread's.
fn with_caps<R: Send>(keep: &[u32], f: impl FnOnce() -> R + Send) -> R {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // _LINUX_CAPABILITY_VERSION_3: two 32-bit halves.
    const V3: u32 = 0x2008_0522;
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut h = Header {
                version: V3,
                pid: 0,
            };
            let mut d = [Data::default(); 2];
            // SAFETY: a v3 header and the two data words it describes; pid 0 is this thread.
            let r = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
            assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
            let want: u64 = keep.iter().map(|c| 1u64 << c).sum();
            d[0].effective = want as u32 & d[0].permitted;
            d[1].effective = (want >> 32) as u32 & d[1].permitted;
            // SAFETY: as above; lowering the effective set needs no privilege.
            let r = unsafe { libc::syscall(libc::SYS_capset, &h, d.as_ptr()) };
            assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("thread")
    })
}

/// The control file, opened by this process.
fn open_ctl(fake: &FakeNv) -> File {
    File::options()
        .read(true)
        .write(true)
        .open(fake.ctl())
        .expect("open the control file")
}

/// NV_ESC_RM_CONTROL's checks come in the driver's order (docs/driver/scheduler-controls.md
/// §0): the legacy path (bit 15) before everything and without the size, binding or privilege
/// checks; the NULL command before any check; the flags; the size before the parameters are
/// read and before the file binding; the object; unknown controls answer NV_OK. Refused calls
/// leave the caller's parameters as they were and are not counted as having reached the driver.
#[test]
fn rm_control_checks_come_in_the_drivers_order() {
    use rm::tsg::{GET_TIMESLICE, SET_TIMESLICE, TimesliceParams};
    let Some(fake) = fake("control-checks", GIB) else {
        return;
    };
    let f = open_ctl(&fake);
    let ctl = Ctl::new(&f);
    let [client, device, sub] = ctl.alloc_subdevice_tree(0).expect("client tree");
    let group = ctl.alloc_channel_group(client, device).handle;
    // A client of another open file (another tenant's).
    let f2 = open_ctl(&fake);
    let other = Ctl::new(&f2).alloc_client().handle;
    let ok = |r: gpud_tests::rm::Reply| (r.ret, r.status);

    // Bit 15: NV_ERR_NOT_SUPPORTED (as the H100 answered 0xa06c8103), counted, nothing done,
    // whatever the size and whoever's client (the path checks neither); an unknown client is
    // still refused, and bit 14 needs CAP_SYS_ADMIN.
    let legacy = SET_TIMESLICE | sched::LEGACY_BIT;
    let mut t = TimesliceParams { timeslice_us: 7 };
    let not_supported = (0, status::NV_ERR_NOT_SUPPORTED);
    assert_eq!(
        ok(ctl.control(client, group, legacy, &mut t)),
        not_supported
    );
    assert_eq!(
        ok(ctl.sched_control(client, group, legacy, &mut [])),
        not_supported
    );
    assert_eq!(ok(ctl.control(other, group, legacy, &mut t)), not_supported);
    assert_eq!(
        ctl.control(0xc1d0_ffff, group, legacy, &mut t).status,
        status::NV_ERR_INVALID_CLIENT
    );
    let root_only = legacy | 0x4000;
    let r = with_caps(&[CAP_SYS_NICE], || {
        ctl.control(client, group, root_only, &mut t)
    });
    assert_eq!(r.status, status::NV_ERR_INSUFFICIENT_PERMISSIONS);
    assert_eq!(
        ok(ctl.control(client, group, root_only, &mut t)),
        not_supported
    );
    let s = fake.snapshot();
    assert_eq!(s.stats.legacy, 4);
    assert_eq!(s.channel_group(client, group).unwrap().timeslice_us, 1024);
    assert!(s.controls.is_empty(), "{:?}", s.controls);

    // The NULL command: NV_OK before any check (no client, object, size, flags or pointer
    // is looked at), nothing done.
    for cmd in [0, 0xa06c_0000, 0x2080_0000] {
        let mut p = rm::Nvos54 {
            h_client: 0xdead,
            h_object: 0xbeef,
            cmd,
            flags: 0x3,
            params: 8,
            params_size: 12345,
            status: 0x99,
        };
        // SAFETY: the pointer is unmapped: the fake must not touch it (and could not).
        let r = unsafe { ctl.control_nvos54(&mut p) };
        assert_eq!(ok(r), (0, status::NV_OK), "{cmd:#x}");
    }

    // Flags: raised IRQL and lock bypass refused for any control; FINN_SERIALIZED on a control
    // the fake models refused (its choice). The parameters stay as they were.
    const SENTINEL: u64 = 0x5eed_5eed;
    let mut sentinel = TimesliceParams {
        timeslice_us: SENTINEL,
    };
    let nvos54 = |cmd: u32, flags: u32, params: u64, size: u32| {
        let mut p = rm::Nvos54 {
            h_client: client,
            h_object: group,
            cmd,
            flags,
            params,
            params_size: size,
            status: 0,
        };
        // SAFETY: `params` is null or `sentinel` (8 bytes), never with a larger size.
        unsafe { ctl.control_nvos54(&mut p) }.status
    };
    let ptr = bytes_of_mut(&mut sentinel).as_mut_ptr() as u64;
    for flags in [nvos54_flags::IRQL_RAISED, nvos54_flags::LOCK_BYPASS, 0x3] {
        for cmd in [GET_TIMESLICE, 0xa06c_01ff] {
            assert_eq!(
                nvos54(cmd, flags, ptr, 8),
                status::NV_ERR_INVALID_ARGUMENT,
                "{cmd:#x} flags {flags:#x}"
            );
        }
    }
    assert_eq!(
        nvos54(GET_TIMESLICE, nvos54_flags::FINN_SERIALIZED, ptr, 8),
        status::NV_ERR_NOT_SUPPORTED
    );

    // The size, before the parameters are read: a short or long size, a size without a
    // pointer, a pointer without a size.
    for (params, size) in [(ptr, 4), (ptr, 7), (0, 8), (ptr, 0), (0, 0)] {
        assert_eq!(
            nvos54(GET_TIMESLICE, 0, params, size),
            status::NV_ERR_INVALID_ARGUMENT,
            "params {params:#x} size {size}"
        );
    }
    assert_eq!(
        sentinel.timeslice_us, SENTINEL,
        "refused calls wrote the parameters"
    );
    // … and before the file binding: another file's client with the wrong size is refused for
    // the size, with the right one for the binding.
    let short = &mut [0u8; 4];
    assert_eq!(
        ctl.sched_control(other, group, GET_TIMESLICE, short).status,
        status::NV_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        ctl.control(other, group, GET_TIMESLICE, &mut sentinel)
            .status,
        status::NV_ERR_INVALID_CLIENT
    );
    assert_eq!(sentinel.timeslice_us, SENTINEL);
    // Every modelled control has its size checked, those without a modelled effect too.
    for c in sched::CONTROLS {
        let mut one_more = vec![0u8; c.size as usize + 1];
        let r = ctl.sched_control(client, sub, c.cmd, &mut one_more);
        assert_eq!(r.status, status::NV_ERR_INVALID_ARGUMENT, "{}", c.name);
    }
    let mut fb = vec![0u8; 1027];
    let r = ctl.sched_control(client, sub, rm::fb::GET_INFO_V2, &mut fb);
    assert_eq!(r.status, status::NV_ERR_INVALID_ARGUMENT);
    // The right size passes, and GET_TIMESLICE writes the group's timeslice.
    assert_eq!(nvos54(GET_TIMESLICE, 0, ptr, 8), status::NV_OK);
    assert_eq!(sentinel.timeslice_us, 1024);

    // The object: none (NV_ERR_OBJECT_NOT_FOUND; the channel-group commands keep
    // NV_ERR_INVALID_OBJECT_HANDLE, which gpud reads as "the group is gone"), or one that does
    // not export the command (NV_ERR_NOT_SUPPORTED).
    let mut gpfifo = [0u8; 24];
    let set_gpfifo = sched::SUBDEVICE_SET_GPFIFO;
    let r = ctl.sched_control(client, 0xbad, set_gpfifo, &mut gpfifo);
    assert_eq!(r.status, status::NV_ERR_OBJECT_NOT_FOUND);
    let r = ctl.sched_control(client, device, set_gpfifo, &mut gpfifo);
    assert_eq!(r.status, status::NV_ERR_NOT_SUPPORTED);
    let r = ctl.control(client, 0xbad, GET_TIMESLICE, &mut sentinel);
    assert_eq!(r.status, status::NV_ERR_INVALID_OBJECT_HANDLE);
    assert_eq!(
        ok(ctl.sched_control(client, sub, set_gpfifo, &mut gpfifo)),
        (0, 0)
    );

    // A control the fake does not model: NV_OK after the client checks, whatever its size.
    let unknown = 0x2080_01ee;
    assert_eq!(
        ok(ctl.sched_control(client, sub, unknown, &mut [0u8; 3])),
        (0, 0)
    );
    assert_eq!(
        ctl.sched_control(other, sub, unknown, &mut [0u8; 3]).status,
        status::NV_ERR_INVALID_CLIENT
    );

    // What reached the driver, and nothing else.
    let s = fake.snapshot();
    let want: std::collections::BTreeMap<String, u64> = [
        (format!("{GET_TIMESLICE:#010x}"), 1),
        (format!("{set_gpfifo:#010x}"), 1),
    ]
    .into();
    assert_eq!(s.controls, want);
    assert_eq!(
        (s.control_count(GET_TIMESLICE), s.control_count(unknown)),
        (1, 0)
    );
    assert_eq!(s.stats.legacy, 4);
}

/// SET_TIMESLICE takes any value and GET_TIMESLICE reads it back (as on the H100); the
/// interleave level (of the group, or of the group through one of its channels) and the
/// realtime flag are recorded; the NICE right gates them, PRIVILEGED needs CAP_SYS_ADMIN; every
/// scheduling control the guard refuses reaches the driver from a privileged caller.
#[test]
fn scheduling_controls_take_effect_with_the_rights_the_driver_asks() {
    use sched::{InterleaveParams, RealtimeParams};
    let Some(fake) = fake("sched-controls", GIB) else {
        return;
    };
    let f = open_ctl(&fake);
    let ctl = Ctl::new(&f);
    let [client, device, sub] = ctl.alloc_subdevice_tree(0).expect("client tree");
    let group = ctl.alloc_channel_group(client, device).handle;
    let chan = ctl.alloc_channel(client, group).expect("channel");
    let s = fake.snapshot();
    let c = s.channel(client, chan).expect("channel in the state");
    assert_eq!(
        (c.group, c.pid, c.gpu, c.enabled),
        (group, std::process::id(), Some(0), true)
    );
    let g = s.channel_group(client, group).unwrap();
    assert_eq!((g.interleave, g.realtime), (0, false));

    for us in [0, 1, 100, 2_000_000, 1 << 32] {
        let r = ctl.set_timeslice(client, group, us);
        assert!(r.ok(), "{us}: {r:?}");
        let (r, got) = ctl.get_timeslice(client, group);
        assert!(r.ok(), "{r:?}");
        assert_eq!(got, us);
    }

    let interleave = |cmd: u32, object: u32, level: u32| {
        let mut p = InterleaveParams { level };
        ctl.control(client, object, cmd, &mut p).status
    };
    let group_state = || {
        fake.snapshot()
            .channel_group(client, group)
            .unwrap()
            .clone()
    };
    assert_eq!(interleave(sched::TSG_SET_INTERLEAVE_LEVEL, group, 2), 0);
    assert_eq!(group_state().interleave, 2);
    assert_eq!(
        interleave(sched::TSG_SET_INTERLEAVE_LEVEL, group, 3),
        status::NV_ERR_INVALID_ARGUMENT
    );
    assert_eq!(group_state().interleave, 2);
    // The channel's control sets its whole group's level.
    assert_eq!(interleave(sched::CHANNEL_SET_INTERLEAVE_LEVEL, chan, 1), 0);
    assert_eq!(group_state().interleave, 1);
    // Each on the object that exports it.
    assert_eq!(
        interleave(sched::CHANNEL_SET_INTERLEAVE_LEVEL, group, 0),
        status::NV_ERR_NOT_SUPPORTED
    );
    let mut rt = RealtimeParams { realtime: 1 };
    assert!(
        ctl.control(client, group, sched::TSG_MAKE_REALTIME, &mut rt)
            .ok()
    );
    assert!(group_state().realtime);

    // Without CAP_SYS_NICE and CAP_SYS_ADMIN: the NICE and PRIVILEGED controls are refused,
    // nothing changes; SET_TIMESLICE (NON_PRIVILEGED) still passes.
    let mut z2 = [0u8; 2];
    let mut z8 = [0u8; 8];
    let mut z4 = [0u8; 4];
    let refused = with_caps(&[], || {
        let mut rt = RealtimeParams { realtime: 0 };
        vec![
            interleave(sched::TSG_SET_INTERLEAVE_LEVEL, group, 0),
            interleave(sched::CHANNEL_SET_INTERLEAVE_LEVEL, chan, 0),
            ctl.control(client, group, sched::TSG_MAKE_REALTIME, &mut rt)
                .status,
            ctl.sched_control(client, chan, sched::CHANNEL_RESTART_RUNLIST, &mut z2)
                .status,
            ctl.sched_control(client, sub, sched::RUNLIST_SET_SCHED_POLICY, &mut z8)
                .status,
            ctl.sched_control(client, sub, sched::SET_COMPUTE_POLICY_CONFIG, &mut z8)
                .status,
            ctl.sched_control(client, device, sched::DEVICE_STOP_RUNLIST, &mut z4)
                .status,
            ctl.set_timeslice(client, group, 5000).status,
        ]
    });
    let mut want = vec![status::NV_ERR_INSUFFICIENT_PERMISSIONS; 7];
    want.push(status::NV_OK);
    assert_eq!(refused, want);
    let g = group_state();
    assert_eq!((g.interleave, g.realtime, g.timeslice_us), (1, true, 5000));
    // CAP_SYS_NICE alone: the NICE right, not PRIVILEGED.
    let got = with_caps(&[CAP_SYS_NICE], || {
        (
            interleave(sched::TSG_SET_INTERLEAVE_LEVEL, group, 0),
            ctl.sched_control(client, sub, sched::SET_COMPUTE_POLICY_CONFIG, &mut z8)
                .status,
        )
    });
    assert_eq!(got, (0, status::NV_ERR_INSUFFICIENT_PERMISSIONS));
    assert_eq!(group_state().interleave, 0);
    // CAP_SYS_ADMIN alone: both.
    let got = with_caps(&[CAP_SYS_ADMIN], || {
        (
            interleave(sched::TSG_SET_INTERLEAVE_LEVEL, group, 2),
            ctl.sched_control(client, device, sched::DEVICE_START_RUNLIST, &mut z4)
                .status,
        )
    });
    assert_eq!(got, (0, 0));

    // Every control the guard refuses reaches the driver from a privileged caller, on the
    // object that exports it, and is counted once more.
    let before = fake.snapshot();
    for c in sched::CONTROLS
        .iter()
        .filter(|c| c.rule == sched::Rule::Refuse)
    {
        let object = match c.cmd >> 16 {
            0xa06c | 0x0090 => group,
            0xa06f => chan,
            0x0080 => device,
            _ => sub,
        };
        let mut p = vec![0u8; c.size as usize];
        let r = ctl.sched_control(client, object, c.cmd, &mut p);
        assert_eq!((r.ret, r.status), (0, 0), "{}", c.name);
    }
    let after = fake.snapshot();
    for c in sched::CONTROLS
        .iter()
        .filter(|c| c.rule == sched::Rule::Refuse)
    {
        assert_eq!(
            after.control_count(c.cmd),
            before.control_count(c.cmd) + 1,
            "{}",
            c.name
        );
    }
    // Zeroed parameters: interleave LOW, not realtime.
    let g = after.channel_group(client, group).unwrap();
    assert_eq!((g.interleave, g.realtime), (0, false));
    // The channel goes with its group.
    assert!(ctl.free(client, group).ok());
    let s = fake.snapshot();
    assert!(s.channels.is_empty() && s.channel_groups.is_empty());
}

/// FIFO_DISABLE_CHANNELS resolves its (client, channel) pairs among every client, as the
/// driver does (and as the H100 showed: another process's channels were disabled): a tenant
/// disables another process's channel through its own subdevice, and under `runlist stop` that
/// process stops until the channel is enabled again. Its own client in NVOS54.hClient must
/// still be bound to its file.
#[test]
fn disable_channels_reaches_another_processs_channel() {
    let Some(fake) = fake("disable-channels", GIB) else {
        return;
    };
    // The victim: another process, with a channel in a channel group.
    let mut a = RmProcess::spawn(None, &fake.ctl());
    let (ac, adev, _) = setup(&mut a);
    let ag = a.handle(&format!("channel-group {ac} {adev}"));
    let chan_class = class::HOPPER_CHANNEL_GPFIFO_A;
    let ach = a.handle(&format!("alloc {ac} {ag} 0 class={chan_class:#x}"));
    let c = fake.snapshot().channel(ac, ach).cloned().expect("channel");
    assert_eq!((c.group, c.pid, c.enabled), (ag, a.pid, true));

    // The tenant: this process, its own file and client.
    let f = open_ctl(&fake);
    let ctl = Ctl::new(&f);
    let [bc, _, bsub] = ctl.alloc_subdevice_tree(0).expect("client tree");
    fake.inject("runlist stop").expect("inject");
    let enabled = || fake.snapshot().channel(ac, ach).map(|c| c.enabled);

    // Refused, nothing changed: a pair naming no channel (none, or a channel group), more
    // pairs than the lists hold, an event pointer from user space, another file's client as
    // the caller.
    let d = sched::DISABLE_CHANNELS;
    for pairs in [
        vec![(ac, ach), (ac, 0xbad)],
        vec![(ac, ag)],
        vec![(0xc1d0_0bad, ach)],
    ] {
        let r = ctl.disable_channels(bc, bsub, true, &pairs);
        assert_eq!(r.status, status::NV_ERR_INVALID_CHANNEL, "{pairs:x?}");
    }
    let r = ctl.disable_channels(bc, bsub, true, &[(ac, ach); 65]);
    assert_eq!(r.status, status::NV_ERR_INVALID_ARGUMENT);
    let mut p = sched::DisableChannelsParams {
        disable: 1,
        num_channels: 1,
        runlist_preempt_event: 0x1000,
        ..Default::default()
    };
    (p.client_list[0], p.channel_list[0]) = (ac, ach);
    let r = ctl.control(bc, bsub, d, &mut p);
    assert_eq!(r.status, status::NV_ERR_INSUFFICIENT_PERMISSIONS);
    let r = ctl.disable_channels(ac, bsub, true, &[(ac, ach)]);
    assert_eq!(r.status, status::NV_ERR_INVALID_CLIENT);
    // The legacy alias: not supported, nothing done, even with the victim's client.
    p.runlist_preempt_event = 0;
    for caller in [bc, ac] {
        let r = ctl.control(caller, bsub, d | sched::LEGACY_BIT, &mut p);
        assert_eq!(r.status, status::NV_ERR_NOT_SUPPORTED);
    }
    assert_eq!(enabled(), Some(true));
    assert_ne!(gpud_tests::process_state(a.pid), 'T');
    assert_eq!(fake.snapshot().control_count(d), 0);

    // The victim's channel, named from the tenant's own client and subdevice: disabled, and the
    // victim stops; enabled again, it continues.
    let r = ctl.disable_channels(bc, bsub, true, &[(ac, ach)]);
    assert_eq!((r.ret, r.status), (0, status::NV_OK));
    assert_eq!(enabled(), Some(false));
    assert!(
        eventually_sync(|| gpud_tests::process_state(a.pid) == 'T'),
        "victim not stopped: {}",
        gpud_tests::process_state(a.pid)
    );
    let r = ctl.disable_channels(bc, bsub, false, &[(ac, ach)]);
    assert!(r.ok(), "{r:?}");
    assert_eq!(enabled(), Some(true));
    assert!(eventually_sync(|| gpud_tests::process_state(a.pid) != 'T'));
    // No channels at all: nothing to do.
    assert!(ctl.disable_channels(bc, bsub, true, &[]).ok());
    assert_eq!(fake.snapshot().control_count(d), 3);

    // `runlist record`: disabled, and the victim runs on (firmware that ignores it).
    fake.inject("runlist record").expect("inject");
    assert!(ctl.disable_channels(bc, bsub, true, &[(ac, ach)]).ok());
    assert_eq!(enabled(), Some(false));
    std::thread::sleep(Duration::from_millis(50));
    assert_ne!(gpud_tests::process_state(a.pid), 'T');
    // The params were read, not written.
    let mut p = sched::DisableChannelsParams {
        disable: 0,
        num_channels: 1,
        ..Default::default()
    };
    (p.client_list[0], p.channel_list[0]) = (ac, ach);
    let copy = bytes_of(&p).to_vec();
    assert!(ctl.control(bc, bsub, d, &mut p).ok());
    assert_eq!(bytes_of(&p), &copy[..]);
    assert_eq!(enabled(), Some(true));
    // The channel goes with its group.
    a.ok(&format!("free {ac} {ag}"));
    assert!(fake.snapshot().channels.is_empty());
}

/// A device's GPU as gpud asks it (`Controls::device_instance`, through a `pidfd_getfd` copy of
/// the caller's file): a device answers no query of its own instance, so the client's subdevice
/// is asked where it holds one, else one is made for the question and freed after. A client
/// holds one subdevice per instance under a device, as the driver allows. Whether an object is
/// still there (`Controls::exists`): the driver answers for any object, not found once freed.
#[test]
fn a_devices_gpu_is_asked_through_its_subdevice() {
    use gpud::{
        enforcement::compute::channel::{Controls, RmObject},
        probes::devices::{DynamicMajors, Matcher, resolve_extra_paths},
    };
    let Some((fake, mut p)) = caller("fk-devgpu", GIB) else {
        return;
    };
    let client = p.handle("client");
    let device = p.handle(&format!("device {client} 1"));
    let pid = u(&p.ok("pid"), "pid") as u32;
    let matcher = Matcher {
        majors: DynamicMajors::read().expect("/proc/devices"),
        extra: resolve_extra_paths(&[fake.ctl()]).expect("the fake's control file"),
    };
    let mut controls = Controls::new(matcher, None);
    let at = |object| RmObject {
        pid,
        client,
        object,
    };
    let subdevices = |fake: &Mounted| {
        fake.snapshot()
            .objects
            .iter()
            .filter(|o| o.client == client && o.class == class::SUBDEVICE)
            .count()
    };
    assert_eq!(controls.device_instance(at(device)).expect("asked"), 1);
    assert_eq!(subdevices(&fake), 0, "the subdevice made to ask is freed");

    let sub = p.handle(&format!("subdevice {client} {device}"));
    let again = p.cmd(&format!("subdevice {client} {device}"));
    assert_eq!(
        status_of(&again),
        status::NV_ERR_INSUFFICIENT_RESOURCES,
        "{again}"
    );
    assert_eq!(controls.device_instance(at(device)).expect("asked"), 1);
    assert!(
        fake.snapshot().object(client, sub).is_some(),
        "the client's own subdevice stays"
    );

    let memory = u(
        &p.ok(&format!("alloc {client} {device} {}", 4 * MIB)),
        "handle",
    ) as u32;
    for object in [client, device, sub, memory] {
        assert!(controls.exists(at(object)).expect("asked"), "{object:#x}");
    }
    p.ok(&format!("free {client} {memory}"));
    assert!(!controls.exists(at(memory)).expect("asked"));
}
