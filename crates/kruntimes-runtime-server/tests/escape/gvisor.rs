//! The escape suite (`suite.rs`) against the `gvisor` backend. It needs `runsc` from
//! bookworm-backports (`.ci/run` installs it): a machine without it fails here rather
//! than passing quietly.

use super::*;

const BACKEND: Backend = Backend::Gvisor;

// The same suite, compiled once per backend on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "suite.rs"]
mod suite;
