//! Function Runs through the API server: create one, wait until it is Ready, get and list
//! them. Invoking a Ready function goes to its endpoint instead ([`crate::invoke`]).
//!
//! Readiness is the Run's phase, never the presence of `status.endpoint` (an endpoint may
//! stay while a Run recovers; docs/function-mode.md). Waiting watches the Run
//! (kube-runtime's `await_condition`); nothing here polls.

use std::time::Duration;

use kruntimes_api::run::{EnvVar, FunctionMode, RetryPolicy, RunMode, RunSource};
use kruntimes_api::{Phase, Run, RunSpec};
use kube::api::{Api, ListParams, ObjectMeta, PostParams};

use crate::connect::Connection;
use crate::endpoint::{EndpointClients, detail};
use crate::wait::{self, WaitError};

/// Why a function operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec breaks an admission rule; nothing was sent.
    #[error("function {name} is invalid: {}", problems.join("; "))]
    Invalid {
        /// The function's name.
        name: String,
        /// One line per broken rule, `field: problem`.
        problems: Vec<String>,
    },
    /// A Run of that name exists already.
    #[error("run {name} already exists in namespace {namespace}")]
    AlreadyExists {
        /// The Run's name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// No Run of that name exists.
    #[error("run {name} not found in namespace {namespace}")]
    NotFound {
        /// The Run's name.
        name: String,
        /// The namespace searched.
        namespace: String,
    },
    /// The Run exists but is a task or a session.
    #[error("run {name} in namespace {namespace} is a {mode} Run, not a function")]
    NotAFunction {
        /// The Run's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// `task`, `session`, or `invalid` for a Run without exactly one mode.
        mode: &'static str,
    },
    /// The API server refused the request or could not be reached.
    #[error("cannot {action} in namespace {namespace}")]
    Api {
        /// What was attempted: `create run NAME`, `list runs`…
        action: String,
        /// The namespace.
        namespace: String,
        /// kube-rs's error (an API status, or a transport failure).
        #[source]
        source: kube::Error,
    },
    /// The Run reached a terminal phase instead of Ready.
    #[error("function {name} ended {} before it was ready{}", phase.as_str(), detail(reason, message))]
    Ended {
        /// The Run's name.
        name: String,
        /// The terminal phase.
        phase: Phase,
        /// `status.reason`, e.g. `RegistrationFailed`.
        reason: Option<String>,
        /// `status.message`.
        message: Option<String>,
        /// The Run as last seen.
        run: Box<Run>,
    },
    /// The Run was deleted while waiting for it.
    #[error("function {name} was deleted before it was ready")]
    Deleted {
        /// The Run's name.
        name: String,
    },
    /// The Run was not Ready within the limit; it goes on.
    #[error(
        "function {name} was not ready after {} (phase {}{})",
        format_duration(*limit),
        phase.as_str(),
        crate::wait::why_text(why)
    )]
    WaitTimedOut {
        /// The Run's name.
        name: String,
        /// How long was waited.
        limit: Duration,
        /// The phase last seen.
        phase: Phase,
        /// Why the scheduler had not placed it (`REASON: MESSAGE` of `Scheduled=False`),
        /// or empty.
        why: String,
    },
    /// The watch on the Run failed.
    #[error("the watch on run {name} failed")]
    Watch {
        /// The Run's name.
        name: String,
        /// kube-runtime's error.
        #[source]
        source: kube::runtime::wait::Error,
    },
}

/// What to register: a handler in inline source, on a Runtime.
///
/// The handler names the entry point in the source's own terms: for python
/// `module:function` (the source is written as `module.py`), for bash the script's file
/// name (the source is written under that name and reads the request on stdin).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FunctionSpec {
    /// The Run's name (a DNS-1123 subdomain), unique in the namespace.
    pub name: String,
    /// The Runtime (worker pool) to register on.
    pub runtime: String,
    /// The program text, at most 256 KiB.
    pub source: String,
    /// The handler, e.g. `main:handle` (python) or `main.sh` (bash).
    pub handler: String,
    /// End the registration (phase Timeout, reason IdleTimeout) after this long without
    /// invocations; whole seconds, rounded up.
    pub idle_timeout: Option<Duration>,
    /// The longest the registration may live, from its start (`spec.timeout`).
    pub timeout: Option<Duration>,
    /// Environment variables of the handler's process.
    pub env: Vec<EnvVar>,
    /// Registration attempts in all, the first included (`spec.retryPolicy.maxAttempts`).
    pub max_attempts: Option<i32>,
    /// How many invocations may run at once (`spec.mode.function.concurrency`, 1 to 64;
    /// `None`: 1). One more is refused with 429.
    pub concurrency: Option<i32>,
}

impl FunctionSpec {
    /// A spec with the four required fields and nothing else set.
    pub fn new(
        name: impl Into<String>,
        runtime: impl Into<String>,
        handler: impl Into<String>,
        source: impl Into<String>,
    ) -> FunctionSpec {
        FunctionSpec {
            name: name.into(),
            runtime: runtime.into(),
            handler: handler.into(),
            source: source.into(),
            ..FunctionSpec::default()
        }
    }

    /// The Run object for this spec, checked against the admission rules the API server
    /// applies (so that a mistake is reported before any request).
    pub fn to_run(&self) -> Result<Run, Error> {
        let invalid = |problem: String| Error::Invalid {
            name: self.name.clone(),
            problems: vec![problem],
        };
        let idle_timeout_seconds = match self.idle_timeout {
            None => None,
            Some(d) => {
                let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                if secs == 0 {
                    return Err(invalid(
                        "the idle timeout must be at least one second".to_string(),
                    ));
                }
                Some(
                    i32::try_from(secs)
                        .map_err(|_| invalid(format!("the idle timeout of {secs}s is too long")))?,
                )
            }
        };
        if self.name.is_empty() {
            return Err(invalid("a function needs a name".to_string()));
        }
        let mut spec = RunSpec::task(self.runtime.clone(), String::new());
        spec.mode = RunMode {
            function: Some(FunctionMode {
                handler: self.handler.clone(),
                idle_timeout_seconds,
                concurrency: self.concurrency,
            }),
            ..RunMode::default()
        };
        spec.source = Some(RunSource {
            inline: Some(self.source.clone()),
            snapshot: None,
        });
        spec.env = (!self.env.is_empty()).then(|| self.env.clone());
        spec.timeout = self.timeout.map(format_duration);
        spec.retry_policy = self.max_attempts.map(|max_attempts| RetryPolicy {
            max_attempts,
            backoff_seconds: None,
        });
        let problems: Vec<String> = kruntimes_api::admission::validate_create(&spec)
            .iter()
            .map(ToString::to_string)
            .collect();
        if !problems.is_empty() {
            return Err(Error::Invalid {
                name: self.name.clone(),
                problems,
            });
        }
        Ok(Run {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        })
    }
}

/// `d` as a `metav1.Duration` string in its largest exact unit: `1h`, `90m`, `45s`,
/// `250ms` (below a millisecond rounds up).
pub fn format_duration(d: Duration) -> String {
    let millis = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    match millis {
        0 => "0s".to_string(),
        m if m.is_multiple_of(3_600_000) => format!("{}h", m / 3_600_000),
        m if m.is_multiple_of(60_000) => format!("{}m", m / 60_000),
        m if m.is_multiple_of(1_000) => format!("{}s", m / 1_000),
        m => format!("{m}ms"),
    }
}

/// Whether `run` is a function Run.
pub fn is_function(run: &Run) -> bool {
    run.spec.mode.function.is_some()
}

/// Function operations in one namespace. Cheap to clone; clones share their clients.
#[derive(Clone)]
pub struct Functions {
    pub(crate) api: Api<Run>,
    pub(crate) namespace: String,
    /// The connection's configuration: the credentials every invocation carries.
    pub(crate) config: kube::Config,
    pub(crate) endpoints: EndpointClients,
    pub(crate) invoke_timeout: Duration,
}

impl std::fmt::Debug for Functions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Functions")
            .field("namespace", &self.namespace)
            .field("invoke_timeout", &self.invoke_timeout)
            .finish_non_exhaustive()
    }
}

impl Functions {
    /// Function operations in the connection's namespace.
    pub fn new(connection: &Connection) -> Functions {
        Functions {
            api: Api::namespaced(connection.client().clone(), connection.namespace()),
            namespace: connection.namespace().to_string(),
            config: connection.config().clone(),
            endpoints: EndpointClients::default(),
            invoke_timeout: crate::invoke::DEFAULT_INVOKE_TIMEOUT,
        }
    }

    /// The namespace these operations work in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn api_error(&self, action: String, source: kube::Error) -> Error {
        Error::Api {
            action,
            namespace: self.namespace.clone(),
            source,
        }
    }

    /// Creates the function Run of `spec`. It starts Pending; see [`Functions::wait_ready`].
    ///
    /// Errors: [`Error::Invalid`] before any request, [`Error::AlreadyExists`], or
    /// [`Error::Api`].
    pub async fn create(&self, spec: &FunctionSpec) -> Result<Run, Error> {
        let run = spec.to_run()?;
        match self.api.create(&PostParams::default(), &run).await {
            Ok(run) => Ok(run),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::AlreadyExists {
                name: spec.name.clone(),
                namespace: self.namespace.clone(),
            }),
            Err(e) => Err(self.api_error(format!("create run {}", spec.name), e)),
        }
    }

    /// The function Run `name`: [`Error::NotFound`] when there is none,
    /// [`Error::NotAFunction`] when it is a task or a session.
    pub async fn get(&self, name: &str) -> Result<Run, Error> {
        let run = self
            .api
            .get_opt(name)
            .await
            .map_err(|e| self.api_error(format!("get run {name}"), e))?
            .ok_or_else(|| Error::NotFound {
                name: name.to_string(),
                namespace: self.namespace.clone(),
            })?;
        if !is_function(&run) {
            return Err(Error::NotAFunction {
                name: name.to_string(),
                namespace: self.namespace.clone(),
                mode: run.spec.mode.kind().map_or("invalid", |k| k.as_str()),
            });
        }
        Ok(run)
    }

    /// Every function Run of the namespace (tasks and sessions left out), in the API
    /// server's order, read page by page.
    pub async fn list(&self) -> Result<Vec<Run>, Error> {
        let mut functions = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default().limit(500);
            if let Some(t) = token.take() {
                params = params.continue_token(&t);
            }
            let page = self
                .api
                .list(&params)
                .await
                .map_err(|e| self.api_error("list runs".to_string(), e))?;
            functions.extend(page.items.into_iter().filter(is_function));
            match page.metadata.continue_ {
                Some(t) if !t.is_empty() => token = Some(t),
                _ => return Ok(functions),
            }
        }
    }

    /// Waits until the function Run `name` is Ready and returns it.
    ///
    /// Watches the Run; returns as soon as it is Ready. Errors: [`Error::NotFound`] when
    /// there is no such Run at the start, [`Error::Ended`] when it reaches a terminal phase
    /// instead (with its reason and message), [`Error::Deleted`], [`Error::WaitTimedOut`]
    /// after `limit` (the Run goes on), [`Error::Watch`] when the watch fails.
    pub async fn wait_ready(&self, name: &str, limit: Duration) -> Result<Run, Error> {
        self.wait_ready_with(name, limit, |_| {}).await
    }

    /// [`Functions::wait_ready`], calling `on_update` with every state of the Run seen
    /// while waiting (for progress displays).
    pub async fn wait_ready_with(
        &self,
        name: &str,
        limit: Duration,
        on_update: impl Fn(&Run) + Send + Sync,
    ) -> Result<Run, Error> {
        // Fail at once for a Run that does not exist: the watch would wait for it.
        let first = self.get(name).await?;
        let waited = wait::until_phase(
            &self.api,
            name,
            None,
            first.phase(),
            limit,
            on_update,
            wait::ready_or_ended,
        )
        .await;
        let run = match waited {
            Ok(run) => run,
            Err(WaitError::TimedOut { phase, why }) => {
                return Err(Error::WaitTimedOut {
                    name: name.to_string(),
                    limit,
                    phase,
                    why,
                });
            }
            Err(WaitError::Watch(source)) => {
                return Err(Error::Watch {
                    name: name.to_string(),
                    source,
                });
            }
            Err(WaitError::Deleted) => {
                return Err(Error::Deleted {
                    name: name.to_string(),
                });
            }
        };
        let phase = run.phase();
        match phase {
            Phase::Ready => Ok(run),
            Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled
            | Phase::Pending
            | Phase::Scheduled
            | Phase::Running
            | Phase::Finalizing
            | Phase::Suspended => {
                let status = run.status.as_ref();
                Err(Error::Ended {
                    name: name.to_string(),
                    phase,
                    reason: status.and_then(|s| s.reason.clone()),
                    message: status.and_then(|s| s.message.clone()),
                    run: Box::new(run),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_becomes_a_function_run() {
        let mut spec = FunctionSpec::new(
            "greeter",
            "python",
            "main:handle",
            "def handle(e):\n    return e\n",
        );
        spec.idle_timeout = Some(Duration::from_millis(1500));
        spec.timeout = Some(Duration::from_secs(600));
        spec.env = vec![EnvVar {
            name: "A".into(),
            value: "1".into(),
        }];
        spec.max_attempts = Some(3);
        let run = spec.to_run().expect("valid");
        assert_eq!(run.metadata.name.as_deref(), Some("greeter"));
        let function = run.spec.mode.function.as_ref().expect("function mode");
        assert_eq!(function.handler, "main:handle");
        assert_eq!(function.idle_timeout_seconds, Some(2));
        assert!(run.spec.mode.task.is_none());
        assert_eq!(run.spec.runtime, "python");
        assert_eq!(run.spec.timeout.as_deref(), Some("10m"));
        assert_eq!(
            run.spec.source.as_ref().and_then(|s| s.inline.as_deref()),
            Some("def handle(e):\n    return e\n")
        );
        assert_eq!(run.spec.env.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            run.spec.retry_policy.as_ref().map(|r| r.max_attempts),
            Some(3)
        );
        let value = serde_json::to_value(&run).expect("json");
        assert_eq!(value["kind"], "Run");
        assert_eq!(
            value["spec"]["mode"],
            serde_json::json!({"function": {"handler": "main:handle", "idleTimeoutSeconds": 2}})
        );
    }

    #[test]
    fn admission_mistakes_are_caught_before_sending() {
        let big = "x".repeat(kruntimes_api::run::MAX_INLINE_SOURCE_BYTES + 1);
        let e = FunctionSpec::new("f", "python", "main:handle", big)
            .to_run()
            .expect_err("too big");
        assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
        assert!(e.to_string().contains("spec.source.inline"), "{e}");
        let e = FunctionSpec::new("f", "python", "", "x")
            .to_run()
            .expect_err("no handler");
        assert!(e.to_string().contains("spec.mode.function.handler"), "{e}");
        let mut spec = FunctionSpec::new("f", "python", "main:handle", "x");
        spec.idle_timeout = Some(Duration::ZERO);
        assert!(spec.to_run().is_err());
        spec.idle_timeout = None;
        spec.max_attempts = Some(0);
        assert!(spec.to_run().is_err());
        assert!(
            FunctionSpec::new("", "python", "main:handle", "x")
                .to_run()
                .is_err()
        );
    }

    #[test]
    fn durations_format_in_their_largest_exact_unit() {
        for (d, text) in [
            (Duration::from_secs(7200), "2h"),
            (Duration::from_secs(5400), "90m"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_micros(1), "1ms"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(format_duration(d), text);
            assert_eq!(
                kruntimes_api::duration::parse(text).expect("parses"),
                d.max(Duration::from_millis(u64::from(!d.is_zero()))),
            );
        }
    }

    #[test]
    fn an_ended_function_says_why() {
        let run = Run::new("f", RunSpec::task("python", "x"));
        let e = Error::Ended {
            name: "f".into(),
            phase: Phase::Failed,
            reason: Some("RegistrationFailed".into()),
            message: Some("import failed:\nNameError".into()),
            run: Box::new(run),
        };
        assert_eq!(
            e.to_string(),
            "function f ended Failed before it was ready: RegistrationFailed: import failed: NameError"
        );
    }
}
