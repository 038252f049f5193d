//! Small helpers for writing Run status; they live in `kruntimes_api::lifecycle`, shared
//! with runtimed.

pub(crate) use kruntimes_api::lifecycle::{now_rfc3339, set_condition};
