//! `fuzz`: corrupted RM calls built from valid ones, deterministic for a seed.

use gpud_common::nv;
use gpud_tests::rm::Ctl;
use serde_json::{Value, json};

/// `fuzz CLIENT DEVICE SEED N`: N RM calls built from valid ones (an NVOS21/NVOS64 allocation
/// of video memory under DEVICE, a VID_HEAP_CONTROL, a free) with random corruptions: classes,
/// handles, sizes, flags, parameter pointers (garbage or null), ioctl sizes, XFER wrapping, random
/// bytes. Deterministic for a seed. Answers how many calls the driver accepted.
pub(crate) fn fuzz(ctl: &Ctl<'_>, client: u32, device: u32, seed: u64, n: u64) -> Value {
    use gpud_common::rm::{self as r, MemoryAllocationParams, Nvos00, Nvos32, Nvos64};
    let mut next = gpud_tests::rm::xorshift(seed);
    let mut accepted = 0u64;
    let mut handles: Vec<u32> = Vec::new();
    for _ in 0..n {
        let mut params = MemoryAllocationParams {
            size: (next() % (8 << 20)) + 1,
            ..Default::default()
        };
        if next().is_multiple_of(8) {
            params.flags = next() as u32;
        }
        if next().is_multiple_of(8) {
            params.attr = next() as u32;
        }
        let pick = next() % 10;
        let mut buf = [0u8; 256];
        let (nr, size) = match pick {
            0..=5 => {
                let mut a = Nvos64 {
                    h_root: if next().is_multiple_of(10) {
                        next() as u32
                    } else {
                        client
                    },
                    h_object_parent: if next().is_multiple_of(10) {
                        next() as u32
                    } else {
                        device
                    },
                    h_class: match next() % 6 {
                        0 => r::class::MEMORY_VIRTUAL,
                        1 => next() as u32,
                        _ => r::class::MEMORY_LOCAL_USER,
                    },
                    // Garbage pointers are in the kernel half, which no user mapping covers: the
                    // driver's copy fails (EFAULT) and nothing in this process is written.
                    p_alloc_parms: match next() % 10 {
                        0 => 0,
                        1 => next() | 1 << 63,
                        _ => (&mut params as *mut MemoryAllocationParams) as u64,
                    },
                    flags: if next().is_multiple_of(10) {
                        next() as u32
                    } else {
                        0
                    },
                    ..Default::default()
                };
                a.status = next() as u32; // an OUT field: garbage on the way in
                buf[..48].copy_from_slice(gpud_tests::rm::bytes_of(&a));
                let size = match next() % 6 {
                    0 => 32,
                    1 => (next() % 64) as u32,
                    _ => 48,
                };
                (nv::NV_ESC_RM_ALLOC, size)
            }
            6 | 7 => {
                let mut v = Nvos32 {
                    h_root: client,
                    h_object_parent: device,
                    function: [2, 3, 6, 14, next() as u32][(next() % 5) as usize],
                    ..Default::default()
                };
                for b in v.data.iter_mut() {
                    if next().is_multiple_of(4) {
                        *b = next() as u8;
                    }
                }
                buf[..184].copy_from_slice(gpud_tests::rm::bytes_of(&v));
                (nv::NV_ESC_RM_VID_HEAP_CONTROL, 184)
            }
            8 => {
                let obj = match handles.last() {
                    Some(h) if next().is_multiple_of(2) => *h,
                    _ => next() as u32,
                };
                let f = Nvos00 {
                    h_root: client,
                    h_object_parent: 0,
                    h_object_old: obj,
                    status: 0,
                };
                buf[..16].copy_from_slice(gpud_tests::rm::bytes_of(&f));
                (nv::NV_ESC_RM_FREE, 16)
            }
            _ => {
                for b in buf.iter_mut() {
                    *b = next() as u8;
                }
                // pAllocParms and pRightsRequested: kernel-half garbage, as above.
                buf[16..24].copy_from_slice(&(next() | 1 << 63).to_le_bytes());
                buf[24..32].copy_from_slice(&(next() | 1 << 63).to_le_bytes());
                (nv::NV_ESC_RM_ALLOC, 48)
            }
        };
        let (ret, _) = if next().is_multiple_of(4) {
            let mut x = r::NvIoctlXfer {
                cmd: nr,
                size,
                ptr: buf.as_mut_ptr() as u64,
            };
            let cmd = nv::nv_iowr(nv::NV_ESC_IOCTL_XFER_CMD, nv::NV_IOCTL_XFER_SIZE);
            // SAFETY: `x` and `buf` (256 bytes, more than any size used here) live across the
            // call; the only other pointers are `params` (live) or kernel-half garbage.
            unsafe { ctl.raw(cmd, (&mut x as *mut r::NvIoctlXfer).cast()) }
        } else {
            // SAFETY: as above; `size` never exceeds `buf`.
            unsafe { ctl.raw(nv::nv_iowr(nr, size), buf.as_mut_ptr()) }
        };
        if ret == 0 {
            accepted += 1;
            if nr == nv::NV_ESC_RM_ALLOC && size == 48 {
                handles.push(u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]));
            }
        }
    }
    json!({ "ok": true, "calls": n, "accepted": accepted })
}
