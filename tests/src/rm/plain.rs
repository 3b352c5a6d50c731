//! The ABI structs as bytes: [`Plain`] structs viewed as bytes and made from them, and
//! native-endian fields read and written at an offset in a raw struct.

use gpud_common::rm;

/// Structs that may be viewed as bytes and made from any bytes: `#[repr(C)]`, `Copy`, every
/// byte belongs to a field (the ABI structs spell out their padding), every bit pattern valid.
///
/// # Safety
/// Implement only for types meeting the above.
pub unsafe trait Plain: Copy + Default {}

// SAFETY: each is #[repr(C)] with explicit padding fields and integer members only.
unsafe impl Plain for rm::Nvos00 {}
unsafe impl Plain for rm::Nvos21 {}
unsafe impl Plain for rm::Nvos55 {}
unsafe impl Plain for rm::Nvos64 {}
unsafe impl Plain for rm::Nvos32 {}
unsafe impl Plain for rm::surface::GetSurfaceInfoParams {}
unsafe impl Plain for rm::MemoryAllocationParams {}
unsafe impl Plain for rm::Nv0080AllocParams {}
unsafe impl Plain for rm::Nv2080AllocParams {}
unsafe impl Plain for rm::NvIoctlXfer {}
unsafe impl Plain for rm::Nvos54 {}
unsafe impl Plain for rm::fb::GetInfoV2Params {}
unsafe impl Plain for rm::tsg::ScheduleParams {}
unsafe impl Plain for rm::tsg::TimesliceParams {}
unsafe impl Plain for rm::tsg::PreemptParams {}
unsafe impl Plain for rm::sched::DisableChannelsParams {}
unsafe impl Plain for rm::sched::InterleaveParams {}
unsafe impl Plain for rm::sched::RealtimeParams {}
unsafe impl Plain for rm::id::FindSubdeviceHandleParams {}
unsafe impl Plain for rm::id::GetIdParams {}
unsafe impl Plain for rm::id::GetIdInfoV2Params {}

/// The bytes of `v`.
pub fn bytes_of<T: Plain>(v: &T) -> &[u8] {
    // SAFETY: `Plain` guarantees every byte is initialized.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

/// The bytes of `v`, writable.
pub fn bytes_of_mut<T: Plain>(v: &mut T) -> &mut [u8] {
    // SAFETY: `Plain` guarantees any bit pattern is a valid `T`.
    unsafe { std::slice::from_raw_parts_mut((v as *mut T).cast::<u8>(), size_of::<T>()) }
}

/// A `T` from the first bytes of `b`; missing bytes read as zero.
pub fn from_bytes<T: Plain>(b: &[u8]) -> T {
    let mut v = T::default();
    let dst = bytes_of_mut(&mut v);
    let n = dst.len().min(b.len());
    dst[..n].copy_from_slice(&b[..n]);
    v
}

pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

pub fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}
