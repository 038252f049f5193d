"""The async client: the connection to the API server, the Runs it makes and the clients of
the endpoints they publish.

The kubeconfig is read by lightkube (bearer tokens, token files, client certificates, exec
plugins), and the same credentials go to the gateway: every gateway request and WebSocket
carries them, and TLS trusts only the Run's ``status.endpoint.caBundle`` (the kubeconfig
cluster's CA when the Run publishes none). Nothing is retried.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2
import yaml
from lightkube import ApiError, AsyncClient
from lightkube.config.client_adapter import user_auth, user_cert, verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType

from ..errors import (
    InvalidRequest,
    KruntimesError,
    NotFound,
    OperationTimeout,
    OutcomeUnknown,
    Unavailable,
    from_status,
    parse_retry_after,
)
from ._http1 import Http1Pool

#: The Run kind, as a lightkube generic resource.
Run = create_namespaced_resource("kruntimes.io", "v1alpha1", "Run", "runs")
#: The Snapshot kind (checkpoints), as a lightkube generic resource.
Snapshot = create_namespaced_resource("kruntimes.io", "v1alpha1", "Snapshot", "snapshots")

#: How long one HTTP call to the gateway may take, in seconds.
CALL_TIMEOUT = 60.0
#: The largest caBundle (PEM bytes, decoded).
MAX_CA_BUNDLE_BYTES = 16 * 1024
#: The most endpoint clients kept (one per gateway origin and CA bundle, in practice one).
MAX_ENDPOINT_CLIENTS = 16
#: The cluster extension of the kubeconfig `kruntimes up` writes that names the gateway.
GATEWAY_EXTENSION = "kruntimes.io/gateway"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Timeout", "Cancelled"})


def kubeconfig_path(path: str | os.PathLike[str] | None) -> Path:
    """The kubeconfig to read: ``path``, else the first existing entry of ``$KUBECONFIG``,
    else ``$KRUNTIMES_DATA_DIR/kubeconfig``, else ``.kruntimes/kubeconfig`` (where
    ``kruntimes up`` writes it), else ``~/.kube/config``."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("KUBECONFIG", "")
    entries = [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    for entry in entries:
        if entry.is_file():
            return entry
    if entries:
        return entries[0]
    data_dir = os.environ.get("KRUNTIMES_DATA_DIR")
    candidates = [Path(data_dir) / "kubeconfig"] if data_dir else []
    candidates += [Path(".kruntimes/kubeconfig"), Path("~/.kube/config").expanduser()]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return candidates[0]


def _gateway_from_kubeconfig(path: Path, cluster_name: str) -> str | None:
    """The gateway URL of the cluster's ``kruntimes.io/gateway`` extension, when present
    (lightkube's model does not keep cluster extensions)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    for entry in doc.get("clusters") or []:
        if not isinstance(entry, dict) or entry.get("name") != cluster_name:
            continue
        for ext in (entry.get("cluster") or {}).get("extensions") or []:
            if isinstance(ext, dict) and ext.get("name") == GATEWAY_EXTENSION:
                url = (ext.get("extension") or {}).get("url")
                if isinstance(url, str) and url:
                    return url.rstrip("/")
    return None


def as_dict(obj: Any) -> dict[str, Any]:
    """A lightkube generic object (or a dict) as a plain dict."""
    if isinstance(obj, dict):
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        out = to_dict()
        assert isinstance(out, dict)
        return out
    raise KruntimesError(f"unexpected object {type(obj).__name__}")


def phase_of(run: Mapping[str, Any]) -> str:
    """``status.phase``, ``Pending`` when unset."""
    return str((run.get("status") or {}).get("phase") or "Pending")


def meta(run: Mapping[str, Any], key: str) -> str:
    """``metadata.<key>`` as a string (empty when absent)."""
    return str((run.get("metadata") or {}).get(key) or "")


def status_field(run: Mapping[str, Any], key: str) -> str | None:
    """``status.<key>`` when set."""
    value = (run.get("status") or {}).get(key)
    return str(value) if value not in (None, "") else None


def api_error(error: ApiError, action: str) -> KruntimesError:
    """A lightkube API error as the SDK's exception."""
    status = error.status
    code = int(getattr(status, "code", None) or error.response.status_code)
    reason = getattr(status, "reason", None)
    message = getattr(status, "message", None) or str(error)
    return from_status(
        code,
        reason,
        f"cannot {action}: {message}",
        retry_after=parse_retry_after(error.response.headers.get("Retry-After")),
    )


def error_answer(status: int, body: bytes, headers: Mapping[str, str]) -> KruntimesError:
    """The gateway's JSON error body (``{"code", "reason", "message"}``) as an exception."""
    reason: str | None = None
    message = body[:4096].decode("utf-8", "replace").strip() or f"HTTP {status}"
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict):
            reason = str(parsed.get("reason") or "") or None
            message = str(parsed.get("message") or message)
    except ValueError:
        pass
    return from_status(status, reason, message, retry_after=parse_retry_after(headers.get("retry-after")))


NOT_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout, httpx2.UnsupportedProtocol)


def transport_error(error: Exception, url: str, *, mutation: bool, operation_id: str | None = None) -> KruntimesError:
    """A transport failure: before sending, nothing happened; after, a mutation's outcome is
    unknown."""
    if isinstance(error, NOT_SENT):
        return Unavailable(f"cannot reach {url}; nothing was sent: {error}")
    if mutation:
        return OutcomeUnknown(
            f"the connection to {url} broke after the request was sent; it may or may not have taken effect: {error}",
            operation_id=operation_id,
        )
    return KruntimesError(f"the connection to {url} broke: {error}")


class Endpoint:
    """A Run's published endpoint: URL, origin, and the PEM CA bundle it is verified with."""

    def __init__(self, run: Mapping[str, Any]) -> None:
        name = meta(run, "name")
        endpoint = (run.get("status") or {}).get("endpoint") or {}
        self.url = str(endpoint.get("url") or "")
        parts = urlsplit(self.url)
        if str(endpoint.get("protocol") or "HTTPS").upper() != "HTTPS" or parts.scheme != "https":
            raise KruntimesError(
                f"the endpoint {self.url!r} of run {name} is not HTTPS, and a bearer token is never sent in the clear"
            )
        if not parts.netloc:
            raise KruntimesError(f"the endpoint {self.url!r} of run {name} has no host")
        self.origin = f"https://{parts.netloc}"
        self.path = parts.path
        self.ca_bundle: bytes | None = None
        encoded = endpoint.get("caBundle")
        if encoded:
            # caBundle is bytes in the design (CRD `format: byte`): base64 of the PEM in JSON.
            try:
                pem = base64.b64decode(str(encoded), validate=True)
            except ValueError as e:
                raise KruntimesError(f"the caBundle of run {name} is not base64: {e}") from None
            if len(pem) > MAX_CA_BUNDLE_BYTES:
                raise KruntimesError(f"the caBundle of run {name} exceeds {MAX_CA_BUNDLE_BYTES} bytes")
            if pem.strip():
                self.ca_bundle = pem


class AsyncConnection:
    """The API server client, the credentials, and the endpoint clients of one kubeconfig
    context, working in one namespace. Make it with :func:`kruntimes.aio.from_kube_config`
    or :func:`kruntimes.aio.from_incluster`."""

    def __init__(self, config: SingleConfig, *, namespace: str | None = None, gateway_url: str | None = None) -> None:
        if config.user is None:
            raise InvalidRequest(f"the kubeconfig context {config.context_name} names no user")
        self.config = config
        self.namespace = namespace or config.namespace
        self.gateway_url = gateway_url
        self.kube = AsyncClient(config, namespace=self.namespace, field_manager="kruntimes-sdk-python")
        self._auth = user_auth(config.user)
        self._cert = user_cert(config.user, config.abs_file)
        self._cluster_ssl: ssl.SSLContext | None = None
        self._endpoints: dict[tuple[str, bytes | None], httpx2.AsyncClient] = {}
        self._api_http: httpx2.AsyncClient | None = None
        self._invokers: dict[tuple[str, bytes | None], Http1Pool] = {}
        self._authorization: str | None = None

    # -- credentials and TLS ------------------------------------------------------------

    def ssl_context(self, ca_bundle: bytes | None) -> ssl.SSLContext:
        """TLS that trusts ``ca_bundle`` (PEM) only, else the kubeconfig cluster's CA, and
        presents the kubeconfig's client certificate when it has one."""
        if ca_bundle is None:
            if self._cluster_ssl is None:
                assert self.config.user is not None
                self._cluster_ssl = verify_cluster(self.config.cluster, self.config.user, self.config.abs_file)
            return self._cluster_ssl
        try:
            ctx = ssl.create_default_context(cadata=ca_bundle.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
            raise KruntimesError(f"the caBundle is not a PEM certificate bundle: {e}") from None
        if self._cert:
            ctx.load_cert_chain(*self._cert)
        return ctx

    async def authorization(self, *, rejected: str | None = None) -> str | None:
        """The ``Authorization`` value the kubeconfig's credentials give (``None`` without
        one), kept from one call to the next: lightkube's credential flows change theirs
        only when a request is refused with 401. ``rejected``: the value a server just
        refused with 401; the flow is run past that answer (a token file read again, an
        exec plugin run again) for a fresh one."""
        if self._auth is None:
            return None
        if rejected is None and self._authorization is not None:
            return self._authorization
        request = httpx2.Request("GET", "https://kruntimes.invalid/")
        if rejected is not None:
            request.headers["Authorization"] = rejected
        flow = self._auth.async_auth_flow(request)
        try:
            authed = await flow.__anext__()
            if rejected is not None:
                with contextlib.suppress(StopAsyncIteration):
                    authed = await flow.asend(httpx2.Response(401, request=authed))
        finally:
            await flow.aclose()
        self._authorization = authed.headers.get("Authorization") or None
        return self._authorization

    async def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header the kubeconfig's credentials give (for the
        WebSocket and the invoke path, which httpx does not carry); empty without one."""
        value = await self.authorization()
        return {"Authorization": value} if value else {}

    def invoker(self, origin: str, ca_bundle: bytes | None) -> Http1Pool:
        """The kept-alive HTTP/1.1 connections of the invoke path and of uploads to a
        gateway origin, verified with ``ca_bundle``."""
        key = (origin, ca_bundle)
        pool = self._invokers.get(key)
        if pool is None:
            if len(self._invokers) >= MAX_ENDPOINT_CLIENTS:
                _, oldest = self._invokers.popitem()
                oldest.close()
            parts = urlsplit(origin)
            if parts.hostname is None:
                raise KruntimesError(f"the endpoint origin {origin!r} has no host")
            pool = Http1Pool(parts.hostname, parts.port or 443, self.ssl_context(ca_bundle))
            self._invokers[key] = pool
        return pool

    def http(self, origin: str, ca_bundle: bytes | None) -> httpx2.AsyncClient:
        """The kept-alive client of a gateway origin, verified with ``ca_bundle``."""
        key = (origin, ca_bundle)
        client = self._endpoints.get(key)
        if client is None:
            if len(self._endpoints) >= MAX_ENDPOINT_CLIENTS:
                _, oldest = self._endpoints.popitem()
                asyncio.get_running_loop().create_task(oldest.aclose())
            client = httpx2.AsyncClient(
                base_url=origin,
                verify=self.ssl_context(ca_bundle),
                auth=self._auth,
                timeout=httpx2.Timeout(CALL_TIMEOUT),
                trust_env=False,
            )
            self._endpoints[key] = client
        return client

    def gateway(self) -> tuple[str, httpx2.AsyncClient]:
        """The gateway of task logs (the kubeconfig's ``kruntimes.io/gateway`` extension, or
        ``gateway_url``), verified with the kubeconfig cluster's CA."""
        if not self.gateway_url:
            raise KruntimesError(
                "no gateway URL: the kubeconfig has no kruntimes.io/gateway extension; pass "
                "gateway_url= or set KRUNTIMES_GATEWAY_URL"
            )
        parts = urlsplit(self.gateway_url)
        origin = f"{parts.scheme}://{parts.netloc}"
        return origin, self.http(origin, None)

    async def close(self) -> None:
        """Closes every connection this client opened."""
        clients = list(self._endpoints.values())
        self._endpoints.clear()
        invokers = list(self._invokers.values())
        self._invokers.clear()
        for pool in invokers:
            pool.close()
        if self._api_http is not None:
            clients.append(self._api_http)
            self._api_http = None
        for client in clients:
            await client.aclose()
        await self.kube.close()

    # -- Runs ---------------------------------------------------------------------------

    async def create_run(self, body: dict[str, Any], namespace: str, what: str) -> dict[str, Any]:
        """Creates a Run."""
        return await self._create(Run, body, namespace, what)

    async def get_run(self, namespace: str, name: str) -> dict[str, Any]:
        """The Run as it is now; :class:`NotFound` when there is none."""
        return await self._get(Run, namespace, name, "run")

    async def _create(self, kind: Any, body: dict[str, Any], namespace: str, what: str) -> dict[str, Any]:
        try:
            created = await self.kube.create(kind.from_dict(body))
        except ApiError as e:
            raise api_error(e, f"create {what} in namespace {namespace}") from None
        except httpx2.TransportError as e:
            raise transport_error(e, self.config.cluster.server, mutation=True) from None
        return as_dict(created)

    async def _get(self, kind: Any, namespace: str, name: str, what: str) -> dict[str, Any]:
        try:
            return as_dict(await self.kube.get(kind, name, namespace=namespace))
        except ApiError as e:
            raise api_error(e, f"get {what} {name} in namespace {namespace}") from None
        except httpx2.TransportError as e:
            raise transport_error(e, self.config.cluster.server, mutation=False) from None

    async def patch_run(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the Run."""
        try:
            return as_dict(await self.kube.patch(Run, name, patch, namespace=namespace, patch_type=PatchType.MERGE))
        except ApiError as e:
            raise api_error(e, f"patch run {name} in namespace {namespace}") from None
        except httpx2.TransportError as e:
            raise transport_error(e, self.config.cluster.server, mutation=True) from None

    async def delete_run(self, namespace: str, name: str, uid: str) -> bool:
        """Deletes the Run, only if it is still the one with ``uid`` (a UID precondition,
        which lightkube's ``delete`` cannot send). False when it was already gone."""
        return await self._delete("runs", namespace, name, uid)

    # -- Snapshots ----------------------------------------------------------------------

    async def create_snapshot(self, body: dict[str, Any], namespace: str) -> dict[str, Any]:
        """Creates a Snapshot."""
        return await self._create(Snapshot, body, namespace, f"snapshot {meta(body, 'name')}")

    async def get_snapshot(self, namespace: str, name: str) -> dict[str, Any]:
        """The Snapshot as it is now; :class:`NotFound` when there is none."""
        return await self._get(Snapshot, namespace, name, "snapshot")

    async def delete_snapshot(self, namespace: str, name: str, uid: str | None) -> bool:
        """Deletes the Snapshot (only if it is still the one with ``uid``, when given).
        False when it was already gone."""
        return await self._delete("snapshots", namespace, name, uid)

    async def wait_snapshot(
        self,
        namespace: str,
        name: str,
        uid: str | None,
        done: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        first: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """:meth:`wait_run` for a Snapshot."""
        return await self._wait(Snapshot, self.get_snapshot, namespace, name, uid, done, timeout, what, first)

    async def _delete(self, plural: str, namespace: str, name: str, uid: str | None) -> bool:
        if self._api_http is None:
            assert self.config.user is not None
            self._api_http = httpx2.AsyncClient(
                base_url=self.config.cluster.server,
                verify=self.ssl_context(None),
                auth=self._auth,
                timeout=httpx2.Timeout(CALL_TIMEOUT),
                trust_env=False,
            )
        url = f"/apis/kruntimes.io/v1alpha1/namespaces/{namespace}/{plural}/{name}"
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            response = await self._api_http.request(
                "DELETE", url, content=json.dumps(body), headers={"Content-Type": "application/json"}
            )
        except httpx2.TransportError as e:
            raise transport_error(e, self.config.cluster.server, mutation=True) from None
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            err = error_answer(response.status_code, response.content, response.headers)
            if response.status_code == 409:
                # The precondition failed: another object of that name; ours is gone.
                return False
            raise err
        return True

    async def wait_run(
        self,
        namespace: str,
        name: str,
        uid: str | None,
        done: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        first: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Waits until ``done(run)`` holds, with a watch from the Run's resourceVersion.
        Returns the Run, or ``None`` when it was deleted (or replaced by another UID).
        Raises :class:`OperationTimeout` after ``timeout`` seconds (the Run goes on)."""
        return await self._wait(Run, self.get_run, namespace, name, uid, done, timeout, what, first)

    async def _wait(
        self,
        resource: Any,
        get: Callable[[str, str], Awaitable[dict[str, Any]]],
        namespace: str,
        name: str,
        uid: str | None,
        done: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        first: dict[str, Any] | None,
    ) -> dict[str, Any] | None:
        noun = "run" if resource is Run else "snapshot"
        deadline = time.monotonic() + timeout
        run = first
        while True:
            if run is None:
                try:
                    run = await get(namespace, name)
                except NotFound:
                    return None
            if uid is not None and meta(run, "uid") != uid:
                return None
            if done(run):
                return run
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationTimeout(
                    f"{noun} {name} was not {what} after {timeout:g}s (phase {phase_of(run)}); it goes on"
                )
            watch = self.kube.watch(
                resource,
                namespace=namespace,
                fields={"metadata.name": name},
                resource_version=meta(run, "resourceVersion") or None,
                server_timeout=max(1, min(300, int(left) + 1)),
            )
            events: AsyncIterator[tuple[str, Any]] = watch.__aiter__()
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        kind, obj = await asyncio.wait_for(events.__anext__(), left)
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        break
                    current = as_dict(obj)
                    if uid is not None and meta(current, "uid") not in ("", uid):
                        return None
                    if kind == "DELETED":
                        return None
                    run = current
                    if done(run):
                        return run
            except ApiError as e:
                if e.status.code == 410:
                    run = None  # the resourceVersion is too old: read again
                    continue
                raise api_error(e, f"watch {noun} {name}") from None
            except httpx2.TransportError:
                run = None  # the watch broke: read the Run again and watch anew
                continue
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
            # The watch ended (server timeout, deadline): read the Run again.
            run = None
