"""E2B's network rules through the real e2b SDK against a server of its own
started with `--e2b-network egress`: a route out by default, allow_out and
deny_out as E2B reads them (allows win; 0.0.0.0/0 is all traffic),
update_network live and kept across pause and resume. The outside world is
the package registries (the hosts reachable from every machine this runs
on); needs root and nftables, as Cairn's own network tests do."""

import asyncio
import os
import shutil
import socket

import pytest
from e2b import ALL_TRAFFIC, AsyncSandbox, InvalidArgumentException, Sandbox, SandboxException

# On some machines every registry is one proxy address: one host, and
# addresses no sandbox reaches anyway, are what the checks tell apart.
OUT = "pypi.org"


def _missing():
    if os.geteuid() != 0:
        return "sandbox networking needs root"
    if shutil.which("nft") is None:
        return "nft is not installed; apt-get install nftables"
    return None


@pytest.fixture(scope="module")
def egress_server(server_of_its_own):
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with server_of_its_own("net", "--e2b-network", "egress") as server:
        yield server


def _create(srv, **kw):
    return Sandbox.create(api_url=srv["url"], sandbox_url=srv["url"], api_key=srv["key"], **kw)


def _reaches(s, host, port=443):
    """Whether the sandbox connects to host:port (an address: no DNS wait)."""
    r = s.commands.run(f"if nc -w 5 {host} {port} </dev/null; then echo yes; else echo no; fi", timeout=30)
    return r.stdout.strip() == "yes"


def _addr(name):
    return socket.gethostbyname(name)


def _slots_of(home):
    d = "/run/cairn/net/slots"
    return [f for f in os.listdir(d) if home in open(os.path.join(d, f)).read()] if os.path.isdir(d) else []


def test_a_sandbox_has_a_route_out_unless_denied(egress_server):
    s = _create(egress_server)
    try:
        assert s.commands.run(f"nslookup {OUT} >/dev/null && echo resolved").stdout.strip() == "resolved"
        assert _reaches(s, OUT)
        assert s.get_info().network == {"allow_out": [], "deny_out": [], "allow_public_traffic": False}
    finally:
        s.kill()
    closed = _create(egress_server, allow_internet_access=False)
    try:
        assert not _reaches(closed, _addr(OUT))
        assert closed.get_info().network["deny_out"] == [ALL_TRAFFIC]
    finally:
        closed.kill()


def test_allows_win_over_denies_and_names_are_pinned(egress_server):
    out = _addr(OUT)
    s = _create(egress_server, network={"deny_out": [ALL_TRAFFIC], "allow_out": [OUT]})
    try:
        assert _reaches(s, OUT), "an allowed name resolves (pinned) and connects"
        assert f"{out}\t{OUT}" in s.files.read("/etc/hosts")
        info = s.get_info()
        assert info.network["allow_out"] == [OUT] and info.network["deny_out"] == [ALL_TRAFFIC]
    finally:
        s.kill()
    for network, reaches in [
        ({"deny_out": [f"{out}/32"]}, False),
        ({"deny_out": ["198.51.100.7"]}, True),
        ({"deny_out": [".".join(out.split(".")[:3]) + ".0/24"], "allow_out": [out]}, True),
        ({"deny_out": [ALL_TRAFFIC], "allow_out": ["192.0.2.1"]}, False),
    ]:
        s = _create(egress_server, network=network)
        try:
            assert _reaches(s, out) == reaches, network
        finally:
            s.kill()


def test_update_network_changes_the_rules_live_and_a_resume_keeps_them(egress_server):
    out = _addr(OUT)
    s = _create(egress_server)
    try:
        assert _reaches(s, out)
        s.update_network({"deny_out": [ALL_TRAFFIC]})
        assert not _reaches(s, out)
        s.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [OUT]})
        assert _reaches(s, OUT)
        assert OUT in s.files.read("/etc/hosts")
        s.update_network({"deny_out": [ALL_TRAFFIC]})
        # A paused sandbox resumes with its rules.
        assert s.pause()
        s = Sandbox.connect(s.sandbox_id, api_url=egress_server["url"], sandbox_url=egress_server["url"],
                            api_key=egress_server["key"])
        assert not _reaches(s, out)
        # An empty update clears them.
        s.update_network({})
        assert _reaches(s, out)
        # Forks keep their parent's rules.
        s.update_network({"deny_out": [f"{out}/32"]})
        fork = s.fork(count=1)[0]
        try:
            assert not _reaches(fork, out)
            assert fork.get_info().network["deny_out"] == [f"{out}/32"]
        finally:
            fork.kill()
        # A paused sandbox's rules change for its resume.
        assert s.pause()
        Sandbox.update_network(s.sandbox_id, {}, api_url=egress_server["url"], api_key=egress_server["key"])
        s = Sandbox.connect(s.sandbox_id, api_url=egress_server["url"], sandbox_url=egress_server["url"],
                            api_key=egress_server["key"])
        assert _reaches(s, out)
    finally:
        s.kill()
    assert _slots_of(egress_server["home"]) == [], "every address given back"


def test_the_async_client_sets_and_changes_the_rules(egress_server):
    out = _addr(OUT)
    opts = {"api_url": egress_server["url"], "sandbox_url": egress_server["url"], "api_key": egress_server["key"]}

    async def run():
        a = await AsyncSandbox.create(network={"deny_out": [ALL_TRAFFIC]}, **opts)
        try:
            probe = f"if nc -w 5 {out} 443 </dev/null; then echo yes; else echo no; fi"
            before = (await a.commands.run(probe)).stdout.strip()
            await a.update_network({})
            after = (await a.commands.run(probe)).stdout.strip()
            return before, after, (await a.get_info()).network
        finally:
            await a.kill()

    before, after, network = asyncio.run(run())
    assert (before, after) == ("no", "yes")
    assert network["deny_out"] == []


def test_bad_rules_are_refused_naming_them(egress_server, cairn_e2b):
    for network, says in [
        ({"deny_out": ["pypi.org"]}, "a name can only be allowed"),
        ({"deny_out": [ALL_TRAFFIC], "allow_out": ["10.1.0.1/16"]}, "host bits set"),
        ({"deny_out": ["1.2.3.4/33"]}, "does not parse"),
        ({"dns_servers": ["1.1.1.1"]}, "network.dnsServers is not supported"),
    ]:
        with pytest.raises((InvalidArgumentException, SandboxException), match=says):
            _create(egress_server, network=network)
    s = _create(egress_server)
    try:
        with pytest.raises((InvalidArgumentException, SandboxException), match="a name can only be allowed"):
            s.update_network({"deny_out": ["example.org"]})
        assert _reaches(s, _addr(OUT)), "a refused update changes nothing"
    finally:
        s.kill()
    # The default server gives no network: allows cannot be honoured, and
    # there is nothing to update.
    with pytest.raises((InvalidArgumentException, SandboxException), match="--e2b-network egress"):
        Sandbox.create(network={"deny_out": [ALL_TRAFFIC], "allow_out": [OUT]})
    plain = Sandbox.create()
    try:
        with pytest.raises(SandboxException, match="no network"):
            plain.update_network({"deny_out": [ALL_TRAFFIC]})
    finally:
        plain.kill()
