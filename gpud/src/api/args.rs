//! Bounds on the arguments of D-Bus calls, checked before the core sees them. The `limits`
//! dictionary of `SetLimits` is decoded by gpud-api's schema ([`gpud_api::limits::LimitDict`]).

/// Longest string argument accepted; longer ones are refused before any work.
pub const MAX_ARG_LEN: usize = 4096;
