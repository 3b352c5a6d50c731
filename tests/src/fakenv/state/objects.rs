//! Objects of the fake's RM and their memory: `NV_ESC_RM_ALLOC` in both forms, clients bound
//! to the caller's file, object trees checked parent by parent, video memory charged to a GPU's
//! capacity, `RM_FREE` of a subtree or a client, and `NV_ESC_RM_VID_HEAP_CONTROL`.

use std::collections::BTreeMap;

use gpud_common::{
    nv,
    rm::{self, Handle},
};

use super::{
    Caller, Chan, Client, DEFAULT_TIMESLICE_US, EscapeResult, Mem, Object, Rm, Sched,
    inject::take,
    remote::{read_params, read_remote, remote_write},
    tgid,
};
use crate::rm::{bytes_of, class, get_u32, get_u64, put_u32, put_u64, status};

/// Video-memory request fields, from `NV_MEMORY_ALLOCATION_PARAMS` or `NVOS32`.
#[derive(Clone, Copy, Debug)]
struct VidReq {
    size: u64,
    flags: u32,
    attr: u32,
}

/// The fields of an `NV_ESC_RM_ALLOC` the fake acts on.
#[derive(Clone, Copy, Debug)]
struct AllocReq {
    root: Handle,
    parent: Handle,
    new: Handle,
    class: u32,
    /// `pAllocParms`, in the caller's memory.
    params: u64,
    /// NVOS64 with `FINN_SERIALIZED`.
    finn: bool,
}

/// What kind of object is made, with what its construction needs.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Device(u32),
    Subdevice(u32),
    Vidmem(VidReq),
    /// Memory classes without video memory (virtual, system): under a device or subdevice.
    Memory,
    /// `KEPLER_CHANNEL_GROUP_A`: under a device.
    ChannelGroup,
    /// `HOPPER_CHANNEL_GPFIFO_A`: under a channel group.
    Channel,
    Plain,
}

impl Rm {
    /// `NV_ESC_RM_ALLOC`, NVOS21 or NVOS64 by size.
    pub(super) fn rm_alloc(&mut self, c: Caller, buf: &mut [u8]) -> EscapeResult {
        let (long, status_at) = match buf.len() as u32 {
            nv::NVOS21_SIZE => (false, rm::NVOS21_STATUS),
            nv::NVOS64_SIZE => (true, rm::NVOS64_STATUS),
            _ => return Err(libc::EINVAL),
        };
        let finn = long && get_u32(buf, rm::NVOS64_FLAGS) & rm::NVOS64_FLAGS_FINN_SERIALIZED != 0;
        let a = AllocReq {
            root: get_u32(buf, rm::ALLOC_H_ROOT),
            parent: get_u32(buf, rm::ALLOC_H_PARENT),
            new: get_u32(buf, rm::ALLOC_H_NEW),
            class: get_u32(buf, rm::ALLOC_H_CLASS),
            params: get_u64(buf, rm::ALLOC_P_PARAMS),
            finn,
        };
        let st = match self.alloc(c, a) {
            Ok(h) => {
                put_u32(buf, rm::ALLOC_H_NEW, h);
                status::NV_OK
            }
            Err(st) => st,
        };
        self.count(st);
        put_u32(buf, status_at, st);
        Ok(())
    }

    fn alloc(&mut self, c: Caller, a: AllocReq) -> Result<Handle, u32> {
        let AllocReq {
            root,
            parent,
            new,
            class,
            params,
            finn,
        } = a;
        if class::is_root(class) {
            return self.alloc_client(c, new);
        }
        match class {
            class::MEMORY_LOCAL_USER => {
                if finn {
                    return Err(status::NV_ERR_NOT_SUPPORTED);
                }
                let mut p: rm::MemoryAllocationParams =
                    read_remote(c.tid, params).ok_or(status::NV_ERR_INVALID_POINTER)?;
                let req = VidReq {
                    size: p.size,
                    flags: p.flags,
                    attr: p.attr,
                };
                let (h, bytes) = self.create(c, root, parent, new, class, Kind::Vidmem(req))?;
                // RM copies the whole params struct back on success, with the allocated size.
                p.size = bytes;
                p.limit = bytes - 1;
                if remote_write(c.tid, params, bytes_of(&p)).is_err() {
                    self.free(c.fh, root, h);
                    return Err(status::NV_ERR_INVALID_POINTER);
                }
                Ok(h)
            }
            class::MEMORY_VIRTUAL | class::MEMORY_SYSTEM => {
                if finn {
                    return Err(status::NV_ERR_NOT_SUPPORTED);
                }
                self.create(c, root, parent, new, class, Kind::Memory)
                    .map(|(h, _)| h)
            }
            class::DEVICE => {
                let p: rm::Nv0080AllocParams = read_params(c.tid, params)?;
                self.create(c, root, parent, new, class, Kind::Device(p.device_id))
                    .map(|(h, _)| h)
            }
            class::CHANNEL_GROUP => self
                .create(c, root, parent, new, class, Kind::ChannelGroup)
                .map(|(h, _)| h),
            // Its params (`NV_CHANNEL_ALLOC_PARAMS`: GPFIFO, error notifier…) are not read.
            class::HOPPER_CHANNEL_GPFIFO_A => self
                .create(c, root, parent, new, class, Kind::Channel)
                .map(|(h, _)| h),
            class::SUBDEVICE => {
                let p: rm::Nv2080AllocParams = read_params(c.tid, params)?;
                self.create(
                    c,
                    root,
                    parent,
                    new,
                    class,
                    Kind::Subdevice(p.sub_device_id),
                )
                .map(|(h, _)| h)
            }
            _ => self
                .create(c, root, parent, new, class, Kind::Plain)
                .map(|(h, _)| h),
        }
    }

    /// A client bound to the caller's open file; `new` 0 generates the handle.
    fn alloc_client(&mut self, c: Caller, new: Handle) -> Result<Handle, u32> {
        let h = if new != 0 {
            if self.clients.contains_key(&new) {
                return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
            }
            new
        } else {
            let mut found = None;
            for _ in 0..0x10_0000 {
                let h = rm::RS_CLIENT_HANDLE_BASE | (self.next_client & 0xf_ffff);
                self.next_client = self.next_client.wrapping_add(1);
                if !self.clients.contains_key(&h) {
                    found = Some(h);
                    break;
                }
            }
            found.ok_or(status::NV_ERR_INSUFFICIENT_RESOURCES)?
        };
        self.clients.insert(
            h,
            Client {
                file: c.fh,
                pid: tgid(c.tid),
                objects: BTreeMap::new(),
                next: 0,
            },
        );
        self.stats.created += 1;
        Ok(h)
    }

    /// `NV_OK` when `client` is live and bound to file `fh`.
    pub(super) fn check_client(&self, fh: u64, client: Handle) -> u32 {
        match self.clients.get(&client) {
            Some(c) if c.file == fh => status::NV_OK,
            _ => status::NV_ERR_INVALID_CLIENT,
        }
    }

    /// Makes an object of `class` under `parent` in `root`; returns its handle and the video
    /// memory it holds.
    fn create(
        &mut self,
        c: Caller,
        root: Handle,
        parent: Handle,
        new: Handle,
        class: u32,
        kind: Kind,
    ) -> Result<(Handle, u64), u32> {
        let st = self.check_client(c.fh, root);
        if st != status::NV_OK {
            return Err(st);
        }
        let client = &self.clients[&root];
        let parent_obj = if parent == root {
            None
        } else {
            Some(
                *client
                    .objects
                    .get(&parent)
                    .ok_or(status::NV_ERR_INVALID_OBJECT_PARENT)?,
            )
        };
        let parent_class = parent_obj.map(|o| o.class);
        let parent_gpu = parent_obj.and_then(|o| o.gpu);
        let under_gpu = matches!(parent_class, Some(class::DEVICE | class::SUBDEVICE));
        if new != 0 && (new == root || client.objects.contains_key(&new)) {
            return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
        }
        let (gpu, vid) = match kind {
            Kind::Device(id) => {
                if parent_obj.is_some() {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                if id as usize >= self.gpus.len() {
                    return Err(status::NV_ERR_INVALID_ARGUMENT);
                }
                (Some(id), None)
            }
            Kind::Subdevice(id) => {
                if parent_class != Some(class::DEVICE) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                if id != 0 {
                    return Err(status::NV_ERR_INVALID_ARGUMENT);
                }
                // One subdevice per instance per device in a client (`subdeviceConstruct_IMPL`).
                if self.subdevice_of(root, parent).is_some() {
                    return Err(status::NV_ERR_INSUFFICIENT_RESOURCES);
                }
                (parent_gpu, None)
            }
            Kind::Vidmem(req) => {
                if !under_gpu {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, Some(req))
            }
            Kind::Memory => {
                if !under_gpu {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::ChannelGroup => {
                if parent_class != Some(class::DEVICE) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::Channel => {
                if parent_class != Some(class::CHANNEL_GROUP) {
                    return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
                }
                (parent_gpu, None)
            }
            Kind::Plain => (parent_gpu, None),
        };
        let bytes = match (vid, gpu) {
            (Some(req), Some(g)) => self.charge(g, req)?,
            _ => 0,
        };
        let client = self.clients.get_mut(&root).expect("client checked above");
        let h = if new != 0 {
            new
        } else {
            match client.generate(root) {
                Some(h) => h,
                None => {
                    if let Some(g) = gpu {
                        self.gpus[g as usize].used -= bytes;
                    }
                    return Err(status::NV_ERR_INSUFFICIENT_RESOURCES);
                }
            }
        };
        let mem = match (gpu, bytes) {
            (Some(g), 1..) => {
                let id = self.next_mem;
                self.next_mem += 1;
                self.mems.insert(
                    id,
                    Mem {
                        gpu: g,
                        bytes,
                        refs: 1,
                    },
                );
                id
            }
            _ => 0,
        };
        client.objects.insert(
            h,
            Object {
                parent,
                class,
                gpu,
                bytes,
                mem,
                pid: tgid(c.tid),
                sched: matches!(kind, Kind::ChannelGroup).then_some(Sched {
                    enabled: true,
                    timeslice_us: DEFAULT_TIMESLICE_US,
                    timeslice_sets: 0,
                    schedules: 0,
                    preempts: 0,
                    // kchangrpInit zeroes the levels: LOW.
                    interleave: 0,
                    realtime: false,
                }),
                channel: matches!(kind, Kind::Channel).then_some(Chan {
                    disables: 0,
                    disabled_times: 0,
                }),
            },
        );
        self.stats.created += 1;
        Ok((h, bytes))
    }

    /// Takes video memory from `gpu` as `vidmemConstruct` would; returns the rounded size.
    fn charge(&mut self, gpu: u32, req: VidReq) -> Result<u64, u32> {
        if req.flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0
            || rm::attr_location(req.attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM
        {
            return Err(status::NV_ERR_INVALID_ARGUMENT);
        }
        if let Some(st) = take(&mut self.inject.fail_alloc) {
            return Err(st);
        }
        if req.size == 0 {
            return Err(status::NV_ERR_INVALID_ARGUMENT);
        }
        let rounded = req
            .size
            .checked_next_multiple_of(self.page_size)
            .ok_or(status::NV_ERR_NO_MEMORY)?;
        let g = &mut self.gpus[gpu as usize];
        match g.used.checked_add(rounded) {
            Some(total) if total <= g.capacity => {
                g.used = total;
                Ok(rounded)
            }
            _ => Err(status::NV_ERR_NO_MEMORY),
        }
    }

    /// Drops the handles' references to their memory; memory goes back to its GPU with its
    /// last reference.
    fn uncharge(&mut self, objects: impl IntoIterator<Item = Object>) {
        for o in objects {
            let Some(m) = self.mems.get_mut(&o.mem) else {
                continue;
            };
            m.refs -= 1;
            if m.refs == 0 {
                let m = *m;
                self.mems.remove(&o.mem);
                self.gpus[m.gpu as usize].used -= m.bytes;
            }
        }
    }

    /// `NV_ESC_RM_DUP_OBJECT` of video memory: a new handle under a device or subdevice of
    /// `h_client` that shares the source's memory. The source client must be the caller's own
    /// or one of its process's (RM's default share policy lets a process dup its own objects;
    /// what crosses processes goes through `RM_SHARE`, not modelled). Other classes: not
    /// supported here.
    pub(super) fn dup(&mut self, c: Caller, p: &rm::Nvos55) -> Result<Handle, u32> {
        let st = self.check_client(c.fh, p.h_client);
        if st != status::NV_OK {
            return Err(st);
        }
        let src_client = self
            .clients
            .get(&p.h_client_src)
            .ok_or(status::NV_ERR_INVALID_CLIENT)?;
        if src_client.pid != tgid(c.tid) {
            return Err(status::NV_ERR_INSUFFICIENT_PERMISSIONS);
        }
        let src = *src_client
            .objects
            .get(&p.h_object_src)
            .ok_or(status::NV_ERR_OBJECT_NOT_FOUND)?;
        if src.mem == 0 {
            return Err(status::NV_ERR_NOT_SUPPORTED);
        }
        let client = &self.clients[&p.h_client];
        let parent = client
            .objects
            .get(&p.h_parent)
            .ok_or(status::NV_ERR_INVALID_OBJECT_PARENT)?;
        if !matches!(parent.class, class::DEVICE | class::SUBDEVICE) || parent.gpu != src.gpu {
            return Err(status::NV_ERR_INVALID_OBJECT_PARENT);
        }
        if p.h_object != 0 && (p.h_object == p.h_client || client.objects.contains_key(&p.h_object))
        {
            return Err(status::NV_ERR_INSERT_DUPLICATE_NAME);
        }
        let client = self
            .clients
            .get_mut(&p.h_client)
            .expect("client checked above");
        let h = match p.h_object {
            0 => client
                .generate(p.h_client)
                .ok_or(status::NV_ERR_INSUFFICIENT_RESOURCES)?,
            h => h,
        };
        client.objects.insert(
            h,
            Object {
                parent: p.h_parent,
                pid: tgid(c.tid),
                sched: None,
                channel: None,
                ..src
            },
        );
        if let Some(m) = self.mems.get_mut(&src.mem) {
            m.refs += 1;
        }
        self.stats.created += 1;
        Ok(h)
    }

    /// `RM_FREE` semantics: the object and its subtree, the whole client when `handle == root`,
    /// `NV_OK` for a handle that does not exist.
    pub(super) fn free(&mut self, fh: u64, root: Handle, handle: Handle) -> u32 {
        let st = self.check_client(fh, root);
        if st != status::NV_OK {
            return st;
        }
        if handle == root {
            self.free_client(root);
            return status::NV_OK;
        }
        let client = self.clients.get_mut(&root).expect("client checked above");
        if !client.objects.contains_key(&handle) {
            return status::NV_OK;
        }
        let mut doomed = vec![handle];
        let mut i = 0;
        while i < doomed.len() {
            let p = doomed[i];
            doomed.extend(
                client
                    .objects
                    .iter()
                    .filter(|(_, o)| o.parent == p)
                    .map(|(&h, _)| h),
            );
            i += 1;
        }
        let gone: Vec<Object> = doomed
            .iter()
            .filter_map(|h| client.objects.remove(h))
            .collect();
        self.uncharge(gone);
        self.apply_runlist();
        status::NV_OK
    }

    pub(super) fn free_client(&mut self, root: Handle) {
        if let Some(c) = self.clients.remove(&root) {
            self.uncharge(c.objects.into_values());
        }
        self.apply_runlist();
    }
    /// `NV_ESC_RM_VID_HEAP_CONTROL`.
    pub(super) fn vid_heap(&mut self, c: Caller, buf: &mut [u8]) -> EscapeResult {
        if buf.len() != nv::NVOS32_SIZE as usize {
            return Err(libc::EINVAL);
        }
        let root = get_u32(buf, rm::VIDHEAP_H_ROOT);
        let parent = get_u32(buf, rm::VIDHEAP_H_PARENT);
        let function = get_u32(buf, rm::VIDHEAP_FUNCTION);
        let st = if let Some((attr_at, size_at)) = rm::vidheap_alloc_fields(function) {
            let flags = get_u32(buf, rm::VIDHEAP_FLAGS);
            let attr = get_u32(buf, attr_at);
            let size = get_u64(buf, size_at);
            let new = if flags & rm::NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED != 0 {
                get_u32(buf, rm::VIDHEAP_H_MEMORY)
            } else {
                0
            };
            // The class the driver turns the request into (rmapi_deprecated_vidheapctrl.c).
            let (class, kind) = if flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0 {
                (class::MEMORY_VIRTUAL, Kind::Memory)
            } else if rm::attr_location(attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM {
                (class::MEMORY_SYSTEM, Kind::Memory)
            } else {
                let req = VidReq { size, flags, attr };
                (class::MEMORY_LOCAL_USER, Kind::Vidmem(req))
            };
            match self.create(c, root, parent, new, class, kind) {
                Ok((h, bytes)) => {
                    put_u32(buf, rm::VIDHEAP_H_MEMORY, h);
                    if class == class::MEMORY_LOCAL_USER {
                        put_u64(buf, size_at, bytes);
                    }
                    status::NV_OK
                }
                Err(st) => st,
            }
        } else {
            match function {
                rm::NVOS32_FUNCTION_FREE => {
                    self.free(c.fh, root, get_u32(buf, rm::VIDHEAP_H_MEMORY))
                }
                rm::NVOS32_FUNCTION_INFO => match self.gpu_of(c.fh, root, parent) {
                    Ok(g) => {
                        let g = self.gpus[g as usize];
                        put_u64(buf, rm::VIDHEAP_TOTAL, g.capacity);
                        put_u64(buf, rm::VIDHEAP_FREE, g.capacity - g.used);
                        // The largest free block: all of it, as this fake does not fragment.
                        put_u64(buf, rm::VIDHEAP_INFO_SIZE, g.capacity - g.used);
                        status::NV_OK
                    }
                    Err(st) => st,
                },
                _ => self.check_client(c.fh, root),
            }
        };
        self.count(st);
        put_u32(buf, rm::VIDHEAP_STATUS, st);
        Ok(())
    }

    /// The GPU of object `h` of `root` (a device, subdevice or something under one).
    fn gpu_of(&self, fh: u64, root: Handle, h: Handle) -> Result<u32, u32> {
        let st = self.check_client(fh, root);
        if st != status::NV_OK {
            return Err(st);
        }
        self.clients[&root]
            .objects
            .get(&h)
            .and_then(|o| o.gpu)
            .ok_or(status::NV_ERR_INVALID_OBJECT_PARENT)
    }
}
