"""Cairn's tools through the official `mcp` client (2.3.x), over stdio and
Streamable HTTP, in both protocol eras: 2026-07-28 (stateless) and
2025-11-25 (the initialize handshake)."""

import json
import threading
import uuid

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

ERAS = {"legacy": "2025-11-25", "2026-07-28": "2026-07-28"}
CASES = [(t, m) for t in ("stdio", "http") for m in ERAS]
TOOLS = {
    "plan_stage", "run_stage", "stage_status", "fork_from", "select", "inspect_logs", "inspect",
    "diff", "dlq", "exec", "read_file", "write_file", "snapshot", "restore",
    "session_create", "session_suspend", "session_resume", "session_fork", "session_close",
}


def client(cairn, transport, mode):
    if transport == "stdio":
        env = {k: cairn["env"][k] for k in ("CAIRN_HOME", "PATH", "HOME") if k in cairn["env"]}
        target = StdioServerParameters(command=cairn["bin"], args=["mcp"], env=env)
    else:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {cairn['token']}"})
        target = streamable_http_client(cairn["url"], http_client=http)
    return Client(target, mode=mode, read_timeout_seconds=120, cache=None)


def run(f, *args):
    return anyio.run(f, *args)


async def call(c, name, args, **kw):
    r = await c.call_tool(name, args, **kw)
    assert not r.is_error, f"{name} failed: {r.content}"
    return r.structured_content


@pytest.mark.parametrize("transport,mode", CASES)
def test_tools_are_listed_with_schemas_in_either_era(cairn, transport, mode):
    async def go():
        async with client(cairn, transport, mode) as c:
            assert c.protocol_version == ERAS[mode]
            tools = (await c.list_tools()).tools
            assert {t.name for t in tools} == TOOLS
            run_stage = next(t for t in tools if t.name == "run_stage")
            assert set(run_stage.input_schema["required"]) == {"snapshot_id", "commands", "reason"}
            assert run_stage.input_schema["additionalProperties"] is False
            assert run_stage.output_schema["required"]

    run(go)


@pytest.mark.parametrize("transport,mode", CASES)
def test_stage_forks_select_and_inspection(cairn, transport, mode):
    seed = cairn["seed"]
    tag = uuid.uuid4().hex[:8]

    async def go():
        async with client(cairn, transport, mode) as c:
            plan = await call(c, "plan_stage", {"context": "count the seed", "reason": "start from the seed"})
            assert seed in [s["id"] for s in plan["snapshots"]]
            key = f"count-{tag}"
            stage = {
                "snapshot_id": seed,
                "edits": [{"path": "/work/n", "content": "3\n"}],
                "commands": ["echo counting {braces}", "cat /work/seed /work/n > /work/out"],
                "stage_key": key,
                "wait_secs": 30,
                "reason": "prepare the input",
            }
            done = await call(c, "run_stage", stage)
            assert done["status"] == "completed", done
            assert done["cached"] is False
            out = done["output_snapshot"]
            again = await call(c, "run_stage", stage)
            assert again["cached"] is True and again["output_snapshot"] == out
            assert again["handle"] != done["handle"]

            logs = await call(c, "inspect_logs", {"stage": done["handle"], "tail_lines": 5})
            assert "counting {braces}" in logs["lines"], logs

            branches = []
            for i, h in enumerate(["double", "triple", "square"]):
                b = await call(
                    c,
                    "fork_from",
                    {
                        "snapshot_id": out,
                        "hypothesis": h,
                        "commands": [f"echo {h} {i} > /work/result", f"echo score {5 - i}"],
                        "wait_secs": 0,
                        "reason": f"try {h}",
                    },
                )
                assert b["hypothesis"] == h
                branches.append(b["handle"])
            for b in branches:
                s = await call(c, "stage_status", {"handle": b, "wait_secs": 30})
                assert s["status"] == "completed", s
            chosen = await call(
                c,
                "select",
                {"branches": branches, "winner": branches[1], "reason": f"triple fits best {tag}"},
            )
            assert chosen["winner"] == branches[1]
            assert sorted(chosen["lost"]) == sorted([branches[0], branches[2]])

            by_file = await call(c, "select", {"branches": branches, "rule": "max", "metric": "file:/work/result",
                                               "reason": "the largest index"})
            assert by_file["winner"] == branches[2], by_file
            assert by_file["metrics"] == {b: float(i) for i, b in enumerate(branches)}
            by_output = await call(c, "select", {"branches": [done["handle"], *branches], "rule": "max",
                                                 "metric": "output", "reason": "the best score printed"})
            assert by_output["winner"] == branches[0], by_output
            assert by_output["metrics"] == {b: float(5 - i) for i, b in enumerate(branches)}
            none = await c.call_tool("select", {"branches": [done["handle"]], "rule": "min", "metric": "output",
                                                "reason": "it printed no number"})
            assert none.is_error and "no completed branch has a number" in none.content[0].text
            f = await call(c, "inspect", {"snapshot_id": chosen["output_snapshot"], "path": "/work/result"})
            assert f["kind"] == "file" and f["content"] == "triple 1\n"
            d = await call(c, "inspect", {"snapshot_id": out, "path": "/work"})
            assert {e["name"] for e in d["entries"]} >= {"seed", "n", "out"}
            f = await call(c, "inspect", {"snapshot_id": out, "path": "/work/out"})
            assert f["content"] == "seed\n3\n"
            return branches

    branches = run(go)
    shown = json.loads(cairn["cli"]("pipeline", "show", branches[1], "--json"))
    won = [e for e in shown["events"] if e["kind"] == "won"]
    assert len(won) == 1 and f"triple fits best {tag}" in won[0]["detail"], shown["events"]
    hyp = [e["detail"] for e in shown["events"] if e["kind"] == "hypothesis"]
    assert hyp == ["triple"], shown["events"]
    asked = [e["detail"] for e in shown["events"] if e["kind"] == "asked"]
    assert len(asked) == 1 and "try triple" in asked[0] and "over MCP " + ERAS[mode] in asked[0], asked
    text = cairn["cli"]("pipeline", "show", branches[0])
    assert "lost" in text and f"triple fits best {tag}" in text


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_long_stage_returns_a_handle_and_reports_progress(cairn, transport):
    seen = []

    async def progress(p, total, message):
        seen.append((p, total, message))

    async def go():
        async with client(cairn, transport, "2026-07-28") as c:
            started = await c.call_tool(
                "run_stage",
                {"snapshot_id": cairn["seed"], "commands": ["sleep 4", "echo slept"], "wait_secs": 1,
                 "reason": "a stage longer than the wait"},
                progress_callback=progress,
            )
            s = started.structured_content
            assert s["status"] == "running", s
            assert seen, "progress was reported while waiting"
            done = await call(c, "stage_status", {"handle": s["handle"], "wait_secs": 30})
            assert done["status"] == "completed" and done["output_snapshot"]

    run(go)


@pytest.mark.parametrize("transport,mode", CASES)
def test_malformed_calls_get_clear_errors(cairn, transport, mode):
    async def go():
        async with client(cairn, transport, mode) as c:
            with pytest.raises(MCPError) as bad:
                await c.call_tool("run_stage", {"snapshot_id": cairn["seed"], "commands": ["true"]})
            assert bad.value.code == -32602 and "reason" in bad.value.message
            with pytest.raises(MCPError) as bad:
                await c.call_tool("inspect", {"snapshot_id": "../../etc", "path": "/"})
            assert bad.value.code == -32602 and "not an id" in bad.value.message
            with pytest.raises(MCPError) as bad:
                await c.call_tool("rm_everything", {})
            assert bad.value.code == -32602
            # A well-formed call the engine refuses is a tool error the model can read.
            r = await c.call_tool("inspect", {"snapshot_id": "abcdef", "path": "/"})
            assert r.is_error and "snapshot" in r.content[0].text
            r = await c.call_tool("inspect", {"snapshot_id": cairn["seed"], "path": "/no/such"})
            assert r.is_error and "does not exist" in r.content[0].text

    run(go)


@pytest.mark.parametrize("transport,mode", CASES)
def test_session_tools_record_the_reason_in_the_context_log(cairn, transport, mode):
    name = f"s-{transport}-{mode.replace('.', '')}-{uuid.uuid4().hex[:6]}".replace("-2026-07-28", "-modern")
    cairn["cli"]("session", "create", "--name", name)

    async def go():
        async with client(cairn, transport, mode) as c:
            w = await call(c, "write_file", {"session": name, "path": "/tmp/note", "content": "hello\n",
                                             "reason": "leave a note"})
            assert w["size"] == 6
            r = await call(c, "exec", {"session": name, "argv": ["sh", "-c", "cat /tmp/note; echo err >&2; exit 3"],
                                       "reason": "read the note back"})
            assert (r["status"], r["stdout"], r["stderr"]) == (3, "hello\n", "err\n")
            f = await call(c, "read_file", {"session": name, "path": "/tmp/note"})
            assert f["content"] == "hello\n"
            r = await c.call_tool("read_file", {"session": name, "path": "/tmp/none"})
            assert r.is_error and "does not exist" in r.content[0].text
            r = await c.call_tool("exec", {"session": "no-such-session", "argv": ["true"], "reason": "x"})
            assert r.is_error
            snap = await call(c, "snapshot", {"session": name, "reason": "keep the note"})
            f = await call(c, "inspect", {"snapshot_id": snap["snapshot_id"], "path": "/tmp/note"})
            assert f["content"] == "hello\n"
            back = await call(c, "restore", {"snapshot_id": snap["snapshot_id"], "name": f"{name}-r",
                                             "reason": "continue from the note"})
            assert back["name"] == f"{name}-r"
            await call(c, "write_file", {"session": back["session"], "path": "/tmp/note", "content": "changed\n",
                                         "reason": "change the copy"})
            f = await call(c, "read_file", {"session": back["session"], "path": "/tmp/note"})
            assert f["content"] == "changed\n"
            f = await call(c, "read_file", {"session": name, "path": "/tmp/note"})
            assert f["content"] == "hello\n", "the original session is untouched"
            r = await c.call_tool("restore", {"snapshot_id": "0123456789ab", "reason": "no such snapshot"})
            assert r.is_error
            return snap["snapshot_id"]

    snap = run(go)
    log = [json.loads(line) for line in cairn["cli"]("session", "log", name, "--json").splitlines()]
    calls = [json.loads(e["arguments"]) for e in log if e.get("kind") == "tool_call"]
    assert [c["reason"] for c in calls] == ["leave a note", "read the note back"], calls
    assert all("over MCP " + ERAS[mode] in c["asked_by"] for c in calls)
    notes = [e for e in log if e.get("kind") == "note" and e.get("snapshot_id") == snap]
    assert len(notes) == 1 and "keep the note" in notes[0]["content"], log
    restored = [json.loads(line) for line in cairn["cli"]("session", "log", f"{name}-r", "--json").splitlines()]
    assert restored[0]["kind"] == "note" and restored[0]["snapshot_id"] == snap, restored
    assert "continue from the note" in restored[0]["content"]


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_failed_stage_is_listed_in_the_dlq_and_retried(cairn, transport):
    async def go():
        async with client(cairn, transport, "2026-07-28") as c:
            s = await call(c, "run_stage", {"snapshot_id": cairn["seed"], "commands": ["echo failing", "exit 7"],
                                            "wait_secs": 30, "reason": "this fails"})
            assert s["status"] == "failed" and s["error"], s
            dead = (await call(c, "dlq", {"action": "list"}))["dead_letters"]
            mine = [d for d in dead if d["handle"] == s["handle"]]
            assert len(mine) == 1 and not mine[0]["retried"], dead
            r = await call(c, "dlq", {"action": "retry", "id": mine[0]["id"], "reason": "once more"})
            assert r["handle"] == s["handle"]
            again = await call(c, "stage_status", {"handle": s["handle"], "wait_secs": 30})
            assert again["status"] == "failed", again
            dead = (await call(c, "dlq", {"action": "list"}))["dead_letters"]
            mine = [d for d in dead if d["handle"] == s["handle"]]
            assert sorted(d["retried"] for d in mine) == [False, True], mine
            with pytest.raises(MCPError) as bad:
                await c.call_tool("dlq", {"action": "retry", "id": mine[0]["id"]})
            assert bad.value.code == -32602 and "reason" in bad.value.message
            return s["handle"]

    handle = run(go)
    shown = json.loads(cairn["cli"]("pipeline", "show", handle, "--json"))
    assert any(e["kind"] == "asked" and "once more" in e["detail"] for e in shown["events"])


def test_http_without_a_token_is_refused(cairn):
    r = httpx2.post(cairn["url"], json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
    assert r.status_code == 401


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_three_hypotheses_run_as_one_group_and_select_first_success_records_the_winner(cairn, transport):
    tag = uuid.uuid4().hex[:8]

    async def go():
        async with client(cairn, transport, "2026-07-28") as c:
            group = await call(c, "fork_from", {
                "snapshot_id": cairn["seed"],
                "edits": [{"path": "/work/shared", "content": "shared {not a placeholder}\n"}],
                "commands": ["mkdir -p /work/out"],
                "hypotheses": [
                    {"name": "slow", "commands": ["sleep 3", "echo slow > /work/out/who", "echo score 1"]},
                    {"name": "fast", "edits": [{"path": "/work/out/who", "content": "fast\n"}],
                     "commands": ["echo score 2"]},
                    {"name": "middle", "commands": ["sleep 1.5", "echo middle > /work/out/who", "echo score 3"]},
                ],
                "wait_secs": 0,
                "reason": f"which is quickest {tag}",
            })
            assert [b["name"] for b in group["branches"]] == ["slow", "fast", "middle"], group
            done = await call(c, "stage_status", {"handle": group["handle"], "wait_secs": 30})
            assert done["status"] == "completed", done
            assert [b["status"] for b in done["branches"]] == ["completed"] * 3, done
            for b in done["branches"]:
                who = await call(c, "inspect", {"snapshot_id": b["output_snapshot"], "path": "/work/out/who"})
                assert who["content"] == b["name"] + "\n", (b, who)
                shared = await call(c, "inspect", {"snapshot_id": b["output_snapshot"], "path": "/work/shared"})
                assert shared["content"] == "shared {not a placeholder}\n"
            logs = await call(c, "inspect_logs", {"stage": group["handle"], "branch": "middle"})
            assert "score 3" in logs["lines"], logs

            chosen = await call(c, "select", {"handle": group["handle"], "rule": "first_success",
                                              "reason": f"the quickest wins {tag}"})
            assert chosen["winner"] == "fast" and sorted(chosen["lost"]) == ["middle", "slow"], chosen
            fast = next(b for b in done["branches"] if b["name"] == "fast")
            assert chosen["output_snapshot"] == fast["output_snapshot"]
            again = await c.call_tool("select", {"handle": group["handle"], "winner": "slow", "reason": "changed mind"})
            assert again.is_error and "has its winner already (fast)" in again.content[0].text
            after = await call(c, "stage_status", {"handle": group["handle"]})
            assert {b["name"]: b["selected"] for b in after["branches"]} == {"fast": "won", "slow": "lost", "middle": "lost"}

            # first_success among single-branch handles too.
            singles = []
            for h, pause in (("late", 2), ("early", 0)):
                b = await call(c, "fork_from", {"snapshot_id": cairn["seed"], "hypothesis": h,
                                                "commands": [f"sleep {pause}"], "wait_secs": 0, "reason": h})
                singles.append(b["handle"])
            for h in singles:
                assert (await call(c, "stage_status", {"handle": h, "wait_secs": 30}))["status"] == "completed"
            first = await call(c, "select", {"branches": singles, "rule": "first_success", "reason": "quickest"})
            assert first["winner"] == singles[1], first
            return group["handle"]

    handle = run(go)
    shown = json.loads(cairn["cli"]("pipeline", "show", handle, "--json"))
    events = shown["events"]
    won = [e for e in events if e["kind"] == "won"]
    assert len(won) == 1 and won[0]["branch"] == "fast" and f"the quickest wins {tag}" in won[0]["detail"], events
    assert sorted(e["branch"] for e in events if e["kind"] == "lost") == ["middle", "slow"], events
    assert sorted(e["branch"] for e in events if e["kind"] == "hypothesis") == ["fast", "middle", "slow"]
    assert any(e["kind"] == "asked" and f"which is quickest {tag}" in e["detail"] for e in events)


def test_inspect_reads_a_snapshots_layers_without_starting_a_sandbox(cairn):
    cli = cairn["cli"]
    box = cli("create").split()[-1]
    cli("exec", box, "--", "sh", "-c",
        "mkdir -p /work/d && echo keep > /work/keep && echo gone > /work/gone && echo old > /work/changed"
        " && touch /work/d/old")
    cli("snapshot", box, "--label", "lower")
    cli("exec", box, "--", "sh", "-c",
        "rm /work/gone && echo new > /work/changed && ln -s ../../etc /work/out && ln -s /etc/passwd /work/pw"
        " && rm -r /work/d && mkdir /work/d && touch /work/d/new")
    snap = cli("snapshot", box, "--label", "upper").split()[-1]
    cli("rm", "--force", box)

    def running():
        return set(cli("ps", "-q").split())

    before = running()
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(running())

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def go():
        async with client(cairn, "stdio", "2026-07-28") as c:
            for _ in range(5):
                keep = await call(c, "inspect", {"snapshot_id": snap, "path": "/work/keep"})
                assert keep["content"] == "keep\n", keep
                changed = await call(c, "inspect", {"snapshot_id": snap, "path": "/work/changed"})
                assert changed["content"] == "new\n", changed
                gone = await c.call_tool("inspect", {"snapshot_id": snap, "path": "/work/gone"})
                assert gone.is_error and "does not exist" in gone.content[0].text
                listing = await call(c, "inspect", {"snapshot_id": snap, "path": "/work"})
                entries = {e["name"]: e for e in listing["entries"]}
                assert set(entries) == {"keep", "changed", "out", "pw", "d"}, listing
                # Removed and made again: an opaque directory hides the old one's files.
                d = await call(c, "inspect", {"snapshot_id": snap, "path": "/work/d"})
                assert [e["name"] for e in d["entries"]] == ["new"], d
                assert (entries["out"]["kind"], entries["out"]["target"]) == ("symlink", "../../etc")
                link = await call(c, "inspect", {"snapshot_id": snap, "path": "/work/pw"})
                assert (link["kind"], link["target"]) == ("symlink", "/etc/passwd") and "content" not in link
                through = await c.call_tool("inspect", {"snapshot_id": snap, "path": "/work/out/passwd"})
                assert through.is_error and "symlinks are not followed" in through.content[0].text, through.content

    try:
        run(go)
    finally:
        stop.set()
        watcher.join()
    assert seen and all(s == before for s in seen), "a sandbox ran while inspect read the snapshot"
    assert running() == before

    lower = json.loads(cli("snapshots", "--json"))
    lower = next(s["id"] for s in lower if s.get("label") == "lower")

    async def compare():
        async with client(cairn, "stdio", "2026-07-28") as c:
            d = await call(c, "diff", {"from_snapshot_id": lower, "to_snapshot_id": snap})
            changes = {x["path"]: x for x in d["changes"]}
            assert {p: x["change"] for p, x in changes.items()} == {
                "/work/gone": "removed", "/work/changed": "changed", "/work/out": "added", "/work/pw": "added",
                # The directory made again holds another file: the old one is gone.
                "/work/d/old": "removed", "/work/d/new": "added",
            }, d
            assert (d["added"], d["removed"], d["changed"], d["truncated"]) == (3, 2, 1, False)
            assert changes["/work/changed"]["what"] == ["content"]
            assert "-old\n+new\n" in changes["/work/changed"]["diff"]
            assert changes["/work/out"]["kind"] == "symlink" and "diff" not in changes["/work/out"]
            quiet = await call(c, "diff", {"from_snapshot_id": lower, "to_snapshot_id": snap, "text": False})
            assert all("diff" not in x for x in quiet["changes"]) and quiet["changed"] == 1
            same = await call(c, "diff", {"from_snapshot_id": snap, "to_snapshot_id": snap})
            assert same["changes"] == [] and same["added"] == 0
            with pytest.raises(MCPError, match="from_snapshot_id"):
                await c.call_tool("diff", {"from_snapshot_id": "zz", "to_snapshot_id": snap})
            missing = await c.call_tool("diff", {"from_snapshot_id": "abcdef0123", "to_snapshot_id": snap})
            assert missing.is_error and "abcdef0123" in missing.content[0].text

    run(compare)
    assert running() == before


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_session_lifecycle_tools_record_the_caller_and_reason(cairn, transport):
    name = f"life-{transport}-{uuid.uuid4().hex[:6]}"

    async def go():
        async with client(cairn, transport, "2026-07-28") as c:
            s = await call(c, "session_create", {"name": name, "reason": "a place to work"})
            assert (s["name"], s["state"]) == (name, "active") and s["sandbox_id"]
            await call(c, "write_file", {"session": name, "path": "/tmp/kept", "content": "kept\n", "reason": "state"})
            down = await call(c, "session_suspend", {"session": name, "reason": "lunch break"})
            assert down["state"] == "suspended" and down["sandbox_id"] is None and down["snapshot_id"]
            again = await c.call_tool("session_suspend", {"session": name, "reason": "twice"})
            assert again.is_error
            up = await call(c, "session_resume", {"session": name, "reason": "back to work"})
            assert up["state"] == "active"
            f = await call(c, "read_file", {"session": name, "path": "/tmp/kept"})
            assert f["content"] == "kept\n"
            child = await call(c, "session_fork", {"session": name, "name": f"{name}-fork", "reason": "try a variant"})
            assert child["parent"] == up["session"] and child["state"] == "active"
            f = await call(c, "read_file", {"session": child["session"], "path": "/tmp/kept"})
            assert f["content"] == "kept\n", "the fork starts from the parent's newest snapshot"
            from_snap = await call(c, "session_create", {"snapshot_id": down["snapshot_id"], "reason": "from the snapshot"})
            f = await call(c, "read_file", {"session": from_snap["session"], "path": "/tmp/kept"})
            assert f["content"] == "kept\n"
            boxes = []
            for sid in (child["session"], from_snap["session"], name):
                closed = await call(c, "session_close", {"session": sid, "reason": "done"})
                assert closed["state"] == "closed"
                boxes.append(closed["sandbox_id"])
            return child["session"], boxes

    child, boxes = run(go)
    assert not set(boxes) & set(cairn["cli"]("ps", "-q").split()), "a closed session's sandbox is gone"
    log = [json.loads(line) for line in cairn["cli"]("session", "log", name, "--json").splitlines()]
    notes = [e["content"] for e in log if e.get("kind") == "note" and "asked by" in (e.get("content") or "")]
    wanted = ["session_create", "session_suspend", "session_resume", "session_close"]
    for tool, reason in zip(wanted, ["a place to work", "lunch break", "back to work", "done"]):
        assert any(n.startswith(f"{tool} asked by") and reason in n and "over MCP" in n for n in notes), (tool, notes)
    shown = json.loads(cairn["cli"]("session", "show", child, "--json"))
    assert "try a variant" in json.dumps(shown), shown


def _tenant_client(cairn, token, transport, mode):
    """A client with `token`: as the bearer token of /mcp, or as the
    CAIRN_TOKEN an MCP client's configuration gives `cairn mcp`."""
    if transport == "stdio":
        env = {k: cairn["env"][k] for k in ("CAIRN_HOME", "PATH", "HOME") if k in cairn["env"]}
        target = StdioServerParameters(command=cairn["bin"], args=["mcp"], env=dict(env, CAIRN_TOKEN=token))
    else:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        target = streamable_http_client(cairn["url"], http_client=http)
    return Client(target, mode=mode, read_timeout_seconds=120, cache=None)


def _tenant_token(cairn, tenant):
    cairn["cli"]("tenant", "create", tenant)
    return json.loads(cairn["cli"]("token", "create", f"{tenant}-mcp", "--tenant", tenant, "--json"))["secret"]


@pytest.mark.parametrize("transport,mode", CASES)
def test_a_tenants_token_reaches_its_own_sessions_snapshots_and_stages_only(cairn, transport, mode):
    tag = uuid.uuid4().hex[:6]
    acme = _tenant_token(cairn, f"acme{tag}")
    globex = _tenant_token(cairn, f"globex{tag}")
    session = f"acme-{tag}"

    async def as_acme():
        async with _tenant_client(cairn, acme, transport, mode) as c:
            await call(c, "session_create", {"name": session, "reason": "acme's work"})
            await call(c, "write_file", {"session": session, "path": "/tmp/secret", "content": "acme\n",
                                         "reason": "a secret"})
            snap = (await call(c, "snapshot", {"session": session, "reason": "keep it"}))["snapshot_id"]
            stage = await call(c, "run_stage", {"snapshot_id": snap, "commands": ["cat /tmp/secret > /tmp/out"],
                                                "wait_secs": 30, "reason": "a stage of acme's"})
            assert stage["status"] == "completed", stage
            plan = await call(c, "plan_stage", {"context": "what is there", "reason": "look"})
            ids = [s["id"] for s in plan["snapshots"]]
            assert snap in ids and cairn["seed"] not in ids, "the administrator's snapshots are not a tenant's"
            r = await c.call_tool("run_stage", {"snapshot_id": cairn["seed"], "commands": ["true"], "reason": "x"})
            assert r.is_error
            return snap, stage["handle"]

    snap, handle = run(as_acme)
    missing_snap = "0" * len(snap)

    async def as_globex():
        async with _tenant_client(cairn, globex, transport, mode) as c:
            plan = await call(c, "plan_stage", {"context": "what is there", "reason": "look"})
            assert snap not in [s["id"] for s in plan["snapshots"]]
            pairs = [
                ("exec", {"session": session, "argv": ["cat", "/tmp/secret"], "reason": "peek"}, session,
                 "no-such-session"),
                ("read_file", {"session": session, "path": "/tmp/secret"}, session, "no-such-session"),
                ("write_file", {"session": session, "path": "/tmp/x", "content": "x", "reason": "x"}, session,
                 "no-such-session"),
                ("session_suspend", {"session": session, "reason": "x"}, session, "no-such-session"),
                ("session_fork", {"session": session, "reason": "x"}, session, "no-such-session"),
                ("session_close", {"session": session, "reason": "x"}, session, "no-such-session"),
                ("inspect", {"snapshot_id": snap, "path": "/tmp/secret"}, snap, missing_snap),
                ("restore", {"snapshot_id": snap, "reason": "x"}, snap, missing_snap),
                ("run_stage", {"snapshot_id": snap, "commands": ["true"], "reason": "x"}, snap, missing_snap),
                ("stage_status", {"handle": handle}, handle, "0" * len(handle)),
                ("inspect_logs", {"stage": handle}, handle, "0" * len(handle)),
            ]
            for tool, args, theirs, absent in pairs:
                r1 = await c.call_tool(tool, args)
                r2 = await c.call_tool(tool, json.loads(json.dumps(args).replace(theirs, absent)))
                assert r1.is_error and r2.is_error, (tool, r1.content, r2.content)
                assert r1.content[0].text.replace(theirs, "KEY") == r2.content[0].text.replace(absent, "KEY"), (
                    tool, r1.content[0].text, r2.content[0].text)
            dlq = await call(c, "dlq", {"action": "list"})
            assert dlq["dead_letters"] == []

    run(as_globex)
    # Acme's session is untouched and still its own.
    async def check():
        async with _tenant_client(cairn, acme, transport, mode) as c:
            f = await call(c, "read_file", {"session": session, "path": "/tmp/secret"})
            assert f["content"] == "acme\n"

    run(check)
    rows = json.loads(cairn["cli"]("token", "log", "--tenant", f"globex{tag}", "--json", "-n", "1000"))
    if transport == "http":
        assert rows and all(r["surface"] == "mcp" and r["path"] == "/mcp" for r in rows), rows
    else:
        # One row per tool call (and the `cairn mcp` command's own, once
        # it has exited).
        calls = [r for r in rows if r["surface"] == "mcp"]
        assert all(r["method"] == "CALL" for r in calls), rows
        assert {"exec", "restore", "dlq", "plan_stage"} <= {r["path"] for r in calls}, rows
        assert any(r["path"] == "exec" and r["status"] == 422 for r in calls), rows
        assert any(r["path"] == "dlq" and r["status"] == 200 for r in calls), rows
        assert all(r["path"] == "cairn mcp" for r in rows if r["surface"] == "cli"), rows
