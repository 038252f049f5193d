#!/usr/bin/env bash
# Runs the whole test suite: unit tests, and the end-to-end tests that start the real
# `kruntimes` binary and drive it with kube-rs and the real kubectl.
#
# Works on a fresh machine as root with no stdin. Honours CARGO_TARGET_DIR: the
# end-to-end tests find the binary next to their own executable.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x /usr/bin/kubectl ]]; then
    echo "test.sh: /usr/bin/kubectl is missing; the end-to-end tests drive the real kubectl" >&2
    exit 1
fi

# The gvisor sandbox's tests need gVisor's runsc (2024 or later).
./scripts/install-runsc.sh

# One build, never rebuilt in place: incremental state would double the target
# directory (about 6 GB of 13 GB on a fresh build), and a CI disk can be small.
export CARGO_INCREMENTAL=0

# How long each phase took, printed as it ends: CI has a time budget.
phase_start=$SECONDS
phase() {
    echo "test.sh: $1 took $((SECONDS - phase_start)) s"
    phase_start=$SECONDS
}

# The end-to-end tests start these binaries; build them before any test runs.
cargo build --workspace --bins
phase "the build"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
phase "cargo test --workspace"
# The same end-to-end task, function and session tests (and the runtime server's,
# runtimed's and krt's) again with every sandbox in gVisor: KRUNTIMES_SANDBOX reaches
# `kruntimes up` and the runtime servers the tests start, unless a test asks for a backend
# itself. The escape suite ran against both backends above; the 2,000-task burst pins its
# own backend (`process`), so a second pass would run the same test again. The whole
# workspace is selected, as above, so nothing is compiled again: a selection of packages
# unifies the dependencies' features differently and rebuilt them (4m40s of CI). The
# other crates' tests, which start no sandbox, cost about a minute more.
KRUNTIMES_SANDBOX=gvisor cargo test --no-fail-fast --workspace --tests -- --skip escape_ \
    --skip a_burst_of_two_thousand_tasks 2>&1 | tee -a "$log"
gvisor_status=${PIPESTATUS[0]}
phase "the gVisor pass"
# The Python SDK (sdk/python): ruff, mypy --strict and its pytest suite against the real
# `kruntimes up` built above (scripts/python-sdk.sh makes its virtualenv).
./scripts/python-sdk.sh 2>&1 | tee -a "$log"
python_status=${PIPESTATUS[0]}
phase "the Python SDK"
# The Go SDK (sdk/go, the machines view): gofmt, go vet and its tests against the real
# `kruntimes up` built above (scripts/go-sdk.sh installs golang-go when it is missing).
./scripts/go-sdk.sh 2>&1 | tee -a "$log"
go_status=${PIPESTATUS[0]}
phase "the Go SDK"
# The Kustomize install (deploy/), rendered by kubectl and validated against the Kubernetes
# schemas of every supported version (scripts/validate-manifests.sh makes its virtualenv).
./scripts/validate-manifests.sh 2>&1 | tee -a "$log"
manifests_status=${PIPESTATUS[0]}
phase "the manifests"
# Every fuzz target, built unoptimised (four minutes of build instead of ten) and run
# briefly on its corpus (fuzz/corpus; scripts/fuzz.sh). A longer local run is
# `scripts/fuzz.sh 300`, optimised.
KRUNTIMES_FUZZ_PROFILE=${KRUNTIMES_FUZZ_PROFILE:-dev} ./scripts/fuzz.sh "${KRUNTIMES_FUZZ_SECONDS:-5}" 2>&1 |
    tee -a "$log"
fuzz_status=${PIPESTATUS[0]}
phase "fuzzing"
set -e
if (( status == 0 )); then
    status=$gvisor_status
fi
if (( status == 0 )); then
    status=$python_status
fi
if (( status == 0 )); then
    status=$go_status
fi
if (( status == 0 )); then
    status=$manifests_status
fi
if (( status == 0 )); then
    status=$fuzz_status
fi

# One closing line for the whole suite: cargo's last "test result" is the last crate's
# doc tests, often "0 passed", which says nothing about the run. pytest's summary line
# ("3 failed, 41 passed in 80.1s") adds the Python SDK's tests, and `go test -v`'s
# "--- PASS" / "--- FAIL" lines the Go SDK's.
awk '
    /^test result:/ { passed += $4; failed += $6; next }
    /^--- PASS: / { passed += 1; next }
    /^--- FAIL: / { failed += 1; next }
    /^(=+ )?[0-9]+ (passed|failed)/ && / in [0-9.]+s/ {
        for (i = 1; i < NF; i++) {
            if ($(i + 1) ~ /^passed/) passed += $i
            if ($(i + 1) ~ /^failed/) failed += $i
        }
    }
    END { printf "%d passed, %d failed\n", passed, failed }' "$log"
exit "$status"
