//! How errors are printed at the edges (the hook's message, the plugin's log and ttrpc status):
//! gpud-api's [`Chain`], which shows every cause of an error exactly once.

pub use gpud_api::report::Chain;

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
