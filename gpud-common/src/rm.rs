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
pub mod tsg {
    /// `NVA06C_CTRL_CMD_GPFIFO_SCHEDULE`: the group on (or off) the runlist;
    /// [`ScheduleParams`].
    pub const GPFIFO_SCHEDULE: u32 = 0xa06c_0101;
    /// `NVA06C_CTRL_CMD_SET_TIMESLICE`: [`TimesliceParams`]; takes effect at once.
    pub const SET_TIMESLICE: u32 = 0xa06c_0103;
    /// `NVA06C_CTRL_CMD_GET_TIMESLICE`: the value last set (not what the hardware uses).
    pub const GET_TIMESLICE: u32 = 0xa06c_0104;
    /// `NVA06C_CTRL_CMD_PREEMPT`: takes the group off the engine now; [`PreemptParams`].
    pub const PREEMPT: u32 = 0xa06c_0105;

    /// `NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS` (3 `NvBool`s).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct ScheduleParams {
        /// On the runlist (1) or off it (0).
        pub enable: u8,
        /// Skip submitting the runlist update.
        pub skip_submit: u8,
        /// Skip enabling the channels.
        pub skip_enable: u8,
    }

    /// `NVA06C_CTRL_TIMESLICE_PARAMS`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct TimesliceParams {
        /// Microseconds; rounded down to what the hardware holds.
        pub timeslice_us: u64,
    }

    /// `NVA06C_CTRL_PREEMPT_PARAMS`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct PreemptParams {
        /// Wait until the preemption completes.
        pub wait: u8,
        /// Use `timeout_us` instead of RM's timeout.
        pub manual_timeout: u8,
        /// Padding to the `NvU32`.
        pub _pad: [u8; 2],
        /// At most 1 s.
        pub timeout_us: u32,
    }

    const _: () = assert!(size_of::<ScheduleParams>() == 3);
    const _: () = assert!(size_of::<TimesliceParams>() == 8);
    const _: () = assert!(size_of::<PreemptParams>() == 8);
}

const _: () = assert!(size_of::<Nvos54>() == crate::nv::NVOS54_SIZE as usize);

/// The RM controls that change how the GPU divides its time, or that stop another client's work:
/// what the scheduler guard does with each when a tenant (any process but gpud) issues it.
/// Numbers, sizes and gates are those of drivers 580–595 (docs/driver/scheduler-controls.md has
/// the export-table row and header line of each).
pub mod sched {
    /// `NVOS54.flags` bit 15 of `cmd`: the GSS-legacy path, forwarded to the GPU's firmware with
    /// no size, privilege or client check (`rmapi_gss_legacy_control.c`).
    pub const LEGACY_BIT: u32 = 0x8000;
    /// The timeslice (µs) libcuda sets on its compute channel group at context creation (580,
    /// H100: docs/real-gpu.md): refusing it fails `cuCtxCreate`, so no ceiling is below it
    /// where the call can only be refused.
    pub const CUDA_TIMESLICE_US: u64 = 2048;

    /// `NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL` (NICE): the group's share of runlist slots.
    pub const TSG_SET_INTERLEAVE_LEVEL: u32 = 0xa06c_0107;
    /// `NVA06C_CTRL_CMD_MAKE_REALTIME` (NICE): jumps the runlist.
    pub const TSG_MAKE_REALTIME: u32 = 0xa06c_0110;
    /// `NVA06F_CTRL_CMD_GPFIFO_SCHEDULE`: a channel on or off the runlist.
    pub const CHANNEL_GPFIFO_SCHEDULE: u32 = 0xa06f_0103;
    /// `NVA06F_CTRL_CMD_SET_INTERLEAVE_LEVEL` (NICE).
    pub const CHANNEL_SET_INTERLEAVE_LEVEL: u32 = 0xa06f_0109;
    /// `NVA06F_CTRL_CMD_RESTART_RUNLIST` (NICE): preempts whoever runs.
    pub const CHANNEL_RESTART_RUNLIST: u32 = 0xa06f_0111;
    /// `NV0090_CTRL_CMD_SET_TPC_PARTITION_MODE` (on a group's graphics context).
    pub const CTX_SET_TPC_PARTITION_MODE: u32 = 0x0090_0101;
    /// `NV0080_CTRL_CMD_FIFO_SET_CHANNEL_PROPERTIES`: can set or disable a channel's timeslice.
    pub const DEVICE_SET_CHANNEL_PROPERTIES: u32 = 0x0080_170f;
    /// `NV0080_CTRL_CMD_FIFO_STOP_RUNLIST` (privileged): stops an engine's whole runlist.
    pub const DEVICE_STOP_RUNLIST: u32 = 0x0080_1711;
    /// `NV0080_CTRL_CMD_FIFO_START_RUNLIST` (privileged).
    pub const DEVICE_START_RUNLIST: u32 = 0x0080_1712;
    /// `NV2080_CTRL_CMD_SET_GPFIFO`: reprograms a channel.
    pub const SUBDEVICE_SET_GPFIFO: u32 = 0x2080_1102;
    /// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS`: lists of (client, channel) handles, any client's.
    pub const DISABLE_CHANNELS: u32 = 0x2080_110b;
    /// `NV2080_CTRL_CMD_FIFO_CONFIG_CTXSW_TIMEOUT` (privileged; 595 only).
    pub const CONFIG_CTXSW_TIMEOUT: u32 = 0x2080_1110;
    /// `NV2080_CTRL_CMD_FIFO_RUNLIST_SET_SCHED_POLICY` (NICE): runlist-wide policy.
    pub const RUNLIST_SET_SCHED_POLICY: u32 = 0x2080_1115;
    /// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS_FOR_KEY_ROTATION`: other clients' channels.
    pub const DISABLE_CHANNELS_FOR_KEY_ROTATION: u32 = 0x2080_111a;
    /// `NV2080_CTRL_CMD_FIFO_ROTATE_KEYS` (595): other clients' channels.
    pub const ROTATE_KEYS: u32 = 0x2080_111c;
    /// `NV2080_CTRL_CMD_FIFO_OBJSCHED_SET_STATE`: the vGPU scheduler's state.
    pub const OBJSCHED_SET_STATE: u32 = 0x2080_1121;
    /// `NV2080_CTRL_CMD_GPU_SET_COMPUTE_POLICY_CONFIG` (privileged): the device-wide timeslice.
    pub const SET_COMPUTE_POLICY_CONFIG: u32 = 0x2080_0194;
    /// `NV2080_CTRL_CMD_GR_CTXSW_PREEMPTION_BIND`: carries another client's handle.
    pub const GR_CTXSW_PREEMPTION_BIND: u32 = 0x2080_1211;
    /// `NV2080_CTRL_CMD_GR_SET_TPC_PARTITION_MODE`.
    pub const GR_SET_TPC_PARTITION_MODE: u32 = 0x2080_122c;

    /// What the guard does with a control from a tenant.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Rule {
        /// `SET_TIMESLICE`: a value above the caller's allowance is lowered to it (refused only
        /// where nothing can be rewritten): CUDA itself sets one at context creation.
        Timeslice,
        /// `FIFO_DISABLE_CHANNELS`: refused when its list names a client of another process.
        DisableChannels,
        /// A channel group's `GPFIFO_SCHEDULE`: CUDA enables its groups with it at context
        /// creation, so it passes, but for an enable of a group gpud holds off the runlist.
        Schedule,
        /// Never a tenant's: refused (with `EPERM`, or turned into a call the driver rejects).
        Refuse,
        /// Scheduling controls that act on the caller's own work only and that CUDA issues:
        /// let through (listed so the table is the whole set, and reported nowhere).
        Pass,
    }

    /// One row of [`CONTROLS`].
    #[derive(Clone, Copy, Debug)]
    pub struct Control {
        /// The command number (`class << 16 | category << 8 | index`).
        pub cmd: u32,
        /// The driver's name, without its `NVxxxx_CTRL_CMD_` prefix.
        pub name: &'static str,
        /// The parameter struct's size (the driver's export row).
        pub size: u32,
        /// What the guard does with it.
        pub rule: Rule,
    }

    const fn c(cmd: u32, name: &'static str, size: u32, rule: Rule) -> Control {
        Control {
            cmd,
            name,
            size,
            rule,
        }
    }

    /// Every guarded control, with its rule. [`rule_of`] is the kernel side's copy of the same
    /// decision (a `match` the compiler turns into comparisons); a test keeps both in step.
    pub const CONTROLS: [Control; 25] = [
        c(
            super::tsg::SET_TIMESLICE,
            "SET_TIMESLICE",
            8,
            Rule::Timeslice,
        ),
        c(
            DISABLE_CHANNELS,
            "FIFO_DISABLE_CHANNELS",
            536,
            Rule::DisableChannels,
        ),
        c(
            TSG_SET_INTERLEAVE_LEVEL,
            "TSG_SET_INTERLEAVE_LEVEL",
            4,
            Rule::Refuse,
        ),
        c(TSG_MAKE_REALTIME, "MAKE_REALTIME", 1, Rule::Refuse),
        c(
            CHANNEL_SET_INTERLEAVE_LEVEL,
            "CHANNEL_SET_INTERLEAVE_LEVEL",
            4,
            Rule::Refuse,
        ),
        c(CHANNEL_RESTART_RUNLIST, "RESTART_RUNLIST", 2, Rule::Refuse),
        c(
            CTX_SET_TPC_PARTITION_MODE,
            "SET_TPC_PARTITION_MODE",
            8,
            Rule::Refuse,
        ),
        c(
            DEVICE_SET_CHANNEL_PROPERTIES,
            "FIFO_SET_CHANNEL_PROPERTIES",
            16,
            Rule::Refuse,
        ),
        c(DEVICE_STOP_RUNLIST, "FIFO_STOP_RUNLIST", 4, Rule::Refuse),
        c(DEVICE_START_RUNLIST, "FIFO_START_RUNLIST", 4, Rule::Refuse),
        c(SUBDEVICE_SET_GPFIFO, "SET_GPFIFO", 24, Rule::Refuse),
        c(
            CONFIG_CTXSW_TIMEOUT,
            "FIFO_CONFIG_CTXSW_TIMEOUT",
            8,
            Rule::Refuse,
        ),
        c(
            RUNLIST_SET_SCHED_POLICY,
            "FIFO_RUNLIST_SET_SCHED_POLICY",
            8,
            Rule::Refuse,
        ),
        c(
            DISABLE_CHANNELS_FOR_KEY_ROTATION,
            "FIFO_DISABLE_CHANNELS_FOR_KEY_ROTATION",
            520,
            Rule::Refuse,
        ),
        c(ROTATE_KEYS, "FIFO_ROTATE_KEYS", 520, Rule::Refuse),
        c(
            OBJSCHED_SET_STATE,
            "FIFO_OBJSCHED_SET_STATE",
            24,
            Rule::Refuse,
        ),
        c(
            SET_COMPUTE_POLICY_CONFIG,
            "GPU_SET_COMPUTE_POLICY_CONFIG",
            8,
            Rule::Refuse,
        ),
        c(
            GR_CTXSW_PREEMPTION_BIND,
            "GR_CTXSW_PREEMPTION_BIND",
            112,
            Rule::Refuse,
        ),
        c(
            GR_SET_TPC_PARTITION_MODE,
            "GR_SET_TPC_PARTITION_MODE",
            32,
            Rule::Refuse,
        ),
        c(
            super::tsg::GPFIFO_SCHEDULE,
            "TSG_GPFIFO_SCHEDULE",
            3,
            Rule::Schedule,
        ),
        c(super::tsg::GET_TIMESLICE, "GET_TIMESLICE", 8, Rule::Pass),
        c(super::tsg::PREEMPT, "PREEMPT", 8, Rule::Pass),
        c(
            CHANNEL_GPFIFO_SCHEDULE,
            "CHANNEL_GPFIFO_SCHEDULE",
            3,
            Rule::Pass,
        ),
        c(0x906f_0102, "RESET_CHANNEL", 16, Rule::Pass),
        c(0x2080_1210, "GR_SET_CTXSW_PREEMPTION_MODE", 32, Rule::Pass),
    ];

    /// The rule for `cmd` (exact match, whatever the class of the object it is sent to: the
    /// driver resolves a command on any object that exports it). A command with
    /// [`LEGACY_BIT`] set whose class and category are scheduling ones is refused: that path
    /// skips every check the driver makes.
    #[inline(always)]
    pub const fn rule_of(cmd: u32) -> Option<Rule> {
        match plain_rule(cmd) {
            Some(r) => Some(r),
            None if cmd & LEGACY_BIT != 0
                && (legacy_scheduling(cmd) || plain_rule(cmd & !LEGACY_BIT).is_some()) =>
            {
                Some(Rule::Refuse)
            }
            None => None,
        }
    }

    /// [`rule_of`] without the legacy aliases.
    #[inline(always)]
    const fn plain_rule(cmd: u32) -> Option<Rule> {
        match cmd {
            super::tsg::SET_TIMESLICE => Some(Rule::Timeslice),
            DISABLE_CHANNELS => Some(Rule::DisableChannels),
            super::tsg::GPFIFO_SCHEDULE => Some(Rule::Schedule),
            TSG_SET_INTERLEAVE_LEVEL
            | TSG_MAKE_REALTIME
            | CHANNEL_SET_INTERLEAVE_LEVEL
            | CHANNEL_RESTART_RUNLIST
            | CTX_SET_TPC_PARTITION_MODE
            | DEVICE_SET_CHANNEL_PROPERTIES
            | DEVICE_STOP_RUNLIST
            | DEVICE_START_RUNLIST
            | SUBDEVICE_SET_GPFIFO
            | CONFIG_CTXSW_TIMEOUT
            | RUNLIST_SET_SCHED_POLICY
            | DISABLE_CHANNELS_FOR_KEY_ROTATION
            | ROTATE_KEYS
            | OBJSCHED_SET_STATE
            | SET_COMPUTE_POLICY_CONFIG
            | GR_CTXSW_PREEMPTION_BIND
            | GR_SET_TPC_PARTITION_MODE => Some(Rule::Refuse),
            _ => None,
        }
    }

    /// Whether a legacy-path command addresses scheduling: a channel, channel group or context
    /// class, or the FIFO and GR categories of a device or subdevice (no legacy category of
    /// those exists, so nothing legitimate is lost).
    #[inline(always)]
    pub const fn legacy_scheduling(cmd: u32) -> bool {
        let (class, category) = (cmd >> 16, (cmd >> 8) & 0x3f);
        matches!(class, 0xa06c | 0xa06f | 0x906f | 0x506f | 0x0090 | 0x9067)
            || (class == 0x2080 && matches!(category, 0x11 | 0x12))
            || (class == 0x0080 && matches!(category, 0x11 | 0x17))
    }

    /// The row of `cmd` in [`CONTROLS`] (a legacy alias by the command it aliases).
    pub fn control(cmd: u32) -> Option<&'static Control> {
        let plain = cmd & !LEGACY_BIT;
        CONTROLS.iter().find(|c| c.cmd == cmd || c.cmd == plain)
    }

    /// `NV2080_CTRL_FIFO_DISABLE_CHANNELS_PARAMS` (536 bytes).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct DisableChannelsParams {
        /// Disable (1) or enable (0) the listed channels.
        pub disable: u8,
        /// Padding to the `NvU32`.
        pub _pad0: [u8; 3],
        /// Entries used in both lists (at most [`DISABLE_CHANNELS_MAX`]).
        pub num_channels: u32,
        /// Only take the channels off the schedule (no preemption).
        pub only_disable_scheduling: u8,
        /// Rewind the channels' GP_PUT.
        pub rewind_gp_put: u8,
        /// Padding to the `NvP64`.
        pub _pad1: [u8; 6],
        /// `NvP64`: an event to signal on runlist preemption (kernel callers only).
        pub runlist_preempt_event: u64,
        /// The client of each channel: any client's, unchecked by the driver.
        pub client_list: [u32; DISABLE_CHANNELS_MAX],
        /// The channels, each a handle in the client at the same index.
        pub channel_list: [u32; DISABLE_CHANNELS_MAX],
    }

    /// Capacity of the disable-channels lists.
    pub const DISABLE_CHANNELS_MAX: usize = 64;

    impl Default for DisableChannelsParams {
        fn default() -> Self {
            Self {
                disable: 0,
                _pad0: [0; 3],
                num_channels: 0,
                only_disable_scheduling: 0,
                rewind_gp_put: 0,
                _pad1: [0; 6],
                runlist_preempt_event: 0,
                client_list: [0; DISABLE_CHANNELS_MAX],
                channel_list: [0; DISABLE_CHANNELS_MAX],
            }
        }
    }

    /// Offset of `num_channels` (ctrl2080fifo.h, measured: 4).
    pub const DISABLE_NUM_CHANNELS: usize =
        core::mem::offset_of!(DisableChannelsParams, num_channels);
    /// Offset of `client_list` (measured: 24).
    pub const DISABLE_CLIENT_LIST: usize =
        core::mem::offset_of!(DisableChannelsParams, client_list);
    /// Offset of `channel_list` (measured: 280).
    pub const DISABLE_CHANNEL_LIST: usize =
        core::mem::offset_of!(DisableChannelsParams, channel_list);
    const _: () = assert!(size_of::<DisableChannelsParams>() == 536);
    const _: () = assert!(DISABLE_NUM_CHANNELS == 4 && DISABLE_CLIENT_LIST == 24);
    const _: () = assert!(core::mem::offset_of!(DisableChannelsParams, channel_list) == 280);

    /// `NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS` / `NVA06F_…` (4 bytes): LOW 0, MEDIUM 1, HIGH 2.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct InterleaveParams {
        /// The interleave level.
        pub level: u32,
    }

    /// `NVA06C_CTRL_MAKE_REALTIME_PARAMS` (1 byte).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct RealtimeParams {
        /// Realtime (1) or not (0).
        pub realtime: u8,
    }

    /// Offset of `NVOS54.cmd`, which the guard rewrites for a legacy-path command.
    pub const NVOS54_CMD: usize = core::mem::offset_of!(super::Nvos54, cmd);
    /// Offset of `NVOS54.paramsSize`, which the guard sets to 0 to have the driver reject a call.
    pub const NVOS54_PARAMS_SIZE: usize = core::mem::offset_of!(super::Nvos54, params_size);

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_table_and_the_kernel_side_agree() {
            for c in CONTROLS {
                let want = if c.rule == Rule::Pass {
                    None
                } else {
                    Some(c.rule)
                };
                assert_eq!(rule_of(c.cmd), want, "{}", c.name);
                // A legacy alias of a refused, clamped or passed scheduling control is refused.
                assert_eq!(
                    rule_of(c.cmd | LEGACY_BIT),
                    Some(Rule::Refuse),
                    "{} alias",
                    c.name
                );
            }
            // Ordinary controls pass: memory info, the GPU's info, the client's.
            for cmd in [
                0x2080_1303,
                0x2080_0101,
                0x0000_0201,
                0x0080_0101,
                0x2080_9303,
            ] {
                assert_eq!(rule_of(cmd), None, "{cmd:#x}");
            }
        }
    }
}

/// The subdevice's framebuffer information control (`ctrl2080fb.h`): what `cuMemGetInfo`, NVML
/// and `nvidia-smi` learn the GPU's memory size and free memory from. Layout and units are those
/// of drivers 580–595 (docs/driver/memory-info-controls.md, with the source lines).
pub mod fb {
    /// `NV2080_CTRL_CMD_FB_GET_INFO_V2`: a list of (index, value) pairs inline in
    /// [`GetInfoV2Params`]; the driver fills each pair's value.
    pub const GET_INFO_V2: u32 = 0x2080_1303;
    /// `NV2080_CTRL_FB_INFO_MAX_LIST_SIZE` of drivers 580–595 (54 before 545, 55 to 555, 57 to
    /// 575): the driver takes a params size of exactly `4 + 8 * MAX_LIST_SIZE`.
    pub const MAX_LIST_SIZE: usize = 128;

    // `NV2080_CTRL_FB_INFO_INDEX_*` that carry memory sizes, all in KiB.
    /// Framebuffer memory physically present.
    pub const RAM_SIZE: u32 = 0x07;
    /// Video memory usable with the subdevice.
    pub const TOTAL_RAM_SIZE: u32 = 0x08;
    /// Memory available for allocations (total less the driver's reserve).
    pub const HEAP_SIZE: u32 = 0x09;
    /// The part of the heap the CPU can map.
    pub const MAPPABLE_HEAP_SIZE: u32 = 0x0a;
    /// Largest contiguous free block.
    pub const LARGEST_FREE_REGION_SIZE_KB: u32 = 0x12;
    /// Free video memory.
    pub const HEAP_FREE: u32 = 0x16;
    /// Usable framebuffer physically present.
    pub const USABLE_RAM_SIZE: u32 = 0x20;
    /// Width of the memory bus in bits (not a size: never rewritten).
    pub const BUS_WIDTH: u32 = 0x0b;
    /// Memory the vGPU host takes (0 on bare metal; never rewritten).
    pub const FB_TAX_SIZE_KB: u32 = 0x10;

    /// What the memory view does with a list entry of `index`: lower it to the limit
    /// ([`Clamp::Total`]), to the limit less the cgroup's usage ([`Clamp::Free`]), or leave it.
    #[inline(always)]
    pub const fn clamp_of(index: u32) -> Option<Clamp> {
        match index {
            RAM_SIZE | TOTAL_RAM_SIZE | HEAP_SIZE | MAPPABLE_HEAP_SIZE | USABLE_RAM_SIZE => {
                Some(Clamp::Total)
            }
            HEAP_FREE | LARGEST_FREE_REGION_SIZE_KB => Some(Clamp::Free),
            _ => None,
        }
    }

    /// How an FB info value is lowered by the memory view.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Clamp {
        /// A size of the GPU's memory: at most the cgroup's limit.
        Total,
        /// Free memory: at most the limit less the cgroup's usage.
        Free,
    }

    /// `NV2080_CTRL_FB_INFO`: one pair of the list.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Info {
        /// `NV2080_CTRL_FB_INFO_INDEX_*`, set by the caller.
        pub index: u32,
        /// The value, filled by the driver (KiB for the memory indices).
        pub data: u32,
    }

    /// `NV2080_CTRL_FB_GET_INFO_V2_PARAMS`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct GetInfoV2Params {
        /// Pairs used, 1 to [`MAX_LIST_SIZE`].
        pub list_size: u32,
        /// The pairs; those past `list_size` are ignored.
        pub list: [Info; MAX_LIST_SIZE],
    }

    impl Default for GetInfoV2Params {
        fn default() -> Self {
            Self {
                list_size: 0,
                list: [Info::default(); MAX_LIST_SIZE],
            }
        }
    }

    const _: () = assert!(size_of::<GetInfoV2Params>() == 1028);
}

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
