"""The async client's entry points: :class:`AsyncClient` and :class:`AsyncRuntime`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ConfigError

from ..errors import InvalidRequest, KruntimesError
from ..models import AcquireOptions, Checkpoint, check_object_name
from . import _checkpoints
from ._client import AsyncConnection, _gateway_from_kubeconfig, kubeconfig_path
from ._sandbox import AsyncSandbox, acquire, fork, open_existing
from ._work import AsyncFunction, AsyncTask, create_function, function_run, task_run


class AsyncRuntime:
    """A Runtime (a pool of workers) in a namespace: sandboxes, tasks and functions run
    on it."""

    def __init__(self, client: AsyncClient, namespace: str, name: str) -> None:
        self._client = client
        self.namespace = namespace
        self.name = name

    def __repr__(self) -> str:
        return f"AsyncRuntime(namespace={self.namespace!r}, name={self.name!r})"

    async def acquire_sandbox(self, options: AcquireOptions | None = None, **kwargs: Any) -> AsyncSandbox:
        """Creates one session Run on this Runtime and waits until it is Ready.

        Pass :class:`~kruntimes.AcquireOptions`, or its fields as keywords
        (``acquire_sandbox(generate_name="labeler-", lease_timeout_seconds=60)``). With
        ``from_snapshot=`` it is a fork of that checkpoint (see :meth:`AsyncClient.fork`).
        Raises :class:`~kruntimes.SandboxStateError` when it ends before Ready (with its
        phase and reason), :class:`~kruntimes.OperationTimeout` after ``options.wait`` (the
        Run goes on: release it)."""
        if options is None:
            options = AcquireOptions(**kwargs)
        elif kwargs:
            raise InvalidRequest("pass AcquireOptions or keywords, not both")
        return await acquire(self._client.connection, self.namespace, self.name, options)

    async def run(
        self,
        argv: list[str] | None = None,
        *,
        source: str | None = None,
        entrypoint: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        name: str | None = None,
    ) -> AsyncTask:
        """Creates a task Run and returns at once: ``argv=[program, *args]`` (a program the
        worker resolves) or ``source="..."`` (run by the Runtime's interpreter, written to
        ``entrypoint`` when given). ``timeout`` bounds its run, in seconds."""
        body = task_run(self.name, argv=argv, source=source, entrypoint=entrypoint, env=env, timeout=timeout, name=name)
        body["metadata"]["namespace"] = self.namespace
        created = await self._client.connection.create_run(body, self.namespace, f"a task on Runtime {self.name}")
        return AsyncTask(self._client.connection, created)

    async def create_function(
        self,
        name: str,
        *,
        source: str,
        handler: str = "main:handle",
        idle_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_attempts: int | None = None,
        concurrency: int | None = None,
        wait: float = 300.0,
    ) -> AsyncFunction:
        """Registers a function (inline ``source`` is the module ``main``) and waits until it
        is Ready. Raises :class:`~kruntimes.RunStateError` when its registration fails (an
        import error, say), with the phase and reason. ``concurrency`` (1 to 64, default 1)
        is how many invocations may run at once, each in an interpreter of its own."""
        body = function_run(
            self.name,
            name,
            source=source,
            handler=handler,
            idle_timeout=idle_timeout,
            env=env,
            timeout=timeout,
            max_attempts=max_attempts,
            concurrency=concurrency,
        )
        return await create_function(self._client.connection, self.namespace, body, wait)


class AsyncClient:
    """The async client of one kruntimes control plane (the twin of
    :class:`kruntimes.Client`). Use it as ``async with``, or call :meth:`close`."""

    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection

    @property
    def namespace(self) -> str:
        """The namespace used when a call names none."""
        return self.connection.namespace

    def runtime(self, namespace: str, name: str | None = None) -> AsyncRuntime:
        """The Runtime ``name`` in ``namespace``: ``runtime("default", "bash")``, or
        ``runtime("bash")`` in the client's namespace."""
        if name is None:
            namespace, name = self.namespace, namespace
        return AsyncRuntime(self, namespace, name)

    async def open(self, namespace: str, name: str | None = None) -> AsyncSandbox:
        """Attaches to an existing sandbox: ``open(ns, name)`` or ``open(name)``."""
        if name is None:
            namespace, name = self.namespace, namespace
        return await open_existing(self.connection, namespace, name)

    async def checkpoint(self, namespace: str, name: str | None = None) -> Checkpoint:
        """An existing checkpoint (a Snapshot) as it is now: ``checkpoint(ns, name)`` or
        ``checkpoint(name)``."""
        if name is None:
            namespace, name = self.namespace, namespace
        return await _checkpoints.read(self.connection, namespace, check_object_name(name, "a checkpoint's name"))

    async def delete_checkpoint(self, checkpoint: Checkpoint | str, *, namespace: str | None = None) -> bool:
        """Deletes a checkpoint: a :class:`~kruntimes.Checkpoint` (only that very Snapshot:
        a UID precondition), or a name in ``namespace`` (default: the client's). Forks made
        from it are not touched. False when it was gone already."""
        if isinstance(checkpoint, Checkpoint):
            return await self.connection.delete_snapshot(
                checkpoint.namespace or namespace or self.namespace, checkpoint.name, checkpoint.uid or None
            )
        name = check_object_name(checkpoint, "a checkpoint's name")
        return await self.connection.delete_snapshot(namespace or self.namespace, name, None)

    async def fork(
        self,
        snapshot: Checkpoint | str,
        *,
        count: int = 1,
        suspended: bool = False,
        runtime: str | None = None,
        namespace: str | None = None,
        options: AcquireOptions | None = None,
        **kwargs: Any,
    ) -> list[AsyncSandbox]:
        """Starts ``count`` (1 to 100) sandboxes from the checkpoint ``snapshot`` (a
        :class:`~kruntimes.Checkpoint`, or a Snapshot's name in ``namespace``, default the
        client's): each starts with the checkpoint's files and goes its own way. The
        Snapshot is read first: it must be Ready, and every fork pins its UID. They run on
        the checkpointed sandbox's Runtime (recorded on the checkpoint; ``runtime=`` when it
        is not). Other options as :meth:`AsyncRuntime.acquire_sandbox` takes them
        (``AcquireOptions`` or its fields as keywords; ``source`` must be unset, and a
        ``name`` or ``request_id`` only with ``count=1``; forks are named
        ``<runtime>-fork-…`` by default).

        Waits until every fork is Ready, or with ``suspended=True`` until each is
        ``Suspended`` to the checkpoint (no slot taken; ``resume()`` it later). With
        ``count`` over 1 it is all or none: when one fails, the others are ended and
        deleted and its error is raised.

        Raises :class:`ValueError` for a ``count`` outside 1 to 100,
        :class:`~kruntimes.NotFound` for no such checkpoint,
        :class:`~kruntimes.SnapshotStateError` for one that is not Ready (or was replaced),
        and as :meth:`AsyncRuntime.acquire_sandbox`."""
        if options is None:
            options = AcquireOptions(**kwargs)
        elif kwargs:
            raise InvalidRequest("pass AcquireOptions or keywords, not both")
        if isinstance(snapshot, Checkpoint) and snapshot.namespace:
            namespace = namespace or snapshot.namespace
        return await fork(
            self.connection,
            namespace or self.namespace,
            snapshot,
            options,
            count=count,
            suspended=suspended,
            runtime=runtime,
        )

    async def task(self, namespace: str, name: str | None = None) -> AsyncTask:
        """An existing task Run."""
        if name is None:
            namespace, name = self.namespace, namespace
        return AsyncTask(self.connection, await self.connection.get_run(namespace, name))

    async def function(self, namespace: str, name: str | None = None) -> AsyncFunction:
        """An existing, Ready function Run."""
        if name is None:
            namespace, name = self.namespace, namespace
        return AsyncFunction(self.connection, await self.connection.get_run(namespace, name))

    async def close(self) -> None:
        """Closes every connection of this client."""
        await self.connection.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def from_kube_config(
    path: str | os.PathLike[str] | None = None,
    context: str | None = None,
    *,
    namespace: str | None = None,
    gateway_url: str | None = None,
) -> AsyncClient:
    """A client from a kubeconfig: ``path``, else ``$KUBECONFIG``, else
    ``$KRUNTIMES_DATA_DIR/kubeconfig``, else ``.kruntimes/kubeconfig`` (where ``kruntimes
    up`` writes it), else ``~/.kube/config``; in ``context`` (default: the current one).
    The namespace is the context's unless given. Reads files only."""
    file = kubeconfig_path(path)
    try:
        config = KubeConfig.from_file(file).get(context)
    except ConfigError as e:
        raise KruntimesError(
            f"cannot use the kubeconfig {file}: {e}; is `kruntimes up` running? set KUBECONFIG to its kubeconfig"
        ) from None
    except (KeyError, TypeError, ValueError) as e:
        raise KruntimesError(f"{file} is not a valid kubeconfig: {e}") from None
    assert config is not None
    gateway = (
        gateway_url or os.environ.get("KRUNTIMES_GATEWAY_URL") or _gateway_from_kubeconfig(file, config.context.cluster)
    )
    return AsyncClient(AsyncConnection(config, namespace=namespace, gateway_url=gateway))


def from_incluster(*, namespace: str | None = None, gateway_url: str | None = None) -> AsyncClient:
    """A client from the Pod's service account (token, CA and namespace under
    ``/var/run/secrets/kubernetes.io/serviceaccount``). Task logs need the gateway's URL:
    ``gateway_url`` or ``$KRUNTIMES_GATEWAY_URL``."""
    try:
        config = KubeConfig.from_service_account().get()
    except (ConfigError, KeyError) as e:
        raise KruntimesError(f"not running in a cluster: {e}") from None
    assert config is not None
    return AsyncClient(
        AsyncConnection(config, namespace=namespace, gateway_url=gateway_url or os.environ.get("KRUNTIMES_GATEWAY_URL"))
    )
