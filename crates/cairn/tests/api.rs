//! End-to-end: `cairn serve` and its HTTP API, driven over TCP with a
//! bearer token and over the Unix socket, against real sandboxes.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{skip, Home};
use serde_json::{json, Value};

/// A running `cairn serve` on a home, with a token.
struct Server {
    child: Child,
    base: String,
    token: String,
}

impl Server {
    fn start(home: &Home, extra: &[&str]) -> Server {
        let token = home.ok(&["token", "create", "tests"]);
        Server::start_with(home, extra, token)
    }

    fn start_with(home: &Home, extra: &[&str], token: String) -> Server {
        Server::start_env(home, extra, token, &[])
    }

    /// [`Server::start_with`], with variables set in the server's environment.
    fn start_env(home: &Home, extra: &[&str], token: String, env: &[(&str, &str)]) -> Server {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut child = home
            .command(&args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let base = loop {
            let line = lines.next().expect("the server prints where it listens").unwrap();
            if let Some(rest) = line.strip_prefix("cairn: serving on http://") {
                break format!("http://{}", rest.split_whitespace().next().unwrap());
            }
        };
        // Keep draining the log so the server never blocks on it.
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Server { child, base, token }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn req(&self, method: &str, path: &str) -> ureq::Request {
        ureq::request(method, &self.url(path)).set("Authorization", &format!("Bearer {}", self.token))
    }

    /// Sends JSON; answers (status, body) whatever the status.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let r = self.req(method, path);
        let resp = match body {
            Some(b) => r.send_json(b),
            None => r.call(),
        };
        answer(resp)
    }

    /// [`Server::call`] with another token.
    fn call_as(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let r = ureq::request(method, &self.url(path)).set("Authorization", &format!("Bearer {token}"));
        answer(match body {
            Some(b) => r.send_json(b),
            None => r.call(),
        })
    }

    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn sigterm(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
    }

    fn stop(mut self) -> std::process::ExitStatus {
        self.sigterm();
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn answer(resp: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("transport error: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn create(s: &Server) -> String {
    let (status, v) = s.call("POST", "/v1/sandboxes", Some(json!({})));
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn exec(s: &Server, id: &str, script: &str) -> Value {
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({ "argv": ["sh", "-c", script] })),
    );
    assert_eq!(status, 200, "{v}");
    v
}

#[test]
fn sandboxes_exec_files_snapshots_and_forks_work_through_the_api() {
    if skip("sandboxes_exec_files_snapshots_and_forks_work_through_the_api") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let id = create(&s);
    let v = exec(&s, &id, "echo out; echo err >&2; exit 3");
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str(), v["stderr"].as_str()),
        (Some(3), Some("out\n"), Some("err\n"))
    );
    // stdin and timeout.
    let (_, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({ "argv": ["cat"], "stdin": "fed in" })),
    );
    assert_eq!(v["stdout"], "fed in");
    let (_, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({ "argv": ["sleep", "30"], "timeout_secs": 0.3 })),
    );
    assert_eq!(
        (v["timed_out"].as_bool(), v["exit_code"].as_i64()),
        (Some(true), Some(124)),
        "{v}"
    );
    // A file of 3 MiB goes in and comes out byte for byte, mode kept.
    let data: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let resp = s
        .req("PUT", &format!("/v1/sandboxes/{id}/files?path=/tmp/blob&mode=750"))
        .send_bytes(&data);
    let (status, v) = answer(resp);
    assert_eq!(
        (status, v["size"].as_u64(), v["mode"].as_u64()),
        (201, Some(3 << 20), Some(0o750)),
        "{v}"
    );
    let resp = s
        .req("GET", &format!("/v1/sandboxes/{id}/files?path=/tmp/blob"))
        .call()
        .unwrap();
    assert_eq!(resp.header("x-cairn-mode"), Some("750"));
    let mut back = Vec::new();
    resp.into_reader().read_to_end(&mut back).unwrap();
    assert!(back == data, "the download differs from the upload");
    // Directories: make, list, move, remove.
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/files/mkdir"),
        Some(json!({ "path": "/tmp/d/e", "parents": true })),
    );
    assert_eq!((status, v["created"].as_bool()), (200, Some(true)), "{v}");
    exec(&s, &id, "echo x > /tmp/d/e/f && ln -s /etc /tmp/d/link");
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/files/move"),
        Some(json!({ "from": "/tmp/d/e/f", "to": "/tmp/d/g" })),
    );
    assert_eq!(status, 200, "{v}");
    let (_, v) = s.call("GET", &format!("/v1/sandboxes/{id}/files/list?path=/tmp/d"), None);
    let names: Vec<(&str, &str)> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["path"].as_str().unwrap(), e["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(
        names,
        [("/tmp/d/e", "dir"), ("/tmp/d/g", "file"), ("/tmp/d/link", "symlink")],
        "{v}"
    );
    let (status, _) = s.call(
        "DELETE",
        &format!("/v1/sandboxes/{id}/files?path=/tmp/d&recursive=true"),
        None,
    );
    assert_eq!(status, 204);
    assert_eq!(
        exec(&s, &id, "ls /etc/passwd && ls /tmp/d || echo gone")["stdout"],
        "/etc/passwd\ngone\n"
    );
    // Snapshot, then fork three; each sees the snapshot and diverges alone.
    exec(&s, &id, "echo base > /tmp/mark");
    let (status, snap) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({ "label": "base" })),
    );
    assert_eq!(status, 201, "{snap}");
    let snap_id = snap["id"].as_str().unwrap();
    let (status, forks) = s.call(
        "POST",
        &format!("/v1/snapshots/{snap_id}/fork"),
        Some(json!({ "count": 3 })),
    );
    assert_eq!(status, 201, "{forks}");
    let forks: Vec<String> = forks["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(forks.len(), 3);
    for (i, f) in forks.iter().enumerate() {
        exec(&s, f, &format!("echo {i} >> /tmp/mark"));
    }
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(exec(&s, f, "cat /tmp/mark")["stdout"], format!("base\n{i}\n"));
    }
    assert_eq!(exec(&s, &id, "cat /tmp/mark")["stdout"], "base\n");
    // Reset rewinds a fork; the snapshot's lineage names its parent.
    let (status, _) = s.call(
        "POST",
        &format!("/v1/sandboxes/{}/reset", forks[0]),
        Some(json!({ "snapshot": snap_id })),
    );
    assert_eq!(status, 200);
    assert_eq!(exec(&s, &forks[0], "cat /tmp/mark")["stdout"], "base\n");
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{}/snapshots", forks[1]),
        Some(json!({})),
    );
    assert_eq!(status, 201);
    let (_, detail) = s.call("GET", &format!("/v1/snapshots/{}", v["id"].as_str().unwrap()), None);
    assert_eq!(detail["lineage"][0]["id"], snap_id, "{detail}");
    // Listing pages through everything once.
    let (_, page1) = s.call("GET", "/v1/sandboxes?limit=2", None);
    let after = page1["next"].as_str().unwrap();
    let (_, page2) = s.call("GET", &format!("/v1/sandboxes?limit=10&after={after}"), None);
    assert_eq!(
        page1["items"].as_array().unwrap().len() + page2["items"].as_array().unwrap().len(),
        4
    );
    assert!(page2["next"].is_null());
    for f in forks.iter().chain([&id]) {
        let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{f}?force=true"), None);
        assert_eq!(status, 204);
    }
    assert!(home.ps().is_empty());
    // Metrics saw the operations.
    let (status, text) = s.call("GET", "/metrics", None);
    let text = text.as_str().unwrap().to_string();
    assert_eq!(status, 200);
    assert!(text.contains("cairn_operation_seconds_count{op=\"fork\"} 1"), "{text}");
    assert!(text.contains("cairn_sandboxes{state=\"running\"} 0"), "{text}");
    assert_eq!(s.stop().code(), Some(0));
}

#[test]
fn a_streamed_exec_delivers_output_as_it_happens_and_a_client_that_leaves_kills_or_keeps_it() {
    if skip("a_streamed_exec_delivers_output_as_it_happens_and_a_client_that_leaves_kills_or_keeps_it") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let id = create(&s);
    let resp = s
        .req("POST", &format!("/v1/sandboxes/{id}/exec/stream"))
        .send_json(json!({ "argv": ["sh", "-c", "echo one; sleep 1; echo two >&2; sleep 1; echo three; exit 7"] }))
        .unwrap();
    let t = Instant::now();
    let mut seen = Vec::new();
    let mut event = String::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).unwrap();
            seen.push((event.clone(), v, t.elapsed()));
        }
    }
    let kinds: Vec<&str> = seen.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(kinds, ["started", "stdout", "stderr", "stdout", "exit"], "{seen:?}");
    assert_eq!(seen[1].1["data"], "b25lCg==");
    assert_eq!(seen[4].1["exit_code"], 7);
    // The first line came a second before the exit: streamed, not collected.
    assert!(seen[4].2 - seen[1].2 > Duration::from_millis(1500), "{seen:?}");
    // A client that goes away: the process is killed by default, kept on request.
    for (policy, marker) in [("kill", "/tmp/killed"), ("keep", "/tmp/kept")] {
        let script = format!("sleep 2; touch {marker}");
        let mut conn = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
        let body = json!({ "argv": ["sh", "-c", script], "on_disconnect": policy }).to_string();
        write!(
            conn,
            "POST /v1/sandboxes/{id}/exec/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            s.token,
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 256];
        let n = conn.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        std::thread::sleep(Duration::from_millis(300));
        drop(conn);
    }
    std::thread::sleep(Duration::from_secs(3));
    let v = exec(&s, &id, "ls /tmp/killed /tmp/kept 2>/dev/null; true");
    assert_eq!(
        v["stdout"], "/tmp/kept\n",
        "kill removes the process, keep lets it finish"
    );
}

#[test]
fn bad_requests_get_one_error_shape_and_change_nothing() {
    if skip("bad_requests_get_one_error_shape_and_change_nothing") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &["--max-upload", "1M"]);
    let id = create(&s);
    let code = |v: &Value| v["error"]["code"].as_str().unwrap_or_default().to_string();
    let message = |v: &Value| v["error"]["message"].as_str().unwrap_or_default().to_string();
    // No token, a wrong one, a revoked one: 401, nothing done.
    for auth in [None, Some("Bearer cairn_0000"), Some("Basic eDp5")] {
        let mut r = ureq::post(&s.url("/v1/sandboxes"));
        if let Some(a) = auth {
            r = r.set("Authorization", a);
        }
        let (status, v) = answer(r.send_json(json!({})));
        assert_eq!((status, code(&v)), (401, "unauthorized".into()), "{v}");
    }
    let other = home.ok(&["token", "create", "other"]);
    home.ok(&["token", "rm", "other"]);
    let (status, _) = answer(
        ureq::post(&s.url("/v1/sandboxes"))
            .set("Authorization", &format!("Bearer {other}"))
            .send_json(json!({})),
    );
    assert_eq!(status, 401, "a revoked token is refused at once");
    assert_eq!(home.ps().len(), 1);
    // Unknown ids name the id.
    for path in [
        "/v1/sandboxes/nosuchbox",
        "/v1/snapshots/nosuchsnap",
        "/v1/runs/nosuchrun",
        "/v1/dlq/nosuchdl",
    ] {
        let (status, v) = s.call("GET", path, None);
        assert_eq!(status, 404, "{path}: {v}");
        assert!(message(&v).contains(path.rsplit('/').next().unwrap()), "{v}");
    }
    // Malformed JSON, unknown fields, wrong types: 400 naming the field.
    let (status, v) = answer(
        s.req("POST", "/v1/sandboxes")
            .set("Content-Type", "application/json")
            .send_string("{\"image\": "),
    );
    assert_eq!((status, code(&v)), (400, "bad_request".into()), "{v}");
    let (status, v) = s.call("POST", "/v1/sandboxes", Some(json!({ "imgae": "busybox" })));
    assert!(status == 400 && message(&v).contains("imgae"), "{v}");
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({ "argv": "ls" })),
    );
    assert!(status == 400 && message(&v).contains("invalid type"), "{v}");
    let (status, v) = s.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({ "argv": [] })));
    assert!(status == 400 && message(&v).contains("argv"), "{v}");
    let (status, v) = s.call("POST", "/v1/sandboxes", Some(json!({ "limits": { "memory": "lots" } })));
    assert!(status == 400 && message(&v).contains("limits.memory"), "{v}");
    let (status, v) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "limits": { "pids": 2147483648u64 } })),
    );
    assert!(status == 400 && message(&v).contains("limits.pids"), "{v}");
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{id}/files?path=relative"), None);
    assert!(status == 400 && message(&v).contains("absolute"), "{v}");
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{id}/files?path=/nonexistent"), None);
    assert_eq!(status, 404, "{v}");
    // What a process in the sandbox planted is refused by name, before any
    // byte: a FIFO, links on the way (to init's /proc among them), init's
    // own /proc entries.
    exec(
        &s,
        &id,
        "mkfifo /tmp/fifo && ln -s /proc/1 /tmp/p1 && mkdir /tmp/real && ln -s /tmp/real /tmp/link",
    );
    for (route, path, want, saying) in [
        (
            "files",
            "/tmp/fifo",
            400,
            "/tmp/fifo is a FIFO; only regular files can be downloaded",
        ),
        ("files", "/tmp/p1/maps", 400, "/tmp/p1 is a symbolic link"),
        (
            "files",
            "/proc/1/maps",
            403,
            "/proc/1 is the /proc entry of the sandbox's init",
        ),
        ("files/list", "/proc/self/fd", 400, "/proc/self is a symbolic link"),
        (
            "files/list",
            "/proc/1/fd",
            403,
            "/proc/1 is the /proc entry of the sandbox's init",
        ),
        (
            "files/stat",
            "/proc/1",
            403,
            "/proc/1 is the /proc entry of the sandbox's init",
        ),
    ] {
        let (status, v) = s.call("GET", &format!("/v1/sandboxes/{id}/{route}?path={path}"), None);
        assert!(
            status == want && message(&v).contains(saying),
            "{route} {path}: {status} {v}"
        );
    }
    let (status, v) = answer(
        s.req("PUT", &format!("/v1/sandboxes/{id}/files?path=/tmp/link/x"))
            .send_bytes(b"x"),
    );
    assert!(
        status == 400 && message(&v).contains("/tmp/link is a symbolic link"),
        "{v}"
    );
    let listed = exec(&s, &id, "ls -A /tmp/real");
    assert_eq!(listed["stdout"], "", "an upload wrote through a link");
    let (status, v) = s.call("GET", "/v1/nowhere", None);
    assert_eq!((status, code(&v)), (404, "not_found".into()));
    // An upload above the cap: 413, and no file appears.
    let (status, v) = answer(
        s.req("PUT", &format!("/v1/sandboxes/{id}/files?path=/tmp/big"))
            .send_bytes(&vec![7u8; (1 << 20) + 1]),
    );
    assert_eq!((status, code(&v)), (413, "too_large".into()), "{v}");
    let listed = exec(&s, &id, "ls /tmp/big 2>&1; true");
    assert!(listed["stdout"].as_str().unwrap().contains("No such file"), "{listed}");
    assert_eq!(
        std::fs::read_dir(home.path().join("tmp"))
            .map(|d| d.count())
            .unwrap_or(0),
        0,
        "no spool left"
    );
    // Still exactly one sandbox, and nothing half-made.
    assert_eq!(home.ps().len(), 1);
}

#[test]
fn conflicting_operations_on_one_sandbox_get_409_and_idempotency_keys_make_one_sandbox() {
    if skip("conflicting_operations_on_one_sandbox_get_409_and_idempotency_keys_make_one_sandbox") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let id = create(&s);
    // A snapshot of 300 MiB of new files takes long enough for a second
    // operation to arrive while it runs.
    exec(&s, &id, "dd if=/dev/urandom of=/tmp/big bs=1M count=300 2>/dev/null");
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            s.call("POST", &format!("/v1/sandboxes/{id}/snapshots"), Some(json!({})))
                .0
        });
        std::thread::sleep(Duration::from_millis(150));
        let second = s
            .call(
                "POST",
                &format!("/v1/sandboxes/{id}/reset"),
                Some(json!({ "snapshot": "x" })),
            )
            .0;
        vec![first.join().unwrap(), second]
    });
    assert_eq!(statuses, [201, 409]);
    // The same key twice: one sandbox, the same answer; another body: 422.
    let post = |key: &str, body: Value| {
        answer(
            s.req("POST", "/v1/sandboxes")
                .set("Idempotency-Key", key)
                .send_json(body),
        )
    };
    let (a, va) = post("k-1", json!({ "name": "once" }));
    let (b, vb) = post("k-1", json!({ "name": "once" }));
    assert_eq!((a, b), (201, 201));
    assert_eq!(va["id"], vb["id"]);
    let (c, vc) = post("k-1", json!({ "name": "twice" }));
    assert_eq!(c, 422, "{vc}");
    assert_eq!(home.ps().len(), 2);
    // A key names one request to one route and one source: forks of two
    // sandboxes with the same key are two forks.
    let other = vb["id"].as_str().unwrap();
    let fork = |of: &str| {
        answer(
            s.req("POST", &format!("/v1/sandboxes/{of}/fork"))
                .set("Idempotency-Key", "fork-1")
                .send_json(json!({})),
        )
    };
    let (fa, va) = fork(&id);
    let (fb, vb) = fork(other);
    assert_eq!((fa, fb), (201, 201));
    assert_eq!(va["snapshot"]["sandbox_id"], id.as_str());
    assert_eq!(vb["snapshot"]["sandbox_id"], other, "{vb}");
    assert_eq!(home.ps().len(), 4);
}

#[test]
fn a_server_killed_9_loses_nothing_and_the_next_one_finishes_its_run() {
    if skip("a_server_killed_9_loses_nothing_and_the_next_one_finishes_its_run") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let token = s.token.clone();
    let id = create(&s);
    exec(&s, &id, "echo kept > /tmp/kept");
    let pipeline = r#"
[pipeline]
name = "slow"
image = "busybox"

[[stage]]
name = "one"
key = "slow-one-{params.n}"
run = ["sleep 3 && echo one > /work.txt"]

[[stage]]
name = "two"
after = "one"
key = "slow-two-{params.n}"
run = ["cat /work.txt && echo two >> /work.txt"]
artifacts = ["/work.txt"]

[params]
n = "0"
"#;
    let n = format!("{}", std::process::id());
    let (status, run) = answer(
        s.req("POST", "/v1/runs")
            .set("Idempotency-Key", "run-1")
            .send_json(json!({ "pipeline": pipeline, "params": { "n": n } })),
    );
    assert_eq!(status, 202, "{run}");
    let run_id = run["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(1000));
    s.kill9();
    // The sandbox and the stage's command outlived the server.
    let ps = home.ps();
    assert!(
        ps.iter().any(|p| p["id"] == id.as_str() && p["state"] == "running"),
        "{ps:?}"
    );
    let s = Server::start_with(&home, &[], token);
    let (_, v) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(v["state"], "running");
    assert_eq!(exec(&s, &id, "cat /tmp/kept")["stdout"], "kept\n");
    // The retried start answers the same run; the new server resumed it.
    let (status, again) = answer(
        s.req("POST", "/v1/runs")
            .set("Idempotency-Key", "run-1")
            .send_json(json!({ "pipeline": pipeline, "params": { "n": n } })),
    );
    assert_eq!((status, again["id"].as_str()), (202, Some(run_id.as_str())));
    let deadline = Instant::now() + Duration::from_secs(120);
    let detail = loop {
        let (_, d) = s.call("GET", &format!("/v1/runs/{run_id}"), None);
        if d["run"]["status"] != "running" || Instant::now() > deadline {
            break d;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(detail["run"]["status"], "completed", "{detail}");
    let kinds: Vec<&str> = detail["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"reattached"),
        "the first stage went on in its sandbox: {kinds:?}"
    );
    // Events carry their typed fields through the API too.
    let completed: Vec<&Value> = detail["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"]["type"] == "stage-completed")
        .collect();
    assert!(!completed.is_empty(), "{detail}");
    assert!(completed
        .iter()
        .all(|e| e["data"]["output_snapshot"] == e["snapshot_id"] && e["data"]["compute_ms"].is_u64()));
    let artifact = detail["artifacts"][0]["id"].as_str().unwrap();
    let resp = s.req("GET", &format!("/v1/artifacts/{artifact}")).call().unwrap();
    assert_eq!(resp.into_string().unwrap(), "one\ntwo\n");
    let (status, log) = s.call("GET", &format!("/v1/runs/{run_id}/logs/two"), None);
    assert_eq!((status, log.as_str()), (200, Some("one\n")));
    // A tail: the last bytes from the first whole line; bounds checked.
    let (status, log) = s.call("GET", &format!("/v1/runs/{run_id}/logs/two?tail_bytes=100"), None);
    assert_eq!((status, log.as_str()), (200, Some("one\n")));
    for bad in ["0", "16777217", "-1", "x"] {
        let (status, _) = s.call("GET", &format!("/v1/runs/{run_id}/logs/two?tail_bytes={bad}"), None);
        assert_eq!(status, 400, "tail_bytes={bad}");
    }
    // The list counts each run's stages by status.
    let (_, listed) = s.call("GET", "/v1/runs", None);
    let mine = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == run_id.as_str())
        .unwrap();
    assert_eq!(mine["stage_counts"]["completed"], 2, "{mine}");
    // The audit of the run: each stage's costs from its typed events.
    let (status, audit) = s.call("GET", &format!("/v1/runs/{run_id}/audit"), None);
    assert_eq!(status, 200, "{audit}");
    let stages = audit["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{audit}");
    assert!(
        stages
            .iter()
            .all(|s| s["compute_ms"].is_u64() && s["restore_ms"].is_u64()),
        "{audit}"
    );
    let (status, _) = s.call("GET", "/v1/runs/nosuchrun/audit", None);
    assert_eq!(status, 404);
    // The lineage page is served from the binary, with a strict policy.
    let resp = s.req("GET", "/ui/").call().unwrap();
    assert!(resp
        .header("content-security-policy")
        .unwrap()
        .contains("default-src 'none'"));
    assert!(resp.into_string().unwrap().contains("/ui/app.js"));
}

#[test]
fn the_unix_socket_is_the_owners_alone_and_needs_no_token() {
    if skip("the_unix_socket_is_the_owners_alone_and_needs_no_token") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let socket = home.path().join("cairn.sock");
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut conn = UnixStream::connect(&socket).unwrap();
    conn.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"items\":[]"), "{text}");
    // A second server on the same socket is refused; the first keeps serving.
    let out = home.cairn(&["serve"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another `cairn serve`"),
        "{out:?}"
    );
    assert!(UnixStream::connect(&socket).is_ok());
    assert_eq!(s.stop().code(), Some(0));
    assert!(!socket.exists(), "a stopped server removes its socket");
}

#[test]
fn a_loopback_listener_answers_only_to_loopback_names_and_allowed_hosts() {
    if skip("a_loopback_listener_answers_only_to_loopback_names_and_allowed_hosts") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &["--allowed-host", "cairn.internal"]);
    // What a page at evil.example.com sends once its name points here
    // (DNS rebinding): its own name in Host and Origin.
    let ask = |headers: &str| -> String {
        let mut conn = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
        write!(
            conn,
            "GET /v1/sandboxes HTTP/1.1\r\n{headers}Authorization: Bearer {}\r\nConnection: close\r\n\r\n",
            s.token
        )
        .unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).unwrap();
        text
    };
    for refused in [
        "Host: evil.example.com\r\n",
        "Host: evil.example.com:80\r\nOrigin: http://evil.example.com\r\n",
        "Host: 127.0.0.1\r\nOrigin: http://evil.example.com\r\n",
        "Host: localhost.evil.example.com\r\n",
        "Host: 127.0.0.1\r\nOrigin: null\r\n",
    ] {
        let text = ask(refused);
        assert!(text.starts_with("HTTP/1.1 403"), "{refused:?}: {text}");
        assert!(
            text.contains("DNS rebinding") && text.contains("--allowed-host"),
            "{text}"
        );
    }
    for accepted in [
        "Host: localhost\r\n",
        "Host: 127.0.0.1:7070\r\nOrigin: http://127.0.0.1:7070\r\n",
        "Host: [::1]\r\n",
        "Host: cairn.internal\r\nOrigin: https://cairn.internal\r\n",
    ] {
        let text = ask(accepted);
        assert!(text.starts_with("HTTP/1.1 200"), "{accepted:?}: {text}");
    }
    // The check comes before the token's: a page learns nothing more.
    let mut conn = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
    conn.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: evil.example.com\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 403"), "{text}");
    // The Unix socket is not reached by pages: any name passes there.
    let mut conn = UnixStream::connect(home.path().join("cairn.sock")).unwrap();
    conn.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[test]
fn the_checked_in_openapi_document_matches_the_code() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--openapi"])
        .output()
        .unwrap();
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let checked_in = std::fs::read_to_string(path).unwrap();
    assert!(
        generated == checked_in,
        "docs/openapi.json is out of date: run `cargo run -p cairn -- serve --openapi > docs/openapi.json`"
    );
    let doc: Value = serde_json::from_str(&generated).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    for path in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}/exec/stream",
        "/v1/snapshots/{id}/fork",
        "/v1/runs",
        "/v1/dlq/{id}/retry",
        "/v1/sessions/{id}/exec/stream",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} is documented");
    }
}

#[test]
fn stopping_the_server_finishes_requests_in_flight_and_ends_open_streams() {
    if skip("stopping_the_server_finishes_requests_in_flight_and_ends_open_streams") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let events = s.req("GET", "/v1/events").call().unwrap();
    let watcher = std::thread::spawn(move || {
        BufReader::new(events.into_reader())
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("event: ").map(str::to_string))
            .collect::<Vec<_>>()
    });
    let id = create(&s);
    let (status, v) = std::thread::scope(|scope| {
        let in_flight = scope.spawn(|| {
            s.call(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({ "argv": ["sh", "-c", "sleep 1; echo done"] })),
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        s.sigterm();
        in_flight.join().unwrap()
    });
    assert_eq!((status, v["stdout"].as_str()), (200, Some("done\n")), "{v}");
    assert_eq!(s.stop().code(), Some(0));
    // The events stream saw the sandbox made, and ended with the server.
    assert_eq!(watcher.join().unwrap(), ["sandbox.created"]);
    // The sandbox outlives the server.
    assert!(home
        .ps()
        .iter()
        .any(|p| p["id"] == id.as_str() && p["state"] == "running"));
}

/// Polls a run until it is no longer running.
fn settled(s: &Server, run: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, d) = s.call("GET", &format!("/v1/runs/{run}"), None);
        if (d["run"]["status"] != "running" && d["run"]["orchestrated"] == false) || Instant::now() > deadline {
            return d;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_dead_letter_is_retried_and_an_image_is_built_through_the_api() {
    if skip("a_dead_letter_is_retried_and_an_image_is_built_through_the_api") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let pipeline = r#"
[pipeline]
name = "flaky"
image = "busybox"

[[stage]]
name = "flaky"
key = "flaky-{params.tag}"
retries = 1
run = ["echo attempt $CAIRN_ATTEMPT; [ $CAIRN_ATTEMPT -ge 3 ]"]

[params]
tag = "a"
"#;
    let tag = format!("t{}", std::process::id());
    let (status, run) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({ "pipeline": pipeline, "params": { "tag": tag } })),
    );
    assert_eq!(status, 202, "{run}");
    let run = run["id"].as_str().unwrap().to_string();
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "failed", "{d}");
    let (_, dlq) = s.call("GET", "/v1/dlq", None);
    let dl = dlq[0]["id"].as_str().unwrap().to_string();
    assert_eq!(dlq[0]["run_id"], run.as_str());
    let (status, _) = s.call("POST", &format!("/v1/dlq/{dl}/retry"), None);
    assert_eq!(status, 202);
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "completed", "{d}");
    let (status, v) = s.call("POST", &format!("/v1/dlq/{dl}/retry"), None);
    assert_eq!(status, 409, "a dead letter is retried once: {v}");
    let (_, log) = s.call("GET", &format!("/v1/runs/{run}/logs/flaky"), None);
    assert!(log.as_str().unwrap().contains("attempt 3"), "{log}");
    // A bad pipeline is refused with its line, and starts nothing.
    let (status, v) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({ "pipeline": "[pipeline]\nname = 3\n" })),
    );
    assert_eq!(status, 400, "{v}");
    let (_, runs) = s.call("GET", "/v1/runs", None);
    assert_eq!(runs["items"].as_array().unwrap().len(), 1);
    // An image build streams its steps, then the image.
    let resp = s
        .req("POST", "/v1/images")
        .send_json(json!({ "name": "tiny", "kind": "busybox" }))
        .unwrap();
    let events: Vec<String> = BufReader::new(resp.into_reader())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("event: ").map(str::to_string))
        .collect();
    assert!(
        events.len() >= 2 && events.iter().rev().skip(1).all(|e| e == "step"),
        "{events:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("image"), "{events:?}");
    let (_, images) = s.call("GET", "/v1/images", None);
    assert!(
        images.as_array().unwrap().iter().any(|i| i["name"] == "tiny"),
        "{images}"
    );
    let (status, _) = s.call("DELETE", "/v1/images/tiny", None);
    assert_eq!(status, 204);
}

#[test]
fn a_stage_waiting_for_approval_is_approved_or_refused_through_the_api() {
    if skip("a_stage_waiting_for_approval_is_approved_or_refused_through_the_api") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let pipeline = r#"
[pipeline]
name = "gated"
image = "busybox"

[params]
tag = "a"

[[stage]]
name = "build"
key = "api-build-{params.tag}"
run = ["echo built > /out"]

[[stage]]
name = "ship"
after = "build"
key = "api-ship-{params.tag}"
approve = true
run = ["cat /out"]
"#;
    let tag = format!("t{}", std::process::id());
    let (status, run) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({ "pipeline": pipeline, "params": { "tag": tag } })),
    );
    assert_eq!(status, 202, "{run}");
    let run = run["id"].as_str().unwrap().to_string();
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "awaiting_approval", "{d}");
    assert_eq!(
        d["decisions"],
        json!([]),
        "a run without decide stages has no decisions"
    );
    let path = |stage: &str, verb: &str| format!("/v1/runs/{run}/stages/{stage}/{verb}");
    let (status, v) = s.call("POST", &path("nope", "approve"), None);
    assert_eq!(status, 404, "{v}");
    let (status, v) = s.call("POST", &path("build", "approve"), None);
    assert_eq!(status, 409, "{v}");
    let (status, v) = s.call("POST", &path("ship", "reject"), Some(json!({})));
    assert_eq!(status, 400, "a rejection needs a reason: {v}");
    let (status, v) = s.call("POST", &path("ship", "approve"), Some(json!({ "by": "a\nb" })));
    assert_eq!(status, 400, "{v}");
    let (status, v) = s.call("POST", &path("ship", "approve"), Some(json!({ "colour": "red" })));
    assert_eq!(status, 400, "{v}");
    let (status, v) = s.call(
        "POST",
        &path("ship", "approve"),
        Some(json!({ "by": "dana", "reason": "release window" })),
    );
    assert_eq!(status, 202, "{v}");
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "completed", "{d}");
    let approved: Vec<&Value> = d["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "approved")
        .collect();
    assert_eq!(approved.len(), 1);
    assert_eq!(approved[0]["detail"], "approved by dana: release window");
    let (status, v) = s.call("POST", &path("ship", "approve"), None);
    assert_eq!(status, 409, "approving twice is refused: {v}");
    let (_, log) = s.call("GET", &format!("/v1/runs/{run}/logs/ship"), None);
    assert_eq!(log.as_str(), Some("built\n"));
}

#[test]
fn a_run_the_server_executes_asks_its_decide_stage_and_lists_the_decision() {
    if skip("a_run_the_server_executes_asks_its_decide_stage_and_lists_the_decision") {
        return;
    }
    let home = Home::new();
    let model = cairn_testkit::model_server::ScriptedModel::start(json!({"turns": [{"tool_calls": [
        {"name": "decide", "arguments": {"reason": "the low one", "params": {"level": "2"}}}
    ]}]}));
    let token = home.ok(&["token", "create", "tests"]);
    let s = Server::start_env(&home, &[], token, &[("ANTHROPIC_API_KEY", "sk-ant-test")]);
    let pipeline = format!(
        r#"
[pipeline]
name = "decided"
image = "busybox"
model = {{ provider = "anthropic", model = "claude-test", base_url = "{}" }}

[params]
level = "9"
tag = "t"

[[stage]]
name = "probe"
key = "api-probe-{{params.tag}}"
run = ["echo probed"]

[[stage]]
name = "choose"
after = "probe"
key = "api-choose-{{params.tag}}"
decide = {{ prompt = "Pick a level.", choose = ["params"] }}

[[stage]]
name = "use"
after = "choose"
key = "api-use-{{params.tag}}-{{params.level}}"
run = ["echo level {{params.level}}"]
"#,
        model.url()
    );
    let tag = format!("t{}", std::process::id());
    let (status, run) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({ "pipeline": pipeline, "params": { "tag": tag } })),
    );
    assert_eq!(status, 202, "{run}");
    let run = run["id"].as_str().unwrap().to_string();
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "completed", "{d}");
    let decisions = d["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 1, "{d}");
    assert_eq!(decisions[0]["model"], "anthropic/claude-test");
    assert_eq!(decisions[0]["answer"]["params"], json!({"level": "2"}));
    let (_, log) = s.call("GET", &format!("/v1/runs/{run}/logs/use"), None);
    assert_eq!(log.as_str(), Some("level 2\n"));
    // Without a usable model a run is refused, and nothing is recorded.
    let (status, v) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({ "pipeline": pipeline.replace("provider = \"anthropic\", ", "") })),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("needs a model"), "{v}");
    let (_, runs) = s.call("GET", "/v1/runs", None);
    assert_eq!(runs["items"].as_array().unwrap().len(), 1);
    assert_eq!(model.requests().len(), 1);
}

#[test]
fn a_run_started_with_queue_waits_for_a_worker_and_the_server_leaves_it_alone() {
    if skip("a_run_started_with_queue_waits_for_a_worker_and_the_server_leaves_it_alone") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let pipeline = r#"
[pipeline]
name = "queued"
image = "busybox"

[[stage]]
name = "one"
key = "queued-one-{params.n}"
run = ["echo one > /work.txt"]
"#;
    let (status, run) = s.call(
        "POST",
        "/v1/runs",
        Some(json!({"pipeline": pipeline, "params": {"n": std::process::id().to_string()}, "queue": true})),
    );
    assert_eq!(status, 202, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    assert_eq!(run["orchestrated"], true, "the queue's workers hold it: {run}");
    // Without a worker nothing runs it, and a resume through the server is refused.
    std::thread::sleep(Duration::from_millis(500));
    let (_, d) = s.call("GET", &format!("/v1/runs/{id}"), None);
    assert_eq!(d["run"]["status"], "running", "{d}");
    assert!(d["stages"].as_array().unwrap().is_empty(), "{d}");
    let (status, v) = s.call("POST", &format!("/v1/runs/{id}/resume"), None);
    assert_eq!(status, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("cairn worker"), "{v}");
    // A worker takes it.
    let out = home.cairn(&["worker", "--idle-exit", "2"]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let d = settled(&s, &id);
    assert_eq!(d["run"]["status"], "completed", "{d}");
    assert_eq!(d["run"]["orchestrated"], false, "{d}");
}

#[test]
fn a_sandbox_with_a_network_is_created_and_its_port_found_through_the_api() {
    if skip("a_sandbox_with_a_network_is_created_and_its_port_found_through_the_api") {
        return;
    }
    if std::process::Command::new("nft").arg("--version").output().is_err() {
        common::skipped(
            "a_sandbox_with_a_network_is_created_and_its_port_found_through_the_api: apt-get install nftables",
        );
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    let host_port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (status, v) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({
            "network": { "publish": [format!("{host_port}:8000")] },
            "services": ["mkdir -p /www/cgi-bin && echo via-the-api > /www/index.html \
                && printf '#!/bin/sh\\necho Content-Type: text/plain\\necho\\nenv\\necho body: $(cat)\\n' > /www/cgi-bin/env \
                && chmod +x /www/cgi-bin/env && httpd -f -p 8000 -h /www"],
        })),
    );
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["network"]["mode"], "egress", "{v}");
    let address = v["network"]["address"].as_str().expect("an address").to_string();
    let (status, port) = s.call("GET", &format!("/v1/sandboxes/{id}/ports/8000"), None);
    assert_eq!(status, 200, "{port}");
    assert_eq!(port["host"], format!("{address}:8000"));
    assert_eq!(port["published"], json!([host_port]));
    // What it names answers (once the service listens; patient on a
    // loaded host).
    let body = (0..300)
        .find_map(|_| {
            let got = ureq::get(port["url"].as_str().unwrap()).call().ok()?.into_string().ok();
            if got.is_none() {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            got
        })
        .expect("the sandbox's server answered");
    assert_eq!(body.trim(), "via-the-api");
    // Through the server too, for clients that cannot reach the sandbox:
    // method, path, query and body go in; Cairn's token does not.
    let (status, page) = s.call("GET", &format!("/v1/sandboxes/{id}/ports/8000/http/"), None);
    assert_eq!(
        (status, page.as_str().map(str::trim)),
        (200, Some("via-the-api")),
        "{page}"
    );
    let resp = s
        .req(
            "POST",
            &format!("/v1/sandboxes/{id}/ports/8000/http/cgi-bin/env?probe=1"),
        )
        .send_string("posted-through");
    let env = match resp {
        Ok(resp) => resp.into_string().unwrap(),
        Err(ureq::Error::Status(code, resp)) => panic!(
            "the proxied POST answered {code}: {:?}",
            resp.into_string().unwrap_or_default()
        ),
        Err(e) => panic!("the proxied POST failed: {e}"),
    };
    assert!(env.contains("QUERY_STRING=probe=1"), "{env}");
    assert!(env.contains("REQUEST_METHOD=POST"), "{env}");
    assert!(env.contains("body: posted-through"), "{env}");
    assert!(!env.contains(&s.token), "the token reached the sandbox: {env}");
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{id}/ports/8001/http/"), None);
    assert_eq!(status, 502, "{v}");
    // Bad input: one error shape, nothing made.
    for (body, says) in [
        (json!({"network": {"mode": "bridge"}}), "unknown network"),
        (json!({"network": {"allow": ["10.0.0.1/8"]}}), "host bits"),
        (json!({"network": {"mode": "egress", "extra": 1}}), "unknown field"),
        (
            json!({"network": {"publish": [format!("{host_port}:80")]}}),
            &host_port.to_string(),
        ),
    ] {
        let (status, v) = s.call("POST", "/v1/sandboxes", Some(body.clone()));
        assert!(status == 400 || status == 422, "{body}: {status} {v}");
        assert!(
            v["error"]["message"].as_str().unwrap_or_default().contains(says),
            "{body}: {v}"
        );
    }
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{id}/ports/0"), None);
    assert_eq!(status, 400, "{v}");
    let plain = create(&s);
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{plain}/ports/80"), None);
    assert_eq!(status, 409, "{v}");
    let (status, v) = s.call("GET", &format!("/v1/sandboxes/{plain}/ports/80/http/"), None);
    assert_eq!(status, 409, "{v}");
    let (_, list) = s.call("GET", "/v1/sandboxes", None);
    assert_eq!(list["items"].as_array().unwrap().len(), 2, "{list}");
}

#[test]
fn a_runs_graph_gives_each_stage_the_stage_it_forks_and_an_unreadable_file_gives_none() {
    if skip("a_runs_graph_gives_each_stage_the_stage_it_forks_and_an_unreadable_file_gives_none") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, &[]);
    // Two stages after one, listed before it; a branch group after one of
    // them; a second root.
    let pipeline = r#"
[pipeline]
name = "tree"
image = "busybox"

[[stage]]
name = "left"
after = "prepare"
key = "tree-left"
run = ["echo left > /left"]

[[stage]]
name = "prepare"
key = "tree-prepare"
run = ["echo prepared > /base"]

[[stage]]
name = "right"
after = "prepare"
key = "tree-right"
run = ["echo right > /right"]

[[stage]]
name = "sweep"
after = "left"
key = "tree-sweep-{hypothesis}"
run = ["echo {hypothesis.v} > /v"]
[stage.branches]
select = "min"
metric = "file:/v"
hypotheses = [{ name = "a", v = "1" }, { name = "b", v = "2" }]

[[stage]]
name = "alone"
key = "tree-alone"
run = ["true"]
"#;
    let (status, run) = s.call("POST", "/v1/runs", Some(json!({ "pipeline": pipeline })));
    assert_eq!(status, 202, "{run}");
    let run = run["id"].as_str().unwrap().to_string();
    let d = settled(&s, &run);
    assert_eq!(d["run"]["status"], "completed", "{d}");
    let graph = d["graph"].as_array().unwrap();
    let after = |stage: &str| -> Vec<&str> {
        let e = graph
            .iter()
            .find(|e| e["stage"] == stage)
            .unwrap_or_else(|| panic!("{stage}: {d}"));
        e["after"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect()
    };
    assert_eq!(after("left"), ["prepare"]);
    assert_eq!(after("right"), ["prepare"]);
    assert_eq!(after("sweep"), ["left"]);
    assert!(after("prepare").is_empty() && after("alone").is_empty(), "{d}");
    let at = |stage: &str| graph.iter().position(|e| e["stage"] == stage).unwrap();
    assert!(
        at("prepare") < at("left") && at("left") < at("sweep"),
        "parents first: {d}"
    );
    // The edges are what the orchestrator did: each stage forked its
    // parent's output, the right one too, not the stage run before it.
    let row = |stage: &str, branch: &str| {
        d["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["stage"] == stage && r["branch"] == branch)
            .unwrap_or_else(|| panic!("{stage}/{branch}: {d}"))
            .clone()
    };
    let prepared = row("prepare", "")["output_snapshot"].clone();
    assert!(prepared.is_string(), "{d}");
    assert_eq!(row("left", "")["input_snapshot"], prepared);
    assert_eq!(row("right", "")["input_snapshot"], prepared);
    assert_eq!(row("sweep", "a")["input_snapshot"], row("left", "")["output_snapshot"]);
    assert_eq!(
        row("alone", "")["input_snapshot"],
        Value::Null,
        "a root starts from the image"
    );
    // `cairn pipeline show --json` reads the same edges.
    let shown: Value = serde_json::from_str(&home.ok(&["pipeline", "show", &run, "--json"])).unwrap();
    assert_eq!(shown["graph"], d["graph"]);
    // And its tree nests each stage under the stage it forks.
    let depth = |text: &str, stage: &str| -> usize {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("─ {stage}: ")))
            .unwrap_or_else(|| panic!("{stage}: {text}"));
        line.chars().take_while(|c| !matches!(c, '├' | '└')).count()
    };
    let text = home.ok(&["pipeline", "show", &run]);
    let depths: Vec<usize> = ["prepare", "alone", "left", "right", "sweep"]
        .iter()
        .map(|s| depth(&text, s))
        .collect();
    assert_eq!(depths, [0, 0, 3, 3, 6], "{text}");
    // A run whose stored file no longer parses still loads, without a graph.
    let shown_stages = d["stages"].clone();
    let db = rusqlite::Connection::open(home.path().join("state.db")).unwrap();
    db.execute("UPDATE runs SET spec = 'not a pipeline' WHERE id = ?1", [&run])
        .unwrap();
    let (status, d) = s.call("GET", &format!("/v1/runs/{run}"), None);
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["graph"], Value::Null, "{d}");
    assert_eq!(d["stages"], shown_stages, "{d}");
    let text = home.ok(&["pipeline", "show", &run]);
    assert!(
        ["prepare", "alone", "left", "right", "sweep"]
            .iter()
            .all(|s| depth(&text, s) == 0),
        "without edges the stages follow each other: {text}"
    );
}

#[test]
fn disk_limits_oom_kills_and_a_dead_init_are_given_and_shown_through_the_api() {
    if common::skip_without_disks("disk_limits_oom_kills_and_a_dead_init_are_given_and_shown_through_the_api") {
        return;
    }
    let home = Home::new();
    let token = home.ok(&["token", "create", "tests"]);
    let s = Server::start_env(&home, &[], token, &[("CAIRN_DISK", "32M")]);
    let message = |v: &Value| v["error"]["message"].as_str().unwrap_or_default().to_string();
    let (status, v) = s.call("POST", "/v1/sandboxes", Some(json!({ "limits": { "disk": "1K" } })));
    assert!(status == 400 && message(&v).contains("limits.disk"), "{v}");
    // The server's default, and a size given.
    let plain = create(&s);
    let (status, v) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "limits": { "disk": "48M", "memory": "32M" } })),
    );
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["disk_bytes"], 48 << 20, "{v}");
    assert_eq!(v["oom_kills"], 0, "{v}");
    let (_, v) = s.call("GET", &format!("/v1/sandboxes/{plain}"), None);
    assert_eq!(v["disk_bytes"], 32 << 20, "{v}");
    let v = exec(&s, &id, "dd if=/dev/zero of=/big bs=1M count=100");
    assert!(v["stderr"].as_str().unwrap().contains("No space left on device"), "{v}");
    // An OOM kill: said in the exec's result, counted in the sandbox's view.
    let v = exec(&s, &id, "x=aaaaaaaa; while true; do x=$x$x; done");
    assert_eq!(
        (v["exit_code"].as_i64(), v["oom_killed"].as_bool()),
        (Some(137), Some(true)),
        "{v}"
    );
    let (_, v) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(v["oom_kills"], 1, "{v}");
    // A sandbox whose init died: an exec says so, not only that nothing answers.
    let (_, v) = s.call("GET", &format!("/v1/sandboxes/{plain}"), None);
    let pid = v["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cairn_sandbox::pid_start_time(pid).is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sandboxes/{plain}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!(status, 409, "{v}");
    assert!(message(&v).contains("not running: init exited"), "{v}");
    for sandbox in [&id, &plain] {
        let (status, v) = s.call("DELETE", &format!("/v1/sandboxes/{sandbox}?force=true"), None);
        assert!(status < 300, "{v}");
    }
    assert!(home.host_mounts().is_empty(), "{:?}", home.host_mounts());
}

/// Creates a sandbox with the admission headers given; (status, body).
fn create_queued(s: &Server, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut r = s.req("POST", "/v1/sandboxes");
    for (k, v) in headers {
        r = r.set(k, v);
    }
    answer(r.send_json(json!({})))
}

#[test]
fn two_hundred_simultaneous_creates_over_a_capacity_of_twenty_all_succeed_in_turn() {
    if skip("two_hundred_simultaneous_creates_over_a_capacity_of_twenty_all_succeed_in_turn") {
        return;
    }
    let home = Home::new();
    let s = std::sync::Arc::new(Server::start(
        &home,
        &[
            "--max-sandboxes",
            "20",
            "--max-connections-per-peer",
            "1000",
            "--max-connections",
            "1000",
        ],
    ));
    let start = Instant::now();
    // The queue's depth, sampled from /metrics while the clients run.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (s, done) = (std::sync::Arc::clone(&s), std::sync::Arc::clone(&done));
        std::thread::spawn(move || {
            let mut deepest = 0u64;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let text = s.req("GET", "/metrics").call().unwrap().into_string().unwrap();
                let depth = text
                    .lines()
                    .find_map(|l| l.strip_prefix("cairn_admission_queue_depth "))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                deepest = deepest.max(depth);
                std::thread::sleep(Duration::from_millis(20));
            }
            deepest
        })
    };
    let threads: Vec<_> = (0..200)
        .map(|i| {
            let s = std::sync::Arc::clone(&s);
            std::thread::spawn(move || {
                let (status, v) = create_queued(&s, &[("Request-Timeout", "600")]);
                assert_eq!(status, 201, "request {i}: {v}");
                let made = start.elapsed();
                let id = v["id"].as_str().unwrap().to_string();
                assert_eq!(exec(&s, &id, "echo $((6*7))")["stdout"], "42\n");
                // Held a while, so that the capacity fills and the rest wait.
                std::thread::sleep(Duration::from_millis(500));
                let removing = start.elapsed();
                let (status, v) = s.call("DELETE", &format!("/v1/sandboxes/{id}?force=true"), None);
                assert_eq!(status, 204, "{v}");
                (made, removing)
            })
        })
        .collect();
    let spans: Vec<(Duration, Duration)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(spans.len(), 200, "every create succeeded, none refused");
    // At no moment did clients hold more sandboxes than the capacity.
    let most = spans
        .iter()
        .map(|(made, _)| spans.iter().filter(|(m, r)| m <= made && made < r).count())
        .max()
        .unwrap();
    assert!(most <= 20, "{most} sandboxes were held at once");
    let deepest = sampler.join().unwrap();
    assert!(
        deepest >= 100,
        "the queue held {deepest} at most: the creates did not wait for capacity"
    );
    let metrics = s.req("GET", "/metrics").call().unwrap().into_string().unwrap();
    assert!(metrics.contains("cairn_admission_refused_total 0"), "{metrics}");
    assert!(metrics.contains("cairn_admission_wait_seconds_count 200"), "{metrics}");
    assert!(home.ps().is_empty(), "{:?}", home.ps());
}

#[test]
fn two_tokens_under_contention_get_the_same_share_and_a_short_deadline_is_refused_cleanly() {
    if skip("two_tokens_under_contention_get_the_same_share_and_a_short_deadline_is_refused_cleanly") {
        return;
    }
    let home = Home::new();
    let a = home.ok(&["token", "create", "tenant-a"]);
    let b = home.ok(&["token", "create", "tenant-b"]);
    let s = std::sync::Arc::new(Server::start_with(
        &home,
        &["--max-sandboxes", "4", "--max-connections-per-peer", "1000"],
        a.clone(),
    ));
    // Six clients per token, each making, holding and removing sandboxes
    // until 80 have been made between them.
    let made = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .flat_map(|token| std::iter::repeat_n(token, 6))
        .map(|token| {
            let (s, made) = (std::sync::Arc::clone(&s), std::sync::Arc::clone(&made));
            std::thread::spawn(move || {
                let mut mine = 0;
                while made.load(std::sync::atomic::Ordering::SeqCst) < 80 {
                    let r = ureq::post(&s.url("/v1/sandboxes"))
                        .set("Authorization", &format!("Bearer {token}"))
                        .set("Request-Timeout", "600")
                        .send_json(json!({}));
                    let (status, v) = answer(r);
                    assert_eq!(status, 201, "{v}");
                    if made.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 80 {
                        mine += 1;
                    }
                    std::thread::sleep(Duration::from_millis(150));
                    let id = v["id"].as_str().unwrap();
                    let r = ureq::delete(&s.url(&format!("/v1/sandboxes/{id}?force=true")))
                        .set("Authorization", &format!("Bearer {token}"))
                        .call();
                    assert_eq!(answer(r).0, 204);
                }
                mine
            })
        })
        .collect();
    let counts: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let (ca, cb): (usize, usize) = (counts[..6].iter().sum(), counts[6..].iter().sum());
    assert_eq!(ca + cb, 80);
    let spread = ca.abs_diff(cb) as f64 / ca.max(cb) as f64;
    assert!(spread <= 0.10, "token a made {ca}, token b {cb}: not an even share");

    // One sandbox fills a capacity of four when it asks for four; a
    // request whose deadline passes first is refused and makes nothing.
    let held: Vec<String> = (0..4).map(|_| create(&s)).collect();
    let before = home.ps().len();
    let t = Instant::now();
    let (status, v) = create_queued(&s, &[("Request-Timeout", "0.5")]);
    let waited = t.elapsed();
    assert_eq!(status, 429, "{v}");
    assert!(
        waited >= Duration::from_millis(500),
        "refused after {waited:?}, before its deadline"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("Request-Timeout"),
        "{v}"
    );
    assert_eq!(home.ps().len(), before, "a refused create left a sandbox");
    for (header, value) in [
        ("Request-Timeout", "soon"),
        ("Request-Timeout", "-1"),
        ("Priority", "high"),
        ("Priority", "-9223372036854775808"),
        ("Priority", "1001"),
    ] {
        let (status, v) = create_queued(&s, &[(header, value)]);
        assert_eq!(status, 400, "{header}: {value}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(header), "{v}");
    }
    // A request the whole capacity could never hold is refused at once.
    let t = Instant::now();
    let (status, v) = answer(
        s.req("POST", &format!("/v1/sandboxes/{}/fork", held[1]))
            .set("Request-Timeout", "60")
            .send_json(json!({"count": 5})),
    );
    assert_eq!(status, 429, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("whole capacity"),
        "{v}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "it waited {:?}", t.elapsed());
    // A waiting request starts once a sandbox goes.
    let s2 = std::sync::Arc::clone(&s);
    let waiter = std::thread::spawn(move || create_queued(&s2, &[("Request-Timeout", "60")]));
    std::thread::sleep(Duration::from_millis(300));
    let metrics = s.req("GET", "/metrics").call().unwrap().into_string().unwrap();
    assert!(metrics.contains("cairn_admission_queue_depth 1"), "{metrics}");
    assert!(metrics.contains("cairn_admission_refused_total 2"), "{metrics}");
    let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{}?force=true", held[0]), None);
    assert_eq!(status, 204);
    let (status, v) = waiter.join().unwrap();
    assert_eq!(status, 201, "{v}");
}

/// Asks `path` as `token` for an object of another tenant and for one that
/// does not exist: both answers are the same 404, but for the key itself.
fn absent_alike(s: &Server, token: &str, method: &str, theirs: &str, missing: &str, path: &str, body: Option<Value>) {
    let (st1, v1) = s.call_as(token, method, &path.replace("{}", theirs), body.clone());
    let (st2, v2) = s.call_as(token, method, &path.replace("{}", missing), body);
    assert_eq!((st1, st2), (404, 404), "{method} {path}: {v1} / {v2}");
    assert_eq!(
        v1.to_string().replace(theirs, "KEY"),
        v2.to_string().replace(missing, "KEY"),
        "{method} {path} tells another tenant's object from an absent one"
    );
}

#[test]
fn tenants_see_act_on_and_learn_of_their_own_objects_only() {
    if skip("tenants_see_act_on_and_learn_of_their_own_objects_only") {
        return;
    }
    let home = Home::new();
    home.ok(&["tenant", "create", "acme", "--max-sandboxes", "4"]);
    home.ok(&["tenant", "create", "globex"]);
    let acme = home.ok(&["token", "create", "acme-ci", "--tenant", "acme"]);
    let globex = home.ok(&["token", "create", "globex-ci", "--tenant", "globex"]);
    let err = home.cairn(&["token", "create", "x", "--tenant", "nobody"]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("no tenant named \"nobody\""));
    let s = Server::start(&home, &[]);

    // Acme's sandbox, its snapshot, its fork, its session.
    // Names are each tenant's own: both name a sandbox "web".
    let (st, a) = s.call_as(&acme, "POST", "/v1/sandboxes", Some(json!({ "name": "web" })));
    assert_eq!(st, 201, "{a}");
    assert_eq!(
        a["name"], "acme-web",
        "a tenant's names are stored in its namespace: {a}"
    );
    let a = a["id"].as_str().unwrap().to_string();
    let (st, v) = s.call_as(
        &acme,
        "POST",
        &format!("/v1/sandboxes/{a}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo secret > /tmp/s; cat /tmp/s"] })),
    );
    assert_eq!((st, v["stdout"].as_str()), (200, Some("secret\n")), "{v}");
    let (st, snap) = s.call_as(
        &acme,
        "POST",
        "/v1/sandboxes/web/snapshots",
        Some(json!({ "label": "acme-base" })),
    );
    assert_eq!(st, 201, "{snap}");
    let snap = snap["id"].as_str().unwrap().to_string();
    let (st, fork) = s.call_as(&acme, "POST", &format!("/v1/snapshots/{snap}/fork"), Some(json!({})));
    assert_eq!(st, 201, "{fork}");
    let (st, session) = s.call_as(&acme, "POST", "/v1/sessions", Some(json!({ "name": "acme-agent" })));
    assert_eq!(st, 201, "{session}");
    let session = session["id"].as_str().unwrap().to_string();
    let (st, g) = s.call_as(&globex, "POST", "/v1/sandboxes", Some(json!({ "name": "web" })));
    assert_eq!((st, g["name"].as_str()), (201, Some("globex-web")), "{g}");
    let (st, v) = s.call_as(&globex, "POST", "/v1/sandboxes", Some(json!({ "name": "web" })));
    assert_eq!(st, 409, "its own name is taken: {v}");
    let (st, v) = s.call_as(&globex, "GET", "/v1/sandboxes/web", None);
    assert_eq!((st, v["id"].as_str()), (200, g["id"].as_str()), "{v}");
    let g = g["id"].as_str().unwrap().to_string();

    // Globex lists none of Acme's and cannot tell them from absent ones.
    let (_, list) = s.call_as(&globex, "GET", "/v1/sandboxes", None);
    let ids: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [g.as_str()], "{list}");
    let (_, list) = s.call_as(&globex, "GET", "/v1/snapshots", None);
    assert_eq!(list["items"], json!([]), "{list}");
    let (_, list) = s.call_as(&globex, "GET", "/v1/sessions", None);
    assert_eq!(list["items"], json!([]), "{list}");
    let missing = "0123456789abcdef0123";
    for (method, path, body) in [
        ("GET", "/v1/sandboxes/{}", None),
        ("DELETE", "/v1/sandboxes/{}", None),
        (
            "POST",
            "/v1/sandboxes/{}/exec",
            Some(json!({ "argv": ["cat", "/tmp/s"] })),
        ),
        ("GET", "/v1/sandboxes/{}/files?path=/tmp/s", None),
        ("PUT", "/v1/sandboxes/{}/files?path=/tmp/x", Some(json!("x"))),
        ("POST", "/v1/sandboxes/{}/snapshots", Some(json!({}))),
        ("POST", "/v1/sandboxes/{}/fork", Some(json!({}))),
        ("POST", "/v1/sandboxes/{}/reset", Some(json!({ "snapshot": "x" }))),
        ("GET", "/v1/sandboxes/{}/ports/80", None),
    ] {
        absent_alike(&s, &globex, method, &a, missing, path, body.clone());
        absent_alike(&s, &globex, method, "acme-web", "nobody-web", path, body);
    }
    for (method, path) in [
        ("GET", "/v1/snapshots/{}"),
        ("DELETE", "/v1/snapshots/{}"),
        ("POST", "/v1/snapshots/{}/fork"),
        ("POST", "/v1/snapshots/{}/restore"),
        ("POST", "/v1/snapshots/{}/verify"),
    ] {
        absent_alike(
            &s,
            &globex,
            method,
            &snap,
            &format!("{}0", &missing[..19]),
            path,
            Some(json!({})),
        );
        absent_alike(&s, &globex, method, "acme-base", "nobody-base", path, Some(json!({})));
    }
    for (method, path) in [
        ("GET", "/v1/sessions/{}"),
        ("GET", "/v1/sessions/{}/log"),
        ("POST", "/v1/sessions/{}/exec"),
        ("POST", "/v1/sessions/{}/suspend"),
        ("POST", "/v1/sessions/{}/fork"),
        ("DELETE", "/v1/sessions/{}"),
    ] {
        absent_alike(
            &s,
            &globex,
            method,
            &session,
            missing,
            path,
            Some(json!({ "argv": ["true"] })),
        );
    }
    // A prefix of Acme's id is one of Globex's at most.
    let (st, _) = s.call_as(&globex, "GET", &format!("/v1/sandboxes/{}", &a[..4]), None);
    assert_eq!(st, if g.starts_with(&a[..4]) { 200 } else { 404 });
    // A body naming Acme's snapshot, a diff of Acme's objects: absent too.
    let (st, v) = s.call_as(&globex, "POST", "/v1/sandboxes", Some(json!({ "snapshot": snap })));
    assert_eq!(st, 404, "{v}");
    let (st, v) = s.call_as(&globex, "GET", &format!("/v1/diff?a={snap}&b={g}"), None);
    assert_eq!(st, 404, "{v}");
    assert!(v.to_string().contains("names no snapshot, sandbox or stage"), "{v}");
    let (st, v) = s.call_as(&acme, "GET", &format!("/v1/diff?a={snap}&b=web"), None);
    assert_eq!(st, 200, "{v}");
    // A tenant's image is its own; the administrator's is shared, and not
    // theirs to remove.
    let (st, built) = s.call_as(
        &acme,
        "POST",
        "/v1/images",
        Some(json!({ "name": "tools", "kind": "busybox" })),
    );
    assert_eq!(st, 200);
    assert!(built.to_string().contains("acme-tools"), "{built}");
    let (_, images) = s.call_as(&acme, "GET", "/v1/images", None);
    assert!(images.to_string().contains("acme-tools"), "{images}");
    let (_, images) = s.call_as(&globex, "GET", "/v1/images", None);
    assert!(!images.to_string().contains("tools"), "{images}");
    let (st, v) = s.call_as(&globex, "POST", "/v1/sandboxes", Some(json!({ "image": "acme-tools" })));
    assert_eq!(st, 404, "{v}");
    absent_alike(
        &s,
        &globex,
        "DELETE",
        "acme-tools",
        "nobody-tools",
        "/v1/images/{}",
        None,
    );
    let (_, images) = s.call_as(&globex, "GET", "/v1/images", None);
    assert!(images.to_string().contains("busybox"), "{images}");
    let (st, _) = s.call_as(&globex, "DELETE", "/v1/images/busybox", None);
    assert_eq!(st, 404);
    let (st, v) = s.call_as(&globex, "GET", "/metrics", None);
    assert_eq!(st, 403, "{v}");
    // Globex's run, its artifact and its dead letter are Globex's alone.
    let pipeline = r#"
[pipeline]
name = "globex-run"
image = "busybox"

[[stage]]
name = "make"
key = "globex-make"
run = ["mkdir -p /work && echo result > /work/out"]
artifacts = ["/work/out"]

[[stage]]
name = "fail"
after = "make"
key = "globex-fail"
run = ["exit 3"]
"#;
    let (st, run) = s.call_as(&globex, "POST", "/v1/runs", Some(json!({ "pipeline": pipeline })));
    assert_eq!(st, 202, "{run}");
    let run = run["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    let detail = loop {
        let (_, d) = s.call_as(&globex, "GET", &format!("/v1/runs/{run}"), None);
        if (d["run"]["status"] != "running" && d["run"]["orchestrated"] == false) || Instant::now() > deadline {
            break d;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(detail["run"]["status"], "failed", "{detail}");
    let artifact = detail["artifacts"][0]["id"].as_str().unwrap().to_string();
    let (_, dlq) = s.call_as(&globex, "GET", "/v1/dlq", None);
    let dead = dlq[0]["id"].as_str().unwrap().to_string();
    let (st, _) = s.call_as(&globex, "GET", &format!("/v1/artifacts/{artifact}"), None);
    assert_eq!(st, 200);
    let (_, runs) = s.call_as(&acme, "GET", "/v1/runs", None);
    assert_eq!(runs["items"], json!([]), "{runs}");
    let (_, dlq) = s.call_as(&acme, "GET", "/v1/dlq", None);
    assert_eq!(dlq, json!([]), "{dlq}");
    for path in [
        "/v1/runs/{}",
        "/v1/runs/{}/audit",
        "/v1/runs/{}/logs/make",
        "/v1/runs/{}/resume",
    ] {
        let method = if path.ends_with("resume") { "POST" } else { "GET" };
        absent_alike(&s, &acme, method, &run, "0123456789ab", path, None);
    }
    absent_alike(&s, &acme, "GET", &dead, "0123456789ab", "/v1/dlq/{}", None);
    absent_alike(&s, &acme, "POST", &dead, "0123456789ab", "/v1/dlq/{}/retry", None);
    let (st, v) = s.call_as(&acme, "GET", &format!("/v1/artifacts/{artifact}"), None);
    assert_eq!(st, 404, "{v}");
    let (_, runs) = s.call("GET", "/v1/runs", None);
    assert!(runs.to_string().contains(&run), "the administrator sees it: {runs}");
    let stage_snapshot = detail["stages"][0]["output_snapshot"].as_str().unwrap().to_string();
    let (st, _) = s.call_as(&globex, "GET", &format!("/v1/snapshots/{stage_snapshot}"), None);
    assert_eq!(st, 200, "a run's stage outputs are its tenant's");

    // An Idempotency-Key is each tenant's own.
    let key = [("Idempotency-Key", "same-key")];
    let created = |token: &str| {
        let mut r = ureq::post(&s.url("/v1/sandboxes")).set("Authorization", &format!("Bearer {token}"));
        for (k, v) in key {
            r = r.set(k, v);
        }
        let (st, v) = answer(r.send_json(json!({})));
        assert_eq!(st, 201, "{v}");
        v["id"].as_str().unwrap().to_string()
    };
    let (ga, gb) = (created(&globex), created(&globex));
    assert_eq!(ga, gb, "a retry gets the first answer");
    let aa = created(&acme);
    assert_ne!(aa, ga, "another tenant's answer is never replayed");

    // Acme holds 4 of 4 (its session's sandbox among them): the next
    // create, fork or restore is refused whole.
    for (path, body) in [
        ("/v1/sandboxes", json!({})),
        (&*format!("/v1/sandboxes/{a}/fork"), json!({})),
        (&*format!("/v1/snapshots/{snap}/restore"), json!({})),
    ] {
        let (st, v) = s.call_as(&acme, "POST", path, Some(body));
        assert_eq!(st, 429, "{path}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("at most 4 sandboxes"),
            "{v}"
        );
    }
    let (_, list) = s.call_as(&acme, "GET", "/v1/sandboxes", None);
    assert_eq!(list["items"].as_array().unwrap().len(), 4, "{list}");
    // The administrator sees everyone's.
    let (_, list) = s.call("GET", "/v1/sandboxes", None);
    assert_eq!(list["items"].as_array().unwrap().len(), 6, "{list}");
    let tenants: Value = serde_json::from_str(&home.ok(&["tenant", "ls", "--json"])).unwrap();
    assert_eq!(tenants[0]["tenant"]["name"], "acme");
    assert_eq!(tenants[0]["holds"]["sandboxes"], 4, "{tenants}");

    // Removing Acme: refused while it holds sandboxes, then --force.
    let out = home.cairn(&["tenant", "rm", "acme"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("still has 4 sandbox(es) and 1 open session(s)"));
    let (st, _) = s.call_as(&acme, "GET", "/v1/sandboxes", None);
    assert_eq!(st, 200);
    home.ok(&["tenant", "rm", "--force", "acme"]);
    let (st, v) = s.call_as(&acme, "GET", "/v1/sandboxes", None);
    assert_eq!(st, 401, "{v}");
    let (_, list) = s.call("GET", "/v1/sandboxes", None);
    assert_eq!(
        list["items"].as_array().unwrap().len(),
        2,
        "Acme's sandboxes went with it: {list}"
    );
    let (st, left) = s.call("GET", &format!("/v1/snapshots/{snap}"), None);
    assert_eq!(st, 200, "its snapshot stays, the administrator's now: {left}");

    // Who did what. The log is written behind the answers: its newest row
    // (Globex's look at Acme's sandbox) may take a moment to show.
    let looked_at_acmes =
        |r: &Value| r["method"] == "GET" && r["path"] == format!("/v1/sandboxes/{a}") && r["status"] == 404;
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log: Value =
            serde_json::from_str(&home.ok(&["token", "log", "--tenant", "globex", "--json", "-n", "1000"])).unwrap();
        if log.as_array().unwrap().iter().any(looked_at_acmes) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let rows = log.as_array().unwrap();
    assert!(
        rows.iter().all(|r| r["tenant"] == "globex" && r["surface"] == "api"),
        "{log}"
    );
    assert!(rows.iter().any(looked_at_acmes), "{log}");
    let tokens: Value = serde_json::from_str(&home.ok(&["token", "ls", "--json"])).unwrap();
    let globex_id = tokens
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "globex-ci")
        .unwrap()["id"]
        .clone();
    assert!(rows.iter().all(|r| r["token"] == globex_id), "{log}");
}
