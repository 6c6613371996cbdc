"""E2B's default template as Cairn serves it by default (`--e2b-base
debian`): Debian with bash, python3, pip, git and curl, built from Debian's
packages when the server starts without it, and commands and files as
E2B's user `user` (uid 1000, home /home/user), through the real e2b SDK."""

import os
import subprocess
import time

import pytest
from e2b import Sandbox


def _create(srv, **kw):
    return Sandbox.create(api_url=srv["url"], sandbox_url=srv["url"], api_key=srv["key"], **kw)


@pytest.fixture(scope="module")
def debian_server(server_of_its_own):
    with server_of_its_own("debian-base", "--e2b-base", "debian") as srv:
        yield srv


def test_the_base_is_built_on_first_use_and_is_e2bs_debian_with_its_user(debian_server, cairn_e2b):
    srv = debian_server
    # The server builds the base when it starts; a create meanwhile waits,
    # then is told to come back (503) while the build goes on.
    deadline = time.time() + 1200
    while True:
        try:
            sbx = _create(srv)
            break
        except Exception as e:  # the SDK raises a 503 as ServiceBusyException
            assert "being built" in str(e), e
            assert time.time() < deadline, "the base was not built within 20 minutes"
            time.sleep(5)
    try:
        r = sbx.commands.run("id -un; id -u; echo $HOME; pwd; echo $BASH_VERSION | cut -c1")
        assert r.stdout.split() == ["user", "1000", "/home/user", "/home/user", "5"], r.stdout
        versions = sbx.commands.run("python3 --version && pip --version && git --version && curl --version | head -1")
        assert versions.exit_code == 0 and "Python 3" in versions.stdout and "git version" in versions.stdout
        assert sbx.commands.run("id -u", user="root").stdout.strip() == "0"
        # Files and directories are the user's, with E2B's modes.
        sbx.files.write("/home/user/notes/a.txt", "hello")
        sbx.files.make_dir("/home/user/made")
        modes = sbx.commands.run("stat -c '%a %U' /home/user /home/user/notes /home/user/notes/a.txt /home/user/made")
        assert modes.stdout.split("\n")[:4] == ["755 user", "755 user", "644 user", "755 user"], modes.stdout
        info = sbx.files.get_info("/home/user/made")
        assert (info.owner, info.permissions) == ("user", "drwxr-xr-x")
        # The user owns no more than their own: root's files stay root's.
        denied = sbx.commands.run("touch /etc/x 2>&1 || echo refused")
        assert "refused" in denied.stdout
        root_file = sbx.commands.run("touch /etc/x && stat -c %U /etc/x", user="root")
        assert root_file.stdout.strip() == "root"
        # pip installs beside Debian's packages, as in E2B's base.
        pip = sbx.commands.run("pip install --help >/dev/null && echo pip-ok")
        assert pip.stdout.strip() == "pip-ok"
    finally:
        sbx.kill()
    env = dict(os.environ, CAIRN_HOME=srv["home"])
    images = subprocess.run([cairn_e2b["bin"], "image", "ls"], env=env, capture_output=True, text=True).stdout
    assert "e2b-base" in images, images


def test_the_async_client_runs_as_user_on_the_base_and_as_root_when_asked(debian_server):
    import asyncio

    from e2b import AsyncSandbox

    srv = debian_server

    async def main():
        sbx = await AsyncSandbox.create(api_url=srv["url"], sandbox_url=srv["url"], api_key=srv["key"])
        try:
            assert (await sbx.commands.run("id -un")).stdout.strip() == "user"
            assert (await sbx.commands.run("id -un", user="root")).stdout.strip() == "root"
            await sbx.files.write("/home/user/x.txt", "x")
            info = await sbx.files.get_info("/home/user/x.txt")
            assert (info.owner, info.group) == ("user", "user")
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_a_template_from_a_debian_suite_is_built_from_debians_packages(debian_server):
    from e2b import Template

    srv = debian_server
    api = {"api_url": srv["url"], "api_key": srv["key"]}
    with open("/etc/os-release") as f:
        suite = next(l.split("=", 1)[1].strip().strip('"') for l in f if l.startswith("VERSION_CODENAME="))
    logs = []
    template = Template().from_debian_image(suite).run_cmd("cat /etc/debian_version > /home/user/version")
    Template.build(template, "debian-tpl", on_build_logs=logs.append, **api)
    assert any(f"debian-{suite}" in str(l.message) for l in logs), "the suite's image was built on first use"
    sbx = _create(srv, template="debian-tpl")
    try:
        version = sbx.commands.run("cat /home/user/version; id -un")
        assert version.stdout.split()[1] == "user" and version.stdout[0].isdigit(), version.stdout
    finally:
        sbx.kill()
