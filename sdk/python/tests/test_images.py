import io
import tarfile

import pytest

import cairn


def test_build_a_busybox_image_reporting_steps_then_remove_it(client):
    steps = []
    image = client.images.build("sdk-built", "busybox", on_step=steps.append)
    assert image.name == "sdk-built" and steps
    assert "sdk-built" in [i.name for i in client.images.list()]
    with client.sandboxes.create(image="sdk-built") as sb:
        assert sb.exec("echo from the built image").stdout == "from the built image\n"
    client.images.remove("sdk-built")
    assert "sdk-built" not in [i.name for i in client.images.list()]
    with pytest.raises(cairn.NotFound):
        client.images.remove("sdk-built")


def test_unknown_image_kind_is_a_bad_request(client):
    with pytest.raises(cairn.BadRequest) as e:
        client.images.build("sdk-bad", "alpine")
    assert "alpine" in e.value.message


def test_import_a_root_filesystem_tar(client, sandbox, tmp_path):
    busybox = tmp_path / "busybox"
    sandbox.download("/bin/busybox", busybox)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(busybox), arcname="bin/busybox")
        for name in ("sh", "echo", "cat"):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    path = tmp_path / "rootfs.tar"
    path.write_bytes(buf.getvalue())
    image = client.images.import_tar("sdk-imported", str(path))
    assert image.name == "sdk-imported"
    try:
        with client.sandboxes.create(image="sdk-imported") as sb:
            assert sb.exec(["/bin/echo", "imported"]).stdout == "imported\n"
    finally:
        client.images.remove("sdk-imported")
