//! How errors are printed at the edges (logs, replies, the hook's and the plugins' messages): an
//! error's Display says what failed and its cause is only its source, so an error printed with
//! [`Chain`] shows every cause exactly once.

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

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open the thing")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_once() {
        let e = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(Chain(&e).to_string(), "cannot open the thing: disk on fire");
    }
}
