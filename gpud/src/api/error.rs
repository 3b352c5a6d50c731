//! The daemon's side of D-Bus errors: which `dev.gpud.Error.*` ([`ApiError`], defined once in
//! gpud-api for server and clients) each failure of the core becomes.

use crate::{
    attribution::AttributionError, cgroupfs::CgroupError, daemon::DaemonError,
    enforcement::EnforcementError, policy::PolicyError, report::Chain,
};
pub use gpud_api::ApiError;

// The reply carries the whole chain: a caller sees why (e.g. the OS error of a failed write).
impl From<AttributionError> for ApiError {
    fn from(e: AttributionError) -> Self {
        let text = Chain(&e).to_string();
        match e {
            AttributionError::Cgroup(CgroupError::NotFound(_)) => Self::NotFound(text),
            AttributionError::Cgroup(CgroupError::InvalidPath { .. })
            | AttributionError::ShareRefused { .. } => Self::InvalidArgument(text),
            _ => Self::Failed(text),
        }
    }
}

impl From<EnforcementError> for ApiError {
    fn from(e: EnforcementError) -> Self {
        let text = Chain(&e).to_string();
        match e {
            EnforcementError::Attribution(a) => a.into(),
            EnforcementError::Policy(PolicyError::Write { .. }) | EnforcementError::Setting(_) => {
                Self::Failed(text)
            }
            EnforcementError::Policy(_) => Self::InvalidArgument(text),
        }
    }
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> Self {
        match e {
            DaemonError::Stopped => Self::Failed(e.to_string()),
            DaemonError::Attribution(e) => e.into(),
            DaemonError::Enforcement(e) => e.into(),
        }
    }
}
