//! What the state task owns ([`State`]): the core, the NVML view, the compute task's feed, the
//! idle report, where its news goes and the live settings it passes on; and its timers.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use tokio::sync::watch;

use super::{core::Core, joins::ComputeFeed};
use crate::{
    config::Config,
    enforcement::{compute::law::LawParams, dmem::DmemLimits},
    notice::NoticeBus,
    nvml::{GpuStatus, NvmlView, SamplerSettings},
    policy::idle::IdleTracker,
};

/// Where the state task's news goes.
pub(super) struct Senders {
    /// Every notice, for the API's publishers, the metrics and the log.
    pub(super) notices: NoticeBus,
    /// The GPU inventory last published as a notice.
    pub(super) inventory: Arc<Vec<GpuStatus>>,
    /// Directories of the cgroups that have limits, for [`removals`].
    pub(super) limited_dirs: watch::Sender<BTreeSet<std::path::PathBuf>>,
}

/// The live settings the state task passes on to the tasks that own them.
pub(super) struct LiveSettings {
    /// The compute law's settings (`None`: compute shares are off).
    pub(super) compute: Option<watch::Sender<LawParams>>,
    /// The NVML sampler's intervals (`None`: NVML is off).
    pub(super) sampler: Option<watch::Sender<SamplerSettings>>,
}

/// Everything the state task owns.
pub(super) struct State {
    /// The accounting and the memory limits, which kernel events change.
    pub(super) core: Core,
    pub(super) nvml: NvmlView,
    /// Inputs of the compute task (`None`: compute shares disabled).
    pub(super) compute: Option<ComputeFeed>,
    pub(super) idle: IdleTracker,
    pub(super) outputs: Senders,
    pub(super) live: LiveSettings,
    /// The driver's own limits (`dmem.max`), where it registers its GPUs with the dmem
    /// controller; `None` where it does not.
    pub(super) dmem: Option<DmemLimits>,
}

/// Timers of the state task (live: a reload changes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Intervals {
    /// Periodic `/proc` scan; `None` disables it.
    pub(super) rescan: Option<Duration>,
    pub(super) sweep: Duration,
}

impl Intervals {
    pub(super) fn of(config: &Config) -> Self {
        let a = &config.attribution;
        Self {
            rescan: (a.rescan_interval_secs > 0)
                .then(|| Duration::from_secs(a.rescan_interval_secs)),
            sweep: Duration::from_secs(a.sweep_interval_secs),
        }
    }
}
