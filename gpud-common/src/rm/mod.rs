//! Parameter structs of the NVIDIA resource-manager (RM) escapes that allocate and free GPU
//! memory, as laid out by drivers 535 and later (x86-64 and arm64; identical for 32-bit callers,
//! since every 64-bit member is 8-aligned).
//!
//! Facts from the open GPU kernel modules (`src/common/sdk/nvidia/inc/nvos.h`, class headers),
//! measured with `offsetof` probes against the 595.45.04 headers; see
//! shared/reference/nvidia-ioctl-abi.md §3. The probes read these fields from user memory at the
//! ioctl's entry and return; the test fixture that plays the driver writes them. One definition
//! serves both, and the `const` assertions below pin every offset the probes rely on.

use core::mem::{offset_of, size_of};

/// An RM object handle (`NvHandle`). Client handles are unique among live clients; other handles
/// only within their client, so `(client, object)` is an object's identity.
pub type Handle = u32;

/// `NV_STATUS` values the accounting distinguishes (`nvstatuscodes.h`). RM writes them into the
/// parameter struct's `status`; the ioctl itself returns 0 for any well-formed request.
pub mod status {
    /// Success: the only status that is charged or uncharged.
    pub const NV_OK: u32 = 0;
    /// A malformed parameter.
    pub const NV_ERR_INVALID_ARGUMENT: u32 = 0x1f;
    /// `hClass` names no class RM allocates here.
    pub const NV_ERR_INVALID_CLASS: u32 = 0x22;
    /// `hRoot` names no live client.
    pub const NV_ERR_INVALID_CLIENT: u32 = 0x23;
    /// A handle names no object of the client.
    pub const NV_ERR_INVALID_OBJECT_HANDLE: u32 = 0x33;
    /// `hObjectParent` cannot parent the class.
    pub const NV_ERR_INVALID_OBJECT_PARENT: u32 = 0x36;
    /// Out of memory: an allocation that fails this way still returns 0 from `ioctl()`.
    pub const NV_ERR_NO_MEMORY: u32 = 0x51;
    /// A handle that is already in use (a live client, or an object within its client).
    pub const NV_ERR_INSERT_DUPLICATE_NAME: u32 = 0x19;
    /// RM ran out of an internal resource (e.g. handles).
    pub const NV_ERR_INSUFFICIENT_RESOURCES: u32 = 0x1a;
    /// A `VID_HEAP_CONTROL` function RM does not implement.
    pub const NV_ERR_INVALID_FUNCTION: u32 = 0x2a;
    /// A parameter pointer RM could not copy in.
    pub const NV_ERR_INVALID_POINTER: u32 = 0x3d;
    /// A control's parameters of the wrong size for it.
    pub const NV_ERR_INVALID_PARAM_STRUCT: u32 = 0x3a;
    /// The request is valid but not supported here.
    pub const NV_ERR_NOT_SUPPORTED: u32 = 0x56;
    /// `hObject` names no object of the client (`rs_client.c`).
    pub const NV_ERR_OBJECT_NOT_FOUND: u32 = 0x57;
}

/// RM classes (`hClass`) the accounting follows.
pub mod class {
    /// `NV01_ROOT`: rewritten by the driver to [`ROOT_CLIENT`].
    pub const ROOT: u32 = 0x0;
    /// `NV01_ROOT_NON_PRIV`: rewritten by the driver to [`ROOT_CLIENT`].
    pub const ROOT_NON_PRIV: u32 = 0x1;
    /// `NV01_ROOT_CLIENT`: a client; `hObjectNew` is the new client handle.
    pub const ROOT_CLIENT: u32 = 0x41;
    /// `NV01_DEVICE_0`: a GPU (or SLI group) under a client; params [`Nv0080AllocParams`](super::Nv0080AllocParams).
    pub const DEVICE: u32 = 0x80;
    /// `NV20_SUBDEVICE_0`: one GPU of a device.
    pub const SUBDEVICE: u32 = 0x2080;
    /// `NV01_MEMORY_LOCAL_USER`: physical video memory; params [`MemoryAllocationParams`](super::MemoryAllocationParams).
    pub const MEMORY_LOCAL_USER: u32 = 0x40;
    /// `NV01_MEMORY_SYSTEM`: pinned host memory (not video memory).
    pub const MEMORY_SYSTEM: u32 = 0x3e;
    /// `NV50_MEMORY_VIRTUAL`: a GPU virtual-address reservation (no physical memory).
    pub const MEMORY_VIRTUAL: u32 = 0x50a0;
    /// `KEPLER_CHANNEL_GROUP_A`: a channel group (TSG), the unit the GPU's scheduler time-slices;
    /// parent a device (gpu-scheduler-controls.md §2).
    pub const CHANNEL_GROUP: u32 = 0xa06c;

    /// Whether `hClass` allocates a client.
    #[inline(always)]
    pub const fn is_root(c: u32) -> bool {
        matches!(c, ROOT | ROOT_NON_PRIV | ROOT_CLIENT)
    }

    /// Whether `hClass` allocates a GPFIFO channel of Volta or later (`VOLTA_CHANNEL_GPFIFO_A`
    /// 0xc36f, Turing 0xc46f, Ampere 0xc56f/0xc76f, Hopper 0xc86f, Blackwell 0xc96f/0xca6f): the
    /// handles `FIFO_DISABLE_CHANNELS` takes.
    #[inline(always)]
    pub const fn is_gpfifo_channel(c: u32) -> bool {
        c & 0xff == 0x6f && c >= 0xc36f && c <= 0xcfff
    }
}

/// `NVOS00_PARAMETERS` (`NV_ESC_RM_FREE`). `hObjectParent` is ignored by modern RM; freeing
/// `hRoot` itself frees the client.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos00 {
    /// The client.
    pub h_root: Handle,
    /// Ignored by modern RM.
    pub h_object_parent: Handle,
    /// The object to free with its subtree; `h_root` itself frees the client.
    pub h_object_old: Handle,
    /// OUT: `NV_STATUS`.
    pub status: u32,
}

/// `NVOS55_PARAMETERS` (`NV_ESC_RM_DUP_OBJECT`, 28 bytes): a new handle in `h_client` under
/// `h_parent` that references the object `h_client_src:h_object_src`. A duplicate of memory
/// shares the original's pages: they are freed with the last handle (`memCopyConstruct_IMPL`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos55 {
    /// The client the new handle is made in.
    pub h_client: Handle,
    /// Its parent there (a device or subdevice for memory).
    pub h_parent: Handle,
    /// IN/OUT: the new handle; 0 asks RM for one.
    pub h_object: Handle,
    /// The client of the object duplicated.
    pub h_client_src: Handle,
    /// The object duplicated.
    pub h_object_src: Handle,
    /// `NV04_DUP_HANDLE_FLAGS_*`.
    pub flags: u32,
    /// OUT: `NV_STATUS`.
    pub status: u32,
}

/// `NVOS21_PARAMETERS` (`NV_ESC_RM_ALLOC`, 32 bytes). `h_object_new` is IN/OUT: 0 asks RM for a
/// handle. `params_size` is ignored by the driver (it copies the class's struct size).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos21 {
    /// The client; 0 when allocating a client.
    pub h_root: Handle,
    /// The parent object (a device or subdevice for memory classes).
    pub h_object_parent: Handle,
    /// IN/OUT: the new object's handle (0 asks RM for one).
    pub h_object_new: Handle,
    /// The class allocated (see [`class`]).
    pub h_class: u32,
    /// User pointer to the class's allocation parameters.
    pub p_alloc_parms: u64,
    /// From driver 535; ignored by the driver.
    pub params_size: u32,
    /// OUT: `NV_STATUS`.
    pub status: u32,
}

/// `NVOS64_PARAMETERS` (`NV_ESC_RM_ALLOC` with access rights, 48 bytes). The driver tells it from
/// [`Nvos21`] by the ioctl size alone; the first five fields sit at the same offsets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos64 {
    /// As in [`Nvos21`].
    pub h_root: Handle,
    /// As in [`Nvos21`].
    pub h_object_parent: Handle,
    /// IN/OUT, as in [`Nvos21`].
    pub h_object_new: Handle,
    /// As in [`Nvos21`].
    pub h_class: u32,
    /// As in [`Nvos21`].
    pub p_alloc_parms: u64,
    /// User pointer to an `RS_ACCESS_MASK`, or NULL.
    pub p_rights_requested: u64,
    /// Ignored by the driver.
    pub params_size: u32,
    /// `NVOS64_FLAGS_*`.
    pub flags: u32,
    /// OUT: `NV_STATUS`.
    pub status: u32,
    /// Padding to 8-byte alignment.
    pub _pad: u32,
}

/// `NVOS64_FLAGS_FINN_SERIALIZED`: `pAllocParms` points at a serialized blob, not the struct.
pub const NVOS64_FLAGS_FINN_SERIALIZED: u32 = 0x1;

// Offsets shared by [`Nvos21`] and [`Nvos64`] (the driver asserts they are equal).

/// `hRoot` in either RM_ALLOC form.
pub const ALLOC_H_ROOT: usize = offset_of!(Nvos21, h_root);
/// `hObjectParent` in either RM_ALLOC form.
pub const ALLOC_H_PARENT: usize = offset_of!(Nvos21, h_object_parent);
/// `hObjectNew` in either RM_ALLOC form.
pub const ALLOC_H_NEW: usize = offset_of!(Nvos21, h_object_new);
/// `hClass` in either RM_ALLOC form.
pub const ALLOC_H_CLASS: usize = offset_of!(Nvos21, h_class);
/// `pAllocParms` in either RM_ALLOC form.
pub const ALLOC_P_PARAMS: usize = offset_of!(Nvos21, p_alloc_parms);
/// `status` of NVOS21 (28 from driver 535; 24 before).
pub const NVOS21_STATUS: usize = offset_of!(Nvos21, status);
/// `status` of NVOS64 (40 from driver 535).
pub const NVOS64_STATUS: usize = offset_of!(Nvos64, status);
/// `flags` of NVOS64.
pub const NVOS64_FLAGS: usize = offset_of!(Nvos64, flags);

/// `NV_MEMORY_ALLOCATION_PARAMS`, the params of classes 0x40, 0x3e and 0x50a0 (128 bytes from
/// driver 545; 120 before, with the same offsets). `size` is IN/OUT: RM writes back the size it
/// allocated (page and alignment rounding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryAllocationParams {
    /// `owner`.
    pub owner: u32,
    /// `NVOS32_TYPE_*` (image, depth, … notifier).
    pub type_: u32,
    /// `NVOS32_ALLOC_FLAGS_*` (e.g. [`NVOS32_ALLOC_FLAGS_VIRTUAL`]).
    pub flags: u32,
    /// `width`.
    pub width: u32,
    /// `height`.
    pub height: u32,
    /// `pitch`.
    pub pitch: i32,
    /// `NVOS32_ATTR_*`: location in bits 26:25 (see [`attr_location`]), physicality, page size.
    pub attr: u32,
    /// `NVOS32_ATTR2_*`.
    pub attr2: u32,
    /// `format`.
    pub format: u32,
    /// `comprCovg`.
    pub compr_covg: u32,
    /// `zcullCovg`.
    pub zcull_covg: u32,
    /// Padding to 8-byte alignment.
    pub _pad0: u32,
    /// `rangeLo`.
    pub range_lo: u64,
    /// `rangeHi`.
    pub range_hi: u64,
    /// IN/OUT: requested bytes; RM writes back the size it allocated.
    pub size: u64,
    /// `alignment`.
    pub alignment: u64,
    /// `offset`.
    pub offset: u64,
    /// OUT: size − 1.
    pub limit: u64,
    /// `address`.
    pub address: u64,
    /// `ctagOffset`.
    pub ctag_offset: u32,
    /// `hVASpace`.
    pub h_va_space: Handle,
    /// `internalflags`.
    pub internal_flags: u32,
    /// `tag`.
    pub tag: u32,
    /// NUMA node (from driver 545, hence 128 bytes).
    pub numa_node: i32,
    /// Padding to 8-byte alignment.
    pub _pad1: u32,
}

/// `size` of [`MemoryAllocationParams`]: the bytes requested at entry and allocated at return.
pub const MEM_PARAMS_SIZE: usize = offset_of!(MemoryAllocationParams, size);
/// `flags` of [`MemoryAllocationParams`].
pub const MEM_PARAMS_FLAGS: usize = offset_of!(MemoryAllocationParams, flags);
/// `attr` of [`MemoryAllocationParams`].
pub const MEM_PARAMS_ATTR: usize = offset_of!(MemoryAllocationParams, attr);

/// `NVOS32_ALLOC_FLAGS_VIRTUAL`: a VA reservation, not memory.
pub const NVOS32_ALLOC_FLAGS_VIRTUAL: u32 = 0x0008_0000;
/// `NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED`: `hMemory` is an input.
pub const NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED: u32 = 0x0000_4000;
/// `NVOS32_ATTR_LOCATION` is bits 26:25 of `attr`; 0 is video memory.
pub const fn attr_location(attr: u32) -> u32 {
    (attr >> NVOS32_ATTR_LOCATION_SHIFT) & 0x3
}
/// Lowest bit of `NVOS32_ATTR_LOCATION` in `attr`.
pub const NVOS32_ATTR_LOCATION_SHIFT: u32 = 25;
/// `NVOS32_ATTR_LOCATION_VIDMEM`: video memory, the location that is charged.
pub const NVOS32_ATTR_LOCATION_VIDMEM: u32 = 0;
/// `NVOS32_ATTR_LOCATION_PCI`: system memory.
pub const NVOS32_ATTR_LOCATION_PCI: u32 = 1;

/// `NV0080_ALLOC_PARAMETERS` (class `NV01_DEVICE_0`, 56 bytes): `deviceId` is the RM device
/// instance the client opens.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv0080AllocParams {
    /// The RM device instance (what gpud calls the GPU of what is allocated below it).
    pub device_id: u32,
    /// `hClientShare`.
    pub h_client_share: Handle,
    /// `hTargetClient`.
    pub h_target_client: Handle,
    /// `hTargetDevice`.
    pub h_target_device: Handle,
    /// `NV_DEVICE_ALLOCATION_FLAGS_*`.
    pub flags: u32,
    /// Padding to 8-byte alignment.
    pub _pad0: u32,
    /// `vaSpaceSize`.
    pub va_space_size: u64,
    /// `vaStartInternal`.
    pub va_start_internal: u64,
    /// `vaLimitInternal`.
    pub va_limit_internal: u64,
    /// `vaMode`: `NV_DEVICE_ALLOCATION_VAMODE_*`.
    pub va_mode: u32,
    /// Padding to 8-byte alignment.
    pub _pad1: u32,
}

/// `deviceId` of [`Nv0080AllocParams`].
pub const DEVICE_PARAMS_ID: usize = offset_of!(Nv0080AllocParams, device_id);

/// `NV2080_ALLOC_PARAMETERS` (class `NV20_SUBDEVICE_0`): which GPU of the device.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv2080AllocParams {
    /// Index of the GPU within its device.
    pub sub_device_id: u32,
}

/// Generated client handles are `RS_CLIENT_HANDLE_BASE | index` (index in bits 19:0), unique
/// among live clients.
pub const RS_CLIENT_HANDLE_BASE: Handle = 0xc1d0_0000;
/// `NVOS54_PARAMETERS` (`NV_ESC_RM_CONTROL`, 32 bytes, nvos.h L2233-2242): a control `cmd` on
/// an object, with its parameters at a user pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos54 {
    /// The client.
    pub h_client: Handle,
    /// The object the control addresses.
    pub h_object: Handle,
    /// `(class << 16) | (category << 8) | message`.
    pub cmd: u32,
    /// `NVOS54_FLAGS_*` (0: raw parameter struct).
    pub flags: u32,
    /// User pointer to the control's parameters.
    pub params: u64,
    /// Size of the parameters (the driver checks it against the control's struct).
    pub params_size: u32,
    /// OUT: `NV_STATUS`.
    pub status: u32,
}

/// Controls of a channel group (`KEPLER_CHANNEL_GROUP_A`, ctrla06c.h) that decide how the GPU
/// divides its time: their numbers and parameter structs.
pub mod tsg;

const _: () = assert!(size_of::<Nvos54>() == crate::nv::NVOS54_SIZE as usize);

/// The RM controls that change how the GPU divides its time, or that stop another client's work:
/// what the scheduler guard does with each when a tenant (any process but gpud) issues it.
/// Numbers, sizes and gates are those of drivers 580–595 (docs/driver/scheduler-controls.md has
/// the export-table row and header line of each).
pub mod sched;

/// The subdevice's framebuffer information control (`ctrl2080fb.h`): what `cuMemGetInfo`, NVML
/// and `nvidia-smi` learn the GPU's memory size and free memory from. Layout and units are those
/// of drivers 580–595 (docs/driver/memory-info-controls.md, with the source lines).
pub mod fb;

/// The memory object's surface information control (`ctrl0041.h`): the size the driver
/// allocated for a memory object, asked after the allocation returned.
pub mod surface;

/// Which GPU an object is on, as the driver answers it (`ctrl0080gpu.h`, `ctrl2080gpu.h`,
/// `ctrl0000gpu.h`): a device's GPU, asked after the device was made.
pub mod id;

/// Generated object handles start here, per client (`RS_UNIQUE_HANDLE_BASE`, range 0x80000).
pub const RS_UNIQUE_HANDLE_BASE: Handle = 0xcaf0_0000;
/// How many object handles RM generates per client from [`RS_UNIQUE_HANDLE_BASE`].
pub const RS_UNIQUE_HANDLE_RANGE: u32 = 0x8_0000;

/// `NVOS32_PARAMETERS` (`NV_ESC_RM_VID_HEAP_CONTROL`, 184 bytes): a header, then a union selected
/// by `function`. The union members the accounting reads are given as offsets below.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nvos32 {
    /// The client.
    pub h_root: Handle,
    /// The device.
    pub h_object_parent: Handle,
    /// `NVOS32_FUNCTION_*`: which operation, and which `data` union member.
    pub function: u32,
    /// `hVASpace`.
    pub h_va_space: Handle,
    /// `ivcHeapNumber`.
    pub ivc_heap_number: i16,
    /// Padding.
    pub _pad0: u16,
    /// OUT: `NV_STATUS`.
    pub status: u32,
    /// OUT: heap size (`NVOS32_FUNCTION_INFO`).
    pub total: u64,
    /// OUT: free heap bytes (`NVOS32_FUNCTION_INFO`).
    pub free: u64,
    /// The union selected by `function`; the fields read are given as `VIDHEAP_*` offsets.
    pub data: [u8; 144],
}

impl Default for Nvos32 {
    fn default() -> Self {
        Self {
            h_root: 0,
            h_object_parent: 0,
            function: 0,
            h_va_space: 0,
            ivc_heap_number: 0,
            _pad0: 0,
            status: 0,
            total: 0,
            free: 0,
            data: [0; 144],
        }
    }
}

/// `NVOS32_FUNCTION_ALLOC_SIZE`: allocates `data.AllocSize.size` bytes.
pub const NVOS32_FUNCTION_ALLOC_SIZE: u32 = 2;
/// `NVOS32_FUNCTION_FREE`: frees `data.Free.hMemory`.
pub const NVOS32_FUNCTION_FREE: u32 = 3;
/// `NVOS32_FUNCTION_INFO`: fills `total` and `free` of the heap.
pub const NVOS32_FUNCTION_INFO: u32 = 5;
/// `NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT`: allocates `data.AllocTiledPitchHeight.size` bytes.
pub const NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT: u32 = 6;
/// `NVOS32_FUNCTION_ALLOC_SIZE_RANGE`: allocates `data.AllocSizeRange.size` bytes.
pub const NVOS32_FUNCTION_ALLOC_SIZE_RANGE: u32 = 14;

/// `hRoot` of [`Nvos32`].
pub const VIDHEAP_H_ROOT: usize = offset_of!(Nvos32, h_root);
/// `hObjectParent` of [`Nvos32`].
pub const VIDHEAP_H_PARENT: usize = offset_of!(Nvos32, h_object_parent);
/// `function` of [`Nvos32`].
pub const VIDHEAP_FUNCTION: usize = offset_of!(Nvos32, function);
/// `status` of [`Nvos32`].
pub const VIDHEAP_STATUS: usize = offset_of!(Nvos32, status);
/// `data.*.hMemory` (IN/OUT) for ALLOC_SIZE, ALLOC_TILED_PITCH_HEIGHT, ALLOC_SIZE_RANGE and FREE.
pub const VIDHEAP_H_MEMORY: usize = 44;
/// `data.*.flags` of the three alloc functions.
pub const VIDHEAP_FLAGS: usize = 52;
/// `data.AllocSize.attr` and `data.AllocSizeRange.attr`.
pub const VIDHEAP_ATTR: usize = 56;
/// `data.AllocTiledPitchHeight.attr`.
pub const VIDHEAP_ATTR_TILED: usize = 64;
/// `data.AllocSize.size` and `data.AllocTiledPitchHeight.size` (u64, IN/OUT).
pub const VIDHEAP_SIZE: usize = 88;
/// `data.AllocSizeRange.size` (u64, IN/OUT).
pub const VIDHEAP_SIZE_RANGE: usize = 80;
/// `data.Info.size` (u64, OUT of `NVOS32_FUNCTION_INFO`): the largest free block in bytes
/// (nvos.h L773-780).
pub const VIDHEAP_INFO_SIZE: usize = 56;

/// Where a VID_HEAP_CONTROL allocation function keeps its `attr` and `size`; `None` for functions
/// that do not allocate.
#[inline(always)]
pub const fn vidheap_alloc_fields(function: u32) -> Option<(usize, usize)> {
    match function {
        NVOS32_FUNCTION_ALLOC_SIZE => Some((VIDHEAP_ATTR, VIDHEAP_SIZE)),
        NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT => Some((VIDHEAP_ATTR_TILED, VIDHEAP_SIZE)),
        NVOS32_FUNCTION_ALLOC_SIZE_RANGE => Some((VIDHEAP_ATTR, VIDHEAP_SIZE_RANGE)),
        _ => None,
    }
}

/// `nv_ioctl_xfer_t` (`NV_ESC_IOCTL_XFER_CMD`): `cmd` is the bare escape number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvIoctlXfer {
    /// The inner escape number.
    pub cmd: u32,
    /// The inner parameter size, at most [`NV_MAX_IOCTL_SIZE`](crate::nv::NV_MAX_IOCTL_SIZE).
    pub size: u32,
    /// User pointer to the inner parameters.
    pub ptr: u64,
}

/// `total` of [`Nvos32`].
pub const VIDHEAP_TOTAL: usize = offset_of!(Nvos32, total);
/// `free` of [`Nvos32`].
pub const VIDHEAP_FREE: usize = offset_of!(Nvos32, free);

/// Offset of the `NV_STATUS` field in the parameter struct of escape `nr` when its size is
/// `size`, for the escapes on the control device that carry one (ABI reference §3.1-3.8), and
/// whether the struct starts with `hClient`. `None` for other escapes and sizes.
pub const fn escape_status_offset(nr: u32, size: u32) -> Option<(usize, bool)> {
    use crate::nv::*;
    match (nr, size) {
        (NV_ESC_RM_FREE, NVOS00_SIZE) => Some((12, true)),
        (NV_ESC_RM_CONTROL, NVOS54_SIZE) => Some((28, true)),
        (NV_ESC_RM_ALLOC, NVOS21_SIZE) => Some((NVOS21_STATUS, true)),
        (NV_ESC_RM_ALLOC, NVOS64_SIZE) => Some((NVOS64_STATUS, true)),
        (NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_SIZE) => Some((VIDHEAP_STATUS, true)),
        (NV_ESC_RM_MAP_MEMORY, NVOS33_WITH_FD_SIZE) => Some((40, true)),
        (NV_ESC_RM_UNMAP_MEMORY, NVOS34_SIZE) => Some((24, true)),
        (NV_ESC_RM_MAP_MEMORY_DMA, NVOS46_SIZE) => Some((56, true)),
        (NV_ESC_RM_UNMAP_MEMORY_DMA, NVOS47_SIZE) => Some((40, true)),
        (NV_ESC_RM_DUP_OBJECT, NVOS55_SIZE) => Some((24, true)),
        (NV_ESC_RM_SHARE, NVOS57_SIZE) => Some((20, true)),
        (NV_ESC_ALLOC_OS_EVENT | NV_ESC_FREE_OS_EVENT, NV_OS_EVENT_SIZE) => Some((12, true)),
        _ => None,
    }
}

// Pinned by the ABI reference (§3); a wrong edit here fails the build of both sides.
const _: () = {
    assert!(size_of::<Nvos00>() == 16);
    assert!(offset_of!(Nvos00, h_object_old) == 8 && offset_of!(Nvos00, status) == 12);
    assert!(size_of::<Nvos21>() == 32);
    assert!(size_of::<Nvos55>() == crate::nv::NVOS55_SIZE as usize);
    assert!(offset_of!(Nvos55, h_object_src) == 16 && offset_of!(Nvos55, status) == 24);
    assert!(NVOS21_STATUS == 28 && ALLOC_P_PARAMS == 16 && ALLOC_H_CLASS == 12);
    assert!(size_of::<Nvos64>() == 48);
    assert!(NVOS64_STATUS == 40 && NVOS64_FLAGS == 36);
    assert!(offset_of!(Nvos64, p_alloc_parms) == ALLOC_P_PARAMS);
    assert!(offset_of!(Nvos64, h_class) == ALLOC_H_CLASS);
    assert!(size_of::<MemoryAllocationParams>() == 128);
    assert!(MEM_PARAMS_SIZE == 64 && MEM_PARAMS_ATTR == 24 && MEM_PARAMS_FLAGS == 8);
    assert!(offset_of!(MemoryAllocationParams, limit) == 88);
    assert!(offset_of!(MemoryAllocationParams, numa_node) == 120);
    assert!(size_of::<Nv0080AllocParams>() == 56 && DEVICE_PARAMS_ID == 0);
    assert!(size_of::<Nvos32>() == 184);
    assert!(VIDHEAP_STATUS == 20 && VIDHEAP_FUNCTION == 8 && offset_of!(Nvos32, data) == 40);
    assert!(size_of::<NvIoctlXfer>() == 16);
    assert!(size_of::<Nv2080AllocParams>() == 4);
    assert!(VIDHEAP_TOTAL == 24 && VIDHEAP_FREE == 32);
    assert!(size_of::<Nvos00>() as u32 == crate::nv::NVOS00_SIZE);
    assert!(size_of::<Nvos21>() as u32 == crate::nv::NVOS21_SIZE);
    assert!(size_of::<Nvos64>() as u32 == crate::nv::NVOS64_SIZE);
    assert!(size_of::<Nvos32>() as u32 == crate::nv::NVOS32_SIZE);
};
