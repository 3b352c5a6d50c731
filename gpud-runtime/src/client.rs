//! Applying a container's shares through gpud's D-Bus API (`SetLimits`, `ClearLimits`), and
//! naming its workload (`SetWorkload`), with every call bounded in time.

use std::{collections::BTreeMap, time::Duration};

use super::{RuntimeError, annotations::Shares};
use gpud_api::{LimitState, Manager1Proxy, connect_builder, error::names, limits::to_dict};

/// What [`Client::apply`] set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// GPUs (`all`, an index or a UUID, as gpud names them) that got limits, in force or
    /// pending.
    pub gpus: Vec<String>,
    /// Of those, the ones gpud stored as pending (their GPU not known to it yet: a UUID while
    /// NVML has not answered), with why; gpud puts them in force once it knows the GPU.
    pub pending: Vec<(String, String)>,
}

/// A connection to gpud.
#[derive(Clone)]
pub struct Client {
    proxy: Manager1Proxy<'static>,
    timeout: Duration,
}

/// The answer of a gpud that lacks a method (one older than this client).
const UNKNOWN_METHOD: &str = "org.freedesktop.DBus.Error.UnknownMethod";

/// gpud's own answers (`dev.gpud.Error.*`) refuse the request, except `Failed` (it could not
/// complete it, e.g. while shutting down), and so does an unknown method (gpud is there, only
/// older); anything else (the bus's errors: no daemon on it, the bus policy) says gpud could not
/// be asked.
fn classify(call: &str, e: zbus::Error) -> RuntimeError {
    match e {
        zbus::Error::MethodError(name, message, _)
            if (name.as_str().starts_with(names::PREFIX) && name.as_str() != names::FAILED)
                || name.as_str() == UNKNOWN_METHOD =>
        {
            RuntimeError::Refused {
                call: call.to_owned(),
                name: name.as_str().to_owned(),
                message: message.unwrap_or_default(),
            }
        }
        zbus::Error::MethodError(name, message, _) => RuntimeError::Unreachable {
            call: call.to_owned(),
            reason: format!("{}: {}", name.as_str(), message.unwrap_or_default()),
        },
        other => RuntimeError::Unreachable {
            call: call.to_owned(),
            reason: other.to_string(),
        },
    }
}

impl Client {
    /// Connects to gpud on `bus` (`"system"` or a D-Bus address). Each later call, and this
    /// connection, is bounded by `timeout`.
    pub async fn connect(bus: &str, timeout: Duration) -> Result<Self, RuntimeError> {
        let unreachable = |reason: String| RuntimeError::Unreachable {
            call: format!("connect to bus {bus}"),
            reason,
        };
        let conn = tokio::time::timeout(timeout, connect_builder(bus).build())
            .await
            .map_err(|_| unreachable(format!("no connection within {timeout:?}")))?
            .map_err(|e| unreachable(e.to_string()))?;
        let proxy = Manager1Proxy::new(&conn)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(Self { proxy, timeout })
    }

    async fn bounded<T>(
        &self,
        call: &str,
        f: impl std::future::Future<Output = zbus::Result<T>>,
    ) -> Result<T, RuntimeError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map_err(|e| classify(call, e)),
            Err(_) => Err(RuntimeError::Unreachable {
                call: call.to_owned(),
                reason: format!("no answer within {:?}", self.timeout),
            }),
        }
    }

    /// Sets `shares` on `cgroup`, one `SetLimits` per GPU. A GPU whose limits gpud refuses does
    /// not cost the others theirs: the rest are still set, and nothing set is undone (the
    /// caller's failure policy decides about the container; limits left on a cgroup that goes
    /// are dropped with it). An unreachable gpud stops the round at once (each call would wait
    /// out the timeout). Returns what was set, and the error if any: the unreachable one, else
    /// the first refusal.
    pub async fn apply(
        &self,
        cgroup: &str,
        shares: &Shares,
    ) -> (Applied, Result<(), RuntimeError>) {
        let mut applied = Applied::default();
        let mut refused = None;
        for (gpu, limits) in &shares.gpus {
            let gpu = gpu.to_string();
            let dict = to_dict(limits.iter().map(|(k, v)| (*k, v)));
            if dict.is_empty() {
                continue;
            }
            let call = format!("SetLimits({cgroup}, {gpu})");
            match self
                .bounded(&call, self.proxy.set_limits(cgroup, &gpu, dict))
                .await
            {
                Ok((state, note)) => {
                    if let LimitState::Pending(why) = LimitState::from_wire(&state, &note) {
                        applied.pending.push((gpu.clone(), why));
                    }
                    applied.gpus.push(gpu);
                }
                Err(e @ RuntimeError::Unreachable { .. }) => return (applied, Err(e)),
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        (applied, refused.map_or(Ok(()), Err))
    }

    /// Clears every limit of `cgroup` on each of `gpus`. A cgroup with nothing to clear (gone,
    /// and its limits already dropped by gpud) is not an error.
    pub async fn clear(&self, cgroup: &str, gpus: &[String]) -> Result<(), RuntimeError> {
        for gpu in gpus {
            self.clear_names(cgroup, gpu, &[]).await?;
        }
        Ok(())
    }

    /// Clears the limits named in `limits` (all when empty) of `cgroup` on `gpu`; nothing to clear is
    /// not an error.
    async fn clear_names(
        &self,
        cgroup: &str,
        gpu: &str,
        limits: &[&str],
    ) -> Result<(), RuntimeError> {
        let call = format!("ClearLimits({cgroup}, {gpu})");
        match self
            .bounded(&call, self.proxy.clear_limits(cgroup, gpu, limits))
            .await
        {
            Err(RuntimeError::Refused { name, .. }) if name == names::NOT_FOUND => Ok(()),
            r => r,
        }
    }

    /// A pod's limits after a change of its claims ([`crate::pod::Ledger`]): what it has now
    /// set first, then what it no longer has cleared (never a moment with neither).
    pub async fn apply_change(
        &self,
        change: &crate::pod::Change,
    ) -> (Applied, Result<(), RuntimeError>) {
        let (applied, mut result) = self.apply(&change.cgroup, &change.after).await;
        if matches!(result, Err(RuntimeError::Unreachable { .. })) {
            return (applied, result);
        }
        for (gpu, kinds) in crate::pod::removed(&change.before, &change.after) {
            let names: Vec<&str> = kinds.iter().map(|k| k.dbus_name()).collect();
            let cleared = self
                .clear_names(&change.cgroup, &gpu.to_string(), &names)
                .await;
            if let Err(e) = cleared
                && result.is_ok()
            {
                result = Err(e);
            }
        }
        (applied, result)
    }

    /// Records which Kubernetes workload `cgroup` runs ([`crate::workload`]); empty `names` clear
    /// it. Names that [`gpud_api::workload::check`] refuses are not sent: that is an
    /// [`RuntimeError::Input`].
    pub async fn set_workload(
        &self,
        cgroup: &str,
        names: &crate::workload::Names,
    ) -> Result<(), RuntimeError> {
        gpud_api::workload::check(names)
            .map_err(|e| RuntimeError::Input(format!("workload names of {cgroup}: {e}")))?;
        let call = format!("SetWorkload({cgroup})");
        self.bounded(&call, self.proxy.set_workload(cgroup, names))
            .await
    }

    /// GPU memory charged to `cgroup` from now on is also charged to `group` and held to its
    /// limits (a claim's cgroup: [`crate::claim`]).
    pub async fn share_charges(&self, cgroup: &str, group: &str) -> Result<(), RuntimeError> {
        let call = format!("ShareCharges({cgroup}, {group})");
        self.bounded(&call, self.proxy.share_charges(cgroup, group))
            .await
    }

    /// Limits in force on `cgroup`, by GPU (for checks and logs).
    pub async fn limits_of(
        &self,
        cgroup: &str,
    ) -> Result<BTreeMap<String, BTreeMap<String, u64>>, RuntimeError> {
        let all = self.bounded("ListLimits", self.proxy.list_limits()).await?;
        Ok(all
            .into_iter()
            .filter(|l| l.cgroup == cgroup)
            .map(|l| (l.gpu, l.limits))
            .collect())
    }
}
