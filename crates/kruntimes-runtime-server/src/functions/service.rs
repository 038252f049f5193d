//! The gRPC `FunctionRuntime` service over the function table.
//!
//! Owns the translation between protobuf messages and [`crate::functions`] types, and the
//! one place where function errors become gRPC status codes: a caller's mistake is echoed
//! with a precise message, an internal failure is logged with its whole chain and answered
//! with a generic INTERNAL. It holds no registration state of its own.
#![forbid(unsafe_code)]

use std::sync::Arc;

use kruntimes_proto::runtime::v1 as pb;
use pb::function_runtime_server::FunctionRuntime;
use prost::Message;
use tonic::{Request, Response, Status};

use crate::functions::{
    FunctionError, FunctionSnapshot, FunctionState, Functions, Invocation, InvokeSpec, Outcome,
    RegisterSpec, UnregisterTarget,
};
use crate::tasks::executor;
use crate::tasks::service::{
    duration, env_pairs, execution_id, internal, key, log_tail, source_files,
};

/// Implements `FunctionRuntime` over one function table.
#[derive(Clone)]
pub struct FunctionService {
    functions: Arc<Functions>,
}

impl FunctionService {
    pub fn new(functions: Arc<Functions>) -> Self {
        Self { functions }
    }
}

impl From<FunctionError> for Status {
    fn from(e: FunctionError) -> Self {
        match &e {
            FunctionError::Request(_) => Status::invalid_argument(e.to_string()),
            FunctionError::Conflict { .. } => Status::already_exists(e.to_string()),
            FunctionError::NotFound { .. } => Status::not_found(e.to_string()),
            FunctionError::Busy { .. } => Status::resource_exhausted(e.to_string()),
            FunctionError::StaleAttempt { .. }
            | FunctionError::Failed { .. }
            | FunctionError::Unregistering { .. }
            | FunctionError::LoadFailed { .. }
            | FunctionError::Cancelled { .. } => Status::failed_precondition(e.to_string()),
            FunctionError::ShuttingDown => Status::unavailable(e.to_string()),
            FunctionError::Workspace { .. }
            | FunctionError::Cgroup { .. }
            | FunctionError::Sandbox { .. }
            | FunctionError::Spawn { .. }
            | FunctionError::Io { .. }
            | FunctionError::Remove { .. }
            | FunctionError::Task(_) => internal(&e, "internal error"),
        }
    }
}

fn status(s: FunctionSnapshot) -> pb::FunctionStatusResponse {
    let mut response = pb::FunctionStatusResponse {
        registration_id: s.registration_id,
        id: Some(execution_id(&s.key)),
        state: 0,
        reason: s.reason.to_owned(),
        message: s.message,
        in_flight: s.in_flight,
        registered_at: Some(s.registered_at.into()),
        last_activity: Some(s.last_activity.into()),
        invocations: s.invocations,
    };
    response.set_state(match s.state {
        FunctionState::Ready => pb::FunctionState::Ready,
        FunctionState::Failed => pb::FunctionState::Failed,
    });
    response
}

fn invocation(i: Invocation) -> pb::InvokeFunctionResponse {
    let mut response = pb::InvokeFunctionResponse {
        outcome: 0,
        result: i.result,
        error: i.error.map(|e| pb::InvocationError {
            r#type: e.kind,
            message: e.message,
            traceback: e.traceback,
        }),
        stdout: Some(log_tail(i.stdout)),
        stderr: Some(log_tail(i.stderr)),
        duration: prost_types::Duration::try_from(i.duration).ok(),
    };
    response.set_outcome(match i.outcome {
        Outcome::Succeeded => pb::InvocationOutcome::Succeeded,
        Outcome::Failed => pb::InvocationOutcome::Failed,
        Outcome::TimedOut => pb::InvocationOutcome::TimedOut,
    });
    response
}

fn registration_id(id: &str) -> Result<&str, Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("registration_id is required"));
    }
    Ok(id)
}

#[tonic::async_trait]
impl FunctionRuntime for FunctionService {
    async fn register_function(
        &self,
        request: Request<pb::RegisterFunctionRequest>,
    ) -> Result<Response<pb::FunctionStatusResponse>, Status> {
        let mut request = request.into_inner();
        // The configuration is everything but how long loading may take: a repeat with
        // another load timeout is the same registration.
        let load_timeout = duration(request.load_timeout.take(), "load_timeout")?;
        // 0 means 1: both name the same configuration.
        if request.concurrency == 1 {
            request.concurrency = 0;
        }
        let digest = executor::digest(&request.encode_to_vec());
        let key = key(request.id)?;
        let adapter = self.functions.adapter();
        let spec = RegisterSpec::new(
            key,
            source_files(request.files),
            request.handler,
            env_pairs(request.env),
            load_timeout,
            request.concurrency,
            adapter,
            digest,
        )
        .map_err(FunctionError::from)?;
        let snapshot = self.functions.register(spec).await?;
        Ok(Response::new(status(snapshot)))
    }

    async fn function_status(
        &self,
        request: Request<pb::FunctionStatusRequest>,
    ) -> Result<Response<pb::FunctionStatusResponse>, Status> {
        let request = request.into_inner();
        let snapshot = self
            .functions
            .status(registration_id(&request.registration_id)?)?;
        Ok(Response::new(status(snapshot)))
    }

    async fn invoke_function(
        &self,
        request: Request<pb::InvokeFunctionRequest>,
    ) -> Result<Response<pb::InvokeFunctionResponse>, Status> {
        let request = request.into_inner();
        let id = registration_id(&request.registration_id)?;
        let spec = InvokeSpec::new(
            request.invocation_id,
            request.payload,
            duration(request.timeout, "timeout")?,
        )
        .map_err(FunctionError::from)?;
        let result = self.functions.invoke(id, spec).await?;
        Ok(Response::new(invocation(result)))
    }

    async fn unregister_function(
        &self,
        request: Request<pb::UnregisterFunctionRequest>,
    ) -> Result<Response<pb::UnregisterFunctionResponse>, Status> {
        let request = request.into_inner();
        let target = if !request.registration_id.is_empty() {
            UnregisterTarget::Id(request.registration_id)
        } else if request.id.is_some() {
            UnregisterTarget::UpTo(key(request.id)?)
        } else {
            return Err(Status::invalid_argument(
                "either registration_id or id is required",
            ));
        };
        let existed = self.functions.unregister(target).await?;
        Ok(Response::new(pb::UnregisterFunctionResponse { existed }))
    }

    async fn list_functions(
        &self,
        _request: Request<pb::ListFunctionsRequest>,
    ) -> Result<Response<pb::ListFunctionsResponse>, Status> {
        let functions = self.functions.list().into_iter().map(status).collect();
        Ok(Response::new(pb::ListFunctionsResponse { functions }))
    }
}
