"""The sync client: the async client (:mod:`kruntimes.aio`) driven from a private event
loop on a background thread, one per :class:`Client`.

One implementation serves both shapes, so they cannot drift apart. The loop thread also
runs what must go on between calls: a session's heartbeats and its reader. Calls may come
from any thread; a call made from inside a running event loop should use
:mod:`kruntimes.aio` instead.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from . import aio
from .aio._transfer import Readable, Writable
from .models import (
    AcquireOptions,
    Checkpoint,
    Event,
    ExecResult,
    FileEntry,
    FilePage,
    Invocation,
    ListFilesOptions,
    Operation,
    ReleaseMode,
    SandboxStatus,
    TaskResult,
    Uploaded,
)

T = TypeVar("T")


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def _settle(timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    # As asyncio.run ends: what is left is cancelled, and given a bounded time to unwind.
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="kruntimes-sdk", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, awaitable: Awaitable[T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync kruntimes call from the SDK's own loop")
        future: Future[T] = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def iterate(self, iterator: AsyncIterator[T]) -> Iterator[T]:
        it = iterator.__aiter__()
        try:
            while True:
                try:
                    yield self.call(it.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None and not self.loop.is_closed():
                self.call(aclose())

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if threading.current_thread() is not self._thread:
            # Close the async generators the client dropped and end its tasks (heartbeats
            # of sessions left open) before the loop stops: none is destroyed pending.
            self.call(_settle())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Session:
    """An open connection to a sandbox (see :class:`kruntimes.aio.AsyncSession`)."""

    def __init__(self, portal: _Portal, inner: aio.AsyncSession) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def closed(self) -> bool:
        """The connection has ended."""
        return self._inner.closed

    def send(self, operation: Operation) -> str:
        """Sends one operation; returns its ID once the sandbox admitted it."""
        return self._portal.call(self._inner.send(operation))

    def receive(self, timeout: float | None = None) -> Event:
        """The next event; :class:`~kruntimes.SessionClosed` after the connection ended."""
        return self._portal.call(self._inner.receive(timeout))

    def __iter__(self) -> Iterator[Event]:
        return self._portal.iterate(self._inner)

    def cancel(self, operation_id: str) -> bool:
        """Cancels a queued or running operation; True when the sandbox found it."""
        return self._portal.call(self._inner.cancel(operation_id))

    def heartbeat(self) -> str | None:
        """Renews the lease now; returns when it expires."""
        return self._portal.call(self._inner.heartbeat())

    def run(self, operation: Operation) -> ExecResult:
        """Sends one operation and follows it to its end."""
        return self._portal.call(self._inner.run(operation))

    def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        operation_id: str | None = None,
    ) -> ExecResult:
        """Runs one command on this connection and returns what it did."""
        return self._portal.call(
            self._inner.exec(
                argv, shell=shell, cwd=cwd, env=env, stdin=stdin, timeout=timeout, operation_id=operation_id
            )
        )

    def close(self) -> None:
        """Closes the connection only: the sandbox and its operations go on."""
        self._portal.call(self._inner.close())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    """A session Run (see :class:`kruntimes.aio.AsyncSandbox`). ``with`` releases it on
    exit: drained after a clean exit, cancelled at once after an exception."""

    def __init__(self, portal: _Portal, inner: aio.AsyncSandbox) -> None:
        self._portal = portal
        self._inner = inner

    name = property(lambda self: self._inner.name, doc="The Run's name.")
    namespace = property(lambda self: self._inner.namespace, doc="The Run's namespace.")
    uid = property(lambda self: self._inner.uid, doc="The Run's UID.")
    lease_timeout_seconds = property(lambda self: self._inner.lease_timeout_seconds, doc="The lease, if any.")
    request_id = property(
        lambda self: self._inner.request_id, doc="The creation request ID, if any (release keeps its tombstone)."
    )

    def __repr__(self) -> str:
        return f"Sandbox(namespace={self.namespace!r}, name={self.name!r}, uid={self.uid!r})"

    def run(self) -> dict[str, Any]:
        """The Run as it is now."""
        return self._portal.call(self._inner.run())

    def open_session(self) -> Session:
        """Opens a session (renews the lease; heartbeats while open)."""
        return Session(self._portal, self._portal.call(self._inner.open_session()))

    def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Runs ``argv`` or a ``shell`` line; a non-zero exit code is a result."""
        return self._portal.call(self._inner.exec(argv, shell=shell, cwd=cwd, env=env, stdin=stdin, timeout=timeout))

    def run_operation(self, operation: Operation) -> ExecResult:
        """Sends one operation on the sandbox's own session and follows it to its end."""
        return self._portal.call(self._inner.run_operation(operation))

    def write_file(self, path: str, data: bytes | str, *, executable: bool = False, make_parents: bool = True) -> None:
        """Writes a workspace file (at most 1 MiB)."""
        self._portal.call(self._inner.write_file(path, data, executable=executable, make_parents=make_parents))

    def read_file(self, path: str) -> bytes:
        """A workspace file's bytes (at most 1 MiB)."""
        return self._portal.call(self._inner.read_file(path))

    def upload(
        self,
        path: str,
        reader: Readable,
        *,
        size: int | None = None,
        executable: bool = False,
    ) -> Uploaded:
        """Streams ``reader`` (a binary file) into the workspace file ``path``, atomically;
        ``size``, when known, is announced (see :meth:`kruntimes.aio.AsyncSandbox.upload`)."""
        return self._portal.call(self._inner.upload(path, reader, size=size, executable=executable))

    def upload_file(self, local: str | os.PathLike[str], path: str) -> Uploaded:
        """Uploads the local file ``local`` to ``path``, executable when it is."""
        return self._portal.call(self._inner.upload_file(local, path))

    def upload_tar(self, path: str, reader: Readable, *, size: int | None = None) -> Uploaded:
        """Streams a tar stream from ``reader``, extracted into the new or empty directory
        ``path``."""
        return self._portal.call(self._inner.upload_tar(path, reader, size=size))

    def upload_dir(self, local: str | os.PathLike[str], path: str) -> Uploaded:
        """Uploads the local directory ``local`` as a tar stream into ``path`` (a new or
        empty directory)."""
        return self._portal.call(self._inner.upload_dir(local, path))

    def download(self, path: str, writer: Writable | Callable[[bytes], Any]) -> int:
        """Streams the workspace file ``path`` into ``writer``; the bytes written."""
        return self._portal.call(self._inner.download(path, writer))

    def download_file(self, path: str, local: str | os.PathLike[str]) -> int:
        """Downloads ``path`` to the local file ``local``, atomically."""
        return self._portal.call(self._inner.download_file(path, local))

    def download_dir(self, path: str, local: str | os.PathLike[str]) -> int:
        """Downloads the directory ``path`` (``""``: the workspace) as a tar stream into the
        local directory ``local`` (created; it must not exist or be empty)."""
        return self._portal.call(self._inner.download_dir(path, local))

    def make_directory(self, path: str, *, parents: bool = True) -> None:
        """Creates a workspace directory."""
        self._portal.call(self._inner.make_directory(path, parents=parents))

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Deletes a workspace path."""
        self._portal.call(self._inner.delete(path, recursive=recursive))

    def rename(self, source: str, target: str) -> None:
        """Renames a workspace path."""
        self._portal.call(self._inner.rename(source, target))

    def list_files(self, options: ListFilesOptions | None = None) -> FilePage:
        """One page of a workspace directory."""
        return self._portal.call(self._inner.list_files(options))

    def iter_file_pages(self, directory: str = "", limit: int = 1000) -> Iterator[FilePage]:
        """Every page of a directory."""
        return self._portal.iterate(self._inner.iter_file_pages(directory, limit))

    def iter_files(self, directory: str = "", limit: int = 1000) -> Iterator[FileEntry]:
        """Every entry of a directory, page after page."""
        return self._portal.iterate(self._inner.iter_files(directory, limit))

    def status(self) -> SandboxStatus:
        """The session's status; does not renew the lease."""
        return self._portal.call(self._inner.status())

    def renew(self) -> SandboxStatus:
        """Renews the lease; returns the status."""
        return self._portal.call(self._inner.renew())

    def wait_ended(self, timeout: float = 300.0) -> str | None:
        """Waits until the sandbox's Run has ended; returns its phase."""
        return self._portal.call(self._inner.wait_ended(timeout))

    def suspend(self, *, wait: float | None = 300.0) -> int:
        """Suspends the sandbox and waits until it is Suspended; returns the generation the
        request produced (see :meth:`kruntimes.aio.AsyncSandbox.suspend`)."""
        return self._portal.call(self._inner.suspend(wait=wait))

    def resume(self, *, wait: float | None = 300.0) -> int:
        """Resumes a suspended sandbox and waits until it is Ready again; returns the
        generation the request produced (see :meth:`kruntimes.aio.AsyncSandbox.resume`)."""
        return self._portal.call(self._inner.resume(wait=wait))

    def checkpoint(self, name: str, *, timeout: float = 300.0) -> Checkpoint:
        """Checkpoints the sandbox while it goes on (the Snapshot ``name``: every operation
        accepted before the call, none after) and waits until it is Ready; the checkpoint
        outlives the sandbox (see :meth:`kruntimes.aio.AsyncSandbox.checkpoint`)."""
        return self._portal.call(self._inner.checkpoint(name, timeout=timeout))

    def close(self) -> None:
        """Closes the sandbox's own session (the one :meth:`exec` uses)."""
        self._portal.call(self._inner.close())

    def release(self, mode: ReleaseMode = "drain", *, wait: float = 300.0) -> str | None:
        """Ends the sandbox (``drain`` or ``immediate``), deletes its Run, waits until it is
        gone; returns the phase it ended in. A sandbox made with a request ID keeps its
        ended Run as the ID's tombstone (see :meth:`kruntimes.aio.AsyncSandbox.release`)."""
        return self._portal.call(self._inner.release(mode, wait=wait))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release("immediate" if exc_type is not None else "drain")


class Task:
    """A task Run (see :class:`kruntimes.aio.AsyncTask`)."""

    def __init__(self, portal: _Portal, inner: aio.AsyncTask) -> None:
        self._portal = portal
        self._inner = inner

    name = property(lambda self: self._inner.name, doc="The Run's name.")
    namespace = property(lambda self: self._inner.namespace, doc="The Run's namespace.")
    uid = property(lambda self: self._inner.uid, doc="The Run's UID.")

    def __repr__(self) -> str:
        return f"Task(namespace={self.namespace!r}, name={self.name!r})"

    def run(self) -> dict[str, Any]:
        """The Run as it is now."""
        return self._portal.call(self._inner.run())

    def phase(self) -> str:
        """The Run's phase now."""
        return self._portal.call(self._inner.phase())

    def wait(self, timeout: float | None = None, *, max_log_bytes: int = 16 * 1024 * 1024) -> TaskResult:
        """Waits until the task ends; returns phase, exit code, outputs, stdout, stderr."""
        return self._portal.call(self._inner.wait(timeout, max_log_bytes=max_log_bytes))

    def logs(self, stream: str = "stdout", *, follow: bool = False) -> Iterator[bytes]:
        """The task's output stream, chunk by chunk (until it ends, with ``follow``)."""
        return self._portal.iterate(self._inner.logs(stream, follow=follow))

    def cancel(self) -> None:
        """Asks the task to end now."""
        self._portal.call(self._inner.cancel())

    def delete(self, *, wait: float = 120.0) -> None:
        """Deletes the Run and waits until it is gone."""
        self._portal.call(self._inner.delete(wait=wait))


class Function:
    """A Ready function Run (see :class:`kruntimes.aio.AsyncFunction`)."""

    def __init__(self, portal: _Portal, inner: aio.AsyncFunction) -> None:
        self._portal = portal
        self._inner = inner

    name = property(lambda self: self._inner.name, doc="The Run's name.")
    namespace = property(lambda self: self._inner.namespace, doc="The Run's namespace.")
    uid = property(lambda self: self._inner.uid, doc="The Run's UID.")

    def __repr__(self) -> str:
        return f"Function(namespace={self.namespace!r}, name={self.name!r})"

    def invoke(self, payload: Any = None, *, invocation_id: str | None = None, timeout: float = 300.0) -> Any:
        """Invokes the handler once; returns its JSON result (InvocationError if it raised)."""
        return self._portal.call(self._inner.invoke(payload, invocation_id=invocation_id, timeout=timeout))

    def call(self, payload: Any = None, *, invocation_id: str | None = None, timeout: float = 300.0) -> Invocation:
        """Invokes the handler once; returns the whole answer, whatever the outcome."""
        return self._portal.call(self._inner.call(payload, invocation_id=invocation_id, timeout=timeout))

    def refresh(self) -> None:
        """Reads the Run again and takes its endpoint as it is now."""
        self._portal.call(self._inner.refresh())

    def delete(self, *, wait: float = 120.0) -> None:
        """Deletes the function and waits until its Run is gone."""
        self._portal.call(self._inner.delete(wait=wait))


class Runtime:
    """A Runtime (a pool of workers) in a namespace."""

    def __init__(self, portal: _Portal, inner: aio.AsyncRuntime) -> None:
        self._portal = portal
        self._inner = inner
        self.namespace = inner.namespace
        self.name = inner.name

    def __repr__(self) -> str:
        return f"Runtime(namespace={self.namespace!r}, name={self.name!r})"

    def acquire_sandbox(self, options: AcquireOptions | None = None, **kwargs: Any) -> Sandbox:
        """Creates one session Run and waits until it is Ready; ``from_snapshot=`` forks a
        checkpoint (see :meth:`kruntimes.aio.AsyncRuntime.acquire_sandbox`)."""
        return Sandbox(self._portal, self._portal.call(self._inner.acquire_sandbox(options, **kwargs)))

    def run(
        self,
        argv: list[str] | None = None,
        *,
        source: str | None = None,
        entrypoint: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        name: str | None = None,
    ) -> Task:
        """Creates a task Run and returns at once."""
        return Task(
            self._portal,
            self._portal.call(
                self._inner.run(argv, source=source, entrypoint=entrypoint, env=env, timeout=timeout, name=name)
            ),
        )

    def create_function(
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
    ) -> Function:
        """Registers a function and waits until it is Ready."""
        inner = self._portal.call(
            self._inner.create_function(
                name,
                source=source,
                handler=handler,
                idle_timeout=idle_timeout,
                env=env,
                timeout=timeout,
                max_attempts=max_attempts,
                concurrency=concurrency,
                wait=wait,
            )
        )
        return Function(self._portal, inner)


class Client:
    """The client of one kruntimes control plane. Make it with
    :func:`kruntimes.kubernetes.from_kube_config` or :func:`from_incluster`; use it as
    ``with``, or call :meth:`close`."""

    def __init__(self, portal: _Portal, inner: aio.AsyncClient) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def namespace(self) -> str:
        """The namespace used when a call names none."""
        return self._inner.namespace

    def runtime(self, namespace: str, name: str | None = None) -> Runtime:
        """The Runtime ``name`` in ``namespace`` (or ``runtime(name)``)."""
        return Runtime(self._portal, self._inner.runtime(namespace, name))

    def open(self, namespace: str, name: str | None = None) -> Sandbox:
        """Attaches to an existing sandbox."""
        return Sandbox(self._portal, self._portal.call(self._inner.open(namespace, name)))

    def checkpoint(self, namespace: str, name: str | None = None) -> Checkpoint:
        """An existing checkpoint as it is now: ``checkpoint(ns, name)`` or ``checkpoint(name)``."""
        return self._portal.call(self._inner.checkpoint(namespace, name))

    def delete_checkpoint(self, checkpoint: Checkpoint | str, *, namespace: str | None = None) -> bool:
        """Deletes a checkpoint (a :class:`~kruntimes.Checkpoint`: only that very Snapshot);
        False when it was gone already."""
        return self._portal.call(self._inner.delete_checkpoint(checkpoint, namespace=namespace))

    def fork(
        self,
        snapshot: Checkpoint | str,
        *,
        count: int = 1,
        suspended: bool = False,
        runtime: str | None = None,
        namespace: str | None = None,
        options: AcquireOptions | None = None,
        **kwargs: Any,
    ) -> list[Sandbox]:
        """Starts ``count`` (1 to 100) sandboxes from a Ready checkpoint and waits until each
        is Ready (``suspended=True``: Suspended, to be resumed later); all or none (see
        :meth:`kruntimes.aio.AsyncClient.fork`)."""
        forks = self._portal.call(
            self._inner.fork(
                snapshot,
                count=count,
                suspended=suspended,
                runtime=runtime,
                namespace=namespace,
                options=options,
                **kwargs,
            )
        )
        return [Sandbox(self._portal, inner) for inner in forks]

    def task(self, namespace: str, name: str | None = None) -> Task:
        """An existing task Run."""
        return Task(self._portal, self._portal.call(self._inner.task(namespace, name)))

    def function(self, namespace: str, name: str | None = None) -> Function:
        """An existing, Ready function Run."""
        return Function(self._portal, self._portal.call(self._inner.function(namespace, name)))

    def close(self) -> None:
        """Closes every connection and stops the client's loop thread."""
        if not self._portal.loop.is_closed():
            self._portal.call(self._inner.close())
            self._portal.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make(factory: Any) -> Client:
    portal = _Portal()

    async def build() -> aio.AsyncClient:
        # The async objects are made on the loop that will run them.
        client: aio.AsyncClient = factory()
        return client

    try:
        return Client(portal, portal.call(build()))
    except BaseException:
        portal.stop()
        raise


def from_kube_config(
    path: str | os.PathLike[str] | None = None,
    context: str | None = None,
    *,
    namespace: str | None = None,
    gateway_url: str | None = None,
) -> Client:
    """A client from a kubeconfig (see :func:`kruntimes.aio.from_kube_config`)."""
    return _make(lambda: aio.from_kube_config(path, context, namespace=namespace, gateway_url=gateway_url))


def from_incluster(*, namespace: str | None = None, gateway_url: str | None = None) -> Client:
    """A client from the Pod's service account (see :func:`kruntimes.aio.from_incluster`)."""
    return _make(lambda: aio.from_incluster(namespace=namespace, gateway_url=gateway_url))
