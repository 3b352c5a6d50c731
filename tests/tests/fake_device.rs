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
    rm::{self, class, status},
};
use gpud_tests::{
    Cgroup, Rig, RmProcess, TempDir, bin_dir, class_counts, eventually,
    fakenv::{self, FakeNv, Options, Snapshot},
    rm::{Alloc, Ctl, Form, bytes_of_mut},
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
    // Other classes are plain objects under any parent.
    let plain = p.handle(&format!("alloc {client} {sub} 1 class=0xc86f"));
    assert_eq!(fake.snapshot().object(client, plain).unwrap().gpu, Some(0));
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
    // Parameters of another control's size.
    let mut bad = rm::tsg::TimesliceParams::default();
    let r = ctl.control(client, group, rm::tsg::GPFIFO_SCHEDULE, &mut bad);
    assert_eq!(r.status, status::NV_ERR_INVALID_PARAM_STRUCT);
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
