//! GPU-memory accounting read back from the kernel side: usage per cgroup and GPU, and the
//! releases the kernel leaves to the daemon (subtree, client and file frees, which need a walk
//! over the objects). Part of [`Attribution`](super::Attribution); the state task owns it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use gpud_common::{
    Ancestry, GPU_ALL, GPU_UNKNOWN, MAX_CGROUP_DEPTH, OBJ_CHANNEL, OBJ_CHANNEL_GROUP, OBJ_CLIENT,
    OBJ_SUBDEVICE, ObjEntry, ObjKey,
};
use tracing::{debug, info, warn};

use super::{Attribution, AttributionError, ChannelGroup, RmRef, TenantObjects};
use crate::probes::{BPF_NOEXIST, map_entries};

/// Name of a GPU key in records: the index, `unknown`, or `all`.
pub fn gpu_name(gpu: u32) -> String {
    match gpu {
        GPU_ALL => "all".to_owned(),
        GPU_UNKNOWN => "unknown".to_owned(),
        i => i.to_string(),
    }
}

/// Memory figures of one cgroup (hierarchical: descendants included).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryView {
    /// Bytes charged by GPU name ([`gpu_name`]: an index, `unknown`, and `all`, the sum).
    pub current: BTreeMap<String, u64>,
    /// Limits in force on this cgroup, by GPU name.
    pub max: BTreeMap<String, u64>,
    /// Allocations that crossed (react) or were refused by (deny) its limits.
    pub events: u64,
}

impl MemoryView {
    /// No memory, no limits (`all` is always listed).
    pub fn empty() -> Self {
        let mut v = Self::default();
        v.current.insert("all".to_owned(), 0);
        v
    }
}

impl Attribution {
    /// Usage and limits of `cgroup_id` by GPU name.
    pub fn memory_of(&self, cgroup_id: u64) -> MemoryView {
        self.memory_views(Some(cgroup_id))
            .remove(&cgroup_id)
            .unwrap_or_else(MemoryView::empty)
    }

    /// Usage and limits of every cgroup that has any (or of `only`), from one walk of each map.
    pub fn memory_views(&self, only: Option<u64>) -> HashMap<u64, MemoryView> {
        let mut views: HashMap<u64, MemoryView> = HashMap::new();
        let wanted = |id: u64| only.is_none_or(|o| o == id);
        // `all` is the sum of the per-GPU figures read here, not the kernel's own total: the
        // kernel updates the two one after the other, so a walk can fall between them, and a
        // record whose GPU holds more than its `all` would be torn.
        for (id, record) in map_entries(&self.maps.usage) {
            if !wanted(id) {
                continue;
            }
            let current = &mut views.entry(id).or_insert_with(MemoryView::empty).current;
            for (gpu, bytes) in record.charged().filter(|(gpu, _)| *gpu != GPU_ALL) {
                current.insert(gpu_name(gpu), bytes);
                *current.entry(gpu_name(GPU_ALL)).or_default() += bytes;
            }
        }
        for (k, l) in map_entries(&self.maps.limits) {
            if wanted(k.cgroup_id) {
                let v = views.entry(k.cgroup_id).or_insert_with(MemoryView::empty);
                // The limit on unnamed GPUs is the kernel's, beside per-GPU ones: not a limit
                // anyone set, but its crossings are the cgroup's.
                if k.gpu != GPU_UNKNOWN {
                    v.max.insert(gpu_name(k.gpu), l.max);
                }
                v.events += l.events;
            }
        }
        views
    }

    /// Bytes `cgroup_id` holds on `gpu` (hierarchical).
    pub fn usage_of(&self, cgroup_id: u64, gpu: u32) -> u64 {
        self.maps
            .usage
            .get(&cgroup_id, 0)
            .map_or(0, |record| record.on(gpu))
    }

    fn objects(&self) -> Vec<(ObjKey, ObjEntry)> {
        map_entries(&self.maps.objects)
    }

    /// The channel groups, channels and subdevices of the processes in `pids` (one walk of
    /// `OBJECTS`; they are released with their client like any object below it).
    pub fn tenant_objects(&self, pids: &BTreeSet<u32>) -> BTreeMap<u32, TenantObjects> {
        let mut out: BTreeMap<u32, TenantObjects> = BTreeMap::new();
        for (k, e) in self.objects() {
            if !pids.contains(&e.tgid) {
                continue;
            }
            let r = RmRef {
                gpu: e.gpu,
                client: k.client,
                handle: k.object,
            };
            let t = out.entry(e.tgid).or_default();
            match e.kind {
                OBJ_CHANNEL_GROUP => t.groups.push(ChannelGroup {
                    pid: e.tgid,
                    gpu: e.gpu,
                    client: k.client,
                    handle: k.object,
                }),
                OBJ_CHANNEL => t.channels.push(r),
                OBJ_SUBDEVICE => t.subdevices.push(r),
                _ => {}
            }
        }
        for t in out.values_mut() {
            t.groups.sort_unstable();
            t.channels.sort_unstable();
            t.subdevices.sort_unstable();
        }
        out
    }

    /// Releases `object` of `client` and everything below it that is older than `before`
    /// (`RM_FREE` of a client, device or subdevice). Returns the number of objects released.
    pub fn release_tree(&mut self, client: u32, object: u32, before: u64) -> usize {
        let objects = self.objects();
        self.release_tree_of(&objects, client, object, before)
    }

    /// [`Self::release_tree`] on objects already read (one walk of `OBJECTS` serves several
    /// clients: releasing one client's objects does not change another's).
    fn release_tree_of(
        &mut self,
        objects: &[(ObjKey, ObjEntry)],
        client: u32,
        object: u32,
        before: u64,
    ) -> usize {
        let in_client: HashMap<u32, ObjEntry> = objects
            .iter()
            .filter(|(k, e)| k.client == client && e.serial < before)
            .map(|(k, e)| (k.object, *e))
            .collect();
        let mut released = 0;
        for (handle, e) in &in_client {
            if object == client || descends_from(&in_client, *handle, object) {
                released += self.release_one(
                    ObjKey {
                        client,
                        object: *handle,
                    },
                    e,
                    false,
                );
            }
        }
        debug!(client, object, released, "subtree released");
        released
    }

    /// Releases what was made through the control file at address `file` before `before` (the
    /// file's last reference went; the driver freed its clients without RM_FREE).
    pub fn release_file(&mut self, file: u64, before: u64) -> usize {
        self.release_files(&[(file, before)])
    }

    /// [`Self::release_file`] for several releases with one read of `OBJECTS` (a run of them from
    /// one ring-buffer read: a tenant opening and closing a control file in a loop sends two per
    /// open). A file address named twice is released once, up to its latest clock: whatever
    /// was at that address before then is gone. Nothing is left out: the same objects go as with
    /// one [`Self::release_file`] per release. Returns the objects released.
    pub fn release_files(&mut self, files: &[(u64, u64)]) -> usize {
        let mut latest: BTreeMap<u64, u64> = BTreeMap::new();
        for &(file, clock) in files {
            let c = latest.entry(file).or_insert(clock);
            *c = (*c).max(clock);
        }
        let objects = self.objects();
        let mut released = 0;
        for (&file, &before) in &latest {
            released += self.release_file_of(&objects, file, before);
        }
        released
    }

    /// [`Self::release_file`] on objects already read: the file's clients with everything
    /// below them, then every other object made through the file. Those have no client record
    /// to go with (their client was made before gpud attached, or a race dropped its record):
    /// they are released by their own file, as orphans.
    fn release_file_of(&mut self, objects: &[(ObjKey, ObjEntry)], file: u64, before: u64) -> usize {
        let clients: BTreeSet<u32> = objects
            .iter()
            .filter(|(k, e)| {
                e.kind == OBJ_CLIENT && e.file == file && e.serial < before && k.client == k.object
            })
            .map(|(k, _)| k.client)
            .collect();
        let mut released = 0;
        for &c in &clients {
            released += self.release_tree_of(objects, c, c, before);
        }
        for (k, e) in objects
            .iter()
            .filter(|(k, e)| e.file == file && e.serial < before && !clients.contains(&k.client))
        {
            released += self.release_orphan(*k, e, "its control file was released");
        }
        if released > 0 {
            info!(
                released,
                "control file closed: its clients' objects released"
            );
        }
        released
    }

    /// The release rule, checked against the kernel: the driver frees a client when the last
    /// reference to the control file it was made through goes (a descriptor in any process, a
    /// mapping, a message in flight), so its objects are charged exactly that long, whoever
    /// holds the file meanwhile and whether or not its creator lives. Asks the kernel about each
    /// file that objects name (`gpud_file_held`: one short program run per file) and releases
    /// what was made through files that are gone. Catches every release the probes cannot see:
    /// a last reference dropped by a process gpud does not track, by `munmap`, by a socket
    /// discarding a message in flight, or while events were lost. Then releases orphans
    /// ([`Self::release_orphans`]). Returns the objects released.
    ///
    /// Only objects made before the check began are judged, against that instant: a file found
    /// gone was gone for every object older than the check (a live file would still be at the
    /// address), while a newer object may be on a file opened since at the same address.
    pub fn release_closed_files(&mut self) -> usize {
        self.exits_unchecked = 0;
        let started = std::time::Instant::now();
        let Some(checked_from) = monotonic_ns() else {
            warn!("monotonic clock unreadable: releasing no clients");
            return 0;
        };
        let objects = self.objects();
        let files: BTreeSet<u64> = objects
            .iter()
            .filter(|(_, e)| e.file != 0 && e.serial < checked_from)
            .map(|(_, e)| e.file)
            .collect();
        let checked = files.len();
        let mut gone = Vec::new();
        for file in files {
            match self.runs.file_held(file) {
                Ok(true) => {}
                Ok(false) => {
                    debug!(file, "control file no longer referenced");
                    gone.push(file);
                }
                Err(e) => {
                    warn!(
                        "cannot ask the kernel about a control file: {}",
                        crate::report::Chain(&e)
                    );
                    // What was found gone so far is still released.
                    break;
                }
            }
        }
        let mut released = 0;
        for file in gone {
            released += self.release_file_of(&objects, file, checked_from);
        }
        released += self.release_orphans(&objects, checked_from);
        debug!(
            files = checked,
            objects = objects.len(),
            released,
            micros = started.elapsed().as_micros() as u64,
            "control files checked"
        );
        released
    }

    /// Marks in the kernel (`FILE_MARKS`) every control file that recorded objects were made
    /// through, so that its release is sent: objects recorded by a build before the marks, kept
    /// in the pins across a restart, would otherwise wait for the sweep. Run at start; returns
    /// the files marked.
    pub fn mark_recorded_files(&mut self) -> usize {
        let files: BTreeSet<u64> = self
            .objects()
            .iter()
            .map(|(_, e)| e.file)
            .filter(|f| *f != 0)
            .collect();
        let mut marked = 0;
        for file in files {
            match self.maps.file_marks.insert(file, 1, 0) {
                Ok(()) => marked += 1,
                Err(e) => {
                    warn!(
                        "cannot mark a control file for its release (the sweep will find it): {}",
                        crate::report::Chain(&e)
                    );
                    break;
                }
            }
        }
        marked
    }

    /// The guard rail behind the release rules: objects older than `before` with neither a
    /// client record nor a known control file, which no rule would ever release. Each is
    /// released, counted (`orphans_released`) and logged at warn.
    fn release_orphans(&mut self, objects: &[(ObjKey, ObjEntry)], before: u64) -> usize {
        let clients: HashSet<u32> = objects
            .iter()
            .filter(|(k, e)| e.kind == OBJ_CLIENT && k.client == k.object)
            .map(|(k, _)| k.client)
            .collect();
        let mut released = 0;
        for (k, e) in objects.iter().filter(|(k, e)| {
            e.kind != OBJ_CLIENT && e.file == 0 && e.serial < before && !clients.contains(&k.client)
        }) {
            released += self.release_orphan(*k, e, "no client and no control file is known");
        }
        released
    }

    /// Releases `key` as an orphan: counted in the kernel and logged with what it charged.
    fn release_orphan(&mut self, key: ObjKey, e: &ObjEntry, why: &str) -> usize {
        let n = self.release_one(key, e, true);
        if n > 0 {
            let age_ms = monotonic_ns().map_or(0, |now| now.saturating_sub(e.serial) / 1_000_000);
            let cgroup = self
                .cgroups
                .path_of(e.cgroup_id)
                .unwrap_or_else(|| format!("(removed, id {})", e.cgroup_id));
            warn!(
                %cgroup,
                bytes = e.bytes,
                gpu = %gpu_name(e.gpu),
                age_ms,
                pid = e.tgid,
                client = key.client,
                object = key.object,
                "orphan released: {why}, and its client has no record"
            );
        }
        n
    }

    fn release_one(&mut self, key: ObjKey, e: &ObjEntry, orphan: bool) -> usize {
        match self.runs.release(key, e.serial, orphan) {
            Ok(true) => 1,
            Ok(false) => 0,
            Err(err) => {
                warn!(
                    client = key.client,
                    object = key.object,
                    "release failed: {}",
                    crate::report::Chain(&err)
                );
                0
            }
        }
    }

    /// From now on, GPU memory charged to the cgroup at `member` is also charged to the cgroup at
    /// `group`, and `group`'s limits hold it as an ancestor's do: one limit over cgroups in
    /// different subtrees (the containers of several pods that share one grant). The kernel
    /// charges along the ancestry it records for a cgroup at its first charge (`ANCESTRY`); this
    /// records `member`'s with `group` in it first, so it must come before `member` is charged
    /// (a container's cgroup before the container runs): a cgroup charged already is refused,
    /// as what it holds would be uncharged along another ancestry than it was charged along.
    /// Asking again for the same group does nothing. The record goes with `member`'s cgroup
    /// (the sweep); cgroups below `member` charge along their own ancestry, without `group`.
    pub fn share_charges(&mut self, member: &str, group: &str) -> Result<(), AttributionError> {
        let (member, member_id) = self.id_of(member)?;
        let (group, group_id) = self.id_of(group)?;
        let refused = |why| AttributionError::ShareRefused {
            member: member.clone(),
            group: group.clone(),
            why,
        };
        let within = |outer: &str, inner: &str| {
            outer == "/" || inner == outer || inner.starts_with(&format!("{outer}/"))
        };
        if within(&group, &member) || within(&member, &group) {
            return Err(refused(
                "one is the other or below it: the tree charges it already",
            ));
        }
        // The ids from the root down to `member`, `group` put just above it.
        let mut ids = vec![self.cgroups.id_of("/")?];
        let mut at = String::new();
        for part in member.trim_start_matches('/').split('/') {
            at = format!("{at}/{part}");
            ids.push(self.cgroups.id_of(&at)?);
        }
        ids.insert(ids.len() - 1, group_id);
        if ids.len() > MAX_CGROUP_DEPTH {
            return Err(refused(
                "the cgroup is too deep for the kernel's ancestry record",
            ));
        }
        let mut record = Ancestry {
            depth: ids.len() as u32,
            ..Ancestry::default()
        };
        record.ids[..ids.len()].copy_from_slice(&ids);
        match self.maps.ancestry.get(&member_id, 0) {
            // What the programs learnt of its levels' limits is no difference.
            Ok(a)
                if Ancestry {
                    limits_seen: 0,
                    ..a
                } == record =>
            {
                return Ok(());
            }
            Ok(_) => {
                // Every charge on a GPU is also one under `all`.
                let charged = self
                    .maps
                    .usage
                    .get(&member_id, 0)
                    .is_ok_and(|record| record.on(GPU_ALL) != 0);
                if charged {
                    return Err(refused("memory is charged to it already"));
                }
                self.maps.ancestry.insert(member_id, record, 0)?;
                // A new level: the programs' memo of its levels without limits goes.
                self.maps.limits_gen.raise()?;
            }
            // None yet: made here, unless the kernel made one meanwhile (a first charge).
            Err(_) => {
                if let Err(e) = self.maps.ancestry.insert(member_id, record, BPF_NOEXIST) {
                    if self.maps.ancestry.get(&member_id, 0).is_ok() {
                        return Err(refused("memory is charged to it already"));
                    }
                    return Err(e.into());
                }
            }
        }
        info!(
            cgroup = %member,
            group = %group,
            "the cgroup's GPU memory is also charged to the group, and held to its limits"
        );
        Ok(())
    }

    /// Forgets ancestry records and empty usage records of removed cgroups that no object is
    /// charged to any more. The order matters: first which cgroups are gone, then which are
    /// still charged. An object charged to a cgroup was allocated before the cgroup could be
    /// removed, so the second read sees it; read the other way round, an object allocated just
    /// before the cgroup went would lose its ancestry, and its release would leave the charge
    /// on every ancestor.
    pub fn sweep_memory(&mut self) {
        let ancestry: Vec<u64> = map_entries(&self.maps.ancestry)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let usage: Vec<u64> = map_entries(&self.maps.usage)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let ids: std::collections::HashSet<u64> =
            ancestry.iter().chain(usage.iter()).copied().collect();
        let mut gone: std::collections::HashSet<u64> = self
            .cgroups
            .paths_of(ids)
            .into_iter()
            .filter_map(|(id, path)| path.is_none().then_some(id))
            .collect();
        if gone.is_empty() {
            return;
        }
        for (_, e) in self.objects() {
            gone.remove(&e.cgroup_id);
        }
        let mut removed = false;
        for id in ancestry.into_iter().filter(|id| gone.contains(id)) {
            removed |= self.maps.ancestry.remove(&id).is_ok();
        }
        // A removed record's place may be another cgroup's next: nothing learnt in it holds.
        if removed && let Err(e) = self.maps.limits_gen.raise() {
            warn!("{}", crate::report::Chain(&e));
        }
        // Nothing charges a removed cgroup, and with no object charged to it nothing uncharges
        // it: its usage record stays as it is read here.
        for id in usage.into_iter().filter(|id| gone.contains(id)) {
            if self.maps.usage.get(&id, 0).is_ok_and(|r| r.is_empty()) {
                let _ = self.maps.usage.remove(&id);
            }
        }
    }
}

/// Now on the clock the probes stamp objects with (`CLOCK_MONOTONIC`, as `bpf_ktime_get_ns`).
fn monotonic_ns() -> Option<u64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
    u64::try_from(t.tv_sec())
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(u64::try_from(t.tv_nsec()).ok()?)
}

/// Whether `handle` has `ancestor` on its parent chain within one client.
fn descends_from(objs: &HashMap<u32, ObjEntry>, handle: u32, ancestor: u32) -> bool {
    let mut cur = handle;
    // RM trees are shallow (client → device → subdevice → memory); the bound guards cycles.
    for _ in 0..16 {
        if cur == ancestor {
            return true;
        }
        match objs.get(&cur) {
            Some(e) if e.parent != cur => cur = e.parent,
            _ => return false,
        }
    }
    false
}
