//! Property tests of the ioctl classifier (the decoder the eBPF programs run on every matched
//! ioctl): for any command word it agrees with the driver's dispatch rules and never panics.

use gpud_common::{
    DeviceKind, IoctlClass,
    nv::{self, Decoded, classify, classify_xfer, ioc_nr, ioc_size, nv_iowr},
};
use proptest::prelude::*;

/// The (escape, size) pairs the driver accepts, and their class.
fn accepted(nr: u32, size: u32) -> Option<IoctlClass> {
    use nv::*;
    let table: &[(u32, &[u32], IoctlClass)] = &[
        (NV_ESC_RM_ALLOC, &[32, 40, 48], IoctlClass::Alloc),
        (NV_ESC_RM_ALLOC_MEMORY, &[56], IoctlClass::Alloc),
        (NV_ESC_RM_ALLOC_OBJECT, &[20], IoctlClass::Alloc),
        (NV_ESC_RM_FREE, &[16], IoctlClass::Free),
        (NV_ESC_RM_CONTROL, &[32], IoctlClass::Control),
        (NV_ESC_RM_VID_HEAP_CONTROL, &[184], IoctlClass::VidHeap),
        (NV_ESC_RM_MAP_MEMORY, &[56], IoctlClass::Map),
        (NV_ESC_RM_UNMAP_MEMORY, &[32], IoctlClass::Map),
        (NV_ESC_RM_MAP_MEMORY_DMA, &[56, 64], IoctlClass::Map),
        (NV_ESC_RM_UNMAP_MEMORY_DMA, &[48], IoctlClass::Map),
    ];
    table
        .iter()
        .find(|(n, sizes, _)| *n == nr && sizes.contains(&size))
        .map(|(_, _, c)| *c)
}

proptest! {
    #[test]
    fn any_command_on_a_control_or_gpu_file(cmd in any::<u32>(), gpu in any::<bool>()) {
        let kind = if gpu { DeviceKind::Gpu } else { DeviceKind::Control };
        let (nr, size) = (ioc_nr(cmd), ioc_size(cmd));
        let want = if nr == nv::NV_ESC_IOCTL_XFER_CMD {
            if size == 16 { Decoded::Xfer } else { Decoded::Class(IoctlClass::Other) }
        } else {
            Decoded::Class(accepted(nr, size).unwrap_or(IoctlClass::Other))
        };
        prop_assert_eq!(classify(kind, cmd), want);
    }

    #[test]
    fn type_and_direction_bits_never_matter(nr in 0u32..256, size in 0u32..0x4000, tydir in any::<u32>()) {
        let canonical = nv_iowr(nr, size);
        // Replace _IOC_TYPE (bits 8..16) and _IOC_DIR (bits 30..32) with arbitrary values.
        let other = (canonical & 0x3fff_00ff) | (tydir & 0xc000_ff00);
        prop_assert_eq!(classify(DeviceKind::Control, canonical), classify(DeviceKind::Control, other));
    }

    #[test]
    fn anything_on_uvm_is_uvm(cmd in any::<u32>()) {
        prop_assert_eq!(classify(DeviceKind::Uvm, cmd), Decoded::Class(IoctlClass::Uvm));
    }

    #[test]
    fn xfer_payloads(inner_cmd in any::<u32>(), inner_size in any::<u32>()) {
        let want = if inner_cmd > 0xff
            || inner_size > nv::NV_MAX_IOCTL_SIZE
            || inner_cmd == nv::NV_ESC_IOCTL_XFER_CMD
        {
            IoctlClass::Other
        } else {
            accepted(inner_cmd, inner_size).unwrap_or(IoctlClass::Other)
        };
        prop_assert_eq!(classify_xfer(inner_cmd, inner_size), want);
    }
}
