"""Large files and whole directories in and out of a sandbox, streamed through the session
file endpoints (``PUT``/``GET {base}/files``; ``archive=tar`` for a directory): no side
holds a whole file. A local file is read, and written, a chunk at a time off the event
loop; a directory goes as a tar stream made (or unpacked) by a thread of its own, joined
to the connection by a bounded channel of :data:`CHANNEL_CHUNKS` chunks.

Unpacking refuses what would leave the local directory, as the server does for uploads:
absolute names, ``..``, an entry under a symlink, a symlink pointing out, a hard link to
anything but an earlier file of the archive, and devices, FIFOs and sparse files.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import secrets
import stat
import tarfile
import threading
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import httpx2

from ..errors import InvalidRequest, KruntimesError, OutcomeUnknown, Unavailable
from ..models import Uploaded
from ._client import CALL_TIMEOUT, error_answer, transport_error
from ._http1 import AnswerTimeout, AnswerTooLarge, Broken, NotSent
from ._wake import through_wake

if TYPE_CHECKING:
    from ._sandbox import AsyncSandbox

#: Chunks read from a local file or cut from a tar stream.
CHUNK_BYTES = 256 * 1024
#: Chunks buffered between a tar thread and the connection.
CHANNEL_CHUNKS = 8
#: A pause longer than this in a transfer's bytes fails it, in seconds.
TRANSFER_IDLE_TIMEOUT = 60.0
#: The largest answer of an upload (its JSON summary) or error read.
MAX_ANSWER_BYTES = 64 * 1024
#: The most entries unpacked from one archive (the server's bound for uploads).
MAX_ARCHIVE_ENTRIES = 100_000


class Readable(Protocol):
    """A binary source: ``read(n)`` returns at most ``n`` bytes, ``b""`` at the end."""

    def read(self, n: int, /) -> bytes: ...


class Writable(Protocol):
    """A binary sink: ``write(data)``."""

    def write(self, data: bytes, /) -> Any: ...


class _Closed(Exception):
    """The other end of a channel gave up."""


class _SourceError(Exception):
    """The local side of a transfer failed (a file that cannot be read, a short source)."""


class _Channel:
    """A bounded queue of chunks between a thread and the event loop, closable from either
    end: the thread side blocks, the loop side awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int = CHANNEL_CHUNKS) -> None:
        self._loop = loop
        self._size = size
        self._items: deque[bytes] = deque()
        self._cond = threading.Condition()
        self._ended = False
        self._closed = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _signal(self) -> None:
        # Called with the lock held: wakes both sides.
        self._cond.notify_all()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._loop.call_soon_threadsafe(_resolve, waiter)

    # -- either side --------------------------------------------------------------------

    def finish(self, error: BaseException | None = None) -> None:
        """The producer: no more chunks (``error``: the stream failed)."""
        with self._cond:
            self._ended = True
            self._error = error
            self._signal()

    def close(self) -> None:
        """The consumer gave up: the producer's next put raises."""
        with self._cond:
            self._closed = True
            self._signal()

    # -- thread side --------------------------------------------------------------------

    def put(self, chunk: bytes) -> None:
        with self._cond:
            while len(self._items) >= self._size and not self._closed:
                self._cond.wait()
            if self._closed:
                raise _Closed()
            self._items.append(chunk)
            self._signal()

    def get(self) -> bytes | None:
        with self._cond:
            while not self._items and not self._ended and not self._closed:
                self._cond.wait()
            return self._take()

    def _take(self) -> bytes | None:
        if self._items:
            chunk = self._items.popleft()
            self._signal()
            return chunk
        if self._closed:
            raise _Closed()
        if self._error is not None:
            raise self._error
        return None

    # -- loop side ----------------------------------------------------------------------

    async def aput(self, chunk: bytes) -> None:
        while True:
            with self._cond:
                if self._closed:
                    raise _Closed()
                if len(self._items) < self._size:
                    self._items.append(chunk)
                    self._signal()
                    return
                waiter = self._waiter = self._loop.create_future()
            await waiter

    async def aget(self) -> bytes | None:
        while True:
            with self._cond:
                if self._items or self._ended or self._closed:
                    return self._take()
                waiter = self._waiter = self._loop.create_future()
            await waiter


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _ChannelWriter(io.RawIOBase):
    """A writable file over a channel, in chunks of :data:`CHUNK_BYTES` (for tarfile)."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buffer += view
        while len(self._buffer) >= CHUNK_BYTES:
            self._channel.put(bytes(self._buffer[:CHUNK_BYTES]))
            del self._buffer[:CHUNK_BYTES]
        return len(view)

    def flush(self) -> None:
        if self._buffer:
            self._channel.put(bytes(self._buffer))
            self._buffer.clear()


class _ChannelReader(io.RawIOBase):
    """A readable file over a channel (for tarfile)."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._current = b""
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._offset >= len(self._current):
            chunk = self._channel.get()
            if chunk is None:
                return 0
            self._current, self._offset = chunk, 0
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._current) - self._offset)
        view[:n] = self._current[self._offset : self._offset + n]
        self._offset += n
        return n


def query_path(path: str) -> str:
    return quote(path, safe="")


# ---------------------------------------------------------------------------------------
# Uploads
# ---------------------------------------------------------------------------------------


async def _reader_chunks(reader: Readable | AsyncIterable[bytes], size: int | None) -> AsyncIterator[bytes]:
    """The source's bytes in chunks; with ``size``, exactly that many or a failure."""
    sent = 0
    if isinstance(reader, AsyncIterable):
        async for chunk in reader:
            if not isinstance(chunk, (bytes, bytearray, memoryview)):
                raise _SourceError(f"the source gave {type(chunk).__name__}, not bytes")
            data = bytes(chunk)
            sent += len(data)
            if size is not None and sent > size:
                raise _SourceError(f"the source gave more than the {size} bytes announced")
            if data:
                yield data
    else:
        loop = asyncio.get_running_loop()
        while True:
            want = CHUNK_BYTES if size is None else min(CHUNK_BYTES, size - sent)
            if want <= 0:
                break
            try:
                data = await loop.run_in_executor(None, reader.read, want)
            except OSError as e:
                raise _SourceError(f"cannot read the source: {e}") from None
            if not data:
                break
            sent += len(data)
            yield bytes(data)
    if size is not None and sent != size:
        raise _SourceError(f"the source ended after {sent} of the {size} bytes announced")


async def _channel_chunks(channel: _Channel) -> AsyncIterator[bytes]:
    try:
        while True:
            chunk = await channel.aget()
            if chunk is None:
                return
            yield chunk
    finally:
        channel.close()


async def put(sandbox: AsyncSandbox, query: str, body: AsyncIterator[bytes], size: int | None) -> Uploaded:
    """``PUT {endpoint}/files?{query}`` with ``body`` streamed; the upload's summary.

    The answer is read while the body is still being sent (the invoke path's HTTP/1.1
    connections): a refusal that comes mid-body (``DirectoryNotEmpty``, ``FileTooLarge``)
    is reported as such, not as a broken connection."""
    endpoint = await sandbox._awake_target(reads=False)
    connection = sandbox._connection
    pool = connection.invoker(endpoint.origin, endpoint.ca_bundle)
    url = f"{endpoint.url}/files?{query}"
    headers = [("Content-Type", "application/octet-stream")]
    authorization = await connection.authorization()
    if authorization is not None:
        headers.append(("Authorization", authorization))
    try:
        answer = await pool.request_streamed(
            "PUT",
            f"{endpoint.path}/files?{query}",
            headers,
            body,
            size,
            limit=MAX_ANSWER_BYTES,
            idle_timeout=TRANSFER_IDLE_TIMEOUT,
            answer_timeout=CALL_TIMEOUT,
            connect_timeout=30.0,
        )
    except _SourceError as e:
        raise InvalidRequest(f"cannot upload to {url}: {e}; nothing was written") from None
    except NotSent as e:
        raise Unavailable(f"cannot reach {url}; nothing was sent: {e}") from None
    except AnswerTooLarge:
        raise KruntimesError(f"the answer of {url} is over {MAX_ANSWER_BYTES} bytes") from None
    except (AnswerTimeout, Broken, OSError) as e:
        raise OutcomeUnknown(
            f"the upload to {url} broke off after it started; it may or may not have been written: "
            f"{e or type(e).__name__}"
        ) from None
    if answer.status == 401 and authorization is not None:
        # Refused before a byte was read: fresh credentials (a token file read again, an
        # exec plugin run again) for the next call; this one's body is spent.
        await connection.authorization(rejected=authorization)
    if answer.status != 200:
        raise error_answer(answer.status, answer.body, answer.headers)
    from ._sandbox import _json_object

    summary = _json_object(answer.body)
    return Uploaded(
        path=str(summary.get("path") or ""),
        size_bytes=int(summary.get("sizeBytes") or 0),
        files=int(summary.get("files") or 0),
    )


async def _bounded(response: httpx2.Response, limit: int, url: str) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise KruntimesError(f"the answer of {url} is over {limit} bytes")
    return bytes(body)


async def upload(
    sandbox: AsyncSandbox,
    path: str,
    reader: Readable | AsyncIterable[bytes],
    *,
    size: int | None,
    executable: bool,
    archive: bool = False,
) -> Uploaded:
    if size is not None and size < 0:
        raise InvalidRequest("an upload's size is zero or more bytes")
    query = f"path={query_path(path)}"
    if archive:
        query += "&archive=tar"
    elif executable:
        query += "&executable=true"
    return await put(sandbox, query, _reader_chunks(reader, size), size)


async def upload_file(sandbox: AsyncSandbox, local: str | os.PathLike[str], path: str) -> Uploaded:
    loop = asyncio.get_running_loop()
    try:
        file = await loop.run_in_executor(None, open, os.fspath(local), "rb")
    except OSError as e:
        raise InvalidRequest(f"cannot open {local}: {e}") from None
    try:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequest(f"cannot upload {local}: not a regular file")
        executable = bool(info.st_mode & 0o111)
        return await upload(sandbox, path, file, size=info.st_size, executable=executable)
    finally:
        file.close()


def _pack(root: Path, channel: _Channel) -> None:
    """Writes ``root`` as a tar stream (pax) into ``channel``: regular files, directories and
    symlinks (as links), names relative to ``root``; the rest is left out."""
    writer = _ChannelWriter(channel)
    try:
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for top, dirs, files in os.walk(root, followlinks=False):
                dirs.sort()
                for name in sorted(dirs + files):
                    full = os.path.join(top, name)
                    arcname = os.path.relpath(full, root)
                    info = tar.gettarinfo(full, arcname)
                    if info is None:
                        continue  # a socket: tarfile has no entry for it
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    if info.isreg():
                        with open(full, "rb") as source:
                            tar.addfile(info, source)
                    elif info.isdir() or info.issym() or info.islnk():
                        tar.addfile(info)
        writer.flush()
    except _Closed:
        return
    except BaseException as e:
        channel.finish(_SourceError(f"cannot pack {root}: {e}"))
        return
    channel.finish()


async def upload_dir(sandbox: AsyncSandbox, local: str | os.PathLike[str], path: str) -> Uploaded:
    root = Path(local)
    if not root.is_dir():
        raise InvalidRequest(f"cannot upload {local}: not a directory")
    channel = _Channel(asyncio.get_running_loop())
    packer = threading.Thread(target=_pack, args=(root, channel), name="kruntimes-tar", daemon=True)
    packer.start()
    try:
        return await put(sandbox, f"path={query_path(path)}&archive=tar", _channel_chunks(channel), None)
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------
# Downloads
# ---------------------------------------------------------------------------------------


async def _get(sandbox: AsyncSandbox, query: str) -> tuple[httpx2.Response, str, Callable[[], Any]]:
    """``GET {endpoint}/files?{query}``: the open response (checked 200), its URL and the
    coroutine function that closes it. A session suspended for idleness is woken (the
    request is sent again until it is Ready)."""
    return await through_wake(lambda: _get_once(sandbox, query))


async def _get_once(sandbox: AsyncSandbox, query: str) -> tuple[httpx2.Response, str, Callable[[], Any]]:
    endpoint = await sandbox._target(reads=True)
    client = sandbox._connection.http(endpoint.origin, endpoint.ca_bundle)
    url = f"{endpoint.url}/files?{query}"
    request = client.build_request(
        "GET", f"{endpoint.path}/files?{query}", timeout=httpx2.Timeout(TRANSFER_IDLE_TIMEOUT, connect=30.0)
    )
    try:
        response = await asyncio.wait_for(client.send(request, stream=True), CALL_TIMEOUT)
    except asyncio.TimeoutError:
        raise KruntimesError(f"no answer from {url} within {CALL_TIMEOUT:g}s") from None
    except httpx2.TransportError as e:
        raise transport_error(e, url, mutation=False) from None
    if response.status_code != 200:
        try:
            body = await _bounded(response, MAX_ANSWER_BYTES, url)
        except (httpx2.TransportError, KruntimesError):
            body = b""
        finally:
            await response.aclose()
        raise error_answer(response.status_code, body, response.headers)
    return response, url, response.aclose


async def _download(sandbox: AsyncSandbox, path: str, write: Callable[[bytes], Any]) -> tuple[int, bool]:
    """Streams the file ``path`` into ``write`` (called off the loop); the bytes written
    and whether the file is executable."""
    if not path:
        raise InvalidRequest("the workspace is a directory: download it with download_dir", reason="IsADirectory")
    response, url, close = await _get(sandbox, f"path={query_path(path)}")
    loop = asyncio.get_running_loop()
    try:
        if response.headers.get("content-type", "").startswith("application/json"):
            raise InvalidRequest(f"{path} is a directory: download it with download_dir", reason="IsADirectory")
        announced = response.headers.get("content-length")
        written = 0
        try:
            async for chunk in response.aiter_raw():
                try:
                    await loop.run_in_executor(None, write, chunk)
                except OSError as e:
                    raise InvalidRequest(f"cannot write the download of {path}: {e}") from None
                written += len(chunk)
        except httpx2.TransportError as e:
            raise transport_error(e, url, mutation=False) from None
        if announced is not None and announced.isdigit() and int(announced) != written:
            raise KruntimesError(f"the download of {url} broke off after {written} of {announced} bytes")
        return written, response.headers.get("x-kruntimes-executable", "").lower() == "true"
    finally:
        await close()


async def download(sandbox: AsyncSandbox, path: str, writer: Writable | Callable[[bytes], Any]) -> int:
    write = writer if callable(writer) else writer.write
    written, _ = await _download(sandbox, path, write)
    return written


async def download_file(sandbox: AsyncSandbox, path: str, local: str | os.PathLike[str]) -> int:
    target = Path(local)
    temp = target.with_name(f".{target.name or 'download'}.krt-part-{secrets.token_hex(4)}")
    loop = asyncio.get_running_loop()
    try:
        file: IO[bytes] = await loop.run_in_executor(None, open, temp, "xb")
    except OSError as e:
        raise InvalidRequest(f"cannot create {temp}: {e}") from None
    try:
        written, executable = await _download(sandbox, path, file.write)

        def finish() -> None:
            file.flush()
            os.fsync(file.fileno())
            file.close()
            os.chmod(temp, 0o755 if executable else 0o644)
            os.replace(temp, target)

        try:
            await loop.run_in_executor(None, finish)
        except OSError as e:
            raise InvalidRequest(f"cannot write {target}: {e}") from None
        return written
    except BaseException:
        # Whatever failed, the local file stays as it was: the partial download goes.
        file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _link_stays_inside(path: str, target: str) -> bool:
    """Whether a symlink's ``target``, at the entry ``path`` (relative), stays beneath the
    root (as the Rust SDK's ``link_stays_inside``)."""
    if target.startswith("/"):
        return False
    depth = len([p for p in path.split("/") if p not in ("", ".")]) - 1
    seen_name = False
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if seen_name:
                return False
            depth -= 1
        else:
            seen_name = True
        if depth < 0:
            return False
    return True


class _Refused(Exception):
    """An archive entry that would leave the directory, or of a refused kind."""


def _clean_name(name: str) -> str | None:
    """An entry's relative name, ``None`` for the root itself; refuses what could leave."""
    if "\x00" in name or name.startswith("/"):
        raise _Refused(f"the archive's entry {name!r} has an absolute or invalid name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Refused(f"the archive's entry {name!r} climbs out with '..'")
    return "/".join(parts) or None


def _make_parents(root: Path, name: str) -> None:
    """Creates the parents of ``name`` under ``root`` as real directories; refuses one that
    is a symlink or not a directory."""
    current = root
    for part in name.split("/")[:-1]:
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise _Refused(f"the archive's entry {name!r} goes through {current.relative_to(root)}, not a directory")


def _clear(target: Path, name: str) -> None:
    """Removes an earlier entry at ``target`` (a later entry replaces it); never a
    directory."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise _Refused(f"the archive's entry {name!r} would replace a directory")
    os.unlink(target)


def _unpack(root: Path, channel: _Channel) -> None:
    reader = io.BufferedReader(_ChannelReader(channel), CHUNK_BYTES)
    files: set[str] = set()
    count = 0
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        for member in tar:
            count += 1
            if count > MAX_ARCHIVE_ENTRIES:
                raise _Refused(f"the archive has more than {MAX_ARCHIVE_ENTRIES} entries")
            name = _clean_name(member.name)
            if name is None:
                continue
            target = root / name
            _make_parents(root, name)
            if member.isdir():
                try:
                    info = os.lstat(target)
                except FileNotFoundError:
                    os.mkdir(target, 0o755)
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    raise _Refused(f"the archive's directory {name!r} would replace a file")
            elif member.isreg() and not member.issparse():
                _clear(target, name)
                source = tar.extractfile(member)
                assert source is not None
                mode = 0o755 if member.mode & 0o111 else 0o644
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
                with os.fdopen(fd, "wb") as out:
                    while chunk := source.read(CHUNK_BYTES):
                        out.write(chunk)
                files.add(name)
            elif member.issym():
                if not _link_stays_inside(name, member.linkname):
                    raise _Refused(f"the archive's symlink {name!r} points out of it")
                _clear(target, name)
                os.symlink(member.linkname, target)
            elif member.islnk():
                linked = _clean_name(member.linkname)
                if linked is None or linked not in files:
                    raise _Refused(f"the archive's hard link {name!r} names no earlier file of it")
                _clear(target, name)
                os.link(root / linked, target, follow_symlinks=False)
            else:
                raise _Refused(f"the archive's entry {name!r} is neither a file, a directory nor a link")


async def download_dir(sandbox: AsyncSandbox, path: str, local: str | os.PathLike[str]) -> int:
    root = Path(local)
    try:
        if any(root.iterdir()):
            raise InvalidRequest(f"cannot unpack into {root}: not empty")
    except FileNotFoundError:
        try:
            root.mkdir(parents=True)
        except OSError as e:
            raise InvalidRequest(f"cannot create {root}: {e}") from None
    except NotADirectoryError:
        raise InvalidRequest(f"cannot unpack into {root}: not a directory") from None
    response, url, close = await _get(sandbox, f"path={query_path(path)}&archive=tar")
    loop = asyncio.get_running_loop()
    channel = _Channel(loop)
    unpacked: asyncio.Future[BaseException | None] = loop.create_future()

    def unpack() -> None:
        error: BaseException | None = None
        try:
            _unpack(root, channel)
        except BaseException as e:
            error = e
        finally:
            channel.close()
        loop.call_soon_threadsafe(_settle, unpacked, error)

    threading.Thread(target=unpack, name="kruntimes-untar", daemon=True).start()
    received = 0
    network: BaseException | None = None
    try:
        async for chunk in response.aiter_raw():
            received += len(chunk)
            await channel.aput(chunk)
        channel.finish()
    except _Closed:
        pass  # the unpacker stopped: its error says why
    except httpx2.TransportError as e:
        network = transport_error(e, url, mutation=False)
        channel.finish(_Refused(f"the download of {url} broke off"))
    except BaseException:
        channel.finish(_Refused("the download was abandoned"))
        raise
    finally:
        await close()
    error = await unpacked
    if network is not None:
        raise network
    if error is not None:
        if isinstance(error, (_Refused, tarfile.TarError)):
            raise InvalidRequest(f"cannot unpack into {root}: {error}", reason="InvalidArchive") from None
        if isinstance(error, OSError):
            raise InvalidRequest(f"cannot unpack into {root}: {error}") from None
        raise error
    return received


def _settle(future: asyncio.Future[BaseException | None], error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
