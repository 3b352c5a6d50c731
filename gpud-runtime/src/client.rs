//! Applying a container's shares through gpud's D-Bus API (`SetLimits`, `ClearLimits`), with
//! every call bounded in time.

use std::{collections::BTreeMap, time::Duration};

use super::{RuntimeError, annotations::Shares};
use gpud_api::{Manager1Proxy, connect_builder, error::names, limits::to_dict};

/// What [`Client::apply`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// GPUs (`all`, an index or a UUID, as gpud names them) that got limits.
    pub gpus: Vec<String>,
}

/// A connection to gpud.
#[derive(Clone)]
pub struct Client {
    proxy: Manager1Proxy<'static>,
    timeout: Duration,
}

/// gpud's refusals of the request itself; any other error (`Unavailable`, `Failed`, the bus's
/// own) says gpud could not answer now.
fn classify(call: &str, e: zbus::Error) -> RuntimeError {
    match e {
        zbus::Error::MethodError(name, message, _)
            if name.as_str() == names::INVALID_ARGUMENT || name.as_str() == names::NOT_FOUND =>
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

    /// Sets `shares` on `cgroup`, one `SetLimits` per GPU. On an error the GPUs already set are
    /// cleared again (best effort), so a failed apply leaves nothing behind.
    pub async fn apply(&self, cgroup: &str, shares: &Shares) -> Result<Applied, RuntimeError> {
        let mut applied = Applied::default();
        for (gpu, limits) in &shares.gpus {
            let gpu = gpu.to_string();
            let dict = to_dict(limits.iter().map(|(k, v)| (*k, v)));
            if dict.is_empty() {
                continue;
            }
            let call = format!("SetLimits({cgroup}, {gpu})");
            if let Err(e) = self
                .bounded(&call, self.proxy.set_limits(cgroup, &gpu, dict))
                .await
            {
                if let Err(undo) = self.clear(cgroup, &applied.gpus).await {
                    tracing::warn!("cannot undo the limits set before the failure: {undo}");
                }
                return Err(e);
            }
            applied.gpus.push(gpu);
        }
        Ok(applied)
    }

    /// Clears every limit of `cgroup` on each of `gpus`. A cgroup with nothing to clear (gone,
    /// and its limits already dropped by gpud) is not an error.
    pub async fn clear(&self, cgroup: &str, gpus: &[String]) -> Result<(), RuntimeError> {
        for gpu in gpus {
            let call = format!("ClearLimits({cgroup}, {gpu})");
            match self
                .bounded(&call, self.proxy.clear_limits(cgroup, gpu, &[]))
                .await
            {
                Ok(()) => {}
                Err(RuntimeError::Refused { name, .. }) if name == names::NOT_FOUND => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
