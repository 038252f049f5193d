//! The one capacity rule of a worker, used by the scheduler when it places a Run and by
//! runtimed's local gate when it claims one, so that nothing is placed where the gate would
//! refuse it.
//!
//! A worker has `spec.runs` slots (the Runtime's [`RuntimeSpec::runs_per_worker`]). Every
//! Run, whatever its mode (task, function or session), takes
//! `spec.resources.requests.runs` of them ([`RunSpec::requested_runs`], default 1) and
//! shares the worker with the others: each has its own sandbox, cgroup and directory. A
//! function Run with `mode.function.concurrency: N` keeps N interpreters, so it takes N
//! times that ([`RunSpec::function_concurrency`]); its invocations themselves are not
//! counted: they run in those interpreters, and one beyond N is refused with 429. A
//! session with `spec.resources.exclusive: true` takes every slot: it fits only on a worker
//! that holds nothing, and while it holds the worker nothing else fits there.
//!
//! [`RuntimeSpec::runs_per_worker`]: crate::RuntimeSpec::runs_per_worker

use crate::RunSpec;

/// The slots `spec` holds on a worker of `runs_per_worker` slots: every slot when it is
/// exclusive, otherwise its `requests.runs` times its function concurrency.
pub fn slots(spec: &RunSpec, runs_per_worker: i32) -> i64 {
    if spec.is_exclusive() {
        i64::from(runs_per_worker.max(1))
    } else {
        i64::from(spec.requested_runs()) * i64::from(spec.function_concurrency())
    }
}

/// Whether `spec` fits on a worker of `runs_per_worker` slots of which `used` are held
/// (the sum of [`slots`] over the Runs it holds). An exclusive Run fits only when `used` is
/// 0: every Run holds at least one slot, so `used == 0` means the worker holds nothing.
pub fn fits(spec: &RunSpec, runs_per_worker: i32, used: i64) -> bool {
    used.saturating_add(slots(spec, runs_per_worker)) <= i64::from(runs_per_worker)
}

/// Whether `spec` can ever fit on a worker of `runs_per_worker` slots (on an empty one).
pub fn fits_any_worker(spec: &RunSpec, runs_per_worker: i32) -> bool {
    fits(spec, runs_per_worker, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::{RunRequests, RunResources};

    fn spec(runs: Option<i32>, exclusive: bool) -> RunSpec {
        let mut spec = RunSpec::task("bash", "main.sh");
        spec.resources = Some(RunResources {
            requests: runs.map(|runs| RunRequests { runs: Some(runs) }),
            exclusive: exclusive.then_some(true),
        });
        spec
    }

    #[test]
    fn runs_share_a_worker_by_their_slots() {
        let one = spec(None, false);
        let two = spec(Some(2), false);
        assert_eq!(slots(&one, 8), 1);
        assert_eq!(slots(&two, 8), 2);
        assert!(fits(&one, 8, 7));
        assert!(!fits(&one, 8, 8));
        assert!(fits(&two, 8, 6));
        assert!(!fits(&two, 8, 7));
        assert!(!fits_any_worker(&spec(Some(9), false), 8));
    }

    #[test]
    fn a_function_holds_a_slot_per_interpreter() {
        let mut function = RunSpec::task("python", "");
        function.mode = crate::run::RunMode {
            function: Some(crate::run::FunctionMode {
                handler: "main:handle".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(slots(&function, 8), 1);
        if let Some(f) = function.mode.function.as_mut() {
            f.concurrency = Some(4);
        }
        assert_eq!(slots(&function, 8), 4);
        function.resources = Some(RunResources {
            requests: Some(RunRequests { runs: Some(2) }),
            exclusive: None,
        });
        assert_eq!(slots(&function, 8), 8);
        assert!(fits(&function, 8, 0));
        assert!(!fits(&function, 8, 1));
        assert!(!fits_any_worker(&function, 7));
    }

    #[test]
    fn an_exclusive_run_needs_an_empty_worker_and_then_fills_it() {
        let exclusive = spec(None, true);
        assert_eq!(slots(&exclusive, 8), 8);
        assert!(fits(&exclusive, 8, 0));
        assert!(fits_any_worker(&exclusive, 8));
        for used in 1..=8 {
            assert!(!fits(&exclusive, 8, used), "beside {used} held slots");
        }
        // While it holds the worker, nothing else fits.
        let held = slots(&exclusive, 8);
        assert!(!fits(&spec(None, false), 8, held));
        assert!(!fits(&exclusive, 8, held));
        // `requests.runs` does not matter to an exclusive Run.
        assert_eq!(slots(&spec(Some(3), true), 8), 8);
        assert_eq!(slots(&exclusive, 1), 1);
    }
}
