import cairn


def test_three_forks_of_one_snapshot_see_it_and_diverge(client, sandbox):
    sandbox.write_file("/root/shared.txt", "from the snapshot\n")
    snap = sandbox.snapshot(label="base")
    assert snap.sandbox_id == sandbox.id and snap.label == "base"
    fork = client.snapshots.fork(snap.id, count=3)
    assert fork.snapshot.id == snap.id and len(fork.sandboxes) == 3
    try:
        for i, sb in enumerate(fork.sandboxes):
            assert sb.read_file("/root/shared.txt") == b"from the snapshot\n"
            sb.exec(f"echo fork {i} >> /root/shared.txt && touch /root/only-{i}")
        for i, sb in enumerate(fork.sandboxes):
            assert sb.read_file("/root/shared.txt") == f"from the snapshot\nfork {i}\n".encode()
            assert sb.exec("ls /root").stdout.split() == [f"only-{i}", "shared.txt"]
        assert sandbox.read_file("/root/shared.txt") == b"from the snapshot\n"
        assert snap.id in [s.id for s in client.snapshots.list()]
    finally:
        for sb in fork.sandboxes:
            sb.remove()


def test_sandbox_fork_and_snapshot_lineage(client, sandbox):
    sandbox.write_file("/root/a", "a")
    first = sandbox.snapshot()
    sandbox.write_file("/root/b", "b")
    second = sandbox.snapshot()
    detail = client.snapshots.get(second.id)
    assert isinstance(detail, cairn.SnapshotDetail)
    assert [s.id for s in detail.lineage][:1] == [first.id]
    fork = sandbox.fork()
    with fork.sandboxes[0] as child:
        assert child.exec("cat /root/a /root/b").stdout == "ab"


def test_reset_rewinds_the_filesystem(sandbox):
    sandbox.write_file("/root/state", "v1")
    snap = sandbox.snapshot()
    sandbox.write_file("/root/state", "v2")
    sandbox.write_file("/root/extra", "x")
    after = sandbox.reset(snap)
    assert after.id == sandbox.id
    assert sandbox.read_file("/root/state") == b"v1"
    assert sandbox.exec("test -e /root/extra").exit_code == 1


def test_restore_starts_a_sandbox_from_a_snapshot(client, sandbox):
    sandbox.write_file("/root/note", "kept")
    snap = sandbox.snapshot()
    with client.snapshots.restore(snap) as restored:
        assert restored.id != sandbox.id
        assert restored.read_file("/root/note") == b"kept"
    with client.sandboxes.create(snapshot=snap) as again:
        assert again.read_file("/root/note") == b"kept"


def test_diff_names_what_two_snapshots_and_a_live_sandbox_changed(client, sandbox):
    sandbox.write_file("/root/notes.txt", "one\ntwo\nthree\n")
    sandbox.write_file("/root/gone", "bye")
    before = sandbox.snapshot()
    sandbox.write_file("/root/notes.txt", "one\n2\nthree\n")
    sandbox.exec("rm /root/gone && mkdir /root/new && head -c 3000 /dev/urandom > /root/new/blob")
    # The live sandbox: its files as they are now.
    live = client.snapshots.diff(before, sandbox)
    assert isinstance(live, cairn.SnapshotDiff)
    assert (live.a.kind, live.b.kind, live.b.sandbox_id) == ("snapshot", "sandbox", sandbox.id)
    by_path = {c.path: c for c in live.changes}
    assert by_path["/root/notes.txt"].change == "changed" and by_path["/root/notes.txt"].what == ["content"]
    assert "-two\n+2\n" in by_path["/root/notes.txt"].diff
    assert by_path["/root/gone"].change == "removed" and by_path["/root/gone"].before.size == 3
    assert by_path["/root/new"].after.kind == "directory"
    assert by_path["/root/new/blob"].no_diff == "binary"
    after = sandbox.snapshot()
    stat = client.snapshots.diff(before.id, after.id, text_max=0)
    assert (stat.added, stat.removed, stat.changed) == (live.added, live.removed, live.changed) == (2, 1, 1)
    assert all(c.diff is None for c in stat.changes) and stat.shared_layers >= 1
    assert client.snapshots.diff(after, after).changes == []
    report = client.snapshots.verify(after)
    assert report["ok"] and report["root_hash"] == after.id and report["objects"] > 3, report
    assert report["damaged"] == [] and report["unreadable"] == []
    try:
        client.snapshots.diff(after, "no-such-thing")
        raise AssertionError("an unknown side must be refused")
    except cairn.NotFound as e:
        assert "no-such-thing" in str(e)
