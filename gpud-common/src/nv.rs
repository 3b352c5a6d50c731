//! NVIDIA driver ioctl numbers and the classifier of commands.
//!
//! Facts from the open GPU kernel modules (see shared/reference/nvidia-ioctl-abi.md): the frontend
//! command is `_IOWR('F', nr, size)` but the driver looks only at `_IOC_NR` and `_IOC_SIZE`, and
//! rejects an escape whose size is not the size of its parameter struct. The classifier does the
//! same, so a command the driver would refuse is never counted as an allocation.

use crate::{DeviceKind, IoctlClass};

/// Char major of `/dev/nvidiactl` and `/dev/nvidiaN` (`NV_MAJOR_DEVICE_NUMBER`).
pub const NV_MAJOR: u32 = 195;
/// Minor of `/dev/nvidiactl`.
pub const NV_CTL_MINOR: u32 = 255;
/// Minor of `/dev/nvidia-modeset` (display driver; not a compute path, not matched).
pub const NV_MODESET_MINOR: u32 = 254;
/// Largest minor of `/dev/nvidiaN`.
pub const NV_GPU_MINOR_MAX: u32 = 247;

/// Name of the `nvidia-uvm` major (`/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`) in
/// `/proc/devices` (`alloc_chrdev_region` in `uvm.c`).
pub const UVM_DEVICE_NAME: &str = "nvidia-uvm";
/// Name of the `/dev/nvidia-caps/*` major in `/proc/devices` (`nv-caps.c`).
pub const CAPS_DEVICE_NAME: &str = "nvidia-caps";
/// Name of the `/dev/nvidia-caps-imex-channels/*` major in `/proc/devices` (`nv-caps-imex.c`).
pub const CAPS_IMEX_DEVICE_NAME: &str = "nvidia-caps-imex-channels";

// RM escapes (`nv_escape.h`); the handlers are in `RmIoctl()` (`escape.c`).

/// `NV_ESC_RM_ALLOC_MEMORY` (legacy; in practice system memory and OS descriptors, not video
/// memory), on `/dev/nvidiaN` only.
pub const NV_ESC_RM_ALLOC_MEMORY: u32 = 0x27;
/// `NV_ESC_RM_ALLOC_OBJECT` (legacy).
pub const NV_ESC_RM_ALLOC_OBJECT: u32 = 0x28;
/// `NV_ESC_RM_FREE`: frees an object and its subtree; freeing `hRoot` frees the client.
pub const NV_ESC_RM_FREE: u32 = 0x29;
/// `NV_ESC_RM_CONTROL`: an RM control call selected by `cmd`.
pub const NV_ESC_RM_CONTROL: u32 = 0x2a;
/// `NV_ESC_RM_ALLOC`: allocates an object of a class (NVOS21 or, by size, NVOS64).
pub const NV_ESC_RM_ALLOC: u32 = 0x2b;
/// `NV_ESC_RM_VID_HEAP_CONTROL`: the older heap interface; its alloc functions become an
/// internal RM_ALLOC of a memory class.
pub const NV_ESC_RM_VID_HEAP_CONTROL: u32 = 0x4a;
/// `NV_ESC_RM_MAP_MEMORY`: sets up a CPU mapping (made by a later `mmap`).
pub const NV_ESC_RM_MAP_MEMORY: u32 = 0x4e;
/// `NV_ESC_RM_UNMAP_MEMORY`.
pub const NV_ESC_RM_UNMAP_MEMORY: u32 = 0x4f;
/// `NV_ESC_RM_MAP_MEMORY_DMA`: maps memory into a GPU virtual address space.
pub const NV_ESC_RM_MAP_MEMORY_DMA: u32 = 0x57;
/// `NV_ESC_RM_UNMAP_MEMORY_DMA`.
pub const NV_ESC_RM_UNMAP_MEMORY_DMA: u32 = 0x58;
/// `NV_ESC_RM_DUP_OBJECT`: a new handle referencing another client's object.
pub const NV_ESC_RM_DUP_OBJECT: u32 = 0x34;
/// `NV_ESC_RM_SHARE`: sets an object's share policy.
pub const NV_ESC_RM_SHARE: u32 = 0x35;
/// `NV_ESC_ALLOC_OS_EVENT` (OS escape, `NV_IOCTL_BASE` + 6).
pub const NV_ESC_ALLOC_OS_EVENT: u32 = 206;
/// `NV_ESC_FREE_OS_EVENT` (OS escape, `NV_IOCTL_BASE` + 7).
pub const NV_ESC_FREE_OS_EVENT: u32 = 207;
/// `NV_ESC_IOCTL_XFER_CMD`: wraps another escape with a separate size and pointer.
pub const NV_ESC_IOCTL_XFER_CMD: u32 = 211;

// Sizes of the parameter structs (x86-64 and arm64; identical for 32-bit callers, since every
// 64-bit member is 8-aligned). The driver refuses an escape whose `_IOC_SIZE` differs.

/// `nv_ioctl_nvos02_parameters_with_fd` (`NV_ESC_RM_ALLOC_MEMORY`): NVOS02 (48) and an fd.
pub const NVOS02_WITH_FD_SIZE: u32 = 56;
/// `NVOS05_PARAMETERS` (`NV_ESC_RM_ALLOC_OBJECT`).
pub const NVOS05_SIZE: u32 = 20;
/// `NVOS00_PARAMETERS` (`NV_ESC_RM_FREE`).
pub const NVOS00_SIZE: u32 = 16;
/// `NVOS54_PARAMETERS` (`NV_ESC_RM_CONTROL`).
pub const NVOS54_SIZE: u32 = 32;
/// `NVOS21_PARAMETERS` (`NV_ESC_RM_ALLOC`, short form).
pub const NVOS21_SIZE: u32 = 32;
/// NVOS64 before driver 535.
pub const NVOS64_SIZE_OLD: u32 = 40;
/// NVOS64 from driver 535 on.
pub const NVOS64_SIZE: u32 = 48;
/// `NVOS32_PARAMETERS` (`NV_ESC_RM_VID_HEAP_CONTROL`), unchanged from 515 to 595.
pub const NVOS32_SIZE: u32 = 184;
/// `nv_ioctl_nvos33_parameters_with_fd` (`NV_ESC_RM_MAP_MEMORY`): NVOS33 (48) and an fd.
pub const NVOS33_WITH_FD_SIZE: u32 = 56;
/// `NVOS34_PARAMETERS` (`NV_ESC_RM_UNMAP_MEMORY`).
pub const NVOS34_SIZE: u32 = 32;
/// NVOS46 from driver 580 on; 56 before.
pub const NVOS46_SIZE: u32 = 64;
/// NVOS46 before driver 580 (no `kindOverride`).
pub const NVOS46_SIZE_OLD: u32 = 56;
/// `NVOS47_PARAMETERS` (`NV_ESC_RM_UNMAP_MEMORY_DMA`).
pub const NVOS47_SIZE: u32 = 48;
/// `NVOS55_PARAMETERS` (`NV_ESC_RM_DUP_OBJECT`).
pub const NVOS55_SIZE: u32 = 28;
/// `NVOS57_PARAMETERS` (`NV_ESC_RM_SHARE`).
pub const NVOS57_SIZE: u32 = 24;
/// `nv_ioctl_alloc_os_event_t` and `nv_ioctl_free_os_event_t`.
pub const NV_OS_EVENT_SIZE: u32 = 16;
/// `nv_ioctl_xfer_t { u32 cmd; u32 size; NvP64 ptr; }`.
pub const NV_IOCTL_XFER_SIZE: u32 = 16;
/// `NV_ABSOLUTE_MAX_IOCTL_SIZE`: the largest size an XFER may carry.
pub const NV_MAX_IOCTL_SIZE: u32 = 16384;

/// `_IOC_NR` of a command.
#[inline(always)]
pub const fn ioc_nr(cmd: u32) -> u32 {
    cmd & 0xff
}

/// `_IOC_SIZE` of a command (14 bits on x86-64 and arm64).
#[inline(always)]
pub const fn ioc_size(cmd: u32) -> u32 {
    (cmd >> 16) & 0x3fff
}

/// Whether `cmd` is of `_IOC_TYPE` 'F', the type of every RM and OS escape (whatever the
/// direction bits: the driver ignores them).
#[inline(always)]
pub const fn is_escape_type(cmd: u32) -> bool {
    (cmd >> 8) & 0xff == 0x46
}

/// Builds `_IOWR('F', nr, size)`, the encoding CUDA and other clients use.
#[inline(always)]
pub const fn nv_iowr(nr: u32, size: u32) -> u32 {
    0xc000_0000 | ((size & 0x3fff) << 16) | (0x46 << 8) | (nr & 0xff)
}

/// Classifies an RM/OS escape by number and argument size, as `nvidia_ioctl()` dispatches it.
/// `size` is `_IOC_SIZE(cmd)` for a direct call or `xfer.size` for an XFER-wrapped one.
#[inline(always)]
pub const fn classify_escape(nr: u32, size: u32) -> IoctlClass {
    match (nr, size) {
        (NV_ESC_RM_ALLOC, NVOS21_SIZE | NVOS64_SIZE_OLD | NVOS64_SIZE)
        | (NV_ESC_RM_ALLOC_MEMORY, NVOS02_WITH_FD_SIZE)
        | (NV_ESC_RM_ALLOC_OBJECT, NVOS05_SIZE) => IoctlClass::Alloc,
        (NV_ESC_RM_FREE, NVOS00_SIZE) => IoctlClass::Free,
        (NV_ESC_RM_CONTROL, NVOS54_SIZE) => IoctlClass::Control,
        (NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_SIZE) => IoctlClass::VidHeap,
        (NV_ESC_RM_MAP_MEMORY, NVOS33_WITH_FD_SIZE)
        | (NV_ESC_RM_UNMAP_MEMORY, NVOS34_SIZE)
        | (NV_ESC_RM_MAP_MEMORY_DMA, NVOS46_SIZE | NVOS46_SIZE_OLD)
        | (NV_ESC_RM_UNMAP_MEMORY_DMA, NVOS47_SIZE) => IoctlClass::Map,
        _ => IoctlClass::Other,
    }
}

/// What the classifier needs next for a command on a file of `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// The class is known.
    Class(IoctlClass),
    /// An `NV_ESC_IOCTL_XFER_CMD`: read the 16-byte `nv_ioctl_xfer_t` at the argument pointer and
    /// classify `(xfer.cmd, xfer.size)` with [`classify_xfer`].
    Xfer,
}

/// First step of classification of `cmd` issued on a file of `kind`.
#[inline(always)]
pub const fn classify(kind: DeviceKind, cmd: u32) -> Decoded {
    if let DeviceKind::Uvm = kind {
        return Decoded::Class(IoctlClass::Uvm);
    }
    let nr = ioc_nr(cmd);
    let size = ioc_size(cmd);
    if nr == NV_ESC_IOCTL_XFER_CMD {
        if size == NV_IOCTL_XFER_SIZE {
            return Decoded::Xfer;
        }
        return Decoded::Class(IoctlClass::Other);
    }
    Decoded::Class(classify_escape(nr, size))
}

/// Classifies the request inside an XFER wrapper. The driver takes `xfer.cmd` as the bare escape
/// number and refuses sizes above [`NV_MAX_IOCTL_SIZE`]; it does not nest XFERs.
#[inline(always)]
pub const fn classify_xfer(inner_cmd: u32, inner_size: u32) -> IoctlClass {
    if inner_size > NV_MAX_IOCTL_SIZE || inner_cmd > 0xff || inner_cmd == NV_ESC_IOCTL_XFER_CMD {
        return IoctlClass::Other;
    }
    classify_escape(inner_cmd, inner_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_commands() {
        // Values from the ABI reference, §1.3.
        assert_eq!(nv_iowr(NV_ESC_RM_ALLOC, NVOS64_SIZE), 0xc030462b);
        assert_eq!(nv_iowr(NV_ESC_RM_FREE, NVOS00_SIZE), 0xc0104629);
        assert_eq!(nv_iowr(NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_SIZE), 0xc0b8464a);
        assert_eq!(nv_iowr(NV_ESC_IOCTL_XFER_CMD, 16), 0xc01046d3);
        let c = |cmd| classify(DeviceKind::Control, cmd);
        assert_eq!(c(0xc020462b), Decoded::Class(IoctlClass::Alloc));
        assert_eq!(c(0xc030462b), Decoded::Class(IoctlClass::Alloc));
        assert_eq!(c(0xc0104629), Decoded::Class(IoctlClass::Free));
        assert_eq!(c(0xc020462a), Decoded::Class(IoctlClass::Control));
        assert_eq!(c(0xc0b8464a), Decoded::Class(IoctlClass::VidHeap));
        assert_eq!(c(0xc038464e), Decoded::Class(IoctlClass::Map));
        assert_eq!(c(0xc0404657), Decoded::Class(IoctlClass::Map));
        assert_eq!(c(0xc01046d3), Decoded::Xfer);
        assert_eq!(c(0xc00446c9), Decoded::Class(IoctlClass::Other));
    }

    #[test]
    fn type_and_direction_are_ignored_size_is_not() {
        // The driver ignores _IOC_TYPE and _IOC_DIR: 'X' and _IOW still allocate.
        let odd = (0x4000_0000) | (48 << 16) | (0x58 << 8) | NV_ESC_RM_ALLOC;
        assert_eq!(
            classify(DeviceKind::Control, odd),
            Decoded::Class(IoctlClass::Alloc)
        );
        // A wrong size is refused with EINVAL by the driver: not an allocation.
        let bad = nv_iowr(NV_ESC_RM_ALLOC, 36);
        assert_eq!(
            classify(DeviceKind::Control, bad),
            Decoded::Class(IoctlClass::Other)
        );
    }

    #[test]
    fn uvm_and_xfer() {
        assert_eq!(
            classify(DeviceKind::Uvm, 0x3000_0001),
            Decoded::Class(IoctlClass::Uvm)
        );
        assert_eq!(
            classify(DeviceKind::Uvm, 0xc030462b),
            Decoded::Class(IoctlClass::Uvm)
        );
        assert_eq!(classify_xfer(NV_ESC_RM_ALLOC, 48), IoctlClass::Alloc);
        assert_eq!(classify_xfer(NV_ESC_RM_ALLOC, 20000), IoctlClass::Other);
        assert_eq!(classify_xfer(0xc030462b, 48), IoctlClass::Other);
        assert_eq!(classify_xfer(NV_ESC_IOCTL_XFER_CMD, 16), IoctlClass::Other);
    }
}
