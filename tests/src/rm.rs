//! A small typed client of the NVIDIA RM ioctl ABI over any open control-device file: the fake
//! of [`crate::fakenv`] or a real `/dev/nvidiactl`.
//!
//! It owns nothing but the calling convention: the structs are gpud-common's
//! ([`gpud_common::rm`]), commands are `_IOWR('F', nr, size)` ([`nv::nv_iowr`]), and every call
//! reports what the driver reports — the `ioctl()` return value (with errno), the RM status in
//! the struct, and the handle and size RM wrote back — without judging them.
//!
//! Here: the calling convention, allocations and frees; `control` has the RM controls on a
//! [`Ctl`], `plain` the structs as bytes ([`Plain`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use gpud_common::{
    nv,
    rm::{self, Handle},
};

pub use plain::{Plain, bytes_of, bytes_of_mut, from_bytes, get_u32, get_u64, put_u32, put_u64};

pub mod attack;
mod control;
mod plain;

/// RM classes: gpud-common's ([`gpud_common::rm::class`]) and the few more the tests' fake
/// allocates.
pub mod class {
    pub use gpud_common::rm::class::*;

    /// `HOPPER_CHANNEL_GPFIFO_A`: a GPFIFO channel, allocated under a channel group
    /// (`KEPLER_CHANNEL_GROUP_A`) of the same client, as CUDA makes one per engine of a context.
    /// Every `*_CHANNEL_GPFIFO_*` class is one `KernelChannel` to RM: the `a06f`, `906f` and
    /// `506f` controls reach it.
    pub const HOPPER_CHANNEL_GPFIFO_A: u32 = 0xc86f;
}

/// `NV_STATUS` values: gpud-common's ([`gpud_common::rm::status`]) and the ones more the
/// driver answers to the RM controls the tests' fake models (`nvstatuscodes.h`).
pub mod status {
    pub use gpud_common::rm::status::*;

    /// The caller lacks the right or privilege a control needs (`NICE`: `CAP_SYS_NICE` or
    /// `CAP_SYS_ADMIN`; `PRIVILEGED`: `CAP_SYS_ADMIN`).
    pub const NV_ERR_INSUFFICIENT_PERMISSIONS: u32 = 0x1b;
    /// A (client, channel) pair that names no channel.
    pub const NV_ERR_INVALID_CHANNEL: u32 = 0x21;
}

/// `NVOS54.flags` bits (`nvos.h`): raised IRQL and lock bypass are the kernel's own and refused
/// from user space; `FINN_SERIALIZED` makes `params` a serialized blob.
pub mod nvos54_flags {
    /// `NVOS54_FLAGS_IRQL_RAISED`.
    pub const IRQL_RAISED: u32 = 0x1;
    /// `NVOS54_FLAGS_LOCK_BYPASS`.
    pub const LOCK_BYPASS: u32 = 0x2;
    /// `NVOS54_FLAGS_FINN_SERIALIZED`.
    pub const FINN_SERIALIZED: u32 = 0x4;
}

/// How a memory allocation is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `NV_ESC_RM_ALLOC` with `NVOS21_PARAMETERS` (32 bytes).
    Nvos21,
    /// `NV_ESC_RM_ALLOC` with `NVOS64_PARAMETERS` (48 bytes).
    Nvos64,
    /// `NV_ESC_RM_VID_HEAP_CONTROL`, `NVOS32_FUNCTION_ALLOC_SIZE`.
    VidHeap,
    /// The same, wrapped in `NV_ESC_IOCTL_XFER_CMD`.
    Xfer21,
    Xfer64,
    XferVidHeap,
}

impl Form {
    pub const ALL: [Form; 6] = [
        Form::Nvos21,
        Form::Nvos64,
        Form::VidHeap,
        Form::Xfer21,
        Form::Xfer64,
        Form::XferVidHeap,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Form::Nvos21 => "nvos21",
            Form::Nvos64 => "nvos64",
            Form::VidHeap => "vidheap",
            Form::Xfer21 => "xfer21",
            Form::Xfer64 => "xfer64",
            Form::XferVidHeap => "xfervidheap",
        }
    }

    pub fn parse(s: &str) -> Option<Form> {
        Form::ALL.into_iter().find(|f| f.name() == s)
    }

    fn xfer(self) -> bool {
        matches!(self, Form::Xfer21 | Form::Xfer64 | Form::XferVidHeap)
    }
}

/// A seeded xorshift64* generator: fixed and dependency-free, enough for the fuzz runs' mutation
/// choices (the same seed replays the same calls).
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// What one call reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// The `ioctl()` return value (0 or -1).
    pub ret: i32,
    /// `errno` when `ret` is -1, else 0.
    pub errno: i32,
    /// The RM status written into the struct (meaningless when `ret` is -1).
    pub status: u32,
    /// The handle RM wrote back (new object or client), or the one freed.
    pub handle: Handle,
    /// The size RM wrote back (memory allocations), else 0.
    pub size: u64,
}

impl Reply {
    /// What a call that writes back no size reported: `call` is [`Ctl::raw`]'s (ret, errno).
    pub fn of(call: (i32, i32), status: u32, handle: Handle) -> Self {
        Self {
            ret: call.0,
            errno: call.1,
            status,
            handle,
            size: 0,
        }
    }

    /// The call succeeded at both levels.
    pub fn ok(&self) -> bool {
        self.ret == 0 && self.status == status::NV_OK
    }
}

/// A memory allocation request in full; [`Ctl::alloc_vidmem`] fills the common case.
#[derive(Clone, Copy, Debug)]
pub struct MemRequest {
    pub client: Handle,
    pub parent: Handle,
    /// 0 lets RM pick the handle.
    pub handle: Handle,
    /// `hClass` for the RM_ALLOC forms (ignored by VID_HEAP_CONTROL, which picks the class from
    /// `flags` and `attr` as the driver does).
    pub class: u32,
    pub size: u64,
    /// `NVOS32_ALLOC_FLAGS_*`.
    pub flags: u32,
    /// `NVOS32_ATTR_*` (bits 26:25 are the location; 0 is video memory).
    pub attr: u32,
    pub form: Form,
    /// `NVOS64_PARAMETERS.flags` of the NVOS64 forms (`NVOS64_FLAGS_FINN_SERIALIZED`: the
    /// parameters a serialized blob, of no size the probes can read).
    pub nvos64_flags: u32,
}

impl MemRequest {
    pub fn vidmem(client: Handle, parent: Handle, size: u64, form: Form) -> Self {
        Self {
            client,
            parent,
            handle: 0,
            class: class::MEMORY_LOCAL_USER,
            size,
            flags: 0,
            attr: 0,
            form,
            nvos64_flags: 0,
        }
    }
}

/// One `NV_ESC_RM_ALLOC` request.
#[derive(Clone, Copy, Debug)]
pub struct Alloc {
    pub client: Handle,
    pub parent: Handle,
    /// 0 lets RM pick the handle.
    pub new: Handle,
    pub class: u32,
    /// `pAllocParms`: the class's parameter struct in this process's memory, or null.
    pub params: *mut u8,
    /// NVOS64 (48 bytes) instead of NVOS21 (32 bytes).
    pub long: bool,
    /// `NVOS64_PARAMETERS.flags` (NVOS64 only).
    pub flags: u32,
    /// Wrapped in `NV_ESC_IOCTL_XFER_CMD`.
    pub xfer: bool,
}

impl Alloc {
    pub fn new(client: Handle, parent: Handle, class: u32) -> Self {
        Self {
            client,
            parent,
            new: 0,
            class,
            params: std::ptr::null_mut(),
            long: false,
            flags: 0,
            xfer: false,
        }
    }

    pub fn handle(mut self, new: Handle) -> Self {
        self.new = new;
        self
    }

    pub fn params(mut self, params: *mut u8) -> Self {
        self.params = params;
        self
    }
}

/// Whether this process's RM calls go through the i386 system-call entry ([`crate::ia32`]), as a
/// 32-bit process's do.
static ENTRY_32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sends this process's RM calls from now on through the i386 entry (`true`, x86-64 only) or
/// the 64-bit one. Fails where the kernel has no i386 entry (no IA32 emulation).
pub fn use_32bit_entry(on: bool) -> std::io::Result<()> {
    #[cfg(target_arch = "x86_64")]
    if on && !crate::ia32::available() {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSYS));
    }
    #[cfg(not(target_arch = "x86_64"))]
    if on {
        return Err(std::io::Error::from(std::io::ErrorKind::Unsupported));
    }
    ENTRY_32.store(on, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Whether [`use_32bit_entry`] is on.
pub fn uses_32bit_entry() -> bool {
    ENTRY_32.load(std::sync::atomic::Ordering::Relaxed)
}

/// RM calls on one open control-device file.
#[derive(Clone, Copy, Debug)]
pub struct Ctl<'f> {
    fd: BorrowedFd<'f>,
}

impl<'f> Ctl<'f> {
    pub fn new(file: &'f impl AsFd) -> Self {
        Self { fd: file.as_fd() }
    }

    /// Issues `cmd` with `arg` as argument; returns (ret, errno).
    ///
    /// # Safety
    /// `arg` must be valid for reads and writes of `_IOC_SIZE(cmd)` bytes, and of whatever the
    /// request points to in turn (an XFER payload, alloc params), as the driver writes there.
    pub unsafe fn raw(&self, cmd: u32, arg: *mut u8) -> (i32, i32) {
        #[cfg(target_arch = "x86_64")]
        if ENTRY_32.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: as the caller guarantees.
            return unsafe { crate::ia32::ioctl(self.fd.as_raw_fd(), cmd, arg) };
        }
        // SAFETY: as the caller guarantees.
        let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), cmd as _, arg) };
        let errno = if ret < 0 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        } else {
            0
        };
        (ret, errno)
    }

    /// Issues escape `nr` on `params` directly, or wrapped in `NV_ESC_IOCTL_XFER_CMD`.
    fn escape<T: Plain>(&self, nr: u32, params: &mut T, xfer: bool) -> (i32, i32) {
        let size = size_of::<T>() as u32;
        if xfer {
            let mut x = rm::NvIoctlXfer {
                cmd: nr,
                size,
                ptr: (params as *mut T) as u64,
            };
            let cmd = nv::nv_iowr(nv::NV_ESC_IOCTL_XFER_CMD, nv::NV_IOCTL_XFER_SIZE);
            // SAFETY: the wrapper and `params` are live and of the sizes given.
            unsafe { self.raw(cmd, bytes_of_mut(&mut x).as_mut_ptr()) }
        } else {
            // SAFETY: `params` is live and `size` bytes long.
            unsafe { self.raw(nv::nv_iowr(nr, size), bytes_of_mut(params).as_mut_ptr()) }
        }
    }

    /// `NV_ESC_RM_ALLOC` of any class.
    ///
    /// # Safety
    /// `a.params` must be null or valid for reads and writes of the class's parameter struct
    /// (RM copies it back).
    pub unsafe fn alloc(&self, a: &Alloc) -> Reply {
        let (ret, errno, status, handle) = if a.long {
            let mut p = rm::Nvos64 {
                h_root: a.client,
                h_object_parent: a.parent,
                h_object_new: a.new,
                h_class: a.class,
                p_alloc_parms: a.params as u64,
                flags: a.flags,
                ..Default::default()
            };
            let (ret, errno) = self.escape(nv::NV_ESC_RM_ALLOC, &mut p, a.xfer);
            (ret, errno, p.status, p.h_object_new)
        } else {
            let mut p = rm::Nvos21 {
                h_root: a.client,
                h_object_parent: a.parent,
                h_object_new: a.new,
                h_class: a.class,
                p_alloc_parms: a.params as u64,
                ..Default::default()
            };
            let (ret, errno) = self.escape(nv::NV_ESC_RM_ALLOC, &mut p, a.xfer);
            (ret, errno, p.status, p.h_object_new)
        };
        Reply {
            ret,
            errno,
            status,
            handle,
            size: 0,
        }
    }

    /// A new client (`NV01_ROOT_CLIENT`, handle chosen by RM).
    pub fn alloc_client(&self) -> Reply {
        self.alloc_client_with(0)
    }

    /// A client with a handle of the caller's choice.
    pub fn alloc_client_with(&self, handle: Handle) -> Reply {
        // SAFETY: no params.
        unsafe { self.alloc(&Alloc::new(0, 0, class::ROOT_CLIENT).handle(handle)) }
    }

    /// `NV01_DEVICE_0` for GPU `device_id` under `client`.
    pub fn alloc_device(&self, client: Handle, device_id: u32) -> Reply {
        let mut p = rm::Nv0080AllocParams {
            device_id,
            ..Default::default()
        };
        let ptr = bytes_of_mut(&mut p).as_mut_ptr();
        // SAFETY: `p` is the class's params and outlives the call.
        unsafe { self.alloc(&Alloc::new(client, client, class::DEVICE).params(ptr)) }
    }

    /// `NV20_SUBDEVICE_0` (subdevice 0) under `device`.
    pub fn alloc_subdevice(&self, client: Handle, device: Handle) -> Reply {
        let mut p = rm::Nv2080AllocParams::default();
        let ptr = bytes_of_mut(&mut p).as_mut_ptr();
        // SAFETY: `p` is the class's params and outlives the call.
        unsafe { self.alloc(&Alloc::new(client, device, class::SUBDEVICE).params(ptr)) }
    }

    /// `KEPLER_CHANNEL_GROUP_A` under `device` (NVOS64, default parameters), as CUDA makes one per
    /// context and engine.
    pub fn alloc_channel_group(&self, client: Handle, device: Handle) -> Reply {
        let mut a = Alloc::new(client, device, class::CHANNEL_GROUP);
        a.long = true;
        // SAFETY: no params (RM's defaults).
        unsafe { self.alloc(&a) }
    }

    /// `HOPPER_CHANNEL_GPFIFO_A` under channel group `tsg` (NVOS64, no parameters): its handle,
    /// or the reply that refused it.
    pub fn alloc_channel(&self, client: Handle, tsg: Handle) -> Result<Handle, Reply> {
        let mut a = Alloc::new(client, tsg, class::HOPPER_CHANNEL_GPFIFO_A);
        a.long = true;
        // SAFETY: no params.
        let r = unsafe { self.alloc(&a) };
        if r.ok() { Ok(r.handle) } else { Err(r) }
    }

    /// `NV_ESC_RM_VID_HEAP_CONTROL` `NVOS32_FUNCTION_INFO` on `parent`: the reply, and the heap
    /// size, free bytes and largest free block it holds after the call.
    pub fn vidheap_info(&self, client: Handle, parent: Handle) -> (Reply, [u64; 3]) {
        let mut p = rm::Nvos32 {
            h_root: client,
            h_object_parent: parent,
            function: rm::NVOS32_FUNCTION_INFO,
            ..Default::default()
        };
        let (ret, errno) = self.escape(nv::NV_ESC_RM_VID_HEAP_CONTROL, &mut p, false);
        let largest = get_u64(bytes_of(&p), rm::VIDHEAP_INFO_SIZE);
        let reply = Reply {
            ret,
            errno,
            status: p.status,
            handle: parent,
            size: 0,
        };
        (reply, [p.total, p.free, largest])
    }

    /// A client, device `device_id` and its subdevice: what a CUDA process holds per GPU.
    pub fn alloc_subdevice_tree(&self, device_id: u32) -> Result<[Handle; 3], Reply> {
        let client = self.alloc_client();
        if !client.ok() {
            return Err(client);
        }
        let device = self.alloc_device(client.handle, device_id);
        if !device.ok() {
            return Err(device);
        }
        let sub = self.alloc_subdevice(client.handle, device.handle);
        if !sub.ok() {
            return Err(sub);
        }
        Ok([client.handle, device.handle, sub.handle])
    }

    /// Video memory of `size` bytes under `parent` (a device or subdevice), issued as `form`.
    pub fn alloc_vidmem(&self, client: Handle, parent: Handle, size: u64, form: Form) -> Reply {
        self.alloc_memory(&MemRequest::vidmem(client, parent, size, form))
    }

    /// A memory allocation in full.
    pub fn alloc_memory(&self, r: &MemRequest) -> Reply {
        match r.form {
            Form::VidHeap | Form::XferVidHeap => {
                let mut p = rm::Nvos32 {
                    h_root: r.client,
                    h_object_parent: r.parent,
                    function: rm::NVOS32_FUNCTION_ALLOC_SIZE,
                    ..Default::default()
                };
                let mut flags = r.flags;
                if r.handle != 0 {
                    flags |= rm::NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED;
                }
                let b = bytes_of_mut(&mut p);
                put_u32(b, rm::VIDHEAP_H_MEMORY, r.handle);
                put_u32(b, rm::VIDHEAP_FLAGS, flags);
                put_u32(b, rm::VIDHEAP_ATTR, r.attr);
                put_u64(b, rm::VIDHEAP_SIZE, r.size);
                let (ret, errno) =
                    self.escape(nv::NV_ESC_RM_VID_HEAP_CONTROL, &mut p, r.form.xfer());
                let b = bytes_of(&p);
                Reply {
                    ret,
                    errno,
                    status: p.status,
                    handle: get_u32(b, rm::VIDHEAP_H_MEMORY),
                    size: get_u64(b, rm::VIDHEAP_SIZE),
                }
            }
            form => {
                let mut params = rm::MemoryAllocationParams {
                    size: r.size,
                    flags: r.flags,
                    attr: r.attr,
                    ..Default::default()
                };
                let ptr = bytes_of_mut(&mut params).as_mut_ptr();
                let mut a = Alloc::new(r.client, r.parent, r.class)
                    .handle(r.handle)
                    .params(ptr);
                a.long = matches!(form, Form::Nvos64 | Form::Xfer64);
                a.flags = r.nvos64_flags;
                a.xfer = form.xfer();
                // SAFETY: `params` is NV_MEMORY_ALLOCATION_PARAMS, the params of every memory
                // class, and outlives the call; other classes read at most as much.
                let mut reply = unsafe { self.alloc(&a) };
                reply.size = params.size;
                reply
            }
        }
    }

    /// `NV_ESC_RM_DUP_OBJECT`: a new handle (`handle`, or one RM picks for 0) under `parent` of
    /// `client` referencing `src_client:src`.
    pub fn dup(
        &self,
        client: Handle,
        parent: Handle,
        handle: Handle,
        src_client: Handle,
        src: Handle,
    ) -> Reply {
        let mut p = rm::Nvos55 {
            h_client: client,
            h_parent: parent,
            h_object: handle,
            h_client_src: src_client,
            h_object_src: src,
            ..Default::default()
        };
        let call = self.escape(nv::NV_ESC_RM_DUP_OBJECT, &mut p, false);
        Reply::of(call, p.status, p.h_object)
    }

    /// `NV_ESC_RM_FREE` of `handle` (its subtree goes with it; `handle == client` frees the
    /// client).
    pub fn free(&self, client: Handle, handle: Handle) -> Reply {
        let mut p = rm::Nvos00 {
            h_root: client,
            h_object_parent: 0,
            h_object_old: handle,
            status: 0,
        };
        let call = self.escape(nv::NV_ESC_RM_FREE, &mut p, false);
        Reply::of(call, p.status, handle)
    }

    /// `NV_ESC_RM_VID_HEAP_CONTROL` `NVOS32_FUNCTION_FREE` of `memory`.
    pub fn vidheap_free(&self, client: Handle, parent: Handle, memory: Handle) -> Reply {
        let mut p = rm::Nvos32 {
            h_root: client,
            h_object_parent: parent,
            function: rm::NVOS32_FUNCTION_FREE,
            ..Default::default()
        };
        put_u32(bytes_of_mut(&mut p), rm::VIDHEAP_H_MEMORY, memory);
        let call = self.escape(nv::NV_ESC_RM_VID_HEAP_CONTROL, &mut p, false);
        Reply::of(call, p.status, memory)
    }
}
