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

/// `NV2080_CTRL_FB_INFO`: one pair of the list (`NVXXXX_CTRL_XXX_INFO`, the layout of every
/// such list: the surface information's too, [`super::surface::Info`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Info {
    /// `NV2080_CTRL_FB_INFO_INDEX_*` (or the list's own index kind), set by the caller.
    pub index: u32,
    /// The value, filled by the driver (KiB for the FB memory indices).
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
