//! End-to-end: sandbox networking on the real host: veth pairs, nftables,
//! NAT to the host's route out, DNS through the host's resolver, PyPI as
//! the outside world (the one registry reachable from every machine this
//! runs on).
//!
//! Slots, interfaces and the `inet cairn` table are host-wide and other
//! tests run beside these, so each check names this test's own sandboxes:
//! their directories in the slot records, their addresses, their ports.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{skip, skipped, stderr, stdout, Home};

fn skip_without_nft(test: &str) -> bool {
    if skip(test) {
        return true;
    }
    if Command::new("nft").arg("--version").output().is_err() {
        skipped(&format!("{test}: nft is not installed; apt-get install nftables"));
        return true;
    }
    false
}

/// The network record of a sandbox, from `cairn ps --json`.
fn network_of(home: &Home, id: &str) -> serde_json::Value {
    home.ps()
        .into_iter()
        .find(|s| s["id"] == id)
        .unwrap_or_else(|| panic!("{id} is not listed"))["network"]
        .clone()
}

fn held(home: &Home, id: &str) -> (String, String, String) {
    let n = network_of(home, id);
    let h = &n["held"];
    (
        h["interface"].as_str().expect("an interface").to_string(),
        h["address"].as_str().expect("an address").to_string(),
        h["mac"].as_str().expect("a MAC").to_string(),
    )
}

/// Slot records naming a sandbox directory under `home`.
fn slots_of(home: &Home) -> Vec<String> {
    let prefix = home.path().to_string_lossy().into_owned();
    std::fs::read_dir("/run/cairn/net/slots")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter(|text| text.contains(&prefix))
        .collect()
}

fn ruleset() -> String {
    let out = Command::new("nft")
        .args(["list", "table", "inet", "cairn"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An address of this host on its route out (not loopback).
fn host_address() -> String {
    let out = Command::new("ip")
        .args(["-4", "-o", "route", "get", "1.1.1.1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut words = text.split_whitespace();
    words
        .by_ref()
        .find(|w| *w == "src")
        .and_then(|_| words.next())
        .unwrap_or_else(|| panic!("no source address in {text:?}"))
        .to_string()
}

/// A TCP port nothing on this host listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(addr: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}

#[test]
fn egress_resolves_and_connects_while_none_cannot() {
    if skip_without_nft("egress_resolves_and_connects_while_none_cannot") {
        return;
    }
    let home = Home::new();
    let out = home.ok(&[
        "run",
        "--network",
        "egress",
        "--",
        "sh",
        "-c",
        "nslookup pypi.org >/dev/null && echo resolved; nc -w 5 pypi.org 443 </dev/null && echo connected",
    ]);
    assert_eq!(out, "resolved\nconnected", "{out}");
    // Loopback only: no resolver, no route.
    let out = home.cairn(&[
        "run",
        "--",
        "sh",
        "-c",
        "nslookup pypi.org >/dev/null 2>&1 && echo resolved; nc -w 3 1.1.1.1 443 </dev/null && echo connected; \
         echo links: $(ip -o link | cut -d: -f2)",
    ]);
    assert_eq!(stdout(&out).trim(), "links: lo", "{}", stderr(&out));
}

#[test]
fn an_allow_list_admits_its_host_and_refuses_everything_else() {
    if skip_without_nft("an_allow_list_admits_its_host_and_refuses_everything_else") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--allow", "pypi.org:443"]);
    let pinned = network_of(&home, &id)["held"]["resolved"][0][1][0]
        .as_str()
        .expect("pypi.org pinned to an address")
        .to_string();
    // The name resolves (pinned in /etc/hosts) and its port connects.
    let hosts = home.sh(&id, "cat /etc/hosts");
    assert!(hosts.contains(&format!("{pinned}\tpypi.org")), "{hosts}");
    assert_eq!(
        home.sh(&id, "nc -w 5 pypi.org 443 </dev/null && echo connected"),
        "connected"
    );
    // Another port of the same host, another host, and DNS are refused.
    for (what, script) in [
        ("another port", format!("nc -w 3 {pinned} 80 </dev/null")),
        ("another host", "nc -w 3 1.1.1.1 443 </dev/null".to_string()),
        (
            "an unlisted name",
            "nc -w 3 files.pythonhosted.org 443 </dev/null".to_string(),
        ),
        ("DNS", "nslookup example.org".to_string()),
    ] {
        let out = home.cairn(&["exec", &id, "--", "sh", "-c", &script]);
        assert!(!out.status.success(), "{what} was reachable: {}", stdout(&out));
    }
    home.ok(&["rm", "-f", &id]);
    // A network allowed: any port on it.
    let id = home.ok(&["create", "--allow", &format!("{pinned}/32")]);
    assert_eq!(
        home.sh(&id, &format!("nc -w 5 {pinned} 443 </dev/null && echo connected")),
        "connected"
    );
}

#[test]
fn link_local_private_and_host_addresses_are_refused() {
    if skip_without_nft("link_local_private_and_host_addresses_are_refused") {
        return;
    }
    let home = Home::new();
    // Something on the host listens on every address: a sandbox must not
    // reach it, whichever address it tries.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let id = home.ok(&["create", "--network", "egress"]);
    let (_, address, _) = held(&home, &id);
    let gateway = network_of(&home, &id)["held"]["gateway"].as_str().unwrap().to_string();
    for target in [
        "169.254.169.254:80".to_string(),
        format!("{}:{port}", host_address()),
        format!("{gateway}:{port}"),
        format!("127.0.0.1:{port}"),
        "10.1.2.3:80".to_string(),
        "192.168.1.1:80".to_string(),
    ] {
        let (host, p) = target.split_once(':').unwrap();
        let out = home.cairn(&["exec", &id, "--", "nc", "-w", "3", host, p]);
        assert!(!out.status.success(), "{target} was reachable from {address}");
    }
    // The listener saw nothing.
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "a sandbox connected to the host");
    // The sandbox cannot change its own address or routes.
    let out = home.cairn(&[
        "exec",
        &id,
        "--",
        "ip",
        "addr",
        "add",
        "10.213.255.250/30",
        "dev",
        "eth0",
    ]);
    assert!(!out.status.success(), "the sandbox changed its address");
}

#[test]
fn a_published_port_answers_from_the_host() {
    if skip_without_nft("a_published_port_answers_from_the_host") {
        return;
    }
    let home = Home::new();
    let port = free_port();
    let id = home.ok(&[
        "create",
        "--publish",
        &format!("{port}:8000"),
        "--service",
        "mkdir -p /www && echo served-from-the-sandbox > /www/index.html && httpd -f -p 8000 -h /www",
    ]);
    let (_, address, _) = held(&home, &id);
    let mut answers = Vec::new();
    for addr in [
        format!("127.0.0.1:{port}"),
        format!("{}:{port}", host_address()),
        format!("{address}:8000"),
    ] {
        let body = (0..50)
            .find_map(|_| {
                http_get(&addr)
                    .ok()
                    .filter(|b| b.contains("served-from-the-sandbox"))
                    .or_else(|| {
                        std::thread::sleep(Duration::from_millis(100));
                        None
                    })
            })
            .unwrap_or_else(|| panic!("nothing answered at {addr}"));
        answers.push(body);
    }
    assert_eq!(answers.len(), 3);
    // The port is this sandbox's alone.
    let out = home.cairn(&["create", "--publish", &format!("{port}:8000")]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains(&port.to_string()), "{}", stderr(&out));
    // Removed, it answers no more and its element is gone.
    home.ok(&["rm", "-f", &id]);
    assert!(http_get(&format!("127.0.0.1:{port}")).is_err());
    assert!(!ruleset().contains(&format!("{port} : ")), "{}", ruleset());
}

/// SIGKILLs the init of sandbox `id`.
fn kill_init(home: &Home, id: &str) {
    let pid = home.ps().into_iter().find(|s| s["id"] == id).unwrap()["pid"]
        .as_i64()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Whether a host program could bind `addr` now (as a server would: std
/// sets SO_REUSEADDR).
fn bindable(addr: &str) -> bool {
    std::net::TcpListener::bind(addr).is_ok()
}

/// Waits up to 10 s for `addr` to become bindable.
fn bindable_soon(addr: &str) -> bool {
    (0..100).any(|_| {
        bindable(addr) || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    })
}

/// The attack on `main`: a host server bound a published port's loopback
/// address and its local clients reached the sandbox instead. Cairn now
/// holds every published port while it is published; `ADDR:HOST:PORT`
/// publishes on one address only; a port held by an IPv6 listener alone is
/// refused; killing the sandbox's init gives the ports back.
#[test]
fn published_ports_cannot_be_shadowed_and_can_be_bound_to_one_address() {
    if skip_without_nft("published_ports_cannot_be_shadowed_and_can_be_bound_to_one_address") {
        return;
    }
    let home = Home::new();
    let serve = "mkdir -p /www && echo served-from-the-sandbox > /www/index.html && httpd -f -p 8000 -h /www";
    let (every, one) = (free_port(), free_port());
    let id = home.ok(&[
        "create",
        "--publish",
        &format!("{every}:8000"),
        "--publish",
        &format!("127.0.0.1:{one}:8000"),
        "--service",
        serve,
    ]);
    let answers = |addr: &str| {
        (0..50).any(|_| {
            http_get(addr).is_ok_and(|b| b.contains("served-from-the-sandbox")) || {
                std::thread::sleep(Duration::from_millis(100));
                false
            }
        })
    };
    assert!(answers(&format!("127.0.0.1:{every}")));
    assert!(answers(&format!("127.0.0.1:{one}")));
    // Held on every family and address while published.
    for addr in [
        format!("127.0.0.1:{every}"),
        format!("0.0.0.0:{every}"),
        format!("[::1]:{every}"),
        format!("{}:{every}", host_address()),
        format!("127.0.0.1:{one}"),
    ] {
        assert!(!bindable(&addr), "a host program bound {addr} while it is published");
    }
    // One address only: the port stays free elsewhere, and is not
    // rewritten there.
    let elsewhere = format!("{}:{one}", host_address());
    let listener = std::net::TcpListener::bind(&elsewhere).expect("the port is free on other addresses");
    drop(listener);
    assert!(
        http_get(&elsewhere).is_err(),
        "the sandbox answered on an address it was not published on"
    );
    // A port an IPv6 listener alone holds is refused.
    let v6 = std::net::TcpListener::bind("[::]:0").unwrap();
    let taken = v6.local_addr().unwrap().port();
    let out = home.cairn(&["create", "--publish", &format!("{taken}:8000")]);
    assert!(!out.status.success(), "a port held over IPv6 was published");
    assert!(stderr(&out).contains("in use"), "{}", stderr(&out));
    drop(v6);
    // Bad forms are refused with the form in the error.
    for bad in ["[::1]:8080:80", "::1:8080:80", "0.0.0.0:8080:80", "no-address:8080:80"] {
        let out = home.cairn(&["create", "--publish", bad]);
        assert!(!out.status.success(), "--publish {bad} was accepted");
        assert!(stderr(&out).contains("--publish"), "{}", stderr(&out));
    }
    let out = home.cairn(&["create", "--publish", &format!("192.0.2.1:{}:80", free_port())]);
    assert!(stderr(&out).contains("not an address of this host"), "{}", stderr(&out));
    // Killed, the sandbox's init takes its holder with it.
    kill_init(&home, &id);
    assert!(
        bindable_soon(&format!("[::1]:{every}")),
        "the port was still held after init died"
    );
    home.ok(&["gc"]);
    home.cairn(&["rm", "-f", &id]);
    assert!(bindable(&format!("127.0.0.1:{every}")) && bindable(&format!("127.0.0.1:{one}")));
    assert!(!ruleset().contains(&format!("{one} : ")), "{}", ruleset());
}

#[test]
fn three_forks_of_one_sandbox_get_three_addresses_and_macs() {
    if skip_without_nft("three_forks_of_one_sandbox_get_three_addresses_and_macs") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--network", "egress"]);
    home.sh(&id, "echo parent > /tmp/who");
    let forks: Vec<String> = home.ok(&["fork", &id, "-n", "3"]).lines().map(str::to_string).collect();
    assert_eq!(forks.len(), 3);
    let mut seen = vec![held(&home, &id)];
    for f in &forks {
        let (ifname, address, mac) = held(&home, f);
        // What the sandbox itself sees is what was recorded.
        let inside = home.sh(
            f,
            "cat /sys/class/net/eth0/address; ip -4 -o addr show eth0; cat /tmp/who",
        );
        assert!(inside.starts_with(&mac), "{inside} vs {mac}");
        assert!(inside.contains(&format!("inet {address}/30")), "{inside}");
        assert!(inside.ends_with("parent"), "{inside}");
        assert_eq!(
            home.sh(f, "nc -w 5 pypi.org 443 </dev/null && echo connected"),
            "connected"
        );
        seen.push((ifname, address, mac));
    }
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[i + 1..] {
            assert!(
                a.0 != b.0 && a.1 != b.1 && a.2 != b.2,
                "{a:?} and {b:?} share an identity"
            );
        }
    }
    // A snapshot restored with no network asked for has none.
    let snap = home.ok(&["snapshot", &id]);
    let plain = home.ok(&["restore", &snap]);
    assert!(network_of(&home, &plain).is_null());
}

#[test]
fn nothing_is_left_after_rm_or_after_kill_9_and_gc() {
    if skip_without_nft("nothing_is_left_after_rm_or_after_kill_9_and_gc") {
        return;
    }
    let home = Home::new();
    let port = free_port();
    let a = home.ok(&["create", "--allow", "1.1.1.1:443", "--publish", &format!("{port}:80")]);
    let b = home.ok(&["create", "--network", "egress"]);
    let (a_if, a_addr, _) = held(&home, &a);
    let (b_if, b_addr, _) = held(&home, &b);
    assert_eq!(slots_of(&home).len(), 2);
    assert!(ruleset().contains(&format!("\"{a_if}\" . 1.1.1.1")), "{}", ruleset());
    assert!(Path::new("/sys/class/net").join(&a_if).exists());

    home.ok(&["rm", "-f", &a]);
    assert_eq!(slots_of(&home).len(), 1);
    let rules = ruleset();
    assert!(!rules.contains(&format!("{port} : {a_addr}")), "{rules}");
    assert!(!rules.contains(&format!("\"{a_if}\" . 1.1.1.1")), "{rules}");

    // Everything killed: the sandbox's init, and a command mid-start.
    kill_init(&home, &b);
    // Starts killed at spread instants: before the lease, holding it,
    // with init running, or (the latest) after they finished.
    for delay in [0, 2, 4, 7, 10, 14, 20, 30] {
        let mut starting = home.command(&["create", "--network", "egress"]).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(delay));
        let _ = starting.kill();
        let _ = starting.wait();
    }
    let gc: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    assert!(
        gc["sandboxes_removed"].as_array().unwrap().iter().any(|s| s == &b),
        "{gc}"
    );
    // A start the kill came too late for is a sandbox like any other.
    for s in home.ps() {
        assert_eq!(s["state"], "running", "gc left {s}");
        home.ok(&["rm", "-f", s["id"].as_str().unwrap()]);
    }
    assert!(slots_of(&home).is_empty(), "{:?}", slots_of(&home));
    let rules = ruleset();
    assert!(
        !rules.contains(&format!("\"{b_if}\" ")) || !slot_is_free(&b_if),
        "{rules}"
    );
    assert!(!rules.contains(&b_addr), "{rules}");
    assert!(home.ps().is_empty());
}

/// Whether no slot record holds `ifname` now (another test may have taken
/// the slot since).
fn slot_is_free(ifname: &str) -> bool {
    let slot = ifname.trim_start_matches("cn-");
    !Path::new("/run/cairn/net/slots").join(slot).exists()
}

#[test]
fn bad_network_requests_are_refused_with_what_to_do() {
    if skip_without_nft("bad_network_requests_are_refused_with_what_to_do") {
        return;
    }
    let home = Home::new();
    for (args, says) in [
        (vec!["--network", "bridge"], "none"),
        (vec!["--network", "none", "--allow", "pypi.org"], "--network egress"),
        (vec!["--allow", "10.0.0.1/8"], "host bits"),
        (vec!["--allow", "no_such.example"], "host name"),
        (vec!["--publish", "8080"], "HOSTPORT:PORT"),
        (vec!["--allow", "no-such-host.invalid"], "cannot resolve"),
    ] {
        let mut argv = vec!["create"];
        argv.extend(args.iter());
        let out = home.cairn(&argv);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    assert!(home.ps().is_empty(), "a refused create left a sandbox");
    assert!(slots_of(&home).is_empty());
}

#[test]
fn pip_downloads_a_package_from_pypi_with_egress() {
    if skip_without_nft("pip_downloads_a_package_from_pypi_with_egress") {
        return;
    }
    if Command::new("debootstrap").arg("--version").output().is_err() {
        skipped(
            "pip_downloads_a_package_from_pypi_with_egress: debootstrap is not installed; apt-get install debootstrap",
        );
        return;
    }
    let home = Home::new();
    let out = home.cairn(&[
        "image",
        "build",
        "debian",
        "--packages",
        "python3-pip",
        "--name",
        "deb-pip",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The host's CA bundle goes in on stdin: where egress passes a
    // TLS-inspecting proxy the host trusts, pip must trust it too.
    let pip = "cat > /tmp/ca.pem; pip download --cert /tmp/ca.pem --no-deps --no-cache-dir \
               --disable-pip-version-check -q -d /tmp/pkgs six==1.16.0 && ls /tmp/pkgs";
    let run = |net: &[&str], script: &str| {
        let mut argv = vec!["run", "-i", "--image", "deb-pip"];
        argv.extend(net);
        argv.extend(["--", "sh", "-c", script]);
        let ca = std::fs::File::open("/etc/ssl/certs/ca-certificates.crt").expect("the host's CA bundle");
        home.command(&argv).stdin(ca).output().unwrap()
    };
    let out = run(&["--network", "egress"], pip);
    assert!(stdout(&out).contains("six-1.16.0"), "{}{}", stdout(&out), stderr(&out));
    // Allowed only PyPI's index and files: the same works.
    let out = run(
        &["--allow", "pypi.org:443", "--allow", "files.pythonhosted.org:443"],
        pip,
    );
    assert!(stdout(&out).contains("six-1.16.0"), "{}{}", stdout(&out), stderr(&out));
    // Loopback only, it does not.
    let out = run(&[], &pip.replace("pip download", "timeout 60 pip download"));
    assert!(
        !out.status.success(),
        "pip reached PyPI with no network: {}",
        stdout(&out)
    );
}

#[test]
fn pipeline_stages_and_sessions_get_the_network_they_name() {
    if skip_without_nft("pipeline_stages_and_sessions_get_the_network_they_name") {
        return;
    }
    let home = Home::new();
    // The pipeline is loopback only; one stage asks for PyPI alone.
    let file = home.path().join("net.toml");
    std::fs::write(
        &file,
        r#"
[pipeline]
name = "net"
image = "busybox"

[[stage]]
name = "offline"
key = "offline-1"
run = ["mkdir -p /work", "nc -w 3 pypi.org 443 </dev/null && echo reached > /work/offline || echo refused > /work/offline"]

[[stage]]
name = "fetch"
after = "offline"
key = "fetch-1"
network = "egress"
allow = ["pypi.org:443"]
run = [
  "nc -w 5 pypi.org 443 </dev/null 2>/dev/null && echo reached > /work/fetch || echo refused > /work/fetch",
  "nc -w 3 1.1.1.1 443 </dev/null 2>/dev/null && echo reached >> /work/fetch || echo refused >> /work/fetch",
  "cat /work/offline /work/fetch",
]
"#,
    )
    .unwrap();
    let run = home.ok(&["pipeline", "run", file.to_str().unwrap()]);
    let log = home.ok(&["logs", &run, "fetch"]);
    assert_eq!(
        log.split_whitespace().collect::<Vec<_>>(),
        ["refused", "reached", "refused"],
        "{log}"
    );

    // A session's network survives a suspend and resume, with a new address.
    let id = home.ok(&["session", "create", "--network", "egress"]);
    let probe = [
        "session",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "nc -w 5 pypi.org 443 </dev/null && echo reached",
    ];
    assert_eq!(home.ok(&probe), "reached");
    home.ok(&["session", "suspend", &id]);
    assert!(slots_of(&home).is_empty(), "a suspended session holds an address");
    home.ok(&["session", "resume", &id]);
    assert_eq!(home.ok(&probe), "reached");
    let plain = home.ok(&["session", "create"]);
    let out = home.cairn(&["session", "exec", &plain, "--", "nc", "-w", "3", "1.1.1.1", "443"]);
    assert!(!out.status.success());
}
