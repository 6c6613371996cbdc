"""Files through the real e2b SDK against what a sandbox plants and what a
client sends: a FIFO, a link to init's /proc and a link on the way are
refused by name; uploads are spooled to disk, so one past the 64 MiB the
gateway once held in memory goes through, and one past the server's limit
(a server of its own, `--max-upload 8M`) is refused with 413 and writes
nothing, not even the files of its form that fitted. File metadata (envd
0.6.2's `X-Metadata-*`) is kept as `user.e2b.*` attributes of the file."""

import hashlib
import io
import os

import httpx
import pytest
from e2b import Sandbox, SandboxException


@pytest.fixture
def sbx():
    s = Sandbox.create()
    yield s
    Sandbox.kill(s.sandbox_id)


@pytest.fixture(scope="module")
def small_server(server_of_its_own):
    """A second `cairn serve --e2b`, on a state directory of its own, whose
    uploads are limited to 8 MiB."""
    with server_of_its_own("small", "--max-upload", "8M") as server:
        yield server


def _md5(sbx, path):
    return sbx.commands.run(f"md5sum {path}").stdout.split()[0]


def test_planted_fifos_and_links_are_refused_by_name(sbx):
    sbx.commands.run("mkfifo /tmp/fifo && ln -s /proc/1 /tmp/p1 && mkdir /tmp/real && ln -s /tmp/real /tmp/link")
    with pytest.raises(SandboxException, match="/tmp/fifo is a FIFO"):
        sbx.files.read("/tmp/fifo")
    with pytest.raises(SandboxException, match="/tmp/p1 is a symbolic link"):
        sbx.files.read("/tmp/p1/maps")
    with pytest.raises(SandboxException, match="/proc/1 is the /proc entry of the sandbox's init"):
        sbx.files.read("/proc/1/maps")
    with pytest.raises(SandboxException, match="/proc/self is a symbolic link"):
        sbx.files.list("/proc/self/fd")
    with pytest.raises(SandboxException, match="symbolic link"):
        sbx.files.write("/tmp/link/planted", "x")
    with pytest.raises(SandboxException, match="/tmp/link is a symbolic link"):
        sbx.files.write("/tmp/link/sub/planted", "x")
    assert sbx.commands.run("ls -A /tmp/real").stdout == ""


def test_an_upload_past_the_old_in_memory_cap_is_written_whole(sbx):
    data = os.urandom(80 << 20)
    digest = hashlib.md5(data).hexdigest()
    # A multipart form (bytes), then an octet-stream body (a file object).
    sbx.files.write("/home/user/form.bin", data)
    assert _md5(sbx, "/home/user/form.bin") == digest
    sbx.files.write("/home/user/stream.bin", io.BytesIO(data))
    assert _md5(sbx, "/home/user/stream.bin") == digest
    assert hashlib.md5(bytes(sbx.files.read("/home/user/stream.bin", format="bytes"))).hexdigest() == digest


def _status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_sixteen_parallel_uploads_add_at_most_64_mb_to_the_server(sbx, cairn_e2b):
    from concurrent.futures import ThreadPoolExecutor

    pid = cairn_e2b["pid"]()
    data = os.urandom(63 << 20)
    digest = hashlib.md5(data).hexdigest()
    # One upload first, so that what the first use of a path allocates once
    # (buffers, pools, the sandbox's client) is not counted as per-upload.
    sbx.files.write("/home/user/warm.bin", io.BytesIO(data))
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    before = _status_kib(pid, "VmRSS")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: sbx.files.write(f"/home/user/up{i}.bin", io.BytesIO(data)), range(16)))
    peak = _status_kib(pid, "VmHWM")
    added_mb = (peak - before) / 1000
    print(f"16 parallel 63 MiB uploads: server RSS {before / 1000:.1f} MB before, peak {peak / 1000:.1f} MB (+{added_mb:.1f})")
    assert added_mb <= 64, f"the uploads added {added_mb:.1f} MB to the server's resident memory"
    assert _md5(sbx, "/home/user/up7.bin") == digest


def test_an_upload_past_the_servers_limit_is_refused_and_writes_nothing(small_server):
    s = Sandbox.create(api_url=small_server["url"], sandbox_url=small_server["url"], api_key=small_server["key"])
    try:
        fits = os.urandom(6 << 20)
        s.files.write("/home/user/fits.bin", fits)
        assert _md5(s, "/home/user/fits.bin") == hashlib.md5(fits).hexdigest()

        too_large = os.urandom(9 << 20)
        for write in (
            lambda: s.files.write("/home/user/big.bin", too_large),
            lambda: s.files.write("/home/user/big.bin", io.BytesIO(too_large)),
            lambda: s.files.write_files(
                [{"path": "/home/user/first.bin", "data": b"small"}, {"path": "/home/user/big.bin", "data": too_large}]
            ),
            # 9 MiB of zeros in ~9 KiB of gzip: the limit counts what it inflates to.
            lambda: s.files.write("/home/user/big.bin", bytes(9 << 20), gzip=True),
        ):
            with pytest.raises(SandboxException, match="413: .*limit of 8388608 bytes"):
                write()
            assert not s.files.exists("/home/user/big.bin")
            assert not s.files.exists("/home/user/first.bin")
        assert s.commands.run("ls -A /home/user").stdout.split() == ["fits.bin"]
        # The spools (the state directory's tmp/) are gone with their uploads.
        assert [n for n in os.listdir(os.path.join(small_server["home"], "tmp")) if n.startswith(".tmp")] == []
    finally:
        s.kill()


def test_file_metadata_is_kept_with_the_file_and_reported_by_write_get_info_list_and_rename(cairn_e2b):
    sbx = Sandbox.create()
    try:
        written = sbx.files.write("/home/user/m.txt", "x", metadata={"Owner": "ci", "purpose": "a test run"})
        expected = {"owner": "ci", "purpose": "a test run"}
        assert written.metadata == expected, "keys are lowercased"
        assert sbx.files.get_info("/home/user/m.txt").metadata == expected
        listed = {e.name: e.metadata for e in sbx.files.list("/home/user")}
        assert listed["m.txt"] == expected
        # One map for every file of a batch.
        batch = sbx.files.write_files(
            [{"path": "/home/user/a", "data": "1"}, {"path": "/home/user/b", "data": "2"}], metadata={"k": "v"}
        )
        assert [w.metadata for w in batch] == [{"k": "v"}, {"k": "v"}]
        assert sbx.files.get_info("/home/user/b").metadata == {"k": "v"}
        # A rewrite without metadata replaces the file, and its metadata with it.
        sbx.files.write("/home/user/a", "again")
        assert sbx.files.get_info("/home/user/a").metadata is None
        assert sbx.files.rename("/home/user/m.txt", "/home/user/n.txt").metadata == expected
        # Refused before anything is written: a value the SDK would not send.
        token = httpx.get(
            f"{cairn_e2b['url']}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": cairn_e2b["key"]}
        ).json()["envdAccessToken"]
        r = httpx.post(
            f"{cairn_e2b['url']}/files",
            params={"path": "/home/user/bad"},
            content=b"x",
            headers={
                "Content-Type": "application/octet-stream",
                "E2b-Sandbox-Id": sbx.sandbox_id,
                "X-Access-Token": token,
                "X-Metadata-Bad": "caf\u00e9".encode(),
            },
        )
        assert r.status_code == 400 and "metadata value" in r.text, r.text
        assert not sbx.files.exists("/home/user/bad")
    finally:
        sbx.kill()


def test_the_async_client_writes_and_reads_file_metadata(cairn_e2b):
    import asyncio

    from e2b import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create()
        try:
            written = await sbx.files.write("/home/user/a.txt", "x", metadata={"Stage": "2"})
            assert written.metadata == {"stage": "2"}
            assert (await sbx.files.get_info("/home/user/a.txt")).metadata == {"stage": "2"}
            listed = {e.name: e.metadata for e in await sbx.files.list("/home/user")}
            assert listed["a.txt"] == {"stage": "2"}
            # The user the SDK names owns what it writes (root where the
            # image has no such user, as busybox has none).
            info = await sbx.files.get_info("/home/user/a.txt")
            assert (info.owner, info.permissions) == ("root", "-rw-r--r--")
        finally:
            await sbx.kill()

    asyncio.run(main())
