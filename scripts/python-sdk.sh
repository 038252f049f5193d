#!/usr/bin/env bash
# The Python SDK's checks (sdk/python): ruff, mypy --strict and its pytest suite, which
# starts the real `kruntimes up` built in the cargo target dir (build it first:
# `cargo build --workspace --bins`).
#
# Makes a virtualenv with Debian's python3 (installing python3-venv when it is missing)
# under the target dir, and installs the SDK with its test extras into it; both steps are
# skipped when already done for the same pyproject.toml. Extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
target=${CARGO_TARGET_DIR:-$root/target}
venv=${KRUNTIMES_PY_VENV:-$target/python-sdk-venv}
python=/usr/bin/python3

if [[ ! -x $python ]] || ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    echo "python-sdk.sh: installing python3 and python3-venv" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3 python3-venv >/dev/null
fi
if [[ ! -x $venv/bin/python ]]; then
    "$python" -m venv "$venv"
fi
stamp=$venv/.kruntimes-sdk-installed
want=$(sha256sum sdk/python/pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e "sdk/python[test]"
    echo "$want" >"$stamp"
fi

cd sdk/python
"$venv/bin/ruff" format --check src tests examples ../../bench/python
"$venv/bin/ruff" check src tests examples ../../bench/python
"$venv/bin/mypy" --strict
export CARGO_TARGET_DIR=$target
"$venv/bin/pytest" -q -p no:cacheprovider "$@"
