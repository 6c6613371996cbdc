//! End-to-end: pipelines on the embedded store, and on PostgreSQL.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{skip, skip_without_runsc, stderr, stdout, Home};

fn write(home: &Home, name: &str, text: &str) -> String {
    let path = home.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn show(home: &Home, run: &str) -> serde_json::Value {
    serde_json::from_str(&home.ok(&["pipeline", "show", run, "--json"])).unwrap()
}

/// Starts `cairn pipeline run FILE` in the background, polls its only run
/// until `ready` holds for `cairn pipeline show --json`, waits `then`, and kills
/// the orchestrator (`kill -9`); returns the run id.
fn kill_run_when(
    home: &Home,
    file: &str,
    why: &str,
    then: Duration,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> String {
    let mut child = home
        .command(&["pipeline", "run", file])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let run = the_run_when(home, ready);
    if run.is_some() {
        std::thread::sleep(then);
    }
    let _ = child.kill();
    let _ = child.wait();
    run.unwrap_or_else(|| panic!("{why}"))
}

/// The home's only run once `ready` holds for `cairn pipeline show --json`
/// (polled for up to 90 s).
fn the_run_when(home: &Home, ready: impl Fn(&serde_json::Value) -> bool) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        let runs: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
        if let Some(id) = runs.as_array().and_then(|a| a.first()).and_then(|r| r["id"].as_str()) {
            if ready(&show(home, id)) {
                return Some(id.to_string());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Waits (up to a minute) until `done` holds.
fn wait_for(why: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "{why}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn events<'a>(v: &'a serde_json::Value, kind: &str) -> Vec<&'a serde_json::Value> {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

const CHECKPOINTED: &str = r#"
[pipeline]
name = "checkpointed"
image = "busybox"

[[stage]]
name = "long"
key = "long-v1"
retries = 2
checkpoint_every = "300ms"
run = [
  "mkdir -p /work; if [ -e /work/after-checkpoint ]; then echo LEAK; fi; echo attempt $CAIRN_ATTEMPT",
  "[ -e /work/before ] || { echo written > /work/before; sleep 1.5; }",
  "echo late > /work/after-checkpoint; if [ $CAIRN_ATTEMPT -le 2 ]; then exit 7; fi",
]
"#;

#[test]
fn a_failing_stage_retries_from_its_checkpoint_each_time() {
    if skip("a_failing_stage_retries_from_its_checkpoint_each_time") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", CHECKPOINTED);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let log = home.ok(&["logs", &run, "long"]);
    assert!(log.contains("attempt 3"), "{log}");
    // The file written after the checkpoint is gone on every retry.
    assert!(
        !log.contains("LEAK"),
        "a retry saw work from after the checkpoint:\n{log}"
    );
    let v = show(&home, &run);
    assert_eq!(events(&v, "retry").len(), 2);
    assert!(events(&v, "retry")
        .iter()
        .all(|e| e["detail"].as_str().unwrap().contains("restores checkpoint")));
    let checkpoints: Vec<&str> = events(&v, "checkpoint")
        .iter()
        .map(|e| e["data"]["snapshot"].as_str().unwrap())
        .collect();
    assert!(!checkpoints.is_empty());
    // Each retry names the checkpoint it restored, one the stage took.
    for r in events(&v, "retry") {
        let restored = r["data"]["checkpoint"].as_str().expect("a retry names its checkpoint");
        assert!(checkpoints.contains(&restored), "{r}");
        assert_eq!(r["data"]["parent_snapshot"].as_str(), Some(restored));
        assert_eq!(r["snapshot_id"].as_str(), Some(restored));
    }
    let failed = events(&v, "failed");
    assert!(failed
        .iter()
        .any(|f| f["data"]["type"] == "stage-failed" && f["data"]["attempt"] == 1));
    let done = events(&v, "completed");
    assert!(done
        .iter()
        .any(|c| c["data"]["type"] == "stage-completed" && c["data"]["attempt"] == 3));
    assert_eq!(v["run"]["status"], "completed");
}

const DEAD: &str = r#"
[pipeline]
name = "dead"
image = "busybox"

[[stage]]
name = "first"
key = "first-{params.tag}"
run = ["mkdir -p /work && echo ok > /work/first"]
artifacts = ["/work/first"]

[[stage]]
name = "flaky"
after = "first"
key = "flaky-{params.tag}"
retries = 1
run = ["echo attempt $CAIRN_ATTEMPT > /work/flaky; [ $CAIRN_ATTEMPT -ge 3 ]"]

[params]
tag = "a"
"#;

#[test]
fn exhausted_retries_land_in_the_dlq_and_dlq_retry_completes_the_run() {
    if skip("exhausted_retries_land_in_the_dlq_and_dlq_retry_completes_the_run") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", DEAD);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let dlq: serde_json::Value = serde_json::from_str(&home.ok(&["dlq", "ls", "--json"])).unwrap();
    let dl = &dlq[0];
    assert_eq!(dl["stage"], "flaky");
    // Both snapshots restore.
    for snap in [
        dl["failure_snapshot"].as_str().unwrap(),
        dl["input_snapshot"].as_str().unwrap(),
    ] {
        let sb = home.ok(&["restore", snap]);
        home.ok(&["exec", &sb, "--", "cat", "/work/first"]);
        home.ok(&["rm", "-f", &sb]);
    }
    let failed = home.ok(&["restore", dl["failure_snapshot"].as_str().unwrap()]);
    assert_eq!(home.ok(&["exec", &failed, "--", "cat", "/work/flaky"]), "attempt 2");
    let out = home.cairn(&["dlq", "retry", dl["id"].as_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed");
    // The first stage did not run again.
    let completed_first = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["stage"] == "first" && e["kind"] == "completed")
        .count();
    assert_eq!(completed_first, 1);
    let out = home.cairn(&["dlq", "retry", dl["id"].as_str().unwrap()]);
    assert!(stderr(&out).contains("already retried"), "{}", stderr(&out));
    // The artifact comes back out of the store.
    let artifact = v["artifacts"][0]["id"].as_str().unwrap();
    assert_eq!(home.ok(&["artifact", "get", artifact]), "ok");
    // Into a file, never through a link planted at a name the copy might
    // write first.
    let work = tempfile::tempdir().unwrap();
    let victim = work.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, work.path().join("out.cairn-partial")).unwrap();
    let out = work.path().join("out.txt");
    home.ok(&["artifact", "get", artifact, "-o", out.to_str().unwrap()]);
    assert!(std::fs::symlink_metadata(&out).unwrap().is_file());
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), "ok");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
}

fn branches(select: &str, metric: &str) -> String {
    format!(
        r#"
[pipeline]
name = "branches"
image = "busybox"

[[stage]]
name = "base"
key = "base"
run = ["mkdir -p /work"]

[[stage]]
name = "pick"
after = "base"
key = "pick-{{hypothesis}}"
run = ["sleep {{hypothesis.delay}}; echo {{hypothesis.value}} > /work/value; echo value {{hypothesis.value}}"]
[stage.branches]
select = "{select}"
{metric}
hypotheses = [
  {{ name = "slow-low", value = "1", delay = "0.6" }},
  {{ name = "fast-mid", value = "5", delay = "0" }},
  {{ name = "slow-high", value = "9", delay = "0.6" }},
]
"#
    )
}

#[test]
fn a_branch_group_keeps_the_right_winner_under_each_rule() {
    if skip("a_branch_group_keeps_the_right_winner_under_each_rule") {
        return;
    }
    for (select, metric, winner) in [
        ("min", "metric = \"file:/work/value\"", "slow-low"),
        ("max", "metric = \"output\"", "slow-high"),
        ("first_success", "", "fast-mid"),
    ] {
        let home = Home::new();
        let file = write(&home, "p.toml", &branches(select, metric));
        let out = home.cairn(&["pipeline", "run", &file]);
        assert!(out.status.success(), "{select}: {}", stderr(&out));
        let v = show(&home, stdout(&out).trim());
        let won = events(&v, "won");
        assert_eq!(won.len(), 1, "{select}");
        assert!(
            won[0]["detail"].as_str().unwrap().starts_with(winner),
            "{select}: {}",
            won[0]["detail"]
        );
        // The winner, rule and runner-up are fields, not only words.
        let data = &won[0]["data"];
        assert_eq!(won[0]["branch"], winner, "{select}: {won:?}");
        assert_eq!(
            (data["type"].as_str(), data["branch"].as_str()),
            (Some("won"), Some(winner))
        );
        assert_eq!(data["rule"], select);
        match select {
            "min" => assert_eq!(
                (data["metric"].as_f64(), data["runner_up"].as_str()),
                (Some(1.0), Some("fast-mid"))
            ),
            "max" => assert_eq!(
                (data["metric"].as_f64(), data["runner_up"].as_str()),
                (Some(9.0), Some("fast-mid"))
            ),
            _ => assert!(
                data["runner_up"].as_str().is_some_and(|r| r.starts_with("slow")),
                "{data}"
            ),
        }
        let lost = events(&v, "lost");
        assert_eq!(lost.len(), 2, "{select}: the losers keep their reason");
        assert!(lost
            .iter()
            .all(|l| l["data"]["winner"] == winner && l["data"]["ended"] == "completed"));
        // Each branch's first attempt names the snapshot it forked.
        let base = v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "base")
            .unwrap();
        let forks: Vec<_> = events(&v, "forked")
            .into_iter()
            .filter(|e| e["stage"] == "pick")
            .collect();
        assert_eq!(forks.len(), 3);
        assert!(forks
            .iter()
            .all(|f| f["data"]["parent_snapshot"] == base["output_snapshot"] && f["data"]["attempt"] == 1));
        // The winner's files continue the run.
        let group = v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "pick" && s["branch"] == "")
            .unwrap();
        let sb = home.ok(&["restore", group["output_snapshot"].as_str().unwrap()]);
        let value = home.ok(&["exec", &sb, "--", "cat", "/work/value"]);
        let expected = match winner {
            "slow-low" => "1",
            "fast-mid" => "5",
            _ => "9",
        };
        assert_eq!(value, expected, "{select}");
        // Each loser against the winner: its value file differs, and the
        // run's page says so with the command that shows it.
        let run = v["run"]["id"].as_str().unwrap();
        let diffs = v["branch_diffs"].as_array().unwrap();
        assert_eq!(diffs.len(), 2, "{select}: {diffs:?}");
        for d in diffs {
            assert_eq!(
                (d["winner"].as_str(), d["changed"].as_u64()),
                (Some(winner), Some(1)),
                "{d}"
            );
            let loser = d["branch"].as_str().unwrap();
            let out = home.cairn(&[
                "diff",
                &format!("{run}/pick.{winner}"),
                &format!("{run}/pick.{loser}"),
                "--json",
            ]);
            assert_eq!(out.status.code(), Some(1), "something differs: {}", stderr(&out));
            let diff: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            let changes = diff["changes"].as_array().unwrap();
            assert_eq!(changes.len(), 1, "{diff}");
            assert_eq!(changes[0]["path"], "/work/value");
            assert!(changes[0]["diff"].as_str().unwrap().contains(&format!("-{expected}\n")));
            assert_eq!(diff["b"]["kind"], "stage");
        }
        let text = home.ok(&["pipeline", "show", run]);
        assert!(
            text.contains(&format!(
                "differs from the winner {winner}: 0 added, 0 removed, 1 changed"
            )),
            "{text}"
        );
        // The base stage against the group's output: the value file is new.
        let out = home.cairn(&["diff", &format!("{run}/base"), &format!("{run}/pick"), "--stat"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(stdout(&out).contains("A /work/value"), "{}", stdout(&out));
        let out = home.cairn(&["diff", &format!("{run}/nope"), &format!("{run}/pick")]);
        assert_eq!(out.status.code(), Some(125));
        assert!(stderr(&out).contains("RUN/STAGE.BRANCH"), "{}", stderr(&out));
    }
}

#[test]
fn a_deferred_branch_group_ends_its_run_with_every_branch_and_no_winner() {
    if skip("a_deferred_branch_group_ends_its_run_with_every_branch_and_no_winner") {
        return;
    }
    let home = Home::new();
    // Each hypothesis names its own edit's file; an empty path writes none.
    let text = branches("deferred", "")
        .replace(
            "run = [\"sleep",
            "edits = [{ path = \"{hypothesis.own}\", content = \"{hypothesis.value}\" }]\nrun = [\"sleep",
        )
        .replace(
            "value = \"1\", delay = \"0.6\"",
            "value = \"1\", delay = \"0.6\", own = \"/work/low\"",
        )
        .replace(
            "value = \"5\", delay = \"0\"",
            "value = \"5\", delay = \"0\", own = \"\"",
        )
        .replace(
            "value = \"9\", delay = \"0.6\"",
            "value = \"9\", delay = \"0.6\", own = \"/work/high\"",
        );
    let file = write(&home, "p.toml", &text);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, stdout(&out).trim());
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert!(
        events(&v, "won").is_empty() && events(&v, "lost").is_empty(),
        "nothing is chosen: {v}"
    );
    let ended = events(&v, "ended");
    assert_eq!(ended.len(), 1, "{v}");
    assert!(
        ended[0]["detail"]
            .as_str()
            .unwrap()
            .starts_with("3 of 3 branches completed"),
        "{v}"
    );
    let stages = v["stages"].as_array().unwrap();
    assert!(
        !stages.iter().any(|s| s["stage"] == "pick" && s["branch"] == ""),
        "no group row: {v}"
    );
    for (branch, own, value) in [
        ("slow-low", Some("/work/low"), "1"),
        ("fast-mid", None, "5"),
        ("slow-high", Some("/work/high"), "9"),
    ] {
        let row = stages
            .iter()
            .find(|s| s["stage"] == "pick" && s["branch"] == branch)
            .unwrap();
        assert_eq!(row["status"], "completed", "{branch}");
        let sb = home.ok(&["restore", row["output_snapshot"].as_str().unwrap()]);
        assert_eq!(home.ok(&["exec", &sb, "--", "cat", "/work/value"]), value, "{branch}");
        let listed = home.ok(&["exec", &sb, "--", "ls", "/work"]);
        let owns: Vec<&str> = listed
            .split_whitespace()
            .filter(|f| *f == "low" || *f == "high")
            .collect();
        assert_eq!(
            owns,
            own.map(|p| p.trim_start_matches("/work/"))
                .into_iter()
                .collect::<Vec<_>>(),
            "{branch}"
        );
        home.ok(&["rm", "--force", &sb]);
    }
}

#[test]
fn a_bad_pipeline_is_refused_before_anything_runs() {
    if skip("a_bad_pipeline_is_refused_before_anything_runs") {
        return;
    }
    let home = Home::new();
    let file = write(
        &home,
        "bad.toml",
        &DEAD.replace("retries = 1", "retries = 1\nretrys = 3"),
    );
    let out = home.cairn(&["pipeline", "run", &file]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("bad.toml:17"), "{}", stderr(&out));
    let file = write(
        &home,
        "cycle.toml",
        &DEAD.replace(
            "key = \"first-{params.tag}\"",
            "key = \"first-{params.tag}\"\nafter = \"flaky\"",
        ),
    );
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(stderr(&out).contains("cycle"), "{}", stderr(&out));
    let out = home.cairn(&["pipeline", "run", &write(&home, "p.toml", DEAD), "--param", "nokey"]);
    assert!(stderr(&out).contains("KEY=VALUE"), "{}", stderr(&out));
    assert_eq!(home.ok(&["pipeline", "ls", "--json"]), "[]");
    assert!(home.ps().is_empty());
}

const FOUR: &str = r#"
[pipeline]
name = "four"
image = "busybox"

[[stage]]
name = "s1"
key = "s1"
run = ["mkdir -p /work && sleep 0.3 && echo 1 >> /work/trail", "echo key-s1"]

[[stage]]
name = "s2"
after = "s1"
key = "s2"
checkpoint_every = "200ms"
run = ["sleep 0.5 && echo 2 >> /work/trail", "echo key-s2"]

[[stage]]
name = "s3"
after = "s2"
key = "s3"
run = ["sleep 0.3 && echo 3 >> /work/trail", "echo key-s3"]

[[stage]]
name = "s4"
after = "s3"
key = "s4"
run = ["echo 4 >> /work/trail", "echo key-s4"]
artifacts = ["/work/trail"]
"#;

#[test]
fn a_run_killed_at_random_instants_resumes_to_the_right_result() {
    if skip("a_run_killed_at_random_instants_resumes_to_the_right_result") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", FOUR);
    let mut child = home
        .command(&["pipeline", "run", &file])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let run = stdout(&out).trim().to_string();
    assert!(!run.is_empty(), "the run id is printed first");
    let mut seed = 0x2545f4914f6cdd1du64;
    let deadline = Instant::now() + Duration::from_secs(240);
    // With the first run, 20 kills at random instants.
    for _ in 0..19 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut child = home
            .command(&["pipeline", "resume", &run])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(50 + seed % 700));
        let _ = child.kill();
        let _ = child.wait();
        assert!(Instant::now() < deadline);
    }
    // Resume until done (a completed run refuses to resume).
    for _ in 0..5 {
        let v = show(&home, &run);
        if v["run"]["status"] == "completed" {
            break;
        }
        let _ = home.cairn(&["pipeline", "resume", &run]);
    }
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    // Every stage completed exactly once; a cut-short attempt was discarded with its fork.
    for s in ["s1", "s2", "s3", "s4"] {
        let n = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["stage"] == s && e["kind"] == "completed")
            .count();
        assert_eq!(n, 1, "stage {s} completed {n} times");
    }
    // Each stage's last command printed its key to the stage log, which is
    // outside the sandbox and the store and is never rolled back. A key
    // repeats only where the store records an interruption of that stage
    // (its attempt re-attached, which replays the command's output, or
    // discarded and redone); a stage recorded as completed never ran again.
    for s in ["s1", "s2", "s3", "s4"] {
        let stage_events: Vec<&serde_json::Value> = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["stage"] == s)
            .collect();
        let completed = stage_events.iter().find(|e| e["kind"] == "completed").unwrap()["seq"]
            .as_i64()
            .unwrap();
        let started_again = stage_events.iter().find(|e| {
            e["seq"].as_i64().unwrap() > completed
                && ["forked", "retry", "reattached", "resumed"].contains(&e["kind"].as_str().unwrap())
        });
        assert!(
            started_again.is_none(),
            "stage {s} ran after it completed: {started_again:?}"
        );
        let interruptions = stage_events
            .iter()
            .filter(|e| e["kind"] == "reattached" || e["kind"] == "resumed")
            .count();
        let log = home.ok(&["logs", &run, s]);
        let keys = log.lines().filter(|l| *l == format!("key-{s}")).count();
        assert!(
            keys >= 1 && keys <= 1 + interruptions,
            "stage {s}: key printed {keys} times with {interruptions} interruptions:\n{log}"
        );
    }
    // Work inside the sandboxes was applied once per stage: the trail has each step once.
    let trail = home.ok(&["artifact", "get", v["artifacts"][0]["id"].as_str().unwrap()]);
    assert_eq!(trail, "1\n2\n3\n4", "{:#}", v["events"]);
    // No sandbox of an interrupted attempt is left running.
    let _ = home.cairn(&["gc"]);
    assert!(home.ps().is_empty(), "{:?}", home.ps());
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(stderr(&out).contains("already completed"), "{}", stderr(&out));
}

#[test]
fn the_quickstart_runs_and_a_second_run_reuses_every_stage() {
    if skip("the_quickstart_runs_and_a_second_run_reuses_every_stage") {
        return;
    }
    let home = Home::new();
    let quickstart = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/quickstart.toml");
    let out = home.cairn(&["pipeline", "run", quickstart, "--param", "size=20000"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, stdout(&out).trim());
    assert_eq!(events(&v, "won").len(), 1);
    assert_eq!(events(&v, "retry").len(), 1);
    let out = home.cairn(&["pipeline", "run", quickstart, "--param", "size=20000"]);
    assert!(out.status.success());
    let v = show(&home, stdout(&out).trim());
    assert!(events(&v, "forked").is_empty(), "the second run ran something: {v}");
    assert_eq!(events(&v, "reused").len(), 5);
}

#[test]
fn gc_keeps_artifacts_and_the_snapshots_runs_need() {
    if skip("gc_keeps_artifacts_and_the_snapshots_runs_need") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", DEAD.replace("retries = 1", "retries = 5").as_str());
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, stdout(&out).trim());
    // A stage's output stays: its key returns it to later runs.
    let output = v["stages"][0]["output_snapshot"].as_str().unwrap();
    let refused = home.cairn(&["snapshot", "rm", output]);
    assert_eq!(refused.status.code(), Some(125));
    assert!(stderr(&refused).contains("needs it"), "{}", stderr(&refused));
    home.ok(&["gc"]);
    std::fs::remove_dir_all(home.path().join("layers")).unwrap();
    assert_eq!(
        home.ok(&["artifact", "get", v["artifacts"][0]["id"].as_str().unwrap()]),
        "ok"
    );
    let last = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "flaky")
        .unwrap();
    let sb = home.ok(&["restore", last["output_snapshot"].as_str().unwrap()]);
    assert_eq!(home.ok(&["exec", &sb, "--", "cat", "/work/flaky"]), "attempt 3");
}

const LONG_COMMAND: &str = r#"
[pipeline]
name = "reattach"
image = "busybox"

[[stage]]
name = "long"
key = "long-reattach-v1"
run = ["mkdir -p /work; echo start >> /work/trail; sleep 3; echo done >> /work/trail; echo finished"]
artifacts = ["/work/trail"]
"#;

#[test]
fn a_resumed_run_reattaches_to_the_command_still_running_in_its_sandbox() {
    if skip("a_resumed_run_reattaches_to_the_command_still_running_in_its_sandbox") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", LONG_COMMAND);
    // Once the command runs, the orchestrator is killed.
    let run = kill_run_when(
        &home,
        &file,
        "the stage never started",
        Duration::from_millis(500),
        |v| v["stages"][0]["status"] == "running",
    );
    // The stage's sandbox outlives the orchestrator, its command still running.
    let sandbox = show(&home, &run)["stages"][0]["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    let ids = |home: &Home| -> Vec<String> {
        home.ps()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(ids(&home).contains(&sandbox), "{:?} lacks {sandbox}", ids(&home));
    // The run is listed as interrupted: recorded as running, executed by nobody.
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "running", "{v}");
    assert_eq!(v["run"]["interrupted"], true, "{v}");
    assert!(home.ok(&["pipeline", "ls"]).contains("interrupted"));
    assert!(home.ok(&["pipeline", "show", &run]).contains("pipeline resume"));
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert_eq!(events(&v, "reattached").len(), 1, "{v}");
    assert!(events(&v, "resumed").is_empty(), "the attempt was not discarded: {v}");
    // The command ran once, from start to end, across the two orchestrators.
    let trail = home.ok(&["artifact", "get", v["artifacts"][0]["id"].as_str().unwrap()]);
    assert_eq!(trail, "start\ndone");
    assert!(home.ok(&["logs", &run, "long"]).contains("finished"));
    // Its sandbox went with the attempt.
    assert!(!ids(&home).contains(&sandbox));
}

const TIMED_STAGE: &str = r#"
[pipeline]
name = "deadline"
image = "busybox"

[[stage]]
name = "slow"
key = "slow-deadline-v1"
timeout = "4s"
retries = 0
run = ["mkdir -p /work; sleep 3; touch /work/one-done", "sleep 2; echo second-finished"]
"#;

#[test]
fn a_reattached_stage_keeps_the_deadline_its_attempt_began_with() {
    if skip("a_reattached_stage_keeps_the_deadline_its_attempt_began_with") {
        return;
    }
    // 3 s + 2 s of commands under a 4 s stage timeout: the attempt must time
    // out in its second command, across a killed orchestrator too (a resumed
    // one that restarted the clock would give the second command 4 s).
    let home = Home::new();
    let file = write(&home, "p.toml", TIMED_STAGE);
    let run = kill_run_when(
        &home,
        &file,
        "the stage never started",
        Duration::from_millis(300),
        |v| v["stages"][0]["status"] == "running",
    );
    // The orchestrator stays away until the first command has finished: the
    // time it was away counts against the stage.
    let sandbox = show(&home, &run)["stages"][0]["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for("the first command never finished", || {
        home.cairn(&["exec", &sandbox, "--", "test", "-e", "/work/one-done"])
            .status
            .success()
    });
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(!out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(events(&v, "reattached").len(), 1, "{v}");
    assert_eq!(v["run"]["status"], "failed", "{v}");
    let error = v["stages"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("timed out") || error.contains("timeout"), "{v}");
    assert!(!home.ok(&["logs", &run, "slow"]).contains("second-finished"));
}

const GATED_COMMAND: &str = r#"
[pipeline]
name = "gated"
image = "busybox"

[[stage]]
name = "gated"
key = "gated-v1"
run = ["mkdir -p /work; echo start >> /work/trail; until [ -e /work/go ]; do sleep 0.05; done; echo done >> /work/trail"]
artifacts = ["/work/trail"]
"#;

#[test]
fn a_run_is_executed_by_one_orchestrator_at_a_time() {
    if skip("a_run_is_executed_by_one_orchestrator_at_a_time") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", GATED_COMMAND);
    let mut first = home
        .command(&["pipeline", "run", &file])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until its command runs (it waits for /work/go).
    let run = the_run_when(&home, |v| {
        let stage = &v["stages"][0];
        stage["status"] == "running"
            && stage["sandbox_id"].as_str().is_some_and(|sandbox| {
                let trail = home.cairn(&["exec", sandbox, "--", "cat", "/work/trail"]);
                stdout(&trail).trim() == "start"
            })
    })
    .expect("the stage never started");
    let sandbox = show(&home, &run)["stages"][0]["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    // A second orchestrator is refused, naming the first, and changes nothing
    // (one that ran instead would wait on the gate: it is stopped after a minute).
    let mut second = home
        .command(&["pipeline", "resume", &run])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while second.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = second.kill();
            panic!("a second orchestrator ran the run beside the first");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = second.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    let msg = stderr(&out);
    assert!(msg.contains("another cairn process"), "{msg}");
    assert!(msg.contains(&format!("pid {}", first.id())), "{msg}");
    let v = show(&home, &run);
    assert_eq!(v["stages"][0]["attempts"], 1);
    assert_eq!(v["run"]["orchestrator_pid"], first.id(), "{v}");
    assert_eq!(v["run"]["interrupted"], false, "{v}");
    // The first goes on and completes; the command ran once.
    home.ok(&["exec", &sandbox, "--", "touch", "/work/go"]);
    let status = first.wait().unwrap();
    assert!(status.success(), "the first orchestrator failed: {status}");
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert_eq!(v["run"]["orchestrator_pid"], serde_json::Value::Null, "{v}");
    let trail = home.ok(&["artifact", "get", v["artifacts"][0]["id"].as_str().unwrap()]);
    assert_eq!(trail, "start\ndone");
    // With the first gone, the lock is free: resuming says the run is done.
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(stderr(&out).contains("already completed"), "{}", stderr(&out));
}

const ON_POSTGRES: &str = r#"
[pipeline]
name = "on-postgres"
image = "busybox"

[[stage]]
name = "make"
key = "make-v1"
run = ["mkdir -p /work && echo made > /work/made"]
artifacts = ["/work/made"]

[[stage]]
name = "pick"
after = "make"
key = "pick-{hypothesis}"
run = ["cat /work/made && echo {hypothesis.value} > /work/value"]
[stage.branches]
select = "first_success"
hypotheses = [
  { name = "one", value = "1" },
  { name = "two", value = "2" },
]
"#;

#[test]
fn a_pipeline_runs_on_a_postgres_state_store_and_its_keys_are_reused() {
    let test = "a_pipeline_runs_on_a_postgres_state_store_and_its_keys_are_reused";
    if skip(test) {
        return;
    }
    let Some(db) = cairn_engine::testing::postgres_database(test) else {
        return;
    };
    let home = Home::with_state(Some(db.url.clone()));
    let file = write(&home, "p.toml", ON_POSTGRES);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first = stdout(&out).trim().to_string();
    // --state names the store as CAIRN_STATE does.
    let mut runs = home.command(&["--state", &db.url, "runs", "--json"]);
    runs.env_remove("CAIRN_STATE");
    let runs = runs.output().unwrap();
    assert!(runs.status.success(), "{}", stderr(&runs));
    let runs: serde_json::Value = serde_json::from_slice(&runs.stdout).unwrap();
    assert_eq!(runs[0]["id"], first.as_str());
    assert_eq!(runs[0]["status"], "completed");
    // The rows are in PostgreSQL, not in an SQLite file of the home.
    assert!(!home.path().join("state.db").exists());
    assert_eq!(db.count(&format!("SELECT count(*) FROM runs WHERE id = '{first}'")), 1);
    assert_eq!(
        db.count("SELECT count(*) FROM stage_keys WHERE stage_key IN ('make-v1', 'pick-one', 'pick-two')"),
        3
    );
    assert!(db.count("SELECT count(*) FROM snapshots") >= 2);
    assert_eq!(db.count("SELECT count(*) FROM artifacts"), 1);
    // A second run reuses every completed key and runs nothing.
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, stdout(&out).trim());
    assert_eq!(v["run"]["status"], "completed");
    assert!(events(&v, "forked").is_empty(), "the second run ran something: {v}");
    assert!(!events(&v, "reused").is_empty(), "{v}");
    let make = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "make")
        .unwrap();
    assert_eq!(
        make["output_snapshot"].as_str().unwrap(),
        db.client()
            .query_one(
                "SELECT output_snapshot FROM stage_keys WHERE stage_key = 'make-v1'",
                &[]
            )
            .unwrap()
            .get::<_, String>(0)
    );
    // Without the URL the home's embedded store knows nothing of the runs.
    let mut embedded = home.command(&["pipeline", "ls", "--json"]);
    embedded.env_remove("CAIRN_STATE");
    assert_eq!(stdout(&embedded.output().unwrap()).trim(), "[]");
}

const IN_MEMORY: &str = r#"
[pipeline]
name = "in-memory"
image = "busybox"
driver = "gvisor"

[[stage]]
name = "count"
key = "count-in-memory-v1"
retries = 2
checkpoint_every = "700ms"
# Checkpoints as often as the bound allows (each then waits its own length).
checkpoint_share = "50%"
run = ["mkdir -p /work; echo start >> /work/starts; i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo $i > /work/progress; sleep 0.1; done; echo counted to $i"]
artifacts = ["/work/starts"]
"#;

#[test]
fn a_gvisor_stage_whose_sandbox_died_goes_on_from_its_memory_checkpoint() {
    let name = "a_gvisor_stage_whose_sandbox_died_goes_on_from_its_memory_checkpoint";
    if skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", IN_MEMORY);
    // Once a memory checkpoint of the running stage exists, the host
    // "crashes": the orchestrator and the stage's sandbox are killed.
    let run = kill_run_when(
        &home,
        &file,
        "no checkpoint of the running stage was taken",
        Duration::ZERO,
        |v| !events(v, "checkpoint").is_empty() && v["stages"][0]["status"] == "running",
    );
    let sandbox = show(&home, &run)["stages"][0]["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    home.ok(&["rm", "-f", &sandbox]);
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert_eq!(events(&v, "resumed").len(), 1, "the dead attempt is discarded: {v}");
    assert!(
        v["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["detail"].as_str().unwrap_or("").contains("restores checkpoint")),
        "{v}"
    );
    // The command went on from the checkpoint's memory: it never started again.
    let starts = home.ok(&["artifact", "get", v["artifacts"][0]["id"].as_str().unwrap()]);
    assert_eq!(starts, "start", "{v:#}\n{}", home.ok(&["logs", &run, "count"]));
    assert!(home.ok(&["logs", &run, "count"]).contains("counted to 40"));
    let _ = home.cairn(&["gc"]);
    assert!(home.ps().is_empty(), "{:?}", home.ps());
}

#[test]
fn a_gvisor_stage_is_followed_through_its_memory_checkpoints() {
    let name = "a_gvisor_stage_is_followed_through_its_memory_checkpoints";
    if skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    // Each checkpoint quiesces init, which ends the orchestrator's
    // connection to the running command; it follows on from the bytes seen.
    let file = write(
        &home,
        "p.toml",
        &IN_MEMORY.replace(
            "echo $i > /work/progress; sleep 0.1",
            "echo $i > /work/progress; echo line $i; sleep 0.1",
        ),
    );
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    assert!(events(&v, "checkpoint").len() >= 2, "{v}");
    let log = home.ok(&["logs", &run, "count"]);
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("line ")).collect();
    let expected: Vec<String> = (1..=40).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, expected, "every line once, in order: {log}");
    assert!(log.contains("counted to 40"));
}

/// Runs `cmd` to its end with stdout piped; returns its exit code, its
/// stdout and its peak resident set size in bytes (the kernel's high-water
/// mark for that process, from `wait4`).
#[allow(clippy::zombie_processes, reason = "wait4 reaps it, and gives its resource usage")]
fn run_measured(cmd: &mut std::process::Command) -> (i32, String, u64) {
    use std::io::Read;
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is our unreaped child (std's Child is not waited on
    // after this), and both pointers are to live locals.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4: {}", std::io::Error::last_os_error());
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    // ru_maxrss is in KiB on Linux.
    (code, out, usage.ru_maxrss as u64 * 1024)
}

const NOISY: &str = r#"
[pipeline]
name = "noisy"
image = "busybox"

[[stage]]
name = "noisy"
key = "noisy-v1"
run = ["head -c 2147483648 /dev/zero; echo; echo the last line"]
"#;

/// What a host process may grow to while 2 GiB of stage output pass through.
const RSS_BOUND: u64 = 256 << 20;

#[test]
fn a_stage_printing_2_gib_leaves_the_orchestrator_small_and_its_log_whole() {
    if skip("a_stage_printing_2_gib_leaves_the_orchestrator_small_and_its_log_whole") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", NOISY);
    // The orchestrator echoes stage output on stderr: 2 GiB nobody reads here.
    let (code, out, peak) = run_measured(home.command(&["pipeline", "run", &file]).stderr(Stdio::null()));
    let run = out.trim().to_string();
    assert_eq!(code, 0, "the run failed: {}", home.ok(&["pipeline", "show", &run]));
    eprintln!("cairn pipeline run: peak RSS {} MiB", peak >> 20);
    assert!(
        peak < RSS_BOUND,
        "the orchestrator grew to {} MiB passing 2 GiB of stage output",
        peak >> 20
    );
    // The log on disk holds every byte (a note would mark dropped ones).
    let log = home.path().join("runs").join(&run).join("noisy.log");
    let size = std::fs::metadata(&log).unwrap().len();
    assert_eq!(
        size,
        (2 << 30) + "\nthe last line\n".len() as u64,
        "the log lost output"
    );
    // Its tail reads back without reading the log into memory.
    let (code, tail, peak) = run_measured(&mut home.command(&["logs", &run, "noisy", "--tail", "1"]));
    assert_eq!(code, 0);
    assert_eq!(tail, "the last line\n");
    eprintln!("cairn logs --tail 1: peak RSS {} MiB", peak >> 20);
    assert!(
        peak < RSS_BOUND,
        "cairn logs grew to {} MiB printing the tail of a 2 GiB log",
        peak >> 20
    );
}

const BIG_METRIC: &str = r#"
[pipeline]
name = "big-metric"
image = "busybox"

[[stage]]
name = "pick"
key = "pick-{hypothesis}"
run = ["mkdir -p /work && { echo {hypothesis.value}; head -c {hypothesis.filler} /dev/zero; } > /work/metric"]
[stage.branches]
select = "min"
metric = "file:/work/metric"
hypotheses = [
  { name = "huge", value = "1", filler = "2097152" },
  { name = "small", value = "5", filler = "0" },
]
"#;

#[test]
fn a_metric_file_above_1_mib_fails_its_branch_with_a_clear_error() {
    if skip("a_metric_file_above_1_mib_fails_its_branch_with_a_clear_error") {
        return;
    }
    let home = Home::new();
    let file = write(&home, "p.toml", BIG_METRIC);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, stdout(&out).trim());
    let won = events(&v, "won");
    assert_eq!(won.len(), 1);
    assert!(
        won[0]["detail"].as_str().unwrap().starts_with("small"),
        "{}",
        won[0]["detail"]
    );
    let huge = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "pick" && s["branch"] == "huge")
        .unwrap();
    assert_eq!(huge["status"], "dead", "{huge}");
    let error = huge["error"].as_str().unwrap();
    assert!(
        error.contains("/work/metric") && error.contains("1 MiB") && error.contains("artifact"),
        "the error does not say what is wrong and what to do: {error}"
    );
}

#[test]
fn checkpoints_keep_within_their_share_of_the_stage_however_often_they_are_asked_for() {
    if skip("checkpoints_keep_within_their_share_of_the_stage_however_often_they_are_asked_for") {
        return;
    }
    let home = Home::new();
    // Asked for every 20 ms: the bound, not the interval, sets the pace. The
    // stage runs until the test has seen three checkpoints.
    let file = write(
        &home,
        "p.toml",
        r#"
[pipeline]
name = "shared"
image = "busybox"

[[stage]]
name = "busy"
key = "busy-v1"
checkpoint_every = "20ms"
checkpoint_share = "10%"
run = [
  "mkdir -p /work; for i in $(seq 1 8); do dd if=/dev/urandom of=/work/f$i bs=64k count=1 2>/dev/null; done",
  "i=0; while [ ! -e /work/done ]; do i=$((i+1)); echo $i > /work/tick; sleep 0.05; done",
]
"#,
    );
    let child = home
        .command(&["pipeline", "run", &file])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    let run = loop {
        let runs: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
        if let Some(id) = runs[0]["id"].as_str() {
            let v = show(&home, id);
            if events(&v, "checkpoint").len() >= 3 {
                let sandbox = v["stages"][0]["sandbox_id"].as_str().unwrap().to_string();
                home.ok(&["exec", &sandbox, "--", "touch", "/work/done"]);
                break id.to_string();
            }
        }
        assert!(std::time::Instant::now() < deadline, "three checkpoints never came");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    let checkpoints = events(&v, "checkpoint");
    // Each checkpoint's event says what it took; the next came at least
    // nine times that later (10%: 90 to 10).
    let took = |e: &serde_json::Value| -> i64 {
        let d = e["detail"].as_str().unwrap();
        assert!(d.contains("(at most 10%)"), "{d}");
        d.split("took ")
            .nth(1)
            .and_then(|r| r.split(" ms").next())
            .and_then(|n| n.parse().ok())
            .unwrap()
    };
    for pair in checkpoints.windows(2) {
        let gap = pair[1]["created_at"].as_i64().unwrap() - pair[0]["created_at"].as_i64().unwrap();
        assert!(
            gap >= 9 * took(pair[0]),
            "checkpoints {gap} ms apart after one that took {} ms: {checkpoints:?}",
            took(pair[0])
        );
    }
}

#[test]
fn keep_winners_collects_losing_branches_at_gc_and_keeps_their_records() {
    if skip("keep_winners_collects_losing_branches_at_gc_and_keeps_their_records") {
        return;
    }
    let home = Home::new();
    let text = branches("max", "metric = \"output\"").replace(
        "image = \"busybox\"",
        "image = \"busybox\"\nkeep = \"winners\"\nkeep_losers_for = \"1h\"",
    );
    let later = write(&home, "later.toml", &text);
    // Its own stage keys: a run reusing the first run's branches would
    // share their snapshots, which the first run's rows keep.
    let now = write(
        &home,
        "now.toml",
        &text
            .replace("keep_losers_for = \"1h\"", "")
            .replace("pick-{hypothesis}", "pick-now-{hypothesis}"),
    );
    // Within the hour nothing goes.
    let out = home.cairn(&["pipeline", "run", &later]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first = stdout(&out).trim().to_string();
    let gc: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    assert_eq!(gc["losers_collected"], serde_json::json!([]), "{gc}");

    // keep = "winners" alone: the losers go at the next gc after the run.
    let out = home.cairn(&["pipeline", "run", &now]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    let rows: Vec<serde_json::Value> = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["stage"] == "pick")
        .cloned()
        .collect();
    let group = rows.iter().find(|s| s["branch"] == "").unwrap();
    let winner_out = group["output_snapshot"].as_str().unwrap().to_string();
    let losers: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|s| s["branch"] != "" && s["output_snapshot"] != group["output_snapshot"])
        .collect();
    assert_eq!(losers.len(), 2);
    let gc: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    let collected = gc["losers_collected"].as_array().unwrap();
    assert_eq!(collected.len(), 2, "{gc}");
    assert!(
        collected.iter().all(|c| c["run_id"] == run.as_str()),
        "only the run past its deadline: {gc}"
    );
    let snaps = home.ok(&["snapshots", "--json"]);
    for l in &losers {
        let gone = l["output_snapshot"].as_str().unwrap();
        assert!(!snaps.contains(gone), "the loser's output {gone} stayed");
    }
    assert!(snaps.contains(&winner_out), "the winner's output went");
    // The winner is whole and restores; the losers' records stay, with why.
    let sb = home.ok(&["restore", &winner_out]);
    assert_eq!(home.ok(&["exec", &sb, "--", "cat", "/work/value"]), "9");
    let v = show(&home, &run);
    assert_eq!(events(&v, "lost").len(), 2);
    let col = events(&v, "collected");
    assert_eq!(col.len(), 2, "{v}");
    assert!(col.iter().all(|e| e["data"]["kept_for_secs"] == 0));
    let loser = losers[0]["branch"].as_str().unwrap();
    let out = home.cairn(&["diff", &format!("{run}/pick.slow-high"), &format!("{run}/pick.{loser}")]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("collected"), "{}", stderr(&out));
    // A second gc finds nothing more, and the first run keeps its losers.
    let gc: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    assert_eq!(gc["losers_collected"], serde_json::json!([]), "{gc}");
    let first_rows = show(&home, &first);
    for s in first_rows["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["branch"] != "")
    {
        let out = s["output_snapshot"].as_str().unwrap();
        home.ok(&["snapshot", "show", out]);
    }
}

#[test]
fn a_retention_that_does_not_parse_is_refused_naming_its_line() {
    if skip("a_retention_that_does_not_parse_is_refused_naming_its_line") {
        return;
    }
    let home = Home::new();
    for (extra, said) in [
        ("keep = \"some\"", "keep = \"some\" is not one of"),
        ("keep_losers_for = \"1h\"", "keep_losers_for needs keep = \"winners\""),
        ("keep = \"winners\"\nkeep_losers_for = \"soon\"", "is not a duration"),
    ] {
        let text = branches("max", "metric = \"output\"")
            .replace("image = \"busybox\"", &format!("image = \"busybox\"\n{extra}"));
        let file = write(&home, "p.toml", &text);
        let out = home.cairn(&["pipeline", "run", &file]);
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains(said) && stderr(&out).contains("p.toml:"),
            "{extra}: {}",
            stderr(&out)
        );
    }
    assert!(home.ps().is_empty());
}
