//! The daemon's own programs, run once in the kernel on demand (`BPF_PROG_TEST_RUN`): marking a
//! process in the tracepoint-mode filter, releasing an object's charge, asking whether a control
//! file is still referenced. The kernel changes what these touch only with atomic operations, so
//! the daemon changes it through the same code instead of writing the maps. [`KernelRuns`] holds
//! its own descriptors of the loaded programs, so that the attribution, their one user, owns
//! them while [`Probes`] (the object, its links and its settings) stays the core's.

use aya::programs::{RawTracePoint, RawTracePointRunOptions, TestRun as _};
use gpud_common::{ObjEntry, ObjKey};

use super::{ProbeError, Probes, programs};

/// Handles on the run programs of one loaded object ([`Probes::runs`]), each with its name.
pub struct KernelRuns {
    seed: (&'static str, RawTracePoint),
    release: (&'static str, RawTracePoint),
    file_held: (&'static str, RawTracePoint),
    adopt: (&'static str, RawTracePoint),
}

/// What [`KernelRuns::adopt`] did with an object of the previous ABI's maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adopted {
    /// Recorded, counted and (memory) charged or shared.
    Yes,
    /// An object is recorded under its key already: the programs saw it made.
    Present,
    /// `OBJECTS` has no room.
    Full,
}

impl KernelRuns {
    /// Takes a descriptor of each run program `probes` loaded.
    pub(super) fn of(probes: &Probes) -> Result<Self, ProbeError> {
        let handle = |name: &'static str| -> Result<_, ProbeError> {
            let perr = move |source| ProbeError::Run { name, source };
            let info = probes.program(name)?.info().map_err(perr)?;
            Ok((
                name,
                RawTracePoint::from_program_info(info, name.into()).map_err(perr)?,
            ))
        };
        Ok(Self {
            seed: handle(programs::SEED)?,
            release: handle(programs::RELEASE)?,
            file_held: handle(programs::FILE_HELD)?,
            adopt: handle(programs::ADOPT)?,
        })
    }

    /// Runs `prog` once with `args`; its return value.
    fn run((name, prog): &(&'static str, RawTracePoint), args: &[u64]) -> Result<u32, ProbeError> {
        let mut opts = RawTracePointRunOptions::new();
        for (slot, a) in opts.args.iter_mut().zip(args) {
            *slot = *a;
        }
        prog.test_run(opts)
            .map(|r| r.return_value)
            .map_err(|source| ProbeError::Run { name, source })
    }

    /// Marks `pid` as holding an NVIDIA file in the tracepoint-mode filter (`gpud_seed`; the
    /// filter is only changed with atomic adds).
    pub fn seed(&self, pid: u32) -> Result<(), ProbeError> {
        Self::run(&self.seed, &[u64::from(pid)])?;
        Ok(())
    }

    /// Releases the object `(client, object)` if it still carries `serial`, uncharging its
    /// bytes (`gpud_release`: usage counters are only ever changed atomically in the kernel);
    /// an `orphan` is also counted in the kernel's `orphans_released`. Returns whether it was
    /// released.
    pub fn release(&self, key: ObjKey, serial: u64, orphan: bool) -> Result<bool, ProbeError> {
        let args = [
            u64::from(key.client),
            u64::from(key.object),
            serial,
            u64::from(orphan),
        ];
        Ok(Self::run(&self.release, &args)? == 0)
    }

    /// Whether the control file at kernel address `file` is still referenced (so the driver
    /// still holds the clients made through it), by `gpud_file_held`.
    pub fn file_held(&self, file: u64) -> Result<bool, ProbeError> {
        Ok(Self::run(&self.file_held, &[file])? == 0)
    }

    /// Records `entry`, an object of the previous ABI's maps, under `key` in this ABI's
    /// (`gpud_adopt`): counted, its file marked, its memory charged (`first`: no other holder of
    /// its charge is recorded) or shared, all with the kernel's own atomic updates.
    pub fn adopt(&self, key: ObjKey, entry: &ObjEntry, first: bool) -> Result<Adopted, ProbeError> {
        let args = [
            u64::from(key.client) << 32 | u64::from(key.object),
            u64::from(entry.kind) | u64::from(entry.parent) << 32,
            u64::from(entry.gpu) | u64::from(entry.tgid) << 32,
            entry.cgroup_id,
            entry.bytes,
            entry.file,
            entry.serial,
            entry.charge,
            u64::from(first),
        ];
        Ok(match Self::run(&self.adopt, &args)? {
            0 => Adopted::Yes,
            1 => Adopted::Present,
            _ => Adopted::Full,
        })
    }
}
