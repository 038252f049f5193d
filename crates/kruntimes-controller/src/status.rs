//! Small helpers for writing Run status; most live in `kruntimes_api::lifecycle`, shared
//! with runtimed.

pub(crate) use kruntimes_api::lifecycle::{leave_ready, now_rfc3339, set_condition};
