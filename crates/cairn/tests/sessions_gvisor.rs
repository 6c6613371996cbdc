//! End-to-end: agent sessions on the gvisor driver, whose suspend keeps the
//! sandbox's memory and running processes.

mod common;

use common::{skip_without_runsc, Home};

/// An HTTP server in busybox sh: each request gets the shell's pid, a
/// nonce drawn once at its start and the count of requests served, all held
/// only in the shell's memory (one `nc -l` per request, the loop between
/// them). The count moves only when `nc` served: a restore interrupts the
/// `accept` it was blocked in (EINTR), and busybox nc gives up on that.
const COUNTER_SERVER: &str = "nonce=$RANDOM$RANDOM; i=0; while true; do n=$((i+1)); \
     printf 'HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n%s %s %s\\n' $$ $nonce $n \
     | nc -l -p 8080 >/dev/null 2>&1 && i=$n; done";

/// One request to the server from inside the session (retried while the
/// loop is between two `nc`s): (pid, nonce, counter).
fn request(home: &Home, session: &str, when: &str) -> (u64, u64, u64) {
    let out = home.cairn(&[
        "session",
        "exec",
        session,
        "--",
        "sh",
        "-c",
        "for t in $(seq 50); do wget -q -O - http://127.0.0.1:8080/ && exit 0; sleep 0.1; done; exit 1",
    ]);
    assert!(
        out.status.success(),
        "the server in session {session} did not answer {when}: {}{}",
        common::stdout(&out),
        common::stderr(&out)
    );
    let text = common::stdout(&out);
    let fields: Vec<u64> = text.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    assert_eq!(fields.len(), 3, "unexpected answer {when}: {text:?}");
    (fields[0], fields[1], fields[2])
}

fn sandbox_of(home: &Home, session: &str) -> String {
    let show: serde_json::Value = serde_json::from_str(&home.ok(&["session", "show", session, "--json"])).unwrap();
    show["sandbox_id"]
        .as_str()
        .expect("an active session has a sandbox")
        .to_string()
}

#[test]
fn a_background_server_keeps_its_memory_across_suspend_and_resume() {
    let name = "a_background_server_keeps_its_memory_across_suspend_and_resume";
    if skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    let session = home.ok(&["session", "create", "--driver", "gvisor", "--name", "server"]);
    home.sh_detached(&sandbox_of(&home, &session), COUNTER_SERVER);
    let (pid, nonce, first) = request(&home, &session, "before any suspend");
    assert_eq!(first, 1);
    assert_eq!(request(&home, &session, "before any suspend"), (pid, nonce, 2));
    // Two requests were served before the first suspend.
    for cycle in 1..=5u64 {
        let before = sandbox_of(&home, &session);
        home.ok(&["session", "suspend", &session]);
        home.ok(&["session", "resume", &session]);
        assert_ne!(
            sandbox_of(&home, &session),
            before,
            "resume {cycle} kept the old sandbox instead of restoring the snapshot"
        );
        let when = format!("after resume {cycle}");
        let (p, n, count) = request(&home, &session, &when);
        assert_eq!(
            (p, n),
            (pid, nonce),
            "{when}: another server process answered (pid {p}, nonce {n}; was pid {pid}, nonce {nonce})"
        );
        assert_eq!(count, cycle + 2, "{when}: the in-memory counter did not continue");
    }
    assert!(home.ok(&["session", "verify", &session]).starts_with("ok: "));
}

#[test]
#[ignore = "known defect: a suspend killed about 40 ms in (while init quiesces) now and then leaves a session whose \
            server refuses connections after the resume while init answers (1 run in 12 with both cores busy); run \
            with --ignored when fixing it"]
fn a_suspend_killed_midway_keeps_the_memory() {
    let name = "a_suspend_killed_midway_keeps_the_memory";
    if skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    let session = home.ok(&["session", "create", "--driver", "gvisor", "--name", "killed"]);
    home.sh_detached(&sandbox_of(&home, &session), COUNTER_SERVER);
    let (pid, nonce, mut count) = request(&home, &session, "before any suspend");
    // A suspend stops the sandbox at its checkpoint (no restore); killed at
    // spread instants (quiescing, the checkpoint, the image being stored,
    // the snapshot being recorded, the sandbox being removed, or after),
    // the next command finds the sandbox running, or restores it from the
    // window's image, or the resume restores the snapshot: never an older
    // state.
    for delay in [0u64, 40, 120, 250, 500, 900] {
        let mut child = home
            .command(&["session", "suspend", &session])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay));
        let _ = child.kill();
        let _ = child.wait();
        let show: serde_json::Value = serde_json::from_str(&home.ok(&["session", "show", &session, "--json"])).unwrap();
        eprintln!("a suspend killed at {delay} ms left the session {}", show["state"]);
        if show["state"] != "active" {
            home.ok(&["session", "resume", &session]);
        }
        let when = format!("after a suspend killed at {delay} ms");
        let (p, n, c) = request(&home, &session, &when);
        assert_eq!((p, n), (pid, nonce), "{when}: another server process answered");
        assert_eq!(c, count + 1, "{when}: the in-memory counter went back or skipped");
        count = c;
    }
    assert!(home.ok(&["session", "verify", &session]).starts_with("ok: "));
}
