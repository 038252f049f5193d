"""The invoke path (``kruntimes.aio._http1``): kept-alive connections, the time limit, an
endpoint nobody listens on, and credentials that rotate, against the real gateway."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

import kruntimes
from kruntimes.aio import AsyncClient, AsyncFunction, from_kube_config
from kruntimes.kubernetes import from_kube_config as sync_from_kube_config

from .conftest import Server

HANDLER = """
import time

def handle(event):
    time.sleep(event.get("sleep", 0))
    return event
"""


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


@pytest.mark.asyncio
async def test_warm_invokes_share_one_kept_alive_connection(aclient: AsyncClient) -> None:
    fn = await aclient.runtime("default", "python").create_function("keepalive", source=HANDLER)
    try:
        pool = fn._connection.invoker(fn._endpoint.origin, fn._endpoint.ca_bundle)
        assert await fn.invoke({"n": 0}) == {"n": 0}
        assert len(pool._idle) == 1
        first = pool._idle[0]
        for i in range(1, 30):
            assert await fn.invoke({"n": i, "pad": "x" * i * 100}) == {"n": i, "pad": "x" * i * 100}
        assert pool._idle == [first], "every call after the first reused the first connection"
        # A handler error is an answer too: the connection stays.
        with pytest.raises(kruntimes.InvocationError) as failed:
            await fn.invoke({"sleep": "not a number"})
        assert failed.value.error_type == "TypeError"
        assert pool._idle == [first]
        assert (await fn.call({"n": -1}, invocation_id="kept")).invocation_id == "kept"
        assert pool._idle == [first]
    finally:
        await fn.delete()


@pytest.mark.asyncio
async def test_an_invoke_past_its_time_is_outcome_unknown_and_drops_the_connection(aclient: AsyncClient) -> None:
    fn = await aclient.runtime("default", "python").create_function("slow", source=HANDLER)
    try:
        pool = fn._connection.invoker(fn._endpoint.origin, fn._endpoint.ca_bundle)
        assert await fn.invoke({}) == {}
        assert len(pool._idle) == 1
        with pytest.raises(kruntimes.OutcomeUnknown) as unknown:
            await fn.invoke({"sleep": 5}, invocation_id="late-1", timeout=0.5)
        assert unknown.value.operation_id == "late-1"
        assert "may or may not" in str(unknown.value)
        assert pool._idle == [], "a connection with an answer still to come is never reused"
    finally:
        await fn.delete()


@pytest.mark.asyncio
async def test_an_endpoint_nobody_listens_on_is_unavailable_and_nothing_was_sent(aclient: AsyncClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = {
        "metadata": {"name": "nobody", "namespace": "default", "uid": "u"},
        "spec": {"mode": {"function": {"handler": "main:handle"}}},
        "status": {
            "phase": "Ready",
            "endpoint": {"protocol": "HTTPS", "url": f"https://127.0.0.1:{port}/v1/namespaces/default/functions/x"},
        },
    }
    fn = AsyncFunction(aclient.connection, run)
    with pytest.raises(kruntimes.Unavailable, match="nothing was sent"):
        await fn.invoke({})
    # No partial state left: the next call fails the same way, promptly.
    with pytest.raises(kruntimes.Unavailable):
        await asyncio.wait_for(fn.invoke({}), 30)


def test_a_rotated_token_file_is_read_again_after_a_401(server: Server, tmp_path: Path) -> None:
    config = yaml.safe_load(server.kubeconfig.read_text())
    good = config["users"][0]["user"]["token"]
    token = tmp_path / "token"
    token.write_text(good)
    config["users"][0]["user"] = {"tokenFile": str(token)}
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    with sync_from_kube_config(server.kubeconfig) as admin:
        fn = admin.runtime("default", "python").create_function("rotated", source=HANDLER)
        try:
            with sync_from_kube_config(kubeconfig) as client:
                other = client.function("default", "rotated")  # the API client has read the good token
                token.write_text("not-a-token")
                with pytest.raises(kruntimes.Unauthorized) as refused:
                    other.invoke({"n": 1})
                assert refused.value.status == 401
                token.write_text(good)
                # The invoke path still holds the bad token: the 401 makes it read the file again.
                assert other.invoke({"n": 2}) == {"n": 2}
                assert other.invoke({"n": 3}) == {"n": 3}
        finally:
            fn.delete()


def test_a_session_reads_a_rotated_token_file_again_after_a_401(server: Server, tmp_path: Path) -> None:
    config = yaml.safe_load(server.kubeconfig.read_text())
    good = config["users"][0]["user"]["token"]
    token = tmp_path / "token"
    token.write_text(good)
    config["users"][0]["user"] = {"tokenFile": str(token)}
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    with sync_from_kube_config(server.kubeconfig) as admin:
        sb = admin.runtime("default", "bash").acquire_sandbox(generate_name="rotated-")
        try:
            with sync_from_kube_config(kubeconfig) as client:
                other = client.open("default", sb.name)  # the API client has read the good token
                token.write_text("not-a-token")
                with pytest.raises(kruntimes.Unauthorized):
                    other.open_session()
                token.write_text(good)
                with other.open_session() as session:
                    assert session.exec(["echo", "again"]).stdout == b"again\n"
        finally:
            sb.release("immediate")


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (b"", "broke after the request was sent"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", "broke after the request was sent"),
        (b"not http at all\r\n\r\n", "not HTTP/1.1"),
    ],
)
async def test_a_peer_that_breaks_off_after_the_request_is_outcome_unknown(
    aclient: AsyncClient, tmp_path: Path, answer: bytes, expected: str
) -> None:
    """A TLS peer on 127.0.0.1 that reads the request, writes ``answer`` and hangs up: what
    the gateway's side of a broken invoke looks like to the client."""
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    run = {
        "metadata": {"name": "peer", "namespace": "default", "uid": "u"},
        "spec": {"mode": {"function": {"handler": "main:handle"}}},
        "status": {
            "phase": "Ready",
            "endpoint": {
                "protocol": "HTTPS",
                "url": f"https://127.0.0.1:{port}/v1/namespaces/default/functions/peer",
                "caBundle": base64.b64encode(cert.read_bytes()).decode(),
            },
        },
    }
    try:
        fn = AsyncFunction(aclient.connection, run)
        with pytest.raises(kruntimes.OutcomeUnknown, match=expected) as unknown:
            await fn.invoke({"n": 1}, invocation_id="inv-9", timeout=30)
        assert unknown.value.operation_id == "inv-9"
        assert len(requests) == 1 and requests[0].startswith(b"POST /v1/namespaces/default/functions/peer HTTP/1.1")
        assert fn._connection.invoker(fn._endpoint.origin, fn._endpoint.ca_bundle)._idle == []
    finally:
        server.close()
        await server.wait_closed()
