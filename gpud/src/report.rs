//! How errors are printed at the edges: log lines, D-Bus replies, status text, the exit message.
//! gpud's errors follow aya's style: Display says what failed and the cause is only the error's
//! source, so an error printed with [`Chain`] (gpud-api's, shared with the runtime
//! integration) shows every cause exactly once.

pub use gpud_api::report::Chain;
