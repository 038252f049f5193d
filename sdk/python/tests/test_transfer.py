"""Large files and directories, streamed (``upload``/``download``, ``*_file``, ``*_dir``),
sync and async, against the real session file endpoints."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import stat
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

import kruntimes
from kruntimes import AcquireOptions
from kruntimes.aio import AsyncClient, from_kube_config
from kruntimes.aio._transfer import _link_stays_inside

from .conftest import Server

MIB = 1024 * 1024


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as out:
        left = size
        while left:
            chunk = os.urandom(min(left, MIB))
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def test_a_large_file_goes_up_and_down_byte_identical_without_being_held(
    sandbox: kruntimes.Sandbox, tmp_path: Path
) -> None:
    size = 40 * MIB + 12345
    local = tmp_path / "blob.bin"
    digest = _random_file(local, size)
    local.chmod(0o755)
    sandbox.make_directory("big")
    tracemalloc.start()
    try:
        uploaded = sandbox.upload_file(local, "big/blob.bin")
        _, up_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        back = tmp_path / "back.bin"
        assert sandbox.download_file("big/blob.bin", back) == size
        _, down_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert uploaded == kruntimes.Uploaded(path="big/blob.bin", size_bytes=size, files=1)
    # Streamed: neither direction held more than a few chunks of the 40 MiB.
    assert up_peak < 8 * MIB and down_peak < 8 * MIB, (up_peak, down_peak)
    assert _sha256(back) == digest
    assert back.stat().st_mode & 0o777 == 0o755, "the executable bit comes back"
    there = sandbox.exec(["sh", "-c", "sha256sum big/blob.bin; test -x big/blob.bin && echo x"])
    assert there.stdout.decode().split() == [digest, "big/blob.bin", "x"]
    assert not [p.name for p in tmp_path.iterdir() if ".krt-part-" in p.name]

    # A stream of unknown length, into a writer of any kind.
    sink = io.BytesIO()
    assert sandbox.upload("big/small.txt", io.BytesIO(b"hello " * 1000)).size_bytes == 6000
    assert sandbox.download("big/small.txt", sink) == 6000 and sink.getvalue() == b"hello " * 1000
    chunks: list[bytes] = []
    assert sandbox.download("big/small.txt", chunks.append) == 6000 and b"".join(chunks) == b"hello " * 1000
    assert sandbox.exec(["test", "-x", "big/small.txt"]).exit_code == 1


def _tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            out[rel] = ("link", os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            out[rel] = ("dir",)
        else:
            out[rel] = ("file", path.read_bytes(), bool(info.st_mode & 0o111))
    return out


def test_a_directory_goes_up_and_down_as_tar(sandbox: kruntimes.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep" / "er").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "README").write_text("read me\n")
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "pkg" / "deep" / "er" / "data.bin").write_bytes(os.urandom(3 * MIB))
    (src / "pkg" / "link").symlink_to("deep/er/data.bin")
    for i in range(300):
        (src / "pkg" / "deep" / f"f{i:03}.txt").write_text(str(i))
    # Neither a file, a directory nor a link: left out of the archive.
    os.mkfifo(src / "pkg" / "fifo")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(src / "pkg" / "sock"))
    uploaded = sandbox.upload_dir(src, "tree")
    assert (uploaded.path, uploaded.files) == ("tree", 303)
    (src / "pkg" / "fifo").unlink()
    (src / "pkg" / "sock").unlink()
    assert sandbox.exec(["sh", "tree/pkg/run.sh"]).stdout == b"ran\n"
    assert sandbox.exec(["readlink", "tree/pkg/link"]).stdout == b"deep/er/data.bin\n"

    back = tmp_path / "back"
    assert sandbox.download_dir("tree", back) > 3 * MIB
    assert _tree(back) == _tree(src)

    # Only into a new or empty directory; and only into an empty local one.
    with pytest.raises(kruntimes.Conflict) as occupied:
        sandbox.upload_dir(src, "tree")
    assert occupied.value.reason == "DirectoryNotEmpty"
    with pytest.raises(kruntimes.InvalidRequest, match="not empty"):
        sandbox.download_dir("tree", back)
    with pytest.raises(kruntimes.InvalidRequest, match="not a directory"):
        sandbox.upload_dir(src / "README", "other")


def test_transfers_refuse_escapes_files_over_the_cap_and_short_sources(
    sandbox: kruntimes.Sandbox, tmp_path: Path
) -> None:
    with pytest.raises(kruntimes.InvalidRequest) as escape:
        sandbox.upload("../outside.txt", io.BytesIO(b"x"))
    assert escape.value.status == 400
    with pytest.raises(kruntimes.InvalidRequest) as escape:
        sandbox.download("../../etc/passwd", io.BytesIO())
    assert escape.value.status == 400
    assert sandbox.exec(["ln", "-sfn", "/", "root-link"]).exit_code == 0
    with pytest.raises(kruntimes.InvalidRequest) as through:
        sandbox.upload("root-link/tmp/x", io.BytesIO(b"x"))
    assert (through.value.status, through.value.reason) == (400, "PathEscapes")

    # Over the cap (1 GiB): refused at the announced length, before the bytes (sparse).
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as f:
        f.truncate(1024 * MIB + 1)
    with pytest.raises(kruntimes.InvalidRequest) as too_large:
        sandbox.upload_file(huge, "huge.bin")
    assert (too_large.value.status, too_large.value.reason) == (413, "FileTooLarge")

    # A source shorter than announced writes nothing: the earlier file stays.
    sandbox.upload("keep.txt", io.BytesIO(b"old"))
    with pytest.raises(kruntimes.InvalidRequest, match="ended after 3 of the 10 bytes"):
        sandbox.upload("keep.txt", io.BytesIO(b"new"), size=10)
    assert sandbox.read_file("keep.txt") == b"old"

    with pytest.raises(kruntimes.NotFound):
        sandbox.download("no/such/file", io.BytesIO())
    with pytest.raises(kruntimes.NotFound):
        sandbox.upload("no/such/dir/file", io.BytesIO(b"x"))
    sandbox.make_directory("a-dir")
    with pytest.raises(kruntimes.InvalidRequest) as directory:
        sandbox.download("a-dir", io.BytesIO())
    assert directory.value.reason == "IsADirectory"
    with pytest.raises(kruntimes.InvalidRequest, match="download_dir"):
        sandbox.download("", io.BytesIO())
    # A failed download leaves no local file and no temporary.
    target = tmp_path / "never.bin"
    with pytest.raises(kruntimes.NotFound):
        sandbox.download_file("no/such/file", target)
    assert list(tmp_path.iterdir()) == [huge]


def test_a_downloaded_archive_with_a_link_pointing_out_is_refused(sandbox: kruntimes.Sandbox, tmp_path: Path) -> None:
    made = sandbox.exec(["sh", "-c", "mkdir -p evil/sub && echo hi > evil/a && ln -s /etc evil/sub/etc"])
    assert made.exit_code == 0, made
    local = tmp_path / "evil"
    with pytest.raises(kruntimes.InvalidRequest) as refused:
        sandbox.download_dir("evil", local)
    assert refused.value.reason == "InvalidArchive" and "points out" in str(refused.value)
    assert not (local / "sub" / "etc").exists() and not (local / "sub" / "etc").is_symlink()


def test_links_must_stay_inside() -> None:
    # The Rust SDK's cases (kruntimes-client sandbox/transfer.rs).
    assert _link_stays_inside("a", "b")
    assert _link_stays_inside("d/a", "../b")
    assert not _link_stays_inside("a", "../b")
    assert not _link_stays_inside("a", "/etc")
    assert not _link_stays_inside("d/a", "x/../../..")


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


@pytest.mark.asyncio
async def test_async_transfers_stream_both_ways(aclient: AsyncClient, tmp_path: Path) -> None:
    runtime = aclient.runtime("default", "bash")
    async with await runtime.acquire_sandbox(AcquireOptions(generate_name="async-files-")) as sb:
        pieces = [os.urandom(MIB) for _ in range(12)]

        async def source() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        uploaded = await sb.upload("blob", source(), size=12 * MIB)
        assert uploaded.size_bytes == 12 * MIB
        received = hashlib.sha256()
        assert await sb.download("blob", received.update) == 12 * MIB
        assert received.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()

        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "x").write_bytes(b"x" * 100)
        assert (await sb.upload_dir(src, "tree")).files == 1
        back = tmp_path / "back"
        await sb.download_dir("", back)
        assert (back / "tree" / "d" / "x").read_bytes() == b"x" * 100
        assert (back / "blob").stat().st_size == 12 * MIB
        with pytest.raises(kruntimes.InvalidRequest) as escape:
            await sb.upload("../x", source())
        assert escape.value.status == 400
