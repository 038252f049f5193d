#!/usr/bin/env bash
# Installs gVisor's runsc for the `gvisor` sandbox backend (and its tests) when it is
# missing or too old. Debian bookworm's own build (20221219) runs only on the ptrace
# platform and breaks stat(1); bookworm-backports' (20240729) works with systrap, so on
# bookworm this adds the backports source and installs runsc from there. Needs root.
set -euo pipefail

runsc_date() {
    # "runsc version 0.0~20240729.0" -> 20240729 (0 when missing or unreadable).
    # The whole output is read first: `runsc --version | head -n1` can kill runsc with
    # SIGPIPE, which pipefail turns into a failure and a second line "0".
    local version
    version=$(runsc --version 2>/dev/null) || true
    local date
    date=$(grep -m1 -oE '[0-9]{8}' <<<"$version") || true
    echo "${date:-0}"
}

if (( $(runsc_date) >= 20240101 )); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-runsc.sh: runsc (2024 or later) is missing and installing it needs root" >&2
    exit 1
fi
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive
if [[ ${VERSION_CODENAME:-} == bookworm ]]; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" \
        > /etc/apt/sources.list.d/kruntimes-bookworm-backports.list
    apt-get update -qq
    apt-get install -y -qq -t bookworm-backports runsc >/dev/null
else
    apt-get update -qq
    apt-get install -y -qq runsc >/dev/null
fi
if (( $(runsc_date) < 20240101 )); then
    echo "install-runsc.sh: runsc is still missing or older than 2024: $(runsc --version 2>&1 | head -n1)" >&2
    exit 1
fi
echo "install-runsc.sh: $(runsc --version | head -n1)"
