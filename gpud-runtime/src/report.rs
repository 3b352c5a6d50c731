//! How errors are printed at the edges (the hook's message, the plugin's log and ttrpc status):
//! an error's Display says what failed and its cause is only its source, so an error printed
//! with [`Chain`] shows every cause exactly once.

use std::fmt;

/// An error and its causes: `what failed: why: deeper cause`.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cause_once() {
        let e = crate::RuntimeError::Io {
            path: "/run/gpud-hook/x.json".into(),
            source: std::io::Error::other("disk on fire"),
        };
        assert_eq!(
            Chain(&e).to_string(),
            "cannot access /run/gpud-hook/x.json: disk on fire"
        );
    }
}
