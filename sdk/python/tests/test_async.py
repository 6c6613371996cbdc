import time

import pytest

import cairn


async def test_async_client_creates_execs_streams_and_forks(aclient):
    async with await aclient.sandboxes.create() as sb:
        assert isinstance(sb, cairn.AsyncSandbox)
        result = await sb.exec("echo async; exit 4")
        assert (result.stdout, result.exit_code) == ("async\n", 4)

        stream = await sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.3; done")
        arrivals = [(time.monotonic(), out.data) async for out in stream]
        assert [d for _, d in arrivals] == [b"1\n", b"2\n", b"3\n"]
        assert arrivals[2][0] - arrivals[0][0] > 0.4
        assert stream.result.exit_code == 0

        await sb.write_file("/root/f", b"\x00\x01binary")
        assert await sb.read_file("/root/f") == b"\x00\x01binary"
        fork = await sb.fork(count=2)
        try:
            for i, child in enumerate(fork.sandboxes):
                assert await child.read_file("/root/f") == b"\x00\x01binary"
                await child.exec(f"echo {i} > /root/f")
            assert [await c.read_file("/root/f") for c in fork.sandboxes] == [b"0\n", b"1\n"]
            diff = await aclient.snapshots.diff(fork.sandboxes[0], fork.sandboxes[1])
            assert [(c.path, c.change, c.what) for c in diff.changes] == [("/root/f", "changed", ["content"])]
            assert "-0\n+1\n" in diff.changes[0].diff
        finally:
            for child in fork.sandboxes:
                await child.remove()
    with pytest.raises(cairn.NotFound):
        await aclient.sandboxes.get(sb.id)
    assert sb.id not in [s.id async for s in aclient.sandboxes.list()]
