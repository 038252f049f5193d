//! The Rust SDK of kruntimes, used by `krt` and by tests (ARCHITECTURE.md, "Crates and
//! folders": `kruntimes-client`). For now it covers function mode.
//!
//! It owns the client side of the contracts: finding the kubeconfig ([`Connection`]),
//! creating, waiting for and listing function Runs through the API server
//! ([`Functions`]), and invoking a Ready function over HTTPS at its published endpoint
//! ([`Functions::invoke`]). It never implements authentication (every request carries the
//! kubeconfig's credentials through kube-rs) and never retries an invocation.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use kruntimes_client::{Connection, FunctionSpec, Outcome};
//!
//! let connection = Connection::from_kubeconfig(None).await?;
//! let functions = connection.functions();
//! let spec = FunctionSpec::new(
//!     "greeter",
//!     "python",
//!     "main:handle",
//!     "def handle(event):\n    return {'hello': event['name']}\n",
//! );
//! functions.create(&spec).await?;
//! let run = functions.wait_ready("greeter", Duration::from_secs(60)).await?;
//! let answer = functions
//!     .invoke(&run, &serde_json::json!({"name": "world"}), None)
//!     .await?;
//! assert_eq!(answer.outcome, Outcome::Succeeded);
//! println!("{}", answer.result);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod connect;
mod endpoint;
pub mod function;
pub mod invoke;
pub mod machines;
pub mod sandbox;
pub mod session;
mod wait;

pub use connect::{ConnectError, Connection};
pub use endpoint::{MAX_SERVER_MESSAGE_BYTES, pem_certificates};
pub use function::{Error, FunctionSpec, Functions};
pub use invoke::{HandlerError, Invocation, InvocationRun, InvokeError, Outcome};
