//! The errors the daemon answers D-Bus calls with, named `dev.gpud.Error.<Variant>`. Clients
//! match on these names (or convert a `zbus::Error` with [`ApiError::from`]).

/// An error returned to a D-Bus caller.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "dev.gpud.Error")]
pub enum ApiError {
    /// A failure of the bus itself (not one of the daemon's answers).
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The named object (e.g. a cgroup path) does not exist.
    NotFound(String),
    /// An argument is malformed (e.g. a path with `..`).
    InvalidArgument(String),
    /// The daemon could not complete the request.
    Failed(String),
    /// The caller may not call this method (it changes state: root and the admin group only).
    AccessDenied(String),
}

/// The full D-Bus names of the errors, for clients that match on `zbus::Error::MethodError`.
pub mod names {
    /// [`super::ApiError::NotFound`].
    pub const NOT_FOUND: &str = "dev.gpud.Error.NotFound";
    /// [`super::ApiError::InvalidArgument`].
    pub const INVALID_ARGUMENT: &str = "dev.gpud.Error.InvalidArgument";
    /// [`super::ApiError::Failed`].
    pub const FAILED: &str = "dev.gpud.Error.Failed";
    /// [`super::ApiError::AccessDenied`].
    pub const ACCESS_DENIED: &str = "dev.gpud.Error.AccessDenied";
    /// The prefix of every error the daemon itself answers with.
    pub const PREFIX: &str = "dev.gpud.Error.";
}

#[cfg(test)]
mod tests {
    use zbus::DBusError as _;

    use super::*;

    #[test]
    fn names_match_the_variants() {
        for (e, name) in [
            (ApiError::NotFound(String::new()), names::NOT_FOUND),
            (
                ApiError::InvalidArgument(String::new()),
                names::INVALID_ARGUMENT,
            ),
            (ApiError::Failed(String::new()), names::FAILED),
            (ApiError::AccessDenied(String::new()), names::ACCESS_DENIED),
        ] {
            assert_eq!(e.name().as_str(), name);
            assert!(name.starts_with(names::PREFIX));
        }
    }
}
