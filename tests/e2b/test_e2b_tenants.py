"""Tenants through the real `e2b` SDK: keys of one tenant (`cairn token
create NAME --tenant T`) neither list, reach, pause, kill, snapshot, fork
nor build upon another tenant's sandboxes, snapshots and templates, and
cannot tell them from absent ones; the administrator's key sees all;
limits refuse cleanly; removing a tenant ends its keys and access tokens."""

import json
import os
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    Template,
)


def _cairn(cairn_e2b, *args):
    return subprocess.run(
        [cairn_e2b["bin"], *args],
        env=dict(os.environ, CAIRN_HOME=cairn_e2b["home"]),
        capture_output=True,
        text=True,
    )


def _tenant(cairn_e2b, *flags):
    """A new tenant and a key of it."""
    name = f"t{uuid.uuid4().hex[:8]}"
    assert _cairn(cairn_e2b, "tenant", "create", name, *flags).returncode == 0
    out = _cairn(cairn_e2b, "token", "create", f"{name}-key", "--tenant", name, "--json")
    assert out.returncode == 0, out.stderr
    return name, json.loads(out.stdout)["secret"]


def _envd_get(s, token):
    """An envd request to sandbox `s` with access token `token`."""
    return httpx.get(
        os.environ["E2B_SANDBOX_URL"] + "/files",
        params={"path": "/etc/passwd"},
        headers={"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": token},
    )


def _status(path, key, method="GET", body=None):
    r = httpx.request(method, os.environ["E2B_API_URL"] + path, headers={"X-API-KEY": key}, json=body)
    return r.status_code, r.json() if r.content else None


def test_a_tenants_key_reaches_its_own_sandboxes_only(cairn_e2b):
    _, a = _tenant(cairn_e2b)
    _, b = _tenant(cairn_e2b)
    sa = Sandbox.create(api_key=a, metadata={"who": "a"})
    sb = Sandbox.create(api_key=b)
    try:
        assert sa.commands.run("echo a").stdout == "a\n"
        mine = [s.sandbox_id for s in Sandbox.list(api_key=b).next_items()]
        assert mine == [sb.sandbox_id]
        admin = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sa.sandbox_id in admin and sb.sandbox_id in admin
        # Every call on A's sandbox with B's key: not found, as if absent.
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sa.sandbox_id, api_key=b)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sa.sandbox_id, api_key=b)
        with pytest.raises(NotFoundException):
            Sandbox.set_timeout(sa.sandbox_id, 60, api_key=b)
        with pytest.raises(NotFoundException):
            Sandbox.pause(sa.sandbox_id, api_key=b)
        assert Sandbox.kill(sa.sandbox_id, api_key=b) is False
        for method, path in [
            ("GET", "/sandboxes/{}"),
            ("DELETE", "/sandboxes/{}"),
            ("POST", "/sandboxes/{}/pause"),
            ("POST", "/v2/sandboxes/{}/connect"),
            ("POST", "/sandboxes/{}/snapshots"),
            ("POST", "/sandboxes/{}/fork"),
            ("POST", "/sandboxes/{}/timeout"),
            ("GET", "/sandboxes/{}/metrics"),
            ("PUT", "/sandboxes/{}/network"),
        ]:
            theirs = _status(path.format(sa.sandbox_id), b, method, {})
            absent = _status(path.format("i" + sa.sandbox_id[1:]), b, method, {})
            assert theirs[0] == absent[0] == 404, (path, theirs, absent)
            assert json.dumps(theirs[1]).replace(sa.sandbox_id, "X") == json.dumps(absent[1]).replace(
                "i" + sa.sandbox_id[1:], "X"
            ), (path, theirs, absent)
        # Metrics of several: another tenant's are left out, as unknown ones.
        status, many = _status(f"/sandboxes/metrics?sandbox_ids={sa.sandbox_id},{sb.sandbox_id}", b)
        assert status == 200 and sa.sandbox_id not in many["sandboxes"], many
        # A's sandbox goes on, untouched.
        assert sa.is_running()
        assert Sandbox.get_info(sa.sandbox_id, api_key=a).metadata == {"who": "a"}
        # A's snapshot is neither listed for B nor a template B can start.
        snap = sa.create_snapshot().snapshot_id
        assert snap not in [s.snapshot_id for s in Sandbox.list_snapshots(api_key=b).next_items()]
        assert snap in [s.snapshot_id for s in Sandbox.list_snapshots(api_key=a).next_items()]
        with pytest.raises(SandboxException, match="404"):
            Sandbox.create(snap, api_key=b)
        assert _status(f"/templates/{snap}", b, "DELETE")[0] == 404
        from_snap = Sandbox.create(snap, api_key=a)
        try:
            assert from_snap.commands.run("echo restored").stdout == "restored\n"
            # A fork of A's is A's.
            assert from_snap.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=b).next_items()]
            assert from_snap.sandbox_id in [s.sandbox_id for s in Sandbox.list(api_key=a).next_items()]
        finally:
            from_snap.kill()
    finally:
        Sandbox.kill(sa.sandbox_id, api_key=a)
        Sandbox.kill(sb.sandbox_id, api_key=b)


def test_templates_are_their_tenants_and_the_administrators_are_shared(cairn_e2b):
    _, a = _tenant(cairn_e2b)
    _, b = _tenant(cairn_e2b)
    mine = f"tpl-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_base_image().run_cmd("echo a > /tmp/who"), mine, api_key=a)
    shared = f"shared-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_base_image().run_cmd("echo admin > /tmp/who"), shared)
    assert Template.exists(mine, api_key=a) and not Template.exists(mine, api_key=b)
    assert Template.exists(shared, api_key=b)
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(mine, api_key=b)
    # B removes neither A's template nor the administrator's.
    assert _status(f"/templates/{mine}", b, "DELETE")[0] == 404
    assert _status(f"/templates/{shared}", b, "DELETE")[0] == 404
    assert Template.exists(mine, api_key=a) and Template.exists(shared)
    # Names are each tenant's own: B builds a "shared" and a "mine" of its
    # own, which it starts from; A still starts the administrator's and its own.
    Template.build(Template().from_base_image().run_cmd("echo b-shared > /tmp/who"), shared, api_key=b)
    Template.build(Template().from_base_image().run_cmd("echo b-mine > /tmp/who"), mine, api_key=b)
    for key, template, who in [
        (a, mine, "a"),
        (a, shared, "admin"),
        (b, shared, "b-shared"),
        (b, mine, "b-mine"),
        (None, shared, "admin"),
    ]:
        s = Sandbox.create(template, api_key=key) if key else Sandbox.create(template)
        try:
            assert s.commands.run("cat /tmp/who").stdout == f"{who}\n", (template, who)
        finally:
            s.kill()


def test_limits_refuse_cleanly_and_removing_a_tenant_ends_its_keys_and_tokens(cairn_e2b):
    name, key = _tenant(cairn_e2b, "--max-sandboxes", "1")
    s = Sandbox.create(api_key=key)
    assert s.commands.run("echo one").stdout == "one\n"
    with pytest.raises(RateLimitException, match="at most 1 sandboxes"):
        Sandbox.create(api_key=key)
    assert [x.sandbox_id for x in Sandbox.list(api_key=key).next_items()] == [s.sandbox_id]
    # Paused, it holds no sandbox (its snapshot is what it is now), as
    # E2B counts running sandboxes against a team's limit.
    s.pause()
    held = json.loads(_cairn(cairn_e2b, "tenant", "ls", "--json").stdout)
    assert next(t for t in held if t["tenant"]["name"] == name)["holds"]["sandboxes"] == 0
    s = Sandbox.connect(s.sandbox_id, api_key=key)
    token = s._envd_access_token
    assert _envd_get(s, token).status_code == 200
    refused = _cairn(cairn_e2b, "tenant", "rm", name)
    assert refused.returncode != 0 and "still has 1 sandbox(es)" in refused.stderr, refused.stderr
    assert _cairn(cairn_e2b, "tenant", "rm", "--force", name).returncode == 0
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=key).next_items()
    assert _envd_get(s, token).status_code in (401, 404, 502)
    # The gateway notices within a second or so (it reads tokens each second).
    deadline = time.time() + 10
    while s.sandbox_id in [x.sandbox_id for x in Sandbox.list().next_items()]:
        assert time.time() < deadline, "the removed tenant's sandbox is still listed"
        time.sleep(0.2)
    # Who did what: its calls through the E2B API and to its sandboxes'
    # envd (with the access token issued to its key), with its tenant. The
    # log is written behind the answers (the server logs a batch that was
    # slow to land): its newest rows may take a moment to show.
    deadline = time.time() + 30
    while True:
        log = json.loads(_cairn(cairn_e2b, "token", "log", "--tenant", name, "--json", "-n", "1000").stdout)
        assert log and all(r["tenant"] == name and r["surface"] in ("e2b", "envd") for r in log), log
        read = [r for r in log if (r["surface"], r["method"], r["path"]) == ("envd", "GET", "/files")]
        if any(r["status"] == 200 for r in read):
            break
        rows = [(r["at"], r["surface"], r["method"], r["path"], r["status"]) for r in log]
        assert time.time() < deadline, f"the envd request made before the removal is not in the log: {rows}"
        time.sleep(0.2)
    # An envd row names the API key its access token was issued to.
    assert {r["token"] for r in log if r["surface"] == "envd"} <= {r["token"] for r in log if r["surface"] == "e2b"}, log
    assert any(r["method"] == "POST" and r["path"].endswith("/sandboxes") and r["status"] == 429 for r in log), log


def test_revoking_a_tenants_key_ends_the_access_tokens_it_was_issued(cairn_e2b):
    name, a = _tenant(cairn_e2b)
    out = _cairn(cairn_e2b, "token", "create", f"{name}-second", "--tenant", name, "--json")
    assert out.returncode == 0, out.stderr
    second = json.loads(out.stdout)["secret"]
    s = Sandbox.create(api_key=second)
    try:
        token = s._envd_access_token
        assert _envd_get(s, token).status_code == 200
        assert _cairn(cairn_e2b, "token", "rm", f"{name}-second").returncode == 0
        assert _envd_get(s, token).status_code == 401
        with pytest.raises(AuthenticationException):
            Sandbox.list(api_key=second).next_items()
        # The tenant's other key still reaches the sandbox, with a new
        # access token issued to it.
        again = Sandbox.connect(s.sandbox_id, api_key=a)
        assert again.commands.run("echo still").stdout == "still\n"
    finally:
        Sandbox.kill(s.sandbox_id)
