# The images of a cluster install (docs/cluster.md):
#
#   docker build --target control-plane -t kruntimes/control-plane:0.1.0 .
#   docker build --target runtime -t kruntimes/runtime:0.1.0 .
#
# `control-plane` runs every component command (`kruntimes controller-manager`, `gateway`,
# `apiserver`, `runtimed`) as a non-root user. `runtime` is the image of a Runtime's
# `runtime` container: the runtime server with bash and Python, for the default sandbox
# (namespaces, seccomp, Landlock, cgroup limits) and gVisor's runsc where the node has it.
# No docker daemon runs on the machines that test this project, so these builds are not
# run by its CI; the binaries they copy are the ones the tests build.

FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kruntimes -p kruntimes-runtime-server -p krt \
    && install -D -m 0755 target/release/kruntimes /out/kruntimes \
    && install -D -m 0755 target/release/kruntimes-runtime-server /out/kruntimes-runtime-server \
    && install -D -m 0755 target/release/krt /out/krt

FROM debian:bookworm-slim AS control-plane
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# `kruntimes runtime-server` execs the runtime server installed next to `kruntimes`.
COPY --from=build /out/kruntimes /out/kruntimes-runtime-server /out/krt /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kruntimes"]

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends bash python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/kruntimes-runtime-server /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/kruntimes-runtime-server"]
