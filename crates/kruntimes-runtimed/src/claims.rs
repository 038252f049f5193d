//! The claim gate: claims and the drain at shutdown exclude each other.
//!
//! Every reconcile that may claim a Run, register a function or start a session's
//! registration (any reconcile of a Scheduled Run, and every one of a function or session
//! Run that is not being deleted) holds a [`Pass`] from before it decides until it
//! returns; a session's background `RegisterSession` holds one until the call answers. The
//! drain closes the gate (no pass is granted from then on) and waits until no pass is out
//! ([`Claims::close_and_wait`]) before it reads the Runs it drains. So every claim or
//! registration either completed before that read, and the drain sees it, or was refused.
//! Without this, a reconcile already past the shutdown check claimed or registered after
//! the drain's read: its Run was neither drained nor refused. The wait is bounded: each
//! pass names its Run, and the drain leaves alone (and reports) the Runs whose passes are
//! still out when it stops waiting.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

/// What a test runs when a reconcile got its pass (the Run's name), before it acts. A seam
/// for the interleaving tests (a claim must be held right after the shutdown check while
/// the drain begins); production sets none.
pub type ClaimHook = Arc<dyn Fn(&str) -> BoxFuture<'static, ()> + Send + Sync>;

#[derive(Debug, Default, Clone)]
struct State {
    closed: bool,
    /// Passes out, by Run name.
    out: HashMap<String, usize>,
}

impl State {
    fn add(&mut self, run: &str) {
        *self.out.entry(run.to_string()).or_default() += 1;
    }

    fn remove(&mut self, run: &str) {
        if let Some(count) = self.out.get_mut(run) {
            *count -= 1;
            if *count == 0 {
                self.out.remove(run);
            }
        }
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.out.keys().cloned().collect();
        names.sort();
        names
    }
}

/// The gate (one per runtimed).
#[derive(Default)]
pub struct Claims {
    state: Arc<watch::Sender<State>>,
    hook: OnceLock<ClaimHook>,
}

/// Held while a claim or registration is in flight; dropping it ends it.
pub struct Pass {
    state: Arc<watch::Sender<State>>,
    run: String,
}

impl Clone for Pass {
    /// Another holder of an in-flight claim (the count is at least one now, so a drain that
    /// waits for none out is still waiting).
    fn clone(&self) -> Pass {
        self.state.send_modify(|s| s.add(&self.run));
        Pass {
            state: self.state.clone(),
            run: self.run.clone(),
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.state.send_modify(|s| s.remove(&self.run));
    }
}

impl Claims {
    /// A pass for a reconcile of the Run `run`, or `None` once the gate is closed (then the
    /// reconcile claims, registers and starts nothing). Runs the test hook, if any, after
    /// the pass is granted.
    pub async fn enter(&self, run: &str) -> Option<Pass> {
        let pass = self.join(run)?;
        if let Some(hook) = self.hook.get() {
            hook(run).await;
        }
        Some(pass)
    }

    /// A pass for work on the Run `run` without the hook (a background registration), or
    /// `None` once closed.
    pub fn join(&self, run: &str) -> Option<Pass> {
        let mut granted = false;
        self.state.send_if_modified(|s| {
            if s.closed {
                return false;
            }
            s.add(run);
            granted = true;
            true
        });
        granted.then(|| Pass {
            state: self.state.clone(),
            run: run.to_string(),
        })
    }

    /// The Runs with passes out now, by name.
    pub fn in_flight(&self) -> Vec<String> {
        self.state.borrow().names()
    }

    /// Whether the gate is closed (shutdown began).
    pub fn closed(&self) -> bool {
        self.state.borrow().closed
    }

    /// Closes the gate: no pass is granted from now on.
    pub fn close(&self) {
        self.state.send_modify(|s| s.closed = true);
    }

    /// Closes the gate and waits, until `deadline`, for every pass out to be dropped.
    /// Returns the Runs whose passes are still out (none: no claim or registration is in
    /// flight, and none will start).
    pub async fn close_and_wait(&self, deadline: Instant) -> Vec<String> {
        self.close();
        let mut state = self.state.subscribe();
        let idle = tokio::time::timeout_at(deadline, state.wait_for(|s| s.out.is_empty())).await;
        match idle {
            Ok(Ok(_)) => Vec::new(),
            Ok(Err(_)) | Err(_) => self.in_flight(),
        }
    }

    /// Installs the test seam ([`ClaimHook`]); only the first call counts.
    pub fn set_hook(&self, hook: ClaimHook) {
        let _ = self.hook.set(hook);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Claims;

    #[tokio::test]
    async fn a_closed_gate_grants_nothing_and_waits_for_the_passes_out() {
        let claims = Claims::default();
        let Some(pass) = claims.join("a") else {
            panic!("an open gate refused a pass");
        };
        let copy = pass.clone();
        claims.close();
        assert!(claims.join("b").is_none(), "closed: no pass");
        assert!(claims.closed());
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        assert_eq!(claims.close_and_wait(soon).await, vec!["a".to_string()]);
        drop(pass);
        assert_eq!(
            claims.in_flight(),
            vec!["a".to_string()],
            "a copy still out"
        );
        drop(copy);
        let later = tokio::time::Instant::now() + Duration::from_secs(5);
        assert!(claims.close_and_wait(later).await.is_empty());
    }
}
