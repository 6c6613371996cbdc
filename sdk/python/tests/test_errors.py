import time

import pytest

import cairn


def test_unknown_sandbox_is_not_found_naming_the_id(client):
    with pytest.raises(cairn.NotFound) as e:
        client.sandboxes.get("no-such-sandbox")
    assert e.value.status == 404 and e.value.code == "not_found"
    assert "no-such-sandbox" in e.value.message
    with pytest.raises(cairn.NotFound):
        client.sandboxes.exec("no-such-sandbox", "true")


def test_bad_token_is_unauthorized(server):
    with cairn.Client(server.url, token="cairn_not_a_real_token") as c:
        with pytest.raises(cairn.Unauthorized) as e:
            list(c.sandboxes.list())
    assert e.value.status == 401 and e.value.code == "unauthorized"


def test_unknown_field_is_a_bad_request_naming_it(client):
    with pytest.raises(cairn.BadRequest) as e:
        client.request("POST", "/v1/sandboxes", json={"imagee": "busybox"})
    assert e.value.code == "bad_request" and "imagee" in e.value.message


def test_no_server_is_a_clear_connection_error(tmp_path):
    sock = str(tmp_path / "cairn.sock")
    with cairn.Client(socket=sock) as c:
        with pytest.raises(cairn.ConnectError) as e:
            c.health()
    assert sock in str(e.value) and "cairn serve" in str(e.value)
    with cairn.Client("http://127.0.0.1:9", token="t") as c:
        with pytest.raises(cairn.ConnectError) as e:
            c.health()
    assert "http://127.0.0.1:9" in str(e.value)


def test_environment_selects_the_server_and_arguments_override_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CAIRN_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("CAIRN_TOKEN", "from-env")
    c = cairn.Client()
    assert c.where == "http://127.0.0.1:1" and c._http.headers["authorization"] == "Bearer from-env"
    assert cairn.Client(token="explicit")._http.headers["authorization"] == "Bearer explicit"
    assert cairn.Client(socket=str(tmp_path / "s.sock")).where == f"unix socket {tmp_path / 's.sock'}"
    monkeypatch.delenv("CAIRN_URL")
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path))
    assert cairn.Client().where == f"unix socket {tmp_path / 'cairn.sock'}"


def test_records_ignore_fields_a_newer_server_adds():
    sb = cairn.Sandbox.from_dict({"id": "x", "name": "x", "image": "busybox", "driver": "native",
                                  "state": "running", "brand_new_field": [1, 2]})
    assert sb.id == "x" and not hasattr(sb, "brand_new_field")


def test_a_create_larger_than_the_whole_capacity_raises_no_capacity_at_once(client, sandbox):
    before = [s.id for s in client.sandboxes.list()]
    started = time.monotonic()
    # A memory limit beyond any host's budget: it would never start, so it
    # is refused at once rather than after its wait.
    with pytest.raises(cairn.NoCapacity) as e:
        client.sandboxes.create(memory="64T", wait=30, priority=5)
    assert time.monotonic() - started < 10
    assert e.value.status == 429 and e.value.code == "no_capacity" and "whole capacity" in str(e.value)
    assert [s.id for s in client.sandboxes.list()] == before, "a refused create made a sandbox"
    with pytest.raises(cairn.BadRequest, match="Request-Timeout"):
        client.sandboxes.create(wait=-1)
