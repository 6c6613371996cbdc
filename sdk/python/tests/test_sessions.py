import time
import uuid

import pytest

import cairn


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_session_appends_execs_suspends_forks_rewinds_and_verifies(client):
    name = _name("agent")
    s = client.sessions.create(name=name, idle_timeout_ms=60_000, idempotency_key=name)
    assert client.sessions.create(name=name, idle_timeout_ms=60_000, idempotency_key=name).id == s.id
    try:
        assert isinstance(s, cairn.Session)
        assert (s.state, s.idle_timeout_ms, s.head_seq) == ("active", 60_000, 0)
        e = client.sessions.append(s, "user", "write a file", role="user", tokens_in=3)
        assert isinstance(e, cairn.LogEntry) and (e.seq, e.kind, e.tokens_in) == (1, "user", 3)
        call = client.sessions.append(name, "tool_call", tool="plan", arguments={"steps": ["a", "b"]})
        assert call.arguments == {"steps": ["a", "b"]}

        r = client.sessions.exec(name, "echo one > /f; cat /f; exit 2")
        assert isinstance(r, cairn.SessionExecResult)
        assert (r.exit_code, r.stdout, r.call_seq, r.result_seq) == (2, "one\n", 3, 4)

        stream = client.sessions.exec_stream(name, "echo two >> /f; sleep 0.4; echo three")
        assert [out.data for out in stream] == [b"three\n"]
        assert stream.result.exit_code == 0 and stream.result.result_seq == 6

        tail = client.sessions.log(name, tail=2)
        assert [(e.seq, e.kind) for e in tail] == [(5, "tool_call"), (6, "tool_result")]
        assert tail[0].arguments == {"argv": ["sh", "-c", "echo two >> /f; sleep 0.4; echo three"]}
        assert [e.seq for e in client.sessions.log(name, from_=2, limit=2)] == [2, 3]
        assert [e.seq for e in client.sessions.log(name)] == [1, 2, 3, 4, 5, 6]

        suspended = client.sessions.suspend(name)
        assert suspended.state == "suspended" and suspended.sandbox_id is None and suspended.snapshot_id
        with pytest.raises(cairn.Conflict):
            client.sessions.suspend(name)
        # An exec resumes it; the files came back.
        assert client.sessions.exec(name, ["cat", "/f"]).stdout == "one\ntwo\n"
        assert client.sessions.get(name).state == "active"
        client.sessions.suspend(name)
        assert client.sessions.resume(name).state == "active"

        # The suspend at entry 7 recorded a snapshot: a fork there has /f as it was.
        fork = client.sessions.fork(name, at=7, reason="try another way", name=_name("fork"))
        try:
            assert (fork.parent_id, fork.fork_seq, fork.fork_reason) == (s.id, 7, "try another way")
            assert client.sessions.exec(fork, "echo fork >> /f; cat /f").stdout == "one\ntwo\nfork\n"
            assert client.sessions.exec(name, "cat /f").stdout == "one\ntwo\n"
            assert [e.seq for e in client.sessions.log(fork, limit=7)] == [1, 2, 3, 4, 5, 6, 7]
        finally:
            client.sessions.delete(fork, purge=True)

        head = client.sessions.get(name).head_seq
        rw = client.sessions.rewind(name, 2)
        assert isinstance(rw, cairn.Rewind) and (rw.to_seq, rw.head_seq) == (2, head)
        assert [e.seq for e in client.sessions.log(name)] == [1, 2]
        assert client.sessions.append(name, "note", "again").seq == head + 1
        # Paging back from the end skips the abandoned entries.
        assert [e.seq for e in client.sessions.log(name, before=head + 1, limit=1)] == [2]
        assert [e.seq for e in client.sessions.log(name, before=head + 1)] == [1, 2]

        v = client.sessions.verify(name)
        assert isinstance(v, cairn.Verification) and v.ok and v.entries == head + 1 and v.first_bad is None
        assert s.id in [x.id for x in client.sessions.list(state="active")]
    finally:
        client.sessions.delete(name)
    assert client.sessions.get(name).state == "closed"
    assert client.sessions.log(name, tail=1)[0].content == "again"
    client.sessions.delete(name, purge=True)
    with pytest.raises(cairn.NotFound):
        client.sessions.get(name)


def test_leaving_a_session_stream_early_still_records_the_result(client):
    name = _name("leaver")
    client.sessions.create(name=name)
    try:
        stream = client.sessions.exec_stream(name, "echo first; sleep 1; echo done > /done")
        for out in stream:
            assert out.data == b"first\n"
            break  # the client goes away; the command runs on
        with pytest.raises(cairn.Conflict) as e:
            client.sessions.rewind(name, 0)
        assert "busy" in e.value.message
        deadline = time.monotonic() + 30
        while client.sessions.log(name, tail=1)[0].kind != "tool_result" and time.monotonic() < deadline:
            time.sleep(0.1)
        last = client.sessions.log(name, tail=1)[0]
        assert (last.kind, last.exit_status) == ("tool_result", 0)
        assert client.sessions.exec(name, "cat /done").stdout == "done\n"
    finally:
        client.sessions.delete(name, purge=True)


def test_bad_session_requests_raise_typed_errors_naming_the_fault(client):
    with pytest.raises(cairn.NotFound) as e:
        client.sessions.get("no-such-session")
    assert "no-such-session" in e.value.message and e.value.code == "not_found"
    name = _name("strict")
    client.sessions.create(name=name)
    try:
        with pytest.raises(cairn.BadRequest) as e:
            client.sessions.append(name, "gossip", "x")
        assert "kind must be" in e.value.message
        with pytest.raises(cairn.BadRequest) as e:
            client.request("POST", f"/v1/sessions/{name}/entries", json={"kind": "note", "seq": 4})
        assert "seq is Cairn's" in e.value.message
        with pytest.raises(cairn.Conflict):
            client.sessions.resume(name)
        with pytest.raises(cairn.NotFound) as e:
            client.sessions.fork(name, at=9, reason="x")
        assert "no entry 9" in e.value.message
        with pytest.raises(cairn.TooLarge):
            client.sessions.append(name, "note", "x" * (5 << 20))
        with pytest.raises(ValueError):
            client.sessions.log(name, tail=1, limit=2)
        assert client.sessions.get(name).head_seq == 0
    finally:
        client.sessions.delete(name, purge=True)


async def test_async_sessions_mirror_the_sync_ones(aclient):
    name = _name("async")
    s = await aclient.sessions.create(name=name)
    try:
        assert (await aclient.sessions.append(s, "user", "hi", role="user")).seq == 1
        r = await aclient.sessions.exec(name, "echo async > /a; cat /a")
        assert (r.stdout, r.call_seq, r.result_seq) == ("async\n", 2, 3)
        stream = await aclient.sessions.exec_stream(name, "for i in 1 2; do echo $i; sleep 0.3; done")
        assert isinstance(stream, cairn.AsyncSessionExecStream)
        assert [out.data async for out in stream] == [b"1\n", b"2\n"]
        assert stream.result.result_seq == 5
        assert (await aclient.sessions.suspend(name)).state == "suspended"
        assert (await aclient.sessions.resume(name)).state == "active"
        fork = await aclient.sessions.fork(name, at=3, reason="async fork")
        assert [e.seq for e in await aclient.sessions.log(fork)] == [1, 2, 3]
        await aclient.sessions.delete(fork, purge=True)
        assert (await aclient.sessions.rewind(name, 1)).to_seq == 1
        assert [e.seq for e in await aclient.sessions.log(name, tail=5)] == [1]
        assert (await aclient.sessions.verify(name)).ok
        assert name in [x.name async for x in aclient.sessions.list()]
        # Files, exec options, recovery and bundles, as the sync client has them.
        await aclient.sessions.write_file(name, "/w", b"async file")
        assert await aclient.sessions.read_file(name, "/w") == b"async file"
        assert (await aclient.sessions.exec(name, "pwd", cwd="/tmp")).stdout == "/tmp\n"
        assert (await aclient.sessions.recover(name)).recovered is None
        import io
        buf = io.BytesIO()
        await aclient.sessions.export(name, buf)
        buf.seek(0)
        copy = await aclient.sessions.import_(buf, name=_name("acopy"))
        assert (await aclient.sessions.exec(copy, ["cat", "/w"])).stdout == "async file"
        await aclient.sessions.delete(copy, purge=True)
    finally:
        await aclient.sessions.delete(name, purge=True)
    with pytest.raises(cairn.NotFound):
        await aclient.sessions.get(name)


def test_files_env_timeouts_and_recovery_through_a_session(client):
    name = _name("files")
    s = client.sessions.create(name=name)
    try:
        client.sessions.suspend(name)
        st = client.sessions.write_file(name, "/data.bin", b"\x00\x01binary", mode=0o600)
        assert isinstance(st, cairn.FileStat) and (st.size, st.mode) == (8, 0o600)
        assert client.sessions.get(name).state == "active"
        call, result = client.sessions.log(name, tail=2)
        assert (call.tool, call.arguments["path"]) == ("write_file", "/data.bin")
        client.sessions.suspend(name)
        assert client.sessions.read_file(name, "/data.bin") == b"\x00\x01binary"
        with pytest.raises(cairn.NotFound):
            client.sessions.read_file(name, "/missing")

        r = client.sessions.exec(name, "echo $A; pwd", env={"A": "b"}, cwd="/tmp")
        assert r.stdout == "b\n/tmp\n"
        assert client.sessions.exec(name, ["sleep", "5"], timeout=0.2).exit_code == 124

        with pytest.raises(cairn.Conflict):
            client.sessions.recover(name, replay=True)
        rec = client.sessions.recover(name)
        assert isinstance(rec, cairn.RecoverResult) and rec.recovered is None and rec.replayed == []
    finally:
        client.sessions.delete(s, purge=True)


def test_a_session_exported_and_imported_keeps_its_log_and_files(client):
    import io
    name = _name("bundle")
    s = client.sessions.create(name=name)
    copy = None
    try:
        client.sessions.exec(name, "echo kept > /kept")
        buf = io.BytesIO()
        n = client.sessions.export(name, buf)
        assert n == len(buf.getvalue()) and buf.getvalue()[:8] == b"CAIRNSES"
        buf.seek(0)
        copy = client.sessions.import_(buf, name=_name("copy"))
        assert isinstance(copy, cairn.Session) and copy.state == "suspended" and copy.id != s.id
        assert [e.hash for e in client.sessions.log(copy)] == [e.hash for e in client.sessions.log(name)]
        assert client.sessions.exec(copy, ["cat", "/kept"]).stdout == "kept\n"
        with pytest.raises(cairn.BadRequest):
            client.sessions.import_(io.BytesIO(b"not a bundle"), name=_name("bad"))
    finally:
        if copy is not None:
            client.sessions.delete(copy, purge=True)
        client.sessions.delete(s, purge=True)
