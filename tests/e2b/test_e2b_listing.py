"""Listing in pages, metrics and gzip-compressed files through the real e2b
SDK (sync and async) against `cairn serve --e2b` (conftest.py)."""

import asyncio
import gzip
import hashlib
import io
import os
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)


def _pages(paginator):
    pages = [paginator.next_items()]
    while paginator.has_next:
        pages.append(paginator.next_items())
    return pages


def test_listing_pages_through_every_sandbox_once_in_start_order_with_every_filter(cairn_e2b):
    suite = uuid.uuid4().hex
    made = []
    try:
        for i in range(5):
            made.append(Sandbox.create(metadata={"suite": suite, "i": str(i)}))
            time.sleep(0.02)
        middle = Sandbox.get_info(made[2].sandbox_id).started_at
        assert made[0].pause() and made[1].pause()
        ids = [s.sandbox_id for s in made]
        mine = SandboxQuery(metadata={"suite": suite})

        pages = _pages(Sandbox.list(query=mine, limit=2))
        assert [len(p) for p in pages] == [2, 2, 1]
        # Newest first unless asked otherwise.
        assert [s.sandbox_id for p in pages for s in p] == ids[::-1]
        assert [s.metadata["i"] for s in pages[0]] == ["4", "3"]
        asc = _pages(Sandbox.list(query=mine, limit=3, order="asc"))
        assert [s.sandbox_id for p in asc for s in p] == ids
        assert [len(p) for p in asc] == [3, 2]

        paused = Sandbox.list(query=SandboxQuery(metadata={"suite": suite}, state=[SandboxState.PAUSED]))
        assert sorted(s.sandbox_id for s in paused.next_items()) == sorted(ids[:2])
        assert not paused.has_next
        later = Sandbox.list(query=SandboxQuery(metadata={"suite": suite}, started_after=middle), order="asc")
        assert [s.sandbox_id for s in later.next_items()] == ids[2:]
        assert [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": suite}, template="base"))
                .next_items()][::-1] == ids
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": suite}, template="nothing")).next_items() == []

        # A sandbox removed between pages moves nothing else.
        p = Sandbox.list(query=mine, limit=2, order="asc")
        first = p.next_items()
        made[2].kill()
        rest = p.next_items()
        assert [s.sandbox_id for s in first + rest] == [ids[0], ids[1], ids[3], ids[4]]

        async def in_async():
            pag = AsyncSandbox.list(query=mine, limit=1, order="asc")
            got = [await pag.next_items()]
            while pag.has_next:
                got.append(await pag.next_items())
            return [[s.sandbox_id for s in page] for page in got]

        assert asyncio.run(in_async()) == [[ids[0]], [ids[1]], [ids[3]], [ids[4]]]

        url, headers = cairn_e2b["url"], {"X-API-KEY": cairn_e2b["key"]}
        for bad, says in [
            ("limit=0", "limit must be 1 to 100"),
            ("limit=101", "limit must be 1 to 100"),
            ("nextToken=not-ours", "nextToken is not one this server gave"),
            ("order=newest", "order must be"),
            ("state=running,gone", "state must be"),
            ("startedAfter=yesterday", "startedAfter must be an RFC 3339 time"),
        ]:
            r = httpx.get(f"{url}/v2/sandboxes?{bad}", headers=headers)
            assert r.status_code == 400 and says in r.json()["message"], (bad, r.text)
        with pytest.raises(SandboxException, match="limit must be 1 to 100"):
            Sandbox.list(limit=500).next_items()
    finally:
        for s in made:
            Sandbox.kill(s.sandbox_id)


def test_snapshots_list_in_pages_newest_first(cairn_e2b):
    s = Sandbox.create()
    snaps = []
    try:
        for i in range(3):
            s.files.write("/home/user/n", str(i))
            snaps.append(s.create_snapshot().snapshot_id)
            time.sleep(0.01)
        pages = _pages(Sandbox.list_snapshots(sandbox_id=s.sandbox_id, limit=2))
        assert [len(p) for p in pages] == [2, 1]
        assert [x.snapshot_id for p in pages for x in p] == snaps[::-1]
    finally:
        for snap in snaps:
            Sandbox.delete_snapshot(snap)
        s.kill()


def test_metrics_report_cpu_memory_and_disk_as_they_change(cairn_e2b):
    s = Sandbox.create()
    try:
        s.files.write("/home/user/big.bin", os.urandom(24 << 20))
        started = time.time()
        busy = s.commands.run("while :; do :; done", background=True)
        first = s.get_metrics()
        # The sampler may have read the sandbox already (a slow create),
        # so there is at least one sample, and the newest is fresh.
        assert len(first) >= 1, "a sandbox has metrics at once"
        assert abs(first[-1].timestamp.timestamp() - time.time()) < 30
        # A sample whose whole window the busy loop ran in: one taken after
        # a sample that came after the loop started (at most one interval).
        deadline = time.time() + 30
        while True:
            samples = s.get_metrics()
            windows = [b for a, b in zip(samples, samples[1:]) if a.timestamp.timestamp() >= started]
            if windows or time.time() > deadline:
                break
            time.sleep(0.5)
        assert windows, f"no sample measured the busy loop alone within 30 s: {samples}"
        m = windows[-1]
        info = s.get_info()
        assert m.cpu_count == info.cpu_count
        assert m.mem_total == info.memory_mb << 20
        # One busy loop of the sandbox's CPUs.
        assert 100 / m.cpu_count * 0.5 < m.cpu_used_pct <= 100, m
        assert m.disk_used >= 24 << 20 and m.disk_total > m.disk_used, m
        assert 0 < m.mem_used < m.mem_total and m.mem_cache >= 0, m

        busy.kill()
        s.files.remove("/home/user/big.bin")
        time.sleep(5.5)
        later = s.get_metrics()
        assert len(later) >= 2
        assert [x.timestamp for x in later] == sorted(x.timestamp for x in later)
        assert later[-1].disk_used < m.disk_used - (16 << 20), later[-1]

        future = datetime.now(timezone.utc) + timedelta(hours=1)
        assert s.get_metrics(start=future) == []
        assert len(s.get_metrics(start=datetime.now(timezone.utc) - timedelta(minutes=5))) == len(s.get_metrics())
        r = httpx.get(f"{cairn_e2b['url']}/sandboxes/{s.sandbox_id}/metrics?start=20&end=10",
                      headers={"X-API-KEY": cairn_e2b["key"]})
        assert r.status_code == 400 and "start (20) is after end (10)" in r.json()["message"]

        many = httpx.get(f"{cairn_e2b['url']}/sandboxes/metrics", params={"sandbox_ids": f"{s.sandbox_id},nope"},
                         headers={"X-API-KEY": cairn_e2b["key"]}).json()
        assert list(many["sandboxes"]) == [s.sandbox_id]
        assert many["sandboxes"][s.sandbox_id]["cpuCount"] == m.cpu_count

        async def in_async():
            a = await AsyncSandbox.connect(s.sandbox_id)
            return await a.get_metrics()

        assert len(asyncio.run(in_async())) >= 2
        # A paused sandbox keeps what was sampled.
        assert s.pause()
        assert len(Sandbox.get_metrics(s.sandbox_id)) >= 2
    finally:
        s.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(s.sandbox_id)


def test_gzip_uploads_and_downloads(cairn_e2b):
    s = Sandbox.create()
    try:
        text = "".join(f"line {i}\n" for i in range(100_000)).encode()
        s.files.write("/home/user/z/text.txt", text, gzip=True)
        assert s.files.read("/home/user/z/text.txt", format="bytes") == text
        assert s.files.read("/home/user/z/text.txt", format="bytes", gzip=True) == text
        md5 = s.commands.run("md5sum /home/user/z/text.txt").stdout.split()[0]
        assert md5 == hashlib.md5(text).hexdigest()
        s.files.write("/home/user/z/stream.bin", io.BytesIO(b"streamed " * 1000), gzip=True)
        assert s.files.read("/home/user/z/stream.bin", format="bytes") == b"streamed " * 1000
        written = s.files.write_files(
            [{"path": "/home/user/z/a", "data": "first"}, {"path": "/home/user/z/b", "data": b"second"}], gzip=True
        )
        assert sorted(w.path for w in written) == ["/home/user/z/a", "/home/user/z/b"]
        assert s.files.read("/home/user/z/b") == "second"
        # A big one comes back compressed on the wire, whole.
        r = httpx.get(f"{cairn_e2b['url']}/files", params={"path": "/home/user/z/text.txt"},
                      headers={"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": s._envd_access_token,
                               "Accept-Encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip" and r.content == text
        assert int(r.headers.get("content-length", len(gzip.compress(text)))) < len(text) // 3

        # Not gzip: 400, nothing written.
        r = httpx.post(f"{cairn_e2b['url']}/files", params={"path": "/home/user/z/bad"}, content=b"plain bytes",
                       headers={"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": s._envd_access_token,
                                "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 400 and "not valid gzip" in r.text
        r = httpx.post(f"{cairn_e2b['url']}/files", params={"path": "/home/user/z/bad"}, content=b"x",
                       headers={"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": s._envd_access_token,
                                "Content-Type": "application/octet-stream", "Content-Encoding": "br"})
        assert r.status_code == 400 and 'Content-Encoding "br" is not supported' in r.json()["message"]
        assert not s.files.exists("/home/user/z/bad")

        async def in_async():
            a = await AsyncSandbox.connect(s.sandbox_id)
            await a.files.write("/home/user/z/async.txt", text, gzip=True)
            return await a.files.read("/home/user/z/async.txt", format="bytes", gzip=True)

        assert asyncio.run(in_async()) == text
    finally:
        s.kill()
