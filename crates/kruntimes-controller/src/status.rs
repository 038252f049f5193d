//! Small helpers for writing Run status; most live in `kruntimes_api::lifecycle`, shared
//! with runtimed.

use kruntimes_api::RunStatus;
use kruntimes_api::run::RunSpec;

pub(crate) use kruntimes_api::lifecycle::{now_rfc3339, set_condition};

/// Sets `Ready=False` with `reason` on a function or session Run that this writer moves out
/// of Ready (back to Pending, or to an end), so that no Run outside Ready keeps
/// `Ready=True`. A task Run has no Ready condition and gets none.
pub(crate) fn leave_ready(
    spec: &RunSpec,
    status: &mut RunStatus,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    if spec.mode.function.is_none() && spec.mode.session.is_none() {
        return;
    }
    kruntimes_api::lifecycle::set_ready(status, false, reason, message, generation);
}
