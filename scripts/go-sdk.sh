#!/usr/bin/env bash
# The Go SDK's checks (sdk/go): gofmt, go vet and its tests, which start the real
# `kruntimes up` built in the cargo target dir (build it first: `cargo build --workspace
# --bins`). The module uses the standard library only, so Debian's Go 1.19 builds it with
# no module proxy; golang-go is installed when `go` is missing. Extra arguments go to
# `go test`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
if ! command -v go >/dev/null; then
    echo "go-sdk.sh: installing golang-go" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq golang-go >/dev/null
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# Nothing is downloaded: the module has no dependencies.
export GOPROXY=off GOFLAGS=-mod=mod
# Its build cache under the target dir (CI may run with no $HOME).
export GOCACHE=${GOCACHE:-$CARGO_TARGET_DIR/go-cache} GOPATH=${GOPATH:-$CARGO_TARGET_DIR/go-path}
cd sdk/go
unformatted=$(gofmt -l .)
if [[ -n $unformatted ]]; then
    echo "go-sdk.sh: not gofmt-formatted: $unformatted" >&2
    exit 1
fi
go vet ./...
# -v: one "--- PASS" / "--- FAIL" line a test, which scripts/test.sh counts.
go test -count=1 -v "$@" ./...
