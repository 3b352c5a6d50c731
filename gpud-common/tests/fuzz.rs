//! Fuzz targets (`cargo xtask fuzz` runs them with many more cases) for the ABI decoders the eBPF
//! programs share with user space: for any escape number, size and function, the offsets they
//! read lie inside the parameter struct the driver copies.

mod fuzz {
    use gpud_common::{
        nv,
        rm::{self, escape_status_offset, vidheap_alloc_fields},
    };
    use proptest::prelude::*;

    proptest! {
        /// Where a status offset exists, the 4-byte status (after the leading client handle)
        /// fits in the struct the driver copies.
        #[test]
        fn status_offsets_lie_inside_the_struct(nr in 0u32..256, size in prop_oneof![0u32..0x4000, 0u32..256]) {
            if let Some((off, has_client)) = escape_status_offset(nr, size) {
                prop_assert!(off + 4 <= size as usize, "nr {nr:#x} size {size}: status at {off}");
                prop_assert!(off % 4 == 0);
                prop_assert!(!has_client || off >= 4);
            }
        }

        /// Every allocating VID_HEAP_CONTROL function's attr and size lie inside NVOS32.
        #[test]
        fn vidheap_fields_lie_inside_nvos32(function in any::<u32>()) {
            if let Some((attr, size)) = vidheap_alloc_fields(function) {
                prop_assert!(attr + 4 <= nv::NVOS32_SIZE as usize);
                prop_assert!(size + 8 <= nv::NVOS32_SIZE as usize);
                prop_assert!(size % 8 == 0 && attr % 4 == 0);
            }
        }

        /// Any bytes read as an allocation's parameters: the fields the probes take are at the
        /// offsets the struct declares (one definition serves kernel and user space).
        #[test]
        fn alloc_params_decode_at_their_offsets(bytes in proptest::collection::vec(any::<u8>(), 48)) {
            let u32_at = |o: usize| u32::from_ne_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
            // SAFETY: Nvos64 is repr(C) plain data of 48 bytes; any bit pattern is valid.
            let p: rm::Nvos64 = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
            prop_assert_eq!(p.h_root, u32_at(rm::ALLOC_H_ROOT));
            prop_assert_eq!(p.h_object_parent, u32_at(rm::ALLOC_H_PARENT));
            prop_assert_eq!(p.h_object_new, u32_at(rm::ALLOC_H_NEW));
            prop_assert_eq!(p.h_class, u32_at(rm::ALLOC_H_CLASS));
            prop_assert_eq!(p.status, u32_at(rm::NVOS64_STATUS));
            prop_assert_eq!(p.flags, u32_at(rm::NVOS64_FLAGS));
        }
    }
}
