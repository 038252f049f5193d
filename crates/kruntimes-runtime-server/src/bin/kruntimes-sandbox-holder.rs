//! `kruntimes-sandbox-holder`: a `namespaces` sandbox's holder (see
//! `kruntimes_runtime_server::isolation::holder`). A binary of its own, small and quick to
//! start (a third of the runtime server's start-up), because every sandbox starts one.
//! The runtime server starts it; it is not meant to be run by hand.
#![forbid(unsafe_code)]

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let args = match args.first() {
        Some(first) if kruntimes_runtime_server::isolation::holder::is_holder(Some(first)) => {
            &args[1..]
        }
        _ => &args[..],
    };
    kruntimes_runtime_server::isolation::holder::main(args);
}
