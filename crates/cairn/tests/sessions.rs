//! End-to-end: agent sessions on real native sandboxes.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{init_pid, skip, stdout, Home};

fn log(home: &Home, id: &str) -> Vec<serde_json::Value> {
    home.ok(&["session", "log", id, "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn show(home: &Home, id: &str) -> serde_json::Value {
    serde_json::from_str(&home.ok(&["session", "show", id, "--json"])).unwrap()
}

fn create(home: &Home, name: &str) -> String {
    home.ok(&["session", "create", "--name", name, "--idle", "5m"])
        .trim()
        .to_string()
}

#[test]
fn fifty_suspend_resume_cycles_keep_every_file() {
    if skip("fifty_suspend_resume_cycles_keep_every_file") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "cycles");
    assert_eq!(show(&home, &id)["idle_timeout_ms"], 300_000);
    for i in 0..50 {
        home.ok(&[
            "session",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &format!("echo {i} > /cycle-{i}"),
        ]);
        home.ok(&["session", "suspend", &id]);
        assert_eq!(show(&home, &id)["state"], "suspended");
        home.ok(&["session", "resume", &id]);
    }
    let out = home.ok(&["session", "exec", &id, "--", "sh", "-c", "cat /cycle-* | wc -l"]);
    assert_eq!(out.trim(), "50");
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}

#[test]
fn exec_records_a_call_and_its_result() {
    if skip("exec_records_a_call_and_its_result") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "calls");
    let out = home.cairn(&[
        "session",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(stdout(&out), "out\n");
    let entries = log(&home, &id);
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["kind"], "tool_call");
    assert_eq!(entries[0]["seq"], 1);
    assert!(entries[0]["arguments"].as_str().unwrap().contains("echo out"));
    assert_eq!(entries[1]["kind"], "tool_result");
    assert_eq!(entries[1]["exit_status"], 3);
    let result: serde_json::Value = serde_json::from_str(entries[1]["result"].as_str().unwrap()).unwrap();
    assert_eq!(result["stdout"], "out\n");
    assert_eq!(result["stderr"], "err\n");
    // A big message goes to the chunk store and reads back whole.
    let big = "x".repeat(100_000);
    home.ok(&["session", "append", &id, "--role", "user", "--content", &big]);
    let tail = home.ok(&["session", "log", &id, "--tail", "1", "--json"]);
    let e: serde_json::Value = serde_json::from_str(tail.trim()).unwrap();
    assert_eq!(e["seq"], 3);
    assert_eq!(e["content"].as_str().unwrap().len(), 100_000);
    assert!(e["content_ref"].is_string());
    home.ok(&["gc"]);
    assert_eq!(log(&home, &id)[2]["content"].as_str().unwrap().len(), 100_000);
    // Environment, working directory and timeout run and are recorded.
    let out = home.ok(&[
        "session",
        "exec",
        &id,
        "-e",
        "GREETING=hi",
        "-w",
        "/tmp",
        "--timeout",
        "30",
        "--",
        "sh",
        "-c",
        "echo $GREETING; pwd",
    ]);
    assert_eq!(out, "hi\n/tmp");
    let call = &log(&home, &id)[3];
    let args: serde_json::Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["env"], serde_json::json!([["GREETING", "hi"]]));
    assert_eq!(
        (&args["cwd"], &args["timeout_ms"]),
        (&serde_json::json!("/tmp"), &serde_json::json!(30000))
    );
    let timed_out = home.cairn(&["session", "exec", &id, "--timeout", "0.2", "--", "sleep", "5"]);
    assert_eq!(timed_out.status.code(), Some(124));
    let stdin = home.cairn(&["session", "exec", &id, "-i", "--", "cat"]);
    assert!(!stdin.status.success() && common::stderr(&stdin).contains("no stdin"));
}

#[test]
fn verify_names_a_tampered_entry() {
    if skip("verify_names_a_tampered_entry") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "tamper");
    for text in ["one", "two", "three"] {
        home.ok(&["session", "append", &id, "--role", "user", "--content", text]);
    }
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: 3 entries"));
    let db = rusqlite::Connection::open(home.path().join("state.db")).unwrap();
    db.execute(
        "UPDATE session_entries SET content = 'TWO' WHERE session_id = ?1 AND seq = 2",
        [&id],
    )
    .unwrap();
    let out = home.cairn(&["session", "verify", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("entry 2 is tampered"), "{}", stdout(&out));
    db.execute("DELETE FROM session_entries WHERE session_id = ?1 AND seq = 2", [&id])
        .unwrap();
    assert!(stdout(&home.cairn(&["session", "verify", &id])).contains("entry 2 is missing"));
}

#[test]
fn fork_diverges_in_log_and_files_and_rewind_keeps_abandoned_entries() {
    if skip("fork_diverges_in_log_and_files_and_rewind_keeps_abandoned_entries") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "parent");
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo a > /a"]); // 1, 2
    home.ok(&["session", "suspend", &id]); // 3: the snapshot
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo b > /b"]); // 4, 5
    let child = home
        .ok(&[
            "session",
            "fork",
            &id,
            "--at",
            "3",
            "--reason",
            "try another way",
            "--name",
            "child",
        ])
        .trim()
        .to_string();
    home.ok(&["session", "exec", &child, "--", "sh", "-c", "echo c > /c"]); // 4, 5 in the child
    let files = |s: &str| home.ok(&["session", "exec", s, "--", "sh", "-c", "ls /a /b /c 2>/dev/null; true"]);
    assert_eq!(files(&id), "/a\n/b");
    assert_eq!(files(&child), "/a\n/c");
    let (p, c) = (log(&home, &id), log(&home, &child));
    assert_eq!(p[..3], c[..3]);
    assert!(p[3]["arguments"].as_str().unwrap().contains("/b"));
    assert!(c[3]["arguments"].as_str().unwrap().contains("/c"));
    assert_eq!(show(&home, &child)["parent_id"], id.as_str());
    assert_eq!(show(&home, &child)["fork_reason"], "try another way");
    assert!(home.ok(&["session", "verify", &child]).starts_with("ok: "));

    // Rewind the parent to 3: 4.. leave the live log but stay stored.
    let before = log(&home, &id).len();
    home.ok(&["session", "rewind", &id, "--to", "3"]);
    let live = log(&home, &id);
    assert_eq!(live.len(), 3);
    let seq = home.ok(&["session", "append", &id, "--role", "user", "--content", "after"]);
    assert_eq!(seq.trim().parse::<usize>().unwrap(), before + 1);
    assert_eq!(log(&home, &id).len(), 4);
    assert!(home
        .ok(&["session", "verify", &id])
        .starts_with(&format!("ok: {} entries", before + 1)));
    // The fork was made before the rewind: its shared entries stay live.
    assert_eq!(log(&home, &child).len(), c.len());
    let err = home.cairn(&["session", "fork", &id, "--at", "4", "--reason", "x"]);
    assert!(!err.status.success(), "an abandoned entry cannot be forked from");

    // A fork of the fork, at an entry the child shares with the parent.
    let grandchild = home
        .ok(&["session", "fork", &child, "--at", "2", "--reason", "earlier"])
        .trim()
        .to_string();
    home.ok(&[
        "session",
        "append",
        &grandchild,
        "--role",
        "assistant",
        "--content",
        "g",
    ]);
    let g = log(&home, &grandchild);
    assert_eq!(g[..2], p[..2]);
    assert_eq!(
        (g.len(), &g[2]["seq"], &g[2]["content"]),
        (3, &serde_json::json!(3), &serde_json::json!("g"))
    );
    assert!(home
        .ok(&["session", "verify", &grandchild])
        .starts_with("ok: 3 entries"));
    // Its files are the image's: no snapshot at or before entry 2.
    assert_eq!(files(&grandchild), "");
    // The lineage as a tree: each fork under its parent, with its reason.
    let tree = home.ok(&["session", "ls", "--tree"]);
    let depth = |needle: &str| {
        let l = tree
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle} in {tree}"));
        l.find(|c: char| c.is_ascii_alphanumeric()).unwrap()
    };
    assert!(
        depth(&id) < depth(&child) && depth(&child) < depth(&grandchild),
        "{tree}"
    );
    assert!(tree.contains("forked at 3: try another way"), "{tree}");
    assert!(tree.contains("forked at 2: earlier"), "{tree}");
    let purge = home.cairn(&["session", "rm", &child, "--purge"]);
    assert!(!purge.status.success(), "a session with forks keeps its log");
}

#[test]
fn a_killed_sandbox_is_recovered_naming_the_lost_calls() {
    if skip("a_killed_sandbox_is_recovered_naming_the_lost_calls") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "recover");
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo kept > /kept"]); // 1, 2
    home.ok(&["session", "suspend", &id]); // 3
    home.ok(&["session", "resume", &id]);
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo lost > /lost"]); // 4, 5
    let sandbox = show(&home, &id)["sandbox_id"].as_str().unwrap().to_string();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init_pid(&home, &sandbox)),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let out = home.ok(&[
        "session",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "ls /kept /lost 2>/dev/null; true",
    ]);
    assert_eq!(out, "/kept");
    let entries = log(&home, &id);
    let recovered = entries
        .iter()
        .find(|e| e["kind"] == "recovered")
        .expect("a recovered entry");
    assert_eq!(recovered["seq"], 6);
    let detail: serde_json::Value = serde_json::from_str(recovered["result"].as_str().unwrap()).unwrap();
    assert_eq!(detail["lost_calls"], serde_json::json!([4]));
    assert_eq!(detail["snapshot_seq"], 3);
    assert_eq!(detail["dead_sandbox"], sandbox.as_str());
    assert_ne!(show(&home, &id)["sandbox_id"], sandbox.as_str());
}

#[test]
fn a_suspend_killed_midway_leaves_a_session_that_resumes() {
    if skip("a_suspend_killed_midway_leaves_a_session_that_resumes") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "killed");
    for (i, delay) in [0u64, 20, 60, 120, 250, 500].into_iter().enumerate() {
        home.ok(&["session", "exec", &id, "--", "sh", "-c", &format!("echo {i} > /k-{i}")]);
        let mut child = home
            .command(&["session", "suspend", &id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill();
        let _ = child.wait();
        if show(&home, &id)["state"] != "active" {
            home.ok(&["session", "resume", &id]);
        }
        assert_eq!(show(&home, &id)["state"], "active");
        let n = home.ok(&["session", "exec", &id, "--", "sh", "-c", "ls /k-* | wc -l"]);
        assert_eq!(n.trim(), (i + 1).to_string(), "after a kill at {delay}ms");
    }
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
    home.ok(&["session", "rm", &id]);
    assert_eq!(show(&home, &id)["state"], "closed");
    home.ok(&["session", "rm", &id, "--purge"]);
    assert!(!home.cairn(&["session", "show", &id]).status.success());
}

/// A `cairn serve` on the home, for its idle timer; killed when dropped.
struct Server(std::process::Child);

impl Server {
    fn start(home: &Home) -> Server {
        use std::io::BufRead;
        let mut child = home
            .command(&["serve"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the server says where it serves").unwrap();
            if line.starts_with("cairn: serving on") {
                break;
            }
        }
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Server(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits (up to 30 s) for the session to reach `state`.
fn wait_for(home: &Home, id: &str, state: &str) {
    for _ in 0..300 {
        if show(home, id)["state"] == state {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("session {id} never became {state}: {}", show(home, id));
}

fn count(entries: &[serde_json::Value], kind: &str) -> usize {
    entries.iter().filter(|e| e["kind"] == kind).count()
}

#[test]
fn the_server_suspends_an_idle_session_and_the_next_call_resumes_it() {
    if skip("the_server_suspends_an_idle_session_and_the_next_call_resumes_it") {
        return;
    }
    let home = Home::new();
    let id = home
        .ok(&["session", "create", "--name", "idle", "--idle", "1s"])
        .trim()
        .to_string();
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo kept > /kept"]);
    let _server = Server::start(&home);
    wait_for(&home, &id, "suspended");
    assert!(
        show(&home, &id)["sandbox_id"].is_null(),
        "a suspended session has no sandbox"
    );

    // A user message resumes it, so the machine is ready for the answer.
    home.ok(&["session", "append", &id, "--role", "user", "--content", "go on"]);
    assert_eq!(show(&home, &id)["state"], "active");
    wait_for(&home, &id, "suspended");
    // Other entries are only logged.
    home.ok(&["session", "append", &id, "--role", "assistant", "--content", "noted"]);
    assert_eq!(show(&home, &id)["state"], "suspended");

    // An exec resumes it transparently: the caller sees only its output.
    assert_eq!(home.ok(&["session", "exec", &id, "--", "cat", "/kept"]), "kept");

    // A command running past the idle timeout keeps the session: it is
    // never suspended under the command, and suspend is refused meanwhile.
    let mut long = home
        .command(&["session", "exec", &id, "--", "sh", "-c", "sleep 4; echo done > /done"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let refused = home.cairn(&["session", "suspend", &id]);
    assert!(!refused.status.success(), "suspend while a command runs");
    assert!(
        common::stderr(&refused).contains("busy"),
        "{}",
        common::stderr(&refused)
    );
    for _ in 0..25 {
        assert_eq!(show(&home, &id)["state"], "active", "suspended under a running command");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(long.wait().unwrap().success());
    wait_for(&home, &id, "suspended");
    assert_eq!(home.ok(&["session", "exec", &id, "--", "cat", "/done"]), "done");
    let entries = log(&home, &id);
    assert!(
        entries
            .iter()
            .filter(|e| e["kind"] == "note" && e["content"].as_str().unwrap_or("").starts_with("suspended"))
            .count()
            >= 3,
        "each idle suspend records its snapshot"
    );
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}

#[test]
fn a_server_killed_while_suspending_loses_no_entry() {
    if skip("a_server_killed_while_suspending_loses_no_entry") {
        return;
    }
    let home = Home::new();
    let id = home
        .ok(&["session", "create", "--name", "crashy", "--idle", "1s"])
        .trim()
        .to_string();
    for (i, delay) in [900u64, 1000, 1100, 1200, 1400, 1700].into_iter().enumerate() {
        // The exec resumes whatever the last kill left (suspending, suspended or active).
        let n = home.ok(&[
            "session",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &format!("echo {i} > /k-{i}; ls /k-* | wc -l"),
        ]);
        assert_eq!(n.trim(), (i + 1).to_string(), "after a kill at {delay}ms");
        let server = Server::start(&home);
        std::thread::sleep(Duration::from_millis(delay));
        drop(server);
    }
    let _server = Server::start(&home);
    wait_for(&home, &id, "suspended");
    let n = home.ok(&["session", "exec", &id, "--", "sh", "-c", "ls /k-* | wc -l"]);
    assert_eq!(n.trim(), "6");
    let entries = log(&home, &id);
    assert_eq!(count(&entries, "tool_call"), 7, "every call is in the log");
    assert_eq!(count(&entries, "tool_result"), 7, "every result is in the log");
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}

#[test]
fn a_resume_killed_midway_leaves_a_session_that_resumes() {
    if skip("a_resume_killed_midway_leaves_a_session_that_resumes") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "resumes");
    for (i, delay) in [0u64, 5, 15, 30, 60, 120].into_iter().enumerate() {
        home.ok(&["session", "exec", &id, "--", "sh", "-c", &format!("echo {i} > /r-{i}")]);
        home.ok(&["session", "suspend", &id]);
        let mut child = home
            .command(&["session", "resume", &id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill();
        let _ = child.wait();
        // Whatever the kill left, the next exec gets the machine back.
        let n = home.ok(&["session", "exec", &id, "--", "sh", "-c", "ls /r-* | wc -l"]);
        assert_eq!(n.trim(), (i + 1).to_string(), "after a kill at {delay}ms");
        assert_eq!(show(&home, &id)["state"], "active");
    }
    // A sandbox a killed resume made but never recorded was replaced, not left.
    let sandboxes: Vec<_> = home.ps().into_iter().map(|s| s["id"].clone()).collect();
    assert_eq!(
        sandboxes,
        [show(&home, &id)["sandbox_id"].clone()],
        "only the session's sandbox"
    );
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}

#[test]
fn replay_reruns_the_lost_calls_and_stops_at_a_diverging_one() {
    if skip("replay_reruns_the_lost_calls_and_stops_at_a_diverging_one") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "replay");
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo 0 > /trail"]); // 1, 2
    home.ok(&["session", "suspend", &id]); // 3: the snapshot
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo 1 >> /trail"]); // 4, 5
    let four = home.cairn(&["session", "exec", &id, "--", "sh", "-c", "echo 2 >> /trail; exit 4"]); // 6, 7
    assert_eq!(four.status.code(), Some(4));
    // A call an agent logged itself, whose recorded status replay cannot match.
    home.ok(&[
        "session",
        "append",
        &id,
        "--json",
        r#"{"kind": "tool_call", "tool": "exec", "arguments": "{\"argv\": [\"sh\", \"-c\", \"echo 3 >> /trail\"]}"}"#,
    ]); // 8
    home.ok(&[
        "session",
        "append",
        &id,
        "--json",
        r#"{"kind": "tool_result", "tool": "exec", "exit_status": 9}"#,
    ]); // 9
    home.ok(&["session", "exec", &id, "--", "sh", "-c", "echo 4 >> /trail"]); // 10, 11

    // Nothing to replay while the sandbox runs and no recovery is recorded.
    let refused = home.cairn(&["session", "recover", &id, "--replay"]);
    assert!(!refused.status.success());
    assert!(common::stderr(&refused).contains("nothing to replay"));

    let sandbox = show(&home, &id)["sandbox_id"].as_str().unwrap().to_string();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init_pid(&home, &sandbox)),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let out = home.cairn(&["session", "recover", &id, "--replay", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "replay stopped early: {}",
        common::stderr(&out)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["recovered"]["seq"], 12);
    let replayed: Vec<(u64, i64)> = report["replayed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["call"].as_u64().unwrap(), r["status"].as_i64().unwrap()))
        .collect();
    assert_eq!(replayed, [(4, 0), (6, 4), (8, 0)], "in order, stopping at entry 8");
    assert!(report["stopped"].as_str().unwrap().contains("entry 8"));
    // Entry 10 was not run again: the machine holds what ran up to the divergence.
    assert_eq!(home.ok(&["session", "exec", &id, "--", "cat", "/trail"]), "0\n1\n2\n3");
    let entries = log(&home, &id);
    let replays: Vec<u64> = entries
        .iter()
        .filter_map(|e| {
            let args: serde_json::Value = serde_json::from_str(e["arguments"].as_str()?).ok()?;
            args["replay_of"].as_u64()
        })
        .collect();
    assert_eq!(replays, [4, 6, 8]);
    // Once calls ran on the restored machine, replay refuses.
    let again = home.cairn(&["session", "recover", &id, "--replay"]);
    assert!(!again.status.success());
    assert!(common::stderr(&again).contains("replay only follows a recovery"));
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}

#[test]
fn a_session_suspended_again_and_again_flattens_its_layers() {
    if skip("a_session_suspended_again_and_again_flattens_its_layers") {
        return;
    }
    let home = Home::new();
    let id = create(&home, "deep");
    let sh = |script: &str| home.ok(&["session", "exec", &id, "--", "sh", "-c", script]);
    sh("rm /bin/ls; mkdir /d; echo gone > /d/gone; echo keep > /keep");
    home.ok(&["session", "suspend", &id]);
    sh("rm -r /d");
    home.ok(&["session", "suspend", &id]);
    let layers = |home: &Home| -> usize {
        let snap = show(home, &id)["snapshot_id"].as_str().unwrap().to_string();
        let all: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
        let s = all
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == snap.as_str())
            .unwrap()
            .clone();
        s["layers"].as_array().unwrap().len()
    };
    let mut most = 0;
    for i in 0..110 {
        sh(&format!("echo {i} > /n"));
        home.ok(&["session", "suspend", &id]);
        most = most.max(layers(&home));
    }
    // Each suspend stacked a layer up to 100; the one that would have made
    // 101 was flattened to one instead.
    assert_eq!(most, 100, "the stack grew to the limit");
    assert!(layers(&home) < 20, "and was flattened: {}", layers(&home));
    // The flattened tree is the one the stack showed: deletions of image
    // files and of earlier layers' files stay deleted.
    assert_eq!(sh("ls /bin/ls /d 2>/dev/null; cat /keep /n"), "keep\n109");
    assert!(home.ok(&["session", "verify", &id]).starts_with("ok: "));
}
