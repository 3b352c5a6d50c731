//! Who may change state over D-Bus: root and members of the admin group (`[dbus] admin_group`).
//!
//! The system bus policy (systemd/dev.gpud.Daemon1.conf) already refuses the mutating methods
//! ([`gpud_api::MUTATING_METHODS`]) to everyone else; the daemon checks again, from the
//! credentials the bus reports for the caller, so a permissive or mistaken bus policy does not
//! open them up. Anything that cannot be established (no bus, no sender, a failed lookup) is
//! refused.

use tokio::sync::watch;
use zbus::{Connection, fdo::DBusProxy, message::Header, names::BusName};

use super::error::ApiError;

/// What the bus says about a caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub pid: Option<u32>,
    /// Primary and supplementary groups; `None` when the bus did not say.
    pub gids: Option<Vec<u32>>,
}

/// Checks callers of mutating methods against the admin group.
#[derive(Clone, Debug)]
pub struct Authorizer {
    /// Group name; empty: root only. A reload changes it (`[dbus] admin_group` is live).
    admin_group: watch::Receiver<String>,
}

impl Authorizer {
    pub fn new(admin_group: watch::Receiver<String>) -> Self {
        Self { admin_group }
    }

    /// Allows the call in `header` (received on `conn`) or refuses it with
    /// `dev.gpud.Error.AccessDenied`, logged at warn.
    pub async fn check(&self, conn: &Connection, header: &Header<'_>) -> Result<(), ApiError> {
        let method = header
            .member()
            .map(|m| m.to_string())
            .unwrap_or_else(|| "<no member>".into());
        let caller = match caller_of(conn, header).await {
            Ok(c) => c,
            Err(reason) => {
                tracing::warn!(method, "refused: {reason}");
                return Err(ApiError::AccessDenied(format!(
                    "{method} refused: {reason}"
                )));
            }
        };
        if caller.uid == 0 {
            return Ok(());
        }
        let admin_group = self.admin_group.borrow().clone();
        let denied = |why: String| {
            tracing::warn!(method, uid = caller.uid, pid = caller.pid, "refused: {why}");
            ApiError::AccessDenied(format!("{method} refused for uid {}: {why}", caller.uid))
        };
        if admin_group.is_empty() {
            return Err(denied(
                "it needs root (no admin group is configured: [dbus] admin_group)".into(),
            ));
        }
        let group = admin_group.clone();
        let found =
            blocking(move || nix::unistd::Group::from_name(&group).map_err(|e| e.to_string()))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r);
        let gid = match found {
            Ok(Some(g)) => g.gid.as_raw(),
            Ok(None) => {
                return Err(denied(format!(
                    "it needs root or group `{admin_group}`, which does not exist"
                )));
            }
            Err(e) => {
                return Err(denied(format!("cannot look up group `{admin_group}`: {e}")));
            }
        };
        let gids = match caller.gids.clone() {
            Some(g) => g,
            None => groups_of_user(caller.uid).await.map_err(|e| {
                denied(format!("cannot list the groups of uid {}: {e}", caller.uid))
            })?,
        };
        if is_admin(caller.uid, &gids, gid) {
            Ok(())
        } else {
            Err(denied(format!(
                "it needs root or membership in group `{admin_group}` (gid {gid})"
            )))
        }
    }
}

/// Root, or a member of the admin group.
pub fn is_admin(uid: u32, gids: &[u32], admin_gid: u32) -> bool {
    uid == 0 || gids.contains(&admin_gid)
}

/// The caller's credentials as the bus daemon reports them (`GetConnectionCredentials`).
async fn caller_of(conn: &Connection, header: &Header<'_>) -> Result<Caller, String> {
    if conn.unique_name().is_none() {
        return Err("the connection has no bus to vouch for the caller".into());
    }
    let sender = header
        .sender()
        .ok_or_else(|| "the message names no sender".to_owned())?;
    let proxy = DBusProxy::builder(conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(|e| format!("cannot ask the bus about the caller: {e}"))?;
    let creds = proxy
        .get_connection_credentials(BusName::Unique(sender.to_owned()))
        .await
        .map_err(|e| format!("the bus did not report the caller's credentials: {e}"))?;
    let uid = creds
        .unix_user_id()
        .ok_or_else(|| "the bus did not report the caller's uid".to_owned())?;
    Ok(Caller {
        uid,
        pid: creds.process_id(),
        gids: creds.unix_group_ids().cloned(),
    })
}

/// A uid's groups from the group database (primary and supplementary), for buses that do not
/// report `UnixGroupIDs`.
async fn groups_of_user(uid: u32) -> Result<Vec<u32>, String> {
    blocking(move || -> Result<Vec<u32>, String> {
        let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("uid {uid} is not in the user database"))?;
        let name = std::ffi::CString::new(user.name).map_err(|e| e.to_string())?;
        let groups = nix::unistd::getgrouplist(&name, user.gid).map_err(|e| e.to_string())?;
        Ok(groups.into_iter().map(|g| g.as_raw()).collect())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Runs a name-service lookup (which may block on NSS) off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    tokio::task::spawn_blocking(f).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_members_only() {
        assert!(is_admin(0, &[], 1234));
        assert!(is_admin(1000, &[100, 1234], 1234));
        assert!(!is_admin(1000, &[100, 1000], 1234));
        assert!(!is_admin(65534, &[], 0), "gid 0 alone is not root");
    }
}
