//! Compiles `proto/` with protox (a protobuf compiler written in Rust), so building this
//! crate needs no `protoc` on the machine, then generates prost messages and tonic
//! clients and servers from the resulting descriptor set.

const PROTOS: &[&str] = &[
    "kruntimes/runtime/v1/runtime.proto",
    "kruntimes/runtimed/v1/runtimed.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
