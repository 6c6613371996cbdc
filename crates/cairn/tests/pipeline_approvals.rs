//! End-to-end: stages that wait for a person (`approve = true`), through
//! the CLI, with real sandboxes.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{skip, stderr, stdout, Home};

fn write(home: &Home, name: &str, text: &str) -> String {
    let path = home.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn show(home: &Home, run: &str) -> serde_json::Value {
    serde_json::from_str(&home.ok(&["pipeline", "show", run, "--json"])).unwrap()
}

fn events<'a>(v: &'a serde_json::Value, kind: &str) -> Vec<&'a serde_json::Value> {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

fn stage<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == name && s["branch"] == "")
        .unwrap_or_else(|| panic!("no stage {name} in {v}"))
}

/// Runs cairn with `USER` set; returns (exit code, stdout, stderr).
fn as_user(home: &Home, user: &str, args: &[&str]) -> (i32, String, String) {
    let out = home.command(args).env("USER", user).output().unwrap();
    (out.status.code().unwrap_or(-1), stdout(&out), stderr(&out))
}

const GATED: &str = r#"
[pipeline]
name = "gated"
image = "busybox"

[params]
tag = "t"

[[stage]]
name = "prepare"
key = "gated-prepare-{params.tag}"
run = ["echo prepared > /data"]

[[stage]]
name = "deploy"
after = "prepare"
key = "gated-deploy-{params.tag}"
approve = true
run = ["cat /data", "echo deployed >> /data"]

[[stage]]
name = "announce"
after = "deploy"
key = "gated-announce-{params.tag}"
approve = true
run = ["cat /data"]
"#;

#[test]
fn a_run_waits_for_approval_with_no_process_and_goes_on_when_approved() {
    if skip("a_run_waits_for_approval_with_no_process_and_goes_on_when_approved") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "gated.toml", GATED);
    let tag = format!("a{}", std::process::id());
    let out = home.cairn(&["pipeline", "run", &file, "--param", &format!("tag={tag}")]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "waiting for approval exits 3: {}",
        stderr(&out)
    );
    let run = stdout(&out).trim().to_string();
    assert!(
        stderr(&out).contains(&format!("cairn pipeline approve {run} deploy")),
        "it says what to run: {}",
        stderr(&out)
    );
    // Waiting is a record: nothing executes the run, and it is not interrupted.
    let runs: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    assert_eq!(runs[0]["status"], "awaiting_approval", "{runs}");
    assert_eq!(runs[0]["interrupted"], false);
    assert_eq!(runs[0]["orchestrator_pid"], serde_json::Value::Null);
    assert_eq!(runs[0]["awaiting_approval"], "deploy");
    let listed = home.cairn(&["pipeline", "ls"]);
    assert!(stdout(&listed).contains("awaiting_approval"), "{}", stdout(&listed));
    assert!(
        stderr(&listed).contains(&format!("cairn pipeline approve {run} deploy")),
        "{}",
        stderr(&listed)
    );
    let tree = home.ok(&["pipeline", "show", &run]);
    assert!(
        tree.contains("awaiting approval of stage deploy") && tree.contains("awaiting-approval"),
        "{tree}"
    );
    let v = show(&home, &run);
    assert_eq!(stage(&v, "prepare")["status"], "completed");
    assert_eq!(stage(&v, "deploy")["status"], "awaiting_approval");
    assert!(
        !home.path().join(format!("runs/{run}/deploy.log")).exists(),
        "the stage did not start"
    );
    assert!(
        home.ps().is_empty(),
        "no sandbox is kept while waiting: {:?}",
        home.ps()
    );

    // Wrong verdicts are refused with what to do, and change nothing.
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "approve", &run, "deplyo"]);
    assert!(
        code != 0 && err.contains("has no stage \"deplyo\"") && err.contains("prepare, deploy, announce"),
        "{err}"
    );
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "approve", &run, "prepare"]);
    assert!(code != 0 && err.contains("does not ask for approval"), "{err}");
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "approve", &run, "announce"]);
    assert!(code != 0 && err.contains("has not reached it"), "{err}");
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "approve", "zzzzzz", "deploy"]);
    assert!(code != 0 && err.contains("no run matches"), "{err}");
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "reject", &run, "deploy"]);
    assert!(
        code != 0 && err.contains("--reason"),
        "a rejection needs a reason: {err}"
    );
    let long = "x".repeat(5000);
    let (code, _, err) = as_user(
        &home,
        "alice",
        &["pipeline", "approve", &run, "deploy", "--reason", &long],
    );
    assert!(code != 0 && err.contains("4096-byte limit"), "{err}");
    assert!(events(&show(&home, &run), "approved").is_empty());

    // Approved: recorded with who and why, then the run goes on here and
    // stops at the next stage that waits.
    let (code, _, err) = as_user(
        &home,
        "alice",
        &["pipeline", "approve", &run, "deploy", "--reason", "change 42 reviewed"],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("cairn pipeline approve {run} announce")), "{err}");
    let v = show(&home, &run);
    let approved = events(&v, "approved");
    assert_eq!(approved.len(), 1);
    assert_eq!(approved[0]["detail"], "approved by alice: change 42 reviewed");
    assert_eq!(stage(&v, "deploy")["status"], "completed");
    assert_eq!(stage(&v, "announce")["status"], "awaiting_approval");
    assert_eq!(v["run"]["status"], "awaiting_approval");
    let log = home.ok(&["logs", &run, "deploy"]);
    assert_eq!(log, "prepared");
    let (code, _, err) = as_user(&home, "alice", &["pipeline", "approve", &run, "deploy"]);
    assert!(code != 0 && err.contains("already approved"), "twice is refused: {err}");

    // Resuming a waiting run stops at the same place and runs nothing.
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(!home.path().join(format!("runs/{run}/announce.log")).exists());

    // Rejected: the run fails there, with who and why; nothing of it runs.
    let (code, _, err) = as_user(
        &home,
        "bob",
        &["pipeline", "reject", &run, "announce", "--reason", "not today"],
    );
    assert_eq!(code, 0, "{err}");
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "failed");
    assert_eq!(v["run"]["error"], "stage announce was rejected by bob: not today");
    assert_eq!(stage(&v, "announce")["status"], "rejected");
    assert!(!home.path().join(format!("runs/{run}/announce.log")).exists());
    let dlq: serde_json::Value = serde_json::from_str(&home.ok(&["dlq", "ls", "--json"])).unwrap();
    assert_eq!(dlq.as_array().unwrap().len(), 0, "a rejection is no dead letter");
    let (code, _, err) = as_user(&home, "bob", &["pipeline", "approve", &run, "announce"]);
    assert!(code != 0 && err.contains("already rejected"), "{err}");
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a rejected run stays failed: {}",
        stderr(&out)
    );
    assert!(!home.path().join(format!("runs/{run}/announce.log")).exists());

    // A second run reuses the approved and completed deploy (nothing runs,
    // nobody is asked) and waits at the announce stage that never ran.
    let out = home.cairn(&["pipeline", "run", &file, "--param", &format!("tag={tag}")]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let again = stdout(&out).trim().to_string();
    let v = show(&home, &again);
    assert_eq!(stage(&v, "deploy")["status"], "completed");
    assert_eq!(events(&v, "reused").len(), 2, "prepare and deploy are reused");
    assert_eq!(v["run"]["status"], "awaiting_approval");
    assert_eq!(stage(&v, "announce")["status"], "awaiting_approval");
}

#[test]
fn an_approval_recorded_before_a_kill_is_kept_and_resume_continues_the_run() {
    if skip("an_approval_recorded_before_a_kill_is_kept_and_resume_continues_the_run") {
        return;
    }
    let home = Home::new();
    let slow = GATED
        .replace(
            "run = [\"cat /data\", \"echo deployed >> /data\"]",
            "run = [\"sleep 2; cat /data\", \"echo deployed >> /data\"]",
        )
        .replace("approve = true\nrun = [\"cat /data\"]", "run = [\"cat /data\"]");
    assert_ne!(slow, GATED);
    let file = write(&home, "slow.toml", &slow);
    let tag = format!("k{}", std::process::id());
    let out = home.cairn(&["pipeline", "run", &file, "--param", &format!("tag={tag}")]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();

    // The approval is recorded first: with nothing continuing the run it is
    // interrupted, not waiting, and is approved once.
    let (code, _, err) = as_user(
        &home,
        "carol",
        &["pipeline", "approve", &run, "deploy", "--no-continue"],
    );
    assert_eq!(code, 0, "{err}");
    let runs: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    assert_eq!(
        (runs[0]["status"].as_str(), runs[0]["interrupted"].as_bool()),
        (Some("running"), Some(true))
    );

    let (code, _, err) = as_user(&home, "carol", &["pipeline", "approve", &run, "deploy"]);
    assert!(code != 0 && err.contains("already approved"), "{err}");
    assert!(
        err.contains(&format!("cairn pipeline resume {run}")),
        "it says how to go on: {err}"
    );
    // The process continuing it is killed (-9) while the approved stage
    // runs; the next resume finishes the run without asking again.
    let mut child = home
        .command(&["pipeline", "resume", &run])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while show(&home, &run)["stages"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| !(s["stage"] == "deploy" && s["status"] == "running"))
    {
        assert!(Instant::now() < deadline, "the approved stage never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed");
    assert_eq!(events(&v, "approved").len(), 1);
    assert_eq!(events(&v, "awaiting-approval").len(), 1, "it never asked again");
    assert_eq!(events(&v, "approved")[0]["detail"], "approved by carol");
    assert_eq!(home.ok(&["logs", &run, "announce"]), "prepared\ndeployed");
}
