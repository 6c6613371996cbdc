"""The lineage page of `cairn serve` in a real headless Chromium: it loads a
run the CLI made, marks the branch group's winner, opens a failed stage's
log, downloads an artifact, follows a run started after it loaded, draws a
run of 10,000 stages, and shows a session's log beside its snapshots."""

import json
import urllib.request

from playwright.sync_api import expect


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
    body = json.dumps(
        {
            "pipeline": '[pipeline]\nname = "ui-live"\nimage = "busybox"\n\n[[stage]]\nname = "wait"\n'
            'key = "wait-v1"\nrun = ["sleep 1; echo waited"]\n'
        }
    ).encode()
    req = urllib.request.Request(
        f"{cairn['url']}/v1/runs",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {cairn['token']}", "Content-Type": "application/json"},
    )
    started = json.load(urllib.request.urlopen(req))
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
