"""The lineage page of `cairn serve` in a real headless Chromium: it loads a
run the CLI made, marks the branch group's winner, opens a failed stage's
log, downloads an artifact, follows a run started after it loaded, lays a
run out as the tree its `after` edges make, draws a run of 10,000 stages,
and shows a session's log beside its snapshots, paging back through it."""

import json
import urllib.request
import uuid

from playwright.sync_api import expect


def call(cairn, method, path, body=None):
    req = urllib.request.Request(
        f"{cairn['url']}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {cairn['token']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as resp:
        return json.load(resp)


def rect(page, selector):
    """Where the one element `selector` names is drawn (a line of no width
    included), read in one step: the page may draw the graph again between
    two."""
    return page.evaluate(
        """s => {
            const found = document.querySelectorAll(s);
            if (found.length !== 1) return null;
            const r = found[0].getBoundingClientRect();
            return { x: r.x, y: r.y, width: r.width, height: r.height };
        }""",
        selector,
    )


def start_run(cairn, token, pipeline):
    """Starts a run of `pipeline` through the API with `token`; its record."""
    req = urllib.request.Request(
        f"{cairn['url']}/v1/runs",
        data=json.dumps({"pipeline": pipeline}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    return json.load(urllib.request.urlopen(req))


def page_for(browser, cairn):
    page = browser.new_page(viewport={"width": 1500, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{cairn['url']}/ui/#token={cairn['token']}")
    return page, errors


def test_the_page_shows_the_winner_and_a_failed_stages_log(browser, cairn, artifacts_dir):
    page, errors = page_for(browser, cairn)
    run = cairn["run"]
    item = page.locator(f'[data-run="{run}"]')
    expect(item).to_contain_text("ui-lineage")
    expect(item).to_contain_text("failed")
    item.click()
    # The group fanned out: one winner (min of 2, 5, 9), two losers with reasons.
    winner = page.locator('.node.winner[data-stage="sweep"]')
    expect(winner).to_have_count(1)
    expect(winner).to_have_attribute("data-branch", "low")
    expect(winner).to_contain_text("★ won")
    losers = page.locator('.node.loser[data-stage="sweep"]')
    expect(losers).to_have_count(2)
    assert "lost under min" in losers.first.get_attribute("title")
    # The dead stage is red, and its log is one click away.
    dead = page.locator('.node.dead[data-stage="broken"]')
    expect(dead).to_have_count(1)
    dead.click()
    expect(page.locator("#log")).to_contain_text("boom-marker from the broken stage")
    expect(page.locator("#detail")).to_contain_text("cairn restore ")
    # Its costs, from the run's audit.
    expect(page.locator("#cost")).to_contain_text("setup / compute")
    page.screenshot(path=str(artifacts_dir / "run-failed-stage.png"), full_page=True)
    assert not errors, errors


def test_an_artifact_downloads_with_the_token(browser, cairn):
    page, errors = page_for(browser, cairn)
    page.locator(f'[data-run="{cairn["run"]}"]').click()
    page.locator('.node.winner[data-stage="sweep"]').click()
    with page.expect_download() as d:
        page.get_by_role("button", name="download").click()
    assert open(d.value.path()).read() == "2\n"
    # Nothing absent is printed as "null" or "undefined".
    shown = page.locator("#detail").inner_text() + page.locator("#run-head").inner_text()
    assert "null" not in shown and "undefined" not in shown, shown
    assert not errors, errors


def test_a_run_started_later_appears_and_ends_without_a_reload(browser, cairn, artifacts_dir):
    page, errors = page_for(browser, cairn)
    expect(page.locator(f'[data-run="{cairn["run"]}"]')).to_be_visible()
    started = start_run(
        cairn,
        cairn["token"],
        '[pipeline]\nname = "ui-live"\nimage = "busybox"\n\n[[stage]]\nname = "wait"\n'
        'key = "wait-v1"\nrun = ["sleep 1; echo waited"]\n',
    )
    item = page.locator(f'[data-run="{started["id"]}"]')
    expect(item).to_be_visible(timeout=20_000)
    item.click()
    expect(page.locator('.node[data-stage="wait"]')).to_have_class("node completed", timeout=30_000)
    page.screenshot(path=str(artifacts_dir / "run-live.png"))
    assert not errors, errors


def test_the_page_is_served_without_a_token_but_the_api_is_not(cairn):
    page = urllib.request.urlopen(f"{cairn['url']}/ui/").read().decode()
    assert "/ui/app.js" in page
    try:
        urllib.request.urlopen(f"{cairn['url']}/v1/runs")
        raise AssertionError("the API answered without a token")
    except urllib.error.HTTPError as e:
        assert e.code == 401


def test_a_run_of_ten_thousand_stages_draws_only_what_is_in_view(browser, cairn, artifacts_dir):
    # Written straight into the state database the server reads: the page's
    # work, not the orchestrator's, is what is measured here.
    import sqlite3
    import time as clock

    now = int(clock.time() * 1000)
    run = "abcdef012345"
    db = sqlite3.connect(f"{cairn['home']}/state.db", timeout=30)
    with db:
        db.execute(
            "INSERT INTO runs (id, pipeline, file, spec, params, status, created_at, ended_at, error) "
            "VALUES (?, 'ten-thousand', 'synthetic', '', '', 'completed', ?, ?, NULL)",
            (run, now - 60_000, now),
        )
        db.executemany(
            "INSERT INTO stages (run_id, stage, branch, stage_key, status, attempts, input_snapshot, "
            "output_snapshot, sandbox_id, started_at, ended_at, error, metric) "
            "VALUES (?, ?, '', ?, 'completed', 1, NULL, NULL, NULL, ?, ?, NULL, NULL)",
            [(run, f"s{i:05}", f"k-{run}-{i}", now - 60_000 + i, now - 60_000 + i + 1) for i in range(10_000)],
        )
    db.close()
    page, errors = page_for(browser, cairn)
    page.locator(f'[data-run="{run}"]').click()
    expect(page.locator('.node[data-stage="s00000"]')).to_be_visible()
    drawn = page.locator(".node").count()
    assert 0 < drawn < 100, f"{drawn} nodes in the page for 10,000 stages"
    page.locator("#dag").evaluate("d => { d.scrollTop = d.scrollHeight; }")
    expect(page.locator('.node[data-stage="s09999"]')).to_be_visible()
    assert page.locator(".node").count() < 100
    page.screenshot(path=str(artifacts_dir / "run-10000-stages.png"))
    assert not errors, errors


def test_a_session_shows_its_context_log_beside_its_snapshots(browser, cairn, artifacts_dir):
    made = cairn["cli"]("session", "create", "--name", "ui-session").stdout.split()[-1]
    try:
        cairn["cli"]("session", "exec", made, "--", "sh", "-c", "echo hello-from-the-session")
        cairn["cli"]("session", "suspend", made)
        page, errors = page_for(browser, cairn)
        item = page.locator(f'[data-session="{made}"]')
        expect(item).to_contain_text("ui-session")
        expect(item).to_contain_text("suspended")
        # Its context log beside the snapshots the log records.
        item.click()
        expect(page.locator("#session-log")).to_contain_text("hello-from-the-session")
        expect(page.locator("#session-snapshots")).to_contain_text("cairn restore ")
        assert "null" not in page.locator("#detail").inner_text()
        page.screenshot(path=str(artifacts_dir / "session.png"))
        assert not errors, errors
    finally:
        cairn["cli"]("session", "rm", made, "--purge", check=False)


def test_a_run_the_cli_executes_is_followed_to_its_end(browser, cairn, tmp_path):
    import subprocess

    path = tmp_path / "cli.toml"
    path.write_text(
        '[pipeline]\nname = "ui-cli"\nimage = "busybox"\n\n[[stage]]\nname = "slow"\nkey = "slow-v1"\n'
        'run = ["sleep 6; echo slept"]\n'
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "CAIRN_STATE"}
    env["CAIRN_HOME"] = cairn["home"]
    proc = subprocess.Popen([cairn["bin"], "pipeline", "run", str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        run = proc.stdout.readline().strip()
        page, errors = page_for(browser, cairn)
        page.locator(f'[data-run="{run}"]').click()
        node = page.locator('.node[data-stage="slow"]')
        expect(node).to_have_class("node running", timeout=10_000)
        # No event reaches the server from the CLI: the page reads the run again.
        expect(node).to_have_class("node completed", timeout=30_000)
        assert not errors, errors
    finally:
        proc.wait(timeout=60)


TREE = """
[pipeline]
name = "ui-tree"
image = "busybox"

[[stage]]
name = "left"
after = "prepare"
key = "tree-left-v1"
run = ["echo left > /side"]

[[stage]]
name = "prepare"
key = "tree-prepare-v1"
run = ["echo prepared > /base"]

[[stage]]
name = "right"
after = "prepare"
key = "tree-right-v1"
run = ["echo right > /side"]

[[stage]]
name = "pick"
after = "left"
key = "tree-pick-{hypothesis}"
run = ["echo {hypothesis.v} > /v"]
[stage.branches]
select = "min"
metric = "file:/v"
hypotheses = [{ name = "one", v = "1" }, { name = "two", v = "2" }]

[[stage]]
name = "finish"
after = "pick"
key = "tree-finish-v1"
run = ["cat /v"]
"""


def test_two_stages_after_one_are_drawn_as_a_tree_with_edges_from_the_parent(browser, cairn, artifacts_dir):
    import time

    run = call(cairn, "POST", "/v1/runs", {"pipeline": TREE})["id"]
    deadline = time.time() + 120
    while call(cairn, "GET", f"/v1/runs/{run}")["run"]["status"] == "running":
        assert time.time() < deadline, "the tree run did not end"
        time.sleep(0.3)
    page, errors = page_for(browser, cairn)
    page.locator(f'[data-run="{run}"]').click()
    node = lambda stage: page.locator(f'.node[data-stage="{stage}"]')
    expect(node("finish")).to_be_visible()
    # Layers by the edges, not by the order the stages ran in: both
    # children of prepare share the layer below it, side by side.
    layer = lambda stage: int(node(stage).first.get_attribute("data-layer"))
    assert [layer(s) for s in ("prepare", "left", "right", "pick", "finish")] == [0, 1, 1, 2, 3]
    box = lambda stage: rect(page, f'.node[data-stage="{stage}"]')
    parent, left, right = box("prepare"), box("left"), box("right")
    assert left["y"] == right["y"] > parent["y"] + parent["height"]
    assert abs(left["x"] - right["x"]) >= left["width"], "side by side, not stacked"
    centre = lambda b: b["x"] + b["width"] / 2
    assert min(centre(left), centre(right)) < centre(parent) < max(centre(left), centre(right))
    # One edge from the parent into each child, from its bottom to their tops.
    for child, b in (("left", left), ("right", right)):
        edge = f'.edge[data-from="prepare"][data-to="{child}"]'
        expect(page.locator(edge)).to_have_count(1)
        e = rect(page, edge)
        assert abs(e["y"] - (parent["y"] + parent["height"])) <= 2, (e, parent)
        assert abs(e["y"] + e["height"] - b["y"]) <= 2, (e, b)
        assert e["x"] - 2 <= centre(b) <= e["x"] + e["width"] + 2, (e, b)
    expect(page.locator('.edge[data-from="left"][data-to="right"]')).to_have_count(0)
    expect(page.locator('.edge[data-to="prepare"]')).to_have_count(0)
    # The branch group under left, fanned out: winner, dashed loser, reasons.
    pick = page.locator('.node[data-stage="pick"]')
    expect(pick).to_have_count(2)
    ones = page.locator('.node.winner[data-stage="pick"]')
    expect(ones).to_have_attribute("data-branch", "one")
    expect(ones).to_contain_text("★ won")
    assert "lost under min" in page.locator('.node.loser[data-stage="pick"]').get_attribute("title")
    assert rect(page, '.node.winner[data-stage="pick"]')["y"] > left["y"]
    expect(page.locator('.edge[data-from="left"][data-to="pick"]')).to_have_count(1)
    # The next stage hangs from the winner.
    winner, finish = rect(page, '.node.winner[data-stage="pick"]'), box("finish")
    e = rect(page, '.edge[data-from="pick"][data-to="finish"]')
    assert abs(e["x"] - min(centre(winner), centre(finish))) <= 2, (e, winner, finish)
    assert abs(e["x"] + e["width"] - max(centre(winner), centre(finish))) <= 2, (e, winner, finish)
    assert abs(e["y"] - (winner["y"] + winner["height"])) <= 2, (e, winner)
    page.screenshot(path=str(artifacts_dir / "run-tree.png"))
    assert not errors, errors


def test_a_wide_tree_of_ten_thousand_stages_draws_only_what_is_in_view(browser, cairn, artifacts_dir):
    # A stored pipeline of 10,000 stages, each after stage (i - 1) / 2: a
    # binary tree 14 layers deep, its last layer thousands of nodes wide.
    import sqlite3
    import time as clock

    n = 10_000
    spec = ['[pipeline]\nname = "wide"\nimage = "busybox"\n']
    for i in range(n):
        after = f'after = "w{(i - 1) // 2:05}"\n' if i else ""
        spec.append(f'[[stage]]\nname = "w{i:05}"\n{after}key = "wide-{i}"\nrun = ["true"]\n')
    now = int(clock.time() * 1000)
    run = "abcdef0wide0"
    db = sqlite3.connect(f"{cairn['home']}/state.db", timeout=30)
    with db:
        db.execute(
            "INSERT INTO runs (id, pipeline, file, spec, params, status, created_at, ended_at, error) "
            "VALUES (?, 'wide', 'wide.toml', ?, '', 'completed', ?, ?, NULL)",
            (run, "\n".join(spec), now - 60_000, now),
        )
        db.executemany(
            "INSERT INTO stages (run_id, stage, branch, stage_key, status, attempts, input_snapshot, "
            "output_snapshot, sandbox_id, started_at, ended_at, error, metric) "
            "VALUES (?, ?, '', ?, 'completed', 1, NULL, NULL, NULL, ?, ?, NULL, NULL)",
            [(run, f"w{i:05}", f"k-{run}-{i}", now - 60_000 + i, now - 60_000 + i + 1) for i in range(n)],
        )
    db.close()
    page, errors = page_for(browser, cairn)
    page.locator(f'[data-run="{run}"]').click()
    # It opens on the root, in the middle of a graph a million pixels wide.
    expect(page.locator('.node[data-stage="w00000"]')).to_be_visible()
    assert page.locator("#dag").evaluate("d => d.scrollWidth") > 500_000
    assert 0 < page.locator(".node").count() < 100
    assert page.locator(".node[data-layer='13']").count() == 0, "the bottom layer is out of view"
    # To the bottom right: the rightmost leaf, w08190 (the last of layer 12;
    # layer 13's stages hang under the left part of layer 12).
    page.locator("#dag").evaluate("d => { d.scrollTop = d.scrollHeight; d.scrollLeft = d.scrollWidth; }")
    expect(page.locator('.node[data-stage="w08190"]')).to_be_visible()
    assert page.locator('.node[data-stage="w08190"]').get_attribute("data-layer") == "12"
    expect(page.locator('.edge[data-from="w04094"][data-to="w08190"]')).to_have_count(1)
    assert 0 < page.locator(".node").count() < 100
    assert 0 < page.locator(".edge").count() < 100
    page.screenshot(path=str(artifacts_dir / "run-10000-tree.png"))
    assert not errors, errors


def test_a_sessions_older_entries_load_a_page_at_a_time(browser, cairn, artifacts_dir):
    made = cairn["cli"]("session", "create", "--name", "ui-paging").stdout.split()[-1]
    try:
        append = lambda text: call(cairn, "POST", f"/v1/sessions/{made}/entries", {"kind": "note", "content": text})
        for i in range(1, 301):
            append(f"before-rewind {i}")
        # Entries 251 to 300 leave the live log: its seqs then skip them.
        call(cairn, "POST", f"/v1/sessions/{made}/rewind", {"to": 250})
        for i in range(1, 151):
            append(f"after-rewind {i}")
        live = call(cairn, "GET", f"/v1/sessions/{made}/log?from=1&limit=1000")["entries"]
        contents = [e.get("content") for e in live]
        assert "before-rewind 250" in contents and "before-rewind 251" not in contents
        expected = [e["seq"] for e in live]
        assert len(expected) >= 400 and expected[-1] - expected[0] + 1 > len(expected), "seqs skip the abandoned"
        page, errors = page_for(browser, cairn)
        page.locator(f'[data-session="{made}"]').click()
        rows = page.locator("#session-log tr")
        expect(rows).to_have_count(200)
        seqs = lambda: [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.seq)")]
        assert seqs() == expected[-200:]
        older = page.locator("#session-older")
        expect(older).to_be_visible()
        older.click()
        expect(rows).to_have_count(min(400, len(expected)))
        assert seqs() == expected[-400:]
        while older.is_visible():
            older.click()
            page.wait_for_timeout(200)
        assert seqs() == expected
        expect(page.locator(f'#session-log tr[data-seq="{expected[contents.index("before-rewind 1")]}"]')).to_contain_text(
            "before-rewind 1"
        )
        # The start of the log: nothing older to ask for.
        expect(older).to_be_hidden()
        page.screenshot(path=str(artifacts_dir / "session-paged.png"))
        assert not errors, errors
    finally:
        cairn["cli"]("session", "rm", made, "--purge", check=False)


def test_a_run_named_in_the_address_opens_and_an_unknown_one_says_why(browser, cairn):
    page, errors = page_for(browser, cairn)
    run = cairn["run"]
    expect(page.locator(f'[data-run="{run}"]')).to_be_visible()
    # The token is kept for the tab: loading the page on a run's address
    # opens that run, by its whole id.
    # (A new hash alone is not a new load: reload.)
    page.goto(f"{cairn['url']}/ui/#/run/{run}")
    page.reload()
    expect(page.locator('.node[data-stage="sweep"]').first).to_be_visible()
    # An id no run has: the error the API gave, as text.
    page.goto(f"{cairn['url']}/ui/#/run/0123456789ab")
    page.reload()
    expect(page.locator("#error")).to_contain_text("0123456789ab")
    expect(page.locator("#error")).not_to_contain_text("[object Object]")
    assert errors == []


def test_a_tenants_token_shows_its_own_runs_only(browser, cairn, artifacts_dir):
    tenant = f"ui{uuid.uuid4().hex[:8]}"
    cairn["cli"]("tenant", "create", tenant)
    token = json.loads(cairn["cli"]("token", "create", f"{tenant}-page", "--tenant", tenant, "--json").stdout)["secret"]
    started = start_run(
        cairn,
        token,
        '[pipeline]\nname = "ui-tenant"\nimage = "busybox"\n\n[[stage]]\nname = "mine"\n'
        f'key = "mine-{tenant}"\nrun = ["echo mine"]\n',
    )
    page = browser.new_page(viewport={"width": 1500, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{cairn['url']}/ui/#token={token}")
    item = page.locator(f'[data-run="{started["id"]}"]')
    expect(item).to_be_visible(timeout=20_000)
    # The administrator's run is not on the tenant's page, nor reachable by its id.
    expect(page.locator(f'[data-run="{cairn["run"]}"]')).to_have_count(0)
    expect(page.locator("[data-run]")).to_have_count(1)
    item.click()
    expect(page.locator('.node[data-stage="mine"]')).to_have_class("node completed", timeout=30_000)
    page.goto(f"{cairn['url']}/ui/#/run/{cairn['run']}")
    page.reload()
    expect(page.locator("#error")).to_contain_text(cairn["run"])
    page.screenshot(path=str(artifacts_dir / "tenant-runs.png"))
    assert errors == []
