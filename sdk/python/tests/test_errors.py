"""The error mapping: statuses to exceptions, checks before sending, and the answers of the
real system for bad credentials and missing rights."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

import kruntimes
from kruntimes import AcquireOptions, Command, Operation
from kruntimes.aio._client import Endpoint
from kruntimes.errors import from_status
from kruntimes.kubernetes import from_kube_config

from .conftest import Server


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, kruntimes.InvalidRequest),
        (401, kruntimes.Unauthorized),
        (403, kruntimes.Forbidden),
        (404, kruntimes.NotFound),
        (409, kruntimes.Conflict),
        (413, kruntimes.InvalidRequest),
        (429, kruntimes.TooManyRequests),
        (502, kruntimes.OutcomeUnknown),
        (503, kruntimes.Unavailable),
        (504, kruntimes.OutcomeUnknown),
        (500, kruntimes.KruntimesError),
    ],
)
def test_statuses_map_to_exceptions(status: int, kind: type[kruntimes.KruntimesError]) -> None:
    error = from_status(status, "Reason", "a\nmessage " + "x" * 5000, retry_after=2.0)
    assert type(error) is kind and isinstance(error, kruntimes.KruntimesError)
    assert error.status == status and "\n" not in error.message and len(error.message) <= 1024
    if isinstance(error, kruntimes.TooManyRequests):
        assert error.retry_after == 2.0


def test_the_hierarchy_is_one_tree() -> None:
    for kind in (
        kruntimes.NotFound,
        kruntimes.Forbidden,
        kruntimes.Conflict,
        kruntimes.TooManyRequests,
        kruntimes.SandboxStateError,
        kruntimes.OperationTimeout,
        kruntimes.InvocationError,
        kruntimes.OutcomeUnknown,
    ):
        assert issubclass(kind, kruntimes.KruntimesError)
    error = kruntimes.SandboxStateError("ended", name="sb", phase="Timeout", run_reason="LeaseExpired")
    assert (error.phase, error.run_reason) == ("Timeout", "LeaseExpired")


def test_bad_options_are_refused_before_sending() -> None:
    for bad in (
        AcquireOptions(lease_timeout_seconds=0),
        AcquireOptions(queue_size=0),
        AcquireOptions(env={"A-B": "x"}),
        AcquireOptions(operation_timeout=-1),
    ):
        with pytest.raises(kruntimes.InvalidRequest):
            bad.to_run("bash")
    run = AcquireOptions(lease_timeout_seconds=1.5, operation_timeout=60, queue_size=4).to_run("bash")
    assert run["spec"]["mode"] == {"session": {"leaseTimeoutSeconds": 2, "queueSize": 4, "operationTimeout": "1m"}}
    assert run["metadata"]["generateName"] == "bash-sandbox-"
    for op in (
        Operation(),
        Operation(command=Command()),
        Operation(command=Command(argv=["a"], shell="b")),
        Operation(command=Command(argv=[])),
        Operation(command=Command(argv=["a"]), operation_id="has space"),
        Operation(command=Command(argv=["a"], stdin=b"x" * (1024 * 1024 + 1))),
    ):
        with pytest.raises(kruntimes.InvalidRequest):
            op.to_wire()
    wire = Operation(command=Command(argv=["cat"], stdin=b"hi", cwd="d", env={"K": "v"}, timeout=2.5)).to_wire()
    assert wire == {
        "command": {"argv": ["cat"], "cwd": "d", "env": {"K": "v"}, "stdin": "aGk="},
        "timeoutSeconds": 3,
    }


def test_the_ca_bundle_is_base64_of_pem() -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    url = "https://127.0.0.1:1/v1/namespaces/default/runtimes/bash/sessions/u"

    def run(endpoint: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"name": "r"}, "status": {"endpoint": endpoint}}

    endpoint = Endpoint(run({"protocol": "HTTPS", "url": url, "caBundle": base64.b64encode(pem).decode()}))
    assert endpoint.ca_bundle == pem and endpoint.origin == "https://127.0.0.1:1"
    with pytest.raises(kruntimes.KruntimesError, match="base64"):
        Endpoint(run({"protocol": "HTTPS", "url": url, "caBundle": "not base64!"}))
    with pytest.raises(kruntimes.KruntimesError, match="HTTPS"):
        Endpoint(run({"protocol": "HTTP", "url": url.replace("https", "http")}))
    with pytest.raises(kruntimes.KruntimesError, match="exceeds"):
        Endpoint(run({"protocol": "HTTPS", "url": url, "caBundle": base64.b64encode(b"x" * 17000).decode()}))


def _kubeconfig_with_token(server: Server, token: str, path: Path) -> Path:
    config = yaml.safe_load(server.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_bad_token_is_unauthorized(server: Server, tmp_path: Path) -> None:
    with from_kube_config(_kubeconfig_with_token(server, "not-a-token", tmp_path / "kc")) as client:
        with pytest.raises(kruntimes.Unauthorized) as error:
            client.runtime("bash").acquire_sandbox()
        assert error.value.status == 401


def test_missing_rights_are_forbidden(server: Server, tmp_path: Path, sandbox: kruntimes.Sandbox) -> None:
    server.kubectl("create", "serviceaccount", "nobody")
    token = server.kubectl("create", "token", "nobody").strip()
    with from_kube_config(_kubeconfig_with_token(server, token, tmp_path / "kc")) as client:
        with pytest.raises(kruntimes.Forbidden) as error:
            client.open("default", sandbox.name)
        assert error.value.status == 403
        with pytest.raises(kruntimes.Forbidden):
            client.runtime("bash").run(["true"])


def test_a_missing_kubeconfig_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(kruntimes.KruntimesError, match="kruntimes up"):
        from_kube_config(tmp_path / "none")


def test_a_wait_past_its_time_is_operation_timeout_and_the_work_goes_on(bash: kruntimes.Runtime) -> None:
    task = bash.run(["sleep", "60"])
    try:
        with pytest.raises(kruntimes.OperationTimeout, match="it goes on"):
            task.wait(timeout=0.5)
        assert task.phase() in ("Pending", "Scheduled", "Running")
    finally:
        task.cancel()
        assert task.wait(timeout=60).phase == "Cancelled"
        task.delete()


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("SessionSuspended", kruntimes.SessionSuspended),
        ("SessionSuspending", kruntimes.SessionSuspending),
        ("Draining", kruntimes.Conflict),
    ],
)
def test_a_409_maps_the_suspension_reasons_to_their_own_errors(reason: str, kind: type[kruntimes.Conflict]) -> None:
    err = from_status(409, reason, "refused")
    assert type(err) is kind
    assert isinstance(err, kruntimes.Conflict)
    assert err.status == 409 and err.reason == reason


def test_superseded_carries_both_generations() -> None:
    err = kruntimes.Superseded("overtaken", generation=3, current_generation=4)
    assert isinstance(err, kruntimes.Conflict)
    assert (err.generation, err.current_generation) == (3, 4)
    assert err.reason == "Superseded"
