//! The daemon's log output: journald-native when stderr is the journal, plain text otherwise,
//! behind a filter that a configuration reload can replace.
//!
//! Under systemd, stderr is a stream to journald and `JOURNAL_STREAM` names it (`dev:ino`). There
//! events go to journald's native socket instead, so their fields (`cgroup`, `pid`, `gpu`, ...)
//! become journal fields (`CGROUP=`, `PID=`, `GPU=`; `journalctl -o verbose` shows them) rather
//! than text inside `MESSAGE=`. Anywhere else: the `fmt` layer on stderr, coloured only on a tty.

use std::io::IsTerminal as _;

use tracing_subscriber::{
    EnvFilter, Registry, fmt, layer::SubscriberExt as _, reload, util::SubscriberInitExt as _,
};

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("invalid log filter `{filter}`: {reason}")]
    Filter { filter: String, reason: String },
    #[error("cannot replace the log filter")]
    Reload(#[from] reload::Error),
    #[error("cannot install the log subscriber")]
    Init(#[from] tracing_subscriber::util::TryInitError),
}

/// Where log events go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// journald's native protocol (stderr was the journal).
    Journal,
    /// Text on stderr.
    Stderr,
}

/// The installed subscriber's filter, replaceable at run time.
pub struct LogHandle {
    filter: reload::Handle<EnvFilter, Registry>,
    /// `RUST_LOG` was set: it wins over `daemon.log`, at start and on reload.
    env_override: Option<String>,
    pub output: Output,
}

/// Parses a filter in `EnvFilter` syntax (the `daemon.log` key).
pub fn parse_filter(filter: &str) -> Result<EnvFilter, LogError> {
    EnvFilter::try_new(filter).map_err(|e| LogError::Filter {
        filter: filter.to_owned(),
        reason: e.to_string(),
    })
}

/// Installs the global subscriber with `filter` (unless `RUST_LOG` overrides it).
pub fn init(filter: &str) -> Result<LogHandle, LogError> {
    let env_override = std::env::var("RUST_LOG").ok().filter(|s| !s.is_empty());
    let initial = parse_filter(env_override.as_deref().unwrap_or(filter))?;
    let (filter_layer, handle) = reload::Layer::new(initial);
    // A journal we cannot reach (no socket) falls back to text on stderr, which systemd
    // still forwards to the journal, only without fields.
    let journal = stderr_is_journal()
        .then(|| tracing_journald::layer().ok())
        .flatten()
        // Fields as they are named in the code (CGROUP=, not the default F_CGROUP=), levels as
        // syslog's (info is 6, not the crate's default 5 "notice").
        .map(|l| {
            l.with_field_prefix(None)
                .with_priority_mappings(tracing_journald::PriorityMappings {
                    error: tracing_journald::Priority::Error,
                    warn: tracing_journald::Priority::Warning,
                    info: tracing_journald::Priority::Informational,
                    debug: tracing_journald::Priority::Debug,
                    trace: tracing_journald::Priority::Debug,
                })
        });
    let output = if journal.is_some() {
        Output::Journal
    } else {
        Output::Stderr
    };
    let text = journal.is_none().then(|| {
        fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
    });
    tracing_subscriber::registry()
        .with(filter_layer)
        .with(journal)
        .with(text)
        .try_init()?;
    Ok(LogHandle {
        filter: handle,
        env_override,
        output,
    })
}

impl LogHandle {
    /// Replaces the filter with `filter`. `Ok(false)`: `RUST_LOG` is set and stays in force.
    pub fn set_filter(&self, filter: &str) -> Result<bool, LogError> {
        let new = parse_filter(filter)?;
        if self.env_override.is_some() {
            return Ok(false);
        }
        self.filter.reload(new)?;
        Ok(true)
    }
}

/// Whether stderr is the stream `JOURNAL_STREAM` names (systemd sets it for units whose output
/// goes to the journal; a child that inherits the variable but not the stream does not match).
pub fn stderr_is_journal() -> bool {
    let Some(var) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = var.to_str().and_then(parse_journal_stream) else {
        return false;
    };
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat(2) on fd 2 into a buffer of the right type; read only if it succeeded.
    let st = unsafe {
        if libc::fstat(libc::STDERR_FILENO, st.as_mut_ptr()) != 0 {
            return false;
        }
        st.assume_init()
    };
    st.st_dev == dev && st.st_ino == ino
}

/// `JOURNAL_STREAM`'s `DEVICE:INODE`, both decimal.
fn parse_journal_stream(s: &str) -> Option<(libc::dev_t, libc::ino_t)> {
    let (dev, ino) = s.split_once(':')?;
    Some((dev.parse().ok()?, ino.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_stream_variable() {
        assert_eq!(parse_journal_stream("8:12345"), Some((8, 12345)));
        assert_eq!(parse_journal_stream("8"), None);
        assert_eq!(parse_journal_stream("x:1"), None);
    }

    #[test]
    fn filters_are_checked() {
        assert!(parse_filter("info").is_ok());
        assert!(parse_filter("gpud=debug,zbus=warn").is_ok());
        assert!(parse_filter("gpud=loudest").is_err());
    }
}
