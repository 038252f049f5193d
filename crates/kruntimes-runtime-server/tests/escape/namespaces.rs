//! The escape suite (`suite.rs`) against the `namespaces` backend.

use super::*;

const BACKEND: Backend = Backend::Namespaces;

// The same suite, compiled once per backend on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "suite.rs"]
mod suite;
