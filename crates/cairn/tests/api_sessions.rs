//! End-to-end: agent sessions through `cairn serve`, over its Unix
//! socket, against real sandboxes.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{skip, Home};
use serde_json::{json, Value};

/// A running `cairn serve` on a home's Unix socket.
struct Server {
    child: Child,
    socket: PathBuf,
}

impl Server {
    fn start(home: &Home) -> Server {
        Server::start_with(home, &[])
    }

    fn start_with(home: &Home, args: &[&str]) -> Server {
        let mut child = home
            .command(&[&["serve"], args].concat())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the server prints where it listens").unwrap();
            if line.starts_with("cairn: serving on ") {
                break;
            }
        }
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Server {
            child,
            socket: home.path().join("cairn.sock"),
        }
    }

    /// Sends a request; answers the status and the raw body (de-chunked).
    fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, Vec<u8>) {
        let mut conn = UnixStream::connect(&self.socket).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        conn.write_all(head.as_bytes()).unwrap();
        // A server refusing a large body may answer and close before it
        // has read it all: write from another thread, read what came.
        let mut writer = conn.try_clone().unwrap();
        let body = body.to_vec();
        let sending = std::thread::spawn(move || drop(writer.write_all(&body)));
        let mut text = Vec::new();
        let mut buf = [0u8; 65536];
        loop {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.extend_from_slice(&buf[..n]),
            }
        }
        let _ = conn.shutdown(std::net::Shutdown::Both);
        let _ = sending.join();
        parse_response(&text)
    }

    /// Sends JSON; answers (status, JSON body or the text as a string).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call_with(method, path, &[], body)
    }

    fn call_with(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let (status, bytes) = self.raw(method, path, headers, body.as_bytes());
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// A call that must answer `status`; its body.
    fn ok(&self, method: &str, path: &str, body: Option<Value>, status: u16) -> Value {
        let (got, v) = self.call(method, path, body);
        assert_eq!(got, status, "{method} {path}: {v}");
        v
    }

    /// A streamed exec's events, (name, data) in order.
    fn stream(&self, id: &str, argv: &[&str]) -> Vec<(String, Value)> {
        let body = json!({ "argv": argv }).to_string();
        let (status, bytes) = self.raw("POST", &format!("/v1/sessions/{id}/exec/stream"), &[], body.as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let mut events = Vec::new();
        let mut name = String::new();
        for line in String::from_utf8(bytes).unwrap().lines() {
            if let Some(e) = line.strip_prefix("event: ") {
                name = e.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                events.push((name.clone(), serde_json::from_str(d).unwrap()));
            }
        }
        events
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status and body of an HTTP/1.1 response, a chunked body joined.
fn parse_response(text: &[u8]) -> (u16, Vec<u8>) {
    let end = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response head");
    let head = String::from_utf8_lossy(&text[..end]).to_ascii_lowercase();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = &text[end + 4..];
    if !head.contains("transfer-encoding: chunked") {
        return (status, body.to_vec());
    }
    let mut out = Vec::new();
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n").expect("a chunk size");
        let size = usize::from_str_radix(std::str::from_utf8(&body[..line_end]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return (status, out);
        }
        out.extend_from_slice(&body[line_end + 2..line_end + 2 + size]);
        body = &body[line_end + 2 + size + 2..];
    }
}

fn b64(text: &str) -> String {
    use std::fmt::Write as _;
    // Standard base64 of a short ASCII text, enough to compare stream data.
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in text.as_bytes().chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.write_char(ABC[(n >> (18 - 6 * i) & 63) as usize] as char).unwrap();
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn entries(v: &Value) -> Vec<Value> {
    v["entries"].as_array().unwrap().clone()
}

fn seqs(v: &Value) -> Vec<u64> {
    entries(v).iter().map(|e| e["seq"].as_u64().unwrap()).collect()
}

#[test]
fn a_session_lives_its_whole_life_through_the_api() {
    if skip("a_session_lives_its_whole_life_through_the_api") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home);
    let events = {
        let mut conn = UnixStream::connect(&s.socket).unwrap();
        conn.write_all(b"GET /v1/events HTTP/1.1\r\nHost: cairn\r\n\r\n")
            .unwrap();
        conn
    };
    let created = s.ok(
        "POST",
        "/v1/sessions",
        Some(json!({ "name": "agent", "idle_timeout_ms": 300000 })),
        201,
    );
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(
        (created["state"].as_str(), created["idle_timeout_ms"].as_u64()),
        (Some("active"), Some(300_000))
    );
    // By name and by a unique prefix too.
    assert_eq!(s.ok("GET", "/v1/sessions/agent", None, 200)["id"], id.as_str());
    assert_eq!(
        s.ok("GET", &format!("/v1/sessions/{}", &id[..6]), None, 200)["id"],
        id.as_str()
    );
    let e = s.ok(
        "POST",
        "/v1/sessions/agent/entries",
        Some(json!({ "kind": "user", "role": "user", "content": "make a file" })),
        201,
    );
    assert_eq!((e["seq"].as_u64(), e["kind"].as_str()), (Some(1), Some("user")));
    let e = s.ok(
        "POST",
        "/v1/sessions/agent/entries",
        Some(json!({ "kind": "tool_call", "tool": "think", "arguments": { "plan": [1, 2] }, "tokens_in": 12 })),
        201,
    );
    assert_eq!(e["arguments"], json!({ "plan": [1, 2] }));
    // A collected exec answers the output and records its call and result.
    let r = s.ok(
        "POST",
        "/v1/sessions/agent/exec",
        Some(json!({ "argv": ["sh", "-c", "echo one > /f; cat /f; echo warn >&2; exit 3"] })),
        200,
    );
    assert_eq!(
        (
            r["exit_code"].as_i64(),
            r["stdout"].as_str(),
            r["stderr"].as_str(),
            r["call_seq"].as_u64(),
            r["result_seq"].as_u64()
        ),
        (Some(3), Some("one\n"), Some("warn\n"), Some(3), Some(4)),
        "{r}"
    );
    // A streamed one sends the output as events, then the exit with its seqs.
    let events_seen = s.stream(
        "agent",
        &["sh", "-c", "echo two >> /f; echo out; sleep 0.2; echo err >&2; exit 5"],
    );
    let names: Vec<&str> = events_seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["stdout", "stderr", "exit"], "{events_seen:?}");
    assert_eq!(events_seen[0].1["data"], b64("out\n"));
    assert_eq!(events_seen[1].1["data"], b64("err\n"));
    let exit = &events_seen[2].1;
    assert_eq!(
        (
            exit["exit_code"].as_i64(),
            exit["call_seq"].as_u64(),
            exit["result_seq"].as_u64()
        ),
        (Some(5), Some(5), Some(6)),
        "{exit}"
    );
    let tail = s.ok("GET", "/v1/sessions/agent/log?tail=2", None, 200);
    assert_eq!(seqs(&tail), [5, 6]);
    assert_eq!(tail["prev"].as_u64(), Some(5), "older entries are there: {tail}");
    let result: Value = serde_json::from_str(tail["entries"][1]["result"].as_str().unwrap()).unwrap();
    assert_eq!(
        (tail["entries"][1]["kind"].as_str(), result["stderr"].as_str()),
        (Some("tool_result"), Some("err\n"))
    );
    assert_eq!(tail["entries"][0]["arguments"]["argv"][0], "sh");
    // Paging from the start: limit, then next.
    let page = s.ok("GET", "/v1/sessions/agent/log?from=1&limit=4", None, 200);
    assert_eq!((seqs(&page), page["next"].as_u64()), (vec![1, 2, 3, 4], Some(5)));
    let page = s.ok("GET", "/v1/sessions/agent/log?from=5&limit=4", None, 200);
    assert_eq!((seqs(&page), page["next"].as_u64()), (vec![5, 6], None));
    // Suspend: the sandbox goes, a snapshot is recorded; an exec resumes it.
    let suspended = s.ok("POST", "/v1/sessions/agent/suspend", None, 200);
    assert_eq!(suspended["state"], "suspended");
    assert!(suspended["sandbox_id"].is_null() && suspended["snapshot_id"].is_string());
    assert!(home.ps().is_empty(), "a suspended session has no sandbox");
    let r = s.ok(
        "POST",
        "/v1/sessions/agent/exec",
        Some(json!({ "argv": ["cat", "/f"] })),
        200,
    );
    assert_eq!(r["stdout"], "one\ntwo\n", "the files came back: {r}");
    assert_eq!(s.ok("GET", "/v1/sessions/agent", None, 200)["state"], "active");
    // Fork at entry 4 (before the second write): the machine as it was then.
    let (status, fork) = s.call_with(
        "POST",
        "/v1/sessions/agent/fork",
        &[("Idempotency-Key", "fork-1")],
        Some(json!({ "at": 4, "reason": "try another way", "name": "other" })),
    );
    assert_eq!(status, 201, "{fork}");
    let (again, same) = s.call_with(
        "POST",
        "/v1/sessions/agent/fork",
        &[("Idempotency-Key", "fork-1")],
        Some(json!({ "at": 4, "reason": "try another way", "name": "other" })),
    );
    assert_eq!((again, &same["id"]), (201, &fork["id"]), "one fork per key");
    assert_eq!(
        (fork["parent_id"].as_str(), fork["fork_seq"].as_u64()),
        (Some(id.as_str()), Some(4))
    );
    let forked_log = s.ok("GET", "/v1/sessions/other/log", None, 200);
    assert_eq!(seqs(&forked_log), [1, 2, 3, 4]);
    // Without a snapshot at or before entry 4 the fork starts from the image.
    let r = s.ok(
        "POST",
        "/v1/sessions/other/exec",
        Some(json!({ "argv": ["sh", "-c", "cat /f 2>&1; echo forked > /f"] })),
        200,
    );
    assert!(r["stdout"].as_str().unwrap().contains("No such file"), "{r}");
    let r = s.ok(
        "POST",
        "/v1/sessions/agent/exec",
        Some(json!({ "argv": ["cat", "/f"] })),
        200,
    );
    assert_eq!(r["stdout"], "one\ntwo\n", "the parent did not see the fork's write");
    // Rewind to 2: later entries leave the live log; the next follows them.
    let head = s.ok("GET", "/v1/sessions/agent", None, 200)["head_seq"]
        .as_u64()
        .unwrap();
    let rw = s.ok("POST", "/v1/sessions/agent/rewind", Some(json!({ "to": 2 })), 200);
    assert_eq!((rw["to_seq"].as_u64(), rw["head_seq"].as_u64()), (Some(2), Some(head)));
    let e = s.ok(
        "POST",
        "/v1/sessions/agent/entries",
        Some(json!({ "kind": "note", "content": "again" })),
        201,
    );
    assert_eq!(e["seq"].as_u64(), Some(head + 1));
    assert_eq!(
        seqs(&s.ok("GET", "/v1/sessions/agent/log", None, 200)),
        [1, 2, head + 1]
    );
    // Paging back from the tail, by `prev`, across the abandoned entries.
    let page = s.ok("GET", "/v1/sessions/agent/log?tail=1", None, 200);
    assert_eq!((seqs(&page), page["prev"].as_u64()), (vec![head + 1], Some(head + 1)));
    let page = s.ok(
        "GET",
        &format!("/v1/sessions/agent/log?before={}&limit=1", head + 1),
        None,
        200,
    );
    assert_eq!((seqs(&page), page["prev"].as_u64()), (vec![2], Some(2)));
    let page = s.ok("GET", "/v1/sessions/agent/log?before=2&limit=5", None, 200);
    assert_eq!((seqs(&page), page["prev"].as_u64()), (vec![1], None));
    let page = s.ok("GET", "/v1/sessions/agent/log?tail=10", None, 200);
    assert_eq!((seqs(&page), page["prev"].as_u64()), (vec![1, 2, head + 1], None));
    // The fork still sees the entries it shares.
    assert_eq!(
        seqs(&s.ok("GET", "/v1/sessions/other/log", None, 200))[..4],
        [1, 2, 3, 4]
    );
    // Verify: ok; then a changed row is named.
    let v = s.ok("GET", "/v1/sessions/agent/verify", None, 200);
    assert_eq!(
        (v["ok"].as_bool(), v["entries"].as_u64()),
        (Some(true), Some(head + 1)),
        "{v}"
    );
    let db = rusqlite::Connection::open(home.path().join("state.db")).unwrap();
    db.execute(
        "UPDATE session_entries SET content = 'changed' WHERE session_id = ?1 AND seq = 1",
        [&id],
    )
    .unwrap();
    let v = s.ok("GET", "/v1/sessions/agent/verify", None, 200);
    assert_eq!(
        (v["ok"].as_bool(), v["first_bad"]["seq"].as_u64()),
        (Some(false), Some(1)),
        "{v}"
    );
    // Listing, filtered by state and paged.
    let all = s.ok("GET", "/v1/sessions?limit=1", None, 200);
    assert_eq!(all["items"][0]["id"], id.as_str());
    let rest = s.ok("GET", &format!("/v1/sessions?after={id}"), None, 200);
    assert_eq!(rest["items"][0]["name"], "other");
    // Close: the sandboxes go, the log stays; purge deletes it (forks first).
    let (status, v) = s.call("DELETE", "/v1/sessions/agent?purge=true", None);
    assert_eq!(status, 409, "a session with forks keeps its log: {v}");
    s.ok("DELETE", "/v1/sessions/other?purge=true", None, 204);
    s.ok("DELETE", "/v1/sessions/agent", None, 204);
    let closed = s.ok("GET", "/v1/sessions/agent", None, 200);
    assert_eq!(closed["state"], "closed");
    assert_eq!(
        seqs(&s.ok("GET", "/v1/sessions/agent/log?tail=1", None, 200)),
        [head + 1]
    );
    s.ok("DELETE", "/v1/sessions/agent?purge=true", None, 204);
    s.ok("GET", "/v1/sessions/agent", None, 404);
    assert!(home.ps().is_empty(), "{:?}", home.ps());
    // The event stream saw the session's life.
    drop(s);
    let mut text = String::new();
    let mut events = events;
    events.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = events.read_to_string(&mut text);
    for kind in [
        "session.created",
        "session.exec",
        "session.suspended",
        "session.resumed",
        "session.forked",
        "session.rewound",
        "session.closed",
    ] {
        assert!(text.contains(&format!("event: {kind}")), "{kind} in {text}");
    }
}

#[test]
fn a_client_that_leaves_a_streamed_exec_still_gets_its_result_recorded() {
    if skip("a_client_that_leaves_a_streamed_exec_still_gets_its_result_recorded") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home);
    s.ok("POST", "/v1/sessions", Some(json!({ "name": "leaver" })), 201);
    let mut conn = UnixStream::connect(&s.socket).unwrap();
    let body = json!({ "argv": ["sh", "-c", "echo start; sleep 1; echo finished > /done; echo end"] }).to_string();
    write!(
        conn,
        "POST /v1/sessions/leaver/exec/stream HTTP/1.1\r\nHost: cairn\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = conn.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // While it runs, the session is busy: a suspend is refused, not queued.
    let (status, v) = s.call("POST", "/v1/sessions/leaver/suspend", None);
    assert_eq!(status, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("busy"), "{v}");
    drop(conn);
    // The command runs to its end and the log gets its result.
    let deadline = Instant::now() + Duration::from_secs(30);
    let last = loop {
        let tail = s.ok("GET", "/v1/sessions/leaver/log?tail=1", None, 200);
        if tail["entries"][0]["kind"] == "tool_result" || Instant::now() > deadline {
            break tail["entries"][0].clone();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        (last["kind"].as_str(), last["exit_status"].as_i64()),
        (Some("tool_result"), Some(0)),
        "{last}"
    );
    let result: Value = serde_json::from_str(last["result"].as_str().unwrap()).unwrap();
    assert_eq!(result["stdout"], "start\nend\n");
    let r = s.ok(
        "POST",
        "/v1/sessions/leaver/exec",
        Some(json!({ "argv": ["cat", "/done"] })),
        200,
    );
    assert_eq!(r["stdout"], "finished\n");
    // Once it ended, the suspend goes through.
    s.ok("POST", "/v1/sessions/leaver/suspend", None, 200);
}

#[test]
fn bad_session_requests_get_one_error_shape_and_change_nothing() {
    if skip("bad_session_requests_get_one_error_shape_and_change_nothing") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home);
    s.ok("POST", "/v1/sessions", Some(json!({ "name": "calm" })), 201);
    let mut seen = Vec::new();
    let mut expect = |status: u16, method: &str, path: &str, body: Option<Value>, says: &str| {
        let (got, v) = s.call(method, path, body);
        assert_eq!(got, status, "{method} {path}: {v}");
        let code = v["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("not the error shape: {v}"));
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(says),
            "{method} {path}: {message:?} should say {says:?}"
        );
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
        seen.push(code.to_string());
    };
    // Unknown sessions.
    expect(404, "GET", "/v1/sessions/nosuchsession", None, "nosuchsession");
    expect(404, "GET", "/v1/sessions/nosuchsession/log", None, "nosuchsession");
    expect(
        404,
        "POST",
        "/v1/sessions/nosuchsession/exec",
        Some(json!({ "argv": ["true"] })),
        "nosuchsession",
    );
    expect(404, "POST", "/v1/sessions/nosuchsession/suspend", None, "nosuchsession");
    expect(404, "DELETE", "/v1/sessions/nosuchsession", None, "nosuchsession");
    // Bad entries.
    let append_to = "/v1/sessions/calm/entries";
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "gossip" })),
        "kind must be",
    );
    expect(400, "POST", append_to, Some(json!({ "kind": "recovered" })), "Cairn's");
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "user", "role": "boss" })),
        "role must be",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "seq": 9 })),
        "seq is Cairn's",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "hash": "00" })),
        "hash is Cairn's",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "content_ref": "x" })),
        "content_ref",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "mood": "x" })),
        "mood",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "content": "a\u{0}b" })),
        "NUL",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "tool_call", "tool": "" })),
        "tool must be",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "tokens_in": 1u64 << 60 })),
        "tokens_in",
    );
    expect(
        400,
        "POST",
        append_to,
        Some(json!({ "kind": "note", "exit_status": "zero" })),
        "invalid type",
    );
    // Bad creates, execs, log reads, forks.
    expect(
        400,
        "POST",
        "/v1/sessions",
        Some(json!({ "name": "no spaces" })),
        "invalid session name",
    );
    expect(
        400,
        "POST",
        "/v1/sessions",
        Some(json!({ "idle_timeout_ms": 5 })),
        "idle_timeout_ms",
    );
    expect(
        409,
        "POST",
        "/v1/sessions",
        Some(json!({ "name": "calm" })),
        "already exists",
    );
    expect(
        400,
        "POST",
        "/v1/sessions/calm/exec",
        Some(json!({ "argv": [] })),
        "argv",
    );
    expect(
        400,
        "POST",
        "/v1/sessions/calm/exec",
        Some(json!({ "argv": ["ls"], "stdin": "x" })),
        "stdin",
    );
    expect(
        400,
        "POST",
        "/v1/sessions/calm/exec",
        Some(json!({ "argv": ["ls"], "env": { "A=B": "c" } })),
        "env names",
    );
    expect(
        400,
        "POST",
        "/v1/sessions/calm/exec",
        Some(json!({ "argv": ["ls"], "timeout_secs": -1 })),
        "timeout_secs",
    );
    expect(400, "GET", "/v1/sessions/calm/log?tail=5&from=1", None, "tail alone");
    expect(
        400,
        "GET",
        "/v1/sessions/calm/log?before=5&from=1",
        None,
        "before and limit",
    );
    expect(
        400,
        "GET",
        "/v1/sessions/calm/log?before=0",
        None,
        "before counts entries from 1",
    );
    expect(
        400,
        "GET",
        "/v1/sessions/calm/log?limit=100000",
        None,
        "limit must be 1 to 1000",
    );
    expect(400, "GET", "/v1/sessions/calm/log?from=-1", None, "invalid query");
    expect(400, "GET", "/v1/sessions?state=sleepy", None, "state must be");
    expect(
        400,
        "POST",
        "/v1/sessions/calm/fork",
        Some(json!({ "at": 0, "reason": " " })),
        "reason",
    );
    expect(
        404,
        "POST",
        "/v1/sessions/calm/fork",
        Some(json!({ "at": 7, "reason": "x" })),
        "no entry 7",
    );
    expect(
        404,
        "POST",
        "/v1/sessions/calm/rewind",
        Some(json!({ "to": 7 })),
        "no entry 7",
    );
    // Wrong states.
    expect(409, "POST", "/v1/sessions/calm/resume", None, "already running");
    expect(
        409,
        "POST",
        "/v1/sessions/calm/rewind",
        Some(json!({ "to": 0 })),
        "nothing to rewind",
    );
    s.ok("POST", "/v1/sessions/calm/suspend", None, 200);
    expect(409, "POST", "/v1/sessions/calm/suspend", None, "only an active session");
    s.ok("DELETE", "/v1/sessions/calm", None, 204);
    expect(409, "POST", append_to, Some(json!({ "kind": "note" })), "read-only");
    expect(
        409,
        "POST",
        "/v1/sessions/calm/exec",
        Some(json!({ "argv": ["true"] })),
        "fork it",
    );
    // A body above 4 MiB: 413, in the same shape.
    let big = json!({ "kind": "note", "content": "x".repeat(5 << 20) }).to_string();
    let (status, bytes) = s.raw("POST", "/v1/sessions/calm/entries", &[], big.as_bytes());
    let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&bytes)));
    assert_eq!((status, v["error"]["code"].as_str()), (413, Some("too_large")), "{v}");
    // Nothing was appended by any of it; the chain is whole.
    let calm = s.ok("GET", "/v1/sessions/calm", None, 200);
    let log = s.ok("GET", "/v1/sessions/calm/log", None, 200);
    assert_eq!(
        entries(&log)
            .iter()
            .map(|e| e["kind"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["note"],
        "only the suspend's note: {log}"
    );
    assert_eq!(calm["head_seq"], 1);
    assert_eq!(s.ok("GET", "/v1/sessions/calm/verify", None, 200)["ok"], true);
    assert_eq!(
        s.ok("GET", "/v1/sessions", None, 200)["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(
        seen.iter()
            .all(|c| ["not_found", "bad_request", "conflict"].contains(&c.as_str())),
        "{seen:?}"
    );
}

#[test]
fn a_suspend_overlapping_a_snapshot_of_the_sessions_sandbox_gets_409() {
    if skip("a_suspend_overlapping_a_snapshot_of_the_sessions_sandbox_gets_409") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home);
    let created = s.ok("POST", "/v1/sessions", Some(json!({ "name": "shared" })), 201);
    let sandbox = created["sandbox_id"].as_str().unwrap().to_string();
    // A snapshot of 300 MiB of new files through the sandbox routes takes
    // long enough for the suspend to arrive while it runs.
    s.ok(
        "POST",
        "/v1/sessions/shared/exec",
        Some(json!({ "argv": ["sh", "-c", "dd if=/dev/urandom of=/big bs=1M count=300 2>/dev/null"] })),
        200,
    );
    let (snapshot, suspend) = std::thread::scope(|scope| {
        let first = scope.spawn(|| s.call("POST", &format!("/v1/sandboxes/{sandbox}/snapshots"), Some(json!({}))));
        std::thread::sleep(Duration::from_millis(150));
        let second = s.call("POST", "/v1/sessions/shared/suspend", None);
        (first.join().unwrap(), second)
    });
    assert_eq!(snapshot.0, 201, "{}", snapshot.1);
    assert_eq!(suspend.0, 409, "{}", suspend.1);
    let message = suspend.1["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&sandbox) && message.contains("retry the session suspend"),
        "{message}"
    );
    // Nothing moved: the session is active in the same sandbox; now it suspends.
    let now = s.ok("GET", "/v1/sessions/shared", None, 200);
    assert_eq!(
        (now["state"].as_str(), now["sandbox_id"].as_str()),
        (Some("active"), Some(sandbox.as_str()))
    );
    assert_eq!(
        s.ok("POST", "/v1/sessions/shared/suspend", None, 200)["state"],
        "suspended"
    );
}

#[test]
fn files_messages_and_recovery_go_through_a_suspended_session() {
    if skip("files_messages_and_recovery_go_through_a_suspended_session") {
        return;
    }
    let home = Home::new();
    let server = Server::start(&home);
    let s = server.ok("POST", "/v1/sessions", Some(json!({ "name": "files" })), 201);
    let id = s["id"].as_str().unwrap().to_string();
    server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);

    // A write to a suspended session resumes it and is logged with its hash.
    let content = b"hello from the agent\n";
    let (status, body) = server.raw(
        "PUT",
        &format!("/v1/sessions/{id}/files?path=/notes.txt&mode=600"),
        &[],
        content,
    );
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let stat: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((stat["size"].as_u64(), stat["mode"].as_u64()), (Some(21), Some(0o600)));
    assert_eq!(
        server.ok("GET", &format!("/v1/sessions/{id}"), None, 200)["state"],
        "active"
    );
    let log = server.ok("GET", &format!("/v1/sessions/{id}/log?tail=2"), None, 200);
    let tail = entries(&log);
    assert_eq!(
        (tail[0]["kind"].as_str(), tail[0]["tool"].as_str()),
        (Some("tool_call"), Some("write_file"))
    );
    assert_eq!(tail[0]["arguments"]["path"], "/notes.txt");
    let result: Value = serde_json::from_str(tail[1]["result"].as_str().unwrap()).unwrap();
    assert_eq!(result["blake3"], blake3::hash(content).to_hex().as_str());
    assert_eq!(result["call"], tail[0]["seq"]);

    // A read of a suspended session resumes it too, and is not logged.
    server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);
    let head = server.ok("GET", &format!("/v1/sessions/{id}"), None, 200)["head_seq"].clone();
    let (status, body) = server.raw("GET", &format!("/v1/sessions/{id}/files?path=/notes.txt"), &[], b"");
    assert_eq!((status, body.as_slice()), (200, content.as_slice()));
    let now = server.ok("GET", &format!("/v1/sessions/{id}"), None, 200);
    assert_eq!((now["state"].as_str(), &now["head_seq"]), (Some("active"), &head));
    let (status, missing) = server.call("GET", &format!("/v1/sessions/{id}/files?path=/nope"), None);
    assert_eq!(status, 404, "{missing}");
    let (status, relative) = server.call("GET", &format!("/v1/sessions/{id}/files?path=notes.txt"), None);
    assert_eq!(status, 400, "{relative}");
    // A FIFO or a link on the way is an error answer, opened in the sandbox
    // first: never a download that hangs or follows the link.
    server.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["sh", "-c", "mkfifo /fifo && ln -s / /up"] })),
        200,
    );
    let (status, fifo) = server.call("GET", &format!("/v1/sessions/{id}/files?path=/fifo"), None);
    assert!(status == 400 && fifo.to_string().contains("FIFO"), "{status} {fifo}");
    let (status, up) = server.call("GET", &format!("/v1/sessions/{id}/files?path=/up/etc/passwd"), None);
    assert!(
        (400..500).contains(&status) && up.to_string().contains("symbolic link"),
        "{status} {up}"
    );

    // A user message to a suspended session resumes it; an assistant's does not.
    server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);
    server.ok(
        "POST",
        &format!("/v1/sessions/{id}/entries"),
        Some(json!({ "kind": "assistant", "role": "assistant", "content": "thinking" })),
        201,
    );
    assert_eq!(
        server.ok("GET", &format!("/v1/sessions/{id}"), None, 200)["state"],
        "suspended"
    );
    server.ok(
        "POST",
        &format!("/v1/sessions/{id}/entries"),
        Some(json!({ "kind": "user", "role": "user", "content": "next step" })),
        201,
    );
    assert_eq!(
        server.ok("GET", &format!("/v1/sessions/{id}"), None, 200)["state"],
        "active"
    );

    // Exec with an environment, a working directory and a timeout.
    let r = server.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo $X; pwd"], "env": { "X": "y" }, "cwd": "/tmp" })),
        200,
    );
    assert_eq!(r["stdout"], "y\n/tmp\n");
    let r = server.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["sleep", "5"], "timeout_secs": 0.2 })),
        200,
    );
    assert_eq!(r["exit_code"], 124);

    // Recovery: nothing to replay while the sandbox runs; after its init is
    // killed, recover restores the snapshot and replays the lost call.
    server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);
    server.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo lost >> /trail"] })),
        200,
    );
    let (status, refused) = server.call(
        "POST",
        &format!("/v1/sessions/{id}/recover"),
        Some(json!({ "replay": true })),
    );
    assert_eq!(status, 409, "{refused}");
    let sandbox = server.ok("GET", &format!("/v1/sessions/{id}"), None, 200)["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(common::init_pid(&home, &sandbox)),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let r = server.ok(
        "POST",
        &format!("/v1/sessions/{id}/recover"),
        Some(json!({ "replay": true })),
        200,
    );
    assert!(r["recovered"]["seq"].is_u64(), "{r}");
    assert_eq!(r["replayed"].as_array().unwrap().len(), 1, "{r}");
    assert!(r["stopped"].is_null(), "{r}");
    let r = server.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["cat", "/trail", "/notes.txt"] })),
        200,
    );
    assert_eq!(r["stdout"], "lost\nhello from the agent\n");
    let v = server.ok("GET", &format!("/v1/sessions/{id}/verify"), None, 200);
    assert_eq!(v["ok"], true);
}

#[test]
fn a_session_exported_through_one_server_resumes_in_another() {
    if skip("a_session_exported_through_one_server_resumes_in_another") {
        return;
    }
    let (home, other) = (Home::new(), Home::new());
    let (here, there) = (Server::start(&home), Server::start(&other));
    let s = here.ok("POST", "/v1/sessions", Some(json!({ "name": "traveller" })), 201);
    let id = s["id"].as_str().unwrap().to_string();
    here.ok(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo packed > /bag"] })),
        200,
    );
    let (status, bundle) = here.raw("GET", &format!("/v1/sessions/{id}/export"), &[], b"");
    assert_eq!(status, 200);
    assert_eq!(&bundle[..8], b"CAIRNSES");
    let original = here.ok("GET", &format!("/v1/sessions/{id}/log?tail=100"), None, 200);

    let (status, body) = there.raw("POST", "/v1/sessions/import?name=arrived", &[], &bundle);
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let done: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (done["session"]["state"].as_str(), done["source_id"].as_str()),
        (Some("suspended"), Some(id.as_str()))
    );
    let new = done["session"]["id"].as_str().unwrap().to_string();
    let imported = there.ok("GET", &format!("/v1/sessions/{new}/log?tail=100"), None, 200);
    assert_eq!(seqs(&imported), seqs(&original));
    let hashes = |v: &Value| entries(v).iter().map(|e| e["hash"].clone()).collect::<Vec<_>>();
    assert_eq!(hashes(&imported), hashes(&original));
    let r = there.ok(
        "POST",
        &format!("/v1/sessions/{new}/exec"),
        Some(json!({ "argv": ["cat", "/bag"] })),
        200,
    );
    assert_eq!(r["stdout"], "packed\n");

    // Damaged, foreign and name-taken bundles are refused and record nothing.
    let before = there.ok("GET", "/v1/sessions", None, 200)["items"]
        .as_array()
        .unwrap()
        .len();
    let mut damaged = bundle.clone();
    // A byte inside the last object's content (its tar header starts with its name).
    let header = damaged.windows(8).rposition(|w| w == b"objects/").unwrap();
    damaged[header + 512 + 5] ^= 0xff;
    let (status, body) = there.raw("POST", "/v1/sessions/import?name=damaged", &[], &damaged);
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    let (status, _) = there.raw("POST", "/v1/sessions/import", &[], b"not a bundle at all");
    assert_eq!(status, 400);
    let (status, _) = there.raw("POST", "/v1/sessions/import?name=arrived", &[], &bundle);
    assert_eq!(status, 409);
    let after = there.ok("GET", "/v1/sessions", None, 200)["items"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(before, after);
    let (status, _) = here.call("GET", "/v1/sessions/nosuch/export", None);
    assert_eq!(status, 404);
}

#[test]
fn a_server_killed_while_resuming_loses_no_entry_and_leaves_no_sandbox() {
    if skip("a_server_killed_while_resuming_loses_no_entry_and_leaves_no_sandbox") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["session", "create", "--name", "resumed"]).trim().to_string();
    let delays = [0u64, 5, 15, 30, 60, 120];
    for (i, delay) in delays.into_iter().enumerate() {
        home.ok(&["session", "exec", &id, "--", "sh", "-c", &format!("echo {i} > /r-{i}")]);
        home.ok(&["session", "suspend", &id]);
        let server = Server::start(&home);
        // The server resumes the session for this request and is killed mid-way.
        let socket = server.socket.clone();
        let path = format!("/v1/sessions/{id}/resume");
        let request = std::thread::spawn(move || {
            if let Ok(mut conn) = UnixStream::connect(&socket) {
                let _ = conn.write_all(
                    format!("POST {path} HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                        .as_bytes(),
                );
                let _ = conn.read_to_end(&mut Vec::new());
            }
        });
        std::thread::sleep(Duration::from_millis(delay));
        drop(server);
        request.join().unwrap();
        // Whatever the kill left (suspended, resuming, active), the next
        // call gets the machine back with every file.
        let n = home.ok(&["session", "exec", &id, "--", "sh", "-c", "ls /r-* | wc -l"]);
        assert_eq!(n.trim(), (i + 1).to_string(), "after a kill at {delay} ms");
    }
    let log: Vec<Value> = home
        .ok(&["session", "log", &id, "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let calls = log.iter().filter(|e| e["kind"] == "tool_call").count();
    let results = log.iter().filter(|e| e["kind"] == "tool_result").count();
    assert_eq!((calls, results), (12, 12), "every call and result is in the log");
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
    // A sandbox a killed resume made but never recorded was replaced, not left.
    let running: Vec<Value> = serde_json::from_str(&home.ok(&["ps", "--json"])).unwrap();
    let session: Value = serde_json::from_str(&home.ok(&["session", "show", &id, "--json"])).unwrap();
    assert_eq!(
        running.iter().map(|s| s["id"].clone()).collect::<Vec<_>>(),
        [session["sandbox_id"].clone()]
    );
}

/// The sandboxes named for session `id`, as (id, state).
fn session_sandboxes(server: &Server, id: &str) -> Vec<(String, String)> {
    let page = server.ok("GET", "/v1/sandboxes?limit=1000", None, 200);
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == format!("session-{id}").as_str())
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_string(),
                s["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Waits until `pred` holds of session `id`'s sandboxes; answers them.
fn wait_for_sandboxes(
    server: &Server,
    id: &str,
    what: &str,
    pred: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = session_sandboxes(server, id);
        if pred(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: session {id}'s sandboxes are {now:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for the one sandbox named for session `id` to be prepared
/// (created and waiting); answers its id.
fn wait_for_prepared(server: &Server, id: &str, what: &str) -> String {
    let ready = wait_for_sandboxes(server, id, what, |s| s.len() == 1 && s[0].1 == "creating");
    ready[0].0.clone()
}

/// A new session `name` on the gvisor driver, as the server answers it.
fn gvisor_session(server: &Server, name: &str) -> Value {
    server.ok(
        "POST",
        "/v1/sessions",
        Some(json!({ "name": name, "driver": "gvisor" })),
        201,
    )
}

#[test]
fn a_suspended_gvisor_session_resumes_into_a_sandbox_prepared_at_its_suspend() {
    let name = "a_suspended_gvisor_session_resumes_into_a_sandbox_prepared_at_its_suspend";
    if common::skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    let server = Server::start(&home);
    let s = gvisor_session(&server, "warm");
    let id = s["id"].as_str().unwrap().to_string();
    // A counter held only in a shell's memory, written out as it moves.
    let sandbox = s["sandbox_id"].as_str().unwrap().to_string();
    home.sh_detached(
        &sandbox,
        "n=0; while true; do n=$((n+1)); echo $n > /tmp/count.new && mv /tmp/count.new /tmp/count; sleep 0.05; done",
    );
    let count = || -> u64 {
        let r = server.ok(
            "POST",
            &format!("/v1/sessions/{id}/exec"),
            Some(json!({ "argv": ["sh", "-c", "sleep 0.3; cat /tmp/count"] })),
            200,
        );
        r["stdout"]
            .as_str()
            .unwrap()
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{r}"))
    };
    let mut last = count();
    assert!(last > 0);
    for cycle in 1..=3 {
        server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);
        // The server makes the resume's sandbox ahead: named for the
        // session, created and waiting.
        let ready = wait_for_prepared(&server, &id, "after the suspend");
        let resumed = server.ok("POST", &format!("/v1/sessions/{id}/resume"), None, 200);
        assert_eq!(
            resumed["sandbox_id"].as_str(),
            Some(ready.as_str()),
            "resume {cycle} did not go into the sandbox prepared ahead: {resumed}"
        );
        assert_eq!(
            session_sandboxes(&server, &id),
            [(ready.clone(), "running".to_string())]
        );
        // The shell and its counter went on from where they were.
        let now = count();
        assert!(now > last, "after resume {cycle} the counter is {now}, was {last}");
        last = now;
    }
    // A suspended session that moves on (closed here) loses its prepared
    // sandbox within the idle timer's round.
    server.ok("POST", &format!("/v1/sessions/{id}/suspend"), None, 200);
    wait_for_prepared(&server, &id, "after the last suspend");
    server.ok("DELETE", &format!("/v1/sessions/{id}"), None, 204);
    wait_for_sandboxes(&server, &id, "after the close", |s| s.is_empty());

    // A server killed while one waits leaves it to the next command,
    // which removes it (its owner is dead); the session resumes the
    // ordinary way.
    let s = gvisor_session(&server, "killed");
    let killed = s["id"].as_str().unwrap().to_string();
    server.ok("POST", &format!("/v1/sessions/{killed}/suspend"), None, 200);
    let ready = wait_for_prepared(&server, &killed, "before the kill");
    drop(server);
    home.ok(&["session", "resume", &killed]);
    let show: Value = serde_json::from_str(&home.ok(&["session", "show", &killed, "--json"])).unwrap();
    assert_ne!(show["sandbox_id"].as_str(), Some(ready.as_str()), "{show}");
    let left: Vec<String> = home
        .ps()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert!(
        !left.contains(&ready),
        "the killed server's prepared sandbox is still there: {left:?}"
    );
    home.ok(&["session", "rm", &killed]);

    // With --session-warm 0, nothing is made ahead and resumes restore.
    let server = Server::start_with(&home, &["--session-warm", "0"]);
    let s = gvisor_session(&server, "cold");
    let cold = s["id"].as_str().unwrap().to_string();
    server.ok("POST", &format!("/v1/sessions/{cold}/suspend"), None, 200);
    std::thread::sleep(Duration::from_secs(2));
    assert!(session_sandboxes(&server, &cold).is_empty());
    let resumed = server.ok("POST", &format!("/v1/sessions/{cold}/resume"), None, 200);
    assert!(resumed["sandbox_id"].is_string(), "{resumed}");
    server.ok("DELETE", &format!("/v1/sessions/{cold}"), None, 204);
}
