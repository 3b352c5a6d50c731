//! Integration-test support for gpud (filled in by the tests).
