//! `kruntimes-sandbox-holder`: the sandboxes' helper binary. A `namespaces` sandbox's
//! holder (see `kruntimes_runtime_server::sandbox::isolation::holder`), and the `gvisor` backend's
//! init, launcher and host-side exec (see `kruntimes_runtime_server::sandbox::isolation::gvisor`).
//! A binary of its own, small and quick to start (a third of the runtime server's
//! start-up), because every sandbox and every sandboxed program starts it. The runtime
//! server starts it; it is not meant to be run by hand.
#![forbid(unsafe_code)]

use kruntimes_runtime_server::sandbox::isolation::{gvisor, holder};

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(mode) = gvisor::mode(args.first().map(|a| a.as_os_str())) {
        mode(&args[1..]);
    }
    let args = match args.first() {
        Some(first) if holder::is_holder(Some(first)) => &args[1..],
        _ => &args[..],
    };
    holder::main(args);
}
