//! The scenario file's types (its format is in the crate's docs, "Scenario"): what the fake
//! library reads, and what tests write, so a test's scenario is typed and every test names its
//! GPUs the same way ([`uuid`]).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// The driver and CUDA versions of the test GPUs (an H100's when it was checked).
pub const DRIVER_VERSION: &str = "580.159.04";
pub const CUDA_VERSION: i32 = 13000;
/// A test GPU's memory: 80 GiB.
pub const MEMORY_TOTAL: u64 = 80 << 30;

/// The UUID of test GPU `index`: `GPU-<index as 8 hex digits>-1111-2222-3333-444444444444`.
pub fn uuid(index: u32) -> String {
    format!("GPU-{index:08x}-1111-2222-3333-444444444444")
}

impl Scenario {
    /// `n` idle test GPUs ([`Gpu::test`]) of the test driver, no process.
    pub fn gpus(n: u32) -> Self {
        Self {
            driver_version: DRIVER_VERSION.to_owned(),
            cuda_version: CUDA_VERSION,
            gpus: (0..n).map(Gpu::test).collect(),
            ..Self::default()
        }
    }

    /// The same with these processes.
    pub fn with(mut self, processes: impl IntoIterator<Item = Process>) -> Self {
        self.processes.extend(processes);
        self
    }

    /// The same with `function` failing ([`Fail`]).
    pub fn failing(mut self, function: &str, fail: Fail) -> Self {
        self.fail.insert(function.to_owned(), fail);
        self
    }
}

impl Gpu {
    /// Test GPU `index`: an 80 GiB "Fake H100" named by [`uuid`], PCI device `0x06 + index` on
    /// bus 0 (as the H100 cloud VM's `00000000:00:06.0`),
    /// with per-process utilization and Xid events, no MIG, no NVLink.
    pub fn test(index: u32) -> Self {
        Self {
            uuid: uuid(index),
            name: "Fake H100".to_owned(),
            pci_bus_id: format!("00000000:00:{:02x}.0", 6 + index),
            memory_total: MEMORY_TOTAL,
            compute_mode: 0,
            mig: None,
            process_utilization: true,
            xid_events: true,
            numa_node: 0,
            pci_switch: None,
            nvlinks: None,
        }
    }
}

impl Process {
    /// A compute process `pid` on GPU `gpu` holding `memory` bytes; its utilization simulated
    /// from its CPU time.
    pub fn on(pid: u32, gpu: u32, memory: u64) -> Self {
        Self {
            pid,
            gpu,
            memory,
            ..Self::default()
        }
    }
}

impl Event {
    /// Xid `xid` on GPU `gpu`, delivered once by its position in the list.
    pub fn xid(gpu: u32, xid: u64) -> Self {
        Self { id: None, gpu, xid }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Mig {
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub memory_total: u64,
    #[serde(default)]
    pub compute_mode: u32,
    #[serde(default)]
    pub mig: Option<Vec<Mig>>,
    #[serde(default = "yes")]
    pub process_utilization: bool,
    #[serde(default = "yes")]
    pub xid_events: bool,
    /// NUMA node of the GPU's PCIe root (`nvmlDeviceGetNumaNodeId`; the common ancestor of two
    /// GPUs on one node is `NODE`, on two nodes `SYSTEM`).
    #[serde(default)]
    pub numa_node: u32,
    /// GPUs naming the same PCIe switch have the common ancestor `SINGLE`.
    #[serde(default)]
    pub pci_switch: Option<String>,
    /// NVLinks: the peer GPU (index) of each active link, one entry per link. Absent: the GPU
    /// has no NVLink (`NOT_SUPPORTED`); links past the list are inactive.
    #[serde(default)]
    pub nvlinks: Option<Vec<u32>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Compute,
    Graphics,
    Both,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Process {
    pub pid: u32,
    pub gpu: u32,
    #[serde(default)]
    pub mig: Option<u32>,
    #[serde(default)]
    pub memory: u64,
    #[serde(default)]
    pub kind: Kind,
    /// Fixed utilization; absent: simulated from the process's CPU time.
    #[serde(default)]
    pub sm_util: Option<u32>,
    #[serde(default)]
    pub enc_util: u32,
    #[serde(default)]
    pub dec_util: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    #[serde(default)]
    pub id: Option<u64>,
    pub gpu: u32,
    pub xid: u64,
}

/// When a function fails: always, or a number of calls after a number of successes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Fail {
    Always(u32),
    Counted {
        code: u32,
        #[serde(default)]
        after: u64,
        #[serde(default)]
        times: Option<u64>,
    },
}

impl Fail {
    /// The code the `n`-th call (1-based) returns, if it fails.
    pub fn code_for_call(self, n: u64) -> Option<u32> {
        match self {
            Fail::Always(code) => Some(code),
            Fail::Counted { code, after, times } => {
                (n > after && times.is_none_or(|t| n <= after.saturating_add(t))).then_some(code)
            }
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default)]
    pub driver_version: String,
    #[serde(default)]
    pub cuda_version: i32,
    #[serde(default)]
    pub init_error: Option<u32>,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    #[serde(default)]
    pub processes: Vec<Process>,
    /// Also accepted as `xid`.
    #[serde(default, alias = "xid")]
    pub events: Vec<Event>,
    #[serde(default)]
    pub fail: HashMap<String, Fail>,
}
