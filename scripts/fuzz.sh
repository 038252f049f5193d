#!/usr/bin/env bash
# Builds every cargo-fuzz target in fuzz/ and runs each for SECONDS (default 20) on its
# corpus in fuzz/corpus/<target>. Fails on the first crash, timeout, leak or OOM, and
# leaves the input that caused it in fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# KRUNTIMES_FUZZ_PROFILE=dev builds the targets unoptimised: in about 4 minutes instead
# of 10 on two cores, for about a tenth of the inputs a second (json_patch 27k in 5 s
# instead of 386k). CI's short runs take it (scripts/test.sh): there the run replays the
# corpus and explores for a few seconds. The default, `release`, is for long runs.
#
# cargo-fuzz needs nightly rustc flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain take
# them. Targets are built optimised with debug assertions and without a sanitizer (the
# project forbids unsafe code; the sanitizer would double the build and the run time), in
# fuzz/target, which is kept out of the main workspace's target directory.
#
# New inputs the fuzzer finds go to a scratch directory, never into the corpus kept in
# the repository: CI runs stay reproducible. Add a finding to the corpus by hand, with
# the regression test that pins it (docs/security.md, "Fuzzing").
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${1:-20}
shift || true

export CARGO_INCREMENTAL=0
export RUSTC_BOOTSTRAP=1
# Its own target directory, whatever CARGO_TARGET_DIR the rest of the build uses.
export CARGO_TARGET_DIR="$PWD/fuzz/target"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --version 0.13.2
fi

cd fuzz
if (( $# > 0 )); then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

case ${KRUNTIMES_FUZZ_PROFILE:-release} in
    release) build_flags=(--release --debug-assertions --sanitizer none) ;;
    dev) build_flags=(--dev --sanitizer none) ;;
    *)
        echo "fuzz.sh: KRUNTIMES_FUZZ_PROFILE must be release or dev" >&2
        exit 2
        ;;
esac
start=$SECONDS
cargo fuzz build "${build_flags[@]}"
echo "fuzz.sh: built every target in $((SECONDS - start)) s"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

failed=()
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "artifacts/$target" "$scratch/$target"
    echo "fuzz.sh: $target for ${seconds} s"
    # -timeout: one input may take at most 2 s; -rss_limit_mb: the whole process 2 GiB;
    # -max_len: 64 KiB covers every bounded input (the API server's bodies are longer,
    # but the parsers' costs show at this size already).
    if ! cargo fuzz run "${build_flags[@]}" "$target" "$scratch/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=2 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="artifacts/$target/" \
        >"$scratch/$target.log" 2>&1; then
        tail -n 40 "$scratch/$target.log" >&2
        failed+=("$target")
    else
        grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$scratch/$target.log" | tr '\n' ' '
        echo
    fi
done

if (( ${#failed[@]} > 0 )); then
    echo "fuzz.sh: findings in ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: ${#targets[@]} targets ran ${seconds} s each without a finding"
