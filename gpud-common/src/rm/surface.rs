//! `NV0041_CTRL_CMD_GET_SURFACE_INFO`, exported by every memory object (`ctrl0041.h`;
//! `memCtrlCmdGetSurfaceInfoLvm_IMPL` in `mem_ctrl.c` answers `PHYS_SIZE` from the object's memory
//! descriptor, the size the driver allocated, in 4 KiB units). Layout of drivers 580–595.

/// `NV0041_CTRL_CMD_GET_SURFACE_INFO`.
pub const GET_SURFACE_INFO: u32 = 0x0041_0110;
/// `NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_SIZE`: the allocated size in units of [`PHYS_SIZE_UNIT`].
pub const INDEX_PHYS_SIZE: u32 = 0x07;
/// `NV0041_CTRL_SURFACE_INFO_PHYS_SIZE_SCALE_FACTOR`.
pub const PHYS_SIZE_UNIT: u64 = 0x1000;

/// `NV0041_CTRL_SURFACE_INFO`: one (index, value) pair of the list, the driver's one
/// `NVXXXX_CTRL_XXX_INFO` layout, as the framebuffer information's.
pub use super::fb::Info;

/// `NV0041_CTRL_GET_SURFACE_INFO_PARAMS`: the list lives in the caller's memory (an embedded
/// pointer the driver copies in and out).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetSurfaceInfoParams {
    /// Entries of the list at `list`.
    pub list_size: u32,
    /// Explicit padding (always 0).
    pub _pad: u32,
    /// `NvP64 surfaceInfoList`: the address of `list_size` [`Info`].
    pub list: u64,
}

const _: () = assert!(size_of::<GetSurfaceInfoParams>() == 16);
