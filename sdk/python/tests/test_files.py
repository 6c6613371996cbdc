import hashlib
import io
import os

import pytest

import cairn


def test_twenty_mib_upload_and_download_are_byte_exact_and_keep_the_mode(sandbox, tmp_path):
    data = os.urandom(20 << 20)
    stat = sandbox.write_file("/root/blob.bin", io.BytesIO(data), mode=0o640)
    assert (stat.size, stat.mode & 0o7777, stat.kind) == (len(data), 0o640, "file")
    inside = sandbox.exec("sha256sum /root/blob.bin").stdout.split()[0]
    assert inside == hashlib.sha256(data).hexdigest()
    assert sandbox.read_file("/root/blob.bin") == data
    dest = tmp_path / "blob.bin"
    assert sandbox.download("/root/blob.bin", dest) == len(data)
    assert dest.read_bytes() == data
    assert dest.stat().st_mode & 0o7777 == 0o640


def test_text_upload_and_stat(sandbox):
    sandbox.write_file("/tmp/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.stat("/tmp/run.sh").mode & 0o7777 == 0o755
    assert sandbox.exec(["/tmp/run.sh"]).stdout == "ran\n"
    assert sandbox.stat("/tmp").kind == "dir"


def test_missing_file_is_not_found(sandbox):
    with pytest.raises(cairn.NotFound):
        sandbox.stat("/no/such/file")
    with pytest.raises(cairn.CairnError):
        sandbox.read_file("/no/such/file")
