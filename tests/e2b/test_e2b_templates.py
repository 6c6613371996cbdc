"""Templates built through E2B's template API with the real e2b SDK's
`Template` builder (sync and async) against `cairn serve --e2b`
(conftest.py): steps, uploaded files, users, the start and ready
commands, tags, failures that name their step, and a build killed by a
server stop."""

import asyncio
import os
import subprocess
import tempfile
import time
import uuid

import httpx
import pytest
from e2b import AsyncTemplate, BuildException, Sandbox, SandboxException, Template


def _run(sbx, cmd, **kw):
    return sbx.commands.run(cmd, **kw).stdout.strip()


def _images(cairn_e2b):
    env = dict(os.environ, CAIRN_HOME=cairn_e2b["home"])
    out = subprocess.run([cairn_e2b["bin"], "image", "ls"], env=env, capture_output=True, text=True, check=True)
    return out.stdout


def _sandbox_names(cairn_e2b):
    env = dict(os.environ, CAIRN_HOME=cairn_e2b["home"])
    out = subprocess.run([cairn_e2b["bin"], "ps"], env=env, capture_output=True, text=True, check=True)
    return out.stdout


def test_a_template_built_from_steps_starts_sandboxes_with_its_files_env_user_workdir_and_server(cairn_e2b):
    name = f"tpl-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as ctx:
        with open(os.path.join(ctx, "app.txt"), "w") as f:
            f.write("from the context\n")
        os.makedirs(os.path.join(ctx, "site", "deep"))
        with open(os.path.join(ctx, "site", "deep", "page.txt"), "w") as f:
            f.write("deep page\n")
        template = (
            Template(file_context_path=ctx)
            .from_base_image()
            .copy("app.txt", "/app/")
            .copy("site", "/app/site", mode=0o640)
            .set_envs({"GREETING": "hello from the template"})
            .run_cmd("echo built > /app/built.txt && echo \"$GREETING\" > /app/env.txt")
            .set_user("user")
            .run_cmd("id -u > /home/user/uid.txt && touch /home/user/mine")
            .copy("app.txt", "/home/user/copied.txt", user="user")
            .set_user("root")
            .set_workdir("/app")
            .set_start_cmd("httpd -f -p 8080 -h /app", "wget -q -O /dev/null http://127.0.0.1:8080/app.txt")
        )
        logs = []
        info = Template.build(template, name, on_build_logs=logs.append)
    assert info.name == name and info.build_id
    text = "\n".join(str(l.message) for l in logs)
    assert "RUN echo built" in text and "the ready command succeeded" in text, text

    assert Template.exists(name) and not Template.exists(f"{name}-missing")
    sbx = Sandbox.create(name)
    try:
        assert _run(sbx, "cat /app/app.txt") == "from the context"
        # The busybox base had no `user`: the build added E2B's, once, and
        # commands run as it by default.
        assert _run(sbx, "grep -c '^user:x:1000:1000:' /etc/passwd") == "1"
        assert _run(sbx, "id -u") == "1000" and _run(sbx, "id -u", user="root") == "0"
        assert _run(sbx, "stat -c '%a %U' /app/site/deep/page.txt") == "640 root"
        assert _run(sbx, "cat /app/site/deep/page.txt", user="root") == "deep page"
        assert sbx.commands.run("cat /app/site/deep/page.txt 2>&1 || true").stdout.strip().endswith("Permission denied")
        assert _run(sbx, "cat /app/built.txt /app/env.txt") == "built\nhello from the template"
        assert _run(sbx, "echo $GREETING") == "hello from the template"
        assert _run(sbx, "echo $GREETING", envs={"GREETING": "overridden"}) == "overridden"
        assert _run(sbx, "pwd") == "/app", "commands run in the template's WORKDIR"
        assert _run(sbx, "cat /home/user/uid.txt") == "1000", "the RUN after USER ran as the user"
        assert _run(sbx, "stat -c %u:%g /home/user/mine /home/user/copied.txt") == "1000:1000\n1000:1000"
        # The start command serves; its ready command was awaited by create.
        assert _run(sbx, "wget -q -O - http://127.0.0.1:8080/built.txt") == "built"
    finally:
        sbx.kill()
    assert f"e2b-" in _images(cairn_e2b)
    assert "e2b-build-" not in _sandbox_names(cairn_e2b), "the build sandbox is removed"

    # Tags: a second build under a tag, then tags moved and removed.
    info2 = Template.build(Template().from_template(name).run_cmd("echo v2 > /app/version"), f"{name}:v2")
    sbx = Sandbox.create(f"{name}:v2")
    try:
        assert _run(sbx, "cat /app/version /app/built.txt") == "v2\nbuilt", "from_template keeps the base's files"
    finally:
        sbx.kill()
    tagged = Template.assign_tags(f"{name}:v2", ["stable", "prod"])
    assert tagged.build_id == info2.build_id and tagged.tags == ["stable", "prod"]
    tags = {t.tag: t.build_id for t in Template.get_tags(name)}
    assert tags == {"default": info.build_id, "v2": info2.build_id, "stable": info2.build_id, "prod": info2.build_id}
    Template.remove_tags(name, ["prod"])
    assert "prod" not in {t.tag for t in Template.get_tags(name)}
    sbx = Sandbox.create(f"{name}:stable")
    try:
        assert _run(sbx, "cat /app/version") == "v2"
    finally:
        sbx.kill()

    # Deleting the template removes its images; its name then starts nothing.
    r = httpx.delete(f"{cairn_e2b['url']}/templates/{name}", headers={"X-API-Key": cairn_e2b["key"]})
    assert r.status_code == 204, r.text
    assert not Template.exists(name)
    assert f"e2b-{info.template_id}" not in _images(cairn_e2b)
    with pytest.raises(SandboxException):
        Sandbox.create(name)


def test_a_template_builds_from_a_snapshot_of_a_sandbox(cairn_e2b):
    sbx = Sandbox.create()
    try:
        sbx.commands.run("echo from the snapshot > /home/user/state.txt")
        snapshot = sbx.create_snapshot().snapshot_id
    finally:
        sbx.kill()
    name = f"snap-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_template(snapshot).run_cmd("echo built >> /home/user/state.txt"), name)
    sbx = Sandbox.create(name)
    try:
        assert _run(sbx, "cat /home/user/state.txt") == "from the snapshot\nbuilt"
    finally:
        sbx.kill()


def test_a_failed_step_names_itself_with_its_output_and_leaves_no_image(cairn_e2b):
    name = f"fail-{uuid.uuid4().hex[:8]}"
    before = _images(cairn_e2b)
    template = Template().from_base_image().run_cmd("echo fine").run_cmd("echo the tail of the output; exit 3")
    with pytest.raises(BuildException) as err:
        Template.build(template, name)
    message = str(err.value)
    assert "exited with code 3" in message and "the tail of the output" in message, message
    assert _images(cairn_e2b) == before, "a failed build leaves no image"
    assert "e2b-build-" not in _sandbox_names(cairn_e2b)
    with pytest.raises(SandboxException):
        Sandbox.create(name)

    # Bases Cairn cannot pull and steps it cannot run are refused naming
    # what is supported.
    with pytest.raises(BuildException) as err:
        Template.build(Template().from_image("ubuntu:22.04").run_cmd("true"), name)
    assert "pulls from no registry" in str(err.value) and "debian:SUITE" in str(err.value), str(err.value)
    with pytest.raises(BuildException) as err:
        Template.build(Template().from_template("no-such-template").run_cmd("true"), name)
    assert "not found" in str(err.value)
    with pytest.raises(BuildException) as err:
        Template.build(Template().from_base_image().set_user("nobody-here").run_cmd("true"), name)
    assert "nobody-here" in str(err.value) and "/etc/passwd" in str(err.value)
    r = httpx.post(
        f"{cairn_e2b['url']}/v3/templates",
        headers={"X-API-Key": cairn_e2b["key"]},
        json={"name": "Bad Name"},
    )
    assert r.status_code == 400 and "template name" in r.json()["message"]


def test_the_async_builder_builds_and_its_status_pages_the_log(cairn_e2b):
    name = f"async-{uuid.uuid4().hex[:8]}"

    async def main():
        template = AsyncTemplate().from_base_image().run_cmd("for i in $(seq 1 150); do echo line $i; done")
        info = await AsyncTemplate.build_in_background(template, name)
        while True:
            status = await AsyncTemplate.get_build_status(info)
            if status.status.value in ("ready", "error"):
                break
            await asyncio.sleep(0.2)
        assert status.status.value == "ready", status
        first = await AsyncTemplate.get_build_status(info, logs_offset=0)
        assert len(first.log_entries) == 100, "a status answer carries at most 100 lines"
        rest = await AsyncTemplate.get_build_status(info, logs_offset=100)
        lines = [e.message for e in first.log_entries + rest.log_entries]
        assert "line 1" in lines and "line 150" in lines
        return info

    asyncio.run(main())
    sbx = Sandbox.create(name)
    try:
        assert _run(sbx, "echo ok") == "ok"
    finally:
        sbx.kill()


def test_a_build_cut_off_by_a_server_stop_fails_and_leaves_nothing(server_of_its_own, cairn_e2b):
    with server_of_its_own("tpl-kill") as srv:
        api = {"api_key": srv["key"], "api_url": srv["url"]}
        name = "cut-off"
        info = Template.build_in_background(
            Template().from_base_image().run_cmd("echo started; sleep 60"), name, **api
        )
        deadline = time.time() + 30
        while True:
            status = Template.get_build_status(info, **api)
            if any("started" in e.message for e in status.log_entries) or time.time() > deadline:
                break
            time.sleep(0.2)
        assert status.status.value == "building", status
        binary = cairn_e2b["bin"]
        env = dict(os.environ, CAIRN_HOME=srv["home"])
        # The server is stopped with SIGKILL: nothing of it runs on.
        pid = subprocess.run(["pgrep", "-f", f"serve --e2b {srv['url'][7:]}"], capture_output=True, text=True)
        for p in pid.stdout.split():
            os.kill(int(p), 9)
        time.sleep(0.5)
        port = srv["url"].rsplit(":", 1)[1]
        log = open(os.path.join(srv["home"], "serve2.log"), "a")
        again = subprocess.Popen(
            [binary, "serve", "--e2b", f"127.0.0.1:{port}", "--e2b-base", "busybox"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.time() + 30
            while True:
                try:
                    status = Template.get_build_status(info, **api)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.2)
            assert status.status.value == "error" and "server stopped" in status.reason.message, status
            images = subprocess.run([binary, "image", "ls"], env=env, capture_output=True, text=True).stdout
            assert "e2b-" not in images
            ps = subprocess.run([binary, "ps"], env=env, capture_output=True, text=True).stdout
            assert "e2b-build-" not in ps, ps
        finally:
            again.terminate()
            again.wait(timeout=30)


def test_from_dockerfile_is_read_by_the_sdk_into_steps_that_cairn_runs(cairn_e2b):
    name = f"df-{uuid.uuid4().hex[:8]}"
    dockerfile = (
        "FROM e2bdev/base\n"
        "ARG GREETING=hey\n"
        "ENV MODE=prod\n"
        "WORKDIR /srv\n"
        "COPY hello.txt .\n"
        "RUN echo \"$GREETING $MODE\" > built.txt\n"
        "CMD [\"httpd\", \"-f\", \"-p\", \"8080\", \"-h\", \"/srv\"]\n"
    )
    with tempfile.TemporaryDirectory() as ctx:
        with open(os.path.join(ctx, "hello.txt"), "w") as f:
            f.write("hi\n")
        Template.build(Template(file_context_path=ctx).from_dockerfile(dockerfile), name)
    sbx = Sandbox.create(name)
    try:
        assert _run(sbx, "cat /srv/hello.txt /srv/built.txt") == "hi\nhey prod"
        assert _run(sbx, "pwd") == "/srv"
        # CMD is the start command, started with the sandbox.
        served = _run(sbx, "for i in $(seq 50); do wget -q -O - http://127.0.0.1:8080/hello.txt && break; sleep 0.1; done")
        assert served == "hi"
    finally:
        sbx.kill()
