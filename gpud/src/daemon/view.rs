//! The read side of the state task: an immutable [`View`] of everything it owns, which D-Bus,
//! metrics and the CLI read without queuing behind its work. Writes still go through the one
//! owner.
//!
//! Freshness: a read returns the latest view when neither the state task nor the kernel changed
//! anything since it was built (two generation numbers say so: the state task's count of the
//! messages and timers it handled, and the sum of the kernel's change counters, which only
//! grow). Otherwise it asks the state task for a new view (one request however many readers
//! ask; the requests queue behind the messages already waiting, as every question did before)
//! and returns the first view built after its own read began. A single cgroup (`GetCgroup`)
//! found stale is asked of the state task directly instead, answered from the same state. So a read never returns older
//! state than the last write that completed before it (read-your-writes: a write is counted
//! before it is answered), nor than what the kernel counted before it; and one reply comes from
//! one view, so a cgroup's bytes, processes and limits are never torn between two moments of the
//! state task. Reads of an unchanged state (the usual case between events) cost an atomic load
//! and one map lookup per counter, and no work in the state task.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Instant,
};

use tokio::sync::{mpsc, oneshot, watch};

use gpud_api::LimitState;

use super::{
    joins,
    messages::{DaemonError, Message, NvmlStatus, Request},
    state::State,
};
use crate::{
    attribution::{AttributionError, CgroupView, KernelCounters, MemoryView, ProcessView},
    cgroupfs::{CgroupFs, id_at},
    enforcement::guard::GuardCounts,
    nvml::{AttributedXid, GpuStatus},
    policy::{LimitEntry, idle::IdleEntry},
};

/// What the state task owns, at one moment.
#[derive(Debug)]
pub struct View {
    /// The generations this view covers (see the module docs).
    state_gen: u64,
    kernel_gen: u64,
    built: Instant,
    /// Every attributed cgroup, ordered by path.
    pub cgroups: Vec<CgroupView>,
    /// Every cgroup's workload names (also of cgroups not attributed yet).
    pub workloads: crate::policy::workloads::ByCgroup,
    /// Index into `cgroups` by path.
    by_path: HashMap<String, usize>,
    /// Every live attributed process, ordered by pid.
    pub processes: Vec<ProcessView>,
    /// Every limit in force, ordered by cgroup and GPU.
    /// Every stored limit and whether it is in force.
    pub limits: Vec<(LimitEntry, LimitState)>,
    /// GPUs and MIG devices as NVML last reported them.
    pub gpus: Vec<GpuStatus>,
    pub nvml_usage: Vec<joins::NvmlUsage>,
    pub nvml: NvmlStatus,
    /// The most recent Xid events, oldest first.
    pub nvml_events: Vec<AttributedXid>,
    idle: Vec<IdleEntry>,
    /// The in-container memory view: `on`, `off` or `unavailable: <why>`.
    pub memory_info: String,
    /// The scheduler guard's state (`GuardState::describe`).
    pub scheduler_guard: String,
    /// Tenants' scheduling controls the guard acted on, by (cgroup, control, action).
    pub guard_counts: GuardCounts,
}

impl View {
    /// The view before the state task published one: nothing attributed yet.
    fn empty() -> Self {
        Self {
            state_gen: 0,
            kernel_gen: 0,
            built: Instant::now(),
            cgroups: Vec::new(),
            workloads: Default::default(),
            by_path: HashMap::new(),
            processes: Vec::new(),
            limits: Vec::new(),
            gpus: Vec::new(),
            nvml_usage: Vec::new(),
            nvml: NvmlStatus {
                available: false,
                status: "not sampled yet".into(),
            },
            nvml_events: Vec::new(),
            idle: Vec::new(),
            memory_info: String::new(),
            scheduler_guard: String::new(),
            guard_counts: GuardCounts::new(),
        }
    }

    /// Whether this view was built after the state task and the kernel reached these
    /// generations.
    fn covers(&self, state_gen: u64, kernel_gen: u64) -> bool {
        self.state_gen >= state_gen && self.kernel_gen >= kernel_gen
    }

    /// The attributed cgroup at `path` (normalized) with id `id`, if this view lists it.
    pub fn cgroup(&self, path: &str, id: u64) -> Option<&CgroupView> {
        self.by_path
            .get(path)
            .map(|i| &self.cgroups[*i])
            .filter(|c| c.id == id)
    }

    /// cgroups idle while holding GPU memory, longest idle first, their idle time counted to
    /// now (the view is of an unchanged state, so they stayed idle since it was built).
    pub fn idle(&self) -> Vec<IdleEntry> {
        let since = self.built.elapsed();
        self.idle
            .iter()
            .cloned()
            .map(|mut e| {
                e.idle_for += since;
                e
            })
            .collect()
    }
}

/// What the state task and the readers share.
struct Board {
    /// Messages and timers the state task has handled (counted before each is handled).
    state_gen: AtomicU64,
    /// A refresh is asked for and not yet taken up by the state task.
    refresh_asked: AtomicBool,
    counters: KernelCounters,
}

/// The state task's side: counts what it handles and publishes views.
pub(super) struct Publisher {
    board: Arc<Board>,
    tx: watch::Sender<Arc<View>>,
}

/// A reader's side; cheap to clone.
#[derive(Clone)]
pub(super) struct Reader {
    board: Arc<Board>,
    rx: watch::Receiver<Arc<View>>,
    /// The state task's queue, for refresh requests.
    requests: mpsc::Sender<Message>,
    cgroup_root: PathBuf,
}

/// A publisher and its first reader.
pub(super) fn channel(
    counters: KernelCounters,
    requests: mpsc::Sender<Message>,
    cgroup_root: PathBuf,
) -> (Publisher, Reader) {
    let board = Arc::new(Board {
        state_gen: AtomicU64::new(1),
        refresh_asked: AtomicBool::new(false),
        counters,
    });
    let (tx, rx) = watch::channel(Arc::new(View::empty()));
    (
        Publisher {
            board: board.clone(),
            tx,
        },
        Reader {
            board,
            rx,
            requests,
            cgroup_root,
        },
    )
}

impl Publisher {
    /// Counts a message or timer about to be handled: views built before it are stale from now
    /// on, and a reader that started after this sees its effect.
    pub fn changing(&self) {
        self.board.state_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// Answers a refresh request: builds a view if the latest is stale, and wakes the readers
    /// waiting for it either way.
    pub fn refresh(&self, state: &mut State) {
        // Cleared first: a reader that asks from now on is answered by the next refresh.
        self.board.refresh_asked.store(false, Ordering::Release);
        // Read before building: the view covers at least these generations.
        let state_gen = self.board.state_gen.load(Ordering::Acquire);
        let kernel_gen = self.board.counters.generation();
        let latest = self.tx.borrow().clone();
        if latest.covers(state_gen, kernel_gen) {
            self.tx.send_modify(|_| {});
            return;
        }
        let view = build(state, state_gen, kernel_gen);
        self.tx.send_replace(Arc::new(view));
    }
}

/// Builds a view of the state.
fn build(state: &mut State, state_gen: u64, kernel_gen: u64) -> View {
    let cgroups: Vec<_> = (state.core.attribution.list().into_iter())
        .map(|c| state.core.with_workload(c))
        .collect();
    let by_path = cgroups
        .iter()
        .enumerate()
        .map(|(i, c)| (c.path.clone(), i))
        .collect();
    View {
        state_gen,
        kernel_gen,
        built: Instant::now(),
        by_path,
        processes: state.core.attribution.processes(),
        limits: state.core.memory.list(&state.core.policies),
        gpus: state.nvml.inventory(),
        nvml_usage: joins::nvml_usage(&mut state.core.attribution, &state.nvml),
        nvml: NvmlStatus {
            available: state.nvml.available,
            status: state.nvml.status.clone(),
        },
        nvml_events: state.nvml.events.iter().cloned().collect(),
        idle: state.idle.list(std::time::Instant::now()),
        memory_info: state.core.memory_info(),
        scheduler_guard: state.core.scheduler_guard(),
        workloads: state.core.workloads.all(),
        guard_counts: crate::enforcement::guard::counts(
            &mut state.core.attribution,
            &state.core.settings,
        ),
        cgroups,
    }
}

impl Reader {
    /// The generations now, and the latest view if it covers them.
    fn fresh(&self) -> ((u64, u64), Option<Arc<View>>) {
        let state_gen = self.board.state_gen.load(Ordering::Acquire);
        let kernel_gen = self.board.counters.generation();
        let v = self.rx.borrow();
        let fresh = v.covers(state_gen, kernel_gen).then(|| v.clone());
        ((state_gen, kernel_gen), fresh)
    }

    /// The latest view that covers everything changed before this call (module docs).
    pub async fn view(&self) -> Result<Arc<View>, DaemonError> {
        // Read first: any view built after this covers them.
        let ((state_gen, kernel_gen), fresh) = self.fresh();
        if let Some(v) = fresh {
            return Ok(v);
        }
        let mut rx = self.rx.clone();
        loop {
            {
                let v = rx.borrow_and_update();
                if v.covers(state_gen, kernel_gen) {
                    return Ok(v.clone());
                }
            }
            if !self.board.refresh_asked.swap(true, Ordering::AcqRel) {
                self.requests
                    .send(Message::Refresh)
                    .await
                    .map_err(|_| DaemonError::Stopped)?;
            }
            rx.changed().await.map_err(|_| DaemonError::Stopped)?;
        }
    }

    /// One cgroup by path, from the latest view if it is fresh; else asked of the state task
    /// alone (one cgroup costs it far less than a whole new view). A cgroup that never used a
    /// device reads as zeros; a path that is not a cgroup is an error.
    pub async fn cgroup(&self, path: &str) -> Result<CgroupView, DaemonError> {
        let path = CgroupFs::normalize(path).map_err(AttributionError::from)?;
        let (_, fresh) = self.fresh();
        let Some(view) = fresh else {
            let (reply, rx) = oneshot::channel();
            self.requests
                .send(Message::Request(Request::GetCgroup { path, reply }))
                .await
                .map_err(|_| DaemonError::Stopped)?;
            return Ok(rx.await.map_err(|_| DaemonError::Stopped)??);
        };
        // Looked up after the view: a cgroup removed since is reported gone.
        let id = id_at(&self.cgroup_root, &path).map_err(AttributionError::from)?;
        Ok(view
            .cgroup(&path, id)
            .cloned()
            .unwrap_or_else(|| CgroupView {
                id,
                workload: view.workloads.get(&path).cloned().unwrap_or_default(),
                path,
                pids: Vec::new(),
                ioctls: Default::default(),
                memory: MemoryView::empty(),
            }))
    }

    /// The kernel's health counters, read now.
    pub fn kernel_stats(&self) -> std::collections::BTreeMap<String, u64> {
        self.board.counters.stats()
    }
}
