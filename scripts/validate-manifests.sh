#!/usr/bin/env bash
# Validates the Kustomize install (deploy/) as a cluster's API server would: renders it with
# the real `kubectl kustomize` and checks every object with `kubernetes-validate --strict`
# (its bundled schemas; unknown fields are errors) for each Kubernetes version the install
# supports. The objects of kinds no schema covers (cert-manager's) must all be
# cert-manager.io kinds; anything else without a schema fails.
#
# Makes a virtualenv with Debian's python3 under the target dir (skipped when already
# made for the same pinned version).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
target=${CARGO_TARGET_DIR:-$PWD/target}
venv=$target/manifests-venv
python=/usr/bin/python3
validator_version=1.37.0
versions=(1.31.0 1.32.0 1.33.0)

if [[ ! -x $python ]] || ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    echo "validate-manifests.sh: installing python3 and python3-venv" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3 python3-venv >/dev/null
fi
if [[ ! -x $venv/bin/kubernetes-validate ]] \
    || [[ $(cat "$venv/.version" 2>/dev/null) != "$validator_version" ]]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "kubernetes-validate==$validator_version"
    echo "$validator_version" >"$venv/.version"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
for part in "" workers cert-manager; do
    name=deploy/$part
    rendered=$work/${part:-install}.yaml
    /usr/bin/kubectl kustomize "$name" >"$rendered"
    for version in "${versions[@]}"; do
        out=$("$venv/bin/kubernetes-validate" --strict --quiet -k "$version" "$rendered" 2>&1) \
            && status=0 || status=$?
        # Lines about kinds without a schema: only cert-manager's may have none.
        unexpected=$(grep -v "^WARN .*Couldn't find schema for kind [A-Za-z]* with api version cert-manager.io/v1 " <<<"$out" || true)
        if (( status != 0 )) || [[ -n $unexpected ]]; then
            echo "FAIL $name against Kubernetes $version:" >&2
            echo "$out" >&2
            failed=1
        else
            echo "ok $name against Kubernetes $version ($(grep -c '^kind:' "$rendered") objects)"
        fi
    done
done
exit $failed
