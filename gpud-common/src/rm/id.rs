//! Which GPU an RM object is on, as the driver answers it: a subdevice's `gpuId`
//! (`NV2080_CTRL_CMD_GPU_GET_ID`, `ctrl2080gpu.h`), the device instance of a `gpuId`
//! (`NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2` on a client, `ctrl0000gpu.h`) and the subdevice a
//! client already holds under a device (`NV0080_CTRL_CMD_GPU_FIND_SUBDEVICE_HANDLE`,
//! `ctrl0080gpu.h`). A device answers no query of its own instance; its subdevice does. Layouts
//! of drivers 580–595.

use super::Handle;

/// `NV0080_CTRL_CMD_GPU_FIND_SUBDEVICE_HANDLE`: the client's subdevice of an instance under a
/// device (`NV_ERR_OBJECT_NOT_FOUND` where it holds none; `subdeviceGetByInstance`).
pub const FIND_SUBDEVICE_HANDLE: u32 = 0x0080_0293;

/// `NV0080_CTRL_GPU_FIND_SUBDEVICE_HANDLE_PARAM`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FindSubdeviceHandleParams {
    /// `subDeviceInst` (in).
    pub sub_device_inst: u32,
    /// `hSubDevice` (out).
    pub h_sub_device: Handle,
}

const _: () = assert!(size_of::<FindSubdeviceHandleParams>() == 8);

/// `NV2080_CTRL_CMD_GPU_GET_ID`: the `gpuId` of a subdevice's GPU.
pub const GPU_GET_ID: u32 = 0x2080_0142;

/// `NV2080_CTRL_GPU_GET_ID_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetIdParams {
    /// `gpuId` (out).
    pub gpu_id: u32,
}

/// `NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2`, on a client: what the driver knows of a `gpuId`.
pub const GET_ID_INFO_V2: u32 = 0x0000_0205;

/// `NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetIdInfoV2Params {
    /// `gpuId` (in).
    pub gpu_id: u32,
    /// `gpuFlags` (out).
    pub gpu_flags: u32,
    /// `deviceInstance` (out): the instance a device of this GPU is allocated with
    /// (`NV0080_ALLOC_PARAMETERS.deviceId`), the kernel side's GPU key.
    pub device_instance: u32,
    /// `subDeviceInstance` (out).
    pub sub_device_instance: u32,
    /// `sliStatus` (out).
    pub sli_status: u32,
    /// `boardId` (out).
    pub board_id: u32,
    /// `gpuInstance` (out).
    pub gpu_instance: u32,
    /// `numaId` (out; -1 for none).
    pub numa_id: i32,
}

const _: () = assert!(size_of::<GetIdInfoV2Params>() == 32);
