//! The FUSE side of the fake: the mount's files (`nvidiactl`, `state`, `inject`), their open
//! handles and the requests on them, with the RM ([`super::state`]) behind `nvidiactl`.

use std::{
    collections::HashMap,
    ffi::OsStr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, IoctlFlags,
    LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl,
    ReplyOpen, ReplyWrite, Request, WriteFlags,
};

use super::{
    CTL, INJECT, STATE, lock,
    state::{Caller, Rm, tgid},
};

const INO_ROOT: u64 = 1;
const INO_CTL: u64 = 2;
const INO_STATE: u64 = 3;
const INO_INJECT: u64 = 4;
const FILES: [(&str, u64); 3] = [(CTL, INO_CTL), (STATE, INO_STATE), (INJECT, INO_INJECT)];

/// The FUSE side: files, open handles, and the RM behind `nvidiactl`.
pub(super) struct Fs {
    pub(super) rm: Arc<Mutex<Rm>>,
    /// Contents served to readers of `state` and `inject`, per open file (fixed at open).
    pub(super) reads: Mutex<HashMap<u64, Vec<u8>>>,
    /// Partial lines written to `inject`, per open file.
    pub(super) writes: Mutex<HashMap<u64, Vec<u8>>>,
    pub(super) next_fh: AtomicU64,
    pub(super) born: SystemTime,
    pub(super) uid: u32,
    pub(super) gid: u32,
}

const TTL: Duration = Duration::from_secs(1);

impl Fs {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, perm, nlink) = match ino {
            INO_ROOT => (FileType::Directory, 0o755, 2),
            INO_CTL => (FileType::RegularFile, 0o666, 1),
            INO_STATE => (FileType::RegularFile, 0o444, 1),
            INO_INJECT => (FileType::RegularFile, 0o644, 1),
            _ => return None,
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size: 0,
            blocks: 0,
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            crtime: self.born,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    /// Applies the complete lines buffered for `fh` (all of it when `all`).
    fn apply_lines(&self, fh: u64, all: bool) -> Result<(), String> {
        let lines: Vec<String> = {
            let mut w = lock(&self.writes);
            let Some(buf) = w.get_mut(&fh) else {
                return Ok(());
            };
            let end = if all {
                buf.len()
            } else {
                buf.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1)
            };
            let text: Vec<u8> = buf.drain(..end).collect();
            String::from_utf8_lossy(&text)
                .lines()
                .map(str::to_owned)
                .collect()
        };
        let mut rm = lock(&self.rm);
        lines.iter().try_for_each(|l| rm.apply_inject(l))
    }
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = FILES
            .iter()
            .find(|(n, _)| OsStr::new(n) == name)
            .filter(|_| parent.0 == INO_ROOT)
            .and_then(|&(_, ino)| self.attr(ino));
        match found {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    // `echo … > inject` truncates first; sizes are not kept, so accept and ignore.
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        match self.attr(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino.0 != INO_ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries = vec![
            (INO_ROOT, FileType::Directory, "."),
            (INO_ROOT, FileType::Directory, ".."),
        ];
        entries.extend(FILES.iter().map(|&(n, i)| (i, FileType::RegularFile, n)));
        for (i, (e_ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(e_ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        match ino.0 {
            INO_CTL => {
                lock(&self.rm).files.insert(fh, tgid(req.pid()));
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            INO_STATE | INO_INJECT => {
                let content = {
                    let rm = lock(&self.rm);
                    if ino.0 == INO_STATE {
                        let mut j = serde_json::to_vec_pretty(&rm.snapshot()).unwrap_or_default();
                        j.push(b'\n');
                        j
                    } else {
                        rm.inject_text().into_bytes()
                    }
                };
                lock(&self.reads).insert(fh, content);
                if ino.0 == INO_INJECT {
                    lock(&self.writes).insert(fh, Vec::new());
                }
                // Direct I/O: reads are not cut at the (unknown) file size nor cached.
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
            }
            _ => reply.error(Errno::EISDIR),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let reads = lock(&self.reads);
        match reads.get(&fh.0) {
            Some(c) => {
                let start = (offset as usize).min(c.len());
                let end = start.saturating_add(size as usize).min(c.len());
                reply.data(&c[start..end]);
            }
            None => reply.error(Errno::EINVAL),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino.0 != INO_INJECT {
            return reply.error(Errno::EINVAL);
        }
        if let Some(buf) = lock(&self.writes).get_mut(&fh.0) {
            buf.extend_from_slice(data);
        }
        match self.apply_lines(fh.0, false) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => {
                eprintln!("fakenv: inject: {e}");
                reply.error(Errno::EINVAL)
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        match ino.0 {
            INO_CTL => lock(&self.rm).release(fh.0),
            _ => {
                if let Err(e) = self.apply_lines(fh.0, true) {
                    eprintln!("fakenv: inject: {e}");
                }
                lock(&self.writes).remove(&fh.0);
                lock(&self.reads).remove(&fh.0);
            }
        }
        reply.ok();
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        if ino.0 != INO_CTL {
            return reply.error(Errno::ENOTTY);
        }
        let delay = lock(&self.rm).inject.delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let caller = Caller {
            fh: fh.0,
            tid: req.pid(),
        };
        let result = lock(&self.rm).ioctl(caller, cmd, in_data);
        match result {
            Ok(out) => reply.ioctl(0, &out[..out.len().min(out_size as usize)]),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }
}
