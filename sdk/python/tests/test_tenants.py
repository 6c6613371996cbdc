"""Tenants through the SDK: a tenant's token (`cairn token create NAME
--tenant T`) lists, reaches and makes its own sandboxes, snapshots and
sessions only; another tenant's answer as absent ones do; limits refuse
with nothing made."""

import json
import subprocess
import uuid

import pytest

import cairn


def _tenant_client(server, *flags):
    name = f"sdk{uuid.uuid4().hex[:8]}"
    cli = lambda *a: subprocess.run(  # noqa: E731
        [server.binary, *a, "--home", server.home], check=True, capture_output=True, text=True
    ).stdout
    cli("tenant", "create", name, *flags)
    secret = json.loads(cli("token", "create", f"{name}-sdk", "--tenant", name, "--json"))["secret"]
    return name, cairn.Client(server.url, token=secret)


def test_a_tenant_reaches_its_own_objects_only(server, client):
    a_name, a = _tenant_client(server)
    _, b = _tenant_client(server)
    with a, b:
        sb = a.sandboxes.create(name="box")
        try:
            assert sb.name == f"{a_name}-box"
            assert sb.exec(["echo", "mine"]).stdout == "mine\n"
            snap = sb.snapshot(label="kept")
            session = a.sessions.create(name="agent")
            assert [s.id for s in a.sandboxes.list() if s.id == sb.id] == [sb.id]
            assert list(b.sandboxes.list()) == []
            assert list(b.snapshots.list()) == []
            assert list(b.sessions.list()) == []
            for call in [
                lambda: b.sandboxes.get(sb.id),
                lambda: b.sandboxes.get("box"),
                lambda: b.sandboxes.exec(sb.id, ["true"]),
                lambda: b.sandboxes.snapshot(sb.id),
                lambda: b.sandboxes.fork(sb.id),
                lambda: b.snapshots.get(snap.id),
                lambda: b.snapshots.fork(snap.id),
                lambda: b.sessions.get(session.id),
                lambda: b.sessions.exec(session.id, ["true"]),
            ]:
                with pytest.raises(cairn.NotFound):
                    call()
            # The administrator's client on the socket sees all of it.
            assert client.sandboxes.get(sb.id).name == f"{a_name}-box"
            assert client.snapshots.get(snap.id).id == snap.id
            # A's own by the name it gave, and a fork of its snapshot is A's.
            assert a.sandboxes.get("box").id == sb.id
            forked = a.snapshots.fork(snap.id)
            assert {s.id for s in forked.sandboxes} <= {s.id for s in a.sandboxes.list()}
        finally:
            for s in list(a.sandboxes.list()):
                s.remove(force=True)


def test_a_tenants_limit_refuses_with_nothing_made(server):
    _, t = _tenant_client(server, "--max-sandboxes", "1")
    with t:
        sb = t.sandboxes.create()
        try:
            with pytest.raises(cairn.NoCapacity) as e:
                t.sandboxes.create()
            assert "at most 1 sandboxes" in e.value.message
            assert [s.id for s in t.sandboxes.list()] == [sb.id]
        finally:
            sb.remove(force=True)
        t.sandboxes.create().remove(force=True)
